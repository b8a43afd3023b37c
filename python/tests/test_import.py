# SPDX-License-Identifier: MIT
# Importing weft needs neither torch nor a GPU; weft.Error is a RuntimeError carrying weft's message.
import subprocess
import sys

import pytest

import weft
from weft import _weft


def test_import_without_torch_leaves_torch_unimported():
    code = "import sys, weft; assert 'torch' not in sys.modules, 'importing weft imported torch'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_version_and_dtypes():
    assert weft.__version__.count(".") == 2
    assert _weft.DTYPES == {"bf16": 0, "f16": 1, "f32": 2, "f8e4m3": 3, "i32": 4, "i64": 5, "u8": 6}
    assert [_weft.dtype_bytes(c) for c in range(7)] == [2, 2, 4, 1, 4, 8, 1]


def test_package_carries_headers_and_kernels_for_the_jit():
    import os
    home = os.environ.get("WEFT_HOME")
    assert home, "weft's package should point WEFT_HOME at itself when the user did not"
    assert os.path.isfile(os.path.join(home, "include", "weft", "device", "token.cuh"))
    assert os.path.isdir(os.path.join(home, "kernels")) or os.path.isdir(os.path.join(home, "share", "weft", "kernels"))


def test_error_is_a_runtime_error_with_weft_message():
    assert issubclass(weft.Error, RuntimeError)
    with pytest.raises(weft.Error, match=r"dtype: expected a weft dtype code in \[0, 6\], got 9"):
        _weft.dtype_bytes(9)


def test_tensor_view_checks_name_the_argument():
    v = weft.TensorView(4096, 0, (8, 16))
    assert v.shape == [8, 16] and v.strides == [16, 1] and v.numel() == 128 and v.is_contiguous()
    assert "bf16[8, 16]" in repr(v)
    with pytest.raises(weft.Error, match="shape: expected 1 to 4 dimensions, got 5"):
        weft.TensorView(0, 0, (1, 1, 1, 1, 1))
    with pytest.raises(weft.Error, match="strides: expected 2 strides"):
        weft.TensorView(0, 0, (2, 2), (1,))
    with pytest.raises(weft.Error, match="shape: dimension 1 is negative"):
        weft.TensorView(0, 0, (2, -2))


def test_op_shape_errors_become_weft_errors_naming_the_field():
    with pytest.raises(weft.Error, match="ag_gemm: shape.max_m must be"):
        _weft.validate_ag_gemm_shape(max_m=7, n=128, k=128, dtype=0, num_ranks=2)
    with pytest.raises(weft.Error, match=r"gemm_rs: shape.k \(this rank's K\) must be a positive multiple of 8, "
                                         r"got 12"):
        _weft.validate_gemm_rs_shape(max_m=128, n=128, k=12, dtype=0, num_ranks=2)
    with pytest.raises(weft.Error, match="gemm_ar: shape.dtype must be bf16 or f16, got f32"):
        _weft.validate_gemm_ar_shape(max_m=16, n=128, k=128, dtype=2, num_ranks=2)
    _weft.validate_ag_gemm_shape(max_m=256, n=128, k=128, dtype=0, num_ranks=2)  # a good shape passes


def test_the_grouped_gemm_bindings_check_their_arrays_before_the_op():
    # TensorViews over an address never read: each refusal comes before the op (and before any GPU is touched).
    def view(shape, dtype="bf16", strides=None):
        return weft.TensorView(4096, _weft.DTYPES[dtype], shape, strides)

    a, b, d, a3, d3 = view((64, 128)), view((3, 256, 128)), view((64, 256)), view((3, 8, 128)), view((3, 8, 256))
    i32 = view((3,), "i32")
    with pytest.raises(weft.Error, match=r"b_layout: expected 0 \(nk\) or 1 \(kn\), got 2"):
        _weft.grouped_gemm_contiguous(a, b, d, 2, i32, i32, 0, 0)
    with pytest.raises(weft.Error, match=r"offsets: expected a contiguous 1-D int32 tensor \(one value per group\), "
                                         r"got i64\[3\]"):
        _weft.grouped_gemm_contiguous(a, b, d, 0, view((3,), "i64"), i32, 0, 0)
    with pytest.raises(weft.Error, match="offsets: expected a contiguous 1-D int32 tensor"):
        _weft.grouped_gemm_contiguous(a, b, d, 0, view((3,), "i32", (2,)), i32, 0, 0)
    with pytest.raises(weft.Error, match=r"counts: expected 3 values \(one per group: b's first extent\), got "
                                         r"i32\[4\]"):
        _weft.grouped_gemm_masked(a3, b, d3, 1, view((4,), "i32"), 0, 0)
    with pytest.raises(weft.Error, match=r"status: expected a contiguous int32 tensor of 4 elements "
                                         r"\(weft.grouped_status\(\)\), got i32\[3\]"):
        _weft.grouped_gemm_masked(a3, b, d3, 0, i32, 0, 0, status=i32)
    with pytest.raises(weft.Error, match="counts: expected a contiguous 1-D int32 tensor"):
        _weft.grouped_gemm_masked_fp8(view((3, 8, 128), "f8e4m3"), view((3, 8, 1), "f32"), b, d3, 0,
                                      view((3, 1), "i32"), a3, 0, 0)
    assert _weft.describe_grouped_status(0, 0, 0, 0) == ""
    assert _weft.describe_grouped_status(2, 1, 300, 128) == (
        "grouped_gemm: group 1 has 300 rows, over the capacity 128 (clamped to the capacity)")


