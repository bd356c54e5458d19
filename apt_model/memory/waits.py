"""Bounded waits for the memory stack: no wait of the pager, the stores, the I/O engine or the
activation offloader can block forever.

Every place that blocks — waiting for a background read or write (``Future.result``), taking a
lock another thread may hold, joining the I/O threads at close — goes through this module and
gives up after :func:`wait_timeout` seconds with a :class:`~apt_model.memory.swap.SwapTimeoutError`
(a :class:`~apt_model.memory.swap.SwapError`) that names what it waited for: the page or saved
activation, its size in bytes, the level it was moving to or from, and the state of the I/O
queues (jobs waiting and running, and which thread runs which job) or the thread holding the lock.

The limit is ``VB_SWAP_TIMEOUT`` (seconds, default 120 — generous: one wait covers one page's
read or write, or one lock hand-over, never a whole training step), or :func:`set_wait_timeout`
(which tests use to make a stuck wait fail in a fraction of a second).
"""
from __future__ import annotations

import _thread
import re
import threading
import time
from concurrent.futures import Future
from typing import Any

from apt_model.base.settings import positive_seconds, read_env
from apt_model.memory.interrupts import deliver_held_back, shielded, track_lock
from apt_model.memory.settings import SWAP_TIMEOUT

#: Seconds a wait may block when neither ``VB_SWAP_TIMEOUT`` nor :func:`set_wait_timeout` says otherwise.
DEFAULT_TIMEOUT_S = SWAP_TIMEOUT.default
ENV = SWAP_TIMEOUT.env

_override: float | None = None


def _check(seconds, source: str) -> float:
    return positive_seconds(seconds, source)


def timeout_error(message: str):
    """A :class:`~apt_model.memory.swap.SwapTimeoutError` with ``message`` (for callers to raise)."""
    from apt_model.memory.swap import SwapTimeoutError  # swap.py uses TimedLock: import here, not at the top

    return SwapTimeoutError(message)


def wait_timeout() -> float:
    """Seconds any single wait of the memory stack may block: the value given to
    :func:`set_wait_timeout`, else ``VB_SWAP_TIMEOUT``, else :data:`DEFAULT_TIMEOUT_S`.

    Raises:
        ConfigError: ``VB_SWAP_TIMEOUT`` is not a positive, finite number of seconds.
    """
    if _override is not None:
        return _override
    found = read_env(SWAP_TIMEOUT)
    return DEFAULT_TIMEOUT_S if found is None else found[0]


def set_wait_timeout(seconds: float | None) -> float | None:
    """Set the wait limit in seconds for this process (None: back to ``VB_SWAP_TIMEOUT`` or the
    default). Returns the previous override (None if there was none).

    Raises:
        ConfigError: ``seconds`` is not a positive, finite number.
    """
    global _override
    previous = _override
    _override = None if seconds is None else _check(seconds, "wait timeout")
    return previous


#: Seconds between two looks for a held-back interrupt while a wait blocks (see :func:`wait_future`).
SLICE_S = 0.05


@shielded  # threading.Condition.wait is not safe to interrupt: signals wait for the next slice
def wait_future(fut: Future, what: str, io: Any = None, direction: str | None = None) -> Any:
    """The result of ``fut`` (re-raising its exception), waiting at most :func:`wait_timeout` seconds.

    A cancellation point: a signal held back by :mod:`~apt_model.memory.interrupts` (also one that
    arrives during the wait) has its handler called here, within :data:`SLICE_S` seconds — its
    exception comes out of this call, the job still running — so every caller must meet an
    interrupt here (take the job back or wait for it before its memory goes).

    Args:
        fut: the background job's future.
        what: what is awaited, for the error (``"read of page blocks.0.weight (65536 bytes) from the nvme level"``).
        io: the :class:`~apt_model.memory.io_engine.IOEngine` running the job, or None: its queues'
            state goes in the error, read when the wait gives up (read when it began, it said
            "none running" of threads stuck in the job: a probe's finding); where its threads are
            all stuck already (:meth:`~apt_model.memory.io_engine.IOEngine.stalled`), the wait gives
            up at once rather than after the limit again.
        direction: ``"read"`` or ``"write"``: the direction whose threads run the job (None: a
            stall of either counts).

    Raises:
        SwapTimeoutError: the job did not finish in time (it keeps running; nothing was freed).
        whatever the job raised, or a held-back signal's handler raised.
    """
    limit = wait_timeout()
    t0 = time.monotonic()
    deadline = t0 + limit
    while True:
        try:
            return fut.result(timeout=max(0.0, min(SLICE_S, deadline - time.monotonic())))
        except TimeoutError:
            if fut.done():  # it ended as the slice did (or itself raised a TimeoutError: re-raised)
                return fut.result()
        deliver_held_back()
        now = time.monotonic()
        stalled = io is not None and now < deadline and io.stalled(direction)
        if now >= deadline or stalled:
            waited = (f"waited {limit:g} s for the {what}, which has not finished" if not stalled else
                      f"gave up after {now - t0:.2g} s on the {what}: every I/O thread of its direction has been "
                      f"stuck in a job for more than {limit:g} s")
            raise timeout_error(
                waited + (f"; {io.describe()}" if io is not None else "")
                + f"; raise {ENV} if the disk is just slow, else look for a stuck swap disk or a blocked I/O thread"
            ) from None


