# SPDX-License-Identifier: MIT
"""Per-call host overhead of weft's Python layers, against weft's C++ call loop and torch.distributed (NCCL).

    python3 -m torch.distributed.run --standalone --nproc_per_node=2 bench/python/bench_overhead.py \
        [--sizes 8,16384] [--iters 300] [--warmup 50] [--json out.json]

For each message size (bytes of f32 per rank), all-reduce through:
    cpp         _weft.time_all_reduce_calls: the C++ op called in a C++ loop (no Python between calls), in place
    cpp out     the same into a second tensor (what weft.all_reduce(x, out) and the custom op run)
    binding     _weft.all_reduce with views and stream made once (one nanobind call per op)
    weft        weft.all_reduce(x) (torch tensor checks, current stream), in place
    weft out    weft.all_reduce(x, out)
    torch.ops   torch.ops.weft.all_reduce(x) (the custom op: dispatcher, output allocation, weft.all_reduce(x, out))
    nccl        torch.distributed.all_reduce(x)
Eager: host µs per call = host time of `iters` back-to-back calls / iters (iters stays below the launch queue's
depth, about a thousand pending launches, so the host never waits for the GPU), and device µs per call from CUDA
events around the same loop (the larger of the two bounds a small message).
Graph: the same calls captured once in a CUDA graph and replayed (host cost of one replay / iters, device µs
per call). Every rank measures; rank 0 prints the table (the slowest rank's figure for each cell) and writes JSON.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from graph_timing import captured, warmed_up

import weft
import weft.torch  # noqa: F401  (torch.ops.weft)
from weft import _weft


def measure(fn, iters, warmup):
    warmed_up(fn, warmup)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    return host / iters * 1e6, start.elapsed_time(end) / iters * 1e3


def measure_graph(fn, iters, warmup):
    graph = captured(fn, iters, warmup)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    graph.replay()
    host = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    return host / iters * 1e6, start.elapsed_time(end) / iters * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="8,16384", help="bytes per rank, comma-separated")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--graph-iters", type=int, default=200, help="calls captured in one CUDA graph")
    p.add_argument("--json", default="")
    args = p.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world = weft.init()
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        numel = max(size // 4, 1)
        x = torch.zeros(numel, device="cuda")  # stays zero under repeated in-place sums
        y = torch.zeros_like(x)
        view = weft.TensorView(x.data_ptr(), _weft.DTYPES["f32"], (numel,))
        out_view = weft.TensorView(y.data_ptr(), _weft.DTYPES["f32"], (numel,))
        stream = torch.cuda.current_stream().cuda_stream

        def binding():
            _weft.all_reduce(world, view, view, stream)

        paths = {
            "binding": binding,
            "weft": lambda: weft.all_reduce(x),
            "weft out": lambda: weft.all_reduce(x, y),
            "torch.ops": lambda: torch.ops.weft.all_reduce(x),
            "nccl": lambda: dist.all_reduce(x),
        }
        binding()
        torch.cuda.synchronize()
        dist.barrier()
        for name, out in (("cpp", view), ("cpp out", out_view)):
            host_s = _weft.time_all_reduce_calls(world, view, out, stream, args.iters)
            torch.cuda.synchronize()
            rows.append({"bytes": numel * 4, "path": name, "mode": "eager", "host_us": host_s / args.iters * 1e6,
                         "device_us": float("nan")})
        for name, fn in paths.items():
            h, d = measure(fn, args.iters, args.warmup)
            rows.append({"bytes": numel * 4, "path": name, "mode": "eager", "host_us": h, "device_us": d})
        for name, fn in paths.items():
            if name == "binding":
                continue  # the same launches as "weft" once captured
            h, d = measure_graph(fn, args.graph_iters, 3)
            rows.append({"bytes": numel * 4, "path": name, "mode": "graph", "host_us": h, "device_us": d})

    # The slowest rank's figure for every cell.
    worst = torch.tensor([[r["host_us"], r["device_us"]] for r in rows], device="cuda", dtype=torch.float64)
    worst = torch.nan_to_num(worst, nan=-1.0)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    for r, (h, d) in zip(rows, worst.tolist()):
        r["host_us"], r["device_us"] = h, (d if d >= 0 else None)
    if world.rank == 0:
        print(f"all_reduce per-call overhead, {world.num_ranks} ranks, f32 (slowest rank)")
        print(f"{'bytes':>8} {'mode':>6} {'path':>10} {'host us/call':>13} {'device us/call':>15}")
        for r in rows:
            dev = f"{r['device_us']:.2f}" if r["device_us"] is not None else "-"
            print(f"{r['bytes']:>8} {r['mode']:>6} {r['path']:>10} {r['host_us']:>13.2f} {dev:>15}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bench": "python_overhead", "num_ranks": world.num_ranks, "rows": rows}, f, indent=1)
    weft.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
