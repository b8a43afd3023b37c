# SPDX-License-Identifier: MIT
"""weft's ops on torch tensors, launched on torch's current CUDA stream (asynchronous, graph-capturable).

Per call, the collectives read the World's constants (device, dtype tables, algorithm codes, torch's current-stream
lookup) from its CallContext and pass contiguous tensors to the extension as pointers and element counts."""
import math
import operator

from . import _runtime, _weft
from ._tensor import (CallContext, bytes_arg, check_tensor, dtype_code, flat_arg, heap_tensor, matrix_view, out_arg,
                      torch_module, values_are_bytes, written)
from ._weft import Error, TensorView


def _context(team, op):
    """(the World's CallContext, the C++ team or None for the World's own) for an op on `team` (a weft.Team or None:
    the World)."""
    state = _runtime._state
    if state is None:
        state = _runtime._get_state()  # raises: not initialised
    ctx = state.call_context
    if ctx is None:
        ctx = state.call_context = CallContext(state.world)
    if team is None:
        return ctx, None
    return ctx, _runtime._cpp_team(team, op, state)


def _team_size(ctx, cpp_team):
    """The ranks of a call's team: the C++ team's, or (None) the World's."""
    return ctx.num_ranks if cpp_team is None else cpp_team.num_ranks


def _stream(ctx):
    """torch's current CUDA stream on the World's device, as an integer (cudaStream_t)."""
    return ctx.stream(ctx.device_index)


def _algo(ctx, op, name):
    code = ctx.algo_codes[op].get(name)
    if code is None:
        if not isinstance(name, str):
            raise TypeError(f"algo: expected an algorithm name (str), got {type(name).__name__}")
        try:
            code = _weft.parse_algo(op, name)
        except Error as e:
            raise ValueError(str(e)) from None
        ctx.algo_codes[op][name] = code
    return code


def _refused(ctx, cpp_team):
    """Counts a collective call this wrapper refuses (its own argument checks) in the team's sequence of collective
    calls, as weft's ops count the calls they refuse: a rank that goes on after it fails its next call as a mismatch
    on every rank, instead of pairing with its peers' refused call."""
    _weft.count_refused_collective_call(ctx.world, cpp_team)


def count_refused_call(team, op):
    """_refused for a call on `team` (a weft.Team or None: the World) refused before its wrapper ran."""
    ctx, cpp_team = _context(team, op)
    _refused(ctx, cpp_team)


def all_reduce(tensor, out=None, *, algo="auto", team=None):
    """out = the element-wise sum of every rank's `tensor` (bf16, f16 or f32, contiguous). In place when out is None
    (like torch.distributed.all_reduce). Returns out. Collective over `team` (a weft.Team; None: the World); on
    torch's current stream."""
    ctx, cpp_team = _context(team, "all_reduce")
    try:
        ptr, numel, code = flat_arg(tensor, "tensor", ctx, ctx.reducible)
        if out is None:
            out, out_ptr = tensor, ptr
        else:
            out_ptr = out_arg(out, "out", ctx, tensor.dtype, numel)
        algo_code = _algo(ctx, "all_reduce", algo)
    except (TypeError, ValueError):
        _refused(ctx, cpp_team)
        raise
    _weft.all_reduce_flat(ctx.world, ptr, out_ptr, numel, code, ctx.stream(ctx.device_index), algo_code, cpp_team)
    return written(out)


def all_gather(tensor, out=None, *, algo="auto", team=None):
    """out = every rank's `tensor` concatenated along dim 0 in rank order (contiguous; any dtype: the op moves bytes,
    quantized tensors and conjugate or negative views refused): shape [num_ranks * tensor.shape[0], ...]. Returns out
    (allocated when None). Collective; on torch's current stream. A symmetric out (weft.empty) lets the push
    algorithms write into it directly."""
    ctx, cpp_team = _context(team, "all_gather")
    try:
        ptr, count, code = bytes_arg(tensor, "tensor", ctx)  # count: elements of `code` (bytes for a dtype as u8)
        n = _team_size(ctx, cpp_team)
        shape = tuple(tensor.shape)
        concatenated = (n * shape[0], *shape[1:]) if shape else (n,)
        if out is not None:
            out_ptr = out_arg(out, "out", ctx, tensor.dtype, n * tensor.numel())
        algo_code = _algo(ctx, "all_gather", algo)
    except (TypeError, ValueError):
        _refused(ctx, cpp_team)
        raise
    if out is None:
        out = torch_module().empty(concatenated, dtype=tensor.dtype, device=tensor.device)
        out_ptr = out.data_ptr()
    _weft.all_gather_flat(ctx.world, ptr, count, out_ptr, n * count, code, ctx.stream(ctx.device_index), algo_code,
                          cpp_team)
    return written(out)