def test_the_moe_routing_bindings_check_their_arrays_before_the_op():
    def view(shape, dtype="i32", strides=None):
        return weft.TensorView(4096, _weft.DTYPES[dtype], shape, strides)

    idx, counts, offsets, gather, slots = view((3, 2)), view((4,)), view((5,)), view((12,)), view((6,))
    with pytest.raises(weft.Error, match=r"routing.offsets: expected a contiguous int32 tensor of 5 elements, got "
                                         r"i32\[4\]"):
        _weft.moe_route(idx, counts, view((4,)), gather, slots, 1, None, 0, 0)
    with pytest.raises(weft.Error, match=r"routing.slot_rows: expected a contiguous int32 tensor of 6 elements"):
        _weft.moe_route(idx, counts, offsets, gather, view((6,), "i64"), 1, None, 0, 0)
    with pytest.raises(weft.Error, match=r"routing.gather_index: expected a contiguous int32 tensor of 12 elements"):
        _weft.moe_route(idx, counts, offsets, view((12,), "i32", (2,)), slots, 1, None, 0, 0)
    with pytest.raises(weft.Error, match=r"topk_idx: expected a 2-D tensor \[tokens, topk\]"):
        _weft.moe_route(view((6,)), counts, offsets, gather, slots, 1, None, 0, 0)
    with pytest.raises(weft.Error, match=r"status: expected a contiguous int32 tensor of 4 elements "
                                         r"\(weft.moe_routing_status\(\)\)"):
        _weft.moe_route(idx, counts, offsets, gather, slots, 1, view((3,)), 0, 0)
    # decode attention's status too (the Python wrapper checks it first; the binding does not take it unchecked).
    q, cache, table, lens = view((2, 4, 64), "bf16"), view((8, 16, 1, 64), "bf16"), view((2, 4)), view((2,))
    with pytest.raises(weft.Error, match=r"status: expected a contiguous int32 tensor of 4 elements "
                                         r"\(weft.attention_status\(\)\), got i64\[4\]"):
        _weft.decode_attention(q, cache, cache, table, lens, 64, q, None, 0, 0, None, 0, None, view((4,), "i64"))
    assert _weft.describe_moe_routing_status(0, 0, 0, 0) == ""
    assert "expert index 9, outside [-1, 4)" in _weft.describe_moe_routing_status(1, 5, 9, 4)
    with pytest.raises(weft.Error, match="shape.max_tokens must be a positive multiple of the team's num_ranks 2"):
        _weft.validate_moe_tp_shape(63, 64, 64, 8, 2, 2)
    _weft.validate_moe_tp_shape(64, 64, 64, 8, 2, 2)  # a good shape passes

def test_algorithm_names():
    assert _weft.parse_algo("all_reduce", "one_shot") == 2
    assert _weft.parse_algo("all_gather", "ce_pull") == 3
    assert _weft.parse_algo("reduce_scatter", "ll") == 2
    with pytest.raises(weft.Error, match="algo: 'nope' is not an algorithm of all_reduce"):
        _weft.parse_algo("all_reduce", "nope")


def test_using_weft_before_init_says_so():
    if weft.is_initialized():
        # The GPU tests, collected first when the whole folder runs under torchrun, keep their World until exit.
        pytest.skip("a World made by an earlier test of this process is still live")
    with pytest.raises(weft.Error, match=r"weft is not initialised: call weft.init\(\) first"):
        weft.world()
    weft.finalize()  # a no-op without a World


def test_a_world_on_a_machine_without_a_gpu_is_a_weft_error():
    if _weft.cuda_available():
        pytest.skip("this machine has a GPU")
    from dict_store import DictStore
    adapter = _weft.StoreAdapter(DictStore())
    with pytest.raises(weft.Error):
        _weft.World.from_store(adapter, rank=0, num_ranks=1, timeout_ms=5000)


