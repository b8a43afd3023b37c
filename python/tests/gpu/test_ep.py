# SPDX-License-Identifier: MIT
# weft.ep (MoE dispatch/combine) on torch tensors: expert counts against routing gathered with NCCL, and a combine of
# the dispatched rows themselves (an identity expert) against x * (sum of the token's valid weights).
import pytest
import torch
import torch.distributed as dist

import weft
from weft_gpu_helpers import rank_generator, rel_error

HIDDEN, TOPK, TOKENS = 256, 4, 128


def _routing(rank, num_experts, tokens, seed):
    g = rank_generator(seed * 1000 + rank)
    scores = torch.rand((tokens, num_experts), generator=g, device="cuda")
    idx = scores.topk(TOPK, dim=1).indices.to(torch.int32)
    idx[::7, -1] = -1  # dropped slots
    weights = torch.rand((tokens, TOPK), generator=g, device="cuda")
    x = torch.randn((tokens, HIDDEN), generator=g, device="cuda").to(torch.bfloat16)
    return x, idx, weights


def _expected_counts(idx, rank, num_ranks, num_experts):
    everyone = torch.empty((num_ranks * idx.shape[0], TOPK), dtype=idx.dtype, device="cuda")
    dist.all_gather_into_tensor(everyone, idx)
    local = num_experts // num_ranks
    valid = everyone[everyone >= 0].long()
    counts = torch.bincount(valid, minlength=num_experts)
    return counts[rank * local:(rank + 1) * local].to(torch.int32)


@pytest.fixture(scope="module")
def buffer():
    buf = weft.ep.Buffer(num_experts=8 * weft.num_ranks(), hidden=HIDDEN, topk=TOPK, max_tokens_per_rank=TOKENS)
    yield buf
    buf.close()


def _expected_combine(x, idx, weights):
    return x.float() * (weights * (idx >= 0)).sum(dim=1, keepdim=True)


def test_normal_dispatch_and_combine(buffer, rank, num_ranks):
    num_experts = buffer.num_experts
    x, idx, weights = _routing(rank, num_experts, TOKENS - rank, 1)  # T may differ between ranks
    h = buffer.make_normal_handle()
    try:
        buffer.dispatch(h, x, idx, weights)
        buffer.sync_and_check()
        assert torch.equal(h.expert_counts, _expected_counts(_pad(idx, TOKENS), rank, num_ranks, num_experts))
        out = buffer.combine(h, h.recv_x)
        buffer.sync_and_check()
        assert out.shape == (TOKENS - rank, HIDDEN)
        assert rel_error(out, _expected_combine(x, idx, weights)) < 2e-2
    finally:
        h.close()


def _pad(idx, tokens):
    # Rows of -1 (no expert) so that every rank gathers the same number of rows.
    pad = torch.full((tokens - idx.shape[0], TOPK), -1, dtype=idx.dtype, device="cuda")
    return torch.cat([idx, pad])


@pytest.mark.parametrize("phases", [("send_recv",), ("send", "recv")])
def test_low_latency_dispatch_and_combine(buffer, rank, num_ranks, phases):
    num_experts = buffer.num_experts
    x, idx, weights = _routing(rank, num_experts, TOKENS, 2)
    h = buffer.make_low_latency_handle()
    try:
        # Each phase is given only what it reads: a receive half reads the handle, a combine's send y alone.
        for phase in phases:
            if phase == "recv":
                buffer.low_latency_dispatch(h, phase=phase)
            else:
                buffer.low_latency_dispatch(h, x, idx, phase=phase)
        buffer.sync_and_check()
        assert torch.equal(h.expert_counts, _expected_counts(idx, rank, num_ranks, num_experts))
        out = None
        for phase in phases:
            if phase == "send":
                assert buffer.low_latency_combine(h, h.recv_x, phase=phase) is None  # no out, no rows to size it
            elif phase == "recv":
                out = buffer.low_latency_combine(h, topk_idx=idx, topk_weights=weights, phase=phase)
            else:
                out = buffer.low_latency_combine(h, h.recv_x, idx, weights, phase=phase)
        buffer.sync_and_check()
        assert rel_error(out, _expected_combine(x, idx, weights)) < 2e-2
    finally:
        h.close()


def test_bad_routing_dtype_names_the_argument(buffer):
    x = torch.zeros((4, HIDDEN), dtype=torch.bfloat16, device="cuda")
    h = buffer.make_low_latency_handle()
    try:
        with pytest.raises(TypeError, match="topk_idx: expected dtype int32, got int64"):
            buffer.low_latency_dispatch(h, x, torch.zeros((4, TOPK), dtype=torch.int64, device="cuda"))
    finally:
        h.close()
