# SPDX-License-Identifier: MIT
"""MoE layers from PyTorch: a tensor-parallel MoE FFN (weft.MoeAgGroupedGemm -> SiLU -> weft.MoeGroupedGemmRs) and an
expert-parallel MoE block (weft.ep.MoeBlock), each checked against torch over the whole weights and timed.

    python3 examples/python/moe_layers.py                      # a world of one rank
    python3 -m torch.distributed.run --standalone --nproc_per_node=4 examples/python/moe_layers.py [T H F E k]

TP: the tokens are sharded by rank (T per rank), every expert's FFN weights by the FFN dimension (F / W per rank), the
routing is the same on every rank; layer 0 gathers the rows each expert's tiles need while its grouped GEMM runs, layer
1 sums the ranks' partial products and each token's top-k outputs while its GEMM runs. EP: every rank holds E / W
experts and T tokens of its own; the block dispatches, runs both expert GEMMs with SwiGLU and combines, the GEMMs
overlapping the communication (fused) or after it (fused=False, the separate ops, the same bits).
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import weft
from example_utils import rel_error, time_ms


def shared_randn(shape, seed, scale=1.0):
    """Data every rank makes alike (each takes its shard)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=g, device="cuda") * scale).to(torch.bfloat16)


def routing(tokens, experts, topk, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.rand((tokens, experts), generator=g, device="cuda").topk(topk, dim=1).indices.to(torch.int32)
    return idx, torch.rand((tokens, topk), generator=g, device="cuda")


def tp_ffn(rank, w, tokens, hidden, ffn, experts, topk):
    m = tokens * w
    x = shared_randn((m, hidden), 1)
    idx, weights = routing(m, experts, topk, 2)
    w_up = shared_randn((experts, ffn, hidden), 3, hidden ** -0.5)
    w_down = shared_randn((experts, hidden, ffn), 4, ffn ** -0.5)
    shard = slice(rank * ffn // w, (rank + 1) * ffn // w)
    x_local, up_shard, down_shard = x[rank * tokens:(rank + 1) * tokens], w_up[:, shard].contiguous(), \
        w_down[:, :, shard].contiguous()
    with weft.MoeAgGroupedGemm(m, hidden, ffn // w, experts, topk) as up, \
            weft.MoeGroupedGemmRs(m, hidden, ffn // w, experts, topk) as down:
        def layer():
            y = up.run(x_local, idx, up_shard)
            return down.run(F.silu(y), down_shard, up.routing, weights)

        out = layer()
        ms = time_ms(layer, warmup=1)
    # torch over the whole weights: out[t] = sum_k weights[t, k] * silu(x[t] @ w_up[e].T) @ w_down[e].T
    ref = torch.zeros((m, hidden), device="cuda")
    for e in range(experts):
        for k in range(topk):
            sel = idx[:, k] == e
            h = F.silu((x[sel].float() @ w_up[e].float().T).to(torch.bfloat16)).float()
            ref[sel] += weights[sel, k, None] * (h @ w_down[e].float().T)
    return rel_error(out, ref[rank * tokens:(rank + 1) * tokens]), ms


def ep_block(rank, w, tokens, hidden, ffn, experts, topk):
    x = shared_randn((tokens, hidden), 10 + rank)
    idx, weights = routing(tokens, experts, topk, 20 + rank)
    gate_up = shared_randn((experts, 2 * ffn, hidden), 5, hidden ** -0.5)
    down = shared_randn((experts, hidden, ffn), 6, ffn ** -0.5)
    local = experts // w
    mine = slice(rank * local, (rank + 1) * local)
    with weft.ep.MoeBlock(experts, hidden, topk, tokens, ffn) as block:
        args = (x, idx, weights, gate_up[mine].contiguous(), down[mine].contiguous())
        out = block(*args)
        block.sync_and_check()
        fused_ms = time_ms(lambda: block(*args), warmup=1)
        separate_ms = time_ms(lambda: block(*args, fused=False), warmup=1)
    ref = torch.zeros((tokens, hidden), device="cuda")
    for e in range(experts):
        for k in range(topk):
            sel = idx[:, k] == e
            gu = (x[sel].float() @ gate_up[e].float().T).to(torch.bfloat16).float()
            a = (F.silu(gu[:, :ffn]) * gu[:, ffn:]).to(torch.bfloat16).float()
            ref[sel] += weights[sel, k, None] * (a @ down[e].float().T).to(torch.bfloat16).float()
    return rel_error(out, ref), fused_ms, separate_ms


def main():
    given = len(sys.argv) >= 6
    tokens, hidden, ffn, experts, topk = (int(v) for v in sys.argv[1:6]) if given else (256, 2048, 1024, 8, 2)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world = weft.init()
    rank, w = world.rank, world.num_ranks
    if experts % w != 0 or ffn % (8 * w) != 0:
        raise SystemExit(f"E={experts} must spread evenly over {w} ranks and F={ffn} into shards of multiples of 8")
    tp_err, tp_ms = tp_ffn(rank, w, tokens, hidden, ffn, experts, topk)
    ep_err, fused_ms, separate_ms = ep_block(rank, w, tokens, hidden, ffn, experts, topk)
    ok = tp_err < 2e-2 and ep_err < 2e-2
    if rank == 0:
        print(f"{w} rank(s), T={tokens} per rank, H={hidden}, F={ffn}, E={experts}, top-{topk}")
        print(f"{'layer':<34}{'ms':>9}{'rel. error':>12}")
        print(f"{'TP MoE FFN (layer 0, SiLU, layer 1)':<34}{tp_ms:>9.3f}{tp_err:>12.2e}")
        print(f"{'EP MoE block, fused':<34}{fused_ms:>9.3f}{ep_err:>12.2e}")
        print(f"{'EP MoE block, separate ops':<34}{separate_ms:>9.3f}")
        print("OK" if ok else "MISMATCH")
    weft.finalize()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