def test_a_negative_dead_peer_bound_is_refused_before_anything_starts():
    from dict_store import DictStore
    adapter = _weft.StoreAdapter(DictStore())
    with pytest.raises(weft.Error, match=r"dead_peer_ms must be >= 0 .* got -1"):
        _weft.World.from_store(adapter, rank=0, num_ranks=1, timeout_ms=5000, dead_peer_ms=-1)


@pytest.mark.parametrize("env", [None, "2500"])
def test_a_world_on_torchs_store_waits_longer_for_a_silent_peer(monkeypatch, env):
    # The watchdog's heartbeats on torch's store need the GIL: weft.init asks from_store for a 60 s dead-peer bound
    # there, unless WEFT_DEAD_PEER_MS is set (then 0: the variable decides). torch.distributed and the extension's
    # World are stand-ins here: what is checked is what init passes.
    import types
    from weft import _runtime
    from dict_store import DictStore
    if weft.is_initialized():
        pytest.skip("a World made by an earlier test of this process is still live")
    if env is None:
        monkeypatch.delenv("WEFT_DEAD_PEER_MS", raising=False)
    else:
        monkeypatch.setenv("WEFT_DEAD_PEER_MS", env)
    seen = {}

    class FakeWorld:
        device = 0
        num_ranks = 1

        @staticmethod
        def from_store(adapter, **kwargs):
            seen.update(kwargs)
            return FakeWorld()

    fake_dist = types.SimpleNamespace(
        get_world_size=lambda: 1, get_rank=lambda: 0,
        distributed_c10d=types.SimpleNamespace(_get_default_store=lambda: DictStore()))
    monkeypatch.setattr(_runtime, "_torch_distributed", lambda: fake_dist)
    monkeypatch.setattr(_runtime, "_weft", types.SimpleNamespace(StoreAdapter=lambda store: store, World=FakeWorld))
    monkeypatch.setattr(_runtime, "_state", None)
    monkeypatch.setattr(_runtime, "_init_count", {})
    assert isinstance(_runtime.init(device=0), FakeWorld)
    assert seen["dead_peer_ms"] == (60000 if env is None else 0)


def test_finalize_closes_the_newest_first_then_the_world():
    from weft import _runtime

    order = []

    class Closable:
        num_ranks = 1

        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def close(self):
            order.append(self.name)
            if self.fail:
                raise weft.Error(f"{self.name} refused")

    _runtime._state = _runtime._State(Closable("world"), None, None)
    _runtime._state.objects += [Closable("buffer"), Closable("handle")]
    weft.finalize()
    assert order == ["handle", "buffer", "world"] and not weft.is_initialized()

    # One refusal does not keep the others open, nor the World (left open, its peers would wait for it at its shutdown
    # barrier); the first error is raised after the World's close.
    order.clear()
    _runtime._state = _runtime._State(Closable("world"), None, None)
    _runtime._state.objects += [Closable("a"), Closable("b", fail=True), Closable("c")]
    with pytest.raises(weft.Error, match="b refused"):
        weft.finalize()
    assert order == ["c", "b", "a", "world"] and not weft.is_initialized()


def test_exit_after_an_uncaught_exception_aborts_the_world_before_closing(monkeypatch):
    from weft import _runtime

    order = []

    class FakeWorld:
        num_ranks = 2
        closed = False

        def abort(self, reason):
            order.append("abort: " + reason)

        def close(self):
            order.append("world")

    class Closable:
        def close(self):
            order.append("op")

    # An exception handled earlier (an interactive session's, pytest's) is no reason to abort at exit.
    monkeypatch.setattr(sys, "last_exc", ValueError("handled earlier"), raising=False)
    monkeypatch.setattr(_runtime, "_exiting", False)
    _runtime._state = _runtime._State(FakeWorld(), None, None)
    _runtime._finalize_at_exit()
    assert order == ["world"]

    order.clear()
    # One that ends the program reaches sys.excepthook, which weft chains.
    monkeypatch.setattr(_runtime, "_previous_excepthook", lambda *args: None)
    monkeypatch.setattr(_runtime, "_uncaught", None)  # restored after the test
    error = ValueError("bad shape on this rank")
    _runtime._excepthook(ValueError, error, None)
    assert _runtime._uncaught is error
    # An ordinary finalize (not at exit) does not abort.
    monkeypatch.setattr(_runtime, "_exiting", False)
    _runtime._state = _runtime._State(FakeWorld(), None, None)
    weft.finalize()
    assert order == ["world"]

    order.clear()
    _runtime._state = _runtime._State(FakeWorld(), None, None)
    _runtime._state.objects.append(Closable())
    monkeypatch.setattr(_runtime, "_exiting", False)
    _runtime._finalize_at_exit()
    assert order == ["abort: it is exiting on an uncaught exception: ValueError: bad shape on this rank", "op", "world"]
    assert not weft.is_initialized()
