"""Asynchronous interrupts and the memory stack: a signal handler that raises — Ctrl-C's
``KeyboardInterrupt``, a script's ``SIGALRM`` or ``SIGTERM`` handler — is held back while the
main thread (the one Python runs handlers on: the training loop's) is inside one of the memory
stack's locks or a paged optimizer step, and runs as soon as it reaches a cancellation point or
leaves them.

Why: CPython runs a signal's Python handler between any two bytecodes of the main thread. Inside
the pager a page's move from one state to the next takes several statements (its state, its I/O
future, the level's running totals, the swap folder's records); an exception raised between two
of them left a page neither resident nor below (``page ... must be acquired before it is
protected`` at the next step), or a step's pre-step copy without its swap record at roll-back.
Both were found by sending signals at random points of paged training
(``tests/test_interrupts.py``); handling every such point one by one would not end.

Policy (the decision, per signal, when its handler is called):

* **Held back** while the main thread holds a :class:`~apt_model.memory.waits.TimedLock` that
  guards paging state (the pager's, the swap folder's, the host level's, the paging session's, the
  activation offloader's; not the bandwidth probe's), runs a function marked :func:`shielded` —
  the paged optimizer step, and the waits for background I/O, whose standard-library code
  (``threading.Condition.wait``) is itself not safe to interrupt: an exception there left the
  future's lock released under its ``with`` block, and the next line raised ``RuntimeError: cannot
  release un-acquired lock`` instead of the ``KeyboardInterrupt`` — or while a :func:`hold` window
  is open (between the paged optimizer step's two hooks, across torch's own code).
* **Delivered** as soon as the thread is out of them (retried every :data:`RETRY_S` seconds by a
  real-time signal of this module's own, the *carrier*), or at a *cancellation point*
  (:func:`deliver_held_back`): a wait for I/O calls it every :data:`~apt_model.memory.waits.SLICE_S`
  seconds, so Ctrl-C is not held until the disk answers — every caller of such a wait is written to
  meet an interrupt (the job is taken back or waited for before its memory goes).
* **Never held back more than** :data:`MAX_HOLD_S` seconds: a lock held that long is a stuck
  wait, and the interrupt is how the user gets out of it; it then runs wherever the thread is.
* **Not wrapped**: the handlers of event loops (:data:`EVENT_LOOPS`), which only wake the loop
  through ``signal.set_wakeup_fd`` — every send of a signal writes that fd, so a re-sent signal
  would run the loop's callback again. A script that sets a wakeup fd itself sees one wakeup per
  re-send of a held-back signal.

Each signal received calls its handler once (two of one kind that arrive together may be merged
by the OS, as without this module). Where the platform has no real-time signals (macOS) nothing
is held back. :func:`install` wraps the handlers set when ``enable()``
builds a memory stack (from the main thread, the only one allowed to set handlers) and patches
``signal.signal`` so that the handlers the script sets later are wrapped too; ``signal.getsignal``
still returns the script's own handler, and ``disable()`` puts the script's handlers back.
"""
from __future__ import annotations

import logging
import signal
import sys
import threading
import time
import weakref
from types import FrameType
from typing import Any, Callable

log = logging.getLogger(__name__)

#: Seconds between two sends of a held-back signal.
RETRY_S = 0.01
#: Seconds a signal may be held back at most (then its handler runs wherever the thread is).
MAX_HOLD_S = 2.0

_locks: "weakref.WeakSet[Any]" = weakref.WeakSet()  # every TimedLock (waits.py registers them)
_shielded: set = set()  # code objects of the functions inside which interrupts are held back
_held: set = set()  # keys of the windows opened by hold() and not yet closed by let_go()
_owing: dict[int, "HeldBack"] = {}  # signal number -> its wrapper, while a signal is held back
#: Modules whose handlers are not wrapped: they only wake an event loop through the wakeup fd
#: (``signal.set_wakeup_fd``), which every send of a signal writes to — a held-back signal's
#: re-sends would run the loop's callback once per re-send.
EVENT_LOOPS = ("asyncio", "trio", "anyio", "uvloop")


