# SPDX-License-Identifier: MIT
# Argument checks of the torch layer that need torch but no GPU (skipped where torch is absent): a stand-in World
# that fails the test if any op reaches it.
import pytest

torch = pytest.importorskip("torch")

import weft  # noqa: E402
from weft import _runtime, _weft  # noqa: E402


class _NoGpuWorld:
    rank, num_ranks, device, closed = 0, 2, 0, False

    def __getattr__(self, name):
        raise AssertionError(f"the argument check should have failed before World.{name}")


@pytest.fixture
def fake_world(monkeypatch):
    # A refused collective call is counted in its team's sequence (weft._ops._refused): recorded, not sent to a World.
    monkeypatch.setattr(_weft, "count_refused_collective_call", lambda *args: None)
    _runtime._state = _runtime._State(_NoGpuWorld(), None, None)
    yield
    _runtime._state = None


def test_a_non_tensor_is_a_type_error_naming_the_argument(fake_world):
    with pytest.raises(TypeError, match="tensor: expected a torch.Tensor, got list"):
        weft.all_reduce([1.0, 2.0])
    with pytest.raises(TypeError, match="b: expected a torch.Tensor, got int"):
        weft.gemm_rs(torch.zeros(4, 8), 3)


def test_a_cpu_tensor_is_a_value_error_naming_the_argument_and_the_device(fake_world):
    with pytest.raises(ValueError, match=r"tensor: expected a tensor on cuda:0 \(this rank's GPU\), got one on cpu"):
        weft.all_reduce(torch.zeros(16))
    with pytest.raises(ValueError, match="a: expected a tensor on cuda:0"):
        weft.gemm(torch.zeros(16, 16, dtype=torch.bfloat16), torch.zeros(16, 16, dtype=torch.bfloat16))
    import weft.torch as weft_torch  # its ops too: not torch's "could not run ... with arguments from the CPU backend"

    with pytest.raises(ValueError, match=r"tensor: expected a tensor on cuda:0 \(this rank's GPU\), got one on cpu"):
        weft_torch.all_reduce(torch.zeros(16))
    with pytest.raises(ValueError, match="a: expected a tensor on cuda:0"):
        weft_torch.gemm(torch.zeros(16, 16, dtype=torch.bfloat16), torch.zeros(16, 16, dtype=torch.bfloat16))


def test_shape_errors_name_the_argument(fake_world):
    with pytest.raises(ValueError, match=r"a_local: expected a 2-D tensor, got shape \(4,\)"):
        weft.ag_gemm(torch.zeros(4), torch.zeros(4, 4))
    with pytest.raises(ValueError, match="b: expected a 2-D tensor"):
        weft.gemm_ar(torch.zeros(4, 4), torch.zeros(4, 4, 4))


def test_bad_options_name_the_argument(fake_world):
    with pytest.raises(TypeError, match="dtype: weft does not take torch.float64"):
        weft.empty((4,), torch.float64)
    with pytest.raises(ValueError, match=r"shape: expected non-negative sizes, got \(4, -1\)"):
        weft.empty((4, -1))
    with pytest.raises(TypeError, match=r"shape: expected a sequence of integer sizes, got \(2.5, 8\)"):
        weft.empty((2.5, 8))  # as torch.empty: not truncated to 2
    with pytest.raises(TypeError, match=r"shape: expected a sequence of integer sizes, got '48'"):
        weft.empty("48")
    with pytest.raises(TypeError, match="team: expected a weft.Team or None, got str"):
        weft.all_reduce(torch.zeros(4), team="tp")
    with pytest.raises(TypeError, match="tensor: expected a torch.Tensor, got int"):
        weft.free(3)


def test_weft_torch_registers_custom_ops_with_fake_implementations(fake_world):
    import weft.torch  # noqa: F401  (registers torch.ops.weft.*)
    # Meta tensors run the fake implementations (what torch.compile traces with).
    x = torch.empty(8, 16, dtype=torch.bfloat16, device="meta")
    w = torch.empty(32, 16, dtype=torch.bfloat16, device="meta")
    assert torch.ops.weft.all_reduce(x).shape == (8, 16)
    assert torch.ops.weft.all_gather(x, -1, 2).shape == (16, 16)
    assert torch.ops.weft.reduce_scatter(x, -1, 2).shape == (4, 16)
    assert torch.ops.weft.ag_gemm(x, w, 2).shape == (16, 32)
    assert torch.ops.weft.gemm_rs(x, w, -1, 2).shape == (4, 32)
    assert torch.ops.weft.gemm_ar(x, w).shape == (8, 32)
    # The Python functions pass the World's count (2 in the stand-in World).
    assert weft.torch.all_gather(x).shape == (16, 16)
    assert weft.torch.reduce_scatter(x).shape == (4, 16)
    assert weft.torch.ag_gemm(x, w).shape == (16, 32)
    assert weft.torch.gemm_rs(x, w).shape == (4, 32)
    assert torch.ops.weft.gemm(x, w).shape == (8, 32)
    assert torch.ops.weft.all_to_all(x, -1, 2).shape == (8, 16)
    assert torch.ops.weft.all_to_all_v(x, [3, 5], [6, 1], -1).shape == (7, 16)
    assert torch.ops.weft.ulysses(x.view(8, 2, 8), True, -1, 2).shape == (16, 1, 8)
    assert torch.ops.weft.ulysses(x.view(8, 2, 8), False, -1, 2).shape == (4, 4, 8)
    assert weft.torch.ulysses_seq_to_head(x.view(4, 4, 8)).shape == (8, 2, 8)


