# SPDX-License-Identifier: MIT
# The collectives' Python wrappers without a GPU (skipped where torch is absent): a stand-in World whose device, for
# the wrappers' checks, is the CPU, and the extension's op calls recorded instead of run. What the wrappers pass to
# the extension (pointers, element counts, dtype codes, stream, algorithm, team) and the errors they raise.
import pytest

torch = pytest.importorskip("torch")

import weft  # noqa: E402
from weft import _runtime, _tensor, _weft  # noqa: E402

_STREAM = 0x5000


class _StandInWorld:
    rank, num_ranks, device, closed = 0, 2, 0, False


class _StandInCppTeam:
    rank, num_ranks, is_member, id = 0, 1, True, "t0"


def _team(is_member=True):
    """A weft.Team of rank 0 alone, as Team.__init__ leaves it (or a team rank 0 is not a member of)."""
    team = object.__new__(_runtime.Team)
    team._team = team._cpp = _StandInCppTeam()
    team._is_member, team._id, team.ranks, team.handle = is_member, "t0", [0] if is_member else [1], 0
    team._state = _runtime._state  # the stand-in World's (set by the calls fixture)
    return team


@pytest.fixture
def calls(monkeypatch):
    """The extension's calls, recorded as (name, arguments); the World's device is the CPU for the checks."""
    made = []
    for name in ("all_reduce_flat", "all_gather_flat", "reduce_scatter_flat", "all_to_all_flat", "all_to_all_v_flat",
                 "ulysses", "count_refused_collective_call"):
        monkeypatch.setattr(_weft, name, lambda *args, _name=name: made.append((_name, args)))
    state = _runtime._State(_StandInWorld(), None, None)
    ctx = state.call_context = _tensor.CallContext(state.world)
    ctx.device = torch.device("cpu")
    ctx.stream = lambda device: _STREAM + device
    _runtime._state = state
    yield made
    _runtime._state = None


def test_the_stream_lookup_is_torchs_raw_current_stream():
    _tensor.torch_module()
    if hasattr(torch._C, "_cuda_getCurrentRawStream"):
        assert _tensor._raw_stream is torch._C._cuda_getCurrentRawStream


def test_all_reduce_passes_pointers_counts_dtype_stream_and_algorithm(calls):
    world = _runtime._state.world
    x, out = torch.zeros(3, 4), torch.zeros(12)
    assert weft.all_reduce(x) is x
    assert weft.all_reduce(x, out, algo="one_shot") is out
    f32, one_shot = _weft.DTYPES["f32"], _weft.parse_algo("all_reduce", "one_shot")
    auto = _weft.parse_algo("all_reduce", "auto")
    assert calls == [
        ("all_reduce_flat", (world, x.data_ptr(), x.data_ptr(), 12, f32, _STREAM, auto, None)),
        ("all_reduce_flat", (world, x.data_ptr(), out.data_ptr(), 12, f32, _STREAM, one_shot, None)),
    ]


def test_all_gather_and_reduce_scatter_allocate_their_output(calls):
    x = torch.zeros(4, 3, dtype=torch.bfloat16)
    gathered = weft.all_gather(x)
    scattered = weft.reduce_scatter(x)
    assert gathered.shape == (8, 3) and gathered.dtype == torch.bfloat16
    assert scattered.shape == (2, 3) and scattered.dtype == torch.bfloat16
    assert weft.all_gather(torch.zeros((), dtype=torch.int32)).shape == (2,)
    bf16, i32 = _weft.DTYPES["bf16"], _weft.DTYPES["i32"]
    assert calls[0][1][1:6] == (x.data_ptr(), 12, gathered.data_ptr(), 24, bf16)
    assert calls[1][1][1:6] == (x.data_ptr(), 12, scattered.data_ptr(), 6, bf16)
    assert calls[2][0] == "all_gather_flat" and calls[2][1][2] == 1 and calls[2][1][4:6] == (2, i32)


