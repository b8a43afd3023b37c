# SPDX-License-Identifier: MIT
# The attention wrappers' argument checks without a GPU (skipped where torch is absent): what they refuse before the
# extension is called, each error naming the argument.
import pytest

torch = pytest.importorskip("torch")

import weft  # noqa: E402
from weft import _weft  # noqa: E402


@pytest.fixture
def calls(monkeypatch):
    made = []
    for name in ("flash_attention", "decode_attention"):
        monkeypatch.setattr(_weft, name, lambda *args, _name=name: made.append((_name, args)))
    return made


def test_flash_attention_refuses_bad_arguments_before_the_extension(calls):
    q = torch.zeros((8, 4, 64), dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="q: expected a torch.Tensor, got list"):
        weft.flash_attention([1.0], q, q)
    with pytest.raises(ValueError, match=r"q: expected a 3-D tensor, got shape \(8, 256\)"):
        weft.flash_attention(q.reshape(8, 256), q, q)
    with pytest.raises(ValueError, match="q: expected a CUDA tensor, got one on cpu"):
        weft.flash_attention(q, q, q)
    with pytest.raises(ValueError, match="q: expected a CUDA tensor, got one on meta"):
        weft.flash_attention(q.to("meta"), q, q)
    assert calls == []


def test_decode_attention_refuses_bad_arguments_before_the_extension(calls):
    q = torch.zeros((2, 4, 64), dtype=torch.float32)
    cache = torch.zeros((4, 16, 1, 64), dtype=torch.float32)
    table = torch.zeros((2, 2), dtype=torch.int32)
    lens = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q: expected a 3-D tensor, got shape \(4, 16, 1, 64\)"):
        weft.decode_attention(cache, cache, cache, table, lens)
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):
        weft.decode_attention(q, cache, cache, table, lens)
    assert calls == []


def test_scalar_arguments_are_refused_naming_them_before_the_extension(calls):
    q = torch.zeros((2, 4, 64), dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="scale: expected a number or None, got str"):
        weft.flash_attention(q, q, q, scale="0.1")
    with pytest.raises(TypeError, match="q_position: expected an integer, got float"):
        weft.flash_attention(q, q, q, q_position=1.5)
    with pytest.raises(TypeError, match="num_splits: expected an integer, got str"):
        weft.decode_attention(q, q, q, q, q, num_splits="4")
    with pytest.raises(TypeError, match="scale: expected a number or None, got list"):
        weft.decode_attention(q, q, q, q, q, scale=[1.0])
    with pytest.raises(ValueError,
                       match=r"num_splits: expected an integer in \[-2147483648, 2147483647\], got 4294967296"):
        weft.decode_attention(q, q, q, q, q, num_splits=1 << 32)
    with pytest.raises(ValueError, match="scale: .* is out of a float's range"):
        weft.flash_attention(q, q, q, scale=10 ** 400)
    assert calls == []


def test_sp_decode_attention_needs_a_world(calls):
    if weft.is_initialized():
        pytest.skip("a World made by an earlier test of this process is still live")
    q = torch.zeros((2, 4, 64), dtype=torch.bfloat16)
    with pytest.raises(weft.Error, match=r"weft is not initialised: call weft.init\(\) first"):
        weft.sp_decode_attention(q, q, q, q, q)
    assert calls == []


def test_the_attention_ops_are_exported():
    for name in ("flash_attention", "decode_attention", "decode_attention_workspace_bytes", "sp_decode_attention",
                 "attention_status", "check_attention_status"):
        assert name in weft.__all__ and callable(getattr(weft, name))


def test_check_attention_status_names_the_entry_and_passes_a_zero_record():
    weft.check_attention_status(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(weft.Error, match=r"block_table\[2\]\[7\] = -1 is outside the cache's pages"):
        weft.check_attention_status(torch.tensor([1, 2, 7, -1], dtype=torch.int32))
    with pytest.raises(TypeError, match="status: expected the int32 tensor of 4 elements"):
        weft.check_attention_status(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="device: expected a CUDA device"):
        weft.attention_status("cpu")
