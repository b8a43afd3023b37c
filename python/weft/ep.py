# SPDX-License-Identifier: MIT
"""MoE expert parallelism from PyTorch: weft::ops::ep's Buffer (normal and low-latency dispatch and combine) and
MoeBlock (a whole MoE block: dispatch, expert GEMMs with SwiGLU, combine, overlapped).

    buf = weft.ep.Buffer(num_experts=64, hidden=4096, topk=8, max_tokens_per_rank=4096,
                         low_latency=False)               # collective; low-latency buffers: <= 1024 tokens
    h = buf.make_normal_handle()                          # collective
    buf.dispatch(h, x, topk_idx, topk_weights)            # rows land expert-contiguous in h.recv_x
    y = my_experts(h.recv_x, h.expert_offsets, h.expert_counts)
    out = buf.combine(h, y)                               # weighted sum over each token's k experts
    h.close(); buf.close()                                # collective (or weft.finalize())

x: bf16 [T, hidden]; topk_idx: int32 [T, k] (-1 drops a slot); topk_weights: f32 [T, k]. Every call runs on torch's
current stream, never synchronises the host, and is collective over the Buffer's ranks: the World's, or those of the
`team=` it was made with (same order everywhere).
Contracts, limits and layouts: include/weft/ops/ep.hpp and kernels/ep/README.md. The handles' tensors (recv_x,
expert_counts, ...) are zero-copy views of weft's buffers: valid until the handle is closed, their contents until
the next dispatch on that handle.
"""
from . import _runtime, _weft
from ._ops import _FusedOp, _stream
from ._tensor import check_tensor, heap_tensor, matrix_view, torch_module, written
from ._weft import TensorView


def _tensor(view, world):
    torch = torch_module()
    dtypes = {_weft.DTYPES["bf16"]: torch.bfloat16, _weft.DTYPES["i32"]: torch.int32,
              _weft.DTYPES["f32"]: torch.float32, _weft.DTYPES["u8"]: torch.uint8,
              _weft.DTYPES["f8e4m3"]: getattr(torch, "float8_e4m3fn", None)}
    return heap_tensor(view, world, dtypes[view.dtype])


def _view(t, name, ctx, dtype):
    torch = torch_module()
    v = matrix_view(t, name, ctx, (dtype,))
    if dtype == torch.int32 or dtype == torch.float32:
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor; call .contiguous()")
    return v


def _routing_views(ctx, x, topk_idx, topk_weights=None, x_name="x"):
    """The views of a call's tokens (bf16), top-k indices (int32) and weights (float32, when given)."""
    torch = torch_module()
    views = [_view(x, x_name, ctx, torch.bfloat16), _view(topk_idx, "topk_idx", ctx, torch.int32)]
    if topk_weights is not None:
        views.append(_view(topk_weights, "topk_weights", ctx, torch.float32))
    return views


class _Handle:
    def __init__(self, buffer, handle):
        self._buffer, self._h = buffer, handle
        _runtime._register(self)

    def close(self):
        if self._h is not None:
            if _runtime._forked_from is not None:  # the parent's handle (see _FusedOp.close)
                raise _runtime._forked_error(f"{type(self).__name__}.close")
            self._h.close()
            self._h = None
            _runtime._unregister(self)

    def _get(self):
        if self._h is None:
            raise _weft.Error(f"{type(self).__name__} is closed")
        if _runtime._forked_from is not None:
            raise _runtime._forked_error(type(self).__name__)
        return self._h

    @property
    def recv_x(self):
        return _tensor(self._get().recv_x, self._buffer._world)

    @property
    def expert_counts(self):
        return _tensor(self._get().expert_counts, self._buffer._world)


