# SPDX-License-Identifier: MIT
"""weft's grouped GEMM (MoE experts) on torch tensors: one GEMM per group in one persistent launch, the groups' row
counts read on the GPU, as weft.ep's dispatch leaves them. A local op: it runs on the GPU its tensors are on and needs
no weft.init; each call is enqueued on torch's current CUDA stream of that device (asynchronous, graph-capturable
once its kernel is loaded)."""
from . import _tensor, _weft
from ._attention import _INT32, _INT64, _check, _number, _status_record, _status_view, _view, _zeroed_status
from ._tensor import torch_module, values_are_bytes, written
from ._weft import Error

_B_LAYOUTS = {"nk": 0, "kn": 1}  # weft::BLayout's kNK and kKN


def _group_array(t, name, groups, device):
    """The TensorView of a per-group array (offsets, counts): a contiguous int32 [groups] tensor on `device` (a's);
    else TypeError / ValueError naming the argument."""
    _check(t, name, 1, (torch_module().int32,), device, "a")
    if t.shape[0] != groups:
        raise ValueError(f"{name}: expected {groups} values (one per group: b's first extent), got shape "
                         f"{tuple(t.shape)}")
    if groups > 1 and t.stride(0) != 1:
        raise ValueError(f"{name}: expected a contiguous tensor, got stride {t.stride(0)}; call .contiguous()")
    return _view(t, name)


