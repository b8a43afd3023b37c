# SPDX-License-Identifier: MIT
# Ctrl-C and Python's signal handlers during weft's blocking calls, and weft's objects in a process forked after they
# were made, without a GPU: Worlds whose peer never comes (weft.init from a launcher's environment, World.from_store),
# store waits, and the extension's ClosableProbe (the rule every World, op, buffer and handle follows).
import gc
import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from weft import _weft
from dict_store import DictStore

_TESTS = os.path.dirname(__file__)


class _Raising(DictStore):
    """A store whose wait and add raise `exc`, as a pure-Python store's method does when a signal's handler raises
    inside it."""

    def __init__(self, exc):
        super().__init__()
        self.exc = exc

    def wait(self, keys, timeout=None):
        raise self.exc("from the store")

    def add(self, key, delta):
        raise self.exc("from the store")


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_a_keyboard_interrupt_or_system_exit_a_store_method_raises_is_raised_as_itself(exc):
    store = _weft.StoreAdapter(_Raising(exc))
    with pytest.raises(exc, match="from the store"):
        store.get("k", 1000)
    with pytest.raises(exc, match="from the store"):
        store.barrier("b", 0, 2, 1000)  # through Store::barrier, which words the store's failures into its own
    with pytest.raises(exc, match="from the store"):
        store.add("n", 1)
    with pytest.raises(_weft.Error, match=r"store.add\('n'\) raised: ConnectionError"):  # an Exception stays an Error
        _weft.StoreAdapter(_Raising(ConnectionError)).add("n", 1)


# A script that makes one blocking call on its main thread, and prints how the call ended. A thread sends the process a
# signal once the call has asked weft's wait check on the main thread (it then waits in C++, where only that check
# runs signal handlers: a signal sent earlier could be handled by Python between bytecodes, and the test would pass
# without exercising the check); the interruptions the check took are printed. CStore's wait blocks in C for its whole
# timeout without running a signal handler, as torch's TCPStore does; DictStore's runs Python, where the handler runs
# by itself. HANDLER_CODE runs in the handler (it prints what it finds).
_SIGNAL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time
    sys.path.insert(0, TESTS)
    import weft
    from weft import _weft
    from dict_store import DictStore

    class CStore(DictStore):
        wait = staticmethod(_weft._testing.wait_in_cpp)  # its keys never come here

    class Preempted(Exception):
        pass

    handled = []
    probe = _weft._testing.ClosableProbe()

    def on_usr1(signum, frame):
        handled.append(time.monotonic() - start)
        HANDLER_CODE
        if RAISE_IN_HANDLER:
            raise Preempted("checkpoint and exit")

    def send_once_waiting(checks_before):
        while _weft._testing.wait_checks_on_main_thread() == checks_before:
            time.sleep(0.005)
        os.kill(os.getpid(), SIGNAL)

    signal.signal(signal.SIGUSR1, on_usr1)
    taken = _weft._testing.interrupts_taken()
    threading.Thread(target=send_once_waiting, args=(_weft._testing.wait_checks_on_main_thread(),),
                     daemon=True).start()
    start = time.monotonic()
    try:
        CALL
        print("returned", flush=True)
    except BaseException as e:
        print(f"raised {type(e).__name__} after {time.monotonic() - start:.2f} s: {e}", flush=True)
    print("handled after", " ".join(f"{t:.2f}" for t in handled), flush=True)
    print("taken", _weft._testing.interrupts_taken() - taken, flush=True)
    # The thread's interrupt state is clean again: the next call runs as usual.
    print("then", _weft.StoreAdapter(DictStore()).check("k"), flush=True)
