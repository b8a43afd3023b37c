# SPDX-License-Identifier: MIT
# weft.grouped_gemm on torch tensors against a per-expert torch.matmul in fp32: both layouts (contiguous with
# padding rows between groups in a shuffled order; masked with empty, full and partial groups), both B layouts, 16-bit
# and fp32 outputs, fp8 rows against their dequantised values, bad counts recorded in a status, and a captured call
# replayed with other counts. Outputs are poisoned with NaN first: every row a group owns must match the reference,
# every other row must keep its NaN. A local op: each rank checks its own GPU.
import pytest
import torch

import weft
from weft_gpu_helpers import rank_generator, rel_error

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-2}  # by out dtype (16-bit inputs)
NAN = float("nan")


def _randn(shape, dtype, seed, rank=0):
    g = rank_generator(seed * 1000 + rank)
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def _host_generator(seed, rank):
    return torch.Generator().manual_seed(seed * 1000 + rank)


def _weights(groups, n, k, b_layout, dtype, seed, rank):
    return _randn((groups, n, k) if b_layout == "nk" else (groups, k, n), dtype, seed, rank)


def _expert(b, g, b_layout):
    """Expert g's B as fp32 [K, N]."""
    return b[g].float().t() if b_layout == "nk" else b[g].float()


def _random_counts(groups, max_rows, gen):
    counts = torch.randint(0, max_rows + 1, (groups,), generator=gen).tolist()
    if not any(counts):
        counts[0] = max(1, max_rows)
    return counts


def _contiguous_layout(counts, gen, max_gap=13):
    """Offsets that place the groups in a shuffled order with 0..max_gap rows no group owns before each group and
    after the last: (offsets, rows of a)."""
    order = torch.randperm(len(counts), generator=gen).tolist()
    gaps = torch.randint(0, max_gap + 1, (len(counts) + 1,), generator=gen).tolist()
    offsets, row = [0] * len(counts), 0
    for i, g in enumerate(order):
        row += gaps[i]
        offsets[g] = row
        row += counts[g]
    return offsets, max(1, row + gaps[-1])


def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def _expect_contiguous(out, a_rows, b, b_layout, offsets, counts):
    """Checks each group's rows of out [rows, N] against a_rows (fp32, a's values) @ its expert; returns the mask of
    the rows the groups own."""
    owned = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
    for g, (first, count) in enumerate(zip(offsets, counts)):
        if count == 0:
            continue
        got = out[first:first + count]
        assert torch.isfinite(got).all(), f"group {g}: rows [{first}, {first + count}) not all written"
        error = rel_error(got, a_rows[first:first + count] @ _expert(b, g, b_layout))
        assert error < TOL[out.dtype], f"group {g} ({count} rows from {first}): relative error {error}"
        owned[first:first + count] = True
    return owned


def _expect_masked(out, a_rows, b, b_layout, counts):
    """Checks rows [0, min(count, capacity)) of each group of out [G, capacity, N] against a_rows (fp32, a's values)
    @ its expert; returns the mask of the rows the groups own."""
    capacity = out.shape[1]
    owned = torch.zeros(out.shape[:2], dtype=torch.bool, device=out.device)
    for g, count in enumerate(counts):
        rows = min(max(count, 0), capacity)
        if rows == 0:
            continue
        got = out[g, :rows]
        assert torch.isfinite(got).all(), f"group {g}: rows [0, {rows}) not all written"
        error = rel_error(got, a_rows[g, :rows] @ _expert(b, g, b_layout))
        assert error < TOL[out.dtype], f"group {g} ({rows} rows): relative error {error}"
        owned[g, :rows] = True
    return owned


def _untouched(out, owned):
    """Every row no group owns still holds the NaN out was poisoned with."""
    return bool(out[~owned].isnan().all())


@pytest.mark.parametrize("b_layout", ["nk", "kn"])
@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, None), (torch.bfloat16, torch.float32),
                                             (torch.float16, None)])
