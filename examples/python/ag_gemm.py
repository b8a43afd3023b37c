# SPDX-License-Identifier: MIT
"""AllGather+GEMM (a column-parallel linear layer) from PyTorch, against NCCL's all-gather then torch.matmul.

    python3 -m torch.distributed.run --standalone --nproc_per_node=4 examples/python/ag_gemm.py [M N K]

Rank r holds rows [r*M/W, (r+1)*M/W) of A [M, K] and its weight shard B [N, K]; weft computes
C = AllGather(A) @ B.T with the gather on copy engines overlapped with the GEMM. Prints the error against the
reference and both times.
"""
import os
import sys

import torch
import torch.distributed as dist

import weft
from example_utils import rel_error, time_ms


def main():
    m, n, k = (int(v) for v in sys.argv[1:4]) if len(sys.argv) >= 4 else (8192, 3584, 8192)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world = weft.init()
    rank, w = world.rank, world.num_ranks
    if m < w:
        raise SystemExit(f"M={m} rows cannot be sharded over {w} ranks")
    m = m // w * w  # rows sharded evenly over the ranks (W need not divide the M asked for: 3, 5, 6, 7 ranks)
    torch.manual_seed(rank)
    a_local = torch.randn(m // w, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5

    with weft.AgGemm(m, n, k, torch.bfloat16) as op:
        c = op.run(a_local, b)
        gathered = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)

        def baseline():
            if dist.is_initialized():
                dist.all_gather_into_tensor(gathered, a_local)
            else:
                gathered.copy_(a_local)
            return gathered @ b.t()

        ref = baseline()
        torch.cuda.synchronize()
        err = rel_error(c, ref)
        t_weft = time_ms(lambda: op.run(a_local, b, c))
        t_base = time_ms(baseline)
    print(f"rank {rank}/{w}: AG+GEMM M={m} N={n} K={k}: rel. error {err:.2e}, weft {t_weft:.3f} ms, "
          f"NCCL all-gather + torch.matmul {t_base:.3f} ms {'OK' if err < 2e-2 else 'WRONG'}", flush=True)
    weft.finalize()
    if dist.is_initialized():
        dist.destroy_process_group()
    raise SystemExit(0 if err < 2e-2 else 1)


if __name__ == "__main__":
    main()
