# SPDX-License-Identifier: MIT
# weft beside torch.distributed (NCCL) in one process, torch.compile(fullgraph=True), CUDA graph replay, autograd of
# the TP linear pair and the TP MLP against a single-GPU reference.
import os

import pytest
import torch
import torch.distributed as dist

import weft
import weft.nn
import weft.torch
from weft_gpu_helpers import rank_generator, rel_error


def test_nccl_process_group_and_weft_share_the_process(world, rank, num_ranks):
    # conftest initialised torch.distributed with NCCL, then weft.init() on torch's store, under torchrun.
    if dist.get_backend() != "nccl":
        pytest.skip("NCCL beside weft: the process group is " + dist.get_backend())
    assert dist.is_initialized()
    assert world.rank == dist.get_rank() and world.num_ranks == dist.get_world_size()
    assert world.device == torch.cuda.current_device()
    assert os.environ.get("MASTER_PORT"), "torchrun sets MASTER_PORT; weft must not have needed it"
    x = torch.full((1000,), float(rank + 1), device="cuda")
    nccl, mine = x.clone(), x.clone()
    dist.all_reduce(nccl)
    weft.all_reduce(mine)
    dist.all_reduce(x)  # NCCL again after weft: both keep working, interleaved
    torch.cuda.synchronize()
    total = num_ranks * (num_ranks + 1) / 2
    assert torch.equal(mine, nccl) and torch.all(mine == total) and torch.equal(x, nccl)


def test_a_second_world_after_finalize_meets_on_fresh_keys(rank):
    weft.finalize()
    w = weft.init()
    assert w.rank == rank
    x = torch.ones(64, device="cuda")
    weft.all_reduce(x)
    torch.cuda.synchronize()
    assert torch.all(x == dist.get_world_size())


def test_init_again_returns_the_world_and_refuses_another_group_or_device(rank):
    w = weft.init()
    assert weft.init() is w
    assert weft.init(group=dist.group.WORLD) is w  # the same ranks
    with pytest.raises(ValueError, match="initialised already"):
        weft.init(device=w.device + 1)


def _randn(shape, dtype, seed, rank=0, scale=1.0):
    g = rank_generator(seed * 1000 + rank)
    return (torch.randn(shape, generator=g, device="cuda") * scale).to(dtype)


def test_custom_ops_under_torch_compile_fullgraph(rank, num_ranks):
    dtype = torch.bfloat16
    w1 = _randn((256, 128), dtype, 1, rank, 0.1)
    w2 = _randn((128, 256), dtype, 2, rank, 0.1)

    def block(x_local):
        h = torch.relu(weft.torch.ag_gemm(x_local, w1))
        y = weft.torch.gemm_rs(h, w2)
        return torch.ops.weft.all_reduce(y) * 0.5

    x_local = _randn((64, 128), dtype, 3, rank)
    eager = block(x_local)
    compiled = torch.compile(block, fullgraph=True)
    out = compiled(x_local)
    torch.cuda.synchronize()
    assert rel_error(out, eager) < 1e-2


def test_cuda_graph_replay(rank, num_ranks):
    dtype = torch.bfloat16
    w1 = _randn((256, 128), dtype, 4, rank, 0.1)
    x_local = _randn((32, 128), dtype, 5, rank)
    t = torch.zeros(4096, device="cuda")

    def step():
        y = weft.torch.ag_gemm(x_local, w1)
        s = weft.torch.all_reduce(t)
        return y, s

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: makes the fused op and the collectives' workspace (collective, not capturable)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, summed = step()
    for it in range(3):
        x_local.copy_(_randn((32, 128), dtype, 10 + it, rank))
        t.fill_(float(rank + it))
        graph.replay()
        torch.cuda.synchronize()
        gathered = torch.empty((num_ranks * 32, 128), dtype=dtype, device="cuda")
        dist.all_gather_into_tensor(gathered, x_local)
        assert rel_error(y, gathered.float() @ w1.float().t()) < 2e-2
        assert torch.all(summed == sum(r + it for r in range(num_ranks)))


def test_making_a_fused_op_during_capture_is_an_error():
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(weft.Error, match="cannot happen during CUDA graph capture"):
        with torch.cuda.graph(graph):
            weft.AgGemm(dist.get_world_size() * 8, 8, 8)


