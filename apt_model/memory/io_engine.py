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
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
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


class _Direction:
    """One direction's thread pool and what it is doing (jobs queued, job per thread)."""

    def __init__(self, name: str, threads: int):
        self.name = name
        self.pid = os.getpid()  # the pool's threads exist in this process only (not in a forked child)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"vb-swap-{name}")
        self.stats = IOStats()
        self._lock = threading.Lock()
        self.queued = 0  # submitted, not started
        self.running: dict[str, str] = {}  # thread name -> label of the job it runs

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
            with self._lock:
                self.queued -= 1
                self.running[me] = label
            t0 = time.perf_counter()
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
        except BaseException:
            with self._lock:
                self.queued -= 1
            raise

    def describe(self) -> str:
        with self._lock:
            running = ", ".join(f"{t} on {label}" for t, label in sorted(self.running.items())) or "none running"
            return f"{self.name} queue: {self.queued} waiting, {running}"


class IOEngine:
    """Runs read and write jobs on their own threads and counts them.

    Args:
        readers / writers: threads per direction.
    """

    def __init__(self, readers: int = 2, writers: int = 2):
        self._read = _Direction("read", readers)
        self._write = _Direction("write", writers)
        self._reader = self._read.pool  # the executors, for callers that queue a marker job
        self._writer = self._write.pool
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
        """The queues now, for error messages: ``"read queue: 1 waiting, vb-swap-read_0 on ...; write queue: ..."``."""
        return f"{self._read.describe()}; {self._write.describe()}"

    def close(self) -> None:
        """Finish queued jobs and stop the threads, waiting at most the wait limit in all.

        Raises:
            SwapTimeoutError: threads still busy after the limit (named, with their jobs); they are
                left running, as daemon-like workers of a closed engine.
        """
        if self._closed:
            return
        self._closed = True
        threads = []
        for d in (self._read, self._write):
            d.pool.shutdown(wait=False)
            threads += list(getattr(d.pool, "_threads", ()))
        limit = wait_timeout()
        deadline = time.monotonic() + limit
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            raise timeout_error(
                f"waited {limit:g} s for the swap I/O threads to finish their queued jobs at close; still busy: "
                f"{', '.join(stuck)} ({self.describe()})"
            )