def track_lock(lock: Any) -> None:
    """Count ``lock`` (anything with ``holds() -> int`` for the calling thread) among the locks
    inside which interrupts are held back."""
    _locks.add(lock)


def shielded(fn: Callable) -> Callable:
    """Decorator: an interrupt that arrives while ``fn`` runs (anywhere below it on the stack,
    from its first instruction on) is held back."""
    _shielded.add(fn.__code__)
    return fn


def hold(key: Any) -> None:
    """Hold interrupts back from now until :func:`let_go` with the same ``key``: for a window
    that spans code the project does not own (between two of torch's hooks)."""
    _held.add(key)


def let_go(key: Any) -> None:
    """Close the window :func:`hold` opened with ``key`` (nothing if none is open)."""
    _held.discard(key)


def holding_back(frame: FrameType | None) -> bool:
    """Whether an interrupt arriving now in the main thread, at ``frame``, is held back: the
    thread holds a memory-stack lock, runs a :func:`shielded` function, or a :func:`hold` window
    is open."""
    if _held:
        return True
    try:
        locks = list(_locks)
    except RuntimeError:  # another thread made a lock during the copy: judged held, asked again soon
        return True
    if any(lock.holds() for lock in locks):
        return True
    while frame is not None:
        if frame.f_code in _shielded:
            return True
        frame = frame.f_back
    return False


def deliver_held_back() -> None:
    """A cancellation point of the main thread: call the handler of every signal held back now,
    here (so its exception, if it raises one, comes out of this call). For code that meets an
    interrupt at this point whatever locks it holds. Elsewhere (another thread's wait) nothing
    happens: Python runs signal handlers on the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    frame = sys._getframe(1)
    for signum, wrapper in list(_owing.items()):
        while wrapper.owed > 0:
            wrapper.run(signum, frame)


class HeldBack:
    """A script's signal handler, called by the policy of this module (see its docstring).

    Args:
        handler: the script's handler, ``handler(signum, frame)``.
    """

    def __init__(self, handler: Callable):
        self.handler = handler
        self.owed = 0  # signals received and not yet handed to the handler
        self._since: float | None = None  # when the oldest signal owed arrived

    def __call__(self, signum: int, frame: FrameType | None):
        self.owed += 1
        if self._since is None:
            self._since = time.monotonic()
        return self.attempt(signum, frame)

    def attempt(self, signum: int, frame: FrameType | None):
        """Hand one owed signal to the script's handler, unless it is held back now (then a
        retry is planned)."""
        if self.owed <= 0:
            return None
        if holding_back(frame) and time.monotonic() - self._since < MAX_HOLD_S and _retry_later():
            if signum not in _owing:
                log.debug("signal %d held back: the memory stack is between two states", signum)
            _owing[signum] = self
            return None
        return self.run(signum, frame)

    def run(self, signum: int, frame: FrameType | None):
        """Hand one signal to the script's handler now (whatever it raises comes out of here)."""
        self.owed -= 1
        if self.owed <= 0:
            self.owed, self._since = 0, None
            _owing.pop(signum, None)
        if _owing:  # others still owed (their turn after this handler, which may raise)
            _retry_later()
        return self.handler(signum, frame)

    def __repr__(self) -> str:
        return f"HeldBack({self.handler!r})"


# ---------------------------------------------------------------- retries
# A held-back signal is retried by a *carrier*: a real-time signal of this module's own, sent to
# the main thread, whose handler tries every owed signal again. Re-sending the script's own signal
# instead lost signals (the OS merges two pending ones of a kind: a re-send and the user's second
# Ctrl-C became one) and woke an event loop's wakeup fd once per re-send. Real-time signals queue.
_carrier: dict = {"signum": None, "previous": None}
_carrier_lock = threading.Lock()


def _carrier_signal() -> int | None:
    low, high = getattr(signal, "SIGRTMIN", None), getattr(signal, "SIGRTMAX", None)
    if low is None or high is None or high - low < 4:
        return None
    return int(high) - 3  # one the C library and common tools leave alone


