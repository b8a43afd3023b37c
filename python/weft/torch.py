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

Teams: ag_gemm(a, b, team=...), gemm_rs and gemm_ar (the Python functions of this module) run on a weft.Team; the
custom ops take the team's handle (an int, -1 for the World). On a team, ag_gemm runs weft::ag_gemm_saving, which also
returns a copy of the gathered input for the weight gradient (memory instead of a second all-gather), and gemm_rs's
backward takes the gathered output gradient from the same op. The collectives take a team handle too
(all_reduce(x, team.handle)).
"""
import torch

from . import _ops, _runtime

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "gemm", "ag_gemm", "gemm_rs", "gemm_ar"]
# ag_gemm, gemm_rs and gemm_ar below are Python functions over the custom ops torch.ops.weft.ag_gemm,
# ag_gemm_saving, gemm_rs and gemm_ar (which take a team handle).

# The ops are defined on a torch.library.Library with a CUDA kernel, a fake implementation and an autograd formula
# each: the CUDA kernel is the Python function itself, called by the dispatcher with nothing around it (a
# torch.library.custom_op wraps its kernels in checks that cost about a microsecond a call).
_lib = torch.library.Library("weft", "FRAGMENT")
_TAGS = (torch.Tag.pt2_compliant_tag,)


def _define(schema, impl, fake):
    """torch.ops.weft.<name> with `impl` as its CUDA kernel and `fake` as its fake (meta) implementation."""
    name = schema[:schema.index("(")]
    _lib.define(schema, tags=_TAGS)
    _lib.impl(name, impl, "CUDA")
    torch.library.register_fake(f"weft::{name}", fake, lib=_lib)
    return getattr(torch.ops.weft, name).default


def _contiguous(x):
    return x if x.is_contiguous() else x.contiguous()


# ---- collectives ----

def _all_reduce(x, team=-1):
    x = _contiguous(x)
    out = torch.empty_like(x)
    _ops.all_reduce(x, out, team=_runtime.team_by_handle(team))
    return out


def _all_reduce_fake(x, team=-1):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_gather(x, team=-1):
    return _ops.all_gather(_contiguous(x), team=_runtime.team_by_handle(team))


def _all_gather_fake(x, team=-1):
    n = _runtime.team_size(team)
    return x.new_empty((n * x.shape[0], *x.shape[1:]))


def _reduce_scatter(x, team=-1):
    return _ops.reduce_scatter(_contiguous(x), team=_runtime.team_by_handle(team))


def _reduce_scatter_fake(x, team=-1):
    n = _runtime.team_size(team)
    torch._check(x.shape[0] % n == 0, lambda: f"x: dim 0 must be a multiple of the {n} ranks")
    return x.new_empty((x.shape[0] // n, *x.shape[1:]))


_all_reduce_op = _define("all_reduce(Tensor x, SymInt team=-1) -> Tensor", _all_reduce, _all_reduce_fake)
_all_gather_op = _define("all_gather(Tensor x, SymInt team=-1) -> Tensor", _all_gather, _all_gather_fake)
_reduce_scatter_op = _define("reduce_scatter(Tensor x, SymInt team=-1) -> Tensor", _reduce_scatter,
                             _reduce_scatter_fake)


def all_reduce(x, team=-1):
    """The element-wise sum of every rank's x (a new tensor), over the team with handle `team` (-1: the World)."""
    return _all_reduce_op(x, team)


def all_gather(x, team=-1):
    """Every rank's x concatenated along dim 0, in rank order."""
    return _all_gather_op(x, team)


def reduce_scatter(x, team=-1):
    """Slice `rank` (dim 0) of the element-wise sum of every rank's x."""
    return _reduce_scatter_op(x, team)


def _save_team(ctx, inputs, output):
    ctx.team = inputs[1]


def _all_reduce_backward(ctx, grad):
    return all_reduce(grad, ctx.team), None


def _all_gather_backward(ctx, grad):
    return reduce_scatter(_contiguous(grad), ctx.team), None


def _reduce_scatter_backward(ctx, grad):
    return all_gather(_contiguous(grad), ctx.team), None


# ---- GEMMs ----

def _gemm(a, b):
    return _ops.gemm(a, b)


def _gemm_fake(a, b):
    return a.new_empty((a.shape[0], b.shape[0]))


def _ag_gemm(a_local, b):
    return _ops.ag_gemm(_contiguous(a_local), _contiguous(b))


def _ag_gemm_fake(a_local, b):
    return a_local.new_empty((_runtime.num_ranks() * a_local.shape[0], b.shape[0]))


def _ag_gemm_saving(a_local, b, team):
    t = _runtime.team_by_handle(team)
    a_local, b = _contiguous(a_local), _contiguous(b)
    m = a_local.shape[0] * _runtime.team_size(team)
    op = _ops._cached(_ops.AgGemm, m, b.shape[0], b.shape[1], a_local.dtype, t)
    out = op.run(a_local, b)
    return out, op.gathered(m).clone()


def _ag_gemm_saving_fake(a_local, b, team):
    m = _runtime.team_size(team) * a_local.shape[0]
    return a_local.new_empty((m, b.shape[0])), a_local.new_empty((m, a_local.shape[1]))


def _gemm_rs(a, b, team=-1):
    return _ops.gemm_rs(_contiguous(a), _contiguous(b), team=_runtime.team_by_handle(team))


