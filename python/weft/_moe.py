# SPDX-License-Identifier: MIT
"""weft's MoE ops on torch tensors. The grouped GEMM (MoE experts): one GEMM per group in one persistent launch, the
groups' row counts read on the GPU, as weft.ep's dispatch leaves them; a local op: it runs on the GPU its tensors are
on and needs no weft.init; each call is enqueued on torch's current CUDA stream of that device (asynchronous,
graph-capturable once its kernel is loaded). moe_route (local too) and the tensor-parallel MoE layers
(MoeAgGroupedGemm, MoeGroupedGemmRs: collective, after weft.init) work in the gathered layout of a top-k routing."""
from . import _tensor, _weft
from ._attention import _INT32, _INT64, _check, _number, _status_record, _status_view, _view, _zeroed_status
from ._ops import _FusedOp, _out_shape_check, _padded_out
from ._tensor import check_tensor, heap_tensor, matrix_view, torch_module, values_are_bytes, written
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
        out, padded = _padded_out(shape, out_dtype or in_dtype, device)
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


# ---- the gathered layout and the tensor-parallel MoE layers ----------------------------------------------------

class MoeRouting:
    """A top-k routing in the gathered layout (weft::ops::MoeRouting): four int32 tensors on one GPU,

        counts        [E]                 rows of each expert
        offsets       [E + 1]             expert e's rows are [offsets[e], offsets[e] + counts[e]); offsets[E]: the
                                          rows used, padding included
        gather_index  [rows_capacity]     the token of each row (-1: padding, unused)
        slot_rows     [tokens * topk]     the row of slot (t, k) (-1: a dropped slot)

    rows grouped by expert, each expert's slots in (token, k) order. weft.moe_route makes one from a top-k index list;
    MoeAgGroupedGemm.routing is its last call's; MoeGroupedGemmRs.run takes one."""
    __slots__ = ("counts", "offsets", "gather_index", "slot_rows", "tokens", "topk")

    def __init__(self, counts, offsets, gather_index, slot_rows, tokens, topk):
        self.counts, self.offsets, self.gather_index, self.slot_rows = counts, offsets, gather_index, slot_rows
        self.tokens, self.topk = int(tokens), int(topk)

    @property
    def num_experts(self):
        return self.counts.shape[0]

    @property
    def rows_capacity(self):
        return self.gather_index.shape[0]

    def _views(self, device):
        """The extension's arguments for this routing: four int32 views on `device`, tokens, topk; or TypeError /
        ValueError naming the array."""
        torch = torch_module()
        sizes = {"counts": None, "offsets": self.num_experts + 1, "gather_index": None,
                 "slot_rows": self.tokens * self.topk}
        views = []
        for name, size in sizes.items():
            t = getattr(self, name)
            _check(t, f"routing.{name}", 1, (torch.int32,), device, "the call's tensors")
            if size is not None and t.shape[0] != size:
                raise ValueError(f"routing.{name}: expected {size} values, got shape {tuple(t.shape)}")
            if t.shape[0] > 1 and t.stride(0) != 1:
                raise ValueError(f"routing.{name}: expected a contiguous tensor, got stride {t.stride(0)}")
            views.append(_view(t, f"routing.{name}"))
        return (*views, self.tokens, self.topk)


def moe_gathered_rows(tokens, topk, num_experts, align=1):
    """Rows of the gathered layout of `tokens` tokens, top-k and `num_experts` experts with every expert's rows padded
    to a multiple of `align`: tokens * topk + num_experts * (align - 1)."""
    return _weft.moe_gathered_rows(int(tokens), int(topk), int(num_experts), int(align))


