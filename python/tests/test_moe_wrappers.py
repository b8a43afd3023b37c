# SPDX-License-Identifier: MIT
# The grouped GEMM wrapper's argument checks without a GPU (skipped where torch is absent): what it refuses before the
# extension is called, each error naming the argument, and what it passes to the extension. Past a's own checks the
# wrapper compares every tensor with a's device: _grouped_args with the CPU as that device reaches them here.
import pytest

torch = pytest.importorskip("torch")

import weft  # noqa: E402
from weft import _moe, _weft  # noqa: E402

_NAMES = ("grouped_gemm_contiguous", "grouped_gemm_masked", "grouped_gemm_masked_fp8")
_CPU = torch.device("cpu")
_FP8 = getattr(torch, "float8_e4m3fn", None)


@pytest.fixture
def calls(monkeypatch):
    made = []
    for name in _NAMES:
        monkeypatch.setattr(_weft, name, lambda *args, _name=name: made.append((_name, args)))
    return made


def _args(a, b, counts, offsets=None, out=None, *, b_layout="nk", out_dtype=None, a_scales=None,
          expected_rows_per_group=0, sm_budget=0, status=None):
    """grouped_gemm's checks with the CPU as a's device: (the extension's function, its arguments before device,
    after stream, out, the padded allocation or None)."""
    return _moe._grouped_args(a, b, counts, offsets, out, b_layout, out_dtype, a_scales, expected_rows_per_group,
                              sm_budget, status, device=_CPU)


def _i32(*shape):
    return torch.zeros(shape, dtype=torch.int32)


def _bf16(*shape):
    return torch.zeros(shape, dtype=torch.bfloat16)


def test_grouped_gemm_refuses_bad_arguments_before_the_extension(calls):
    a, b, counts = _bf16(16, 64), _bf16(3, 32, 64), _i32(3)
    with pytest.raises(TypeError, match="a: expected a torch.Tensor, got list"):
        weft.grouped_gemm([1.0], b, counts, _i32(3))
    with pytest.raises(ValueError, match=r"a: expected a 2-D tensor \[rows, K\] \(contiguous layout\) or a 3-D one "
                                         r"\[G, capacity, K\] \(masked layout\), got shape \(1024,\)"):
        weft.grouped_gemm(a.reshape(-1), b, counts, _i32(3))
    with pytest.raises(ValueError, match="a: expected a CUDA tensor, got one on cpu"):
        weft.grouped_gemm(a, b, counts, _i32(3))
    with pytest.raises(ValueError, match="a: expected a CUDA tensor, got one on meta"):
        weft.grouped_gemm(a.to("meta"), b, counts, _i32(3))
    # Scalars before tensors.
    with pytest.raises(ValueError, match="b_layout: expected 'nk' or 'kn', got 'tn'"):
        weft.grouped_gemm(a, b, counts, _i32(3), b_layout="tn")
    with pytest.raises(ValueError, match="b_layout: expected 'nk' or 'kn', got 1"):
        weft.grouped_gemm(a, b, counts, _i32(3), b_layout=1)
    with pytest.raises(ValueError, match=r"expected_rows_per_group: expected an integer in \[0, 9223372036854775807\], "
                                         r"got -1"):
        weft.grouped_gemm(a, b, counts, _i32(3), expected_rows_per_group=-1)
    with pytest.raises(TypeError, match="sm_budget: expected an integer, got str"):
        weft.grouped_gemm(a, b, counts, _i32(3), sm_budget="8")
    with pytest.raises(ValueError, match=r"sm_budget: expected an integer in \[0, 2147483647\], got -2"):
        weft.grouped_gemm(a, b, counts, _i32(3), sm_budget=-2)
    assert calls == []