class NormalHandle(_Handle):
    """One normal dispatch in flight (collective to make and to close)."""

    @property
    def expert_offsets(self):
        """int32 [E_local + 1]: local expert e's rows of recv_x start at expert_offsets[e] (padded to the Buffer's
        expert_alignment); the last entry is the rows of every expert together."""
        return _tensor(self._get().expert_offsets, self._buffer._world)

    @property
    def num_tokens(self):
        return self._get().num_tokens


class LowLatencyHandle(_Handle):
    """One low-latency dispatch's outputs: recv_x [E_local, W * max_tokens, hidden] (bf16, or fp8 after an fp8
    dispatch), recv_scales (fp8), expert_counts."""

    @property
    def recv_scales(self):
        return _tensor(self._get().recv_scales, self._buffer._world)


class Buffer(_FusedOp):
    """The expert-parallel buffers of this rank (collective over the World, or over `team`'s members, to make and to
    close)."""
    _kind = "ep.Buffer"

    def __init__(self, num_experts, hidden, topk, max_tokens_per_rank, *, normal=True, low_latency=True,
                 max_recv_tokens=0, max_recv_rows=0, expert_alignment=1, team=None):
        super().__init__(lambda w: _weft.ep.Buffer(w, num_experts, hidden, topk, max_tokens_per_rank, normal=normal,
                                                   low_latency=low_latency, max_recv_tokens=max_recv_tokens,
                                                   max_recv_rows=max_recv_rows, expert_alignment=expert_alignment,
                                                   team=self._team), team)
        self.num_experts, self.hidden, self.topk = num_experts, hidden, topk

    @property
    def num_local_experts(self):
        return self._get().num_local_experts

    def make_normal_handle(self):
        return NormalHandle(self, self._get().make_normal_handle())

    def make_low_latency_handle(self):
        return LowLatencyHandle(self, self._get().make_low_latency_handle())

    def _routing(self, x, topk_idx, topk_weights=None, x_name="x"):
        return _routing_views(self._ctx, x, topk_idx, topk_weights, x_name)

    @staticmethod
    def _handle(handle, kind, op):
        """Raises TypeError unless `handle` is a `kind` (NormalHandle or LowLatencyHandle) for `op`."""
        if not isinstance(handle, kind):
            make = "make_normal_handle" if kind is NormalHandle else "make_low_latency_handle"
            raise TypeError(f"handle: ep {op} expected a {kind.__name__} (Buffer.{make}()), got "
                            f"{type(handle).__name__}")

    def dispatch(self, handle, x, topk_idx, topk_weights, *, num_sms=0):
        self._handle(handle, NormalHandle, "dispatch")
        xv, iv, wv = self._routing(x, topk_idx, topk_weights)
        self._get().dispatch(handle._get(), xv, iv, wv, _stream(self._ctx), num_sms=num_sms)

    def combine(self, handle, y, out=None, *, num_sms=0):
        torch = torch_module()
        self._handle(handle, NormalHandle, "combine")
        yv = _view(y, "y", self._ctx, torch.bfloat16)
        if handle.num_tokens < 0:
            raise _weft.Error("ep combine: the handle has not been dispatched")
        if out is None:
            out = torch.empty((handle.num_tokens, self.hidden), dtype=torch.bfloat16, device=y.device)
        ov = _view(out, "out", self._ctx, torch.bfloat16)
        self._get().combine(handle._get(), yv, ov, _stream(self._ctx), num_sms=num_sms)
        return written(out)

    def _unused(self, dtype, *inner):
        """An empty view (no rows, `inner` extents) for an argument the call's phase does not read."""
        return TensorView(0, _weft.DTYPES[dtype], (0, *inner))

    def low_latency_dispatch(self, handle, x=None, topk_idx=None, *, fp8=None, phase="send_recv", num_sms=0):
        """phase="recv" reads the handle only (the send's tokens and fp8 flag): x and topk_idx may be left out, and
        fp8 defaults to the send's (given, it must match). fp8 defaults to False otherwise."""
        self._handle(handle, LowLatencyHandle, "low_latency_dispatch")
        if fp8 is None:
            fp8 = handle._get().fp8 if phase == "recv" else False
        if phase == "recv":
            xv, iv = self._unused("bf16", self.hidden), self._unused("i32", self.topk)
        else:
            if x is None or topk_idx is None:
                raise ValueError(f"ep low_latency_dispatch(phase={phase!r}): x and topk_idx are required")
            xv, iv = self._routing(x, topk_idx)
        self._get().low_latency_dispatch(handle._get(), xv, iv, _stream(self._ctx), fp8=fp8, phase=phase,
                                         num_sms=num_sms)

    def low_latency_combine(self, handle, y=None, topk_idx=None, topk_weights=None, out=None, *, phase="send_recv",
                            num_sms=0):
        """Returns out, allocated when not given (from topk_idx's rows). phase="send" reads y only and writes no
        output: it returns the out the recv half is to fill (None when neither out nor topk_idx is given);
        phase="recv" reads topk_idx and topk_weights and writes out, without y."""
        torch = torch_module()
        self._handle(handle, LowLatencyHandle, "low_latency_combine")
        if out is None and topk_idx is not None:
            _view(topk_idx, "topk_idx", self._ctx, torch.int32)  # before out is made from it (on its device)
            out = torch.empty((topk_idx.shape[0], self.hidden), dtype=torch.bfloat16, device=topk_idx.device)
        if phase != "send":
            if topk_idx is None or topk_weights is None:
                raise ValueError(f"ep low_latency_combine(phase={phase!r}): topk_idx and topk_weights are required")
            ov, iv, wv = self._routing(out, topk_idx, topk_weights, x_name="out")
        else:
            ov, iv, wv = (self._unused("bf16", self.hidden), self._unused("i32", self.topk),
                          self._unused("f32", self.topk))
        if phase != "recv":
            if y is None:
                raise ValueError(f"ep low_latency_combine(phase={phase!r}): y is required")
            check_tensor(y, "y", self._ctx, (torch.bfloat16,))
            if y.dim() != 3:
                raise ValueError(f"y: expected a 3-D tensor [E_local, W * max_tokens, hidden], got shape "
                                 f"{tuple(y.shape)}")
            if y.stride(2) != 1 or y.stride(0) != y.shape[1] * y.stride(1):
                raise ValueError(f"y: expected rows with inner stride 1, stacked evenly, got strides {y.stride()}")
            yv = TensorView(y.data_ptr(), _weft.DTYPES["bf16"], tuple(y.shape), y.stride())
        else:
            yv = self._unused("bf16", 0, self.hidden)
        self._get().low_latency_combine(handle._get(), yv, iv, wv, ov, _stream(self._ctx), phase=phase,
                                        num_sms=num_sms)
        return written(out) if phase != "send" else out

    def check(self):
        """Raises weft.Error for an error a kernel reported (capacity overflow, bad expert index ...)."""
        self._get().check()

    def sync_and_check(self):
        self._get().sync_and_check(_stream(self._ctx))


