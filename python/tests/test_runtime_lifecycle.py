# SPDX-License-Identifier: MIT
# weft.init's device default, a second weft.init, a World closed by its own close(), and a process forked after
# weft.init, without a GPU: the extension's World is a stand-in that records what init passes and what is closed.
import os
import subprocess
import sys
import textwrap
import types

import pytest

import weft
from weft import _runtime


class _World:
    """A World as weft.init gets it from World.from_env: the settings resolved as the C++ World resolves them (a heap
    rounded up to 2 MiB, weft's defaults for 0)."""
    made = []  # the from_env calls' keyword arguments

    def __init__(self, device, heap_bytes, sm_budget, timeout_ms):
        self.rank, self.num_ranks, self.closed = 0, 1, False
        self.aborts = []  # the reasons abort() was given
        self.device = max(device, 0)
        granule = 2 << 20
        self.heap_bytes = -(-(heap_bytes or 1 << 30) // granule) * granule
        self.sm_budget = sm_budget or 132
        self.timeout_ms = timeout_ms or 600000

    @classmethod
    def from_env(cls, **kwargs):
        cls.made.append(kwargs)
        return cls(**kwargs)

    def close(self):
        self.closed = True

    def abort(self, reason):
        self.aborts.append(reason)

    @property
    def aborted(self):
        return bool(self.aborts)


@pytest.fixture
def stand_in(monkeypatch):
    """weft.init without torch.distributed, on stand-in Worlds; no World before or after the test."""
    if weft.is_initialized():
        pytest.skip("a World made by an earlier test of this process is still live")
    monkeypatch.setattr(_runtime, "_torch_distributed", lambda: None)
    monkeypatch.setattr(_runtime, "_weft", types.SimpleNamespace(World=_World))
    monkeypatch.setattr(_World, "made", [])
    yield _World.made
    _runtime._state = None


# ---- device ----

def test_device_cuda_without_an_index_is_the_default_not_device_0(stand_in, monkeypatch):
    # Without torch imported: "cuda" is the default, "cuda:N" is N.
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert _runtime._device_index("cuda") is None
    assert _runtime._device_index("cuda:1") == 1
    with pytest.raises(ValueError, match=r"device: expected 'cuda' or 'cuda:N', got 'cpu'"):
        _runtime._device_index("cpu")
    with pytest.raises(ValueError, match=r"device: expected 'cuda' or 'cuda:N', got 'cuda:x'"):
        _runtime._device_index("cuda:x")
    # The default: -1 (the World takes LOCAL_RANK's GPU) while torch has not initialised CUDA.
    assert _runtime._default_device() == -1
    weft.init(device="cuda")
    assert stand_in[-1]["device"] == -1


def test_torch_device_cuda_without_an_index_is_the_default(stand_in, monkeypatch):
    torch = pytest.importorskip("torch")
    assert _runtime._device_index(torch.device("cuda")) is None
    assert _runtime._device_index("cuda") is None
    assert _runtime._device_index(torch.device("cuda", 2)) == 2
    # torch's current device once torch has initialised CUDA (here a stand-in: device 3), else -1 (LOCAL_RANK's),
    # never the device 0 that current_device() reports before set_device.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    weft.init(device=torch.device("cuda"))
    assert stand_in[-1]["device"] == -1
    weft.finalize()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    weft.init(device="cuda")
    assert stand_in[-1]["device"] == 3
    weft.finalize()
    weft.init(device="cuda:1")
    assert stand_in[-1]["device"] == 1


# ---- a second weft.init ----

def test_a_second_init_with_other_settings_is_a_value_error_naming_both(stand_in):
    world = weft.init(heap_bytes=10**9, timeout_ms=5000)
    assert world.heap_bytes == 1000341504  # rounded up to the heap's granularity
    # The same World for the settings it was given, for the World's own, and for those not given (0).
    assert weft.init() is world
    assert weft.init(heap_bytes=10**9, timeout_ms=5000) is world
    assert weft.init(heap_bytes=1000341504, sm_budget=132) is world  # sm_budget: the default the World resolved
    with pytest.raises(ValueError, match=r"weft.init: weft is initialised already, with heap_bytes 1000341504 \(its "
                                         r"weft.init was given 1000000000\); got heap_bytes 8589934592: call "
                                         r"weft.finalize\(\) first to make a World with another heap_bytes"):
        weft.init(heap_bytes=8 << 30)
    with pytest.raises(ValueError, match=r"with sm_budget 132; got sm_budget 16: call weft.finalize\(\) first"):
        weft.init(sm_budget=16)
    with pytest.raises(ValueError, match=r"with timeout_ms 5000; got timeout_ms 60000: call weft.finalize\(\)"):
        weft.init(timeout_ms=60000)
    assert len(stand_in) == 1 and _runtime._state.world is world


def test_a_second_init_checks_settings_taken_from_the_environment_against_the_world(stand_in):
    world = weft.init()  # heap, budget and timeout from the environment or weft's defaults
    assert weft.init(heap_bytes=1 << 30, timeout_ms=600000) is world
    assert weft.init(heap_bytes=1 << 20) is world  # a heap the World's holds
    with pytest.raises(ValueError, match=r"with heap_bytes 1073741824; got heap_bytes 2147483648"):
        weft.init(heap_bytes=2 << 30)


def test_a_second_init_passing_the_environments_value_is_the_same_world(stand_in, monkeypatch):
    # The environment's value before the World rounded it (the heap) or clamped it: the same setting.
    monkeypatch.setenv("WEFT_SYMMETRIC_HEAP_BYTES", str(10**9))
    monkeypatch.setenv("WEFT_SM_BUDGET", "500")
    world = weft.init()
    assert weft.init(heap_bytes=10**9, sm_budget=500) is world
    with pytest.raises(ValueError, match=r"got sm_budget 16"):
        weft.init(sm_budget=16)


# ---- a World closed by its own close() ----

def test_a_world_closed_by_its_own_close_leaves_weft_uninitialised(stand_in):
    world = weft.init()
    team = object.__new__(_runtime.Team)  # a team of that World, as Team.__init__ leaves it
    team._state, team.ranks, team._team = _runtime._state, [0], types.SimpleNamespace(rank=0)
    weft.world().close()
    assert not weft.is_initialized()
    again = weft.init()  # a new World, not the closed one
    assert again is not world and not again.closed and len(stand_in) == 2
    assert weft.is_initialized() and weft.world() is again
    with pytest.raises(weft.Error, match=r"Team.barrier: weft.Team\(ranks=\[0\], rank=0\) belongs to a World that was "
                                         r"closed \(weft.finalize or World.close\(\)\); make the team again"):
        team.barrier()
    again.close()
    with pytest.raises(weft.Error, match=r"weft is not initialised: call weft.init\(\) first"):
        weft.world()
    with pytest.raises(weft.Error, match=r"weft is not initialised: call weft.init\(\) first"):
        weft.rank()
    assert weft.init() is not again and len(stand_in) == 3


def test_finalize_after_the_worlds_own_close_is_quiet(stand_in):
    weft.init().close()
    weft.finalize()  # nothing left to close
    assert not weft.is_initialized()


@pytest.mark.parametrize("where", ["in a weft wait", "in Python code"])
def test_finalize_interrupted_in_one_close_closes_the_rest_then_raises_the_interrupt(stand_in, where):
    # Ctrl-C during one close: the other objects and the World are closed all the same (a World left open would be
    # closed by its destructor, where no signal handler runs), then KeyboardInterrupt. The World is aborted either way:
    # by the interrupted weft wait itself, or else by finalize (the peers' closes of the object this rank skipped must
    # not pair with its next ones).
    closed = []
    world = weft.init()

    class Op:
        def __init__(self, name, interrupted=False):
            self.name, self.interrupted = name, interrupted

        def close(self):
            if self.interrupted:
                if where == "in a weft wait":  # as an interruptible call does before it raises
                    world.abort("its call was interrupted by KeyboardInterrupt")
                raise KeyboardInterrupt
            closed.append(self.name)

    for op in (Op("older"), Op("newer", interrupted=True)):
        _runtime._register(op)
    with pytest.raises(KeyboardInterrupt):
        weft.finalize()
    assert closed == ["older"] and world.closed and not weft.is_initialized()
    expected = ("its call was interrupted by KeyboardInterrupt" if where == "in a weft wait"
                else "finalize was interrupted by KeyboardInterrupt")
    assert world.aborts == [expected]


# ---- fork ----

_FORK_SCRIPT = textwrap.dedent("""
    import os, sys
    import weft
    from weft import _ops, _runtime, ep

    parent = os.getpid()

    def where():
        return "parent" if os.getpid() == parent else "child"

    class World:
        rank, num_ranks, device, closed = 0, 1, 0, False

        def close(self):
            print("world closed in", where(), flush=True)
            self.closed = True

        def __del__(self):
            print("world destroyed in", where(), flush=True)

    class CppOp:
        def __init__(self, name):
            self.name = name

        def close(self):
            print(self.name, "closed in", where(), flush=True)

    # weft.init's state on a stand-in World, with an op object and an EP handle made on it
    _runtime._state = _runtime._State(World(), None, None)
    op = object.__new__(_ops._FusedOp)
    op._kind, op._op = "GemmAr", CppOp("op")
    _runtime._register(op)
    handle = object.__new__(ep.NormalHandle)
    handle._h = CppOp("handle")
    _runtime._register(handle)

    pid = os.fork()
    if pid == 0:
        print("child initialised:", weft.is_initialized(), flush=True)
        for name, call in (("world", weft.world), ("init", weft.init), ("op._get", op._get),
                           ("op.close", op.close), ("handle._get", handle._get), ("handle.close", handle.close)):
            try:
                call()
                print("child", name, "returned", flush=True)
            except weft.Error as e:
                print("child", name, "raised:", e, flush=True)
        weft.finalize()  # a no-op here
        sys.exit(0)  # a normal exit: the atexit hook runs, and must not close the parent's World
    _, status = os.waitpid(pid, 0)
    print("child exit code", os.waitstatus_to_exitcode(status), flush=True)
    print("parent initialised:", weft.is_initialized(), flush=True)
    # the parent's own exit closes its op and World (weft's atexit hook)
""")


def test_a_forked_child_leaves_the_parents_world_alone_and_refuses_weft_calls():
    out = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "child initialised: False" in lines
    for call in ("world", "init", "op._get", "op.close", "handle._get", "handle.close"):
        line = next(line for line in lines if line.startswith(f"child {call} "))
        assert " raised: " in line and "this process was forked from process " in line, line
        assert "is the parent's: a forked child cannot use it" in line, line
        assert "'spawn' start method" in line, line
    assert "child op._get raised: GemmAr: this process was forked" in out.stdout
    assert "child op.close raised: GemmAr.close: this process was forked" in out.stdout
    assert "child handle.close raised: NormalHandle.close: this process was forked" in out.stdout
    assert "child exit code 0" in lines and "parent initialised: True" in lines
    # Nothing closed or destroyed in the child (not by its weft calls, not by its exit hook, not by the interpreter's
    # teardown); the parent closed its op, then its World, at its exit.
    assert not [line for line in lines if line.endswith(" in child")], out.stdout
    closes = [line for line in lines if line.endswith(" in parent")]
    assert closes[:3] == ["handle closed in parent", "op closed in parent", "world closed in parent"], out.stdout


def test_finalize_in_a_process_that_did_not_make_the_world_closes_nothing(monkeypatch):
    # A fork that bypassed os.fork's handlers: finalize (and so the exit hook) finds another process's pid on the state.
    if weft.is_initialized():
        pytest.skip("a World made by an earlier test of this process is still live")
    closed = []
    world = types.SimpleNamespace(num_ranks=1, closed=False, close=lambda: closed.append("world"))
    monkeypatch.setattr(_runtime, "_forked_from", None)  # these three restored after the test
    monkeypatch.setattr(_runtime, "_exiting", False)
    monkeypatch.setattr(_runtime, "_state", _runtime._State(world, None, None))
    _runtime._state.pid = os.getpid() + 1
    _runtime._finalize_at_exit()
    assert closed == [] and not weft.is_initialized()
    with pytest.raises(weft.Error, match=f"weft: this process was forked from process {os.getpid() + 1} after "
                                         "weft.init there"):
        weft.rank()
