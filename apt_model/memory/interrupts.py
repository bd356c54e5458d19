"""Asynchronous interrupts and the memory stack: a signal handler that raises — Ctrl-C's
``KeyboardInterrupt``, a script's ``SIGALRM`` or ``SIGTERM`` handler — is held back while the
training thread is inside one of the memory stack's locks, and runs as soon as that thread
reaches a cancellation point or leaves the locks.

Why: CPython runs a signal's Python handler between any two bytecodes of the main thread. Inside
the pager a page's move from one state to the next takes several statements (its state, its I/O
future, the level's running totals, the swap folder's records); an exception raised between two
of them left a page neither resident nor below (``page ... must be acquired before it is
protected`` at the next step), or a step's pre-step copy without its swap record at roll-back.
Both were found by sending a signal at random points of paged training (``tests/test_faults.py``,
the interrupt sweep); handling every such point one by one would not end.

Policy (the decision, per signal, when its handler is called):

* **Held back** while the main thread holds any :class:`~apt_model.memory.waits.TimedLock` (the
  pager's, the swap folder's, the host level's, the paging session's, the activation offloader's),
  or runs a function marked :func:`shielded` — the waits for background I/O, whose standard-library
  code (``threading.Condition.wait``) is itself not safe to interrupt: an exception there left the
  future's lock released under its ``with`` block, and the next line raised ``RuntimeError: cannot
  release un-acquired lock`` instead of the ``KeyboardInterrupt``.
* **Delivered** as soon as the thread is out of them (the signal is sent again to the main thread
  every :data:`RETRY_S` seconds until it is let through), or at a *cancellation point*
  (:func:`deliver_held_back`): a wait for I/O calls it every :data:`~apt_model.memory.waits.SLICE_S`
  seconds, so Ctrl-C is not held until the disk answers — every caller of such a wait is written to
  meet an interrupt (the job is taken back or waited for before its memory goes).
* **Never held back more than** :data:`MAX_HOLD_S` seconds: a lock held that long is a stuck
  wait, and the interrupt is how the user gets out of it; it then runs wherever the thread is.

Each signal received calls its handler once (two of one kind that arrive together may be merged
by the OS, as without this module). :func:`install` wraps the handlers set when ``enable()``
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
_owing: dict[int, "HeldBack"] = {}  # signal number -> its wrapper, while a signal is held back


def track_lock(lock: Any) -> None:
    """Count ``lock`` (anything with ``holds() -> int`` for the calling thread) among the locks
    inside which interrupts are held back."""
    _locks.add(lock)


def shielded(fn: Callable) -> Callable:
    """Decorator: an interrupt that arrives while ``fn`` runs (anywhere below it on the stack,
    from its first instruction on) is held back. Also called on a function defined elsewhere
    (torch's optimizer step wrapper); one without Python code is left as it is."""
    code = getattr(fn, "__code__", None)
    if code is not None:
        _shielded.add(code)
    return fn


def holding_back(frame: FrameType | None) -> bool:
    """Whether an interrupt arriving now in the calling thread, at ``frame``, is held back: the
    thread holds a memory-stack lock, or runs a :func:`shielded` function."""
    if any(lock.holds() for lock in list(_locks)):
        return True
    while frame is not None:
        if frame.f_code in _shielded:
            return True
        frame = frame.f_back
    return False


def deliver_held_back() -> None:
    """A cancellation point: call the handler of every signal held back now, here (so its
    exception, if it raises one, comes out of this call). For code that meets an interrupt at this
    point whatever locks it holds."""
    for signum, wrapper in list(_owing.items()):
        if _owing.pop(signum, None) is not None and wrapper.owed > 0:
            wrapper.run(signum, sys._getframe(1))


class HeldBack:
    """A script's signal handler, called by the policy of this module (see its docstring).

    Args:
        handler: the script's handler, ``handler(signum, frame)``.
    """

    def __init__(self, handler: Callable):
        self.handler = handler
        self.owed = 0  # signals received and not yet handed to the handler
        self._resending = False  # a send of ours is on its way: the next arrival is that one
        self._since: float | None = None  # when the oldest signal held back arrived

    def __call__(self, signum: int, frame: FrameType | None):
        if self._resending:
            self._resending = False
        else:
            self.owed += 1
        if self.owed <= 0:
            return None  # our send of a signal a cancellation point already delivered
        now = time.monotonic()
        if holding_back(frame) and (self._since is None or now - self._since < MAX_HOLD_S):
            self._resending = True
            if self._send_again(signum):
                if self._since is None:
                    self._since = now
                    log.debug("signal %d held back: the memory stack is between two states", signum)
                _owing[signum] = self
                return None
            self._resending = False
        return self.run(signum, frame)

    def run(self, signum: int, frame: FrameType | None):
        """Hand one signal to the script's handler now (whatever it raises comes out of here)."""
        self.owed -= 1
        if self.owed <= 0:
            self.owed, self._since = 0, None
            _owing.pop(signum, None)
        return self.handler(signum, frame)

    def _send_again(self, signum: int) -> bool:
        """Send ``signum`` to the main thread again in :data:`RETRY_S` seconds (if it is still owed
        then); False where no thread can be started (the interpreter is shutting down): the
        handler must run now."""
        timer = threading.Timer(RETRY_S, self._resend, (signum,))
        timer.daemon = True
        timer.name = "vb-interrupt-retry"
        try:
            timer.start()
        except RuntimeError:
            return False
        return True

    def _resend(self, signum: int) -> None:
        # (on the timer's thread) a signal a cancellation point delivered meanwhile is not sent:
        # arriving after the script set that signal back to its default action, it killed the process
        if self.owed > 0:
            signal.pthread_kill(threading.main_thread().ident, signum)
        else:
            self._resending = False

    def __repr__(self) -> str:
        return f"HeldBack({self.handler!r})"


def _script_handler(handler: Any) -> Any:
    return handler.handler if isinstance(handler, HeldBack) else handler


def install(patches) -> bool:
    """Hold interrupts back inside the memory stack's locks from now on (see the module
    docstring), every change recorded in ``patches`` (a :class:`~apt_model.base.patches.PatchSet`)
    for ``disable()`` to undo. Returns False, changing nothing, off the main thread (Python lets
    only the main thread set signal handlers) or where ``signal.pthread_kill`` does not exist."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_kill"):
        log.debug("interrupts are not held back inside the memory stack: enable() ran off the main thread "
                  "or signal.pthread_kill is missing")
        return False
    real_signal, real_getsignal = signal.signal, signal.getsignal

    def wrap(handler: Any) -> Any:
        return HeldBack(handler) if callable(handler) and not isinstance(handler, HeldBack) else handler

    def signal_(signalnum, handler):
        """``signal.signal``, the handler held back inside the memory stack's locks (apt_model)."""
        return _script_handler(real_signal(signalnum, wrap(handler)))

    def getsignal_(signalnum):
        """``signal.getsignal``: the script's own handler (apt_model)."""
        return _script_handler(real_getsignal(signalnum))

    def put_back() -> None:
        for signum in signal.valid_signals():
            try:
                current = real_getsignal(signum)
                if isinstance(current, HeldBack):
                    real_signal(signum, current.handler)
            except (OSError, ValueError):  # off the main thread, or a signal that cannot be set
                continue

    patches.add_undo(put_back, "the script's signal handlers (interrupts held back inside the memory stack)")
    for signum in signal.valid_signals():
        try:
            current = real_getsignal(signum)
            if callable(current) and not isinstance(current, HeldBack):
                real_signal(signum, HeldBack(current))
        except (OSError, ValueError):
            continue
    patches.set_attr(signal, "signal", signal_, label="signal.signal (handlers held back inside the memory stack)")
    patches.set_attr(signal, "getsignal", getsignal_, label="signal.getsignal (the script's own handlers)")
    return True