def test_every_tensor_argument_is_checked_naming_it(calls):
    a, b, counts, offsets = _bf16(16, 64), _bf16(3, 32, 64), _i32(3), _i32(3)
    with pytest.raises(TypeError, match="a: expected dtype bfloat16 or float16, got float32"):
        _args(a.float(), b, counts, offsets)
    with pytest.raises(TypeError, match="b: expected dtype bfloat16, got float16"):
        _args(a, b.half(), counts, offsets)
    with pytest.raises(TypeError, match="b: expected a torch.Tensor, got NoneType"):
        _args(a, None, counts, offsets)
    with pytest.raises(ValueError, match=r"b: expected a 3-D tensor, got shape \(32, 64\)"):
        _args(a, b[0], counts, offsets)
    with pytest.raises(ValueError, match=r"b: expected \[G, N, K\] \(b_layout 'nk'\) with a's K = 64, got shape "
                                         r"\(3, 64, 32\)"):
        _args(a, b.transpose(1, 2), counts, offsets)
    with pytest.raises(ValueError, match=r"b: expected \[G, K, N\] \(b_layout 'kn'\) with a's K = 64, got shape "
                                         r"\(3, 32, 64\)"):
        _args(a, b, counts, offsets, b_layout="kn")
    with pytest.raises(ValueError, match=r"b: expected a tensor on cpu \(a's device\), got one on meta"):
        _args(a, b.to("meta"), counts, offsets)
    with pytest.raises(TypeError, match="counts: expected dtype int32, got int64"):
        _args(a, b, counts.long(), offsets)
    with pytest.raises(ValueError, match=r"counts: expected 3 values \(one per group: b's first extent\), got shape "
                                         r"\(4,\)"):
        _args(a, b, _i32(4), offsets)
    with pytest.raises(ValueError, match="counts: expected a contiguous tensor, got stride 2"):
        _args(a, b, _i32(6)[::2], offsets)
    with pytest.raises(ValueError, match=r"counts: expected a tensor on cpu \(a's device\), got one on meta"):
        _args(a, b, counts.to("meta"), offsets)
    with pytest.raises(ValueError, match=r"offsets: the contiguous layout \(a 2-D a\) needs them"):
        _args(a, b, counts)
    with pytest.raises(ValueError, match=r"offsets: expected 3 values .* got shape \(2,\)"):
        _args(a, b, counts, _i32(2))
    with pytest.raises(TypeError, match="offsets: expected a torch.Tensor, got list"):
        _args(a, b, counts, [0, 4, 8])
    with pytest.raises(ValueError, match=r"offsets: the masked layout \(a 3-D a: group g's rows are a\[g, "
                                         r":counts\[g\]\]\) takes none, got Tensor"):
        _args(_bf16(3, 8, 64), b, counts, offsets)
    with pytest.raises(ValueError, match=r"a: expected \[G, capacity, K\] with G = 3 \(b's groups\), got shape "
                                         r"\(2, 8, 64\)"):
        _args(_bf16(2, 8, 64), b, counts)
    with pytest.raises(ValueError, match="a_scales: only fp8 .* takes scales, got a of dtype torch.bfloat16"):
        _args(a, b, counts, offsets, a_scales=torch.zeros((3, 8, 1)))
    with pytest.raises(TypeError, match="out_dtype: expected torch.bfloat16 or torch.float32, got torch.float16"):
        _args(a, b, counts, offsets, out_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"out: expected shape \(16, 32\), got \(16, 33\)"):
        _args(a, b, counts, offsets, _bf16(16, 33))
    with pytest.raises(TypeError, match="out: expected dtype bfloat16 or float32, got float16"):
        _args(a, b, counts, offsets, torch.zeros((16, 32), dtype=torch.float16))
    with pytest.raises(TypeError, match="out: expected dtype float32, got bfloat16"):
        _args(a, b, counts, offsets, _bf16(16, 32), out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"out: expected a 3-D tensor, got shape \(24, 32\)"):
        _args(_bf16(3, 8, 64), b, counts, out=_bf16(24, 32))
    with pytest.raises(ValueError, match=r"status: expected an int32 tensor of 4 contiguous elements "
                                         r"\(weft.grouped_status\(\)\), got shape \(3,\)"):
        _args(a, b, counts, offsets, status=_i32(3))
    with pytest.raises(TypeError, match="status: expected dtype int32, got int64"):
        _args(a, b, counts, offsets, status=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"a: expected a tensor whose bytes are its values, got a negative view"):
        _args(torch._neg_view(a), b, counts, offsets)
    assert calls == []


