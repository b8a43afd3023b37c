# SPDX-License-Identifier: MIT
"""weft's ops as PyTorch custom operators (torch.ops.weft.*), with fake (meta) implementations and autograd.

They trace into torch.compile(fullgraph=True) graphs and replay in CUDA graphs. Every op is functional (returns a
new tensor, allocated by PyTorch: under a CUDA graph, from the graph's pool). Each runs on the World weft.init()
made; the fake implementations read its number of ranks, so call weft.init() before tracing. The fused ops'
objects (AgGemm, GemmRs, GemmAr) are made, collectively, by the first call with a new (n, k, dtype) or a larger M:
call every op once eagerly before capturing a CUDA graph (making one during capture is an error).

Autograd (sums are over ranks; W = number of ranks):
    all_reduce      grad_in = all_reduce(grad_out)
    all_gather      grad_in = reduce_scatter(grad_out)
    reduce_scatter  grad_in = all_gather(grad_out)
    ag_gemm(a, b)   grad_a = gemm_rs(grad_out, b.T), grad_b = grad_out.T @ all_gather(a)
    gemm_rs(a, b)   grad_a = ag_gemm(grad_out, b.T), grad_b = all_gather(grad_out).T @ a
    gemm(a, b)      grad_a = grad_out @ b, grad_b = grad_out.T @ a
so a column-parallel AG+GEMM's backward is GEMM+RS and a row-parallel GEMM+RS's backward is AG+GEMM.
"""
import torch

from . import _ops, _runtime

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "gemm", "ag_gemm", "gemm_rs", "gemm_ar"]


def _contiguous(x):
    return x if x.is_contiguous() else x.contiguous()


# ---- collectives ----

@torch.library.custom_op("weft::all_reduce", mutates_args=(), device_types="cuda")
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The element-wise sum of every rank's x (a new tensor)."""
    x = _contiguous(x)
    out = torch.empty_like(x)
    _ops.all_reduce(x, out)
    return out


@all_reduce.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("weft::all_gather", mutates_args=(), device_types="cuda")
def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x concatenated along dim 0, in rank order."""
    return _ops.all_gather(_contiguous(x))


@all_gather.register_fake
def _(x):
    n = _runtime.num_ranks()
    return x.new_empty((n * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("weft::reduce_scatter", mutates_args=(), device_types="cuda")
def reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    """Slice `rank` (dim 0) of the element-wise sum of every rank's x."""
    return _ops.reduce_scatter(_contiguous(x))


@reduce_scatter.register_fake
def _(x):
    n = _runtime.num_ranks()
    torch._check(x.shape[0] % n == 0, lambda: f"x: dim 0 must be a multiple of the {n} ranks")
    return x.new_empty((x.shape[0] // n, *x.shape[1:]))


def _all_reduce_backward(ctx, grad):
    return all_reduce(grad)


def _all_gather_backward(ctx, grad):
    return reduce_scatter(_contiguous(grad))


def _reduce_scatter_backward(ctx, grad):
    return all_gather(_contiguous(grad))


all_reduce.register_autograd(_all_reduce_backward)
all_gather.register_autograd(_all_gather_backward)
reduce_scatter.register_autograd(_reduce_scatter_backward)


# ---- GEMMs ----

@torch.library.custom_op("weft::gemm", mutates_args=(), device_types="cuda")
def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b.T with b [N, K] (a linear layer's weight), on this GPU."""
    return _ops.gemm(a, b)


@gemm.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], b.shape[0]))


@torch.library.custom_op("weft::ag_gemm", mutates_args=(), device_types="cuda")
def ag_gemm(a_local: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """AllGather(a_local) @ b.T: a_local [M/W, k], b [n, k] -> [M, n]."""
    return _ops.ag_gemm(_contiguous(a_local), _contiguous(b))


@ag_gemm.register_fake
def _(a_local, b):
    return a_local.new_empty((_runtime.num_ranks() * a_local.shape[0], b.shape[0]))


@torch.library.custom_op("weft::gemm_rs", mutates_args=(), device_types="cuda")
def gemm_rs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """ReduceScatter(a @ b.T): a [M, k], b [n, k] -> [M/W, n]."""
    return _ops.gemm_rs(_contiguous(a), _contiguous(b))


@gemm_rs.register_fake
def _(a, b):
    n = _runtime.num_ranks()
    torch._check(a.shape[0] % n == 0, lambda: f"a: M must be a multiple of the {n} ranks")
    return a.new_empty((a.shape[0] // n, b.shape[0]))


@torch.library.custom_op("weft::gemm_ar", mutates_args=(), device_types="cuda")
def gemm_ar(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """AllReduce(a @ b.T): a [M, k], b [n, k] -> [M, n] on every rank."""
    return _ops.gemm_ar(_contiguous(a), _contiguous(b))


@gemm_ar.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], b.shape[0]))


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gemm_backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad_a = grad @ b if ctx.needs_input_grad[0] else None
    grad_b = grad.t() @ a if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


def _ag_gemm_backward(ctx, grad):
    a_local, b = ctx.saved_tensors
    grad = _contiguous(grad)
    grad_a = gemm_rs(grad, b.t().contiguous()) if ctx.needs_input_grad[0] else None
    grad_b = grad.t() @ all_gather(a_local) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


def _gemm_rs_backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad = _contiguous(grad)
    grad_a = ag_gemm(grad, b.t().contiguous()) if ctx.needs_input_grad[0] else None
    grad_b = all_gather(grad).t() @ a if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


def _gemm_ar_backward(ctx, grad):
    # out = sum_r a_r @ b_r.T, the same on every rank: each rank's inputs get the (replicated) output gradient.
    a, b = ctx.saved_tensors
    grad_a = grad @ b if ctx.needs_input_grad[0] else None
    grad_b = grad.t() @ a if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


gemm.register_autograd(_gemm_backward, setup_context=_save_inputs)
ag_gemm.register_autograd(_ag_gemm_backward, setup_context=_save_inputs)
gemm_rs.register_autograd(_gemm_rs_backward, setup_context=_save_inputs)
gemm_ar.register_autograd(_gemm_ar_backward, setup_context=_save_inputs)
