"""Background I/O: one reader thread and one writer thread, so swap traffic overlaps compute.

Reads and writes release the GIL (``os.preadv``/``os.pwrite``, ``zlib.crc32`` on large buffers),
so they run while the training thread computes. A separate reader keeps prefetches from
queueing behind evictions. Each direction counts bytes and busy seconds, giving achieved GB/s.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


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


class IOEngine:
    """Runs read and write jobs on their own threads and counts them."""

    def __init__(self):
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vb-swap-read")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vb-swap-write")
        self.read_stats = IOStats()
        self.write_stats = IOStats()
        self._closed = False

    def _timed(self, stats: IOStats, nbytes: int, fn: Callable[[], Any]) -> Callable[[], Any]:
        def job():
            t0 = time.perf_counter()
            out = fn()
            stats.add(nbytes, time.perf_counter() - t0)
            return out

        return job

    def submit_read(self, nbytes: int, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` (which reads ``nbytes``) on the reader thread."""
        return self._reader.submit(self._timed(self.read_stats, nbytes, fn))

    def submit_write(self, nbytes: int, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` (which writes ``nbytes``) on the writer thread."""
        return self._writer.submit(self._timed(self.write_stats, nbytes, fn))

    def close(self) -> None:
        """Finish queued jobs and stop the threads."""
        if not self._closed:
            self._closed = True
            self._reader.shutdown(wait=True)
            self._writer.shutdown(wait=True)