@pytest.mark.skipif(_FP8 is None, reason="this torch has no float8_e4m3fn")
def test_fp8_rows_need_the_masked_layout_and_their_scales(calls):
    b, counts = _bf16(2, 32, 256), _i32(2)
    codes = torch.zeros((2, 8, 256), dtype=_FP8)
    with pytest.raises(TypeError, match=r"a: fp8 \(float8_e4m3fn\) rows are taken in the masked layout only"):
        _args(codes[0], b, counts, _i32(2))
    with pytest.raises(ValueError, match=r"a_scales: fp8 a needs its scales, a float32 \[G, capacity, K / 128\]"):
        _args(codes, b, counts)
    with pytest.raises(ValueError, match="a: fp8 rows need K a multiple of 128 .* got K = 64"):
        _args(codes[..., :64], b[..., :64], counts, a_scales=torch.zeros((2, 8, 1)))
    with pytest.raises(ValueError, match=r"a_scales: expected shape \(2, 8, 2\) \(\[G, capacity, K / 128\]\), got "
                                         r"\(2, 8, 1\)"):
        _args(codes, b, counts, a_scales=torch.zeros((2, 8, 1)))
    with pytest.raises(TypeError, match="a_scales: expected dtype float32, got bfloat16"):
        _args(codes, b, counts, a_scales=_bf16(2, 8, 2))
    with pytest.raises(TypeError, match="b: expected dtype bfloat16, got float16"):
        _args(codes, b.half(), counts, a_scales=torch.zeros((2, 8, 2)))
    with pytest.raises(TypeError, match="out_dtype: expected torch.bfloat16 or torch.float32"):
        _args(codes, b, counts, a_scales=torch.zeros((2, 8, 2)), out_dtype=torch.float16)
    call, head, tail, out, padded = _args(codes, b, counts, a_scales=torch.zeros((2, 8, 2)), status=_i32(4))
    assert call is _weft.grouped_gemm_masked_fp8 and padded is None
    a_view, scales_view, b_view, d_view, layout, counts_view, workspace = head
    assert a_view.dtype == _weft.DTYPES["f8e4m3"] and a_view.shape == [2, 8, 256]
    assert scales_view.dtype == _weft.DTYPES["f32"] and scales_view.shape == [2, 8, 2]
    assert workspace.dtype == _weft.DTYPES["bf16"] and workspace.shape == [2, 8, 256] and workspace.is_contiguous()
    assert out.dtype == torch.bfloat16 and out.shape == (2, 8, 32) and d_view.ptr == out.data_ptr()
    assert layout == 0 and counts_view.ptr == counts.data_ptr() and tail[2].shape == [4]
    assert calls == []


