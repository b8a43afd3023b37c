# SPDX-License-Identifier: MIT
"""Forward time of weft.nn.TensorParallelMLP beside the same block built from torch.matmul and torch.distributed.

    python3 -m torch.distributed.run --standalone --nproc_per_node=8 bench/python/bench_mlp.py \
        [--m 8192] [--hidden 4096] [--ffn 14336] [--dtype bf16] [--iters 20] [--warmup 5] [--graph] [--json out.json]
    python3 bench/python/bench_mlp.py                 # a world of one rank (smoke run: the collectives are copies)

Both blocks hold the same weights (the baseline reads the weft block's own shards) and compute on every rank
    weft   y_local = GemmRs(act(AgGemm(x_local, w1)), w2)                      weft.nn.TensorParallelMLP.forward
    torch  y_local = reduce_scatter_tensor(act(all_gather_into_tensor(x_local) @ w1.T) @ w2.T)
with x_local [M/W, hidden], w1 [ffn/W, hidden], w2 [hidden, ffn/W] and act the block's activation (gelu). Before
timing, every rank compares the two outputs (relative Frobenius error below --tol on every rank, else the run
stops). Times: device ms per forward from CUDA events around `iters` back-to-back forwards under torch.no_grad, the
input rotating over --rotate buffers; --graph adds the same forwards captured in one CUDA graph and replayed.
Every rank measures; rank 0 prints the slowest rank's figures and writes JSON.

torch.distributed runs on NCCL, one GPU per rank. `--backend gloo` (default: $WEFT_TEST_TORCH_BACKEND, else nccl)
lets ranks share a GPU: the baseline's collectives then go through gloo's host staging, if this torch's gloo runs
all_gather_into_tensor and reduce_scatter_tensor on CUDA tensors of the dtype (tried once first; the bench stops
with torch's message if not). Such times only show that the bench runs; --graph is refused there (gloo's
collectives cannot be captured).
"""
import argparse
import itertools
import json
import os

import torch
import torch.distributed as dist
from graph_timing import captured, warmed_up

import weft
import weft.nn

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}


def fail(message):
    raise SystemExit(f"bench_mlp: {message}")


def init_distributed(backend):
    """torch.distributed (torchrun's ranks, or a world of one on an in-process store), then weft's World on it."""
    if not torch.cuda.is_available():
        fail("expected a CUDA GPU, found none")
    num_local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if backend == "nccl" and torch.cuda.device_count() < num_local:
        fail(f"NCCL needs one GPU per rank: expected {num_local} GPUs on this node, found "
             f"{torch.cuda.device_count()} (--backend gloo lets ranks share a GPU, for a functional run only)")
    device = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(device)
    kwargs = {"device_id": torch.device("cuda", device)} if backend == "nccl" else {}
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, **kwargs)
    else:  # plain `python3 bench_mlp.py`: no launcher, no port
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)


def check_gloo_collectives(dtype):
    """Stops the run, on every rank alike, when this torch's gloo cannot run the baseline's collectives on CUDA."""
    part = torch.ones((8, 8), dtype=dtype, device="cuda")
    full = torch.ones((8 * dist.get_world_size(), 8), dtype=dtype, device="cuda")
    for name, call in (("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(full, part)),
                       ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(part, full))):
        try:
            call()
        except (RuntimeError, ValueError) as e:
            fail(f"the baseline needs dist.{name} on CUDA {dtype} tensors, and the gloo backend of torch "
                 f"{torch.__version__} refused it ({e}); run with one GPU per rank on NCCL")
    torch.cuda.synchronize()


def torch_block(mlp, m_local):
    """The baseline forward on the weft block's own weights and activation: a function of x_local."""
    gathered = torch.empty((m_local * mlp.num_ranks, mlp.hidden), dtype=mlp.w1.dtype, device=mlp.w1.device)
    out = torch.empty((m_local, mlp.hidden), dtype=mlp.w1.dtype, device=mlp.w1.device)

    def forward(x_local):
        dist.all_gather_into_tensor(gathered, x_local)
        h = mlp.activation(torch.matmul(gathered, mlp.w1.t()))
        dist.reduce_scatter_tensor(out, torch.matmul(h, mlp.w2.t()))
        return out

    return forward


def rotating(forward, inputs):
    """A call of `forward` on the next input buffer (keeps the previous call's input out of L2)."""
    cycle = itertools.cycle(inputs)
    return lambda: forward(next(cycle))


def rel_error(actual, expected):
    """Relative Frobenius error; infinite when the reference is all zero (a check that cannot pass vacuously)."""
    actual, expected = actual.double(), expected.double()
    norm = expected.norm()
    if norm.item() == 0.0:
        return float("inf")
    return ((actual - expected).norm() / norm).item()


def stop_unless_outputs_agree(bench, actual, expected, tol, rank):
    """The worst rank's relative error between weft's output and the baseline's; when it is above `tol` (or NaN) every
    rank stops the run (rank 0 says why) before anything is timed."""
    err = torch.tensor([rel_error(actual, expected)], dtype=torch.float64, device="cuda")
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    err = err.item()
    if not err <= tol:  # also catches NaN
        if rank == 0:
            print(f"{bench}: weft and the torch baseline disagree: relative error {err:.3g} on the worst rank, "
                  f"expected at most {tol:g}; nothing timed")
        weft.finalize()
        dist.destroy_process_group()
        raise SystemExit(1)
    return err


