"""Signals that raise (Ctrl-C, a script's SIGALRM handler) during paged training.

CPython runs a signal's handler between any two bytecodes of the main thread. Inside the pager a
page's move between states takes several statements; an exception raised between two of them left
a page neither resident nor below, or a step's pre-step copy without its swap record. Once a memory
stack exists, a handler is held back while the training thread holds one of its locks
(:mod:`apt_model.memory.interrupts`). These tests send real signals: at chosen points of the
lock's life, and at random points of paged training, whose state must then train on exactly as
plain PyTorch from the same state.
"""
import copy
import random
import sys
import signal
import threading
import time
from concurrent.futures import Future

import pytest
import torch

import apt_model.optimization.vb_global as vb
from apt_model.memory.interrupts import MAX_HOLD_S, deliver_held_back
from apt_model.memory.waits import TimedLock, wait_future
from test_faults import FORCE, adamw, assert_same, batches, mlp, one_step, snapshot

SIG = signal.SIGUSR1  # not SIGALRM, which a test-timeout plugin may use

pytestmark = pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs POSIX signals")


class Alarm(KeyboardInterrupt):
    """What the test's handler raises."""


def _raise(signum, frame):
    raise Alarm(f"signal {signum}")


def _send():
    signal.pthread_kill(threading.main_thread().ident, SIG)


@pytest.fixture
def stack_on(tmp_path, cpu_device):
    """The switch on with a memory stack (everything paged), the test's handler set after enable."""
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    previous = signal.signal(SIG, _raise)
    try:
        yield
    finally:
        vb.disable()
        signal.signal(SIG, previous)


def test_the_scripts_handlers_are_its_own_before_during_and_after(tmp_path, cpu_device):
    """``signal.getsignal`` returns the script's handler while its call is held back, and
    ``disable()`` leaves the script's handlers set, unwrapped."""
    before = signal.signal(SIG, _raise)
    try:
        vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
        try:
            assert signal.getsignal(SIG) is _raise  # set before enable, wrapped by it
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

            def other(signum, frame):
                raise Alarm("other")

            assert signal.signal(SIG, other) is _raise  # set while on
            assert signal.getsignal(SIG) is other
        finally:
            vb.disable()
        assert signal.getsignal(SIG) is other
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert "apt_model" not in (signal.signal.__doc__ or "") + (signal.getsignal.__doc__ or "")  # unpatched
    finally:
        signal.signal(SIG, before)


def test_a_signal_inside_a_lock_runs_its_handler_once_the_lock_is_left(stack_on):
    lock = TimedLock("test")
    seen = []
    t0 = time.monotonic()
    with pytest.raises(Alarm):
        with lock:
            _send()
            time.sleep(0.2)  # the handler would run here, at once, without the hold
            seen.append("block ended")
        time.sleep(1.0)  # it runs here, within a retry period of the release
    assert seen == ["block ended"]
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(Alarm):  # outside a lock it runs at once
        _send()
        time.sleep(1.0)


def test_a_wait_for_io_is_a_cancellation_point(stack_on, monkeypatch):
    """Inside the locks an interrupt still reaches a wait for a page's read or write (its callers
    take the job back or wait for it): Ctrl-C is not held until the disk answers. It comes out of
    the wait itself, not from inside ``threading.Condition.wait`` (which, interrupted between its
    lock's release and its ``try``, raised ``RuntimeError: cannot release un-acquired lock``)."""
    monkeypatch.setenv("VB_SWAP_TIMEOUT", "30")
    lock = TimedLock("test")
    timer = threading.Timer(0.2, _send)
    t0 = time.monotonic()
    with pytest.raises(Alarm) as caught:
        with lock:
            timer.start()
            wait_future(Future(), "a read that never ends")
    assert time.monotonic() - t0 < 5
    names = [entry.name for entry in caught.traceback]
    assert "wait_future" in names and not {"result", "wait"} & set(names), names


def test_a_signal_is_held_back_no_longer_than_its_limit(stack_on):
    """A lock held for long is a stuck wait: the interrupt is how the user gets out of it."""
    lock = TimedLock("test")
    t0 = time.monotonic()
    with pytest.raises(Alarm):
        with lock:
            _send()
            time.sleep(MAX_HOLD_S + 5)
    assert MAX_HOLD_S * 0.9 <= time.monotonic() - t0 < MAX_HOLD_S + 3