def _meta(*shape, grad=True):
    return torch.empty(*shape, dtype=torch.bfloat16, device="meta", requires_grad=grad)


def test_autograd_formulas_give_gradients_of_the_inputs_shapes(fake_world):
    import weft.torch  # noqa: F401
    # 2 ranks (the stand-in World): ag_gemm [8, 16] x [32, 16] -> [16, 32]; gemm_rs [16, 32] x [24, 32] -> [8, 24].
    cases = [
        (weft.torch.ag_gemm, (_meta(8, 16), _meta(32, 16)), (16, 32)),
        (weft.torch.gemm_rs, (_meta(16, 32), _meta(24, 32)), (8, 24)),
        (weft.torch.gemm_ar, (_meta(4, 32), _meta(24, 32)), (4, 24)),
        (weft.torch.gemm, (_meta(4, 32), _meta(24, 32)), (4, 24)),
        (weft.torch.all_reduce, (_meta(6, 8),), (6, 8)),
        (weft.torch.all_gather, (_meta(6, 8),), (12, 8)),
        (weft.torch.reduce_scatter, (_meta(6, 8),), (3, 8)),
        (weft.torch.all_to_all, (_meta(6, 8),), (6, 8)),
        (lambda x: weft.torch.all_to_all_v(x, [2, 3], [4, 1]), (_meta(5, 8),), (5, 8)),
        (lambda x: weft.torch.all_to_all_v(x, [2, 3], [1, 1]), (_meta(5, 8),), (2, 8)),
        (weft.torch.ulysses_seq_to_head, (_meta(3, 4, 8),), (6, 2, 8)),
        (weft.torch.ulysses_head_to_seq, (_meta(6, 2, 8),), (3, 4, 8)),
    ]
    for op, inputs, out_shape in cases:
        out = op(*inputs)
        assert tuple(out.shape) == out_shape, op
        out.sum().backward()
        for x in inputs:
            assert x.grad is not None and x.grad.shape == x.shape, op


def test_tensor_parallel_mlp_traces_forward_and_backward(fake_world):
    import weft.nn
    from torch.fx.experimental.proxy_tensor import make_fx

    mlp = weft.nn.TensorParallelMLP(16, 64, device="meta")
    assert mlp.w1.shape == (32, 16) and mlp.w2.shape == (16, 32)  # this rank's shards of 2
    x = _meta(8, 16)
    y = mlp(x)
    assert y.shape == (8, 16)
    y.sum().backward()
    assert x.grad.shape == x.shape and mlp.w1.grad.shape == mlp.w1.shape and mlp.w2.grad.shape == mlp.w2.shape

    params = {name: p.detach() for name, p in mlp.named_parameters()}
    graph = make_fx(lambda p, t: torch.func.functional_call(mlp, p, (t,)), tracing_mode="fake")(
        params, _meta(8, 16, grad=False))
    ops = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert {"weft.ag_gemm.default", "weft.gemm_rs.default"} <= ops, ops
    with pytest.raises(ValueError, match="ffn_hidden: expected a multiple of the 2 ranks, got 63"):
        weft.nn.TensorParallelMLP(16, 63, device="meta")


def test_torch_compile_fullgraph_traces_the_custom_ops_and_their_backward(fake_world):
    import weft.nn

    torch._dynamo.reset()
    mlp = weft.nn.TensorParallelMLP(16, 64, device="meta")
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")  # no GPU here: eager kernels on meta tensors
    x = _meta(8, 16)
    y = compiled(x)
    assert y.shape == (8, 16)
    y.sum().backward()
    assert x.grad.shape == x.shape and mlp.w1.grad.shape == mlp.w1.shape


def test_team_custom_ops_and_their_backward_on_a_team_of_four(fake_world):
    import weft.torch  # noqa: F401

    class _FakeTeam:  # what team_by_handle returns; only its size is read while tracing
        num_ranks = 4

    _runtime._state.teams.append(_FakeTeam())
    a_local, b = _meta(8, 16), _meta(32, 16)
    out, gathered = torch.ops.weft.ag_gemm_saving(a_local, b, 0, 4)
    assert out.shape == (32, 32) and gathered.shape == (32, 16)
    out.sum().backward()
    assert a_local.grad.shape == a_local.shape and b.grad.shape == b.shape

    h, w = _meta(32, 32), _meta(24, 32)
    y = torch.ops.weft.gemm_rs(h, w, 0, 4)
    assert y.shape == (8, 24)
    y.sum().backward()
    assert h.grad.shape == h.shape and w.grad.shape == w.shape
    assert torch.ops.weft.gemm_ar(_meta(4, 32), w, 0).shape == (4, 24)
    with pytest.raises(TypeError, match="team: expected a weft.Team or None, got int"):
        weft.torch.gemm_rs(h, w, team=3)