@pytest.mark.parametrize("n", [256, 100])  # 100: rows of 200 bytes, which the backward's fused ops cannot take
def test_tp_linear_pair_autograd(rank, num_ranks, n):
    dtype = torch.bfloat16
    m_local, k = 32, 128
    a_local = _randn((m_local, k), dtype, 20, rank).requires_grad_()
    b = _randn((n, k), dtype, 21, rank, 0.1).requires_grad_()
    grad = _randn((num_ranks * m_local, n), dtype, 22, rank)
    weft.torch.ag_gemm(a_local, b).backward(grad)

    # Reference: the same maths with torch on gathered data (each rank's b is its own column shard).
    a_full = torch.empty((num_ranks * m_local, k), dtype=dtype, device="cuda")
    dist.all_gather_into_tensor(a_full, a_local.detach())
    grad_a_full = grad.float() @ b.detach().float()
    expected_grad_a = torch.empty((m_local, k), device="cuda")
    dist.reduce_scatter_tensor(expected_grad_a, grad_a_full)
    assert rel_error(a_local.grad, expected_grad_a) < 2e-2
    assert rel_error(b.grad, grad.float().t() @ a_full.float()) < 2e-2

    h = _randn((num_ranks * m_local, k), dtype, 23, rank).requires_grad_()
    w = _randn((n, k), dtype, 24, rank, 0.1).requires_grad_()
    grad_out = _randn((m_local, n), dtype, 25, rank)
    weft.torch.gemm_rs(h, w).backward(grad_out)
    grad_full = torch.empty((num_ranks * m_local, n), dtype=dtype, device="cuda")
    dist.all_gather_into_tensor(grad_full, grad_out)
    assert rel_error(h.grad, grad_full.float() @ w.detach().float()) < 2e-2
    assert rel_error(w.grad, grad_full.float().t() @ h.detach().float()) < 2e-2


@pytest.mark.parametrize("compiled", [False, True])
def test_tensor_parallel_mlp_matches_a_single_gpu_reference(rank, num_ranks, compiled):
    hidden, ffn, m = 256, 1024, 64 * num_ranks
    dtype = torch.bfloat16
    # Full weights, inputs and output gradient, the same on every rank.
    w1 = _randn((ffn, hidden), dtype, 30, 0, 0.05)
    w2 = _randn((hidden, ffn), dtype, 31, 0, 0.05)
    x = _randn((m, hidden), dtype, 32)
    g = _randn((m, hidden), dtype, 33)

    mlp = weft.nn.TensorParallelMLP(hidden, ffn, dtype=dtype)
    mlp.load_full_weights(w1, w2)
    rows = slice(rank * (m // num_ranks), (rank + 1) * (m // num_ranks))
    x_local = x[rows].clone().requires_grad_()
    fwd = torch.compile(mlp, fullgraph=True) if compiled else mlp
    y_local = fwd(x_local)
    y_local.backward(g[rows])

    xr = x.float().requires_grad_()
    w1r, w2r = w1.float().requires_grad_(), w2.float().requires_grad_()
    yr = torch.nn.functional.gelu(xr @ w1r.t()) @ w2r.t()
    yr.backward(g.float())

    shard = slice(rank * (ffn // num_ranks), (rank + 1) * (ffn // num_ranks))
    assert rel_error(y_local, yr[rows]) < 3e-2
    assert rel_error(x_local.grad, xr.grad[rows]) < 3e-2
    assert rel_error(mlp.w1.grad, w1r.grad[shard]) < 3e-2
    assert rel_error(mlp.w2.grad, w2r.grad[:, shard]) < 3e-2


def test_all_to_all_and_ulysses_custom_ops_differentiate_and_compile(rank, num_ranks):
    """The gradient of an all-to-all goes back by the same all-to-all: x.grad's chunk q on this rank is rank q's
    upstream gradient's chunk `rank` (each rank's upstream gradient recomputed here from its seed)."""
    rows = 3 * num_ranks

    def upstream(q):
        return _randn((rows, 8), torch.float32, 20, q)

    x = _randn((rows, 8), torch.float32, 21, rank).requires_grad_()
    y = weft.torch.all_to_all(x)
    y.backward(upstream(rank))
    torch.cuda.synchronize()
    assert torch.equal(x.grad, torch.cat([upstream(q)[rank * 3:(rank + 1) * 3] for q in range(num_ranks)]))
    # Ulysses there and back is the identity, eagerly and compiled, and so is its gradient.
    z = _randn((5, 2 * num_ranks, 16), torch.bfloat16, 22, rank).requires_grad_()

    def round_trip(t):
        return weft.torch.ulysses_head_to_seq(weft.torch.ulysses_seq_to_head(t) * 2)

    out = torch.compile(round_trip, fullgraph=True)(z)
    torch.cuda.synchronize()
    assert torch.equal(out, z * 2)
    out.sum().backward()
    assert torch.equal(z.grad, torch.full_like(z, 2))