@pytest.mark.parametrize("step_in_backward", ["auto", pytest.param("off", marks=pytest.mark.slow)])
def test_signals_at_random_points_of_paged_training_leave_a_state_that_trains_on_as_plain(
        step_in_backward, tmp_path, cpu_device):
    """A signal is sent at a random Python call inside apt_model during a training step, forty
    times; the script catches the KeyboardInterrupt and trains on. Before the hold, most runs of
    either variant ended in ``RuntimeError: page ... must be acquired before it is protected`` or a
    roll-back that found no swap record. Then ``state_dict()`` of the model and the optimizer must
    train on exactly as plain PyTorch loaded from it."""
    data = batches(4)
    m = mlp()
    opt = adamw(m)
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE, paging_step_in_backward=step_in_backward)
    previous = signal.signal(SIG, _raise)
    root = vb.__file__.rsplit("/optimization/", 1)[0] + "/"
    calls = [0, -1]  # calls seen, the call at which to send

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            calls[0] += 1
            if calls[0] == calls[1]:
                _send()
        return None

    try:
        for b in data:
            one_step(m, opt, b)
        calls[0] = 0
        sys.settrace(tracer)
        try:
            one_step(m, opt, data[0])
        finally:
            sys.settrace(None)
        per_step = calls[0]
        assert per_step > 500, per_step
        rng = random.Random(1)
        caught = 0
        for i in range(40):
            calls[0], calls[1] = 0, rng.randint(1, per_step)
            try:
                sys.settrace(tracer)
                try:
                    one_step(m, opt, data[i % 4])
                finally:
                    sys.settrace(None)
                time.sleep(0.03)  # a signal held back to the step's end lands here
                # on a loaded machine the retry's timer thread may run later than that (an Alarm
                # escaped the loop once, with two other test runs beside it): what is still owed is
                # handed over here, still inside the try
                deliver_held_back()
            except Alarm:
                caught += 1
                opt.zero_grad()
        assert caught >= 20, caught
        state = copy.deepcopy({"model": m.state_dict(), "opt": opt.state_dict()})
        on = [one_step(m, opt, b) for b in data[:2]]
        on_state = snapshot(m, opt)
    finally:
        vb.disable()
        signal.signal(SIG, previous)
    plain = mlp()
    popt = adamw(plain)
    plain.load_state_dict(state["model"])
    popt.load_state_dict(state["opt"])
    assert [one_step(plain, popt, b) for b in data[:2]] == on
    assert_same(on_state, snapshot(plain, popt))


def test_a_wait_returns_the_result_of_a_job_that_ends_as_a_slice_does():
    """The wait runs in slices; a job ending between a slice's timeout and the check after it was
    taken for a failed one (a bare ``TimeoutError`` for a read that worked)."""
    class EndsAsTheSliceDoes(Future):
        def result(self, timeout=None):
            if not self.done():
                self.set_result("bytes read")
                raise TimeoutError()
            return super().result(timeout)

    assert wait_future(EndsAsTheSliceDoes(), "a read") == "bytes read"


def test_a_held_back_signal_is_run_on_the_main_thread_only(stack_on):
    """Another thread's I/O wait is no cancellation point for the main thread's signal: its
    handler ran there, the main thread never saw the interrupt."""
    lock = TimedLock("test")
    ran_on = []

    def handler(signum, frame):
        ran_on.append(threading.current_thread().name)
        raise Alarm("main")

    signal.signal(SIG, handler)
    slow = Future()
    waiter = threading.Thread(target=lambda: wait_future(slow, "a read on another thread"), name="other-wait")
    waiter.start()
    try:
        with pytest.raises(Alarm):
            with lock:
                _send()
                time.sleep(0.3)  # held back: the other thread's wait slices pass meanwhile
            time.sleep(1.0)
    finally:
        slow.set_result(None)
        waiter.join()
    assert ran_on == ["MainThread"]


def test_every_signal_held_back_reaches_its_handler(stack_on):
    """Signals arriving while one is held back were taken for the hold's own re-sends: five sent
    inside a lock ran the handler once."""
    lock = TimedLock("test")
    calls = []
    signal.signal(SIG, lambda signum, frame: calls.append(signum))
    with lock:
        for _ in range(5):
            _send()
            time.sleep(0.03)
    time.sleep(0.3)
    assert len(calls) == 5, calls


def test_an_event_loops_signal_callback_runs_once(stack_on):
    """asyncio's handler only wakes the loop through the wakeup fd, which every re-send of a
    held-back signal wrote to: its callback ran once per re-send (39 times for one signal)."""
    import asyncio

    lock = TimedLock("test")
    calls = []

    async def main():
        asyncio.get_running_loop().add_signal_handler(SIG, lambda: calls.append(1))
        with lock:
            _send()
            time.sleep(0.2)
        await asyncio.sleep(0.3)

    asyncio.run(main())
    assert calls == [1]


def test_the_step_of_an_optimizer_that_pages_nothing_is_not_held(stack_on):
    """Only a paged optimizer's step holds signals back: the shield once covered torch's step
    wrapper, shared by every optimizer (Ctrl-C waited 1.5 s for a plain optimizer's slow hook)."""
    m = mlp()
    opt = adamw(m)
    m.to("cpu")
    one_step(m, opt, batches(1)[0])  # a paged step ran
    lone = torch.nn.Parameter(torch.ones(4))
    plain = torch.optim.SGD([lone], lr=0.1)
    plain.register_step_pre_hook(lambda *a: time.sleep(1.5))
    lone.sum().backward()
    threading.Timer(0.1, _send).start()
    t0 = time.monotonic()
    with pytest.raises(Alarm):
        plain.step()
    assert time.monotonic() - t0 < 1.0
