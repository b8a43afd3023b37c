# SPDX-License-Identifier: MIT
# weft's Store adapter over a Python store (torch.distributed.Store's methods), driven through weft's C++ Store
# interface: the same calls a World makes on torch's store.
import threading

import pytest

import weft
from weft import _weft
from dict_store import DictStore


def test_set_get_add_check_erase_go_through_the_python_store():
    py = DictStore()
    store = _weft.StoreAdapter(py)
    store.set("a/b", b"\x00bytes\xff")
    assert store.get("a/b", 1000) == b"\x00bytes\xff"
    assert ("wait", ("a/b",)) in py.calls  # get = wait([key], timeout) then get(key)
    assert store.add("n", 5) == 5 and store.add("n", -2) == 3
    assert store.check("a/b") and not store.check("missing")
    store.erase("a/b")
    store.erase("a/b")  # erasing a missing key is no error
    assert not store.check("a/b")


def test_get_timeout_is_a_weft_error_naming_the_key_and_the_python_exception():
    store = _weft.StoreAdapter(DictStore())
    with pytest.raises(weft.Error, match=r"store.get\('never'\) raised: .*TimeoutError.*never"):
        store.get("never", 50)


def test_a_python_exception_in_any_method_becomes_a_weft_error():
    class Broken(DictStore):
        def add(self, key, delta):
            raise ConnectionError("store server went away")

    store = _weft.StoreAdapter(Broken())
    with pytest.raises(weft.Error, match=r"store.add\('k'\) raised: .*store server went away"):
        store.add("k", 1)


def test_an_object_without_the_store_methods_is_refused():
    with pytest.raises(weft.Error, match="it has no 'wait'"):
        _weft.StoreAdapter(object.__new__(type("NoWait", (), {"set": 1, "get": 1})))
    with pytest.raises(weft.Error, match="expected a store object, got None"):
        _weft.StoreAdapter(None)


def test_prefix_keeps_keys_apart():
    py = DictStore()
    a = _weft.StoreAdapter(py, prefix="weft/0")
    b = _weft.StoreAdapter(py, prefix="weft/1")
    a.set("k", b"a")
    b.set("k", b"b")
    assert a.get("k", 1000) == b"a" and b.get("k", 1000) == b"b"
    assert py.keys() == ["weft/0/k", "weft/1/k"]


def _run_ranks(n, fn):
    results, errors = [None] * n, []

    def body(rank):
        try:
            results[rank] = fn(rank)
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append((rank, e))

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank thread hung (the GIL not released in a blocking call?)"
    assert not errors, errors
    return results


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_barrier_and_all_gather_across_threads_leave_no_keys(num_ranks):
    # Each rank blocks in C++ (GIL released) while the others must run Python to set their keys.
    py = DictStore()
    store = _weft.StoreAdapter(py, prefix="job")

    def rank_fn(rank):
        for i in range(3):
            store.barrier(f"b{i}", rank, num_ranks, 10000)
        return store.all_gather("g", rank, num_ranks, f"rank{rank}".encode() * (rank + 1), 10000)

    results = _run_ranks(num_ranks, rank_fn)
    expected = [f"rank{r}".encode() * (r + 1) for r in range(num_ranks)]
    assert all(r == expected for r in results)
    assert py.keys() == [], "barrier and all_gather must remove their keys"


def test_barrier_timeout_names_the_missing_rank():
    store = _weft.StoreAdapter(DictStore())

    def rank_fn(rank):
        if rank == 0:
            with pytest.raises(weft.Error, match=r"(?s)barrier 'lonely' failed on rank 0 .*1 did not arrive"):
                store.barrier("lonely", 0, 2, 300)
        return rank

    _run_ranks(1, rank_fn)
