"""Background I/O: reader threads and writer threads, so swap traffic overlaps compute.

Reads and writes release the GIL (``os.preadv``/``os.pwrite``), so they run while the training
thread computes. Separate readers keep prefetches from queueing behind evictions. Two threads per
direction keep two requests outstanding per direction: measured on the development VM with 4 MiB
pages, reads went from 1.13 GB/s (one thread) to 1.57 (two) and 1.73 (four), and mixed reads and
writes from 1.30 to 1.97 GB/s combined with two of each. Each direction counts bytes and busy
seconds (summed over its threads), giving achieved GB/s per thread.

Each direction also knows what it is doing — jobs queued, and which thread runs which job — so a
wait that times out (see :mod:`apt_model.memory.waits`) can say where the job it waited for is.
Closing is bounded too: threads that do not finish their queued jobs within the wait limit are
reported with a :class:`~apt_model.memory.swap.SwapTimeoutError`, not joined forever.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from apt_model.memory.interrupts import shielded
from apt_model.memory.waits import timeout_error, wait_timeout


class IOStats:
    """Bytes and busy seconds of one direction (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes = 0
        self.ops = 0
        self.seconds = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.bytes += nbytes
            self.ops += 1
            self.seconds += seconds

    @property
    def gbps(self) -> float | None:
        """Achieved GB/s while busy (None before any transfer)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else None

    def to_dict(self) -> dict:
        return {"bytes": self.bytes, "ops": self.ops, "busy_s": round(self.seconds, 4),
                "gbps": round(self.gbps, 3) if self.gbps else None}


class JobTicket:
    """The submitter's hold on one job, for when the submitting code is interrupted.

    Python raises ``KeyboardInterrupt`` (or whatever a signal handler raises) between any two
    bytecodes: also after a job was queued and before its future reached the caller. Then the
    caller does not know whether the job runs, yet its failure path wants to give back the memory
    the job reads from or writes into — a use after free on the I/O thread, which corrupted the C
    heap (found 2026-11-27 by a probe that sent SIGALRM during paged training). With a ticket,
    :meth:`settle` takes the job back if it has not started (it then never touches the memory), or
    waits for it to end; only after that is the memory the caller's again.

    States: ``new --job starts--> running --job ends--> done``; ``new --settle--> cancelled``.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._state = "new"
        self._done: threading.Event | None = None  # made only when a settle must wait (one per page I/O otherwise)

    def start(self) -> bool:
        """The job side: False when the job was taken back (it must not run)."""
        with self._lock:
            if self._state == "cancelled":
                return False
            self._state = "running"
            return True

    def finish(self) -> None:
        """The job side: the job is over."""
        with self._lock:
            self._state = "done"
            done = self._done
        if done is not None:
            done.set()

    @shielded  # it runs after an interrupt, in failure paths: a second one waits until it is over
    def settle(self, timeout: float) -> bool:
        """The submitter side: True when the job will never touch its memory again — taken back
        before it started (or never submitted), or over; False when it still ran after ``timeout``
        seconds (its memory must then stay as it is)."""
        with self._lock:
            if self._state == "new":
                self._state = "cancelled"
                return True
            if self._state == "done":
                return True
            if self._done is None:
                self._done = threading.Event()
            done = self._done
        return done.wait(timeout)


class DaemonThreadPool:
    """Up to ``threads`` daemon threads running submitted jobs in order, each job's outcome in a
    ``concurrent.futures.Future``: ``ThreadPoolExecutor`` without its join at interpreter exit.

    ``ThreadPoolExecutor`` joins its workers before the interpreter exits (before ``atexit``
    handlers run). A swap read that never returns — a stalled network or FUSE mount, a FIFO in
    place of a swap file — left a worker blocked in the kernel: after the
    :class:`~apt_model.memory.swap.SwapTimeoutError`, which was raised on time, the process could
    never exit (a probe's finding, 2026-11-29). Daemon threads are not joined: a thread stuck so
    ends with the process. A job that is running when the interpreter exits is cut off, which for
    the swap level only loses files that exit deletes anyway.

    Threads start as jobs arrive (one more per submit while under ``threads``) and are named
    ``<prefix>_<n>``. :meth:`shutdown` lets the jobs already queued run, then stops the threads.
    """

    def __init__(self, threads: int, prefix: str):
        if threads < 1:
            raise ValueError(f"threads={threads!r}: a pool needs at least 1 thread")
        self.max_threads = threads
        self._prefix = prefix
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self.threads: list[threading.Thread] = []

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Queue ``fn()``; its result or exception goes to the returned future.

        Raises:
            RuntimeError: the pool was shut down.
        """
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self._prefix} thread pool is shut down: no new jobs")
            self._jobs.put((fut, fn))
            self._grow()
        return fut

    def _grow(self) -> None:
        """One more thread while under ``max_threads`` (called at each submit, the lock held)."""
        if len(self.threads) < self.max_threads:
            t = threading.Thread(target=self._work, name=f"{self._prefix}_{len(self.threads)}", daemon=True)
            t.start()
            self.threads.append(t)

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                self._jobs.put(None)  # the next thread stops too
                return
            fut, fn = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(err)
            else:
                fut.set_result(result)
            del item, fut, fn  # the job's memory (a page's storage) is not held while idle

    def shutdown(self) -> None:
        """No new jobs; the threads stop once the queued ones ran (no wait here)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._jobs.put(None)


class _Direction:
    """One direction's thread pool and what it is doing (jobs queued, job per thread)."""

    def __init__(self, name: str, threads: int):
        self.name = name
        self.pid = os.getpid()  # the pool's threads exist in this process only (not in a forked child)
        self.pool = DaemonThreadPool(threads, f"vb-swap-{name}")
        self.stats = IOStats()
        self._lock = threading.Lock()
        self.queued = 0  # submitted, not started
        self.running: dict[str, tuple[str, float]] = {}  # thread name -> (label of the job it runs, its start)

    def submit(self, nbytes: int, fn: Callable[[], Any], label: str, ticket: JobTicket | None = None) -> Future:
        if os.getpid() != self.pid:
            from apt_model.memory.swap import ForkedPagingError

            raise ForkedPagingError(
                f"{label}: this process (pid {os.getpid()}) was forked by the process that pages the model (pid "
                f"{self.pid}) and uses its paged state; the swap I/O threads exist only there. Use the model in the "
                "parent, fork before enable(), or start workers with the 'spawn' method (they then load their own "
                "copy); DataLoader workers that do not touch the model are fine")

        def job():
            if ticket is not None and not ticket.start():
                with self._lock:
                    self.queued -= 1
                return None  # taken back by its submitter (see JobTicket)
            try:
                return counted()
            finally:
                if ticket is not None:
                    ticket.finish()

        def counted():
            me = threading.current_thread().name
            t0 = time.perf_counter()
            with self._lock:
                self.queued -= 1
                self.running[me] = (label, time.monotonic())
            try:
                out = fn()
            finally:
                with self._lock:
                    self.running.pop(me, None)
            self.stats.add(nbytes, time.perf_counter() - t0)
            return out

        with self._lock:
            self.queued += 1
        try:
            return self.pool.submit(job)
        except RuntimeError:  # shut down: the engine is closed
            with self._lock:
                self.queued -= 1
            from apt_model.memory.swap import SwapError

            raise SwapError(f"{label}: the swap I/O threads were closed (the paging session ended)") from None
        except BaseException:
            with self._lock:
                self.queued -= 1
            raise

    def describe(self) -> str:
        now = time.monotonic()
        with self._lock:
            running = ", ".join(f"{t} on {label} for {now - t0:.3g} s"
                                for t, (label, t0) in sorted(self.running.items())) or "none running"
            return f"{self.name} queue: {self.queued} waiting, {running}"

    def stalled(self, limit: float) -> bool:
        """Whether every thread of this direction runs a job it started more than ``limit`` seconds
        ago: no job queued behind them can start (a disk that stopped answering)."""
        now = time.monotonic()
        with self._lock:
            busy = [t0 for _, t0 in self.running.values()]
        return len(busy) >= self.pool.max_threads and all(now - t0 > limit for t0 in busy)


class IOEngine:
    """Runs read and write jobs on their own threads and counts them.

    Args:
        readers / writers: threads per direction.
    """

    def __init__(self, readers: int = 2, writers: int = 2):
        self._read = _Direction("read", readers)
        self._write = _Direction("write", writers)
        self.read_stats = self._read.stats
        self.write_stats = self._write.stats
        self._closed = False
        self.pid = os.getpid()  # the threads exist in this process only

    def forked(self) -> bool:
        """Whether this is a child made by ``os.fork()`` after the engine started: its threads and
        the jobs they were running exist only in the parent."""
        return os.getpid() != self.pid

    def submit_read(self, nbytes: int, fn: Callable[[], Any], label: str = "a read",
                    ticket: JobTicket | None = None) -> Future:
        """Run ``fn`` (which reads ``nbytes``) on a reader thread; ``label`` names it in errors;
        ``ticket`` lets an interrupted submitter take it back (:class:`JobTicket`)."""
        return self._read.submit(nbytes, fn, label, ticket)

    def submit_write(self, nbytes: int, fn: Callable[[], Any], label: str = "a write",
                     ticket: JobTicket | None = None) -> Future:
        """Run ``fn`` (which writes ``nbytes``) on a writer thread (see :meth:`submit_read`)."""
        return self._write.submit(nbytes, fn, label, ticket)

    def describe(self) -> str:
        """The queues now, for error messages: ``"read queue: 1 waiting, vb-swap-read_0 on ... for 3.2 s;
        write queue: ..."``."""
        return f"{self._read.describe()}; {self._write.describe()}"

    def stalled(self, direction: str | None = None) -> bool:
        """Whether the threads of ``direction`` (``"read"``, ``"write"``; None: either) are all stuck
        in jobs older than the wait limit (see :meth:`_Direction.stalled`): a wait for a job of that
        direction then gives up at once instead of after the limit again (``disable()`` after a
        swap disk stopped answering waited the limit once per page: 40 minutes for 21 pages, a
        probe's finding)."""
        limit = wait_timeout()
        if direction is not None:
            return (self._read if direction == "read" else self._write).stalled(limit)
        return self._read.stalled(limit) or self._write.stalled(limit)

    def close(self) -> None:
        """Finish queued jobs and stop the threads, waiting at most the wait limit in all.

        Raises:
            SwapTimeoutError: threads still busy after the limit (named, with their jobs); they are
                left running, as daemon threads of a closed engine (they do not keep the process
                from exiting).
        """
        if self._closed:
            return
        self._closed = True
        threads = []
        for d in (self._read, self._write):
            d.pool.shutdown()
            threads += list(d.pool.threads)
        limit = 0.0 if self.stalled() else wait_timeout()  # stuck already: one more wait changes nothing
        deadline = time.monotonic() + limit
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with self._read._lock, self._write._lock:  # alive and in a job: an idle thread is ending on its own
            busy = set(self._read.running) | set(self._write.running)
        stuck = [t.name for t in threads if t.is_alive() and t.name in busy]
        if stuck:
            raise timeout_error(
                f"waited {limit:g} s for the swap I/O threads to finish their queued jobs at close; still busy: "
                f"{', '.join(stuck)} ({self.describe()})"
            )
