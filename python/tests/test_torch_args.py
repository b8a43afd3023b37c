# SPDX-License-Identifier: MIT
# Argument checks of the torch layer that need torch but no GPU (skipped where torch is absent): a stand-in World
# that fails the test if any op reaches it.
import pytest

torch = pytest.importorskip("torch")

import weft  # noqa: E402
from weft import _runtime  # noqa: E402


class _NoGpuWorld:
    rank, num_ranks, device = 0, 2, 0

    def __getattr__(self, name):
        raise AssertionError(f"the argument check should have failed before World.{name}")


@pytest.fixture
def fake_world():
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
    assert torch.ops.weft.all_gather(x).shape == (16, 16)
    assert torch.ops.weft.reduce_scatter(x).shape == (4, 16)
    assert torch.ops.weft.ag_gemm(x, w).shape == (16, 32)
    assert torch.ops.weft.gemm_rs(x, w).shape == (4, 32)
    assert torch.ops.weft.gemm_ar(x, w).shape == (8, 32)
    assert torch.ops.weft.gemm(x, w).shape == (8, 32)
