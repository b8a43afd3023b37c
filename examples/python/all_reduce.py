# SPDX-License-Identifier: MIT
"""weft's all-reduce on torch tensors, beside torch.distributed's.

    python3 -m torch.distributed.run --standalone --nproc_per_node=2 examples/python/all_reduce.py
    python examples/python/all_reduce.py          # one rank: runs too (a world of one)

Every rank fills a tensor with its rank + 1; after the all-reduce every element is 1 + 2 + ... + W. With
torch.distributed initialised (NCCL), weft meets through torch's store; the result is checked against NCCL's.
"""
import os

import torch
import torch.distributed as dist

import weft


def main():
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world = weft.init()
    rank, n = world.rank, world.num_ranks

    x = weft.empty((4, 1 << 16), torch.bfloat16)  # on the symmetric heap: peers read it directly
    x.fill_(rank + 1)
    weft.all_reduce(x)  # in place, on torch's current stream
    # The sum in fp32, rounded once to bf16 (exact up to 256: n <= 22).
    expected = torch.tensor(n * (n + 1) / 2, dtype=torch.float32).to(torch.bfloat16).item()
    torch.cuda.synchronize()
    ok = bool(torch.all(x == expected))
    if dist.is_initialized() and n * (n + 1) / 2 <= 256:  # NCCL's bf16 sums round alike only while exact
        y = torch.full((4, 1 << 16), float(rank + 1), device="cuda", dtype=torch.bfloat16)
        dist.all_reduce(y)
        ok = ok and torch.equal(x, y)
    print(f"rank {rank}/{n}: all_reduce of {x.numel()} bf16 -> {x[0, 0].item():g} (expected {expected:g}) "
          f"{'OK' if ok else 'WRONG'}", flush=True)

    weft.free(x)  # collective, like weft.empty
    weft.finalize()
    if dist.is_initialized():
        dist.destroy_process_group()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
