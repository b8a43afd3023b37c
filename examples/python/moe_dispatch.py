# SPDX-License-Identifier: MIT
"""An MoE layer's communication round trip from PyTorch (the Python twin of examples/04_moe_dispatch).

    python3 -m torch.distributed.run --standalone --nproc_per_node=4 examples/python/moe_dispatch.py [T H E k]

Every rank routes its T tokens to k of E experts (the experts spread evenly over the ranks). The normal mode
delivers each rank's received tokens expert-contiguous; a toy "expert" scales its rows by (1 + expert / 8); combine
returns each token's weighted sum over its experts. The low-latency mode does the same with the masked layout
[local experts, rows, hidden], its send and receive halves launched apart. No host synchronisation between the
steps: the expert reads the counts and offsets on the device. Both results are checked against a computation on
the rank's own tokens: x * sum_j w_j (1 + e_j / 8).
"""
import os
import sys

import torch
import torch.distributed as dist

import weft
from example_utils import rel_error


def expert_scale(expert):
    return 1.0 + expert / 8.0


def scale_normal_rows(h, first_expert):
    """The toy expert on the normal layout: rows [offset[e], offset[e] + count[e]) belong to local expert e."""
    recv = h.recv_x
    rows = torch.arange(recv.shape[0], device=recv.device)
    scale = torch.zeros(recv.shape[0], device=recv.device)
    offsets, counts = h.expert_offsets, h.expert_counts
    for e in range(counts.shape[0]):
        mine = (rows >= offsets[e]) & (rows < offsets[e] + counts[e])
        scale = torch.where(mine, expert_scale(first_expert + e), scale)
    return (recv.float() * scale[:, None]).to(torch.bfloat16)


def scale_masked_rows(h, first_expert):
    """The toy expert on the masked layout: expert e's rows are recv_x[e, :count[e]] (the rest are not read)."""
    recv = h.recv_x
    scale = expert_scale(first_expert + torch.arange(recv.shape[0], device=recv.device, dtype=torch.float32))
    return (recv.float() * scale[:, None, None]).to(torch.bfloat16)


def reference(x, idx, weights):
    valid = idx >= 0
    per_slot = torch.where(valid, weights * expert_scale(idx.float()), torch.zeros_like(weights))
    return x.float() * per_slot.sum(dim=1, keepdim=True)


def main():
    given = len(sys.argv) >= 5
    tokens, hidden, experts, topk = (int(v) for v in sys.argv[1:5]) if given else (200, 1024, 16, 4)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world = weft.init()
    rank, w = world.rank, world.num_ranks
    if not given:
        experts = (experts + w - 1) // w * w  # the default spread evenly at any world size (3, 5, 6, 7 ranks)
    if experts % w != 0:
        raise SystemExit(f"E={experts} experts must spread evenly over {w} ranks")

    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    x = torch.randn((tokens, hidden), generator=g, device="cuda").to(torch.bfloat16)
    scores = torch.rand((tokens, experts), generator=g, device="cuda")
    idx = scores.topk(topk, dim=1).indices.to(torch.int32)
    idx[::5, -1] = -1  # a dropped slot on every fifth token
    weights = torch.rand((tokens, topk), generator=g, device="cuda")
    ref = reference(x, idx, weights)

    with weft.ep.Buffer(num_experts=experts, hidden=hidden, topk=topk, max_tokens_per_rank=tokens) as buf:
        first_expert = rank * buf.num_local_experts

        h = buf.make_normal_handle()
        buf.dispatch(h, x, idx, weights)
        out_normal = buf.combine(h, scale_normal_rows(h, first_expert))
        buf.sync_and_check()
        received = int(h.expert_counts.sum())
        h.close()

        h = buf.make_low_latency_handle()
        buf.low_latency_dispatch(h, x, idx, phase="send")
        buf.low_latency_dispatch(h, x, idx, phase="recv")   # other work could run between the halves
        y = scale_masked_rows(h, first_expert)
        out_ll = buf.low_latency_combine(h, y, idx, weights, phase="send")
        buf.low_latency_combine(h, y, idx, weights, out_ll, phase="recv")
        buf.sync_and_check()
        h.close()

    err_normal, err_ll = rel_error(out_normal, ref), rel_error(out_ll, ref)
    ok = err_normal < 2e-2 and err_ll < 2e-2
    print(f"rank {rank}/{w}: MoE T={tokens} H={hidden} E={experts} k={topk}: received {received} rows; "
          f"rel. error normal {err_normal:.2e}, low-latency {err_ll:.2e} {'OK' if ok else 'WRONG'}", flush=True)
    weft.finalize()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
