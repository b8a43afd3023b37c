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
    all_to_all      grad_in = all_to_all(grad_out)   (all_to_all_v: the counts swapped; ulysses: the other direction)
    ag_gemm(a, b)   grad_a = gemm_rs(grad_out, b.T), grad_b = grad_out.T @ all_gather(a)
    gemm_rs(a, b)   grad_a = ag_gemm(grad_out, b.T), grad_b = all_gather(grad_out).T @ a
    gemm(a, b)      grad_a = grad_out @ b, grad_b = grad_out.T @ a
    gemm_ar(a, b)   grad_a = grad_out @ b, grad_b = grad_out.T @ a   (no reduction: Megatron's row-parallel linear)
so a column-parallel AG+GEMM's backward is GEMM+RS and a row-parallel GEMM+RS's backward is AG+GEMM. all_reduce treats
each rank's loss as its own (torch.distributed.nn's convention); gemm_ar treats the replicated output's loss as one
(each rank's grad_out is already the whole gradient): docs/python.md, "weft.torch".

Teams: all_gather(x, team=...), reduce_scatter, ag_gemm(a, b, team=...), gemm_rs and gemm_ar (the Python functions
of this module) run on a weft.Team (None: the World); the custom ops take the team's handle (an int, -1 for the World),
and all_reduce(x, team.handle) is the custom op itself. On a team, ag_gemm runs weft::ag_gemm_saving, which also
returns a copy of the gathered input for the weight gradient (memory instead of a second all-gather), and gemm_rs's
backward takes the gathered output gradient from the same op.

The ops whose output shape depends on the number of ranks (all_gather, reduce_scatter, ag_gemm, ag_gemm_saving,
gemm_rs) take it as an argument, as torch's own functional collectives take the group size: the fake implementations
read nothing but their arguments, and a compiled graph (and torch.compile's caches on disk, shared by every job on the
host) keys on the count. The Python functions pass it; a count that is not the team's is a ValueError.
"""
import torch

from . import _ops, _runtime

if not hasattr(torch.library, "custom_op"):
    raise ImportError(f"weft.torch needs PyTorch 2.4 or later (torch.library.custom_op); this is PyTorch "
                      f"{torch.__version__}. weft's other Python ops (weft.all_reduce, weft.AgGemm, ...) work with it.")

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_v", "ulysses_seq_to_head",
           "ulysses_head_to_seq", "gemm", "ag_gemm", "gemm_rs", "gemm_ar"]
# all_reduce and gemm are custom ops themselves; the others are Python functions over the custom ops
# torch.ops.weft.{all_gather, reduce_scatter, all_to_all, all_to_all_v, ulysses, ag_gemm, ag_gemm_saving, gemm_rs,
# gemm_ar}.


def _contiguous(x):
    return x if x.is_contiguous() else x.contiguous()


# ---- collectives ----

def _all_reduce(x, team=-1):
    x = _contiguous(x)
    out = torch.empty_like(x)
    _ops.all_reduce(x, out, team=_runtime.team_by_handle(team))
    return out


# No device_types on the ops: a tensor on another device reaches weft's own argument check (a ValueError naming the
# argument) instead of torch's "could not run ... with arguments from the CPU backend".
@torch.library.custom_op("weft::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, team: int = -1) -> torch.Tensor:
    """The element-wise sum of every rank's x (a new tensor), over the team with handle `team` (-1: the World)."""
    return _all_reduce(x, team)


@all_reduce.register_fake
def _(x, team=-1):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _ranks_of(team):
    """(handle, number of ranks) of `team`: a weft.Team, its handle (an int; -1: the World) or None (the World).
    Plain Python over plain attributes, so torch.compile traces it and bakes the count into its graph."""
    if team is None:
        return -1, _runtime._get_state().num_ranks
    if isinstance(team, _runtime.Team):
        _runtime._check_open(team, "weft.torch")
        return team.handle, team.num_ranks
    if isinstance(team, int) and not isinstance(team, bool):
        return team, _runtime.team_size(team)
    raise TypeError(f"team: expected a weft.Team, a team handle or None, got {type(team).__name__}")


def _check_ranks(team, num_ranks, op):
    # The count is an argument (as in torch's own functional collectives) so that a compiled graph's shapes, and
    # torch.compile's on-disk caches, key on it; a stale count must not reach the op.
    expected = _runtime.team_size(team)
    if num_ranks != expected:
        of = "the World" if team < 0 else f"the team with handle {team}"
        if op in ("all_gather", "reduce_scatter", "all_to_all", "ulysses_seq_to_head", "ulysses_head_to_seq"):
            # a collective's place in the team's calls (weft._ops._refused)
            _ops.count_refused_call(_runtime.team_by_handle(team), op)
        raise ValueError(f"num_ranks: expected {expected} (the ranks of {of}), got {num_ranks}; "
                         f"weft.torch.{op}(...) passes the right count")


def _check_fake_ranks(num_ranks):
    torch._check(num_ranks >= 1, lambda: f"num_ranks: expected at least 1, got {num_ranks}")


@torch.library.custom_op("weft::all_gather", mutates_args=())
def _all_gather(x: torch.Tensor, team: int, num_ranks: int) -> torch.Tensor:
    """Every rank's x concatenated along dim 0, in rank order, over the team with handle `team` (num_ranks ranks)."""
    _check_ranks(team, num_ranks, "all_gather")
    return _ops.all_gather(_contiguous(x), team=_runtime.team_by_handle(team))


@_all_gather.register_fake
def _(x, team, num_ranks):
    _check_fake_ranks(num_ranks)
    return x.new_empty((num_ranks * x.shape[0], *x.shape[1:]) if x.dim() > 0 else (num_ranks,))


@torch.library.custom_op("weft::reduce_scatter", mutates_args=())
def _reduce_scatter(x: torch.Tensor, team: int, num_ranks: int) -> torch.Tensor:
    """Slice `rank` (dim 0) of the element-wise sum of every rank's x, over the team with handle `team`."""
    _check_ranks(team, num_ranks, "reduce_scatter")
    return _ops.reduce_scatter(_contiguous(x), team=_runtime.team_by_handle(team))


@_reduce_scatter.register_fake
def _(x, team, num_ranks):
    _check_fake_ranks(num_ranks)
    torch._check(x.shape[0] % num_ranks == 0, lambda: f"x: dim 0 must be a multiple of the {num_ranks} ranks")
    return x.new_empty((x.shape[0] // num_ranks, *x.shape[1:]))


def all_gather(x, team=None):
    """Every rank's x concatenated along dim 0 (torch.ops.weft.all_gather), over `team` (a weft.Team, its handle,
    or None: the World), differentiable."""
    handle, n = _ranks_of(team)
    return torch.ops.weft.all_gather(x, handle, n)


def reduce_scatter(x, team=None):
    """This rank's slice of the sum of every rank's x (torch.ops.weft.reduce_scatter), differentiable."""
    handle, n = _ranks_of(team)
    return torch.ops.weft.reduce_scatter(x, handle, n)


def _save_team(ctx, inputs, output):
    ctx.team = inputs[1]


def _all_reduce_backward(ctx, grad):
    return all_reduce(grad, ctx.team), None


def _save_team_and_ranks(ctx, inputs, output):
    ctx.team, ctx.num_ranks = inputs[1], inputs[2]


def _all_gather_backward(ctx, grad):
    return torch.ops.weft.reduce_scatter(_contiguous(grad), ctx.team, ctx.num_ranks), None, None


def _reduce_scatter_backward(ctx, grad):
    return torch.ops.weft.all_gather(_contiguous(grad), ctx.team, ctx.num_ranks), None, None


all_reduce.register_autograd(_all_reduce_backward, setup_context=_save_team)
_all_gather.register_autograd(_all_gather_backward, setup_context=_save_team_and_ranks)
_reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_save_team_and_ranks)


@torch.library.custom_op("weft::all_to_all", mutates_args=())
def _all_to_all(x: torch.Tensor, team: int, num_ranks: int) -> torch.Tensor:
    """x split in num_ranks equal chunks along dim 0; chunk q of the result is rank q's chunk `rank` (equal splits),
    over the team with handle `team`."""
    _check_ranks(team, num_ranks, "all_to_all")
    return _ops.all_to_all(_contiguous(x), team=_runtime.team_by_handle(team))


@_all_to_all.register_fake
def _(x, team, num_ranks):
    _check_fake_ranks(num_ranks)
    torch._check(x.dim() > 0 and x.shape[0] % num_ranks == 0,
                 lambda: f"x: dim 0 must be a multiple of the {num_ranks} ranks")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("weft::all_to_all_v", mutates_args=())
def _all_to_all_v(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], team: int) -> torch.Tensor:
    """send_counts[q] rows of x (dim 0) to rank q, recv_counts[q] rows from it, back to back in rank order."""
    return _ops.all_to_all_v(_contiguous(x), send_counts, recv_counts, team=_runtime.team_by_handle(team))


@_all_to_all_v.register_fake
def _(x, send_counts, recv_counts, team):
    torch._check(x.dim() > 0, lambda: "x: expected at least one dimension")
    return x.new_empty((sum(recv_counts), *x.shape[1:]))


@torch.library.custom_op("weft::ulysses", mutates_args=())
def _ulysses(x: torch.Tensor, seq_to_head: bool, team: int, num_ranks: int) -> torch.Tensor:
    """The Ulysses re-shard: [S / W, H, D] to [S, H / W, D] (seq_to_head) or back."""
    _check_ranks(team, num_ranks, "ulysses_seq_to_head" if seq_to_head else "ulysses_head_to_seq")
    op = _ops.ulysses_seq_to_head if seq_to_head else _ops.ulysses_head_to_seq
    return op(_contiguous(x), team=_runtime.team_by_handle(team))


@_ulysses.register_fake
def _(x, seq_to_head, team, num_ranks):
    _check_fake_ranks(num_ranks)
    torch._check(x.dim() == 3, lambda: "x: expected a 3-D tensor")
    rows, heads, dim = x.shape
    if seq_to_head:
        torch._check(heads % num_ranks == 0, lambda: f"x: H must be a multiple of the {num_ranks} ranks")
        return x.new_empty((rows * num_ranks, heads // num_ranks, dim))
    torch._check(rows % num_ranks == 0, lambda: f"x: S must be a multiple of the {num_ranks} ranks")
    return x.new_empty((rows // num_ranks, heads * num_ranks, dim))


def _all_to_all_backward(ctx, grad):
    # Equal splits: the all-to-all is its own inverse, and a permutation's adjoint is its inverse.
    return torch.ops.weft.all_to_all(_contiguous(grad), ctx.team, ctx.num_ranks), None, None


def _save_counts(ctx, inputs, output):
    ctx.send_counts, ctx.recv_counts, ctx.team = inputs[1], inputs[2], inputs[3]


def _all_to_all_v_backward(ctx, grad):
    # Each row goes back where it came from: the counts swap.
    return torch.ops.weft.all_to_all_v(_contiguous(grad), ctx.recv_counts, ctx.send_counts, ctx.team), None, None, \
        None


def _save_ulysses(ctx, inputs, output):
    ctx.seq_to_head, ctx.team, ctx.num_ranks = inputs[1], inputs[2], inputs[3]


def _ulysses_backward(ctx, grad):
    return torch.ops.weft.ulysses(_contiguous(grad), not ctx.seq_to_head, ctx.team, ctx.num_ranks), None, None, None


_all_to_all.register_autograd(_all_to_all_backward, setup_context=_save_team_and_ranks)
_all_to_all_v.register_autograd(_all_to_all_v_backward, setup_context=_save_counts)
_ulysses.register_autograd(_ulysses_backward, setup_context=_save_ulysses)


def all_to_all(x, team=None):
    """weft.all_to_all as torch.ops.weft.all_to_all (equal splits along dim 0), over `team` (a weft.Team, its
    handle, or None: the World), differentiable (the gradient goes back by the same all-to-all)."""
    handle, n = _ranks_of(team)
    return torch.ops.weft.all_to_all(x, handle, n)


def all_to_all_v(x, send_counts, recv_counts, team=None):
    """weft.all_to_all_v as torch.ops.weft.all_to_all_v (rows along dim 0), differentiable (the gradient goes back
    with the counts swapped)."""
    handle, _ = _ranks_of(team)
    return torch.ops.weft.all_to_all_v(x, [int(c) for c in send_counts], [int(c) for c in recv_counts], handle)


def ulysses_seq_to_head(x, team=None):
    """[S / W, H, D] to [S, H / W, D] (torch.ops.weft.ulysses), differentiable (backward: ulysses_head_to_seq)."""
    handle, n = _ranks_of(team)
    return torch.ops.weft.ulysses(x, True, handle, n)


def ulysses_head_to_seq(x, team=None):
    """[S, H / W, D] to [S / W, H, D], differentiable (backward: ulysses_seq_to_head)."""
    handle, n = _ranks_of(team)
    return torch.ops.weft.ulysses(x, False, handle, n)


# ---- GEMMs ----

@torch.library.custom_op("weft::gemm", mutates_args=())
def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b.T with b [N, K] (a linear layer's weight), on this GPU."""
    return _ops.gemm(a, b)


@gemm.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], b.shape[0]))


@torch.library.custom_op("weft::ag_gemm", mutates_args=())
def _ag_gemm(a_local: torch.Tensor, b: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """AllGather(a_local) @ b.T over the World (num_ranks ranks): a_local [M/W, k], b [n, k] -> [M, n]."""
    _check_ranks(-1, num_ranks, "ag_gemm")
    return _ops.ag_gemm(_contiguous(a_local), _contiguous(b))


@_ag_gemm.register_fake
def _(a_local, b, num_ranks):
    _check_fake_ranks(num_ranks)
    return a_local.new_empty((num_ranks * a_local.shape[0], b.shape[0]))


@torch.library.custom_op("weft::ag_gemm_saving", mutates_args=())
def _ag_gemm_saving(a_local: torch.Tensor, b: torch.Tensor, team: int,
                    num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(AllGather(a_local) @ b.T, a copy of AllGather(a_local)) over the team with handle `team` (-1: the World).
    The copy is what the backward pass needs for the weight gradient (kept instead of gathered again)."""
    _check_ranks(team, num_ranks, "ag_gemm")
    t = _runtime.team_by_handle(team)
    a_local, b = _contiguous(a_local), _contiguous(b)
    _ops._fused_args_check("ag_gemm", a_local, "a_local", b)  # before the op is looked up or made
    m = a_local.shape[0] * _runtime.team_size(team)
    op = _ops._cached(_ops.AgGemm, m, b.shape[0], b.shape[1], a_local.dtype, t)
    out = op.run(a_local, b)
    return out, op.gathered(m).clone()


@_ag_gemm_saving.register_fake
def _(a_local, b, team, num_ranks):
    _check_fake_ranks(num_ranks)
    m = num_ranks * a_local.shape[0]
    return a_local.new_empty((m, b.shape[0])), a_local.new_empty((m, a_local.shape[1]))


@torch.library.custom_op("weft::gemm_rs", mutates_args=())
def _gemm_rs(a: torch.Tensor, b: torch.Tensor, team: int, num_ranks: int) -> torch.Tensor:
    """ReduceScatter(a @ b.T) over the team with handle `team` (-1: the World): a [M, k], b [n, k] -> [M/W, n]."""
    _check_ranks(team, num_ranks, "gemm_rs")
    return _ops.gemm_rs(_contiguous(a), _contiguous(b), team=_runtime.team_by_handle(team))


@_gemm_rs.register_fake
def _(a, b, team, num_ranks):
    _check_fake_ranks(num_ranks)
    torch._check(a.shape[0] % num_ranks == 0, lambda: f"a: M must be a multiple of the {num_ranks} ranks")
    return a.new_empty((a.shape[0] // num_ranks, b.shape[0]))


@torch.library.custom_op("weft::gemm_ar", mutates_args=())
def _gemm_ar(a: torch.Tensor, b: torch.Tensor, team: int = -1) -> torch.Tensor:
    """AllReduce(a @ b.T) over the team with handle `team` (-1: the World): a [M, k], b [n, k] -> [M, n]."""
    return _ops.gemm_ar(_contiguous(a), _contiguous(b), team=_runtime.team_by_handle(team))


@_gemm_ar.register_fake
def _(a, b, team=-1):
    return a.new_empty((a.shape[0], b.shape[0]))


def _team_arg(team):
    """(handle, number of ranks) of the fused ops' `team` argument: a weft.Team or None (the World)."""
    if team is not None and not isinstance(team, _runtime.Team):
        raise TypeError(f"team: expected a weft.Team or None, got {type(team).__name__}")
    return _ranks_of(team)


def ag_gemm(a_local, b, team=None):
    """AllGather(a_local) @ b.T over `team` (a weft.Team; None: the World), differentiable. On a team it saves the
    gathered input for the backward pass (memory of M x k); on the World the backward all-gathers it again."""
    handle, n = _team_arg(team)
    if team is None:
        return torch.ops.weft.ag_gemm(a_local, b, n)
    return torch.ops.weft.ag_gemm_saving(a_local, b, handle, n)[0]


def gemm_rs(a, b, team=None):
    """ReduceScatter(a @ b.T) over `team` (None: the World), differentiable. The partials have a's dtype (each
    rounded once before the fp32 sum; weft.gemm_rs(..., partial_dtype=torch.float32) keeps them exact)."""
    return torch.ops.weft.gemm_rs(a, b, *_team_arg(team))


def gemm_ar(a, b, team=None):
    """AllReduce(a @ b.T) over `team` (None: the World), differentiable. The partials have a's dtype (as gemm_rs)."""
    return torch.ops.weft.gemm_ar(a, b, _team_arg(team)[0])


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _save_world_inputs(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.num_ranks = inputs[2]


def _gemm_backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad_a = grad @ b if ctx.needs_input_grad[0] else None
    grad_b = grad.t() @ a if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


def _fusable(n):
    """Whether a backward's fused op can take n as its reduction dimension: GEMM+RS and AG+GEMM need rows of whole
    16-byte units (n a multiple of 8). The forward ops pad an output of any n; the backward of such an n runs the
    GEMM and the collective one after the other."""
    return n % 8 == 0


def _ag_gemm_backward(ctx, grad):
    a_local, b = ctx.saved_tensors
    grad = _contiguous(grad)
    if not ctx.needs_input_grad[0]:
        grad_a = None
    elif _fusable(b.shape[0]):
        grad_a = torch.ops.weft.gemm_rs(grad, b.t().contiguous(), -1, ctx.num_ranks)
    else:
        grad_a = torch.ops.weft.reduce_scatter(_contiguous(grad @ b), -1, ctx.num_ranks)
    grad_b = grad.t() @ torch.ops.weft.all_gather(a_local, -1, ctx.num_ranks) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


def _save_saving(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], output[1])
    ctx.team, ctx.num_ranks = inputs[2], inputs[3]


def _ag_gemm_saving_backward(ctx, grad, grad_gathered):
    # The gathered copy is an internal output: gradients through it are not propagated (nothing differentiates it).
    b, a_full = ctx.saved_tensors
    grad = _contiguous(grad)
    if not ctx.needs_input_grad[0]:
        grad_a = None
    elif _fusable(b.shape[0]):
        grad_a = torch.ops.weft.gemm_rs(grad, b.t().contiguous(), ctx.team, ctx.num_ranks)
    else:
        grad_a = torch.ops.weft.reduce_scatter(_contiguous(grad @ b), ctx.team, ctx.num_ranks)
    grad_b = grad.t() @ a_full if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None, None


def _save_with_team(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.team = inputs[2]
    ctx.num_ranks = inputs[3] if len(inputs) > 3 else None


def _gemm_rs_backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad = _contiguous(grad)
    if not _fusable(b.shape[0]):
        grad_full = torch.ops.weft.all_gather(grad, ctx.team, ctx.num_ranks)
        grad_a = grad_full @ b if ctx.needs_input_grad[0] else None
        grad_b = grad_full.t() @ a if ctx.needs_input_grad[1] else None
    elif ctx.team < 0:
        grad_a = torch.ops.weft.ag_gemm(grad, b.t().contiguous(), ctx.num_ranks) if ctx.needs_input_grad[0] else None
        grad_b = (torch.ops.weft.all_gather(grad, -1, ctx.num_ranks).t() @ a if ctx.needs_input_grad[1]
                  else None)
    else:
        grad_a, grad_full = torch.ops.weft.ag_gemm_saving(grad, b.t().contiguous(), ctx.team, ctx.num_ranks)
        grad_a = grad_a if ctx.needs_input_grad[0] else None
        grad_b = grad_full.t() @ a if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None, None


def _gemm_ar_backward(ctx, grad):
    # out = sum_r a_r @ b_r.T, the same on every rank: each rank's inputs get the (replicated) output gradient.
    a, b = ctx.saved_tensors
    grad_a = grad @ b if ctx.needs_input_grad[0] else None
    grad_b = grad.t() @ a if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


gemm.register_autograd(_gemm_backward, setup_context=_save_inputs)
_ag_gemm.register_autograd(_ag_gemm_backward, setup_context=_save_world_inputs)
_ag_gemm_saving.register_autograd(_ag_gemm_saving_backward, setup_context=_save_saving)
_gemm_rs.register_autograd(_gemm_rs_backward, setup_context=_save_with_team)
_gemm_ar.register_autograd(_gemm_ar_backward, setup_context=_save_with_team)
