# SPDX-License-Identifier: MIT
# weft's collectives on torch tensors against torch.distributed's (NCCL) in the same process.
import pytest
import torch
import torch.distributed as dist

import weft

SIZES = [1, 7, 4096, 1 << 20]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _integers(numel, dtype, rank, seed):
    # Small integers: every sum is exact in every dtype (up to 8 ranks: |sum| <= 8 * 15 < 256).
    g = torch.Generator(device="cuda")
    g.manual_seed(seed * 1000 + rank)
    return torch.randint(-15, 16, (numel,), generator=g, device="cuda").to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", SIZES)
def test_all_reduce_matches_nccl(rank, dtype, numel):
    x = _integers(numel, dtype, rank, 1)
    expected = x.clone()
    dist.all_reduce(expected)
    out = torch.full_like(x, float("nan"))
    assert weft.all_reduce(x, out) is out
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    in_place = x.clone()
    weft.all_reduce(in_place)
    assert torch.equal(in_place, expected)


@pytest.mark.parametrize("algo", ["ll", "one_shot", "two_shot"])
def test_all_reduce_each_algorithm_on_symmetric_memory(rank, algo):
    x = weft.empty((3, 5000), torch.bfloat16)
    try:
        assert weft.is_symmetric(x)
        x.copy_(_integers(x.numel(), torch.bfloat16, rank, 2).view(3, 5000))
        expected = x.clone()
        dist.all_reduce(expected)
        weft.all_reduce(x, algo=algo)
        torch.cuda.synchronize()
        assert torch.equal(x, expected)
    finally:
        weft.free(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("rows", [1, 33, 4096])
def test_all_gather_matches_nccl(rank, num_ranks, dtype, rows):
    x = _integers(rows * 8, torch.float32, rank, 3).to(dtype).view(rows, 8)
    expected = torch.empty((num_ranks * rows, 8), dtype=dtype, device="cuda")
    dist.all_gather_into_tensor(expected, x)
    out = weft.all_gather(x)
    assert out.shape == (num_ranks * rows, 8)
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def _rank_bytes(rank, numel, dtype):
    """numel elements of `dtype` made of this rank's own bytes (random bytes viewed as `dtype`; bool: 0 or 1)."""
    size = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator(device="cuda")
    g.manual_seed(7000 + rank)
    raw = torch.randint(0, 256, (numel * size,), generator=g, device="cuda", dtype=torch.uint8)
    return (raw & 1 if dtype == torch.bool else raw).view(dtype)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.int16, torch.float64, torch.complex64,
                                   torch.complex128, torch.float8_e5m2], ids=str)
def test_all_gather_moves_any_dtype_bit_for_bit(rank, num_ranks, dtype):
    # Dtypes weft has no code for go as bytes; every rank's bytes land in rank order, whatever they mean.
    rows = 33
    x = _rank_bytes(rank, rows * 8, dtype).view(rows, 8)
    expected = torch.cat([_rank_bytes(r, rows * 8, dtype) for r in range(num_ranks)]).view(num_ranks * rows, 8)
    out = weft.all_gather(x)
    assert out.shape == (num_ranks * rows, 8) and out.dtype == dtype
    into = torch.zeros(num_ranks, rows, 8, dtype=dtype, device="cuda")
    assert weft.all_gather(x, into) is into
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(into.view(torch.uint8).flatten(), expected.view(torch.uint8).flatten())


