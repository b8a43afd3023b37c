#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Renders weft_bench_collectives --json output as the markdown table of docs/performance.md.

    tools/collectives_table.py collectives.json [--sizes 8,16384,1048576,...] [--date YYYY-MM-DD]

One row per (op, size, world): auto's choice and time, the best forced algorithm, NCCL (when it ran) and the
roofline; ratio = NCCL time / best weft time (> 1: weft faster). A result that failed the bench's check is
marked WRONG (and never counted as the best); a time the bench could not measure (null) prints as "-".
"""
import argparse
import json


def human(n):
    for unit, div in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return f"{n}B"


def parse_size(text):
    """Bytes of a size as the bench writes it: 4096, 16K, 1M, 2G (binary multiples)."""
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def num(x):
    """x to two decimals, or "-" for a null (a time or bandwidth the bench could not measure)."""
    return "-" if x is None else f"{x:.2f}"


def wrong_mark(row):
    return " WRONG" if row.get("correct") is False else ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--sizes", default="")
    ap.add_argument("--date", default="")
    args = ap.parse_args()
    data = json.load(open(args.json))
    keep = {parse_size(s) for s in args.sizes.split(",") if s}
    date = args.date or data.get("date", "")
    print("| op | size | world | auto (choice) µs | best weft µs (algo) | NCCL µs | roofline µs | NCCL/best | date |")
    print("|---|---|---|---|---|---|---|---|---|")
    for w in data["worlds"]:
        roof_bw = w.get("roofline_busbw_gbps") or 0.0
        groups = {}
        for r in w["rows"]:
            groups.setdefault((r["op"], r["size_bytes"]), []).append(r)
        for (op, size), rs in groups.items():
            if keep and size not in keep:
                continue
            auto = next((r for r in rs if r["algo"] == "auto"), None)
            nccl = next((r for r in rs if r["algo"] == "nccl"), None)
            forced = [r for r in rs if r["algo"] not in ("auto", "nccl")]
            if not forced:
                continue
            # The best weft time is the fastest measured, correct forced algorithm; the wrong ones are named beside it.
            weft = [r for r in forced if r.get("correct", True) and r.get("us") is not None]
            wrong = [r["algo"] for r in forced if r.get("correct") is False]
            best = min(weft, key=lambda r: r["us"]) if weft else None
            best_text = f"{best['us']:.2f} ({best['algo']})" if best else "-"
            if wrong:
                best_text += f" WRONG: {', '.join(wrong)}"
            roof = None
            if best and best.get("busbw_gbps") is not None and roof_bw > 0:
                bus_bytes = best["busbw_gbps"] * best["us"] * 1e3  # bytes the bus-bandwidth formula counts
                roof = bus_bytes / (roof_bw * 1e3)
            auto_text = f"{num(auto.get('us'))} ({auto.get('chosen', '?')}){wrong_mark(auto)}" if auto else "-"
            nccl_text = f"{num(nccl.get('us'))}{wrong_mark(nccl)}" if nccl else "n/a"
            ratio = f"{nccl['us'] / best['us']:.2f}" if nccl and nccl.get("us") is not None and best else "-"
            print(f"| {op} | {human(size)} | {w['world']} | {auto_text} | {best_text} | "
                  f"{nccl_text} | {num(roof)} | {ratio} | {date} |")


if __name__ == "__main__":
    main()
