# SPDX-License-Identifier: MIT
"""weft's attention ops on torch tensors. flash_attention and decode_attention are local ops: they run on the GPU their
tensors are on and need no weft.init; each call is enqueued on torch's current CUDA stream of that device
(asynchronous, graph-capturable; the first flash_attention call on a device waits once on the host for weft's work
counters to be zeroed). sp_decode_attention and AgAttention are collectives of the World (weft.init first)."""
import operator

from . import _tensor, _weft
from ._weft import Error
from ._ops import _FusedOp, _context, _fused_dtype, _refused
from ._tensor import dtype_code, torch_module


def _dtype_list(dtypes):
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def _check(t, name, dims, dtypes, device=None, like="q"):
    """Raises TypeError / ValueError naming the argument unless `t` is a `dims`-D torch tensor of one of `dtypes` on
    `device` (None: any CUDA device; else the device of the argument named `like`)."""
    torch = torch_module()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected a {dims}-D tensor, got shape {tuple(t.shape)}")
    if device is None and t.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor, got one on {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} ({like}'s device), got one on {t.device}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {_dtype_list(dtypes)}, got {str(t.dtype).replace('torch.', '')}")


def _view(t, name):
    """The TensorView of `t` (its pointer, shape and strides in elements; the C++ op checks the layout)."""
    return _weft.TensorView(t.data_ptr(), dtype_code(t.dtype, name), tuple(t.shape), tuple(t.stride()))


def _output(out, name, like, shape, dtype):
    """`out` checked (shape and dtype; the op checks contiguity), or a new tensor on like's device."""
    torch = torch_module()
    if out is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    _check(out, name, len(shape), (dtype,), like.device)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    return out


def flash_attention(q, k, v, out=None, *, causal=False, scale=None, q_position=0, return_lse=False):
    """Attention forward of one sequence on one GPU: out = softmax(scale * q k^T) v per q-head (weft's flash-attention
    kernel; on sm_90 the wgmma one).

    q: [seq_q, num_q_heads, head_dim]; k, v: [seq_kv, num_kv_heads, head_dim], same shape and strides. bf16 or f16
    (one dtype), head_dim 64 or 128, num_q_heads a multiple of num_kv_heads (at most 16 q-heads per KV head). Any
    strides with the innermost 1 and the others multiples of 8 elements: views into a packed QKV projection work, and
    so does one sequence of torch's [batch, heads, seq, dim] layout as x[b].transpose(0, 1).
    causal: query i sees the keys j <= q_position + i (q_position 0 with seq_q == seq_kv is SDPA's is_causal=True);
    a row that sees no key gets zeros. scale: default 1 / sqrt(head_dim).
    out: q's dtype and shape, contiguous; allocated when None. Returns out, or (out, lse) when return_lse, lse the
    per-row log-sum-exp (natural log) as f32 [seq_q, num_q_heads]. Bad arguments raise TypeError / ValueError, or
    weft.Error from the op naming what it expected."""
    scale, q_position = _number(scale, "scale", float, none=True), _number(q_position, "q_position", int)
    torch = torch_module()
    halves = (torch.bfloat16, torch.float16)
    _check(q, "q", 3, halves)
    _check(k, "k", 3, (q.dtype,), q.device)
    _check(v, "v", 3, (q.dtype,), q.device)
    out = _output(out, "out", q, tuple(q.shape), q.dtype)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
    device = q.device.index
    _weft.flash_attention(_view(q, "q"), _view(k, "k"), _view(v, "v"), _view(out, "out"),
                          _view(lse, "lse") if lse is not None else None, device, _tensor._raw_stream(device),
                          bool(causal), scale, q_position)
    _tensor.written(out)
    return (out, lse) if return_lse else out


_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _number(value, name, kind, none=False, bounds=_INT32):
    """`value` as `kind` (int: an integer, numpy's and torch's included, within `bounds`, the C type's range the
    extension takes; float: a real number, finite or not), or None where `none` allows it; else TypeError (the type)
    or ValueError (out of range) naming the argument."""
    if value is None and none:
        return None
    try:
        if isinstance(value, (bool, str, bytes)):
            raise TypeError
        number = operator.index(value) if kind is int else float(value)
    except TypeError:
        what = "an integer" if kind is int else "a number"
        raise TypeError(f"{name}: expected {what}{' or None' if none else ''}, got {type(value).__name__}") from None
    except OverflowError:
        raise ValueError(f"{name}: {value!r} is out of a float's range") from None
    if kind is int and not bounds[0] <= number <= bounds[1]:
        raise ValueError(f"{name}: expected an integer in [{bounds[0]}, {bounds[1]}], got {number}")
    return number


def _status_view(status, device, maker, like):
    """The TensorView of an op's `status` (None passes as None): an int32 tensor of 4 contiguous elements on `device`
    (the device of the argument named `like`), as weft.`maker`() makes one; else TypeError / ValueError."""
    if status is None:
        return None
    _check(status, "status", 1, (torch_module().int32,), device, like)
    if status.numel() != 4 or not status.is_contiguous():
        raise ValueError(f"status: expected an int32 tensor of 4 contiguous elements (weft.{maker}()), got shape "
                         f"{tuple(status.shape)} with strides {tuple(status.stride())}")
    return _view(status, "status")


def _decode_args(q, k_cache, v_cache, block_table, seq_lens, out, max_seq_len, return_lse, workspace, status):
    """decode_attention's arguments checked, as (the views q, k_cache, v_cache, block_table, seq_lens, max_seq_len,
    out, lse, workspace, status in the extension's order; out; lse or None). Raises TypeError / ValueError naming
    the argument."""
    torch = torch_module()
    halves = (torch.bfloat16, torch.float16)
    _check(q, "q", 3, halves)
    _check(k_cache, "k_cache", 4, (q.dtype,), q.device)
    _check(v_cache, "v_cache", 4, (q.dtype,), q.device)
    _check(block_table, "block_table", 2, (torch.int32,), q.device)
    _check(seq_lens, "seq_lens", 1, (torch.int32,), q.device)
    if max_seq_len is None:
        max_seq_len = block_table.shape[1] * k_cache.shape[1]
    max_seq_len = _number(max_seq_len, "max_seq_len", int, bounds=_INT64)
    out = _output(out, "out", q, tuple(q.shape), q.dtype)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
    ws = None
    if workspace is not None:
        _check(workspace, "workspace", 1, (torch.uint8,), q.device)
        ws = _view(workspace, "workspace")
    st = _status_view(status, q.device, "attention_status", "q")
    views = (_view(q, "q"), _view(k_cache, "k_cache"), _view(v_cache, "v_cache"), _view(block_table, "block_table"),
             _view(seq_lens, "seq_lens"), max_seq_len, _view(out, "out"),
             _view(lse, "lse") if lse is not None else None, ws, st)
    return views, out, lse


def decode_attention(q, k_cache, v_cache, block_table, seq_lens, out=None, *, max_seq_len=None, scale=None,
                     num_splits=0, return_lse=False, workspace=None, status=None):
    """Decode attention against a paged KV cache on one GPU (flash-decoding: KV splits across SMs, then a combine):
    one query token per sequence, out[b, h] = softmax(scale * q[b, h] k^T) v over the first seq_lens[b] tokens of
    sequence b, token j in slot j % page_size of page block_table[b, j // page_size].

    q: [batch, num_q_heads, head_dim] bf16 or f16; k_cache, v_cache: q's dtype, [num_pages, page_size, num_kv_heads,
    head_dim] (a [pages, heads, slots, dim] cache as a strided view: .transpose(1, 2)), same shape and strides;
    block_table: int32 [batch, max_pages_per_seq]; seq_lens: int32 [batch]. head_dim 64, 128 or 256; num_q_heads a
    multiple of num_kv_heads (at most 16 per KV head). max_seq_len: a bound of seq_lens that sizes the split plan
    (default: max_pages_per_seq x page_size; a tighter one saves work). scale: default 1 / sqrt(head_dim).
    num_splits: KV splits per (sequence, KV head), 0 chooses. workspace: device scratch (u8, contiguous) of at least
    decode_attention_workspace_bytes(...) bytes (a 1-D uint8 tensor); without it weft keeps one per device and stream
    for the process's life (a program that makes a stream per call should pass one), grown by uncaptured calls, so
    capturing on a stream with no earlier uncaptured call of this size (torch.cuda.graph captures on a side stream of
    its own) needs one. Calls on one stream come from one thread at a time.
    status: None (the block-table entries are trusted: one outside [0, num_pages) is an out-of-bounds read), or an int32
    tensor of 4 elements on q's device, zeroed (weft.attention_status() makes one): the entries are checked (a second
    kernel build, a few percent slower), a sequence holding one outside the cache gets NaN out and lse, and the first
    found is recorded there; weft.check_attention_status(status) raises weft.Error naming it. Returns out (allocated
    when None), or (out, lse) when return_lse (f32 [batch, num_q_heads], natural log; -inf for an empty sequence, whose
    output is zeros)."""
    scale, num_splits = _number(scale, "scale", float, none=True), _number(num_splits, "num_splits", int)
    args, out, lse = _decode_args(q, k_cache, v_cache, block_table, seq_lens, out, max_seq_len, return_lse,
                                  workspace, status)
    device = q.device.index
    _weft.decode_attention(*args[:8], device, _tensor._raw_stream(device), scale, num_splits, *args[8:])
    _tensor.written(out)
    return (out, lse) if return_lse else out


def sp_decode_attention(q, k_cache, v_cache, block_table, seq_lens, out=None, *, max_seq_len=None, scale=None,
                        num_splits=0, return_lse=False, workspace=None, status=None, team=None):
    """Sequence-parallel decode attention: a collective over `team` (a weft.Team; None: the World; one node). Every
    rank holds a shard of every sequence's KV cache (its own pages, block_table and seq_lens: the tokens of a sequence
    may be split across the ranks in any way) and the same q; every rank gets in out (and lse) the attention over the
    whole sequence, as decode_attention would give over the shards' tokens together. Arguments as for
    decode_attention, per rank, on this rank's GPU: q, out and the head counts the same on every rank; each rank's
    cache, page size, layout, max_seq_len, num_splits and workspace its own. Every rank calls it in the same order as
    its other collectives with the same batch, q-heads, head_dim and dtype (a rank whose call differs is a mismatch
    that World.sync_and_check raises on the ranks that saw it, naming both calls). status (each rank its own, or
    None): a block-table entry outside this rank's cache makes its sequence's out and lse NaN on every rank and is
    recorded (the sequence's index) in the status of the rank whose table holds it. The first call with a head_dim and
    dtype compiles its kernels and meets every rank: make it before capturing a CUDA graph; and capture with a
    `workspace` (as for decode_attention: torch.cuda.graph captures on a stream of its own). On torch's current
    stream. Returns out (allocated when None), or (out, lse) when return_lse."""
    ctx, cpp_team = _context(team, "sp_decode_attention")
    try:
        _tensor.check_tensor(q, "q", ctx)
        scale, num_splits = _number(scale, "scale", float, none=True), _number(num_splits, "num_splits", int)
        args, out, lse = _decode_args(q, k_cache, v_cache, block_table, seq_lens, out, max_seq_len, return_lse,
                                      workspace, status)
    except (TypeError, ValueError):
        _refused(ctx, cpp_team)
        raise
    _weft.sp_decode_attention(ctx.world, *args[:8], ctx.stream(ctx.device_index), scale, num_splits, *args[8:],
                              cpp_team)
    _tensor.written(out)
    return (out, lse) if return_lse else out


def _zeroed_status(device, beside):
    """A zeroed int32 tensor of 4 elements on CUDA device `device` (default: torch's current one); ValueError for
    another kind of device (the status lives beside the op's argument named `beside`)."""
    torch = torch_module()
    dev = None if device is None else torch.device(device)
    if dev is not None and dev.type != "cuda":
        raise ValueError(f"device: expected a CUDA device (the status lives beside {beside}), got {dev}")
    index = None if dev is None else dev.index
    if index is None:
        index = torch.cuda.current_device()
    return torch.zeros(4, dtype=torch.int32, device=torch.device("cuda", index))


def attention_status(device=None):
    """A zeroed int32 tensor of 4 elements on `device` (default: torch's current CUDA device) for decode_attention's
    `status`: code (0: nothing found; 1: a block-table entry outside the cache), sequence, page (the entry's row and
    column of block_table) and value."""
    return _zeroed_status(device, "q")


def _status_record(status, op):
    """The four fields of a status tensor given to `op` (read on torch's current stream, which it waits for); TypeError
    unless `status` is an int32 tensor of 4 elements."""
    torch = torch_module()
    if not isinstance(status, torch.Tensor) or status.dtype != torch.int32 or status.numel() != 4:
        raise TypeError(f"status: expected the int32 tensor of 4 elements given to {op}")
    return tuple(int(x) for x in status.tolist())


def check_attention_status(status):
    """Raises weft.Error naming the bad block-table entry decode_attention recorded in `status`, if any. Reads the
    tensor on torch's current stream: call it there after the decode call (or after synchronising the stream it ran
    on). Zero it again (status.zero_()) before reusing it."""
    code, sequence, page, value = _status_record(status, "decode_attention")
    if code != 0:
        raise Error(_weft.describe_attention_status(code, sequence, page, value))


def decode_attention_workspace_bytes(batch, num_q_heads, num_kv_heads, head_dim, max_seq_len, *, num_splits=0,
                                     device=None):
    """The bytes decode_attention's `workspace` needs for these sizes on `device` (default: torch's current CUDA
    device); 0 when one split suffices."""
    torch = torch_module()
    index = None if device is None else torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    return _weft.decode_attention_workspace_bytes(int(batch), int(num_q_heads), int(num_kv_heads), int(head_dim),
                                                  int(max_seq_len), int(num_splits), index)


class AgAttention(_FusedOp):
    """Sequence-parallel prefill attention (AllGather + attention, weft::ops::AgAttention): every rank holds S / W
    consecutive tokens of one sequence (rank r: global positions [r * S / W, (r + 1) * S / W)) and gets the attention of
    its queries over the whole sequence's keys, each peer's K / V shard consumed as it arrives. Collective to make
    (over the World, or `team`'s members, one node) and to close; run() on torch's current stream, collective with the
    same S on every rank. max_seq: the largest S, a multiple of the team's size; num_q_heads a multiple of
    num_kv_heads (at most 16 q-heads per KV head); head_dim 64 or 128; dtype torch.bfloat16 (default) or
    torch.float16; causal: keys at global positions <= the query's (False: every key); scale: default
    1 / sqrt(head_dim); sm_budget: blocks of the attention kernel (0: the World's budget)."""
    _kind = "AgAttention"

    def __init__(self, max_seq, num_q_heads, num_kv_heads, head_dim=128, dtype=None, *, causal=True, scale=None,
                 sm_budget=0, team=None):
        self.dtype = _fused_dtype(dtype)
        code = dtype_code(self.dtype)
        values = {"max_seq": max_seq, "num_q_heads": num_q_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
        values = {name: _number(v, name, int, bounds=(1, _INT32[1])) for name, v in values.items()}
        scale = _number(scale, "scale", float, none=True)
        sm_budget = _number(sm_budget, "sm_budget", int, bounds=(0, _INT32[1]))
        super().__init__(lambda w: _weft.AgAttention(w, **values, dtype=code, causal=bool(causal), scale=scale,
                                                     sm_budget=sm_budget, team=self._team), team)
        for name, v in values.items():
            setattr(self, name, v)
        self.causal = bool(causal)

    def run(self, q_local, k_local, v_local, out=None, *, return_lse=False):
        """q_local [S / W, num_q_heads, head_dim] (innermost stride 1, the others multiples of 8); k_local, v_local
        [S / W, num_kv_heads, head_dim] (heads and dims contiguous; local_k(S) / local_v(S) skip the local copy); out
        [S / W, num_q_heads, head_dim] contiguous, allocated when None. Returns out, or (out, lse) when return_lse (lse
        float32 [S / W, num_q_heads], natural log)."""
        torch = torch_module()
        op = self._get()
        ctx = self._ctx
        rows = None
        for t, name, heads in ((q_local, "q_local", self.num_q_heads), (k_local, "k_local", self.num_kv_heads),
                               (v_local, "v_local", self.num_kv_heads)):
            _tensor.check_tensor(t, name, ctx, (self.dtype,))
            if t.dim() != 3 or t.shape[1] != heads or t.shape[2] != self.head_dim:
                raise ValueError(f"{name}: expected shape [S / W, {heads}, {self.head_dim}], got {tuple(t.shape)}")
            if rows is None:
                rows = t.shape[0]
            elif t.shape[0] != rows:
                raise ValueError(f"{name}: expected q_local's {rows} rows, got shape {tuple(t.shape)}")
        if rows < 1 or rows * self.num_ranks > self.max_seq:
            raise ValueError(f"q_local: expected 1 to {self.max_seq // self.num_ranks} rows (max_seq / ranks), got "
                             f"{rows}")
        out = _output(out, "out", q_local, (rows, self.num_q_heads, self.head_dim), self.dtype)
        lse = torch.empty((rows, self.num_q_heads), dtype=torch.float32, device=q_local.device) if return_lse else None
        op.run(_view(q_local, "q_local"), _view(k_local, "k_local"), _view(v_local, "v_local"), _view(out, "out"),
               _view(lse, "lse") if lse is not None else None, ctx.stream(ctx.device_index))
        _tensor.written(out)
        return (out, lse) if return_lse else out

    def _buffer(self, view):
        return _tensor.heap_tensor(view, self._world, self.dtype)

    def local_k(self, seq):
        """[seq / W, num_kv_heads, head_dim] over this rank's K shard inside the op's gathered buffer (zero copy):
        writing the K projection here and passing it as k_local skips run's local copy (valid until the op is
        closed)."""
        return self._buffer(self._get().local_k(int(seq)))

    def local_v(self, seq):
        return self._buffer(self._get().local_v(int(seq)))

    def gathered_k(self, seq):
        """[seq, num_kv_heads, head_dim]: the gathered keys after a run with S = seq (all shards without the mask,
        shards 0..rank under the causal mask), until the next run."""
        return self._buffer(self._get().gathered_k(int(seq)))

    def gathered_v(self, seq):
        return self._buffer(self._get().gathered_v(int(seq)))