def test_all_gather_into_a_symmetric_output_with_sm_push(rank, num_ranks):
    x = _integers(4096, torch.bfloat16, rank, 4)
    out = weft.empty((num_ranks * 4096,), torch.bfloat16)
    try:
        out.fill_(float("nan"))
        weft.all_gather(x, out, algo="sm_push")
        expected = torch.empty_like(out)
        dist.all_gather_into_tensor(expected, x)
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
    finally:
        weft.free(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows_per_rank", [1, 100, 8192])
def test_reduce_scatter_matches_nccl(rank, num_ranks, dtype, rows_per_rank):
    x = _integers(num_ranks * rows_per_rank * 4, dtype, rank, 5).view(num_ranks * rows_per_rank, 4)
    expected = torch.empty((rows_per_rank, 4), dtype=dtype, device="cuda")
    dist.reduce_scatter_tensor(expected, x)
    out = weft.reduce_scatter(x)
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def test_collectives_follow_torchs_current_stream(rank):
    s = torch.cuda.Stream()
    x = _integers(1 << 16, torch.float32, rank, 6)
    expected = x.clone()
    dist.all_reduce(expected)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x * 1  # queued on s: the all-reduce must come after it on s
        weft.all_reduce(y)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert torch.equal(y, expected)


def test_bad_arguments_name_the_argument(num_ranks):
    x = torch.zeros(16, device="cuda")
    with pytest.raises(TypeError, match="tensor: expected dtype bfloat16 or float16 or float32, got int32"):
        weft.all_reduce(torch.zeros(16, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="tensor: expected a contiguous tensor"):
        weft.all_reduce(torch.zeros(16, 16, device="cuda").t())
    with pytest.raises(ValueError, match="out: expected 16 elements, got 8"):
        weft.all_reduce(x, torch.zeros(8, device="cuda"))
    with pytest.raises(TypeError, match="out: expected dtype torch.float32, got torch.bfloat16"):
        weft.all_reduce(x, torch.zeros(16, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="algo: 'fast' is not an algorithm of all_reduce"):
        weft.all_reduce(x, algo="fast")
    if num_ranks > 1:  # every length is a multiple of one rank
        with pytest.raises(ValueError, match=f"tensor: expected dim 0 a multiple of the {num_ranks} ranks"):
            weft.reduce_scatter(torch.zeros(num_ranks + 1, device="cuda"))
    # The checks are local and raise on every rank alike: the ranks stay in step.
    weft.world().barrier()


def test_weft_errors_from_the_op_keep_weft_message(num_ranks):
    # Python's checks pass (right device, dtype, count); the C++ op refuses a push into memory peers cannot reach.
    if num_ranks == 1:
        pytest.skip("a world of one rank has no peer to push into")
    x = torch.zeros(16, device="cuda")
    out = torch.zeros(num_ranks * 16, device="cuda")
    with pytest.raises(weft.Error, match="all_gather: algorithm sm_push writes into the peers. outputs"):
        weft.all_gather(x, out, algo="sm_push")  # sm_push needs a symmetric output
    weft.world().barrier()


def test_a_weft_write_bumps_the_version_so_a_saved_tensor_fails_in_backward(rank):
    # As torch's in-place ops: a tensor saved for backward and then overwritten by a weft op makes backward fail
    # ("modified by an inplace operation"), not compute wrong gradients.
    a = torch.ones(64, device="cuda", requires_grad=True)
    y = a * 2
    loss = (y * y).sum()  # saves y
    version = y._version
    weft.all_reduce(y.detach())  # the same storage and version counter as y
    assert y._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    out = torch.empty(64, device="cuda")
    version = out._version
    weft.all_reduce(torch.ones(64, device="cuda"), out)
    assert out._version > version


def _rows_of(rank, rows, cols, dtype, seed):
    """Rank `rank`'s input: computable on every rank (the all-to-all references need no collective of torch's)."""
    return _integers(rows * cols, dtype, rank, seed).view(rows, cols)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("rows_per_rank,symmetric", [(1, False), (37, False), (4096, True)])
def test_all_to_all_against_every_ranks_chunks(rank, num_ranks, dtype, rows_per_rank, symmetric):
    cols = 24
    x = _rows_of(rank, num_ranks * rows_per_rank, cols, dtype, 7)
    if symmetric:
        sym = weft.empty(tuple(x.shape), dtype if dtype != torch.int8 else torch.uint8)
        sym.view(dtype).copy_(x)
        x = sym.view(dtype)
    try:
        out = torch.full_like(x, 99)
        assert weft.all_to_all(x, out) is out
        torch.cuda.synchronize()
        mine = slice(rank * rows_per_rank, (rank + 1) * rows_per_rank)
        want = torch.cat([_rows_of(q, num_ranks * rows_per_rank, cols, dtype, 7)[mine] for q in range(num_ranks)])
        assert torch.equal(out, want)
    finally:
        if symmetric:
            weft.free(sym)


def _splits(q, num_ranks, seed):
    """Rank q's rows for each rank (0 included), computable on every rank."""
    g = torch.Generator()
    g.manual_seed(seed * 100 + q)
    return torch.randint(0, 9, (num_ranks,), generator=g).tolist()


def test_all_to_all_v_against_every_ranks_rows(rank, num_ranks):
    cols, dtype = 10, torch.bfloat16
    sends = [_splits(q, num_ranks, 8) for q in range(num_ranks)]
    inputs = [_rows_of(q, sum(sends[q]), cols, dtype, 9) for q in range(num_ranks)]
    recv = [sends[q][rank] for q in range(num_ranks)]
    out = weft.all_to_all_v(inputs[rank], sends[rank], recv)
    torch.cuda.synchronize()
    starts = [[sum(s[:r]) for r in range(num_ranks)] for s in sends]
    want = torch.cat([inputs[q][starts[q][rank]:starts[q][rank] + sends[q][rank]] for q in range(num_ranks)])
    assert out.shape == (sum(recv), cols) and torch.equal(out, want)


@pytest.mark.parametrize("rows,heads,dim", [(1, 2, 8), (13, 4, 64)])
def test_ulysses_reshards_between_sequence_and_heads(rank, num_ranks, rows, heads, dim):
    h = heads * num_ranks
    everyone = [_integers(rows * h * dim, torch.bfloat16, q, 10).view(rows, h, dim) for q in range(num_ranks)]
    out = weft.ulysses_seq_to_head(everyone[rank])
    torch.cuda.synchronize()
    mine = slice(rank * heads, (rank + 1) * heads)
    assert torch.equal(out, torch.cat([x[:, mine] for x in everyone]))
    back = torch.full_like(everyone[rank], float("nan"))
    weft.ulysses_head_to_seq(out, back)
    torch.cuda.synchronize()
    assert torch.equal(back, everyone[rank])
