# SPDX-License-Identifier: MIT
"""What the Python benchmarks share before they time (bench_overhead.py, bench_mlp.py import it from their folder)."""
import torch
import torch.distributed as dist


def warmed_up(fn, warmup):
    """`warmup` calls of fn, the device synchronised, every rank past a barrier: ready for a timed loop."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()


def captured(fn, iters, warmup):
    """`iters` calls of fn captured in one CUDA graph, after `warmup` calls on a side stream (what capture needs),
    replayed once and synchronised, every rank past a barrier: ready to be timed by the caller's replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    return graph
