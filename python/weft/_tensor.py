# SPDX-License-Identifier: MIT
"""torch tensors <-> weft TensorViews, and tensors on the symmetric heap (weft.empty / weft.free)."""
import math
import operator

from . import _runtime, _weft
from ._weft import Error, TensorView

_torch = None
_Tensor = None  # torch.Tensor
_codes = None  # torch dtype -> weft dtype code
_raw_stream = None  # device index -> torch's current CUDA stream on it, as an integer (cudaStream_t)
_increment_version = None  # torch.autograd.graph.increment_version (or its older private name), or a no-op
_U8 = _weft.DTYPES["u8"]


def torch_module():
    """torch, imported on first use (importing weft does not need it)."""
    global _torch, _Tensor, _codes, _raw_stream
    if _torch is None:
        try:
            import torch
        except ImportError as e:
            raise ImportError("this weft function takes torch tensors: install PyTorch") from e
        d = _weft.DTYPES
        _codes = {torch.bfloat16: d["bf16"], torch.float16: d["f16"], torch.float32: d["f32"],
                  torch.int32: d["i32"], torch.int64: d["i64"], torch.uint8: d["u8"]}
        if hasattr(torch, "float8_e4m3fn"):
            _codes[torch.float8_e4m3fn] = d["f8e4m3"]
        # The same stream as torch.cuda.current_stream(device).cuda_stream without making a Stream object (a few
        # µs per call).
        _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda device: torch.cuda.current_stream(device).cuda_stream)
        global _increment_version
        graph = getattr(torch.autograd, "graph", None)
        _increment_version = (getattr(graph, "increment_version", None)
                              or getattr(torch._C, "_increment_version", None) or (lambda tensor: None))
        _Tensor = torch.Tensor
        _torch = torch
    return _torch


def written(tensor):
    """Tells autograd that `tensor`, which the caller passed, was written in place (its version counter, as torch's own
    in-place ops do): a tensor saved for backward and overwritten by a weft op then fails in backward ("modified by an
    inplace operation") instead of giving wrong gradients. Returns the tensor."""
    torch_module()
    if not tensor.is_inference():  # an inference tensor has no version counter (autograd never saw it)
        _increment_version(tensor)
    return tensor


class CallContext:
    """What an op call reads of its World and of torch, looked up once per World (weft.init makes a new one): the
    World, its device (as torch.device, compared with a tensor's in one step), torch's current-stream lookup, the
    dtype tables and the algorithm codes parsed so far."""
    __slots__ = ("world", "num_ranks", "device", "device_index", "stream", "all_dtypes", "reducible", "gemm_in",
                 "algo_codes")

    def __init__(self, world):
        torch = torch_module()
        self.world = world
        self.num_ranks = world.num_ranks
        self.device_index = world.device
        self.device = torch.device("cuda", self.device_index)
        self.stream = _raw_stream
        self.all_dtypes = _codes
        self.reducible = {t: _codes[t] for t in (torch.bfloat16, torch.float16, torch.float32)}
        self.gemm_in = {t: _codes[t] for t in (torch.bfloat16, torch.float16)}
        self.algo_codes = {"all_reduce": {}, "all_gather": {}, "reduce_scatter": {}}


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def dtype_code(dtype, name="dtype"):
    torch_module()  # fills the dtype table
    code = _codes.get(dtype)
    if code is None:
        supported = ", ".join(_dtype_name(t) for t in _codes)
        raise TypeError(f"{name}: weft does not take {dtype} (it takes {supported})")
    return code


def _not_a_tensor(t, name):
    return TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def _wrong_device(t, name, ctx):
    return ValueError(f"{name}: expected a tensor on cuda:{ctx.device_index} (this rank's GPU), got one on {t.device}")


def _wrong_dtype(t, name, dtypes):
    return TypeError(f"{name}: expected dtype {' or '.join(_dtype_name(d) for d in dtypes)}, got "
                     f"{_dtype_name(t.dtype)}")


def _not_contiguous(t, name):
    return ValueError(f"{name}: expected a contiguous tensor (shape {tuple(t.shape)}, strides {t.stride()}); "
                      "call .contiguous()")


