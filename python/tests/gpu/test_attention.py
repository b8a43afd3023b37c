# SPDX-License-Identifier: MIT
# weft.flash_attention, weft.decode_attention, weft.sp_decode_attention and weft.AgAttention on torch tensors against
# fp32 references computed with torch (softmax over masked scores), outputs poisoned with NaN first. The local ops:
# each rank checks its own GPU; sp_decode_attention and AgAttention: every rank holds a shard of each sequence and
# checks the whole sequence's result.
import math

import pytest
import torch

import weft
from weft_gpu_helpers import rank_generator, rel_error

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _randn(shape, dtype, seed, rank=0):
    g = rank_generator(seed * 1000 + rank)
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def _graph_replays(call, out, times=2):
    """Captures call() in a CUDA graph, then replays it `times` times with `out` poisoned with NaN before each; yields
    after each replay (synchronised) for the caller's checks."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    for _ in range(times):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        yield


def _reference(q, k, v, causal, scale, q_position):
    """(out, lse) in fp32 for q [Sq, Hq, D], k/v [Skv, Hkv, D]."""
    sq, hq, d = q.shape
    skv, hkv = k.shape[0], k.shape[1]
    group = hq // hkv
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if causal:
        pos = torch.arange(sq, device=q.device)[:, None] + q_position
        keys = torch.arange(skv, device=q.device)[None, :]
        s = s.masked_fill(keys > pos, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [h, q]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", p, vf)
    return out, lse.t()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sq,skv,hq,hkv,d,causal,q_position", [
    (1, 1, 4, 1, 64, True, 0),
    (77, 77, 8, 2, 64, True, 0),         # GQA 4, partial tiles
    (300, 300, 4, 4, 128, False, 0),
    (129, 500, 16, 1, 128, True, 371),   # queries at the end of the keys
    (1000, 1000, 6, 3, 64, True, 0),
])
def test_flash_attention_matches_torch(rank, dtype, sq, skv, hq, hkv, d, causal, q_position):
    q, k, v = _randn((sq, hq, d), dtype, 1, rank), _randn((skv, hkv, d), dtype, 2, rank), \
        _randn((skv, hkv, d), dtype, 3, rank)
    scale = 1.0 / math.sqrt(d)
    want, want_lse = _reference(q, k, v, causal, scale, q_position)
    out = torch.full_like(q, float("nan"))
    got, lse = weft.flash_attention(q, k, v, out, causal=causal, q_position=q_position, return_lse=True)
    torch.cuda.synchronize()
    assert got is out and lse.dtype == torch.float32 and lse.shape == (sq, hq)
    assert rel_error(got, want) < TOL[dtype]
    assert torch.allclose(lse, want_lse, atol=2e-2, rtol=1e-3)
    # A scale, no lse, out allocated.
    want2, _ = _reference(q, k, v, causal, 0.3, q_position)
    assert rel_error(weft.flash_attention(q, k, v, causal=causal, scale=0.3, q_position=q_position), want2) < TOL[dtype]


def test_flash_attention_takes_sdpa_layout_views_and_matches_sdpa(rank):
    # torch's [batch, heads, seq, dim]: sequence b as x[b].transpose(0, 1) (strided, no copy).
    b, h, s, d = 2, 8, 257, 128
    q, k, v = (_randn((b, h, s, d), torch.bfloat16, 10 + i, rank) for i in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    for i in range(b):
        got = weft.flash_attention(q[i].transpose(0, 1), k[i].transpose(0, 1), v[i].transpose(0, 1), causal=True)
        assert rel_error(got, want[i].transpose(0, 1)) < TOL[torch.bfloat16]


def test_flash_attention_on_a_side_stream_and_in_a_graph(rank):
    q, k, v = (_randn((500, 8, 64), torch.bfloat16, 20 + i, rank) for i in range(3))
    want, _ = _reference(q, k, v, True, 1 / 8, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    out = torch.full_like(q, float("nan"))
    with torch.cuda.stream(side):
        weft.flash_attention(q, k, v, out, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    assert rel_error(out, want) < TOL[torch.bfloat16]
    graph_out = torch.full_like(q, float("nan"))
    for _ in _graph_replays(lambda: weft.flash_attention(q, k, v, graph_out, causal=True), graph_out):
        assert rel_error(graph_out, want) < TOL[torch.bfloat16]


def _paged(k, v, page, gen):
    """k, v [batch, L, Hkv, D] -> caches [pages, page, Hkv, D] in random page order, block table [batch, L / page]."""
    b, length, hkv, d = k.shape
    per_seq = (length + page - 1) // page
    order = torch.randperm(b * per_seq, generator=gen).to("cuda")
    kc = torch.zeros((b * per_seq, page, hkv, d), dtype=k.dtype, device="cuda")
    vc = torch.zeros_like(kc)
    pad = per_seq * page - length
    kp = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).reshape(b * per_seq, page, hkv, d)
    vp = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).reshape(b * per_seq, page, hkv, d)
    kc[order] = kp
    vc[order] = vp
    return kc, vc, order.reshape(b, per_seq).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,length,hq,hkv,d,page", [
    (1, 1000, 8, 2, 128, 16),
    (3, 4100, 32, 8, 128, 1),
    (4, 700, 8, 8, 64, 64),
])
def test_decode_attention_matches_torch(rank, dtype, batch, length, hq, hkv, d, page):
    gen = torch.Generator().manual_seed(1234 + rank)
    q = _randn((batch, hq, d), dtype, 30, rank)
    k, v = _randn((batch, length, hkv, d), dtype, 31, rank), _randn((batch, length, hkv, d), dtype, 32, rank)
    kc, vc, table = _paged(k, v, page, gen)
    lens = torch.tensor([max(0, length - 37 * i) for i in range(batch)], dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    got, lse = weft.decode_attention(q, kc, vc, table, lens, out, return_lse=True)
    torch.cuda.synchronize()
    assert got is out
    for b in range(batch):
        n = int(lens[b])
        want, want_lse = _reference(q[b:b + 1], k[b, :n], v[b, :n], False, 1 / math.sqrt(d), 0)
        assert rel_error(got[b], want[0]) < TOL[dtype]
        assert torch.allclose(lse[b], want_lse[0], atol=2e-2, rtol=1e-3)


def test_decode_attention_empty_sequence_workspace_and_graph(rank):
    q = _randn((2, 8, 128), torch.bfloat16, 40, rank)
    k, v = _randn((2, 2048, 2, 128), torch.bfloat16, 41, rank), _randn((2, 2048, 2, 128), torch.bfloat16, 42, rank)
    kc, vc, table = _paged(k, v, 16, torch.Generator().manual_seed(7))
    lens = torch.tensor([0, 2048], dtype=torch.int32, device="cuda")
    nbytes = weft.decode_attention_workspace_bytes(2, 8, 2, 128, 2048)
    ws = torch.empty(max(nbytes, 16), dtype=torch.uint8, device="cuda")
    want, _ = _reference(q[1:2], k[1], v[1], False, 1 / math.sqrt(128), 0)
    out = torch.full_like(q, float("nan"))
    for _ in _graph_replays(lambda: weft.decode_attention(q, kc, vc, table, lens, out, workspace=ws), out):
        assert torch.equal(out[0], torch.zeros_like(out[0]))  # an empty sequence: zeros
        assert rel_error(out[1], want[0]) < TOL[torch.bfloat16]


def test_decode_attention_status_poisons_a_bad_sequence_and_names_the_entry(rank):
    q = _randn((3, 8, 128), torch.bfloat16, 50, rank)
    k, v = _randn((3, 600, 2, 128), torch.bfloat16, 51, rank), _randn((3, 600, 2, 128), torch.bfloat16, 52, rank)
    kc, vc, table = _paged(k, v, 16, torch.Generator().manual_seed(9))
    lens = torch.tensor([600, 500, 50], dtype=torch.int32, device="cuda")
    status = weft.attention_status()
    assert status.dtype == torch.int32 and status.shape == (4,) and not status.any()
    want, want_lse = weft.decode_attention(q, kc, vc, table, lens, return_lse=True)
    got, lse = weft.decode_attention(q, kc, vc, table, lens, return_lse=True, status=status)
    weft.check_attention_status(status)  # a good table: nothing recorded, the same result
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    bad = table.clone()
    bad[1, 20] = 1 << 30  # token 320 of sequence 1: read by the split kernel's loop
    got, lse = weft.decode_attention(q, kc, vc, bad, lens, return_lse=True, status=status)
    torch.cuda.synchronize()
    assert torch.isnan(got[1]).all() and torch.isnan(lse[1]).all()
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    assert status.tolist() == [1, 1, 20, 1 << 30]
    with pytest.raises(weft.Error, match=r"block_table\[1\]\[20\] = 1073741824 is outside the cache's pages"):
        weft.check_attention_status(status)
    with pytest.raises(ValueError, match="status: expected an int32 tensor of 4 contiguous elements"):
        weft.decode_attention(q, kc, vc, table, lens, status=torch.zeros(3, dtype=torch.int32, device="cuda"))
    with pytest.raises(TypeError, match="status: expected dtype int32"):
        weft.decode_attention(q, kc, vc, table, lens, status=torch.zeros(4, dtype=torch.int64, device="cuda"))


def test_attention_argument_errors_name_the_argument(rank):
    q = torch.zeros((16, 4, 64), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(weft.Error, match="num_q_heads"):
        weft.flash_attention(q, q[:, :3], q[:, :3])  # 4 q-heads over 3 KV heads
    with pytest.raises(weft.Error, match="head_dim"):
        weft.flash_attention(q[..., :32], q[..., :32], q[..., :32])


def _sharded(k, v, lengths, rank, num_ranks, page, seed):
    """This rank's shard of every sequence (k, v [batch, L, Hkv, D], sequence b of lengths[b] tokens, cut at points
    drawn from `seed`, the same on every rank; sequence 0's tokens all on the last rank) as a paged cache: (k_cache,
    v_cache, block_table, seq_lens)."""
    gen = torch.Generator().manual_seed(seed)
    shards = []
    for b, n in enumerate(lengths):
        if b == 0:
            cuts = [0] * num_ranks + [n]
        else:
            cuts = [0] + sorted(torch.randint(0, n + 1, (num_ranks - 1,), generator=gen).tolist()) + [n]
        shards.append((cuts[rank], cuts[rank + 1]))
    longest = max(1, max(end - begin for begin, end in shards))
    hkv, d = k.shape[2], k.shape[3]
    ks = torch.zeros((len(lengths), longest, hkv, d), dtype=k.dtype, device="cuda")
    vs = torch.zeros_like(ks)
    for b, (begin, end) in enumerate(shards):
        ks[b, :end - begin] = k[b, begin:end]
        vs[b, :end - begin] = v[b, begin:end]
    kc, vc, table = _paged(ks, vs, page, torch.Generator().manual_seed(seed + 1 + rank))
    lens = torch.tensor([end - begin for begin, end in shards], dtype=torch.int32, device="cuda")
    return kc, vc, table, lens


def test_sp_decode_attention_matches_the_whole_sequence(rank, num_ranks):
    lengths = [900, 1000, 0, 45]  # sequence 0 on the last rank only; sequence 2 empty everywhere
    batch, hq, hkv, d = len(lengths), 8, 2, 128
    q = _randn((batch, hq, d), torch.bfloat16, 60)  # the same on every rank
    k = _randn((batch, max(lengths), hkv, d), torch.bfloat16, 61)
    v = _randn((batch, max(lengths), hkv, d), torch.bfloat16, 62)
    kc, vc, table, lens = _sharded(k, v, lengths, rank, num_ranks, 16, 63)
    out = torch.full_like(q, float("nan"))
    got, lse = weft.sp_decode_attention(q, kc, vc, table, lens, out, return_lse=True)
    torch.cuda.synchronize()
    assert got is out
    for b, n in enumerate(lengths):
        if n == 0:
            assert torch.equal(got[b], torch.zeros_like(got[b])) and torch.isneginf(lse[b]).all()
            continue
        want, want_lse = _reference(q[b:b + 1], k[b, :n], v[b, :n], False, 1 / math.sqrt(d), 0)
        assert rel_error(got[b], want[0]) < TOL[torch.bfloat16], f"sequence {b}"
        assert torch.allclose(lse[b], want_lse[0], atol=2e-2, rtol=1e-3), f"sequence {b}"
    # Captured after the first call (which compiled the kernels and met every rank), with a workspace for this rank's
    # split plan (torch.cuda.graph captures on a stream of its own), replayed twice.
    max_len = table.shape[1] * kc.shape[1]
    ws = torch.empty(max(16, weft.decode_attention_workspace_bytes(batch, hq, hkv, d, max_len)), dtype=torch.uint8,
                     device="cuda")
    graph_out = torch.full_like(q, float("nan"))
    for _ in _graph_replays(lambda: weft.sp_decode_attention(q, kc, vc, table, lens, graph_out, workspace=ws),
                            graph_out):
        assert torch.equal(graph_out, got)


def test_sp_decode_attention_status_and_refused_arguments(rank, num_ranks):
    lengths = [300, 500]
    q = _randn((2, 4, 64), torch.float16, 70)
    k, v = _randn((2, 500, 1, 64), torch.float16, 71), _randn((2, 500, 1, 64), torch.float16, 72)
    kc, vc, table, lens = _sharded(k, v, lengths, rank, num_ranks, 16, 73)
    # Refused by the wrapper on every rank (counted as a collective call there), then a good call still pairs up.
    with pytest.raises(TypeError, match="k_cache: expected dtype float16"):
        weft.sp_decode_attention(q, kc.bfloat16(), vc, table, lens)
    want = weft.sp_decode_attention(q, kc, vc, table, lens)
    status = weft.attention_status()
    bad = table.clone()
    last = num_ranks - 1  # holds all of sequence 0 (300 tokens: pages 0..18)
    if rank == last:
        bad[0, 5] = -7
    got = weft.sp_decode_attention(q, kc, vc, bad, lens, status=status)
    torch.cuda.synchronize()
    assert torch.isnan(got[0]).all(), "a bad entry on one rank poisons its sequence on every rank"
    assert torch.equal(got[1], want[1])
    if rank == last:
        assert status.tolist() == [1, 0, 5, -7]
        with pytest.raises(weft.Error, match=r"block_table\[0\]\[5\] = -7 is outside the cache's pages"):
            weft.check_attention_status(status)
    else:
        assert status.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("rows,hq,hkv,d,causal,dtype", [(1, 4, 1, 64, True, torch.bfloat16),
                                                        (77, 8, 2, 128, True, torch.bfloat16),
                                                        (130, 6, 3, 64, False, torch.float16)])
def test_ag_attention_matches_the_whole_sequence(rank, num_ranks, rows, hq, hkv, d, causal, dtype):
    s = rows * num_ranks
    q, k, v = _randn((s, hq, d), dtype, 11), _randn((s, hkv, d), dtype, 12), _randn((s, hkv, d), dtype, 13)
    mine = slice(rank * rows, (rank + 1) * rows)
    want, want_lse = _reference(q[mine], k, v, causal, 1.0 / math.sqrt(d), rank * rows)
    op = weft.AgAttention(s, hq, hkv, d, dtype, causal=causal)
    try:
        out = torch.full_like(q[mine], float("nan"))
        got, lse = op.run(q[mine], k[mine], v[mine], out, return_lse=True)
        torch.cuda.synchronize()
        weft.world().sync_and_check(torch.cuda.current_stream().cuda_stream)
        assert got is out and lse.shape == (rows, hq)
        assert rel_error(out, want) < TOL[dtype]
        assert torch.allclose(lse, want_lse, atol=2e-2, rtol=1e-3)
        # K and V written into the op's own shard buffers (no local copy), the output allocated.
        op.local_k(s).copy_(k[mine])
        op.local_v(s).copy_(v[mine])
        again = op.run(q[mine], op.local_k(s), op.local_v(s))
        torch.cuda.synchronize()
        assert rel_error(again, want) < TOL[dtype]
        seen = rank + 1 if causal else num_ranks
        assert torch.equal(op.gathered_k(s)[:seen * rows], k[:seen * rows])
        with pytest.raises(ValueError, match="k_local: expected shape"):
            op.run(q[mine], k[mine, :, :32], v[mine])
    finally:
        op.close()
