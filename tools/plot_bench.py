#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Figures from the benchmarks' --json files (matplotlib; `pip install matplotlib`).

    python3 tools/plot_bench.py gemm.json collectives.json tp.json ep.json --out figures/

Each file is recognised by its "bench" field (bench/*/ write it):
  gemm             weft_bench_gemm: cuBLASLt time / weft time per shape (above 1: weft is faster)
  collectives      weft_bench_collectives: latency and bus bandwidth against message size, every algorithm and NCCL,
                   with the roofline, one figure per world size and op
  weft_bench_tp    weft_bench_tp: the fused op's speedup over cuBLAS then NCCL back to back (speedup_vs_a) and its
                   overlap efficiency (ideal / fused time), per op and shape
  ep               weft_bench_ep: dispatch and combine latency against tokens per rank, per mode and world size
  primitives       weft_bench_primitives: copy bandwidth against size with its roofline
Files of other benchmarks are skipped with a warning, so `plot_bench.py LOGDIR/*.json` works.
Writes one PNG per figure into --out and prints their paths.
"""

import argparse
import json
import os
import sys
from collections import defaultdict


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        sys.exit("plot_bench.py needs matplotlib: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _title(doc, what):
    device = doc.get("device") or doc.get("gpu") or ""
    date = doc.get("date", "")
    extra = ", ".join(x for x in (device, date) if x)
    return f"{what}\n({extra})" if extra else what  # two lines: long titles stay inside the figure


def _save(plt, fig, out_dir, name, written):
    path = os.path.join(out_dir, name + ".png")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    written.append(path)


def plot_gemm(doc, out_dir, stem, plt, written):
    rows = doc.get("results", [])
    # Rows the op picked by itself ("auto") when the bench also timed forced paths.
    if any(r.get("auto") for r in rows):
        rows = [r for r in rows if r.get("auto")]
    rows = [r for r in rows if r.get("ratio") is not None]
    if not rows:
        return
    labels = [f"{r['m']}x{r['n']}x{r['k']} {r.get('layout', '')}".strip() for r in rows]
    ratios = [r["ratio"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(rows) + 2), 4.5))
    colors = ["tab:green" if x >= 1.0 else "tab:red" for x in ratios]
    ax.bar(range(len(rows)), ratios, color=colors)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("cuBLASLt time / weft time")
    ax.set_title(_title(doc, f"GEMM {doc.get('in', '')}->{doc.get('out', '')}: ratio to cuBLASLt (>1: weft faster)"))
    _save(plt, fig, out_dir, f"{stem}_gemm_ratio", written)


def plot_collectives(doc, out_dir, stem, plt, written):
    for world in doc.get("worlds", []):
        w = world.get("world")
        by_op = defaultdict(lambda: defaultdict(list))
        for r in world.get("rows", []):
            if r.get("us") is None:
                continue
            # Rows timed as CUDA-graph replays are a series of their own.
            by_op[r["op"]][r["algo"] + (" (graph)" if r.get("graph") else "")].append(r)
        for op, algos in by_op.items():
            fig, (lat, bw) = plt.subplots(1, 2, figsize=(12, 4.5))
            for algo, rs in sorted(algos.items()):
                rs.sort(key=lambda r: r["size_bytes"])
                style = dict(linestyle="--", color="black") if algo.startswith("nccl") else {}
                sizes = [r["size_bytes"] for r in rs]
                lat.plot(sizes, [r["us"] for r in rs], marker="o", markersize=3, label=algo, **style)
                bw.plot(sizes, [r.get("busbw_gbps") for r in rs], marker="o", markersize=3, label=algo, **style)
            roof = world.get("roofline_busbw_gbps")
            if roof:
                bw.axhline(roof, color="gray", linestyle=":", label=f"roofline {roof:.0f} GB/s")
            for ax in (lat, bw):
                ax.set_xscale("log", base=2)
                ax.set_xlabel("message size (bytes)")
                ax.grid(True, which="both", alpha=0.3)
            lat.set_yscale("log")
            lat.set_ylabel("latency (us)")
            bw.set_ylabel("bus bandwidth (GB/s)")
            bw.legend(fontsize=7)
            fig.suptitle(_title(doc, f"{op}, {w} ranks: weft's algorithms and NCCL"))
            _save(plt, fig, out_dir, f"{stem}_{op}_w{w}", written)


def plot_tp(doc, out_dir, stem, plt, written):
    by_op = defaultdict(list)
    for r in doc.get("results", []):
        by_op[r["op"]].append(r)
    for op, rs in by_op.items():
        labels = [f"{r['m']}x{r['n']}x{r['k']} W{r['world']}" for r in rs]
        fig, (sp, eff) = plt.subplots(1, 2, figsize=(max(10, 0.6 * len(rs) + 4), 4.5))
        speedup = [r.get("speedup_vs_a") for r in rs]
        efficiency = [r.get("overlap_efficiency") for r in rs]
        x = range(len(rs))
        sp.bar(x, [s or 0 for s in speedup], color=["tab:green" if (s or 0) >= 1 else "tab:red" for s in speedup])
        sp.axhline(1.0, color="black", linewidth=1)
        sp.set_ylabel("speedup over cuBLAS + NCCL back to back")
        eff.bar(x, [e or 0 for e in efficiency], color="tab:blue")
        eff.axhline(1.0, color="black", linewidth=1)
        eff.set_ylabel("overlap efficiency (ideal / fused time)")
        for ax in (sp, eff):
            ax.set_xticks(list(x))
            ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
        baseline = doc.get("baseline_coll", "")
        fig.suptitle(_title(doc, f"fused {op} ({doc.get('dtype', '')}), baseline collective {baseline}"))
        _save(plt, fig, out_dir, f"{stem}_{op.replace('/', '_')}", written)


def plot_ep(doc, out_dir, stem, plt, written):
    by_world = defaultdict(lambda: defaultdict(list))
    for r in doc.get("results", []):
        if r.get("us") is None:
            continue
        by_world[r["world"]][(r["mode"], r["op"], r["dtype"])].append(r)
    for w, series in sorted(by_world.items()):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for (mode, op, dtype), rs in sorted(series.items()):
            rs.sort(key=lambda r: r["tokens"])
            ax.plot([r["tokens"] for r in rs], [r["us"] for r in rs], marker="o", markersize=3,
                    linestyle="-" if op == "dispatch" else "--", label=f"{mode} {op} {dtype}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("latency (us)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title(_title(doc, f"EP dispatch/combine, {w} ranks, hidden {doc.get('hidden')}, top-{doc.get('topk')}"))
        _save(plt, fig, out_dir, f"{stem}_ep_w{w}", written)


def plot_primitives(doc, out_dir, stem, plt, written):
    rows = sorted(doc.get("bandwidth_gbps", []), key=lambda r: r["bytes"])
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = [k for k in rows[0] if k not in ("bytes", "roofline", "roofline_get", "mismatches")]
    for k in keys:
        ax.plot([r["bytes"] for r in rows], [r.get(k) for r in rows], marker="o", markersize=3, label=k)
    ax.plot([r["bytes"] for r in rows], [r.get("roofline") for r in rows], color="gray", linestyle=":",
            label="roofline")
    if "roofline_get" in rows[0]:  # --placement spread: the copy in the gets' direction
        ax.plot([r["bytes"] for r in rows], [r.get("roofline_get") for r in rows], color="gray", linestyle="--",
                label="roofline (get)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes")
    ax.set_ylabel("GB/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(_title(doc, "primitives: copy bandwidth"))
    _save(plt, fig, out_dir, f"{stem}_bandwidth", written)


PLOTTERS = {
    "gemm": plot_gemm,
    "collectives": plot_collectives,
    "weft_bench_tp": plot_tp,
    "ep": plot_ep,
    "primitives": plot_primitives,
}


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="benchmark JSON files (--json of weft_bench_*)")
    parser.add_argument("--out", default="bench_figures", help="folder for the PNG files (default: bench_figures)")
    args = parser.parse_args(argv)
    plt = _pyplot()
    os.makedirs(args.out, exist_ok=True)
    written = []
    for path in args.files:
        with open(path) as f:
            doc = json.load(f)
        kind = doc.get("bench")
        if kind not in PLOTTERS:
            print(f"plot_bench.py: skipping {path}: no figure for benchmark '{kind}' (the \"bench\" field); "
                  f"known: {', '.join(PLOTTERS)}", file=sys.stderr)
            continue
        stem = os.path.splitext(os.path.basename(path))[0]
        PLOTTERS[kind](doc, args.out, stem, plt, written)
    for p in written:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