def reduce_scatter(tensor, out=None, *, algo="auto", team=None):
    """out = slice `rank` (along dim 0) of the element-wise sum of every rank's `tensor` (bf16, f16 or f32,
    contiguous, dim 0 a multiple of num_ranks): shape [tensor.shape[0] / num_ranks, ...]. Returns out (allocated
    when None). Collective; on torch's current stream."""
    ctx, cpp_team = _context(team, "reduce_scatter")
    try:
        ptr, numel, code = flat_arg(tensor, "tensor", ctx, ctx.reducible)
        n = _team_size(ctx, cpp_team)
        shape = tensor.shape
        if not shape or shape[0] % n != 0:
            raise ValueError(f"tensor: expected dim 0 a multiple of the {n} ranks, got shape {tuple(shape)}")
        if out is not None:
            out_ptr = out_arg(out, "out", ctx, tensor.dtype, numel // n)
        algo_code = _algo(ctx, "reduce_scatter", algo)
    except (TypeError, ValueError):
        _refused(ctx, cpp_team)
        raise
    if out is None:
        out = torch_module().empty((shape[0] // n, *shape[1:]), dtype=tensor.dtype, device=tensor.device)
        out_ptr = out.data_ptr()
    _weft.reduce_scatter_flat(ctx.world, ptr, numel, out_ptr, numel // n, code, ctx.stream(ctx.device_index),
                              algo_code, cpp_team)
    return written(out)


def all_to_all(tensor, out=None, *, team=None):
    """Every rank's `tensor` split into num_ranks equal chunks along dim 0; out's chunk q (in rank order) is rank q's
    chunk `rank` (torch.distributed.all_to_all_single with equal splits). Contiguous, any dtype (the op moves bytes;
    quantized tensors and conjugate or negative views refused), dim 0 a multiple of num_ranks; out: tensor's shape and
    dtype, apart from it, allocated when None. Returns out. Collective; on torch's current stream. A symmetric tensor
    (weft.empty) is read by the peers in place; any other is staged through the collective workspace."""
    ctx, cpp_team = _context(team, "all_to_all")
    try:
        ptr, count, code = bytes_arg(tensor, "tensor", ctx)
        n = _team_size(ctx, cpp_team)
        shape = tuple(tensor.shape)
        if not shape or shape[0] % n != 0:
            raise ValueError(f"tensor: expected dim 0 a multiple of the {n} ranks, got shape {shape}")
        if out is not None:
            out_ptr = out_arg(out, "out", ctx, tensor.dtype, tensor.numel())
    except (TypeError, ValueError):
        _refused(ctx, cpp_team)
        raise
    if out is None:
        out = torch_module().empty(shape, dtype=tensor.dtype, device=tensor.device)
        out_ptr = out.data_ptr()
    _weft.all_to_all_flat(ctx.world, ptr, out_ptr, count, code, ctx.stream(ctx.device_index), cpp_team)
    return written(out)


def _split_sizes(counts, name, n):
    """A list of n non-negative ints (rows along dim 0), or TypeError / ValueError naming the argument."""
    try:
        values = [operator.index(c) for c in counts]
    except TypeError:
        raise TypeError(f"{name}: expected a sequence of {n} integers (rows along dim 0), got {counts!r}") from None
    if len(values) != n or any(c < 0 for c in values):
        raise ValueError(f"{name}: expected {n} non-negative integers (one per rank), got {values}")
    return values


def all_to_all_v(tensor, send_counts, recv_counts, out=None, *, team=None):
    """Uneven splits along dim 0 (torch.distributed.all_to_all_single with split sizes): this rank sends rows
    [sum(send_counts[:q]), + send_counts[q]) of `tensor` to rank q and receives recv_counts[q] rows from rank q, back to
    back in rank order, into out [sum(recv_counts), *tensor.shape[1:]] (allocated when None). Rank q's
    send_counts[rank] must equal this rank's recv_counts[q] (checked across ranks before anything is read: weft.Error
    naming both counts). tensor contiguous with sum(send_counts) rows, any dtype, as all_to_all; a tensor that is not
    symmetric is staged in one piece (at most the collective workspace's staging bytes, 32 MiB by default; larger
    inputs must be symmetric: weft.empty). Returns out. Collective; on torch's current stream."""
    ctx, cpp_team = _context(team, "all_to_all_v")
    try:
        ptr, count, code = bytes_arg(tensor, "tensor", ctx)
        n = _team_size(ctx, cpp_team)
        shape = tuple(tensor.shape)
        if not shape:
            raise ValueError("tensor: expected at least one dimension (rows along dim 0), got a 0-d tensor")
        send = _split_sizes(send_counts, "send_counts", n)
        recv = _split_sizes(recv_counts, "recv_counts", n)
        if sum(send) != shape[0]:
            raise ValueError(f"send_counts: expected rows summing to tensor's {shape[0]} (dim 0), got {send}")
        as_bytes = tensor.dtype not in ctx.all_dtypes  # moved as u8 (bytes_arg): counts in bytes
        row = math.prod(shape[1:]) * (tensor.element_size() if as_bytes else 1)  # elements of `code` per row
        out_shape = (sum(recv), *shape[1:])
        if out is not None:
            out_ptr = out_arg(out, "out", ctx, tensor.dtype, math.prod(out_shape))
    except (TypeError, ValueError):
        _refused(ctx, cpp_team)
        raise
    if out is None:
        out = torch_module().empty(out_shape, dtype=tensor.dtype, device=tensor.device)
        out_ptr = out.data_ptr()
    _weft.all_to_all_v_flat(ctx.world, ptr, count, [c * row for c in send], out_ptr, sum(recv) * row,
                            [c * row for c in recv], code, ctx.stream(ctx.device_index), cpp_team)
    return written(out)

def _ulysses(x, out, team, seq_to_head):
    op = "ulysses_seq_to_head" if seq_to_head else "ulysses_head_to_seq"
    ctx, cpp_team = _context(team, op)
    try:
        check_tensor(x, "x", ctx, ctx.all_dtypes)
        n = _team_size(ctx, cpp_team)
        if x.dim() != 3 or not x.is_contiguous():
            raise ValueError(f"x: expected a contiguous 3-D tensor, got shape {tuple(x.shape)} and strides {x.stride()}")
        rows, heads, dim = x.shape
        if seq_to_head:
            if heads % n != 0:
                raise ValueError(f"x: expected [S / W, H, D] with H a multiple of the {n} ranks, got {tuple(x.shape)}")
            shape = (rows * n, heads // n, dim)
        else:
            if rows % n != 0:
                raise ValueError(f"x: expected [S, H / W, D] with S a multiple of the {n} ranks, got {tuple(x.shape)}")
            shape = (rows // n, heads * n, dim)
        if out is not None:
            check_tensor(out, "out", ctx, (x.dtype,))
            if tuple(out.shape) != shape or not out.is_contiguous():
                raise ValueError(f"out: expected a contiguous tensor of shape {shape}, got {tuple(out.shape)}")
        values_are_bytes(x, "x")
    except (TypeError, ValueError):
        _refused(ctx, cpp_team)
        raise
    torch = torch_module()
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    scratch = torch.empty(x.shape, dtype=x.dtype, device=x.device)

    def view(t):
        return TensorView(t.data_ptr(), ctx.all_dtypes[t.dtype], tuple(t.shape), t.stride())

    _weft.ulysses(ctx.world, view(x), view(out), view(scratch), seq_to_head, ctx.stream(ctx.device_index), cpp_team)
    return written(out)


def ulysses_seq_to_head(x, out=None, *, team=None):
    """Ulysses re-shard, sequence-sharded to head-sharded: x [S / W, H, D] (this rank's tokens, every head) becomes out
    [S, H / W, D] (every token, this rank's heads: rank r holds heads [r H / W, (r + 1) H / W)). x contiguous, any dtype
    weft knows, H a multiple of W; out allocated when None. A strided copy into a scratch tensor the call allocates,
    then an all-to-all. Collective; on torch's current stream."""
    return _ulysses(x, out, team, True)


def ulysses_head_to_seq(x, out=None, *, team=None):
    """The inverse of ulysses_seq_to_head: x [S, H / W, D] becomes out [S / W, H, D] (S a multiple of W)."""
    return _ulysses(x, out, team, False)


def _padded_out(shape, dtype, device):
    """A new output of `shape` whose rows start at multiples of 16 bytes, for a kernel that stores rows with TMA: (the
    tensor to write, None), or, when the last extent is not a multiple of 16 bytes' elements, (its first columns in a
    padded allocation, the allocation): the caller then returns a contiguous copy. Uninitialised (torch.empty)."""
    torch = torch_module()
    per16 = 16 // torch.empty((0,), dtype=dtype).element_size()
    n = shape[-1]
    if n % per16 == 0:
        return torch.empty(shape, dtype=dtype, device=device), None
    padded = torch.empty((*shape[:-1], -(-n // per16) * per16), dtype=dtype, device=device)
    return padded[..., :n], padded


def _empty_out(rows, n, dtype, device):
    """An output [rows, n] as _padded_out makes it; one row (no row stride to align) is never padded."""
    if rows <= 1:
        return torch_module().empty((rows, n), dtype=dtype, device=device), None
    return _padded_out((rows, n), dtype, device)


def gemm(a, b, out=None, *, b_layout="nk", out_dtype=None):
    """out[M, N] = a[M, K] @ B with b [N, K] (b_layout "nk": a linear layer's weight, out = a @ b.T) or [K, N]
    ("kn": out = a @ b). bf16 or f16 in (same dtype), fp32 accumulation; out dtype: out_dtype, else a's. Rows may be
    strided (inner stride 1); K a multiple of 8; 16-byte aligned bases and row strides. Local (one GPU)."""
    ctx, _ = _context(None, "gemm")
    av = matrix_view(a, "a", ctx, ctx.gemm_in)
    bv = matrix_view(b, "b", ctx, (a.dtype,))
    if b_layout not in ("nk", "kn"):
        raise ValueError(f"b_layout: expected 'nk' or 'kn', got {b_layout!r}")
    n, k = (b.shape[0], b.shape[1]) if b_layout == "nk" else (b.shape[1], b.shape[0])
    if k != a.shape[1]:
        want = "[N, K]" if b_layout == "nk" else "[K, N]"
        raise ValueError(f"b: expected {want} (b_layout {b_layout!r}) with a's K = {a.shape[1]}, got shape "
                         f"{tuple(b.shape)}")
    out_dtypes = (a.dtype, torch_module().float32)
    if out_dtype is not None and out_dtype not in out_dtypes:
        raise TypeError(f"out_dtype: expected {a.dtype} (a's) or torch.float32, got {out_dtype}")
    padded = None
    if out is None:
        out, padded = _empty_out(a.shape[0], n, out_dtype or a.dtype, a.device)
    dv = matrix_view(out, "out", ctx, out_dtypes if out_dtype is None else (out_dtype,))
    _out_shape_check(out, (a.shape[0], n))
    _weft.gemm(av, bv, dv, 0 if b_layout == "nk" else 1, ctx.device_index, _stream(ctx))
    return written(out) if padded is None else out.contiguous()


def _out_shape_check(out, shape):
    if tuple(out.shape) != shape:
        raise ValueError(f"out: expected shape {shape}, got {tuple(out.shape)}")


def _fused_dtype(dtype):
    """A fused op's dtype (None: bf16); TypeError unless torch.bfloat16 or torch.float16."""
    torch = torch_module()
    if dtype is None:
        return torch.bfloat16
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"dtype: expected torch.bfloat16 or torch.float16, got {dtype}")
    return dtype


class _FusedOp:
    """What AgGemm, GemmRs and GemmAr share: a collective C++ object closed explicitly (or by weft.finalize)."""
    _kind = None
    _a_name = "a"

    def __init__(self, make, team):
        torch = torch_module()
        self._ctx, self._team = _context(team, self._kind)
        self._world = self._ctx.world
        self.num_ranks = self._team.num_ranks if self._team is not None else self._world.num_ranks
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise Error(f"{self._kind}: making the op is collective (symmetric allocation, kernel loading, a barrier) "
                        "and cannot happen during CUDA graph capture; make it (or call it once) before capturing")
        self._op = make(self._world)
        _runtime._register(self)

    def close(self):
        """Collective: frees the op's symmetric buffers (every rank, in the same order)."""
        if self._op is not None:
            if _runtime._forked_from is not None:  # the parent's op: closing it here would free the parent's buffers
                raise _runtime._forked_error(f"{self._kind}.close")
            self._op.close()  # may refuse (an EP buffer with open handles): then it stays open here too
            self._op = None
            _runtime._unregister(self)

    @property
    def closed(self):
        return self._op is None

    def _get(self):
        if self._op is None:
            raise Error(f"{self._kind} is closed")
        if _runtime._forked_from is not None:
            raise _runtime._forked_error(self._kind)
        return self._op

    def _out_rows(self, a):
        """Rows of the output of a call whose first operand is `a` (the op's own rule)."""
        raise NotImplementedError

    # Whether the op's calls are collective calls of its team (GemmAr's all-reduce on the collectives' workspace):
    # then a call its wrapper refuses still counts in the team's sequence, as the C++ op's refusals do.
    _counts_calls = False

    def run(self, a, b, out=None):
        """One call on torch's current stream; out is allocated when None. Returns out."""
        op = self._get()
        try:
            av, bv, cv, out, padded = self._checked_args(a, b, out)
        except (TypeError, ValueError):
            if self._counts_calls:
                _refused(self._ctx, self._team)
            raise
        op.run(av, bv, cv, self._ctx.stream(self._ctx.device_index))
        return written(out) if padded is None else out.contiguous()

    def _checked_args(self, a, b, out):
        """run's arguments as the op takes them (the views of a, b and out; out; its padded allocation or None), or
        TypeError / ValueError naming the argument."""
        ctx = self._ctx
        dtypes = (self.dtype,)
        av = matrix_view(a, self._a_name, ctx, dtypes)
        bv = matrix_view(b, "b", ctx, dtypes)
        if tuple(b.shape) != (self.n, self.k):
            raise ValueError(f"b: expected shape ({self.n}, {self.k}) (the op's [n, k]), got {tuple(b.shape)}")
        if a.shape[1] != self.k:
            raise ValueError(f"{self._a_name}: expected {self.k} columns (the op's k), got shape {tuple(a.shape)}")
        rows = self._out_rows(a)
        m = a.shape[0] * (self.num_ranks if self._a_name == "a_local" else 1)
        if m > self.max_m:
            raise ValueError(f"{self._a_name}: the call's M = {m} exceeds the op's max_m = {self.max_m}, got shape "
                             f"{tuple(a.shape)}")
        padded = None
        if out is None:
            out, padded = _empty_out(rows, self.n, self.dtype, a.device)
        cv = matrix_view(out, "out", ctx, dtypes)
        _out_shape_check(out, (rows, self.n))
        return av, bv, cv, out, padded

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AgGemm(_FusedOp):
    """AllGather+GEMM (column-parallel linear layer): out[M, n] = AllGather(a_local) @ b.T, with a_local [M/W, k]
    on each rank and b [n, k] this rank's weight shard. Collective to make and to close; run() on torch's current
    stream. max_m: largest M (a multiple of num_ranks); dtype: torch.bfloat16 or torch.float16."""
    _kind = "AgGemm"
    _a_name = "a_local"

    def __init__(self, max_m, n, k, dtype=None, *, chunk_rows=0, copy_streams=0, sm_budget=0, autotune=False,
                 team=None):
        self.dtype = _fused_dtype(dtype)
        code = dtype_code(self.dtype)
        super().__init__(lambda w: _weft.AgGemm(w, max_m, n, k, code, chunk_rows=chunk_rows,
                                                copy_streams=copy_streams, sm_budget=sm_budget, autotune=autotune,
                                                team=self._team), team)
        self.max_m, self.n, self.k = max_m, n, k

    def _out_rows(self, a_local):
        return a_local.shape[0] * self.num_ranks

    def gathered(self, m):
        """[m, k] tensor over the gathered A (symmetric heap, zero copy), as the last run with M = m left it; valid
        until the next run (stream-ordered)."""
        return heap_tensor(self._get().gathered(m), self._world, self.dtype)


class GemmRs(_FusedOp):
    """GEMM+ReduceScatter (row-parallel linear layer): out[M/W, n] = rows [r*M/W, (r+1)*M/W) of the sum over ranks
    of a @ b.T, with a [M, k] and b [n, k] this rank's shards. mode: "auto", "pull" or "push"."""
    _kind = "GemmRs"

    def __init__(self, max_m, n, k, dtype=None, *, mode="auto", partial_dtype=None, chunk_rows=0, reduce_ctas=0,
                 sm_budget=0, autotune=False, team=None):
        self.dtype = _fused_dtype(dtype)
        code = dtype_code(self.dtype)
        partial = dtype_code(partial_dtype, "partial_dtype") if partial_dtype is not None else None
        super().__init__(lambda w: _weft.GemmRs(w, max_m, n, k, code, mode=mode, partial_dtype=partial,
                                                chunk_rows=chunk_rows, reduce_ctas=reduce_ctas, sm_budget=sm_budget,
                                                autotune=autotune, team=self._team), team)
        self.max_m, self.n, self.k = max_m, n, k

    @property
    def mode(self):
        return self._get().mode

    def _out_rows(self, a):
        if a.shape[0] % self.num_ranks != 0:
            raise ValueError(f"a: expected M a multiple of the {self.num_ranks} ranks, got shape {tuple(a.shape)}")
        return a.shape[0] // self.num_ranks


class GemmAr(_FusedOp):
    """GEMM+AllReduce for small M (decode): out[M, n] = the sum over ranks of a @ b.T, on every rank."""
    _kind = "GemmAr"

    def __init__(self, max_m, n, k, dtype=None, *, partial_dtype=None, reduce_ctas=0, sm_budget=0,
                 collective_all_reduce=True, team=None):
        self.dtype = _fused_dtype(dtype)
        code = dtype_code(self.dtype)
        partial = dtype_code(partial_dtype, "partial_dtype") if partial_dtype is not None else None
        super().__init__(lambda w: _weft.GemmAr(w, max_m, n, k, code, partial_dtype=partial, reduce_ctas=reduce_ctas,
                                                sm_budget=sm_budget, collective_all_reduce=collective_all_reduce,
                                                team=self._team), team)
        self.max_m, self.n, self.k = max_m, n, k
        # As the C++ op decides (gemm_ar.cpp): the collective all-reduce takes partials of the op's dtype, n % 8 == 0.
        partials_of_dtype = partial_dtype is None or partial_dtype == self.dtype
        self._counts_calls = bool(collective_all_reduce) and partials_of_dtype and n % 8 == 0 and self.num_ranks > 1

    def _out_rows(self, a):
        return a.shape[0]


def _round_max_m(m, num_ranks):
    """The max_m a cached op is made with for a call with M = m: the next power of two, a multiple of num_ranks."""
    p = 1
    while p < m:
        p *= 2
    return -(-p // num_ranks) * num_ranks


def _cached(cls, m, n, k, dtype, team, **options):
    """The cached op of `cls` for (n, k, dtype, team, options) with max_m >= m, made anew (collectively, like every
    call) when m grows; the outgrown one is kept open until weft.finalize, for the CUDA graphs captured with it. Every
    rank makes the same calls with the same shapes, so every rank makes the same ops at the same call. `options`: the
    keyword arguments of `cls` the call passed (not None), part of the key."""
    options = {name: value for name, value in options.items() if value is not None}
    state = _runtime._get_state()
    key = (cls._kind, n, k, dtype, None if team is None else team.id, tuple(sorted(options.items(), key=str)))
    op = state.op_cache.get(key)
    if op is not None and op.max_m >= m and not op.closed:
        return op
    torch = torch_module()
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise Error(f"{cls._kind}: M = {m} needs a larger op than the cached one (max_m "
                    f"{op.max_m if op is not None else 0}), and making one cannot happen during CUDA graph capture: "
                    "call it once with the largest M before capturing")
    # The outgrown op stays open (until weft.finalize): a CUDA graph captured with it still replays on its buffers.
    size = team.num_ranks if team is not None else state.world.num_ranks
    op = cls(_round_max_m(m, size), n, k, dtype, team=team, **options)
    state.op_cache[key] = op
    return op


def _shape_check(a, name, dims=2):
    torch = torch_module()
    if not isinstance(a, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(a).__name__}")
    if a.dim() != dims:
        raise ValueError(f"{name}: expected a {dims}-D tensor, got shape {tuple(a.shape)}")


def _fused_args_check(op, a, a_name, b, rows_multiple=1):
    """What a cached fused op's call checks before the op is looked up or made (collectively, on the heap): both
    operands 2-D tensors on this rank's GPU, of a dtype the fused GEMMs take (bf16, f16), the same dtype and K, and
    a's rows a multiple of `rows_multiple` (GEMM+RS: the team's size)."""
    _shape_check(a, a_name)
    _shape_check(b, "b")
    ctx, _ = _context(None, op)
    check_tensor(a, a_name, ctx, ctx.gemm_in)
    check_tensor(b, "b", ctx, ctx.gemm_in)
    if b.dtype != a.dtype:
        raise TypeError(f"{op}: b must have {a_name}'s dtype {a.dtype}, got {b.dtype}")
    if b.shape[1] != a.shape[1]:
        raise ValueError(f"{op}: b must be [N, K] with {a_name}'s K = {a.shape[1]}, got shape {tuple(b.shape)}")
    if a.shape[0] % rows_multiple != 0:
        raise ValueError(f"{op}: {a_name}'s rows (M = {a.shape[0]}) must be a multiple of the {rows_multiple} ranks")


def ag_gemm(a_local, b, out=None, *, team=None):
    """AllGather(a_local) @ b.T through a cached AgGemm (made on the first call with these n, k, dtype and team;
    made anew when M grows). Collective over the team (default: the World); on torch's current stream."""
    _runtime._team_for(team, "ag_gemm")
    _fused_args_check("ag_gemm", a_local, "a_local", b)
    size = team.num_ranks if team is not None else _runtime.num_ranks()
    return _cached(AgGemm, a_local.shape[0] * size, b.shape[0], b.shape[1], a_local.dtype, team).run(a_local, b, out)


def gemm_rs(a, b, out=None, *, team=None, partial_dtype=None):
    """ReduceScatter(a @ b.T) through a cached GemmRs. Collective over the team; on torch's current stream.
    partial_dtype: the partials' dtype (GemmRs): a's (default; each rank's partial is rounded once, so where the ranks'
    partials cancel an element's error is u * sum |P_r|, not u * |C|) or torch.float32 (exact partials, pull mode)."""
    _runtime._team_for(team, "gemm_rs")
    _fused_args_check("gemm_rs", a, "a", b, team.num_ranks if team is not None else _runtime.num_ranks())
    return _cached(GemmRs, a.shape[0], b.shape[0], b.shape[1], a.dtype, team, partial_dtype=partial_dtype).run(a, b, out)


def gemm_ar(a, b, out=None, *, team=None, partial_dtype=None):
    """AllReduce(a @ b.T) through a cached GemmAr. Collective over the team; on torch's current stream.
    partial_dtype: as gemm_rs's (torch.float32 takes the op's own all-reduce kernel)."""
    _runtime._team_for(team, "gemm_ar")
    try:
        _fused_args_check("gemm_ar", a, "a", b)
    except (TypeError, ValueError):
        # The cached op's all-reduce is a collective call of the team where the C++ op takes that path (GemmAr's
        # _counts_calls): partials of a's dtype and n % 8 == 0, as far as these arguments tell.
        n = b.shape[0] if hasattr(b, "shape") and len(b.shape) >= 1 else 0
        if (partial_dtype is None or partial_dtype == getattr(a, "dtype", None)) and n % 8 == 0:
            count_refused_call(team, "gemm_ar")
        raise
    return _cached(GemmAr, a.shape[0], b.shape[0], b.shape[1], a.dtype, team, partial_dtype=partial_dtype).run(a, b, out)