def measure(fn, iters, warmup):
    """Device ms per call of `iters` back-to-back calls."""
    warmed_up(fn, warmup)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def measure_graph(fn, iters, warmup):
    """Device ms per call of `iters` calls captured in one CUDA graph, from one replay."""
    graph = captured(fn, iters, warmup)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) / iters


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--m", type=int, default=8192, help="tokens over all ranks (M/W per rank)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336, help="ffn_hidden over all ranks (ffn/W per rank)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--iters", type=int, default=20, help="timed forwards (eager loop, or calls in one graph)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rotate", type=int, default=4, help="input buffers cycled through")
    p.add_argument("--tol", type=float, default=3e-2, help="largest relative error between the two outputs")
    p.add_argument("--graph", action="store_true", help="also time both blocks replayed from a CUDA graph")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=os.environ.get("WEFT_TEST_TORCH_BACKEND", "nccl"))
    p.add_argument("--json", default="")
    args = p.parse_args()
    if args.iters < 1 or args.warmup < 0 or args.rotate < 1:
        fail(f"expected --iters >= 1, --warmup >= 0, --rotate >= 1, got {args.iters}, {args.warmup}, {args.rotate}")
    if args.backend not in ("nccl", "gloo"):  # argparse does not check a default taken from the environment
        fail(f"--backend / WEFT_TEST_TORCH_BACKEND: expected nccl or gloo, got {args.backend!r}")
    if args.graph and args.backend == "gloo":
        fail("--graph: gloo's collectives cannot be captured in a CUDA graph; run on NCCL (one GPU per rank)")
    dtype = DTYPES[args.dtype]

    init_distributed(args.backend)
    if args.backend == "gloo":
        check_gloo_collectives(dtype)
    world = weft.init()
    num_ranks, rank = world.num_ranks, world.rank
    if args.m % num_ranks != 0:
        fail(f"--m: expected a multiple of the {num_ranks} ranks, got {args.m}")
    m_local = args.m // num_ranks

    torch.manual_seed(0)
    mlp = weft.nn.TensorParallelMLP(args.hidden, args.ffn, dtype=dtype)
    gen = torch.Generator(device="cuda").manual_seed(1 + rank)  # each rank its own tokens
    inputs = [torch.randn((m_local, args.hidden), dtype=dtype, device="cuda", generator=gen)
              for _ in range(args.rotate)]
    baseline = torch_block(mlp, m_local)
    activation = getattr(mlp.activation, "__name__", repr(mlp.activation))

    with torch.no_grad():
        y_weft = mlp(inputs[0]).clone()
        y_torch = baseline(inputs[0]).clone()
        err = stop_unless_outputs_agree("bench_mlp", y_weft, y_torch, args.tol, rank)

        paths = {"weft": rotating(mlp, inputs), "torch": rotating(baseline, inputs)}
        times = [[measure(fn, args.iters, args.warmup) for fn in paths.values()]]
        modes = ["eager"]
        if args.graph:
            times.append([measure_graph(fn, args.iters, args.warmup) for fn in paths.values()])
            modes.append("graph")

    # The slowest rank's figure for every cell.
    worst = torch.tensor(times, dtype=torch.float64, device="cuda")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    flops = 4.0 * args.m * args.hidden * args.ffn / num_ranks  # two GEMMs per rank
    rows = [{"mode": mode, "weft_ms": w, "torch_ms": t, "torch_over_weft": t / w,
             "weft_tflops": flops / (w * 1e9), "torch_tflops": flops / (t * 1e9)}
            for mode, (w, t) in zip(modes, worst.tolist())]
    if rank == 0:
        print(f"TP MLP forward, {num_ranks} rank(s), {args.dtype}, torch.distributed on {args.backend}: "
              f"x [{args.m}, {args.hidden}] ({m_local} tokens per rank), w1 [{args.ffn}, {args.hidden}], "
              f"w2 [{args.hidden}, {args.ffn}] (ffn {args.ffn // num_ranks} per rank), {activation}")
        print(f"outputs agree: relative error {err:.2e} (worst rank, tolerance {args.tol:g}); "
              f"ms per forward, slowest rank; TFLOP/s per GPU")
        print(f"{'mode':>6} {'weft ms':>9} {'torch ms':>9} {'torch/weft':>11} {'weft TFLOP/s':>13} "
              f"{'torch TFLOP/s':>14}")
        for r in rows:
            print(f"{r['mode']:>6} {r['weft_ms']:>9.3f} {r['torch_ms']:>9.3f} {r['torch_over_weft']:>11.2f} "
                  f"{r['weft_tflops']:>13.1f} {r['torch_tflops']:>14.1f}")
        if args.backend == "gloo":
            print("(gloo: ranks may share a GPU and the baseline's collectives go through the host: "
                  "not a performance figure)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bench": "tp_mlp_forward", "num_ranks": num_ranks, "dtype": args.dtype,
                           "backend": args.backend, "m": args.m, "hidden": args.hidden, "ffn": args.ffn,
                           "activation": activation, "iters": args.iters, "rel_error": err, "rows": rows},
                          f, indent=1)
    weft.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
