# SPDX-License-Identifier: MIT
# The MoE layers from Python: weft.moe_route against the layout's rules, the gathered grouped GEMMs and combine and the
# tensor-parallel layers (MoeAgGroupedGemm, MoeGroupedGemmRs) against torch matmuls over the whole weights, and
# weft.ep.MoeBlock against a torch MoE block.
# Inputs are made from seeds shared by every rank (each rank takes its shard); outputs are poisoned first.
import pytest
import torch
import torch.nn.functional as F

import weft
from weft_gpu_helpers import rank_generator, rel_error


def _topk_idx(tokens, topk, num_experts, seed, drop_every=5):
    """A routing every rank shares: distinct experts per token (one hot expert takes a third of the tokens' first
    slot), every `drop_every`-th token's last slot dropped (-1)."""
    g = rank_generator(seed)
    scores = torch.rand((tokens, num_experts), generator=g, device="cuda")
    scores[: tokens // 3, 0] += 2.0
    idx = scores.topk(topk, dim=1).indices.to(torch.int32)
    idx[::drop_every, -1] = -1
    return idx.contiguous()


def _check_routing(r, idx, num_experts, align):
    """The gathered layout's rules: expert e's rows [offsets[e], + counts[e]) hold its slots in (token, k) order,
    slot_rows names each slot's row (-1 for a dropped slot), padding rows hold -1, offsets aligned."""
    tokens, topk = idx.shape
    counts, offsets = r.counts.cpu(), r.offsets.cpu()
    gather, slots = r.gather_index.cpu(), r.slot_rows.cpu()
    flat = idx.cpu().reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    assert torch.equal(counts, torch.bincount(flat[valid].long(), minlength=num_experts).to(torch.int32))
    assert offsets[0] == 0 and bool((offsets[:-1] % align == 0).all())
    for e in range(num_experts):
        start, n = int(offsets[e]), int(counts[e])
        assert int(offsets[e + 1]) >= start + n
        want = torch.nonzero(flat == e).reshape(-1)  # slots of e in (token, k) order
        assert torch.equal(gather[start:start + n].long(), want // topk)
        assert torch.equal(slots[want].long(), torch.arange(start, start + n))
        assert bool((gather[start + n:int(offsets[e + 1])] == -1).all())
    assert bool((slots[~valid] == -1).all())
    assert bool((gather[int(offsets[-1]):] == -1).all())


@pytest.mark.parametrize("tokens,topk,num_experts,align", [(1, 1, 1, 1), (37, 2, 5, 1), (130, 6, 64, 64),
                                                           (200, 8, 16, 8)])
def test_moe_route_builds_the_gathered_layout(tokens, topk, num_experts, align):
    idx = _topk_idx(tokens, topk, num_experts, 11)
    r = weft.moe_route(idx, num_experts, align=align)
    torch.cuda.synchronize()
    assert r.tokens == tokens and r.topk == topk and r.num_experts == num_experts
    assert r.rows_capacity == weft.moe_gathered_rows(tokens, topk, num_experts, align)
    _check_routing(r, idx, num_experts, align)


def test_moe_route_records_an_expert_index_out_of_range():
    idx = _topk_idx(16, 2, 4, 12)
    idx[3, 1] = 9
    idx[5, 0] = -2
    status = weft.moe_routing_status()
    r = weft.moe_route(idx, 4, status=status)
    with pytest.raises(weft.Error, match="9|-2"):
        weft.check_moe_routing_status(status)
    idx[3, 1], idx[5, 0] = -1, -1  # the bad slots were dropped: the layout is that of the routing without them
    torch.cuda.synchronize()
    _check_routing(r, idx, 4, 1)
    with pytest.raises(ValueError, match="rows_capacity: expected at least"):
        weft.moe_route(idx, 4, rows_capacity=3)


def _weights(shape, seed, scale):
    g = rank_generator(seed)
    return (torch.randn(shape, generator=g, device="cuda") * scale).to(torch.bfloat16)


@pytest.mark.parametrize("tokens_per_rank,hidden,ffn,num_experts,topk", [(32, 256, 128, 8, 2), (7, 136, 72, 5, 3),
                                                                         (64, 512, 256, 16, 6)])
def test_tp_moe_layers_against_torch(rank, num_ranks, tokens_per_rank, hidden, ffn, num_experts, topk):
    m = tokens_per_rank * num_ranks
    x = _weights((m, hidden), 1, 1.0)
    idx = _topk_idx(m, topk, num_experts, 2)
    topk_weights = torch.rand((m, topk), generator=rank_generator(3), device="cuda")
    w_up = _weights((num_experts, ffn * num_ranks, hidden), 4, hidden ** -0.5)
    w_down = _weights((num_experts, hidden, ffn * num_ranks), 5, (ffn * num_ranks) ** -0.5)
    shard = slice(rank * ffn, (rank + 1) * ffn)
    x_local = x[rank * tokens_per_rank:(rank + 1) * tokens_per_rank]
    up = weft.MoeAgGroupedGemm(m, hidden, ffn, num_experts, topk)
    down = weft.MoeGroupedGemmRs(m, hidden, ffn, num_experts, topk)
    try:
        y = torch.full((up.rows_capacity, ffn), float("nan"), dtype=torch.bfloat16, device="cuda")
        up.run(x_local, idx, w_up[:, shard].contiguous(), y)
        out = down.run(y, w_down[:, :, shard].contiguous(), up.routing, topk_weights)
        out32 = torch.full((tokens_per_rank, hidden), float("nan"), device="cuda")
        down.run(y, w_down[:, :, shard].contiguous(), up.routing, topk_weights, out32)
        torch.cuda.synchronize()
        weft.world().sync_and_check(torch.cuda.current_stream().cuda_stream)
        up.check_routing()
        routing = up.routing
        assert routing.tokens == m
        _check_routing(routing, idx, num_experts, 1)
        # Layer 0: every gathered row against x[token] @ w_up[e].T (this rank's columns).
        offsets, counts = routing.offsets.tolist(), routing.counts.tolist()
        y_full = torch.zeros((m, topk, ffn * num_ranks), device="cuda")  # per slot, all columns (fp32 then bf16)
        for e in range(num_experts):
            rows = slice(offsets[e], offsets[e] + counts[e])
            tokens = routing.gather_index[rows].long()
            want = (x[tokens].float() @ w_up[e].float().T).to(torch.bfloat16)
            assert rel_error(y[rows], want[:, shard]) < 1e-2
            slot = (idx[tokens] == e).int().argmax(dim=1)
            y_full[tokens, slot] = want.float()
        # Layer 1: out[t] = sum_k weights[t, k] * (y_full[t, k] @ w_down[e].T) for this rank's tokens.
        want = torch.zeros((m, hidden), device="cuda")
        for k in range(topk):
            for e in range(num_experts):
                sel = idx[:, k] == e
                want[sel] += topk_weights[sel, k, None] * (y_full[sel, k] @ w_down[e].float().T)
        mine = want[rank * tokens_per_rank:(rank + 1) * tokens_per_rank]
        assert out.dtype == torch.bfloat16 and out.shape == (tokens_per_rank, hidden)
        assert rel_error(out, mine) < 2e-2
        assert rel_error(out32, mine) < 1e-2
    finally:
        down.close()
        up.close()


def test_tp_moe_layers_refuse_bad_arguments_naming_them(num_ranks):
    up = weft.MoeAgGroupedGemm(8 * num_ranks, 64, 32, 4, 2)
    down = weft.MoeGroupedGemmRs(8 * num_ranks, 64, 32, 4, 2)
    try:
        x = torch.zeros((8, 64), dtype=torch.bfloat16, device="cuda")
        idx = torch.zeros((8 * num_ranks, 2), dtype=torch.int32, device="cuda")
        w = torch.zeros((4, 32, 64), dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="x_local: expected 64 columns"):
            up.run(x[:, :32], idx, w)
        with pytest.raises(ValueError, match="topk_idx: expected a contiguous"):
            up.run(x, idx[:, :1], w)
        with pytest.raises(ValueError, match=r"w: expected shape \(4, 32, 64\)"):
            up.run(x, idx, w[:3])
        with pytest.raises(TypeError, match="routing: expected a weft.MoeRouting"):
            down.run(torch.zeros((1, 32), dtype=torch.bfloat16, device="cuda"), w, None, None)
    finally:
        down.close()
        up.close()


def _swiglu_block_reference(x, idx, topk_weights, gate_up, down, ffn):
    """The MoE block in torch over every expert's weights (bf16 roundings where the block rounds)."""
    out = torch.zeros(x.shape, device="cuda")
    for e in range(gate_up.shape[0]):
        for k in range(idx.shape[1]):
            sel = idx[:, k] == e
            if not bool(sel.any()):
                continue
            gu = (x[sel].float() @ gate_up[e].float().T).to(torch.bfloat16).float()
            a = (F.silu(gu[:, :ffn]) * gu[:, ffn:]).to(torch.bfloat16).float()
            y = (a @ down[e].float().T).to(torch.bfloat16).float()
            out[sel] += topk_weights[sel, k, None] * y
    return out


@pytest.mark.parametrize("tokens,hidden,ffn,experts_per_rank,topk", [(64, 256, 128, 4, 2), (9, 136, 72, 3, 3)])
def test_ep_moe_block_against_torch(rank, num_ranks, tokens, hidden, ffn, experts_per_rank, topk):
    num_experts = experts_per_rank * num_ranks
    t = tokens - rank  # ranks may bring different token counts
    x = _weights((tokens, hidden), 20 + rank, 1.0)[:t]
    idx = _topk_idx(tokens, topk, num_experts, 30 + rank)[:t].contiguous()
    topk_weights = torch.rand((tokens, topk), generator=rank_generator(40 + rank), device="cuda")[:t].contiguous()
    gate_up = _weights((num_experts, 2 * ffn, hidden), 50, hidden ** -0.5)
    down = _weights((num_experts, hidden, ffn), 51, ffn ** -0.5)
    mine = slice(rank * experts_per_rank, (rank + 1) * experts_per_rank)
    block = weft.ep.MoeBlock(num_experts, hidden, topk, tokens, ffn)
    try:
        assert block.num_local_experts == experts_per_rank
        out = torch.full((t, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
        block.forward(x, idx, topk_weights, gate_up[mine].contiguous(), down[mine].contiguous(), out)
        sequential = block(x, idx, topk_weights, gate_up[mine].contiguous(), down[mine].contiguous(), fused=False)
        block.sync_and_check()
        assert torch.equal(out, sequential)
        want = _swiglu_block_reference(x, idx, topk_weights, gate_up, down, ffn)
        assert rel_error(out, want) < 2e-2
    finally:
        block.close()


@pytest.mark.parametrize("tokens,k_dim,n,num_experts,topk,b_layout", [(37, 64, 48, 5, 2, "nk"), (200, 136, 264, 16, 6,
                                                                                                   "kn")])
def test_gathered_grouped_gemm_and_combine_against_torch(tokens, k_dim, n, num_experts, topk, b_layout):
    a = _weights((tokens, k_dim), 60, 1.0)
    b = _weights((num_experts, n, k_dim) if b_layout == "nk" else (num_experts, k_dim, n), 61, k_dim ** -0.5)
    idx = _topk_idx(tokens, topk, num_experts, 62)
    weights = torch.rand((tokens, topk), generator=rank_generator(63), device="cuda")
    r = weft.moe_route(idx, num_experts)

    def expert(e):
        return b[e].float().T if b_layout == "nk" else b[e].float()

    d = weft.grouped_gemm_gathered(a, b, r, torch.full((r.rows_capacity, n), float("nan"), device="cuda"),
                                   b_layout=b_layout)
    per_slot = weft.grouped_gemm_gathered_combine(a, b, r, per_slot=True, b_layout=b_layout, out_dtype=torch.float32)
    summed = weft.grouped_gemm_gathered_combine(a, b, r, weights, b_layout=b_layout)
    combined = weft.moe_combine(d, r, weights)
    torch.cuda.synchronize()
    offsets, counts = r.offsets.tolist(), r.counts.tolist()
    want_slots = torch.zeros((tokens, topk, n), device="cuda")
    for e in range(num_experts):
        rows = slice(offsets[e], offsets[e] + counts[e])
        toks = r.gather_index[rows].long()
        want = a[toks].float() @ expert(e)
        assert rel_error(d[rows], want) < 1e-2
        want_slots[toks, (idx[toks] == e).int().argmax(dim=1)] = want
    assert rel_error(per_slot, want_slots.reshape(tokens * topk, n)) < 1e-2
    dropped = (idx.reshape(-1) < 0)
    assert bool((per_slot[dropped] == 0).all())
    want_sum = (want_slots * weights[..., None]).sum(dim=1)
    assert summed.dtype == torch.bfloat16 and rel_error(summed, want_sum) < 2e-2
    assert torch.equal(combined, summed)  # the same fp32 rows, the same order of the sums