def test_shapes_follow_the_count_argument_and_graphs_carry_it(fake_world):
    # A compiled graph's shapes must not depend on state outside its code: torch.compile's caches on disk key on the
    # graph, and a job with another number of ranks on the same host must not get this one's shapes.
    import weft.torch  # noqa: F401
    from torch.fx.experimental.proxy_tensor import make_fx

    x, w = _meta(6, 8, grad=False), _meta(24, 8, grad=False)
    assert torch.ops.weft.ag_gemm(x, w, 3).shape == (18, 24)  # 3 ranks, whatever the World says (2)
    assert torch.ops.weft.all_gather(x, -1, 3).shape == (18, 8)
    assert torch.ops.weft.reduce_scatter(x, -1, 3).shape == (2, 8)
    assert torch.ops.weft.gemm_rs(x, w, -1, 3).shape == (2, 24)
    with pytest.raises(RuntimeError, match="num_ranks: expected at least 1, got 0"):
        torch.ops.weft.all_gather(x, -1, 0)

    graph = make_fx(lambda a, b: weft.torch.gemm_rs(weft.torch.ag_gemm(a, b), b.t().contiguous()),
                    tracing_mode="fake")(x, w)
    calls = {str(n.target): n.args for n in graph.graph.nodes if n.op == "call_function"}
    assert calls["weft.ag_gemm.default"][2] == 2, calls
    assert tuple(calls["weft.gemm_rs.default"][2:]) == (-1, 2), calls


def test_a_count_that_is_not_the_teams_is_a_value_error(fake_world):
    import weft.torch

    with pytest.raises(ValueError, match=r"num_ranks: expected 2 \(the ranks of the World\), got 3"):
        weft.torch._check_ranks(-1, 3, "ag_gemm")
    with pytest.raises(ValueError, match=r"num_ranks: expected 2 \(the ranks of the World\), got 4"):
        torch.ops.weft.all_to_all(torch.zeros(8, 2), -1, 4)  # the eager op (a CPU tensor: refused at the count first)
    with pytest.raises(TypeError, match="team: expected a weft.Team, a team handle or None, got str"):
        weft.torch.all_gather(_meta(4, 4), team="tp")


def test_init_takes_a_device_as_an_index_a_string_or_a_torch_device():
    assert _runtime._device_index(None) is None
    assert _runtime._device_index(3) == 3
    assert _runtime._device_index("cuda:2") == 2
    assert _runtime._device_index(torch.device("cuda", 1)) == 1
    with pytest.raises(ValueError, match="device: expected a CUDA device, got 'cpu'"):
        _runtime._device_index("cpu")
    with pytest.raises(ValueError, match="device: expected a CUDA device index >= 0, got -1"):
        _runtime._device_index(-1)
    with pytest.raises(TypeError, match=r"device: expected a CUDA device index \(int\), 'cuda:N' or a torch.device, "
                                        "got float"):
        weft.init(device=1.5)
    with pytest.raises(TypeError, match="got bool"):
        _runtime._device_index(True)


class _Dist:
    """torch.distributed as weft.init reads it: 4 ranks, this one rank 0; `group` is a list of ranks."""

    class GroupMember:
        NON_GROUP_MEMBER = object()

    def get_world_size(self):
        return 4

    def get_rank(self, group=None):
        return -1 if group is not None and 0 not in group else 0

    def get_process_group_ranks(self, group):
        return list(group)


def test_init_again_with_the_default_group_over_a_subgroups_world_is_a_value_error(fake_world, monkeypatch):
    dist = _Dist()
    monkeypatch.setattr(_runtime, "_torch_distributed", lambda: dist)
    _runtime._state.group_ranks = [0, 1]  # the World of weft.init(group=<ranks 0 and 1>)
    assert weft.init(group=[0, 1]) is _runtime._state.world
    with pytest.raises(ValueError, match=r"over torch ranks \[0, 1\]; the default group \(group=None\) has ranks "
                                         r"\[0, 1, 2, 3\]: call weft.finalize\(\) first"):
        weft.init()
    with pytest.raises(ValueError, match=r"over torch ranks \[0, 1\]; group has ranks \[0, 2\]"):
        weft.init(group=[0, 2])


def test_init_outside_the_group_returns_none_without_a_world(monkeypatch):
    dist = _Dist()
    monkeypatch.setattr(_runtime, "_torch_distributed", lambda: dist)
    assert _runtime._state is None
    assert weft.init(group=dist.GroupMember.NON_GROUP_MEMBER) is None
    assert weft.init(group=[1, 2]) is None  # torch says this rank is not in it
    assert _runtime._state is None