def test_the_views_go_to_the_extension_in_its_order(calls):
    a, b_kn, counts, offsets = _bf16(40, 64), _bf16(3, 64, 48), _i32(3), _i32(3)
    call, head, tail, out, padded = _args(a, b_kn, counts, offsets, b_layout="kn", out_dtype=torch.float32,
                                          expected_rows_per_group=12, sm_budget=7)
    assert call is _weft.grouped_gemm_contiguous and padded is None
    a_view, b_view, d_view, layout, offsets_view, counts_view = head
    assert (a_view.ptr, b_view.ptr, d_view.ptr) == (a.data_ptr(), b_kn.data_ptr(), out.data_ptr())
    assert b_view.shape == [3, 64, 48] and layout == 1
    assert out.dtype == torch.float32 and out.shape == (40, 48) and d_view.dtype == _weft.DTYPES["f32"]
    assert (offsets_view.ptr, counts_view.ptr) == (offsets.data_ptr(), counts.data_ptr())
    assert offsets_view.dtype == counts_view.dtype == _weft.DTYPES["i32"]
    assert tail == (7, 12, None)

    # Masked, out given: written in place; an out of either dtype is taken when out_dtype is None.
    a3, b_nk = _bf16(3, 16, 64), _bf16(3, 48, 64)
    given = torch.full((3, 16, 48), float("nan"))
    call, head, tail, out, padded = _args(a3, b_nk, counts, out=given)
    assert call is _weft.grouped_gemm_masked and out is given and padded is None
    assert len(head) == 5 and head[2].ptr == given.data_ptr() and head[3] == 0 and head[4].ptr == counts.data_ptr()
    assert tail == (0, 0, None)

    # N not a multiple of 16 bytes' elements: an allocated out's rows are padded to 16 bytes (the op's TMA stores);
    # grouped_gemm returns a contiguous copy.
    call, head, tail, out, padded = _args(a3, _bf16(3, 20, 64), counts)
    assert out.shape == (3, 16, 20) and out.stride() == (16 * 24, 24, 1) and padded.shape == (3, 16, 24)
    assert head[2].strides == [16 * 24, 24, 1]
    assert calls == []