class MoeBlock(_FusedOp):
    """A whole expert-parallel MoE block of this rank (weft::ops::ep::MoeBlock): dispatch, up-projection, SwiGLU,
    down-projection and combine, the expert GEMMs overlapping the communication. For each token t:

        out[t] = sum over t's valid slots j of topk_weights[t, j] * down_e(swiglu(gate_up_e(x[t]))),  e = topk_idx[t, j]

    gate_up_e(x) = x @ gate_up[e_local].T ([2 * ffn]: gate rows [0, ffn), up rows [ffn, 2 * ffn)), swiglu(g, u) =
    silu(g) * u rounded to bf16, down_e(a) = a @ down[e_local].T; each GEMM accumulates in fp32 and rounds to bf16;
    e_local = e - rank * num_experts / W (this rank's experts). Collective to make (over the World, or `team`'s
    members, one node) and to close; forward() on torch's current stream, collective. num_experts a multiple of the
    team's size; hidden and ffn multiples of 8; max_recv_tokens / max_recv_rows as Buffer's (0: the worst case)."""
    _kind = "ep.MoeBlock"

    def __init__(self, num_experts, hidden, topk, max_tokens_per_rank, ffn, *, max_recv_tokens=0, max_recv_rows=0,
                 team=None):
        super().__init__(lambda w: _weft.ep.MoeBlock(w, num_experts, hidden, topk, max_tokens_per_rank, ffn,
                                                     max_recv_tokens=max_recv_tokens, max_recv_rows=max_recv_rows,
                                                     team=self._team), team)
        self.num_experts, self.hidden, self.topk, self.ffn = num_experts, hidden, topk, ffn
        self.max_tokens_per_rank = max_tokens_per_rank

    def _weight(self, t, name, shape):
        torch = torch_module()
        check_tensor(t, name, self._ctx, (torch.bfloat16,))
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor; call .contiguous()")
        return TensorView(t.data_ptr(), _weft.DTYPES["bf16"], tuple(t.shape), t.stride())

    def forward(self, x, topk_idx, topk_weights, gate_up, down, out=None, *, fused=True, comm_sms=0):
        """x: bf16 [T, hidden]; topk_idx: int32 [T, topk] (-1 drops a slot; ids outside [-1, num_experts) and repeats
        within a token are dropped and reported by check()); topk_weights: float32 [T, topk]; gate_up: bf16
        [num_local_experts, 2 * ffn, hidden]; down: bf16 [num_local_experts, hidden, ffn]; out: bf16 [T, hidden]
        (allocated when None). fused=False runs the separate ops one after another (the same bits). comm_sms: blocks of
        the dispatch and combine (0: chosen). A receive-capacity overflow moves nothing, gives zeros and is raised by
        check(). Returns out."""
        torch = torch_module()
        op = self._get()
        el = self.num_local_experts
        xv, iv, wv = _routing_views(self._ctx, x, topk_idx, topk_weights)
        gv = self._weight(gate_up, "gate_up", (el, 2 * self.ffn, self.hidden))
        dv = self._weight(down, "down", (el, self.hidden, self.ffn))
        if out is None:
            out = torch.empty((x.shape[0], self.hidden), dtype=torch.bfloat16, device=x.device)
        ov = _view(out, "out", self._ctx, torch.bfloat16)
        op.forward(xv, iv, wv, gv, dv, ov, _stream(self._ctx), fused=bool(fused), comm_sms=comm_sms)
        return written(out)

    __call__ = forward

    @property
    def num_local_experts(self):
        return self._get().num_local_experts

    @property
    def max_recv_rows(self):
        return self._get().max_recv_rows

    @property
    def up_config(self):
        """The up-projection's grouped GEMM config (its name)."""
        return self._get().up_config

    @property
    def down_config(self):
        return self._get().down_config

    @property
    def expert_counts(self):
        """int32 [num_local_experts]: the rows each local expert received in the last forward (a zero-copy view)."""
        return _tensor(self._get().expert_counts, self._world)

    @property
    def expert_offsets(self):
        """int32 [num_local_experts + 1]: where each local expert's rows start in the intermediates (zero-copy)."""
        return _tensor(self._get().expert_offsets, self._world)

    @property
    def gate_up_out(self):
        """bf16 [max_recv_rows, 2 * ffn]: the last forward's up-projection (valid rows: the expert segments)."""
        return _tensor(self._get().gate_up_out, self._world)

    @property
    def activation(self):
        return _tensor(self._get().activation, self._world)

    @property
    def expert_out(self):
        return _tensor(self._get().expert_out, self._world)

    def check(self):
        """Raises weft.Error for an error a kernel reported (capacity overflow, bad expert index, bad counts)."""
        self._get().check()

    def sync_and_check(self):
        self._get().sync_and_check(_stream(self._ctx))