def test_a_team_passes_its_cpp_team_and_a_non_member_is_refused(calls):
    team = _team()
    weft.all_reduce(torch.zeros(4), team=team)
    assert calls[-1][1][-1] is team._cpp
    weft.all_gather(torch.zeros(4), team=team)
    assert calls[-1][1][4] == 4  # a team of one gathers one slice
    with pytest.raises(weft.Error, match="all_reduce: world rank 0 is not a member of"):
        weft.all_reduce(torch.zeros(4), team=_team(is_member=False))


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions.*deprecated")
def test_argument_errors_name_the_argument(calls):
    x = torch.zeros(16)
    with pytest.raises(TypeError, match="tensor: expected a torch.Tensor, got list"):
        weft.all_reduce([1.0])
    with pytest.raises(ValueError, match=r"tensor: expected a tensor on cuda:0 \(this rank's GPU\), got one on meta"):
        weft.all_reduce(torch.zeros(16, device="meta"))
    with pytest.raises(TypeError, match="tensor: expected dtype bfloat16 or float16 or float32, got int32"):
        weft.all_reduce(torch.zeros(16, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"tensor: expected a contiguous tensor \(shape \(4, 4\), strides \(1, 4\)\)"):
        weft.all_reduce(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match=r"out: expected 16 elements, got 8 \(shape \(8,\)\)"):
        weft.all_reduce(x, torch.zeros(8))
    with pytest.raises(TypeError, match="out: expected dtype torch.float32, got torch.bfloat16"):
        weft.all_reduce(x, torch.zeros(16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out: expected a contiguous tensor"):
        weft.all_reduce(x, torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="algo: 'fast' is not an algorithm of all_reduce"):
        weft.all_reduce(x, algo="fast")
    with pytest.raises(TypeError, match="algo: expected an algorithm name"):
        weft.all_gather(x, algo=3)
    with pytest.raises(ValueError, match=r"tensor: expected dim 0 a multiple of the 2 ranks, got shape \(3,\)"):
        weft.reduce_scatter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"out: expected 32 elements"):
        weft.all_gather(x, torch.zeros(16))
    # all_gather moves bytes: any dtype (test_all_gather_moves_any_dtype_as_bytes), but not a tensor whose bytes are
    # not its values.
    with pytest.raises(ValueError, match="tensor: expected a contiguous tensor"):
        weft.all_gather(torch.zeros(4, 4, dtype=torch.float64).t())
    refused = 15
    if hasattr(torch, "quantize_per_tensor"):  # deprecated in torch
        refused += 1
        with pytest.raises(TypeError, match=r"tensor: weft moves a tensor's bytes, and a quantized tensor \(qint8\) "
                                            r"keeps its scale and zero point outside them: pass t.int_repr\(\)"):
            weft.all_gather(torch.quantize_per_tensor(torch.zeros(4), 0.5, 0, torch.qint8))
    z = torch.zeros(4, dtype=torch.complex64)
    with pytest.raises(ValueError, match=r"tensor: expected a tensor whose bytes are its values, got a conjugate view "
                                         r"\(is_conj\(\)\); call .resolve_conj\(\)"):
        weft.all_gather(z.conj())
    with pytest.raises(ValueError, match=r"out: expected a tensor whose bytes are its values, got a conjugate view"):
        weft.all_gather(z, torch.zeros(8, dtype=torch.complex64).conj())
    with pytest.raises(ValueError, match=r"tensor: expected a tensor whose bytes are its values, got a negative view "
                                         r"\(is_neg\(\)\); call .resolve_neg\(\)"):
        weft.all_gather(torch._neg_view(torch.zeros(4)))
    # Every check fails before the op is called, and every refused call keeps its place in the team's sequence of
    # collective calls (a rank that goes on then fails its next call as a mismatch, not paired with its peers').
    world = _runtime._state.world
    assert calls == [("count_refused_collective_call", (world, None))] * refused


def test_the_reductions_refuse_a_negative_view_whose_bytes_are_not_its_values(calls):
    # A lazily negated view's bytes are the unnegated values: summed as they are, the result's sign would be wrong.
    x = torch.zeros(8)
    with pytest.raises(ValueError, match=r"tensor: expected a tensor whose bytes are its values, got a negative view"):
        weft.all_reduce(torch._neg_view(x))
    with pytest.raises(ValueError, match=r"tensor: expected a tensor whose bytes are its values, got a negative view"):
        weft.reduce_scatter(torch._neg_view(x))
    with pytest.raises(ValueError, match=r"out: expected a tensor whose bytes are its values, got a negative view"):
        weft.all_reduce(x, torch._neg_view(torch.zeros(8)))
    world = _runtime._state.world
    assert calls == [("count_refused_collective_call", (world, None))] * 3


_BYTE_DTYPES = [torch.bool, torch.int8, torch.int16, torch.uint16, torch.float64, torch.complex32, torch.complex64,
                torch.complex128] + [getattr(torch, name) for name in (
                    "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
                    "uint32", "uint64") if hasattr(torch, name)]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", _BYTE_DTYPES, ids=str)
def test_all_gather_moves_any_dtype_as_bytes(calls, dtype):
    # A dtype weft has no code for goes as its bytes (u8, numel * element_size of them); out keeps the tensor's dtype.
    x = torch.zeros(3, 5, dtype=dtype)
    nbytes = 15 * x.element_size()
    u8 = _weft.DTYPES["u8"]
    gathered = weft.all_gather(x)
    assert gathered.shape == (6, 5) and gathered.dtype == dtype
    out = torch.zeros(2, 3, 5, dtype=dtype)
    assert weft.all_gather(x, out) is out
    assert [call[0] for call in calls] == ["all_gather_flat"] * 2
    assert calls[0][1][1:6] == (x.data_ptr(), nbytes, gathered.data_ptr(), 2 * nbytes, u8)
    assert calls[1][1][1:6] == (x.data_ptr(), nbytes, out.data_ptr(), 2 * nbytes, u8)
    with pytest.raises(TypeError, match=f"out: expected dtype {dtype}, got torch.uint8"):
        weft.all_gather(x, torch.zeros(2 * nbytes, dtype=torch.uint8))  # the same bytes, but not the tensor's dtype


def test_the_all_gather_custom_op_takes_any_dtype(calls):
    import weft.torch  # noqa: F401 -- registers the ops

    x = torch.zeros(4, 2, dtype=torch.float64)
    out = weft.torch.all_gather(x)
    assert out.shape == (8, 2) and out.dtype == torch.float64
    assert calls == [("all_gather_flat", (_runtime._state.world, x.data_ptr(), 64, out.data_ptr(), 128,
                                          _weft.DTYPES["u8"], _STREAM, 0, None))]


def test_all_gather_passes_a_dtype_weft_knows_as_itself(calls):
    for dtype, code in ((torch.bfloat16, "bf16"), (torch.int64, "i64"), (torch.uint8, "u8"),
                        (torch.float8_e4m3fn, "f8e4m3")):
        x = torch.zeros(4, dtype=dtype)
        weft.all_gather(x)
        assert calls[-1][1][2] == 4 and calls[-1][1][5] == _weft.DTYPES[code]


def test_the_custom_op_allocates_its_output_and_calls_the_wrapper(calls):
    import weft.torch  # noqa: F401 -- registers the ops, for every device: a CPU tensor reaches the wrapper

    x = torch.ones(2, 3)
    out = torch.ops.weft.all_reduce(x)
    assert out.shape == x.shape and out.data_ptr() != x.data_ptr()
    assert calls == [("all_reduce_flat", (_runtime._state.world, x.data_ptr(), out.data_ptr(), 6,
                                          _weft.DTYPES["f32"], _STREAM, 0, None))]


def test_gemm_refuses_a_wrong_k_out_dtype_or_out_shape_naming_the_argument(calls):
    a, b = torch.zeros(4, 16, dtype=torch.bfloat16), torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"b: expected \[N, K\] \(b_layout 'nk'\) with a's K = 16, got shape \(8, 24\)"):
        weft.gemm(a, torch.zeros(8, 24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"b: expected \[K, N\] \(b_layout 'kn'\) with a's K = 16, got shape \(8, 16\)"):
        weft.gemm(a, b, b_layout="kn")
    with pytest.raises(TypeError, match="out_dtype: expected torch.bfloat16 \\(a's\\) or torch.float32, got torch.int32"):
        weft.gemm(a, b, out_dtype=torch.int32)
    with pytest.raises(TypeError, match="out: expected dtype bfloat16 or float32, got float16"):
        weft.gemm(a, b, torch.zeros(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"out: expected shape \(4, 8\), got \(4, 16\)"):
        weft.gemm(a, b, torch.zeros(4, 16, dtype=torch.bfloat16))
    assert calls == []


def _fused_op(cls, n, k, max_m, num_ranks=2):
    """A fused op object as its constructor leaves it, its C++ op a stand-in that fails the test if called."""
    op = object.__new__(cls)
    op._op, op._ctx, op._team = object(), _runtime._state.call_context, None
    op.dtype, op.n, op.k, op.max_m, op.num_ranks = torch.bfloat16, n, k, max_m, num_ranks
    return op


def test_fused_ops_refuse_a_wrong_dtype_shape_or_m_naming_the_argument(calls):
    with pytest.raises(TypeError, match="dtype: expected torch.bfloat16 or torch.float16, got torch.float32"):
        weft.AgGemm(64, 8, 16, torch.float32)
    with pytest.raises(TypeError, match="dtype: expected torch.bfloat16 or torch.float16, got torch.int8"):
        weft.GemmRs(64, 8, 16, torch.int8)
    ag = _fused_op(weft.AgGemm, 8, 16, 64)
    a_local, b = torch.zeros(4, 16, dtype=torch.bfloat16), torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"b: expected shape \(8, 16\) \(the op's \[n, k\]\), got \(8, 24\)"):
        ag.run(a_local, torch.zeros(8, 24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"a_local: expected 16 columns \(the op's k\), got shape \(4, 24\)"):
        ag.run(torch.zeros(4, 24, dtype=torch.bfloat16), b)
    with pytest.raises(ValueError, match="a_local: the call's M = 80 exceeds the op's max_m = 64"):
        ag.run(torch.zeros(40, 16, dtype=torch.bfloat16), b)
    with pytest.raises(ValueError, match=r"out: expected shape \(8, 8\), got \(4, 8\)"):
        ag.run(a_local, b, torch.zeros(4, 8, dtype=torch.bfloat16))
    rs = _fused_op(weft.GemmRs, 8, 16, 64)
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 8\), got \(4, 8\)"):
        rs.run(a_local, b, torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="a: the call's M = 80 exceeds the op's max_m = 64"):
        rs.run(torch.zeros(80, 16, dtype=torch.bfloat16), b)
    assert calls == []


def test_ep_calls_refuse_the_other_kind_of_handle_and_a_non_tensor(calls):
    from weft import ep

    buf = object.__new__(ep.Buffer)
    buf._ctx, buf.hidden = _runtime._state.call_context, 8
    low_latency, normal = object.__new__(ep.LowLatencyHandle), object.__new__(ep.NormalHandle)
    y = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"handle: ep combine expected a NormalHandle \(Buffer.make_normal_handle\(\)\), "
                                        "got LowLatencyHandle"):
        buf.combine(low_latency, y)
    with pytest.raises(TypeError, match="handle: ep dispatch expected a NormalHandle"):
        buf.dispatch(low_latency, y, None, None)
    with pytest.raises(TypeError, match="handle: ep low_latency_combine expected a LowLatencyHandle"):
        buf.low_latency_combine(normal, y)
    with pytest.raises(TypeError, match="handle: ep low_latency_dispatch expected a LowLatencyHandle"):
        buf.low_latency_dispatch(normal, y)
    with pytest.raises(TypeError, match="y: expected a torch.Tensor, got list"):
        buf.combine(normal, [1.0])


def test_ep_low_latency_combine_checks_topk_idx_before_making_out_from_it(calls):
    from weft import ep

    buf = object.__new__(ep.Buffer)
    buf._ctx, buf.hidden, buf.topk = _runtime._state.call_context, 8, 2
    handle = object.__new__(ep.LowLatencyHandle)
    weights = torch.zeros(4, 2, dtype=torch.float32)
    # topk_idx on another device than the World's, or no tensor: named as itself, not as the out made from it
    on_meta = torch.zeros(4, 2, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"topk_idx: expected a tensor on cuda:0 \(this rank's GPU\), got one on meta"):
        buf.low_latency_combine(handle, None, on_meta, weights, phase="recv")
    with pytest.raises(TypeError, match="topk_idx: expected a torch.Tensor, got list"):
        buf.low_latency_combine(handle, None, [[0, 1]], weights, phase="recv")
    with pytest.raises(TypeError, match="topk_idx: expected dtype int32, got int64"):
        buf.low_latency_combine(handle, None, torch.zeros(4, 2, dtype=torch.int64), weights, phase="recv")


class _StandInOp:
    """A C++ op (or its constructor's stand-in) that records its calls."""

    def __init__(self, *args, rows_capacity=0, **kwargs):
        self.runs, self.forwards, self.rows_capacity = [], [], rows_capacity

    def run(self, *args):
        self.runs.append(args)

    def forward(self, *args, **kwargs):
        self.forwards.append((args, kwargs))

    def close(self):
        pass


@pytest.mark.parametrize("collective_all_reduce,partial_dtype,counted",
                         [(True, None, True), (False, None, False), (True, torch.float32, False)])
def test_gemm_ar_calls_its_wrapper_refuses_keep_their_place_in_the_teams_calls(calls, monkeypatch,
                                                                                collective_all_reduce, partial_dtype,
                                                                                counted):
    # GemmAr's all-reduce is a collective call of its team where the C++ op takes that path (partials of the op's
    # dtype, n % 8 == 0): a call refused by the wrapper's own checks counts as the C++ op's refusals do (a rank that
    # goes on fails its next call on every rank instead of pairing with the peers' refused call); with the op's own
    # all-reduce kernel (no collective, or fp32 partials) nothing is counted.
    monkeypatch.setattr(_weft, "GemmAr", _StandInOp)
    world = _runtime._state.world
    op = weft.GemmAr(8, 16, 32, torch.bfloat16, collective_all_reduce=collective_all_reduce,
                     partial_dtype=partial_dtype)
    try:
        a, b = torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(16, 32, dtype=torch.bfloat16)
        bad = [
            (a, torch.zeros(16, 31, dtype=torch.bfloat16), None),  # b's shape
            (torch.zeros(4, 31, dtype=torch.bfloat16), b, None),  # a's columns
            (torch.zeros(9, 32, dtype=torch.bfloat16), b, None),  # M over max_m
            (a.float(), b, None),  # a's dtype
            (a, b, torch.zeros(5, 16, dtype=torch.bfloat16)),  # out's shape
        ]
        for args in bad:
            with pytest.raises((TypeError, ValueError)):
                op.run(*args)
        assert [c for c in calls if c[0] == "count_refused_collective_call"] == (
            [("count_refused_collective_call", (world, None))] * len(bad) if counted else [])
        out = op.run(a, b)
        assert out.shape == (4, 16) and len(op._op.runs) == 1
    finally:
        op._op = None  # the stand-in needs no collective close
        _runtime._unregister(op)


def test_sp_decode_attention_counts_the_calls_it_refuses(calls, monkeypatch):
    # A collective: each argument error is counted in the team's sequence of collective calls before it is raised.
    monkeypatch.setattr(_weft, "sp_decode_attention", lambda *args: calls.append(("sp_decode_attention", args)))
    q = torch.zeros((2, 4, 64), dtype=torch.bfloat16)  # on the stand-in World's device (the CPU)
    with pytest.raises(TypeError, match="q: expected a torch.Tensor, got list"):
        weft.sp_decode_attention([0.0], q, q, q, q)
    with pytest.raises(ValueError, match="q: expected a CUDA tensor, got one on cpu"):
        weft.sp_decode_attention(q, q, q, q, q)
    world = _runtime._state.world
    assert calls == [("count_refused_collective_call", (world, None))] * 2


def _moe_layer(cls, max_tokens=16, hidden=64, ffn=32, num_experts=4, topk=2, num_ranks=2, rows_capacity=40):
    """A TP MoE layer as its constructor leaves it, its C++ op a stand-in that records its calls."""
    op = object.__new__(cls)
    op._op, op._ctx, op._team = _StandInOp(rows_capacity=rows_capacity), _runtime._state.call_context, None
    op.max_tokens, op.hidden, op.ffn, op.num_experts, op.topk, op.num_ranks = (max_tokens, hidden, ffn, num_experts,
                                                                              topk, num_ranks)
    return op


def _zeros(*shape, dtype=torch.bfloat16):
    return torch.zeros(shape, dtype=dtype)


def test_moe_ag_grouped_gemm_passes_views_and_refuses_bad_arguments_naming_them(calls):
    up = _moe_layer(weft.MoeAgGroupedGemm)
    x, idx, w = _zeros(8, 64), _zeros(16, 2, dtype=torch.int32), _zeros(4, 32, 64)
    y = up.run(x, idx, w)
    assert y.shape == (40, 32) and y.dtype == torch.bfloat16
    (xv, iv, wv, yv, stream), = up._op.runs
    assert xv.ptr == x.data_ptr() and stream == _STREAM
    assert [tuple(v.shape) for v in (xv, iv, wv, yv)] == [(8, 64), (16, 2), (4, 32, 64), (40, 32)]
    with pytest.raises(ValueError, match=r"x_local: expected 64 columns \(hidden\), got shape \(8, 32\)"):
        up.run(x[:, :32], idx, w)
    with pytest.raises(ValueError, match=r"x_local: expected 1 to 8 rows \(max_tokens / ranks\), got shape \(9, 64\)"):
        up.run(_zeros(9, 64), _zeros(18, 2, dtype=torch.int32), w)
    with pytest.raises(TypeError, match="x_local: expected dtype bfloat16, got float16"):
        up.run(x.half(), idx, w)
    with pytest.raises(ValueError, match=r"topk_idx: expected a contiguous \[16, 2\] tensor"):
        up.run(x, idx[:8], w)
    with pytest.raises(TypeError, match="topk_idx: expected dtype int32, got int64"):
        up.run(x, idx.long(), w)
    with pytest.raises(ValueError, match=r"w: expected shape \(4, 32, 64\) \(\[num_experts, ffn, hidden\]\)"):
        up.run(x, idx, _zeros(4, 64, 32))
    with pytest.raises(ValueError, match=r"out: expected shape \(40, 32\), got \(39, 32\)"):
        up.run(x, idx, w, _zeros(39, 32))
    assert len(up._op.runs) == 1 and calls == []


def test_moe_grouped_gemm_rs_takes_a_routing_and_refuses_bad_arguments_naming_them(calls):
    down = _moe_layer(weft.MoeGroupedGemmRs)
    i32 = torch.int32
    routing = weft.MoeRouting(_zeros(4, dtype=i32), _zeros(5, dtype=i32), _zeros(40, dtype=i32),
                              _zeros(32, dtype=i32), 16, 2)
    h, w, weights = _zeros(40, 32), _zeros(4, 64, 32), _zeros(16, 2, dtype=torch.float32)
    out = down.run(h, w, routing, weights, out_dtype=torch.float32)
    assert out.shape == (8, 64) and out.dtype == torch.float32
    args, = down._op.runs
    assert [tuple(v.shape) for v in args[2:6]] == [(4,), (5,), (40,), (32,)] and args[6:8] == (16, 2)
    assert args[-1] == _STREAM and tuple(args[-2].shape) == (8, 64)
    with pytest.raises(TypeError, match="routing: expected a weft.MoeRouting"):
        down.run(h, w, (routing.counts, routing.offsets), weights)
    odd = weft.MoeRouting(routing.counts, routing.offsets, routing.gather_index, _zeros(30, dtype=i32), 15, 2)
    with pytest.raises(ValueError, match="routing: expected tokens a positive multiple of the 2 ranks up to max_tokens "
                                         "= 16, got 15"):
        down.run(h, w, odd, weights)
    short = weft.MoeRouting(routing.counts, routing.offsets[:4], routing.gather_index, routing.slot_rows, 16, 2)
    with pytest.raises(ValueError, match=r"routing.offsets: expected 5 values, got shape \(4,\)"):
        down.run(h, w, short, weights)
    with pytest.raises(ValueError, match=r"h: expected shape \(40, 32\) \(routing's rows_capacity, ffn\)"):
        down.run(h[:39], w, routing, weights)
    with pytest.raises(ValueError, match=r"w: expected shape \(4, 64, 32\) \(\[num_experts, hidden, ffn\]\)"):
        down.run(h, _zeros(4, 32, 64), routing, weights)
    with pytest.raises(ValueError, match=r"topk_weights: expected a contiguous \[16, 2\] tensor"):
        down.run(h, w, routing, weights.t())
    with pytest.raises(TypeError, match="out_dtype: expected torch.bfloat16 or torch.float32, got torch.float16"):
        down.run(h, w, routing, weights, out_dtype=torch.float16)
    assert len(down._op.runs) == 1 and calls == []


def test_moe_layers_check_their_shape_arguments_before_the_collective_construction(calls):
    with pytest.raises(ValueError, match=r"ffn: expected an integer in \[1, 2147483647\], got 0"):
        weft.MoeAgGroupedGemm(16, 64, 0, 4, 2)
    with pytest.raises(TypeError, match="topk: expected an integer, got float"):
        weft.MoeGroupedGemmRs(16, 64, 32, 4, 2.0)
    with pytest.raises(ValueError, match=r"timeout_ms: expected an integer in \[0, 2147483647\], got -1"):
        weft.MoeGroupedGemmRs(16, 64, 32, 4, 2, timeout_ms=-1)


def test_ep_moe_block_passes_its_weights_and_refuses_bad_ones_naming_them(calls, monkeypatch):
    from weft import ep

    block = object.__new__(ep.MoeBlock)
    block._op, block._ctx, block._team = _StandInOp(), _runtime._state.call_context, None
    block.hidden, block.topk, block.ffn = 64, 2, 32
    monkeypatch.setattr(ep.MoeBlock, "num_local_experts", 3)
    x, idx, weights = _zeros(5, 64), _zeros(5, 2, dtype=torch.int32), _zeros(5, 2, dtype=torch.float32)
    gate_up, down = _zeros(3, 64, 64), _zeros(3, 64, 32)
    out = block(x, idx, weights, gate_up, down, fused=False, comm_sms=4)
    assert out.shape == (5, 64)
    (args, kwargs), = block._op.forwards
    assert [tuple(a.shape) for a in args[:6]] == [(5, 64), (5, 2), (5, 2), (3, 64, 64), (3, 64, 32), (5, 64)]
    assert args[6] == _STREAM and kwargs == {"fused": False, "comm_sms": 4}
    with pytest.raises(ValueError, match=r"gate_up: expected shape \(3, 64, 64\), got \(3, 32, 64\)"):
        block(x, idx, weights, _zeros(3, 32, 64), down)
    with pytest.raises(ValueError, match="down: expected a contiguous tensor"):
        block(x, idx, weights, gate_up, _zeros(3, 32, 64).transpose(1, 2))
    with pytest.raises(TypeError, match="topk_weights: expected dtype float32, got bfloat16"):
        block(x, idx, weights.bfloat16(), gate_up, down)
    assert len(block._op.forwards) == 1 and calls == []


def test_all_to_all_passes_its_chunks_and_counts_the_calls_it_refuses(calls):
    x = torch.zeros(4, 3, dtype=torch.bfloat16)
    out = weft.all_to_all(x)
    assert out.shape == (4, 3) and out.dtype == torch.bfloat16
    name, (_, ptr, out_ptr, numel, code, stream, team) = calls.pop()
    assert (name, ptr, out_ptr, numel, code, stream, team) == ("all_to_all_flat", x.data_ptr(), out.data_ptr(), 12,
                                                               _weft.DTYPES["bf16"], _STREAM, None)
    with pytest.raises(ValueError, match=r"tensor: expected dim 0 a multiple of the 2 ranks, got shape \(3, 4\)"):
        weft.all_to_all(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="out: expected 12 elements, got 6"):
        weft.all_to_all(x, torch.zeros(2, 3, dtype=torch.bfloat16))
    assert [c[0] for c in calls] == ["count_refused_collective_call"] * 2


def test_all_to_all_v_passes_counts_in_elements_and_refuses_bad_splits_naming_them(calls):
    x = torch.zeros(5, 3, dtype=torch.float64)  # no weft dtype: moved as bytes, counts in bytes
    out = weft.all_to_all_v(x, [2, 3], [2, 4])
    assert out.shape == (6, 3) and out.dtype == torch.float64
    name, (_, ptr, numel, send, out_ptr, out_numel, recv, code, stream, team) = calls.pop()
    assert (name, numel, send, out_numel, recv, code) == ("all_to_all_v_flat", 5 * 3 * 8, [48, 72], 6 * 3 * 8,
                                                          [48, 96], _weft.DTYPES["u8"])
    empty = torch.zeros(0, 2, dtype=torch.int32)
    weft.all_to_all_v(empty, [0, 0], [1, 2])
    name, (_, _, numel, send, _, out_numel, recv, code, _, _) = calls.pop()
    assert (numel, send, out_numel, recv, code) == (0, [0, 0], 6, [2, 4], _weft.DTYPES["i32"])
    with pytest.raises(ValueError, match=r"send_counts: expected rows summing to tensor's 5 \(dim 0\), got \[2, 2\]"):
        weft.all_to_all_v(x, [2, 2], [2, 2])
    with pytest.raises(ValueError, match=r"recv_counts: expected 2 non-negative integers \(one per rank\), got "
                                         r"\[1, -1\]"):
        weft.all_to_all_v(x, [2, 3], [1, -1])
    with pytest.raises(TypeError, match="send_counts: expected a sequence of 2 integers"):
        weft.all_to_all_v(x, [2.0, 3], [2, 3])
    with pytest.raises(ValueError, match="tensor: expected at least one dimension"):
        weft.all_to_all_v(torch.zeros(()), [0, 0], [0, 0])
    assert [c[0] for c in calls] == ["count_refused_collective_call"] * 4


def test_ag_attention_passes_its_views_and_refuses_bad_shapes_naming_them(calls):
    op = object.__new__(weft.AgAttention)
    op._op, op._ctx, op._team = _StandInOp(), _runtime._state.call_context, None
    op.dtype, op.max_seq, op.num_q_heads, op.num_kv_heads, op.head_dim, op.num_ranks = torch.bfloat16, 32, 4, 2, 64, 2
    q, kv = _zeros(8, 4, 64), _zeros(8, 2, 64)
    out, lse = op.run(q, kv, kv, return_lse=True)
    assert out.shape == (8, 4, 64) and lse.shape == (8, 4) and lse.dtype == torch.float32
    (qv, kv_, vv, ov, lv, stream), = op._op.runs
    assert [tuple(v.shape) for v in (qv, kv_, vv, ov, lv)] == [(8, 4, 64), (8, 2, 64), (8, 2, 64), (8, 4, 64), (8, 4)]
    assert stream == _STREAM
    assert op.run(q, kv, kv).shape == (8, 4, 64) and op._op.runs[-1][4] is None
    with pytest.raises(ValueError, match=r"k_local: expected shape \[S / W, 2, 64\], got \(8, 4, 64\)"):
        op.run(q, q, kv)
    with pytest.raises(ValueError, match=r"v_local: expected q_local's 8 rows, got shape \(7, 2, 64\)"):
        op.run(q, kv, kv[:7])
    with pytest.raises(ValueError, match=r"q_local: expected 1 to 16 rows \(max_seq / ranks\), got 17"):
        op.run(_zeros(17, 4, 64), _zeros(17, 2, 64), _zeros(17, 2, 64))
    with pytest.raises(TypeError, match="q_local: expected dtype bfloat16, got float16"):
        op.run(q.half(), kv, kv)
    with pytest.raises(TypeError, match="dtype: expected torch.bfloat16 or torch.float16, got torch.float32"):
        weft.AgAttention(32, 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match=r"head_dim: expected an integer in \[1, 2147483647\], got 0"):
        weft.AgAttention(32, 4, 2, 0)
    assert len(op._op.runs) == 2 and calls == []


def test_ulysses_reshards_with_a_scratch_and_refuses_shapes_that_do_not_split(calls):
    x = torch.zeros(3, 4, 8, dtype=torch.bfloat16)
    out = weft.ulysses_seq_to_head(x)
    assert out.shape == (6, 2, 8)
    name, (_, xv, ov, sv, seq_to_head, stream, team) = calls.pop()
    assert (name, seq_to_head, stream, team) == ("ulysses", True, _STREAM, None)
    assert [tuple(v.shape) for v in (xv, ov, sv)] == [(3, 4, 8), (6, 2, 8), (3, 4, 8)] and sv.ptr != xv.ptr
    back = weft.ulysses_head_to_seq(out)
    assert back.shape == (3, 4, 8) and calls.pop()[1][4] is False
    with pytest.raises(ValueError, match=r"x: expected \[S / W, H, D\] with H a multiple of the 2 ranks"):
        weft.ulysses_seq_to_head(torch.zeros(3, 5, 8))
    with pytest.raises(ValueError, match=r"x: expected \[S, H / W, D\] with S a multiple of the 2 ranks"):
        weft.ulysses_head_to_seq(torch.zeros(3, 5, 8))
    with pytest.raises(ValueError, match="x: expected a contiguous 3-D tensor"):
        weft.ulysses_seq_to_head(x.transpose(0, 1))
    with pytest.raises(ValueError, match=r"out: expected a contiguous tensor of shape \(6, 2, 8\)"):
        weft.ulysses_seq_to_head(x, torch.zeros(3, 4, 8, dtype=torch.bfloat16))
    assert [c[0] for c in calls] == ["count_refused_collective_call"] * 4
