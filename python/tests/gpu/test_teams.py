# SPDX-License-Identifier: MIT
# weft.Team from a list of ranks and from a torch process group: fused ops and symmetric tensors over a team, two
# teams at once, against references gathered with NCCL over the matching process group.
import pytest
import torch
import torch.distributed as dist

import weft
import weft.torch  # noqa: F401  (torch.ops.weft)
from weft_gpu_helpers import rank_generator, rel_error


def _halves(num_ranks):
    half = max(num_ranks // 2, 1)
    return [list(range(0, half)), list(range(half, num_ranks))] if num_ranks > 1 else [[0]]


@pytest.fixture(scope="module")
def my_team():
    world = weft.world()
    groups = _halves(world.num_ranks)
    pgs = [dist.new_group(g) for g in groups]  # collective in torch: every rank makes every group
    mine = next(i for i, g in enumerate(groups) if world.rank in g)
    teams = [weft.Team(g) for g in groups]  # collective over the World, in the same order on every rank
    return teams[mine], pgs[mine], groups[mine]


def test_team_membership(world, my_team):
    team, pg, ranks = my_team
    assert team.is_member and team.ranks == ranks and team.num_ranks == len(ranks)
    assert team.rank == ranks.index(world.rank)
    assert team.is_world == (len(ranks) == world.num_ranks)
    team.barrier()


def test_each_rank_passing_its_own_group_makes_one_team_per_group(world):
    # The common idiom: every rank names only its own tensor-parallel group (not every group in turn).
    groups = _halves(world.num_ranks)
    mine = next(g for g in groups if world.rank in g)
    team = weft.Team(mine)
    assert team.is_member and team.ranks == mine and team.rank == mine.index(world.rank)
    x = torch.full((64,), float(world.rank + 1), device="cuda")
    weft.all_reduce(x, team=team)
    torch.cuda.synchronize()
    assert torch.all(x == float(sum(r + 1 for r in mine)))


def test_team_from_a_process_group(world):
    pg = dist.new_group(list(range(world.num_ranks)))
    team = weft.Team(pg)
    assert team.ranks == list(range(world.num_ranks)) and team.is_world and team.rank == world.rank


def test_ag_gemm_and_gemm_rs_on_two_teams_at_once(world, my_team):
    team, pg, ranks = my_team
    w = len(ranks)
    dtype = torch.bfloat16
    g = rank_generator(100 + world.rank)
    a_local = torch.randn((32, 256), generator=g, device="cuda").to(dtype)
    b = (torch.randn((128, 256), generator=g, device="cuda") * 0.1).to(dtype)

    out = weft.ag_gemm(a_local, b, team=team)
    gathered = torch.empty((w * 32, 256), dtype=dtype, device="cuda")
    dist.all_gather_into_tensor(gathered, a_local, group=pg)
    assert out.shape == (w * 32, 128)
    assert rel_error(out, gathered.float() @ b.float().t()) < 2e-2

    a = torch.randn((w * 32, 256), generator=g, device="cuda").to(dtype)
    out = weft.gemm_rs(a, b, team=team)
    expected = torch.empty((32, 128), device="cuda")
    dist.reduce_scatter_tensor(expected, a.float() @ b.float().t(), group=pg)
    assert rel_error(out, expected) < 2e-2


def test_symmetric_tensor_on_a_team(world, my_team):
    team, _, _ = my_team
    x = weft.empty((team.num_ranks, 64), torch.float32, team=team)
    try:
        assert weft.is_symmetric(x)
        x.fill_(1.0)
        team.barrier()
    finally:
        weft.free(x)


def test_collectives_on_two_teams_at_once_match_nccl_on_the_groups(world, my_team):
    team, pg, ranks = my_team
    w = len(ranks)
    g = rank_generator(200 + world.rank)
    x = torch.randint(-15, 16, (w * 1000,), generator=g, device="cuda").to(torch.float32)
    expected = x.clone()
    dist.all_reduce(expected, group=pg)
    assert torch.equal(weft.all_reduce(x.clone(), team=team), expected)
    gathered = torch.empty((w * x.numel(),), device="cuda")
    dist.all_gather_into_tensor(gathered, x, group=pg)
    assert torch.equal(weft.all_gather(x, team=team), gathered)
    scattered = torch.empty((1000,), device="cuda")
    dist.reduce_scatter_tensor(scattered, x, group=pg)
    assert torch.equal(weft.reduce_scatter(x, team=team), scattered)
    # The custom ops and their backward on the team: d(sum(all_gather(x)))/dx = W (reduce-scatter of ones).
    y = x.clone().requires_grad_()
    weft.torch.all_gather(y, team).sum().backward()
    assert torch.all(y.grad == w)


def test_tensor_parallel_mlp_on_a_team_matches_a_single_gpu_reference(my_team):
    import weft.nn

    team, _, ranks = my_team
    w, t = len(ranks), team.rank
    hidden, ffn, m = 128, 512, 32 * w
    dtype = torch.bfloat16
    g = rank_generator(7)  # the same full weights, tokens and gradient on every rank of every team
    w1 = (torch.randn((ffn, hidden), generator=g, device="cuda") * 0.05).to(dtype)
    w2 = (torch.randn((hidden, ffn), generator=g, device="cuda") * 0.05).to(dtype)
    x = torch.randn((m, hidden), generator=g, device="cuda").to(dtype)
    grad = torch.randn((m, hidden), generator=g, device="cuda").to(dtype)

    mlp = weft.nn.TensorParallelMLP(hidden, ffn, dtype=dtype, team=team)
    assert mlp.num_ranks == w and mlp.rank == t
    mlp.load_full_weights(w1, w2)
    rows = slice(t * (m // w), (t + 1) * (m // w))
    x_local = x[rows].clone().requires_grad_()
    y_local = mlp(x_local)
    y_local.backward(grad[rows])

    xr, w1r, w2r = (v.float().requires_grad_() for v in (x, w1, w2))
    yr = torch.nn.functional.gelu(xr @ w1r.t()) @ w2r.t()
    yr.backward(grad.float())
    shard = slice(t * (ffn // w), (t + 1) * (ffn // w))
    assert rel_error(y_local, yr[rows]) < 3e-2
    assert rel_error(x_local.grad, xr.grad[rows]) < 3e-2
    assert rel_error(mlp.w1.grad, w1r.grad[shard]) < 3e-2
    assert rel_error(mlp.w2.grad, w2r.grad[:, shard]) < 3e-2