def moe_route(topk_idx, num_experts, *, align=1, rows_capacity=None, status=None):
    """The gathered layout of a top-k routing: topk_idx int32 [tokens, topk] (contiguous, on a GPU; the expert of each
    slot, -1 = none) -> a MoeRouting on its device, each expert's rows padded to a multiple of `align` (a grouped
    GEMM's tile rows, or 1). rows_capacity: the rows of gather_index (default, and the least taken:
    moe_gathered_rows(tokens, topk, num_experts, align)). An index outside [-1, num_experts) drops its slot; with status
    (weft.moe_routing_status()) the first is recorded there, and weft.check_moe_routing_status(status) raises naming it.
    An expert named twice in one token's row gets two rows. Two launches on torch's current stream of topk_idx's
    device, deterministic; needs no weft.init."""
    torch = torch_module()
    _check(topk_idx, "topk_idx", 2, (torch.int32,))
    if not topk_idx.is_contiguous():
        raise ValueError(f"topk_idx: expected a contiguous tensor, got strides {topk_idx.stride()}")
    num_experts = _number(num_experts, "num_experts", int, bounds=(1, _INT32[1]))
    align = _number(align, "align", int, bounds=(1, _INT32[1]))
    tokens, topk = topk_idx.shape
    least = moe_gathered_rows(tokens, topk, num_experts, align)
    rows = least if rows_capacity is None else _number(rows_capacity, "rows_capacity", int, bounds=(0, _INT32[1]))
    if rows < least:
        raise ValueError(f"rows_capacity: expected at least tokens x topk + num_experts x (align - 1) = {least}, got "
                         f"{rows}")
    device = topk_idx.device
    status_view = _status_view(status, device, "moe_routing_status", "topk_idx")
    routing = MoeRouting(torch.empty(num_experts, dtype=torch.int32, device=device),
                         torch.empty(num_experts + 1, dtype=torch.int32, device=device),
                         torch.empty(rows, dtype=torch.int32, device=device),
                         torch.empty(tokens * topk, dtype=torch.int32, device=device), tokens, topk)
    counts, offsets, gather_index, slot_rows, _, _ = routing._views(device)
    _weft.moe_route(_view(topk_idx, "topk_idx"), counts, offsets, gather_index, slot_rows, align, status_view,
                    device.index, _tensor._raw_stream(device.index))
    return routing


def moe_routing_status(device=None):
    """A zeroed int32 tensor of 4 elements on `device` (default: torch's current CUDA device) for moe_route's `status`:
    code (0: nothing found; 1: an expert index outside [-1, num_experts)), slot (token * topk + k), value, limit."""
    return _zeroed_status(device, "topk_idx")


def _raise_routing_status(code, slot, value, limit):
    if code != 0:
        raise Error(_weft.describe_moe_routing_status(code, slot, value, limit))


def check_moe_routing_status(status):
    """Raises weft.Error naming the bad expert index moe_route recorded in `status`, if any (read on torch's current
    stream, as check_grouped_status does)."""
    _raise_routing_status(*_status_record(status, "moe_route"))


def _layer_args(max_tokens, hidden, ffn, num_experts, topk, comm_blocks, sm_budget, timeout_ms):
    values = {"max_tokens": max_tokens, "hidden": hidden, "ffn": ffn, "num_experts": num_experts, "topk": topk}
    values = {name: _number(v, name, int, bounds=(1, _INT32[1])) for name, v in values.items()}
    knobs = {"comm_blocks": comm_blocks, "sm_budget": sm_budget, "timeout_ms": timeout_ms}
    knobs = {name: _number(v, name, int, bounds=(0, _INT32[1])) for name, v in knobs.items()}
    return values, knobs


class _MoeLayer(_FusedOp):
    """What the two TP MoE layers share: the shape's arguments and the weight's check."""

    def __init__(self, max_tokens, hidden, ffn, num_experts, topk, comm_blocks, sm_budget, timeout_ms, team):
        values, knobs = _layer_args(max_tokens, hidden, ffn, num_experts, topk, comm_blocks, sm_budget, timeout_ms)
        cls = getattr(_weft, self._kind)
        super().__init__(lambda w: cls(w, **values, **knobs, team=self._team), team)
        for name, v in values.items():
            setattr(self, name, v)

    def _weight(self, w, shape):
        torch = torch_module()
        check_tensor(w, "w", self._ctx, (torch.bfloat16,))
        if tuple(w.shape) != shape:
            raise ValueError(f"w: expected shape {shape} ({self._w_layout}), got {tuple(w.shape)}")
        values_are_bytes(w, "w")
        return _view(w, "w")

    @property
    def rows_capacity(self):
        return self._get().rows_capacity


