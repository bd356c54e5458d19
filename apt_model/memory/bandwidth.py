"""Bandwidth of each memory level, measured on this machine (cached per process).

* compute-device memory: a device-to-device copy (CPU: a host ``memcpy``), reported as bytes
  read + written per second, the way memory bandwidth is usually quoted;
* host <-> device link (accelerators only): pinned host-to-device and device-to-host copies;
* NVMe (the swap folder's disk): a file written with ``fdatasync`` and read back after its
  pages were dropped from the page cache — the path paging itself uses.

Each figure is the median of a few runs after a warm-up. The disk probe writes up to 64 MiB to
the swap folder and deletes it — less when the disk has less room: it never takes more than half
of the free space, and a figure from a probe smaller than asked is marked as rough. With less
than :data:`MIN_PROBE_BYTES` usable the disk is not measured (its figure is None and the note
says why); nothing fails because of the probe. Numbers are never constants: a stack printed on
another machine shows that machine's measurements.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from apt_model.devices.timing import synchronize
from apt_model.base.log import get_logger
from apt_model.memory.waits import ENV, TimedLock, timeout_error, wait_timeout

log = get_logger(__name__)


_cache: dict[tuple, dict] = {}
#: The smallest disk probe worth timing (bytes): below this the disk is reported as not measured.
MIN_PROBE_BYTES = 256 * 1024
_lock = TimedLock("bandwidth probe", holds_back_signals=False)  # held for seconds; guards no page


def _median_time(fn, reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


_sync = synchronize  # the device layer's one "wait for the device" (devices/timing.py)


def measure_memory(device: torch.device, mb: int = 64) -> float:
    """Copy bandwidth of ``device`` memory in GB/s (bytes read + written)."""
    n = mb * 2**20
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    a.fill_(1)

    def run():
        b.copy_(a)
        _sync(device)

    return 2 * n / _median_time(run) / 1e9


def measure_link(device: torch.device, mb: int = 64) -> dict:
    """Pinned host<->device copy bandwidth in GB/s: ``{"h2d": ..., "d2h": ...}``."""
    n = mb * 2**20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=device)

    def h2d():
        dev.copy_(host, non_blocking=True)
        _sync(device)

    def d2h():
        host.copy_(dev, non_blocking=True)
        _sync(device)

    return {"h2d": n / _median_time(h2d) / 1e9, "d2h": n / _median_time(d2h) / 1e9}


def measure_disk(folder: str | os.PathLike, mb: int = 64, threads: int = 2, info: dict | None = None) -> dict:
    """Write and cold-read bandwidth of ``folder``'s disk in GB/s, measured the way the swap level
    moves data: 4 MiB files through :class:`~apt_model.memory.swap.SwapSpace` (O_DIRECT where
    supported, checksums included), ``threads`` requests in flight per direction.

    The probe writes up to ``mb`` MiB, but never more than half of the disk's free space: on a
    nearly full disk (or a small tmpfs) it uses fewer and smaller files, and ``info`` (if given)
    gets ``probe_bytes`` and a ``note`` saying the figure is rough.

    Returns:
        ``{"write": GB/s, "read": GB/s}``.

    Raises:
        SwapFullError: less than :data:`MIN_PROBE_BYTES` of room (or the disk filled up under the
            probe): the message says the probe could not run and how much room there is.
        SwapError / SwapTimeoutError: the probe's I/O failed or did not finish in time.
    """
    from apt_model.memory.io_engine import DaemonThreadPool
    from apt_model.memory.swap import SwapFullError, SwapSpace

    space = SwapSpace(folder)
    try:
        free = space.free_bytes()
        want = mb << 20
        room = min(want, free // 2)
        if room < MIN_PROBE_BYTES:
            raise SwapFullError(
                f"the disk bandwidth probe was skipped: {folder} has {free} bytes free, and the probe needs at "
                f"least {2 * MIN_PROBE_BYTES} (it never takes more than half); paging itself may still fit"
            )
        page = 4 << 20
        while page > room and page > 64 * 1024:
            page //= 2
        n = max(1, room // page)
        if info is not None:
            info["probe_bytes"] = n * page
            if n * page < want:
                info["note"] = (f"rough: a {n * page}-byte disk probe instead of {want} bytes, "
                                f"only {free} bytes free there")
    except BaseException:
        space.close()
        raise
    data = memoryview(bytearray(os.urandom(page)))
    outs = [memoryview(bytearray(page)) for _ in range(n)]
    limit = wait_timeout()
    # daemon threads: one stuck in the disk must not keep the process from exiting (io_engine.py)
    pool = DaemonThreadPool(threads, "vb-bw-disk")
    try:
        def run(what, fn):
            futures = [pool.submit(lambda i=i: fn(i)) for i in range(n)]
            deadline = time.monotonic() + limit
            for fut in futures:
                try:
                    fut.result(timeout=max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise timeout_error(
                        f"waited {limit:g} s for the disk bandwidth probe to {what} {n} files of {page} bytes in "
                        f"{space.folder}; raise {ENV} if the disk is just slow"
                    ) from None

        w = _median_time(lambda: run("write", lambda i: space.write(f"bw{i}", data)), reps=2)
        r = _median_time(lambda: run("read", lambda i: space.read_into(f"bw{i}", outs[i])), reps=2)
    except BaseException as err:
        if isinstance(err, SwapFullError):
            raise SwapFullError(f"the disk bandwidth probe could not write its {n * page} bytes: {err}") from err
        raise
    finally:
        pool.shutdown()  # never joined: a failed or timed-out probe may leave a thread stuck in the disk
        space.close()
    return {"write": n * page / w / 1e9, "read": n * page / r / 1e9}


def measure_bandwidths(device: torch.device, swap_folder: str | os.PathLike, refresh: bool = False) -> dict:
    """All level bandwidths (GB/s) for ``device`` and the disk of ``swap_folder``, cached per process.

    Returns:
        ``{"device_memory": float, "link": {"h2d", "d2h"} | None, "disk": {"write", "read"} | None,
        "disk_probe": {"probe_bytes", "note"}, "seconds": float}`` — ``disk`` is None when the swap
        folder's disk had too little room for a probe (``disk_probe["note"]`` says so).
    """
    from apt_model.memory.swap import SwapError

    key = (str(device), str(Path(swap_folder).resolve().parent))
    with _lock:
        if key in _cache and not refresh:
            return _cache[key]
        t0 = time.perf_counter()
        out = {
            "device_memory": round(measure_memory(device), 2),
            "link": None if device.type == "cpu" else {k: round(v, 2) for k, v in measure_link(device).items()},
        }
        probe: dict = {}
        try:
            out["disk"] = {k: round(v, 3) for k, v in measure_disk(swap_folder, info=probe).items()}
        except SwapError as err:  # no room for a probe, or its I/O failed: no figure, never a failed adoption
            # (until 2026-11-29 only a full disk was caught: a file-size limit made the probe's write
            # fail with EINVAL, and training stopped there: a probe's finding). Paging meets the same
            # disk later, with its own errors where they apply.
            out["disk"] = None
            probe["note"] = f"not measured: {err}"
            log.warning("swap disk bandwidth not measured: %s", err)
        out["disk_probe"] = probe
        out["seconds"] = round(time.perf_counter() - t0, 3)
        _cache[key] = out
        return out