class TimedLock(_thread.RLock):
    """A re-entrant lock whose acquisition gives up after :func:`wait_timeout` seconds.

    Used as ``with lock:``; the error names the lock and the thread holding it.

    Safe against asynchronous interrupts (a ``KeyboardInterrupt`` raised by a signal handler, which
    CPython delivers at the first instruction of any Python function and after calls):

    * ``__exit__`` is the C lock's own: leaving a ``with`` block runs no Python frame before the
      release, so no interrupt can land between the block's end and the release. (A Python
      ``__exit__`` met a pending signal at its first instruction and left the lock held for good:
      the I/O threads then timed out on it, found by a probe sending SIGALRM during training.)
    * ``__enter__`` gives back what it took when interrupted after the acquire: the ``with`` block
      never runs then, so ``__exit__`` never would. Holds of an outer ``with`` of the same thread
      are kept.
    * Once ``enable()`` built a memory stack, a signal's handler is held back while the main
      thread holds a TimedLock (:mod:`~apt_model.memory.interrupts`): the two points above
      matter only where it is not installed, or after its longest hold.

    Args:
        name: what the lock protects, for the error (``"pager (level 0)"``).
        holds_back_signals: whether signals wait while the main thread holds it (False for a lock
            that guards no paging state and may be held for seconds: the bandwidth probe's).

    Raises:
        SwapTimeoutError: (on ``__enter__``) the lock was not free within the limit.
    """

    def __init__(self, name: str, holds_back_signals: bool = True):
        self.name = name
        if holds_back_signals:  # a signal's handler is held back while the main thread holds it
            track_lock(self)

    def __enter__(self) -> "TimedLock":
        before = self.holds()
        try:
            if not self.acquire(blocking=False):
                limit = wait_timeout()
                t0 = time.monotonic()
                if not self.acquire(timeout=limit):
                    raise timeout_error(
                        f"waited {time.monotonic() - t0:.3g} s for the {self.name} lock, held by thread "
                        f"{self.owner!r} all that time (thread {threading.current_thread().name!r} wanted it); "
                        f"raise {ENV} if that thread is only slow"
                    )
            return self
        except BaseException:
            for _ in range(self.holds() - before):  # an interrupt after the acquire: give it back
                self.release()
            raise

    def holds(self) -> int:
        """How many times the calling thread holds the lock (0: not at all)."""
        if not self._is_owned():  # the C lock's own record (threading.Condition uses it too)
            return 0
        found = _COUNT.search(_thread.RLock.__repr__(self))
        return int(found.group(1)) if found else 1

    @property
    def owner(self) -> str | None:
        """Name of the thread holding the lock, or None (free, or held by a thread that ended)."""
        found = _OWNER.search(_thread.RLock.__repr__(self))
        ident = int(found.group(1)) if found else 0
        if not ident:
            return None
        return next((t.name for t in threading.enumerate() if t.ident == ident), f"thread id {ident}")


#: Fields of the C re-entrant lock's ``repr`` (``<locked _thread.RLock object owner=N count=N at 0x..>``,
#: the only public view of its hold count).
_COUNT = re.compile(r"\bcount=(\d+)")
_OWNER = re.compile(r"\bowner=(\d+)")