class MoeAgGroupedGemm(_MoeLayer):
    """TP MoE layer 0, AllGather + grouped GEMM: tokens sharded by rank (x_local [M/W, hidden] on each rank), each
    expert's weight sharded by columns (w [E, ffn, hidden]: this rank's ffn columns), the rows each tile needs pushed
    by their owners while the GEMM runs. y[r] = x[gather_index[r]] @ w[e].T for the rows r of expert e, in the gathered
    layout (self.routing after the call). Collective to make (over the World, or `team`'s members: 1 to 8 ranks, one
    node) and to close; run() on torch's current stream. max_tokens: the largest M (all ranks' tokens), a multiple of
    the team's size; hidden and ffn multiples of 8 (ffn: this rank's shard; the rest of the shape the same on every
    rank); topk 1 .. min(64, num_experts). comm_blocks: CTAs of the push (0: chosen, the same on every rank);
    sm_budget: SMs of the op's kernels (0: the World's); timeout_ms: bound on every wait on a peer (0: the World's)."""
    _kind = "MoeAgGroupedGemm"
    _w_layout = "[num_experts, ffn, hidden]"

    def __init__(self, max_tokens, hidden, ffn, num_experts, topk, *, comm_blocks=0, sm_budget=0, timeout_ms=0,
                 team=None):
        super().__init__(max_tokens, hidden, ffn, num_experts, topk, comm_blocks, sm_budget, timeout_ms, team)

    def run(self, x_local, topk_idx, w, y=None):
        """x_local: bf16 [M/W, hidden] (rows with inner stride 1); topk_idx: int32 [M, topk], contiguous, the same on
        every rank (-1: no expert); w: bf16 [num_experts, ffn, hidden]; y: bf16 [rows_capacity, ffn] (allocated when
        None). Every rank calls with the same M and topk_idx (a mismatch is raised by World.sync_and_check on every
        rank). Rows of y past routing.offsets[-1] are not written. Returns y."""
        torch = torch_module()
        op = self._get()
        ctx = self._ctx
        xv = matrix_view(x_local, "x_local", ctx, (torch.bfloat16,))
        if x_local.shape[1] != self.hidden:
            raise ValueError(f"x_local: expected {self.hidden} columns (hidden), got shape {tuple(x_local.shape)}")
        m = x_local.shape[0] * self.num_ranks
        if x_local.shape[0] < 1 or m > self.max_tokens:
            raise ValueError(f"x_local: expected 1 to {self.max_tokens // self.num_ranks} rows (max_tokens / ranks), "
                             f"got shape {tuple(x_local.shape)}")
        check_tensor(topk_idx, "topk_idx", ctx, (torch.int32,))
        if tuple(topk_idx.shape) != (m, self.topk) or not topk_idx.is_contiguous():
            raise ValueError(f"topk_idx: expected a contiguous [{m}, {self.topk}] tensor (M = x_local's rows x "
                             f"{self.num_ranks} ranks, topk), got shape {tuple(topk_idx.shape)}")
        wv = self._weight(w, (self.num_experts, self.ffn, self.hidden))
        rows = self.rows_capacity
        if y is None:
            y = torch.empty((rows, self.ffn), dtype=torch.bfloat16, device=ctx.device)
        yv = matrix_view(y, "y", ctx, (torch.bfloat16,))
        _out_shape_check(y, (rows, self.ffn))
        op.run(xv, _view(topk_idx, "topk_idx"), wv, yv, ctx.stream(ctx.device_index))
        return written(y)

    @property
    def routing(self):
        """The routing of the last call (a MoeRouting of zero-copy views of the op's buffers: valid while the op is
        open, its values until the next call's routing on the stream)."""
        counts, offsets, gather_index, slot_rows = self._get().routing()
        i32 = torch_module().int32
        tensors = [heap_tensor(v, self._world, i32) for v in (counts, offsets, gather_index, slot_rows)]
        topk = self.topk
        return MoeRouting(*tensors, slot_rows.shape[0] // topk, topk)

    def check_routing(self):
        """Raises weft.Error naming the first expert index outside [-1, num_experts) a call's topk_idx held (such a slot
        is dropped). The record is cumulative over calls and read from host-mapped memory: synchronise the stream of
        the calls first."""
        _raise_routing_status(*self._get().routing_status())


class MoeGroupedGemmRs(_MoeLayer):
    """TP MoE layer 1, grouped GEMM + top-k weighted reduction + ReduceScatter: out[t] = sum over t's slots k of
    weights[T0 + t, k] * (sum over ranks of h @ w[e].T)[slot_rows[(T0 + t) * topk + k]], for this rank's tokens T0 =
    rank * M/W .. + M/W, the reduction overlapped with the GEMM. h: the gathered rows (layer 0's y after the
    activation), w [E, hidden, ffn] this rank's K slice. Collective as MoeAgGroupedGemm (same arguments)."""
    _kind = "MoeGroupedGemmRs"
    _w_layout = "[num_experts, hidden, ffn]"

    def __init__(self, max_tokens, hidden, ffn, num_experts, topk, *, comm_blocks=0, sm_budget=0, timeout_ms=0,
                 team=None):
        super().__init__(max_tokens, hidden, ffn, num_experts, topk, comm_blocks, sm_budget, timeout_ms, team)

    def run(self, h, w, routing, topk_weights, out=None, *, out_dtype=None):
        """h: bf16 [routing.rows_capacity, ffn]; w: bf16 [num_experts, hidden, ffn]; routing: a MoeRouting the same on
        every rank (MoeAgGroupedGemm.routing, or weft.moe_route of the replicated topk_idx); topk_weights: float32
        [M, topk], contiguous, the same on every rank; out: bf16 or float32 [M / W, hidden] (allocated when None, of
        out_dtype, default bf16). Returns out."""
        torch = torch_module()
        op = self._get()
        ctx = self._ctx
        if not isinstance(routing, MoeRouting):
            raise TypeError(f"routing: expected a weft.MoeRouting (MoeAgGroupedGemm.routing or weft.moe_route), got "
                            f"{type(routing).__name__}")
        m = routing.tokens
        if m < self.num_ranks or m % self.num_ranks != 0 or m > self.max_tokens:
            raise ValueError(f"routing: expected tokens a positive multiple of the {self.num_ranks} ranks up to "
                             f"max_tokens = {self.max_tokens}, got {m}")
        if routing.topk != self.topk or routing.num_experts != self.num_experts:
            raise ValueError(f"routing: expected num_experts {self.num_experts} and topk {self.topk} (the op's), got "
                             f"{routing.num_experts} and {routing.topk}")
        route = routing._views(ctx.device)
        hv = matrix_view(h, "h", ctx, (torch.bfloat16,))
        if tuple(h.shape) != (routing.rows_capacity, self.ffn):
            raise ValueError(f"h: expected shape {(routing.rows_capacity, self.ffn)} (routing's rows_capacity, ffn), "
                             f"got {tuple(h.shape)}")
        wv = self._weight(w, (self.num_experts, self.hidden, self.ffn))
        check_tensor(topk_weights, "topk_weights", ctx, (torch.float32,))
        if tuple(topk_weights.shape) != (m, self.topk) or not topk_weights.is_contiguous():
            raise ValueError(f"topk_weights: expected a contiguous [{m}, {self.topk}] tensor (routing's tokens, topk), "
                             f"got shape {tuple(topk_weights.shape)}")
        out_dtypes = (torch.bfloat16, torch.float32)
        if out_dtype is not None and out_dtype not in out_dtypes:
            raise TypeError(f"out_dtype: expected torch.bfloat16 or torch.float32, got {out_dtype}")
        shape = (m // self.num_ranks, self.hidden)
        if out is None:
            out = torch.empty(shape, dtype=out_dtype or torch.bfloat16, device=ctx.device)
        ov = matrix_view(out, "out", ctx, out_dtypes if out_dtype is None else (out_dtype,))
        _out_shape_check(out, shape)
        op.run(hv, wv, *route, _view(topk_weights, "topk_weights"), ov, ctx.stream(ctx.device_index))
        return written(out)


# ---- the gathered layout's local ops ----------------------------------------------------------------------------

def _routing_arg(routing, device):
    if not isinstance(routing, MoeRouting):
        raise TypeError(f"routing: expected a weft.MoeRouting (weft.moe_route or MoeAgGroupedGemm.routing), got "
                        f"{type(routing).__name__}")
    return routing._views(device)


def _gathered_operands(a, b, routing, b_layout, device=None):
    """a, b and the routing checked for a gathered grouped GEMM: (views of a and b, N, the routing's arguments).
    `device`: the device every tensor must be on (None: a's, which must be a CUDA device)."""
    torch = torch_module()
    if not isinstance(b_layout, str) or b_layout not in _B_LAYOUTS:
        raise ValueError(f"b_layout: expected 'nk' or 'kn', got {b_layout!r}")
    _check(a, "a", 2, (torch.bfloat16,), device)
    device = a.device
    route = _routing_arg(routing, device)
    if a.shape[0] != routing.tokens:
        raise ValueError(f"a: expected routing's {routing.tokens} tokens as rows, got shape {tuple(a.shape)}")
    _check(b, "b", 3, (torch.bfloat16,), device, "a")
    for t, name in ((a, "a"), (b, "b")):
        values_are_bytes(t, name)
    n, b_k = (b.shape[1], b.shape[2]) if b_layout == "nk" else (b.shape[2], b.shape[1])
    if b.shape[0] != routing.num_experts or b_k != a.shape[1]:
        want = "[E, N, K]" if b_layout == "nk" else "[E, K, N]"
        raise ValueError(f"b: expected {want} (b_layout {b_layout!r}) with E = routing's {routing.num_experts} experts "
                         f"and a's K = {a.shape[1]}, got shape {tuple(b.shape)}")
    return _view(a, "a"), _view(b, "b"), n, route


def _combine_args(routing, topk_weights, out, per_slot, out_dtype, n, device):
    """The token-order output and the combine's weights: (out, its view, weights view or None, weighted_sum)."""
    torch = torch_module()
    out_dtypes = (torch.bfloat16, torch.float32)
    if out_dtype is not None and out_dtype not in out_dtypes:
        raise TypeError(f"out_dtype: expected torch.bfloat16 or torch.float32, got {out_dtype}")
    shape = (routing.tokens * routing.topk, n) if per_slot else (routing.tokens, n)
    weights = None
    if topk_weights is not None:
        if per_slot:
            raise ValueError("topk_weights: per_slot=True writes each slot's row unweighted; pass none")
        _check(topk_weights, "topk_weights", 2, (torch.float32,), device, "a")
        if tuple(topk_weights.shape) != (routing.tokens, routing.topk) or not topk_weights.is_contiguous():
            raise ValueError(f"topk_weights: expected a contiguous [{routing.tokens}, {routing.topk}] tensor "
                             f"(routing's tokens, topk), got shape {tuple(topk_weights.shape)}")
        weights = _view(topk_weights, "topk_weights")
    if out is None:
        out = torch.empty(shape, dtype=out_dtype or torch.bfloat16, device=device)
    else:
        _check(out, "out", 2, out_dtypes if out_dtype is None else (out_dtype,), device, "a")
        if tuple(out.shape) != shape:
            raise ValueError(f"out: expected shape {shape}, got {tuple(out.shape)}")
        values_are_bytes(out, "out")
    return out, _view(out, "out"), weights, not per_slot


def grouped_gemm_gathered(a, b, routing, out=None, *, b_layout="nk", out_dtype=None, expected_rows_per_group=0,
                          sm_budget=0, status=None):
    """The gathered grouped GEMM, rows in expert order: out[r] = a[routing.gather_index[r]] @ b[e].T ("nk": b
    [E, N, K]; "kn": b [E, K, N], @ b[e]) for the rows r of each expert e (routing.offsets / counts). a bf16 [tokens, K]
    (routing.tokens rows), b bf16; out [routing.rows_capacity, N] bf16 or float32 (allocated when None, of out_dtype,
    default bf16); rows of no expert are not written. The rows are gathered into a bf16 [rows_capacity, K] workspace
    the call allocates, then multiplied by the contiguous grouped GEMM (options and status as grouped_gemm's). A local
    op on a's GPU and torch's current stream. Returns out."""
    torch = torch_module()
    av, bv, n, route = _gathered_operands(a, b, routing, b_layout)
    shape = (routing.rows_capacity, n)
    if out is None:
        out, padded = _padded_out(shape, out_dtype or torch.bfloat16, a.device)
    else:
        padded = None
        _check(out, "out", 2, (torch.bfloat16, torch.float32) if out_dtype is None else (out_dtype,), a.device, "a")
        if tuple(out.shape) != shape:
            raise ValueError(f"out: expected shape {shape} (routing's rows_capacity, N), got {tuple(out.shape)}")
        values_are_bytes(out, "out")
    a_rows = torch.empty((routing.rows_capacity, a.shape[1]), dtype=torch.bfloat16, device=a.device)
    status_view = _status_view(status, a.device, "grouped_status", "a")
    device = a.device.index
    _weft.grouped_gemm_gathered(av, bv, _view(out, "out"), _B_LAYOUTS[b_layout], *route, _view(a_rows, "a_rows"),
                                device, _tensor._raw_stream(device), _number(sm_budget, "sm_budget", int),
                                _number(expected_rows_per_group, "expected_rows_per_group", int), status_view)
    return written(out) if padded is None else out.contiguous()


def grouped_gemm_gathered_combine(a, b, routing, topk_weights=None, out=None, *, per_slot=False, b_layout="nk",
                                  out_dtype=None, expected_rows_per_group=0, sm_budget=0, status=None):
    """The gathered grouped GEMM written back to token order: with per_slot=False (default) out [tokens, N] row t = the
    sum over t's slots k (by ascending row: for moe_route's routing, ascending expert, then k) of topk_weights[t, k] (1 when None) times slot (t, k)'s product
    row, in fp32 and rounded once (zeros for a token with no slot); with per_slot=True out [tokens * topk, N] row
    t * topk + k = slot (t, k)'s row (zeros for a dropped slot). N a multiple of 8; out bf16 or float32; a, b, routing
    as grouped_gemm_gathered's. Deterministic (the same bits on every run). Returns out."""
    torch = torch_module()
    av, bv, n, route = _gathered_operands(a, b, routing, b_layout)
    out, ov, weights, weighted = _combine_args(routing, topk_weights, out, per_slot, out_dtype, n, a.device)
    a_rows = torch.empty((routing.rows_capacity, a.shape[1]), dtype=torch.bfloat16, device=a.device)
    d_rows = torch.empty((routing.rows_capacity, n), dtype=torch.float32, device=a.device)
    status_view = _status_view(status, a.device, "grouped_status", "a")
    device = a.device.index
    _weft.grouped_gemm_gathered_combine(av, bv, ov, _B_LAYOUTS[b_layout], *route, weighted, weights,
                                        _view(a_rows, "a_rows"), _view(d_rows, "d_rows"), device,
                                        _tensor._raw_stream(device), _number(sm_budget, "sm_budget", int),
                                        _number(expected_rows_per_group, "expected_rows_per_group", int), status_view)
    return written(out)


def moe_combine(d_rows, routing, topk_weights=None, out=None, *, per_slot=False, out_dtype=None):
    """The combine alone: d_rows float32 [routing.rows_capacity, N] (rows in expert order, e.g. a grouped GEMM's fp32
    output on the gathered rows) back to token order as grouped_gemm_gathered_combine writes it. One launch on torch's
    current stream of d_rows' GPU; deterministic. Returns out."""
    torch = torch_module()
    _check(d_rows, "d_rows", 2, (torch.float32,))
    route = _routing_arg(routing, d_rows.device)
    if d_rows.shape[0] != routing.rows_capacity:
        raise ValueError(f"d_rows: expected routing's {routing.rows_capacity} rows (rows_capacity), got shape "
                         f"{tuple(d_rows.shape)}")
    out, ov, weights, weighted = _combine_args(routing, topk_weights, out, per_slot, out_dtype, d_rows.shape[1],
                                               d_rows.device)
    device = d_rows.device.index
    _weft.moe_combine(_view(d_rows, "d_rows"), *route, weighted, weights, ov, device, _tensor._raw_stream(device))
    return written(out)