@pytest.mark.parametrize("groups", [1, 3, 8, 32])
def test_contiguous_groups_in_any_order_with_rows_between_them(rank, groups, dtype, out_dtype, b_layout):
    n, k = 200, 72  # neither a multiple of the tiles
    gen = _host_generator(groups * 10 + (b_layout == "kn"), rank)
    counts = _random_counts(groups, max(1, 1000 // groups), gen)
    offsets, rows = _contiguous_layout(counts, gen)
    a = _randn((rows, k), dtype, 1 + groups, rank)
    b = _weights(groups, n, k, b_layout, dtype, 2 + groups, rank)
    out = torch.full((rows, n), NAN, dtype=out_dtype or dtype, device="cuda")
    got = weft.grouped_gemm(a, b, _i32(counts), _i32(offsets), out, b_layout=b_layout)
    torch.cuda.synchronize()
    assert got is out
    owned = _expect_contiguous(out, a.float(), b, b_layout, offsets, counts)
    assert _untouched(out, owned)
    # out allocated: the requested dtype and shape, the owned rows the same.
    fresh = weft.grouped_gemm(a, b, _i32(counts), _i32(offsets), b_layout=b_layout, out_dtype=out_dtype)
    torch.cuda.synchronize()
    assert fresh.dtype == (out_dtype or dtype) and fresh.shape == (rows, n)
    assert torch.equal(fresh[owned], out[owned])


@pytest.mark.parametrize("b_layout", ["nk", "kn"])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@pytest.mark.parametrize("groups,capacity", [(1, 1000), (3, 150), (8, 64), (32, 40)])
def test_masked_empty_full_and_partial_groups(rank, groups, capacity, out_dtype, b_layout):
    n, k = 200, 72
    gen = _host_generator(100 + groups, rank)
    counts = torch.randint(1, capacity, (groups,), generator=gen).tolist()
    counts[0] = capacity  # full
    if groups > 1:
        counts[-1] = 0    # empty
    a = _randn((groups, capacity, k), torch.bfloat16, 3 + groups, rank)
    b = _weights(groups, n, k, b_layout, torch.bfloat16, 4 + groups, rank)
    out = torch.full((groups, capacity, n), NAN, dtype=out_dtype or torch.bfloat16, device="cuda")
    got = weft.grouped_gemm(a, b, _i32(counts), None, out, b_layout=b_layout,
                            expected_rows_per_group=sum(counts) // groups)
    torch.cuda.synchronize()
    assert got is out
    owned = _expect_masked(out, a.float(), b, b_layout, counts)
    assert _untouched(out, owned)


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_one_hot_expert_and_every_other_empty(rank, layout):
    groups, hot, n, k = 32, 11, 256, 128
    counts = [0] * groups
    counts[hot] = 1000
    b = _weights(groups, n, k, "nk", torch.bfloat16, 5, rank)
    if layout == "contiguous":
        offsets = [7] * groups  # the empty groups' offsets point anywhere inside a
        offsets[hot] = 24
        a = _randn((1040, k), torch.bfloat16, 6, rank)
        out = torch.full((1040, n), NAN, dtype=torch.bfloat16, device="cuda")
        weft.grouped_gemm(a, b, _i32(counts), _i32(offsets), out, sm_budget=16)
        torch.cuda.synchronize()
        owned = _expect_contiguous(out, a.float(), b, "nk", offsets, counts)
    else:
        a = _randn((groups, 1000, k), torch.bfloat16, 6, rank)
        out = torch.full((groups, 1000, n), NAN, dtype=torch.bfloat16, device="cuda")
        weft.grouped_gemm(a, b, _i32(counts), out=out)
        torch.cuda.synchronize()
        owned = _expect_masked(out, a.float(), b, "nk", counts)
    assert int(owned.sum()) == 1000 and _untouched(out, owned)


def test_one_row_and_an_output_whose_rows_need_padding(rank):
    # One row of one group; then N = 100 (bf16 rows of 200 bytes, not a multiple of 16): grouped_gemm allocates padded
    # rows and returns a contiguous copy.
    a = _randn((1, 64), torch.bfloat16, 7, rank)
    b = _weights(1, 100, 64, "nk", torch.bfloat16, 8, rank)
    out = weft.grouped_gemm(a, b, _i32([1]), _i32([0]))
    torch.cuda.synchronize()
    assert out.shape == (1, 100) and out.is_contiguous()
    assert rel_error(out, a.float() @ _expert(b, 0, "nk")) < TOL[torch.bfloat16]
    a3 = _randn((2, 33, 64), torch.bfloat16, 9, rank)
    b2 = _weights(2, 100, 64, "nk", torch.bfloat16, 10, rank)
    out = weft.grouped_gemm(a3, b2, _i32([33, 5]))
    torch.cuda.synchronize()
    assert out.shape == (2, 33, 100) and out.is_contiguous()
    _expect_masked(out, a3.float(), b2, "nk", [33, 5])
    # b [G, K, N] with rows of 200 bytes: only the op sees the strides, and says so naming b.
    with pytest.raises(weft.Error, match="grouped_gemm: b's stride 1 must be a multiple of 16 bytes"):
        weft.grouped_gemm(a3, b2.transpose(1, 2).contiguous(), _i32([33, 5]), b_layout="kn")


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_masked_fp8_rows_match_their_dequantised_values(rank, out_dtype):
    groups, capacity, n, k = 4, 96, 200, 256
    counts = [96, 0, 37, 1]
    codes = (_randn((groups, capacity, k), torch.float32, 11, rank) * 4).to(torch.float8_e4m3fn)
    scales = _randn((groups, capacity, k // 128), torch.float32, 12, rank).abs() * 0.05 + 0.01
    b = _weights(groups, n, k, "nk", torch.bfloat16, 13, rank)
    # The op rounds each dequantised value once to bf16 before the bf16 GEMM.
    values = (codes.float() * scales.repeat_interleave(128, dim=2)).to(torch.bfloat16).float()
    out = torch.full((groups, capacity, n), NAN, dtype=out_dtype or torch.bfloat16, device="cuda")
    got = weft.grouped_gemm(codes, b, _i32(counts), out=out, a_scales=scales)
    torch.cuda.synchronize()
    assert got is out
    owned = _expect_masked(out, values, b, "nk", counts)
    assert _untouched(out, owned)
    fresh = weft.grouped_gemm(codes, b, _i32(counts), a_scales=scales, out_dtype=out_dtype)
    torch.cuda.synchronize()
    assert fresh.dtype == (out_dtype or torch.bfloat16) and torch.equal(fresh[owned], out[owned])


def test_bad_counts_are_clamped_recorded_and_raised(rank):
    n, k = 128, 64
    b = _weights(4, n, k, "nk", torch.bfloat16, 14, rank)
    # masked: group 1 holds more rows than the capacity; its first `capacity` rows are computed.
    a = _randn((4, 64, k), torch.bfloat16, 15, rank)
    status = weft.grouped_status()
    assert status.dtype == torch.int32 and status.shape == (4,) and not status.any()
    out = torch.full((4, 64, n), NAN, dtype=torch.bfloat16, device="cuda")
    weft.grouped_gemm(a, b, _i32([10, 100, 64, 0]), out=out, status=status)
    assert status.tolist() == [2, 1, 100, 64]
    with pytest.raises(weft.Error, match="grouped_gemm: group 1 has 100 rows, over the capacity 64"):
        weft.check_grouped_status(status)
    owned = _expect_masked(out, a.float(), b, "nk", [10, 100, 64, 0])
    assert _untouched(out, owned)
    # Good counts leave a zeroed record zero.
    status.zero_()
    weft.grouped_gemm(a, b, _i32([10, 64, 64, 0]), out=out, status=status)
    weft.check_grouped_status(status)
    # contiguous: group 3's rows run past a's 80 rows; a negative count is refused too (the first bad group wins).
    a2 = _randn((80, k), torch.bfloat16, 16, rank)
    out2 = torch.full((80, n), NAN, dtype=torch.bfloat16, device="cuda")
    status.zero_()
    weft.grouped_gemm(a2, b, _i32([5, 0, 10, 100]), _i32([0, 5, 10, 50]), out2, status=status)
    assert status.tolist() == [3, 3, 150, 80]
    with pytest.raises(weft.Error, match="grouped_gemm: group 3's rows end at 150 .* outside a's 80 rows"):
        weft.check_grouped_status(status)
    owned = _expect_contiguous(out2, a2.float(), b, "nk", [0, 5, 10, 50], [5, 0, 10, 30])
    assert _untouched(out2, owned)
    status.zero_()
    weft.grouped_gemm(a2, b, _i32([5, -2, 10, 3]), _i32([0, 5, 10, 50]), out2, status=status)
    assert status.tolist() == [1, 1, -2, 0]
    with pytest.raises(TypeError, match="status: expected dtype int32"):
        weft.grouped_gemm(a2, b, _i32([1, 1, 1, 1]), _i32([0, 1, 2, 3]), status=torch.zeros(4, device="cuda"))


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_a_captured_call_reads_the_counts_of_each_replay(rank, layout):
    groups, n, k = 8, 200, 72
    b = _weights(groups, n, k, "kn", torch.bfloat16, 17, rank)
    first = [60, 0, 17, 64, 1, 33, 0, 64]
    replays = ([5, 64, 0, 63, 64, 1, 20, 0], [0] * groups, first)
    if layout == "contiguous":
        offsets = [8 + 70 * g for g in range(groups)]  # 64-row segments with 6 rows between them
        a = _randn((8 + 70 * groups, k), torch.bfloat16, 18, rank)
        out = torch.full((a.shape[0], n), NAN, dtype=torch.bfloat16, device="cuda")
        offsets_t = _i32(offsets)
    else:
        offsets_t = None
        a = _randn((groups, 64, k), torch.bfloat16, 18, rank)
        out = torch.full((groups, 64, n), NAN, dtype=torch.bfloat16, device="cuda")
    counts = _i32(first)
    # On a side stream first: the kernel loads there, outside the capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        weft.grouped_gemm(a, b, counts, offsets_t, out, b_layout="kn")
    side.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weft.grouped_gemm(a, b, counts, offsets_t, out, b_layout="kn")
    for replay_counts in replays:
        counts.copy_(_i32(replay_counts))  # in place: the graph reads these at replay
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        if layout == "contiguous":
            owned = _expect_contiguous(out, a.float(), b, "kn", offsets, replay_counts)
        else:
            owned = _expect_masked(out, a.float(), b, "kn", replay_counts)
        assert int(owned.sum()) == sum(replay_counts) and _untouched(out, owned)