def _gemm_rs_fake(a, b, team=-1):
    n = _runtime.team_size(team)
    torch._check(a.shape[0] % n == 0, lambda: f"a: M must be a multiple of the {n} ranks")
    return a.new_empty((a.shape[0] // n, b.shape[0]))


def _gemm_ar(a, b, team=-1):
    return _ops.gemm_ar(_contiguous(a), _contiguous(b), team=_runtime.team_by_handle(team))


def _gemm_ar_fake(a, b, team=-1):
    return a.new_empty((a.shape[0], b.shape[0]))


_gemm_op = _define("gemm(Tensor a, Tensor b) -> Tensor", _gemm, _gemm_fake)
# a_local [M/W, k], b [n, k] -> AllGather(a_local) @ b.T [M, n], over the World.
_define("ag_gemm(Tensor a_local, Tensor b) -> Tensor", _ag_gemm, _ag_gemm_fake)
# (AllGather(a_local) @ b.T, a copy of AllGather(a_local)) over the team with handle `team` (-1: the World). The copy
# is what the backward pass needs for the weight gradient (kept instead of gathered again).
_define("ag_gemm_saving(Tensor a_local, Tensor b, SymInt team) -> (Tensor, Tensor)", _ag_gemm_saving,
        _ag_gemm_saving_fake)
# ReduceScatter(a @ b.T) over a team: a [M, k], b [n, k] -> [M/W, n].
_define("gemm_rs(Tensor a, Tensor b, SymInt team=-1) -> Tensor", _gemm_rs, _gemm_rs_fake)
# AllReduce(a @ b.T) over a team: a [M, k], b [n, k] -> [M, n].
_define("gemm_ar(Tensor a, Tensor b, SymInt team=-1) -> Tensor", _gemm_ar, _gemm_ar_fake)


def gemm(a, b):
    """a @ b.T with b [N, K] (a linear layer's weight), on this GPU."""
    return _gemm_op(a, b)


def _handle(team):
    if team is None:
        return -1
    if not isinstance(team, _runtime.Team):
        raise TypeError(f"team: expected a weft.Team or None, got {type(team).__name__}")
    return team.handle


def ag_gemm(a_local, b, team=None):
    """AllGather(a_local) @ b.T over `team` (a weft.Team; None: the World), differentiable. On a team it saves the
    gathered input for the backward pass (memory of M x k); on the World the backward all-gathers it again."""
    if team is None:
        return torch.ops.weft.ag_gemm(a_local, b)
    return torch.ops.weft.ag_gemm_saving(a_local, b, _handle(team))[0]


def gemm_rs(a, b, team=None):
    """ReduceScatter(a @ b.T) over `team` (None: the World), differentiable."""
    return torch.ops.weft.gemm_rs(a, b, _handle(team))


def gemm_ar(a, b, team=None):
    """AllReduce(a @ b.T) over `team` (None: the World), differentiable."""
    return torch.ops.weft.gemm_ar(a, b, _handle(team))


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
    grad_a = torch.ops.weft.gemm_rs(grad, b.t().contiguous()) if ctx.needs_input_grad[0] else None
    grad_b = grad.t() @ all_gather(a_local) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


def _save_saving(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], output[1])
    ctx.team = inputs[2]


def _ag_gemm_saving_backward(ctx, grad, grad_gathered):
    # The gathered copy is an internal output: gradients through it are not propagated (nothing differentiates it).
    b, a_full = ctx.saved_tensors
    grad = _contiguous(grad)
    grad_a = torch.ops.weft.gemm_rs(grad, b.t().contiguous(), ctx.team) if ctx.needs_input_grad[0] else None
    grad_b = grad.t() @ a_full if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


def _save_with_team(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.team = inputs[2]


def _gemm_rs_backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad = _contiguous(grad)
    if ctx.team < 0:
        grad_a = torch.ops.weft.ag_gemm(grad, b.t().contiguous()) if ctx.needs_input_grad[0] else None
        grad_b = all_gather(grad).t() @ a if ctx.needs_input_grad[1] else None
    else:
        grad_a, grad_full = torch.ops.weft.ag_gemm_saving(grad, b.t().contiguous(), ctx.team)
        grad_a = grad_a if ctx.needs_input_grad[0] else None
        grad_b = grad_full.t() @ a if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


def _gemm_ar_backward(ctx, grad):
    # out = sum_r a_r @ b_r.T, the same on every rank: each rank's inputs get the (replicated) output gradient.
    a, b = ctx.saved_tensors
    grad_a = grad @ b if ctx.needs_input_grad[0] else None
    grad_b = grad.t() @ a if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


def _register_autograd(name, backward, setup_context):
    torch.library.register_autograd(f"weft::{name}", backward, setup_context=setup_context, lib=_lib)


_register_autograd("all_reduce", _all_reduce_backward, _save_team)
_register_autograd("all_gather", _all_gather_backward, _save_team)
_register_autograd("reduce_scatter", _reduce_scatter_backward, _save_team)
_register_autograd("gemm", _gemm_backward, _save_inputs)
_register_autograd("ag_gemm", _ag_gemm_backward, _save_inputs)
_register_autograd("ag_gemm_saving", _ag_gemm_saving_backward, _save_saving)
_register_autograd("gemm_rs", _gemm_rs_backward, _save_with_team)
_register_autograd("gemm_ar", _gemm_ar_backward, _save_with_team)