def test_check_grouped_status_names_the_group_and_passes_a_zero_record():
    weft.check_grouped_status(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(weft.Error, match="grouped_gemm: group 5 has 300 rows, over the capacity 256"):
        weft.check_grouped_status(torch.tensor([2, 5, 300, 256], dtype=torch.int32))
    with pytest.raises(weft.Error, match="grouped_gemm: group 1 has a negative row count -3"):
        weft.check_grouped_status(torch.tensor([1, 1, -3, 0], dtype=torch.int32))
    with pytest.raises(weft.Error, match="grouped_gemm: group 0's rows end at 90 .* outside a's 64 rows"):
        weft.check_grouped_status(torch.tensor([3, 0, 90, 64], dtype=torch.int32))
    with pytest.raises(TypeError, match="status: expected the int32 tensor of 4 elements given to grouped_gemm"):
        weft.check_grouped_status(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"device: expected a CUDA device \(the status lives beside a\), got cpu"):
        weft.grouped_status("cpu")


def test_the_grouped_gemm_ops_are_exported():
    for name in ("grouped_gemm", "grouped_status", "check_grouped_status"):
        assert name in weft.__all__ and callable(getattr(weft, name))


def test_moe_route_refuses_what_is_no_top_k_index_list_on_a_gpu(monkeypatch):
    monkeypatch.setattr(_weft, "moe_route", lambda *args: pytest.fail("the extension was called"))
    with pytest.raises(TypeError, match="topk_idx: expected a torch.Tensor, got list"):
        weft.moe_route([[0, 1]], 4)
    with pytest.raises(ValueError, match=r"topk_idx: expected a 2-D tensor, got shape \(8,\)"):
        weft.moe_route(_i32(8), 4)
    with pytest.raises(ValueError, match="topk_idx: expected a CUDA tensor, got one on cpu"):
        weft.moe_route(_i32(4, 2), 4)
    with pytest.raises(ValueError, match="device: expected a CUDA device"):
        weft.moe_routing_status("cpu")
    assert weft.moe_gathered_rows(10, 2, 4, 8) == 10 * 2 + 4 * 7


def test_a_routing_checks_its_arrays_against_its_sizes():
    r = weft.MoeRouting(_i32(4), _i32(5), _i32(12), _i32(6), 3, 2)
    assert (r.num_experts, r.rows_capacity, r.tokens, r.topk) == (4, 12, 3, 2)
    views = r._views(_CPU)
    assert [tuple(v.shape) for v in views[:4]] == [(4,), (5,), (12,), (6,)] and views[4:] == (3, 2)
    with pytest.raises(ValueError, match=r"routing.slot_rows: expected 6 values, got shape \(5,\)"):
        weft.MoeRouting(_i32(4), _i32(5), _i32(12), _i32(5), 3, 2)._views(_CPU)
    with pytest.raises(TypeError, match="routing.counts: expected dtype int32, got int64"):
        weft.MoeRouting(_i32(4).long(), _i32(5), _i32(12), _i32(6), 3, 2)._views(_CPU)
    with pytest.raises(ValueError, match="routing.gather_index: expected a contiguous tensor, got stride 2"):
        weft.MoeRouting(_i32(4), _i32(5), _i32(24)[::2], _i32(6), 3, 2)._views(_CPU)


def _routing(tokens=4, topk=2, experts=3, rows=10):
    return weft.MoeRouting(_i32(experts), _i32(experts + 1), _i32(rows), _i32(tokens * topk), tokens, topk)


def test_the_gathered_ops_check_their_operands_naming_them():
    r = _routing()
    a, b = _bf16(4, 16), _bf16(3, 24, 16)
    av, bv, n, route = _moe._gathered_operands(a, b, r, "nk", device=_CPU)
    assert n == 24 and tuple(av.shape) == (4, 16) and route[4:] == (4, 2)
    assert _moe._gathered_operands(a, b.transpose(1, 2), r, "kn", device=_CPU)[2] == 24
    with pytest.raises(ValueError, match=r"a: expected routing's 4 tokens as rows, got shape \(5, 16\)"):
        _moe._gathered_operands(_bf16(5, 16), b, r, "nk", device=_CPU)
    with pytest.raises(ValueError, match=r"b: expected \[E, N, K\] \(b_layout 'nk'\) with E = routing's 3 experts and "
                                         r"a's K = 16, got shape \(2, 24, 16\)"):
        _moe._gathered_operands(a, b[:2], r, "nk", device=_CPU)
    with pytest.raises(TypeError, match="routing: expected a weft.MoeRouting"):
        _moe._gathered_operands(a, b, None, "nk", device=_CPU)
    with pytest.raises(TypeError, match="a: expected dtype bfloat16, got float16"):
        _moe._gathered_operands(a.half(), b, r, "nk", device=_CPU)
    with pytest.raises(ValueError, match="b_layout: expected 'nk' or 'kn', got 'tn'"):
        _moe._gathered_operands(a, b, r, "tn", device=_CPU)
    with pytest.raises(ValueError, match="a: expected a CUDA tensor, got one on cpu"):
        weft.grouped_gemm_gathered(a, b, r)


def test_the_combine_sizes_its_output_and_checks_its_weights():
    r = _routing()
    out, ov, weights, weighted = _moe._combine_args(r, None, None, False, None, 24, _CPU)
    assert out.shape == (4, 24) and out.dtype == torch.bfloat16 and weights is None and weighted
    out, _, _, weighted = _moe._combine_args(r, None, None, True, torch.float32, 24, _CPU)
    assert out.shape == (8, 24) and out.dtype == torch.float32 and not weighted
    w = torch.zeros(4, 2)
    assert tuple(_moe._combine_args(r, w, None, False, None, 24, _CPU)[2].shape) == (4, 2)
    with pytest.raises(ValueError, match="topk_weights: per_slot=True writes each slot's row unweighted"):
        _moe._combine_args(r, w, None, True, None, 24, _CPU)
    with pytest.raises(ValueError, match=r"topk_weights: expected a contiguous \[4, 2\] tensor"):
        _moe._combine_args(r, w.t(), None, False, None, 24, _CPU)
    with pytest.raises(ValueError, match=r"out: expected shape \(4, 24\), got \(4, 16\)"):
        _moe._combine_args(r, None, _bf16(4, 16), False, None, 24, _CPU)
    with pytest.raises(TypeError, match="out_dtype: expected torch.bfloat16 or torch.float32, got torch.float16"):
        _moe._combine_args(r, None, None, False, torch.float16, 24, _CPU)
    with pytest.raises(ValueError, match="d_rows: expected a CUDA tensor, got one on cpu"):
        weft.moe_combine(torch.zeros(10, 24), r)