def _retry(signum: int, frame: FrameType | None) -> None:
    """The carrier's handler: try every owed signal again."""
    for owed_signum, wrapper in list(_owing.items()):
        wrapper.attempt(owed_signum, frame)


def _retry_later() -> bool:
    """Plan a retry in :data:`RETRY_S` seconds; False where none can be planned (no carrier on
    this platform, or no thread can be started at interpreter shutdown): the handler runs now."""
    if _carrier["signum"] is None:
        return False
    timer = threading.Timer(RETRY_S, _send_carrier)
    timer.daemon = True
    timer.name = "vb-interrupt-retry"
    try:
        timer.start()
    except RuntimeError:
        return False
    return True


def _send_carrier() -> None:
    # (on the timer's thread) nothing owed, nothing sent; and never once disable() took the
    # carrier's handler back (its default action ends the process)
    with _carrier_lock:
        if _owing and _carrier["signum"] is not None:
            signal.pthread_kill(threading.main_thread().ident, _carrier["signum"])


def _script_handler(handler: Any) -> Any:
    return handler.handler if isinstance(handler, HeldBack) else handler


def install(patches) -> bool:
    """Hold interrupts back inside the memory stack's locks from now on (see the module
    docstring), every change recorded in ``patches`` (a :class:`~apt_model.base.patches.PatchSet`)
    for ``disable()`` to undo. Returns False, changing nothing, off the main thread (Python lets
    only the main thread set signal handlers) or where ``signal.pthread_kill`` does not exist."""
    carrier = _carrier_signal()
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_kill") \
            or carrier is None:
        log.debug("interrupts are not held back inside the memory stack: enable() ran off the main thread, "
                  "or this platform has no signal.pthread_kill or real-time signals")
        return False
    real_signal, real_getsignal = signal.signal, signal.getsignal

    def wrap(handler: Any) -> Any:
        if not callable(handler) or isinstance(handler, HeldBack) or handler is _retry:
            return handler
        if (getattr(handler, "__module__", None) or "").split(".")[0] in EVENT_LOOPS:
            return handler
        return HeldBack(handler)

    def signal_(signalnum, handler):
        """``signal.signal``, the handler held back inside the memory stack's locks (apt_model)."""
        return _script_handler(real_signal(signalnum, wrap(handler)))

    def getsignal_(signalnum):
        """``signal.getsignal``: the script's own handler (apt_model)."""
        return _script_handler(real_getsignal(signalnum))

    def put_back() -> None:
        with _carrier_lock:  # no carrier is sent once its handler goes back
            signum, _carrier["signum"] = _carrier["signum"], None
        if signum is not None:
            previous = _carrier["previous"]
            real_signal(signum, signal.SIG_DFL if previous is None else previous)
        for signum in signal.valid_signals():
            try:
                current = real_getsignal(signum)
                if isinstance(current, HeldBack):
                    real_signal(signum, current.handler)
            except (OSError, ValueError):  # off the main thread, or a signal that cannot be set
                continue
        for signum, wrapper in list(_owing.items()):  # still owed: sent again, to the script's handler
            _owing.pop(signum, None)
            for _ in range(wrapper.owed):
                signal.pthread_kill(threading.main_thread().ident, signum)
            wrapper.owed = 0

    _carrier["previous"] = real_signal(carrier, _retry)
    _carrier["signum"] = carrier
    patches.add_undo(put_back, "the script's signal handlers (interrupts held back inside the memory stack)")
    for signum in signal.valid_signals():
        try:
            current = real_getsignal(signum)
            wrapped = wrap(current)
            if wrapped is not current:
                real_signal(signum, wrapped)
        except (OSError, ValueError):
            continue
    patches.set_attr(signal, "signal", signal_, label="signal.signal (handlers held back inside the memory stack)")
    patches.set_attr(signal, "getsignal", getsignal_, label="signal.getsignal (the script's own handlers)")
    return True