def check_tensor(t, name, ctx, dtypes=None):
    """Raises TypeError (not a tensor, wrong dtype) or ValueError (not on this rank's GPU) naming the argument.
    ctx: the World's CallContext; dtypes: the torch dtypes taken (None: any)."""
    if not isinstance(t, _Tensor):
        raise _not_a_tensor(t, name)
    if t.device != ctx.device:
        raise _wrong_device(t, name, ctx)
    if dtypes is not None and t.dtype not in dtypes:
        raise _wrong_dtype(t, name, dtypes)


def flat_arg(t, name, ctx, codes):
    """(data pointer, element count, weft dtype code) of a contiguous tensor (any number of dimensions, 0 included)
    on this rank's GPU whose dtype is a key of `codes` (torch dtype -> weft code). Raises TypeError or ValueError
    naming the argument, in check_tensor's order, then contiguity."""
    if not isinstance(t, _Tensor):
        raise _not_a_tensor(t, name)
    if t.device != ctx.device:
        raise _wrong_device(t, name, ctx)
    code = codes.get(t.dtype)
    if code is None:
        raise _wrong_dtype(t, name, codes)
    if not t.is_contiguous():
        raise _not_contiguous(t, name)
    values_are_bytes(t, name)  # the kernels read its bytes: a lazily negated view would be summed unnegated
    return t.data_ptr(), t.numel(), code


def bytes_arg(t, name, ctx):
    """(data pointer, element count, weft dtype code) of an argument of an op that moves bytes (all_gather): a
    contiguous tensor on this rank's GPU of any dtype. A dtype weft has a code for passes as itself; any other (bool,
    int8, int16, float64, complex, the other float8s, ...) as its bytes: code u8, numel * element_size elements.
    Refused, naming the argument: a quantized tensor (its scale and zero point are not in its bytes) and a conjugate
    or negative view (its bytes are not its values). Checked in flat_arg's order."""
    if not isinstance(t, _Tensor):
        raise _not_a_tensor(t, name)
    if t.device != ctx.device:
        raise _wrong_device(t, name, ctx)
    if t.is_quantized:
        raise TypeError(f"{name}: weft moves a tensor's bytes, and a quantized tensor ({_dtype_name(t.dtype)}) keeps "
                        "its scale and zero point outside them: pass t.int_repr() (and its scale and zero point "
                        "apart)")
    if not t.is_contiguous():
        raise _not_contiguous(t, name)
    values_are_bytes(t, name)
    code = ctx.all_dtypes.get(t.dtype)
    if code is not None:
        return t.data_ptr(), t.numel(), code
    return t.data_ptr(), t.numel() * t.element_size(), _U8


def values_are_bytes(t, name):
    """Raises ValueError for a conjugate or negative view (torch applies its conjugation or negation lazily, on read:
    its bytes are not its values)."""
    if t.is_conj():
        raise ValueError(f"{name}: expected a tensor whose bytes are its values, got a conjugate view (is_conj()); "
                         "call .resolve_conj()")
    if t.is_neg():
        raise ValueError(f"{name}: expected a tensor whose bytes are its values, got a negative view (is_neg()); "
                         "call .resolve_neg()")


def out_arg(out, name, ctx, like_dtype, numel):
    """The data pointer of an output argument: checked as flat_arg does, plus its dtype (like_dtype) and element
    count. Its shape is free: the collectives write their result's elements in order (flat)."""
    if not isinstance(out, _Tensor):
        raise _not_a_tensor(out, name)
    if out.device != ctx.device:
        raise _wrong_device(out, name, ctx)
    if out.dtype != like_dtype:
        raise TypeError(f"{name}: expected dtype {like_dtype}, got {out.dtype}")
    if out.numel() != numel:
        raise ValueError(f"{name}: expected {numel} elements, got {out.numel()} (shape {tuple(out.shape)})")
    if not out.is_contiguous():
        raise _not_contiguous(out, name)
    values_are_bytes(out, name)
    return out.data_ptr()


