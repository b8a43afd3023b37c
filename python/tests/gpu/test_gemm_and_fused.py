# SPDX-License-Identifier: MIT
# weft's GEMM and fused TP ops on torch tensors against torch references (torch.matmul in fp32 on inputs gathered
# or reduced with NCCL).
import pytest
import torch
import torch.distributed as dist

import weft
from weft_gpu_helpers import rank_generator, rel_error

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _randn(shape, dtype, seed, rank=0):
    g = rank_generator(seed * 1000 + rank)
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def _gather(x, num_ranks):
    out = torch.empty((num_ranks * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous())
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (48, 512, 256), (512, 384, 1024)])
def test_gemm_matches_torch(rank, dtype, m, n, k):
    a, b = _randn((m, k), dtype, 1, rank), _randn((n, k), dtype, 2, rank)
    out = weft.gemm(a, b)
    expected = a.float() @ b.float().t()
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_error(out, expected) < TOL[dtype]
    kn = weft.gemm(a, b.t().contiguous(), b_layout="kn", out_dtype=torch.float32)
    assert kn.dtype == torch.float32 and rel_error(kn, expected) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m_local,n,k", [(64, 256, 512), (128, 1024, 256)])
def test_ag_gemm_matches_gather_then_matmul(rank, num_ranks, dtype, m_local, n, k):
    a_local, b = _randn((m_local, k), dtype, 3, rank), _randn((n, k), dtype, 4, rank)
    expected = _gather(a_local, num_ranks).float() @ b.float().t()
    out = weft.ag_gemm(a_local, b)
    assert out.shape == (num_ranks * m_local, n)
    assert rel_error(out, expected) < TOL[dtype]
    with weft.AgGemm(num_ranks * m_local, n, k, dtype) as op:
        out2 = torch.full((num_ranks * m_local, n), float("nan"), dtype=dtype, device="cuda")
        op.run(a_local, b, out2)
        assert rel_error(out2, expected) < TOL[dtype]
        assert torch.equal(op.gathered(num_ranks * m_local), _gather(a_local, num_ranks))


@pytest.mark.parametrize("mode", ["auto", "pull"])
@pytest.mark.parametrize("m,n,k", [(128, 256, 512), (512, 512, 256)])
def test_gemm_rs_matches_matmul_then_reduce_scatter(rank, num_ranks, mode, m, n, k):
    dtype = torch.bfloat16
    a, b = _randn((m, k), dtype, 5, rank), _randn((n, k), dtype, 6, rank)
    partial = a.float() @ b.float().t()
    expected = torch.empty((m // num_ranks, n), dtype=torch.float32, device="cuda")
    dist.reduce_scatter_tensor(expected, partial)
    if mode == "auto":
        out = weft.gemm_rs(a, b)
    else:
        with weft.GemmRs(m, n, k, dtype, mode=mode) as op:
            out = op.run(a, b)
            torch.cuda.synchronize()
    assert out.shape == (m // num_ranks, n)
    assert rel_error(out, expected) < TOL[dtype]


def _within_output_rounding(out, expected):
    """Every element within a few bf16 roundings of the fp32 reference (exact partials: only the output is rounded)."""
    error = (out.float() - expected).abs()
    return bool((error <= 8e-3 * expected.abs() + 1e-3 * expected.abs().max()).all())


@pytest.mark.parametrize("m,n,k", [(128, 256, 512), (64, 264, 1024)])
def test_gemm_rs_and_gemm_ar_with_f32_partials_round_only_the_output(rank, num_ranks, m, n, k):
    dtype = torch.bfloat16
    a, b = _randn((m, k), dtype, 21, rank), _randn((n, k), dtype, 22, rank)
    partial = a.float() @ b.float().t()
    summed = partial.clone()
    dist.all_reduce(summed)
    rows = m // num_ranks
    out = weft.gemm_rs(a, b, partial_dtype=torch.float32)
    assert out.shape == (rows, n)
    assert _within_output_rounding(out, summed[rank * rows:(rank + 1) * rows])
    out = weft.gemm_ar(a, b, partial_dtype=torch.float32)
    assert out.shape == (m, n)
    assert _within_output_rounding(out, summed)


@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (16, 1024, 256), (100, 512, 512)])
def test_gemm_ar_matches_matmul_then_all_reduce(rank, m, n, k):
    dtype = torch.bfloat16
    a, b = _randn((m, k), dtype, 7, rank), _randn((n, k), dtype, 8, rank)
    expected = a.float() @ b.float().t()
    dist.all_reduce(expected)
    out = weft.gemm_ar(a, b)
    assert out.shape == (m, n)
    assert rel_error(out, expected) < TOL[dtype]
    # Every rank holds the same bits (the partials are summed in rank order).
    everyone = _gather(out.unsqueeze(0), dist.get_world_size())
    assert all(torch.equal(everyone[0], everyone[r]) for r in range(everyone.shape[0]))


def test_cached_fused_op_grows_with_m(rank, num_ranks):
    dtype = torch.bfloat16
    b = _randn((256, 256), dtype, 9, rank)
    for m_local in (8, 64, 16):
        a_local = _randn((m_local, 256), dtype, 10 + m_local, rank)
        expected = _gather(a_local, num_ranks).float() @ b.float().t()
        assert rel_error(weft.ag_gemm(a_local, b), expected) < TOL[dtype]


def test_fused_op_shape_errors_are_weft_errors_on_every_rank(num_ranks):
    with pytest.raises(weft.Error, match="shape.k"):
        weft.AgGemm(num_ranks * 16, 256, 12, torch.bfloat16)
    with pytest.raises(TypeError, match="a_local: expected dtype bfloat16, got float16"):
        with weft.AgGemm(num_ranks * 16, 256, 256, torch.bfloat16) as op:
            op.run(torch.zeros(16, 256, dtype=torch.float16, device="cuda"),
                   torch.zeros(256, 256, dtype=torch.bfloat16, device="cuda"))
    weft.world().barrier()


def test_functional_fused_ops_refuse_bad_operands_before_making_an_op():
    a = torch.zeros(16, 256, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="K = 256"):
        weft.ag_gemm(a, torch.zeros(64, 128, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(TypeError, match="dtype"):
        weft.gemm_ar(a, torch.zeros(64, 256, dtype=torch.float16, device="cuda"))
    if weft.world().num_ranks > 1:
        with pytest.raises(ValueError, match="multiple of the"):
            weft.gemm_rs(a[:weft.world().num_ranks + 1], torch.zeros(64, 256, dtype=torch.bfloat16, device="cuda"))


def test_symmetric_tensor_is_visible_to_peers_at_the_same_offset(rank, num_ranks):
    x = weft.empty((num_ranks, 1024), torch.float32)
    try:
        x.fill_(float(rank))
        before = weft.world().heap_bytes_in_use
        y = weft.empty((4,), torch.int64)
        assert weft.world().heap_bytes_in_use > before
        weft.free(y)
        out = weft.all_gather(x[rank].contiguous())
        torch.cuda.synchronize()
        assert torch.equal(out.view(num_ranks, 1024)[:, 0].cpu(), torch.arange(num_ranks, dtype=torch.float32))
    finally:
        weft.free(x)
    with pytest.raises(ValueError, match="not a live tensor of weft.empty"):
        weft.free(x)