""")

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID", "WEFT_RUN_ID", "WEFT_JOB_TOKEN", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID",
                  "PMI_RANK", "PMIX_RANK")


def _run(call, *, signal_name="SIGINT", raise_in_handler=True, in_handler="pass", launcher_rank=None):
    """Runs _SIGNAL_SCRIPT with `call`; returns its output lines. `in_handler`: one line of code the handler runs.
    `launcher_rank`: run as that rank of a torchrun job of two ranks whose other rank never starts."""
    script = (_SIGNAL_SCRIPT.replace("TESTS", repr(_TESTS)).replace("CALL", call).replace("HANDLER_CODE", in_handler)
              .replace("SIGNAL", f"signal.{signal_name}").replace("RAISE_IN_HANDLER", repr(raise_in_handler)))
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    if launcher_rank is not None:
        env.update(RANK=str(launcher_rank), WORLD_SIZE="2", LOCAL_RANK=str(launcher_rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT="29511", TORCHELASTIC_RUN_ID=f"weft-test-{uuid.uuid4().hex}")
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=40, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{call}: the signal did not end the call (still waiting after 40 s)")
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def _ended_by(lines, exc, within_s=10.0):
    """The call raised `exc` well before any of its waits' bounds (60 s at least while a World starts; within_s leaves
    room for a CUDA context made first on a machine with a GPU), the interruption taken by weft (its wait check, or
    its adapter of a store whose Python method the handler's exception went through)."""
    line = next(line for line in lines if line.startswith(("raised ", "returned")))
    assert line.startswith(f"raised {exc} after "), line
    seconds = float(line.split(" after ")[1].split(" s")[0])
    assert seconds < within_s, line
    assert "taken 1" in lines, lines
    assert "then False" in lines


@pytest.mark.parametrize("rank", [0, 1])
def test_ctrl_c_ends_weft_init_whose_peer_never_comes(rank):
    # Rank 0 waits for rank 1 in the start-up exchange on its own store; rank 1 waits for rank 0's store to appear.
    _ended_by(_run("weft.init()", launcher_rank=rank), "KeyboardInterrupt")


@pytest.mark.parametrize("store", ["CStore", "DictStore"])
@pytest.mark.parametrize("rank", [0, 1])
def test_ctrl_c_ends_a_world_start_on_a_python_store_whose_peer_never_comes(store, rank):
    # Rank 0 waits in the placement exchange, rank 1 for rank 0's World size.
    _ended_by(_run(f"_weft.World.from_store(_weft.StoreAdapter({store}()), rank={rank}, num_ranks=2)"),
              "KeyboardInterrupt")


@pytest.mark.parametrize("call", ["store.barrier('b', 0, 2, 60000)", "store.all_gather('g', 0, 2, b'x', 60000)",
                                  "store.get('k', 60000)"])
def test_ctrl_c_ends_a_store_wait(call):
    _ended_by(_run(f"store = _weft.StoreAdapter(CStore(), prefix='job'); {call}"), "KeyboardInterrupt")


def test_a_signal_handlers_exception_ends_the_wait_and_is_raised_as_itself():
    lines = _run("_weft.StoreAdapter(CStore()).get('k', 60000)", signal_name="SIGUSR1")
    _ended_by(lines, "Preempted")
    assert any(line.endswith(": checkpoint and exit") for line in lines), lines


def test_a_signal_handler_that_returns_runs_during_the_wait_which_goes_on():
    lines = _run("_weft.StoreAdapter(CStore()).get('k', 1500)", signal_name="SIGUSR1", raise_in_handler=False)
    line = next(line for line in lines if line.startswith(("raised ", "returned")))
    assert line.startswith("raised Error after ") and "timed out waiting for the keys" in line, line
    assert float(line.split(" after ")[1].split(" s")[0]) >= 1.4, line  # the whole timeout
    handled = next(line for line in lines if line.startswith("handled after"))
    assert len(handled.split()) == 3 and float(handled.split()[2]) < 1.4, lines  # while the call waited (1.5 s)
    assert "taken 0" in lines, lines


_CALLS_IN_HANDLER = """for name, fn in (("probe.call", probe.call),
                     ("store.check", lambda: _weft.StoreAdapter(DictStore()).check("k")),
                     ("weft.finalize", weft.finalize),
                     ("weft.init", weft.init),
                     ("probe.abort", probe.abort)):
        try:
            fn()
            print("in handler:", name, "returned", flush=True)
        except _weft.Error as e:
            print("in handler:", name, "raised:", e, flush=True)"""


def test_a_signal_handler_inside_a_weft_call_may_only_abort():
    # The handler runs in the middle of the weft call: a call into weft from it is refused (it would start another
    # exchange while the peers are in the first), except World.abort (ClosableProbe.abort is admitted as it is).
    lines = _run("_weft.StoreAdapter(CStore()).get('k', 60000)", signal_name="SIGUSR1", in_handler=_CALLS_IN_HANDLER)
    _ended_by(lines, "Preempted")
    for name, who in (("probe.call", " (ClosableProbe)"), ("store.check", ""), ("weft.finalize", " (weft.finalize)"),
                      ("weft.init", " (weft.init)")):
        line = next(line for line in lines if line.startswith(f"in handler: {name} "))
        assert line.startswith(f"in handler: {name} raised: weft: a signal handler that runs inside a weft call on "
                               f"this thread called weft{who}. "), line
        assert "only World.abort may be called there" in line and "set a flag" in line, line
    assert "in handler: probe.abort returned" in lines, lines


# ---- an object dropped open, and one used in a forked child ----

def test_an_object_dropped_open_is_destroyed_with_the_gil_released():
    # As an op or EP buffer dropped unclosed: its collective frees wait on the store, whose Python methods need the GIL.
    probe = _weft._testing.ClosableProbe()
    record = probe.record
    assert not record.destroyed
    del probe
    gc.collect()
    assert record.destroyed and not record.destroyed_holding_gil


_FORK_SCRIPT = textwrap.dedent("""
    import gc, os, sys
    from weft import _weft

    probe = _weft._testing.ClosableProbe()  # what every World, op, buffer and handle follows
    record = probe.record
    print("parent", os.getpid(), flush=True)
    pid = os.fork()
    if pid == 0:
        for name, call in (("call", probe.call), ("close", probe.close)):
            try:
                call()
                print("child", name, "returned", flush=True)
            except _weft.Error as e:
                print("child", name, "raised:", e, flush=True)
        print("child closed:", probe.closed, flush=True)
        del probe
        gc.collect()
        print("child destroyed:", record.destroyed, flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    probe.call()
    print("parent call returned", flush=True)
    del probe
    gc.collect()
    print("parent destroyed:", record.destroyed, flush=True)
""")


def test_an_object_made_before_a_fork_refuses_calls_in_the_child_and_is_not_destroyed_there():
    out = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    parent = lines[0].split()[1]
    for name in ("call", "close"):
        line = next(line for line in lines if line.startswith(f"child {name} "))
        assert line.startswith(f"child {name} raised: weft: ClosableProbe: this process was forked from process "
                               f"{parent} after ClosableProbe was made there"), line
        assert "is the parent's: a forked child cannot use it" in line and "'spawn' start method" in line, line
    assert "child closed: False" in lines and "child destroyed: False" in lines, out.stdout
    assert "parent call returned" in lines and "parent destroyed: True" in lines, out.stdout