def matrix_view(t, name, ctx, dtypes=None):
    """A 2-D view with unit inner stride and any row stride (what weft's GEMMs take)."""
    check_tensor(t, name, ctx, dtypes)
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor, got shape {tuple(t.shape)}")
    rows, cols = t.shape
    row_stride, inner_stride = t.stride()
    if inner_stride != 1 and cols > 1:
        raise ValueError(f"{name}: expected rows stored contiguously (inner stride 1), got strides {t.stride()}; "
                         "call .contiguous()")
    code = _codes.get(t.dtype)
    if code is None:
        dtype_code(t.dtype, name)  # raises
    values_are_bytes(t, name)  # the GEMMs read (and write) its bytes
    return TensorView(t.data_ptr(), code, (rows, cols), (row_stride, 1))


def heap_tensor(view, world, torch_dtype):
    """A torch tensor over weft-owned device memory described by `view` (zero copy, through a DLPack capsule)."""
    torch = torch_module()
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if torch_dtype == fp8:
        u8 = TensorView(view.ptr, _weft.DTYPES["u8"], view.shape, view.strides)
        return torch.utils.dlpack.from_dlpack(_weft.dlpack(u8, world.device)).view(torch_dtype)
    return torch.utils.dlpack.from_dlpack(_weft.dlpack(view, world.device))


def empty(shape, dtype=None, *, team=None):
    """A tensor on the symmetric heap (uninitialised; every rank's is at the same offset, so peers' kernels reach it).

    Collective over the World's ranks, or over `team`'s members (weft.Team): each calls it with the same shape and
    dtype, in the same order as its other collectives.
    The memory is freed by weft.free(tensor) (collective) or by weft.finalize(), never by the garbage collector:
    ranks drop their last reference at different moments, and a collective free run from a finalizer would meet
    the other ranks in an order nobody chose (a mismatch error, or a wait until the timeout). After weft.free the
    tensor (and every view of it) must not be used. dtype default: torch.bfloat16.
    """
    torch = torch_module()
    world, cpp_team = _runtime._team_for(team, "empty")
    if dtype is None:
        dtype = torch.bfloat16
    code = dtype_code(dtype)
    if isinstance(shape, int):
        shape = (shape,)
    try:
        shape = tuple(operator.index(s) for s in shape)  # as torch.empty: 2.5 is refused, not truncated to 2
    except TypeError:
        raise TypeError(f"shape: expected a sequence of integer sizes, got {shape!r}") from None
    if any(s < 0 for s in shape):
        raise ValueError(f"shape: expected non-negative sizes, got {shape}")
    numel = math.prod(shape)
    nbytes = numel * _weft.dtype_bytes(code)
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise Error("empty: symmetric allocation is collective and cannot happen during CUDA graph capture")
    owner = cpp_team if cpp_team is not None else world
    ptr = owner.alloc(max(nbytes, 1))
    _runtime._get_state().heap_blocks[ptr] = owner
    flat = heap_tensor(TensorView(ptr, code, (max(numel, 1),), (1,)), world, dtype)
    return flat[:numel].view(shape)


def free(tensor):
    """Collective over the ranks that allocated it: frees a tensor weft.empty returned (the same tensors, in the same
    order, on every one of them)."""
    torch = torch_module()
    state = _runtime._get_state()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor: expected a torch.Tensor, got {type(tensor).__name__}")
    ptr = tensor.data_ptr()
    if tensor.numel() == 0 and tensor.storage_offset() == 0:
        ptr = tensor.untyped_storage().data_ptr()  # an empty tensor reports a null data_ptr; its storage does not
    if ptr not in state.heap_blocks:
        raise ValueError("tensor: not a live tensor of weft.empty (pass the tensor it returned, not a view "
                         "that starts elsewhere; freed tensors cannot be freed again)")
    state.heap_blocks[ptr].free(ptr)  # the World or the team that allocated it
    del state.heap_blocks[ptr]


def is_symmetric(tensor):
    """True when the tensor's memory lies in this rank's symmetric heap."""
    torch = torch_module()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor: expected a torch.Tensor, got {type(tensor).__name__}")
    world = _runtime.world()
    nbytes = max(tensor.numel() * tensor.element_size(), 1)
    ptr = tensor.data_ptr()
    if tensor.numel() == 0:  # an empty tensor reports a null data_ptr; its storage does not (as in free)
        ptr = tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()
    return tensor.is_cuda and world.heap_contains(ptr, nbytes)
