# SPDX-License-Identifier: MIT
"""Forward time of weft's tensor-parallel MoE FFN beside the same layer built from torch and torch.distributed.

    python3 -m torch.distributed.run --standalone --nproc_per_node=8 bench/python/bench_moe.py \
        [--m 8192] [--hidden 4096] [--ffn 14336] [--experts 8] [--topk 2] [--iters 20] [--warmup 5] [--json out.json]
    python3 bench/python/bench_moe.py                 # a world of one rank (smoke run: the collectives are copies)

Both layers hold the same weights (each rank the ffn / W columns of every expert) and the same replicated routing,
and compute on every rank
    weft   out_local = MoeGroupedGemmRs(silu(MoeAgGroupedGemm(x_local, topk_idx, w_up)), w_down, routing, weights)
    torch  x = all_gather_into_tensor(x_local); the slots sorted by expert (argsort), one torch.matmul per expert
           (counts read on the host), silu, one per expert again, the weighted slots summed per token (index_add_),
           out_local = reduce_scatter_tensor(that)
with x_local [M/W, hidden], w_up [E, ffn/W, hidden], w_down [E, hidden, ffn/W], bf16 (the torch layer's reduction in
bf16, weft's in fp32). Defaults: Mixtral-like (8 experts, top-2); --experts 64 --topk 6 --hidden 2048 --ffn 1408 is
DeepSeek-like. Before timing, every rank compares the two outputs (relative Frobenius error below --tol on every
rank, else the run stops). Times: device ms per forward from CUDA events around `iters` back-to-back forwards; every
rank measures, rank 0 prints the slowest rank's figures. torch.distributed on NCCL, one GPU per rank (--backend
gloo lets ranks share a GPU: such times only show that the bench runs).
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_mlp import check_gloo_collectives, init_distributed, measure, stop_unless_outputs_agree

import weft


def fail(message):
    raise SystemExit(f"bench_moe: {message}")


def torch_layer(x_local, idx, weights, w_up, w_down, num_ranks):
    """The baseline forward: a function of nothing (its inputs fixed), returning this rank's output rows."""
    m_local, hidden = x_local.shape
    experts, topk = w_up.shape[0], idx.shape[1]
    gathered = torch.empty((m_local * num_ranks, hidden), dtype=x_local.dtype, device=x_local.device)
    out = torch.empty((m_local, hidden), dtype=x_local.dtype, device=x_local.device)

    def forward():
        dist.all_gather_into_tensor(gathered, x_local)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        order = order[flat[order] >= 0]
        counts = torch.bincount(flat[order].long(), minlength=experts).tolist()  # the host reads the counts
        rows = gathered[order // topk]
        y = torch.empty((rows.shape[0], hidden), dtype=rows.dtype, device=rows.device)
        first = 0
        for e, count in enumerate(counts):
            if count:
                part = slice(first, first + count)
                y[part] = torch.matmul(F.silu(torch.matmul(rows[part], w_up[e].t())), w_down[e].t())
                first += count
        summed = torch.zeros_like(gathered)
        summed.index_add_(0, order // topk, y * weights.reshape(-1)[order].unsqueeze(1).to(y.dtype))
        dist.reduce_scatter_tensor(out, summed)
        return out

    return forward


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--m", type=int, default=8192, help="tokens over all ranks (M/W per rank)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336, help="each expert's ffn over all ranks (ffn/W per rank)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--tol", type=float, default=3e-2, help="largest relative error between the two outputs")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=os.environ.get("WEFT_TEST_TORCH_BACKEND", "nccl"))
    p.add_argument("--json", default="")
    args = p.parse_args()
    if args.iters < 1 or args.warmup < 0:
        fail(f"expected --iters >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    if args.backend not in ("nccl", "gloo"):
        fail(f"--backend / WEFT_TEST_TORCH_BACKEND: expected nccl or gloo, got {args.backend!r}")
    dtype = torch.bfloat16

    init_distributed(args.backend)
    if args.backend == "gloo":
        check_gloo_collectives(dtype)
    world = weft.init()
    num_ranks, rank = world.num_ranks, world.rank
    if args.m % num_ranks or args.ffn % (8 * num_ranks):
        fail(f"--m must be a multiple of the {num_ranks} ranks and --ffn of 8 x ranks, got {args.m} and {args.ffn}")
    m_local, ffn = args.m // num_ranks, args.ffn // num_ranks

    shared = torch.Generator(device="cuda").manual_seed(0)  # the routing and the weights: every rank alike
    scores = torch.rand((args.m, args.experts), generator=shared, device="cuda")
    idx = scores.topk(args.topk, dim=1).indices.to(torch.int32).contiguous()
    weights = torch.softmax(scores.gather(1, idx.long()), dim=1).contiguous()
    w_up = (torch.randn((args.experts, args.ffn, args.hidden), generator=shared, device="cuda") *
            args.hidden ** -0.5).to(dtype)
    w_down = (torch.randn((args.experts, args.hidden, args.ffn), generator=shared, device="cuda") *
              args.ffn ** -0.5).to(dtype)
    shard = slice(rank * ffn, (rank + 1) * ffn)
    w_up, w_down = w_up[:, shard].contiguous(), w_down[:, :, shard].contiguous()
    gen = torch.Generator(device="cuda").manual_seed(1 + rank)  # each rank its own tokens
    x_local = torch.randn((m_local, args.hidden), generator=gen, device="cuda").to(dtype)

    with weft.MoeAgGroupedGemm(args.m, args.hidden, ffn, args.experts, args.topk) as up, \
            weft.MoeGroupedGemmRs(args.m, args.hidden, ffn, args.experts, args.topk) as down:
        y = torch.empty((up.rows_capacity, ffn), dtype=dtype, device="cuda")
        out = torch.empty((m_local, args.hidden), dtype=dtype, device="cuda")

        def weft_layer():
            up.run(x_local, idx, w_up, y)
            return down.run(F.silu(y), w_down, up.routing, weights, out)

        baseline = torch_layer(x_local, idx, weights, w_up, w_down, num_ranks)
        err = stop_unless_outputs_agree("bench_moe", weft_layer().clone(), baseline().clone(), args.tol, rank)
        times = torch.tensor([measure(weft_layer, args.iters, args.warmup),
                              measure(baseline, args.iters, args.warmup)], dtype=torch.float64, device="cuda")
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    weft_ms, torch_ms = times.tolist()
    flops = 4.0 * args.m * args.topk * args.hidden * ffn  # two GEMMs per routed row, this rank's ffn columns
    row = {"m": args.m, "hidden": args.hidden, "ffn": args.ffn, "experts": args.experts, "topk": args.topk,
           "ranks": num_ranks, "weft_ms": weft_ms, "torch_ms": torch_ms, "torch_over_weft": torch_ms / weft_ms,
           "weft_tflops": flops / (weft_ms * 1e9), "relative_error": err}
    if rank == 0:
        print(f"TP MoE FFN forward, {num_ranks} rank(s), bf16, torch.distributed on {args.backend}: M {args.m} "
              f"({m_local} per rank), hidden {args.hidden}, ffn {args.ffn} ({ffn} per rank), {args.experts} experts, "
              f"top-{args.topk}; outputs agree: relative error {err:.2e} (worst rank); ms per forward, slowest rank")
        print(f"{'weft ms':>9} {'torch ms':>9} {'torch/weft':>11} {'weft TFLOP/s':>13}")
        print(f"{weft_ms:>9.3f} {torch_ms:>9.3f} {torch_ms / weft_ms:>11.2f} {row['weft_tflops']:>13.1f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bench": "bench_moe", "device": torch.cuda.get_device_name(), "results": [row]}, f,
                          indent=1)
    weft.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