def _new_out(shape, dtype, device):
    """A new output of `shape` whose rows start at multiples of 16 bytes (the kernel stores rows with TMA): (the tensor
    to write, None), or, when N is not a multiple of 16 bytes' elements, (the first N columns of a padded allocation,
    the allocation); the caller then returns a contiguous copy. Uninitialised (torch.empty)."""
    torch = torch_module()
    per16 = 128 // torch.finfo(dtype).bits
    n = shape[-1]
    if n % per16 == 0:
        return torch.empty(shape, dtype=dtype, device=device), None
    padded = torch.empty((*shape[:-1], -(-n // per16) * per16), dtype=dtype, device=device)
    return padded[..., :n], padded


def _grouped_args(a, b, counts, offsets, out, b_layout, out_dtype, a_scales, expected_rows_per_group, sm_budget,
                  status, device=None):
    """grouped_gemm's arguments checked, as (the extension's function, its arguments before `device`, those after
    `stream`, out, the padded allocation under out or None). `device`: the device every tensor must be on (None: a's,
    which must be a CUDA device). Raises TypeError / ValueError naming the argument."""
    torch = torch_module()
    if not isinstance(b_layout, str) or b_layout not in _B_LAYOUTS:
        raise ValueError(f"b_layout: expected 'nk' or 'kn', got {b_layout!r}")
    expected_rows_per_group = _number(expected_rows_per_group, "expected_rows_per_group", int, bounds=(0, _INT64[1]))
    sm_budget = _number(sm_budget, "sm_budget", int, bounds=(0, _INT32[1]))
    if not isinstance(a, torch.Tensor):
        raise TypeError(f"a: expected a torch.Tensor, got {type(a).__name__}")
    if a.dim() not in (2, 3):
        raise ValueError(f"a: expected a 2-D tensor [rows, K] (contiguous layout) or a 3-D one [G, capacity, K] "
                         f"(masked layout), got shape {tuple(a.shape)}")
    masked = a.dim() == 3
    fp8 = getattr(torch, "float8_e4m3fn", None)
    is_fp8 = fp8 is not None and a.dtype == fp8
    if is_fp8 and not masked:
        raise TypeError(f"a: fp8 (float8_e4m3fn) rows are taken in the masked layout only (a 3-D [G, capacity, K]), "
                        f"got shape {tuple(a.shape)}")
    halves = (torch.bfloat16, torch.float16)
    _check(a, "a", a.dim(), (halves + (fp8,)) if masked and fp8 is not None else halves, device)
    device = a.device
    in_dtype = torch.bfloat16 if is_fp8 else a.dtype  # b's and the GEMM's (fp8 rows are multiplied as bf16)
    _check(b, "b", 3, (in_dtype,), device, "a")
    for t, name in ((a, "a"), (b, "b")):
        values_are_bytes(t, name)  # the kernel reads their bytes
    groups, k = b.shape[0], a.shape[-1]
    n, b_k = (b.shape[1], b.shape[2]) if b_layout == "nk" else (b.shape[2], b.shape[1])
    if b_k != k:
        want = "[G, N, K]" if b_layout == "nk" else "[G, K, N]"
        raise ValueError(f"b: expected {want} (b_layout {b_layout!r}) with a's K = {k}, got shape {tuple(b.shape)}")
    if masked and a.shape[0] != groups:
        raise ValueError(f"a: expected [G, capacity, K] with G = {groups} (b's groups), got shape {tuple(a.shape)}")
    counts_view = _group_array(counts, "counts", groups, device)
    if masked and offsets is not None:
        raise ValueError("offsets: the masked layout (a 3-D a: group g's rows are a[g, :counts[g]]) takes none, got "
                         f"{type(offsets).__name__}")
    if not masked and offsets is None:
        raise ValueError("offsets: the contiguous layout (a 2-D a) needs them: an int32 [G] tensor of each group's "
                         "first row of a")
    offsets_view = None if masked else _group_array(offsets, "offsets", groups, device)
    if is_fp8:
        if a_scales is None:
            raise ValueError("a_scales: fp8 a needs its scales, a float32 [G, capacity, K / 128] tensor")
        if k % 128 != 0:
            raise ValueError(f"a: fp8 rows need K a multiple of 128 (one scale per 128 channels), got K = {k}")
        _check(a_scales, "a_scales", 3, (torch.float32,), device, "a")
        values_are_bytes(a_scales, "a_scales")
        want = (groups, a.shape[1], k // 128)
        if tuple(a_scales.shape) != want:
            raise ValueError(f"a_scales: expected shape {want} ([G, capacity, K / 128]), got {tuple(a_scales.shape)}")
    elif a_scales is not None:
        raise ValueError(f"a_scales: only fp8 (float8_e4m3fn) a takes scales, got a of dtype {a.dtype}")
    out_dtypes = (in_dtype, torch.float32)
    if out_dtype is not None and out_dtype not in out_dtypes:
        raise TypeError(f"out_dtype: expected {in_dtype} or torch.float32, got {out_dtype}")
    shape = (groups, a.shape[1], n) if masked else (a.shape[0], n)
    padded = None
    if out is None:
        out, padded = _new_out(shape, out_dtype or in_dtype, device)
    else:
        _check(out, "out", len(shape), out_dtypes if out_dtype is None else (out_dtype,), device, "a")
        if tuple(out.shape) != shape:
            raise ValueError(f"out: expected shape {shape}, got {tuple(out.shape)}")
        values_are_bytes(out, "out")
    status_view = _status_view(status, device, "grouped_status", "a")
    layout = _B_LAYOUTS[b_layout]
    tail = (sm_budget, expected_rows_per_group, status_view)
    if is_fp8:
        workspace = torch.empty((groups, a.shape[1], k), dtype=torch.bfloat16, device=device)  # the rows as bf16
        head = (_view(a, "a"), _view(a_scales, "a_scales"), _view(b, "b"), _view(out, "out"), layout, counts_view,
                _view(workspace, "a_bf16"))
        return _weft.grouped_gemm_masked_fp8, head, tail, out, padded
    if masked:
        head = (_view(a, "a"), _view(b, "b"), _view(out, "out"), layout, counts_view)
        return _weft.grouped_gemm_masked, head, tail, out, padded
    head = (_view(a, "a"), _view(b, "b"), _view(out, "out"), layout, offsets_view, counts_view)
    return _weft.grouped_gemm_contiguous, head, tail, out, padded


def grouped_gemm(a, b, counts, offsets=None, out=None, *, b_layout="nk", out_dtype=None, a_scales=None,
                 expected_rows_per_group=0, sm_budget=0, status=None):
    """One GEMM per group (MoE expert) in one launch: out[rows of g] = a[rows of g] @ b[g].T for b_layout "nk" (b
    [G, N, K]: each expert's linear-layer weight) or a[rows of g] @ b[g] for "kn" (b [G, K, N]). The groups' row
    counts are read on the GPU (no host synchronisation; a captured call reads them at each replay). a's dimensions
    choose the layout:

        contiguous  a [rows, K], out [rows, N]; group g's rows [offsets[g], offsets[g] + counts[g]), in any order,
                    not overlapping, rows between them allowed (weft.ep normal dispatch: recv_x,
                    expert_offsets[:-1], expert_counts)
        masked      a [G, capacity, K], out [G, capacity, N]; group g's rows a[g, :counts[g]]; offsets None
                    (weft.ep low-latency dispatch: recv_x, expert_counts)

    counts, offsets: contiguous int32 [G] tensors on a's device, G = b.shape[0]. a and b bf16 or f16 (one dtype), fp32
    accumulation; out's dtype: out_dtype, else out's (a's or float32), else a's. fp8 rows (masked only): a
    float8_e4m3fn with a_scales float32 [G, capacity, K / 128] (value = code x the scale of its 128 channels: an fp8
    low-latency dispatch's recv_x and recv_scales), b bf16, out bf16 or float32: the rows are dequantised into a bf16
    [G, capacity, K] workspace the call allocates, then multiplied. K a multiple of 8 (fp8: of 128); rows with inner
    stride 1 and 16-byte aligned bases and row strides; the masked layout's groups back to back.

    Rows of out that no group owns (between groups, past a group's count) are not written: an allocated out holds
    unspecified values there (torch.empty; pass a zeroed out to have zeros). Counts outside their bounds are clamped
    (masked: to [0, capacity]; contiguous: to the rows inside a); with status (weft.grouped_status()) the first is
    recorded there and weft.check_grouped_status(status) raises weft.Error naming it.
    expected_rows_per_group: the rows per group the tile choice plans for (0: rows / G; masked: capacity / 2), a hint
    only. sm_budget: CTAs of the persistent grid (0: every SM).

    On a's GPU and torch's current stream there; needs no weft.init. The first call of a kind loads (JIT-compiles)
    its kernel: make the call once before capturing it in a CUDA graph. Returns out (allocated when None). Bad
    arguments raise TypeError / ValueError naming the argument, or weft.Error from the op (strides, alignment,
    overlapping tensors)."""
    call, head, tail, out, padded = _grouped_args(a, b, counts, offsets, out, b_layout, out_dtype, a_scales,
                                                  expected_rows_per_group, sm_budget, status)
    device = a.device.index
    call(*head, device, _tensor._raw_stream(device), *tail)
    return written(out) if padded is None else out.contiguous()


def grouped_status(device=None):
    """A zeroed int32 tensor of 4 elements on `device` (default: torch's current CUDA device) for grouped_gemm's
    `status`: code (0: nothing found; 1: a negative count; 2: a masked count over the capacity; 3: a contiguous
    group's rows outside a), group, value (the count, or where the group's rows end) and limit (the bound)."""
    return _zeroed_status(device, "a")


def check_grouped_status(status):
    """Raises weft.Error naming the bad count grouped_gemm recorded in `status`, if any. Reads the tensor on torch's
    current stream: call it there after the grouped call (or after synchronising the stream it ran on). Zero it again
    (status.zero_()) before reusing it."""
    code, group, value, limit = _status_record(status, "grouped_gemm")
    if code != 0:
        raise Error(_weft.describe_grouped_status(code, group, value, limit))
