# SPDX-License-Identifier: MIT
"""The Python benchmarks' CUDA-graph capture (bench_overhead.py, bench_mlp.py import it from their own folder)."""
import torch
import torch.distributed as dist


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
