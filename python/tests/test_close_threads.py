# SPDX-License-Identifier: MIT
# close() against calls in flight on other Python threads: the rule every World, op, EP buffer and handle follows
# (python/src/binding.hpp, Closable), driven on the CPU through _weft._testing.ClosableProbe, which uses the same code
# (a World needs a GPU). probe.call(callback) is a call like World.barrier(): the GIL released, the callback run inside
# it with the GIL taken (as a Python store's methods are).
import os
import signal
import threading
import time

import pytest

import weft
from weft import _weft

ClosableProbe = _weft._testing.ClosableProbe
TIMEOUT_S = 30  # bounds every wait below: a regression fails the test instead of hanging it


def _start(target, *args):
    """Runs target(*args) on a daemon thread; returns the thread and a list that receives its exception, if any."""
    errors = []

    def run():
        try:
            target(*args)
        except BaseException as e:  # noqa: BLE001 -- reported to the test
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def _join(thread):
    thread.join(TIMEOUT_S)
    assert not thread.is_alive(), "a thread did not finish: close() and the calls in flight deadlocked"


def _call_in_flight(probe):
    """Starts a call that stays inside the probe until the returned event is set; returns (event, thread, errors)."""
    entered, leave = threading.Event(), threading.Event()

    def inside():
        entered.set()
        assert leave.wait(TIMEOUT_S)

    thread, errors = _start(probe.call, inside)
    assert entered.wait(TIMEOUT_S)
    return leave, thread, errors


def _wait_until_closing(probe):
    """Polls with new calls until they are refused because close() has started on another thread."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            probe.call()
        except weft.Error as e:
            assert "ClosableProbe is closing (close() was called on another thread)" in str(e)
            return
        assert time.monotonic() < deadline, "close() never started refusing new calls"
        time.sleep(0.001)


def test_calls_and_close_on_one_thread():
    probe = ClosableProbe()
    probe.call()
    probe.call(lambda: None)
    assert not probe.closed
    assert probe.close() and probe.closed and probe.calls_in_flight_at_destruction == 0
    assert not probe.close()  # a second close is a no-op
    with pytest.raises(weft.Error, match="ClosableProbe is closed"):
        probe.call()


def test_close_refuses_new_calls_at_once_and_waits_for_those_in_flight():
    probe = ClosableProbe()
    leave_a, a, a_errors = _call_in_flight(probe)
    leave_b, b, b_errors = _call_in_flight(probe)  # calls do not wait for each other
    closer, close_errors = _start(probe.close)
    _wait_until_closing(probe)
    second_closer, second_close_errors = _start(probe.close)  # waits for the first close, then finds it closed

    # The main thread ran Python while close() waited: close() waits with the GIL released.
    leave_a.set()
    _join(a)
    assert closer.is_alive() and not probe.closed  # b is still inside
    leave_b.set()
    _join(b)
    _join(closer)
    _join(second_closer)
    assert a_errors == [] and b_errors == [] and close_errors == [] and second_close_errors == []
    assert probe.closed
    assert probe.calls_in_flight_at_destruction == 0  # destroyed after the calls left, not under them
    with pytest.raises(weft.Error, match="ClosableProbe is closed"):
        probe.call()


def test_close_from_inside_a_call_on_the_same_thread_is_an_error_not_a_deadlock():
    probe = ClosableProbe()

    def close_from_inside():
        with pytest.raises(weft.Error, match=r"close\(\) of ClosableProbe was called from inside a call on it on "
                                             r"the same thread .* close it after the call returns"):
            probe.close()

    caller, errors = _start(probe.call, close_from_inside)  # a thread of its own: a deadlock fails the join
    _join(caller)
    assert errors == []  # the callback's expectation failing would surface here, as a weft.Error from call()
    assert not probe.closed
    probe.call()  # still open, and usable
    assert probe.close() and probe.closed


def test_a_close_refused_after_the_wait_leaves_the_object_open():
    # World.close checks for open ops before and again after the wait (a call in flight may have made one); a refusal
    # after the wait must let calls in again.
    probe = ClosableProbe()
    checks = []

    def check():
        checks.append(len(checks))
        if len(checks) == 2:
            raise weft.Error("an op made during the wait is still open")

    leave, a, a_errors = _call_in_flight(probe)
    closer, close_errors = _start(probe.close, check)
    _wait_until_closing(probe)
    leave.set()
    _join(a)
    _join(closer)
    assert a_errors == [] and checks == [0, 1]
    assert len(close_errors) == 1 and "an op made during the wait is still open" in str(close_errors[0])
    assert not probe.closed
    probe.call()
    assert probe.close() and probe.closed


def test_ctrl_c_ends_a_close_waiting_for_a_call_in_flight_and_leaves_the_object_open():
    probe = ClosableProbe()
    leave, a, a_errors = _call_in_flight(probe)  # a call that stays inside (as one stuck on a missing peer)
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    backstop = threading.Timer(TIMEOUT_S, leave.set)  # a close that cannot be interrupted ends then, and fails below
    backstop.start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        probe.close()
    assert time.monotonic() - started < TIMEOUT_S
    timer.join()
    backstop.cancel()
    assert not probe.closed
    probe.call()  # calls start again: the close that was interrupted ended
    leave.set()
    _join(a)
    assert a_errors == []
    assert probe.close() and probe.closed
