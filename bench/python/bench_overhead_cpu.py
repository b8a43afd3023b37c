# SPDX-License-Identifier: MIT
"""CPU-side proxy of bench_overhead.py: the Python cost per call of weft's wrappers, measured without a GPU.

    python3 bench/python/bench_overhead_cpu.py [--iters 100000] [--repeat 5] [--json out.json]

Needs torch (any build) and weft installed; no GPU, no World. What stands in for what the machine lacks:
    World       a stand-in (rank 0 of 2) whose device, for the wrappers' checks, is the CPU
    tensors     plain CPU tensors: every attribute the wrappers read is torch's own
    team        a stand-in weft.Team of rank 0 alone (a C++ team of one)
    extension   _weft's op calls (all_reduce_flat, all_gather_flat, reduce_scatter_flat, gemm, AgGemm.run) are a
                Python no-op, about the cost of the real binding call (0.2-0.4 µs on the H200 host,
                docs/performance.md); the AgGemm weft.ag_gemm caches is a stand-in with that run
    stream      torch's current-stream lookup is a stub: the figures leave it out (bench_overhead.py measures the
                whole call on a GPU)
torch.ops.weft.all_reduce runs the custom op through torch's dispatcher with its CUDA kernel registered for CPU too
(output allocation, weft.all_reduce(x, out) inside). µs per call = the fastest of `repeat` timings of `iters` calls.
"""
import argparse
import json
import timeit

import torch

import weft
import weft.torch  # noqa: F401  (torch.ops.weft)
from weft import _runtime, _tensor, _weft


class _StandInWorld:
    rank, num_ranks, device = 0, 2, 0


class _StandInCppTeam:
    rank, num_ranks, is_member, id = 0, 1, True, "t0"


def _noop(*args, **kwargs):
    return None


class _StandInAgGemm:
    def __init__(self, world, max_m, *args, **kwargs):
        self.max_m = max_m

    run = staticmethod(_noop)


def _stand_in_state():
    """A World state as weft.init leaves it, with a team, whose ops reach no GPU: the extension's op calls and
    torch's stream lookup are no-ops, and the device the tensors are checked against is the CPU."""
    for name in ("all_reduce_flat", "all_gather_flat", "reduce_scatter_flat", "gemm"):
        setattr(_weft, name, _noop)
    _weft.AgGemm = _StandInAgGemm
    state = _runtime._State(_StandInWorld(), None, None)
    ctx = state.call_context = _tensor.CallContext(state.world)
    ctx.device = torch.device("cpu")
    ctx.stream = lambda device: 0
    team = object.__new__(_runtime.Team)  # as Team.__init__ leaves a team of rank 0 alone
    team._team = team._cpp = _StandInCppTeam()
    team._is_member, team._id, team.ranks, team.handle = True, "t0", [0], 0
    state.teams.append(team)
    return state, team


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=100000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", default="")
    args = p.parse_args()

    _runtime._state, team = _stand_in_state()
    weft.torch._lib.impl("all_reduce", weft.torch._all_reduce, "CPU")
    x, y, gathered, scattered = torch.zeros(4), torch.zeros(4), torch.zeros(8), torch.zeros(2)
    a, b, c = (torch.zeros(16, 16, dtype=torch.bfloat16) for _ in range(3))
    gemm_out = torch.zeros(32, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        x_inference = torch.zeros(4)  # no autograd key: the dispatcher skips the custom op's autograd kernel
    paths = {
        "weft.all_reduce(x)": lambda: weft.all_reduce(x),
        "weft.all_reduce(x, out)": lambda: weft.all_reduce(x, y),
        "weft.all_reduce(x, team=)": lambda: weft.all_reduce(x, team=team),
        "weft.all_gather(x, out)": lambda: weft.all_gather(x, gathered),
        "weft.reduce_scatter(x, out)": lambda: weft.reduce_scatter(x, scattered),
        "weft.gemm(a, b, out)": lambda: weft.gemm(a, b, c),
        "weft.ag_gemm(a, b, out)": lambda: weft.ag_gemm(a, b, gemm_out),
        "torch.ops.weft.all_reduce(x)": lambda: torch.ops.weft.all_reduce(x),
        "torch.ops.weft.all_reduce(inference x)": lambda: torch.ops.weft.all_reduce(x_inference),
        "floor: the no-op in place of the binding": lambda: _noop(1, 2, 3, 4, 5, 6, 7, 8),
    }
    rows = []
    for name, fn in paths.items():
        fn()  # fills the per-World caches
        rows.append((name, min(timeit.repeat(fn, number=args.iters, repeat=args.repeat)) / args.iters * 1e6))
    _runtime._state = None

    print(f"weft Python wrappers, CPU-side proxy (torch {torch.__version__}): µs per call, {args.iters} calls, "
          f"fastest of {args.repeat}")
    for name, us in rows:
        print(f"{name:42s} {us:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "python_overhead_cpu", "torch": torch.__version__,
                       "rows": [{"path": n, "us": us} for n, us in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
