# SPDX-License-Identifier: MIT
"""A job's shape: torch.distributed (NCCL backend) first, then a weft World on torch's store, a TP team of two
inside it, and weft's collectives checked against values each rank computes itself.

    python3 -m torch.distributed.run --standalone --nproc_per_node=4 python/tests/launch/nccl_then_weft.py

Ranks may share a GPU: NCCL refuses two ranks of one communicator on one GPU, so with fewer GPUs than ranks the
process group is initialised without a device (NCCL makes no communicator until a collective runs) and only weft
moves data; with a GPU per rank NCCL all-reduces the same tensor and the results must agree. Exits 0 when every
check passes on this rank.
"""
import os
import sys

import torch
import torch.distributed as dist

import weft


def check(ok, what, failures):
    if not ok:
        failures.append(what)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpu_per_rank = torch.cuda.device_count() >= local_world
    device = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    if gpu_per_rank:
        dist.init_process_group("nccl", device_id=torch.device("cuda", device))
    else:
        dist.init_process_group("nccl")  # lazy: no communicator, no NCCL traffic
    world = weft.init()
    rank, n = world.rank, world.num_ranks
    assert rank == dist.get_rank() and n == dist.get_world_size(), "weft's World follows torch's ranks"
    failures = []

    # The World: all-reduce (in place, on the heap and off it) and all-gather of odd sizes.
    for numel in (1, 1000, 65537):
        x = weft.empty((numel,), torch.float32)
        x.copy_(torch.arange(numel, device="cuda", dtype=torch.float32) * (rank + 1))
        weft.all_reduce(x)
        want = torch.arange(numel, device="cuda", dtype=torch.float32) * (n * (n + 1) / 2)
        torch.cuda.synchronize()
        check(torch.equal(x, want), f"world all_reduce of {numel} f32", failures)
        if gpu_per_rank:
            y = torch.arange(numel, device="cuda", dtype=torch.float32) * (rank + 1)
            dist.all_reduce(y)
            check(torch.equal(x, y), f"weft and NCCL all_reduce of {numel} f32 agree", failures)
        weft.free(x)
        g = weft.all_gather(torch.full((numel,), rank, device="cuda", dtype=torch.int32))
        torch.cuda.synchronize()
        want_g = torch.arange(n, device="cuda", dtype=torch.int32).repeat_interleave(numel)
        check(torch.equal(g, want_g), f"world all_gather of {numel} i32", failures)

    # A TP team of two inside the World (the last rank alone when n is odd), as a torch group and as a weft.Team.
    groups = [list(range(i, min(i + 2, n))) for i in range(0, n, 2)]
    torch_groups = [dist.new_group(g) for g in groups]  # every rank makes every group, in the same order
    mine = next(i for i, g in enumerate(groups) if rank in g)
    teams = [weft.Team(torch_groups[i]) for i in range(len(groups))]
    team = teams[mine]
    check(team.is_member and team.ranks == groups[mine], f"team of {groups[mine]}", failures)
    t = torch.full((4097,), float(rank + 1), device="cuda", dtype=torch.bfloat16)
    weft.all_reduce(t, team=team)
    torch.cuda.synchronize()
    check(bool(torch.all(t == float(sum(r + 1 for r in groups[mine])))), "team all_reduce of 4097 bf16", failures)

    print(f"rank {rank}/{n} ({'one GPU per rank, NCCL checked' if gpu_per_rank else 'ranks share a GPU'}): "
          f"{'OK' if not failures else 'FAILED: ' + '; '.join(failures)}", flush=True)
    weft.finalize()
    dist.destroy_process_group()
    sys.exit(0 if not failures else 1)


if __name__ == "__main__":
    main()
