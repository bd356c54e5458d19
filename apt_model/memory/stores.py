"""Where a page's bytes go when they leave the compute level: the levels below, as stores.

* :class:`DiskStore` — the swap files (the level below host RAM; on a CPU-only run, the level
  right below the compute memory, which *is* host RAM). Reads and writes run on the I/O threads.
* :class:`HostStore` — host RAM below an accelerator: page copies live in a :class:`PinnedPool`
  (pinned slabs allocated once and reused, never per-tensor pinning); when the host budget is
  full, the least recently used host copies spill to a :class:`DiskStore`.

A store moves bytes between a page's storage on the compute device and itself:
``start_write(page, storage) -> Future``, ``start_read(page, storage) -> Future`` and
``finish_read(page, storage)`` (the part that must run on the training thread, e.g. the
host-to-device copy after a disk read), plus ``has``, ``remove``, ``read_to_cpu`` and ``close``;
and, by key, ``rename(key, new_key)`` (a page's lower copy kept under another name: the previous
version an optimizer step may roll back to) and ``discard(key)``.

A background job holds the storage it reads from or writes into until it ends: the tensor that
owned it may be dropped by user code meanwhile (``zero_grad(set_to_none=True)`` while a gradient
is being written), and the job must never touch freed memory.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from apt_model.memory.io_engine import IOEngine
from apt_model.memory.pages import Page, cpu_byte_view
from apt_model.memory.swap import SwapSpace
from apt_model.memory.waits import TimedLock

_ALIGN = 4096


def _done(value=None) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def byte_view(storage: torch.UntypedStorage, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
    """A uint8 tensor over ``storage`` bytes ``[offset, offset + nbytes)`` on the storage's device."""
    n = storage.nbytes() - offset if nbytes is None else nbytes
    t = torch.empty(0, dtype=torch.uint8, device=storage.device)
    t.set_(storage, offset, (n,), (1,))
    return t


class DiskStore:
    """Pages in swap files, moved by the background I/O threads (CPU storages only)."""

    level_kind = "nvme"

    def __init__(self, swap: SwapSpace, io: IOEngine):
        self.swap = swap
        self.io = io

    def has(self, page: Page) -> bool:
        return self.swap.has(page.key)

    def start_write(self, page: Page, storage: torch.UntypedStorage) -> Future:
        view, key = cpu_byte_view(storage), page.key
        # the job holds ``storage``: its memory stays valid even if the tensor is dropped meanwhile
        return self.io.submit_write(page.nbytes, lambda storage=storage: self.swap.write(key, view),
                                    f"write of page {page.label} ({page.nbytes} bytes)")

    def start_read(self, page: Page, storage: torch.UntypedStorage) -> Future:
        view, key = cpu_byte_view(storage), page.key
        return self.io.submit_read(page.nbytes, lambda storage=storage: self.swap.read_into(key, view),
                                   f"read of page {page.label} ({page.nbytes} bytes)")

    def rename(self, key: str, new_key: str) -> bool:
        """Keep ``key``'s copy under ``new_key`` (no I/O). Returns False if there is none."""
        return self.swap.rename(key, new_key)

    def discard(self, key: str) -> None:
        """Forget the copy stored under ``key`` (no error if absent)."""
        self.swap.remove(key)

    def describe(self, key: str) -> str:
        """Where ``key``'s copy is, for error messages (its swap file, or "no copy")."""
        rec = self.swap.record(key)
        return f"swap file {rec.path}" if rec is not None else "no copy on the swap level"

    def finish_read(self, page: Page, storage: torch.UntypedStorage) -> None:
        return None

    def abort_read(self, page: Page) -> None:
        return None

    def read_to_cpu(self, page: Page, out: torch.Tensor) -> None:
        self.swap.read_into(page.key, cpu_byte_view(out.untyped_storage()))

    def remove(self, page: Page) -> None:
        self.swap.remove(page.key)

    def stats(self) -> dict:
        return {"bytes_on_disk": self.swap.bytes_on_disk, "written": self.io.write_stats.to_dict(),
                "read": self.io.read_stats.to_dict()}

    def close(self) -> None:
        self.io.close()
        self.swap.close()


class HostLevelFullError(MemoryError):
    """The pinned host level has no room for a page: everything left in it is a page read from
    disk whose copy to the device has not been made yet (``in_flight`` of them). The pager
    finishes those loads (which is what frees them) and tries again before giving up."""

    def __init__(self, message: str, in_flight: int = 0):
        super().__init__(message)
        self.in_flight = in_flight


@dataclass
class Segment:
    """A piece of a pinned slab: slab index, byte offset and size (bytes, rounded up to 4 KiB)."""

    slab: int
    offset: int
    nbytes: int  # as allocated (rounded up to 4 KiB)


class PinnedPool:
    """Host memory for page copies: slabs of ``slab_bytes`` allocated on demand (pinned when
    ``pin``), up to ``budget`` bytes, sub-allocated first-fit in 4 KiB units and reused.

    Raises:
        ValueError: for a budget below one 4 KiB unit.
    """

    def __init__(self, budget: int, pin: bool, slab_bytes: int = 64 * 2**20):
        if budget < _ALIGN:
            raise ValueError(f"host pool budget {budget} bytes is below one {_ALIGN}-byte unit")
        self.budget = budget
        self.pin = pin
        self.slab_bytes = min(slab_bytes, budget)
        self.slabs: list[torch.Tensor] = []
        self.free: list[list[tuple[int, int]]] = []  # per slab: sorted (offset, length) holes
        self.used = 0

    def _new_slab(self, at_least: int) -> int | None:
        size = max(self.slab_bytes, (at_least + _ALIGN - 1) // _ALIGN * _ALIGN)
        if sum(s.numel() for s in self.slabs) + size > self.budget:
            return None
        self.slabs.append(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin))
        self.free.append([(0, size)])
        return len(self.slabs) - 1

    def alloc(self, nbytes: int) -> Segment | None:
        """A segment of at least ``nbytes``, or None when the pool is full."""
        need = max(_ALIGN, (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)
        for si, holes in enumerate(self.free):
            for hi, (off, length) in enumerate(holes):
                if length >= need:
                    if length == need:
                        holes.pop(hi)
                    else:
                        holes[hi] = (off + need, length - need)
                    self.used += need
                    return Segment(si, off, need)
        si = self._new_slab(need)
        if si is None:
            return None
        return self.alloc(nbytes)

    def release(self, seg: Segment) -> None:
        holes = self.free[seg.slab]
        holes.append((seg.offset, seg.nbytes))
        holes.sort()
        merged: list[tuple[int, int]] = []
        for off, length in holes:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((off, length))
        self.free[seg.slab] = merged
        self.used -= seg.nbytes

    def view(self, seg: Segment, nbytes: int) -> torch.Tensor:
        return self.slabs[seg.slab][seg.offset:seg.offset + nbytes]


class HostStore:
    """Host RAM below an accelerator (Level 1), spilling to disk (Level 2) when full.

    Device-to-host and host-to-device copies run on the training thread (synchronously, from
    pinned memory); disk traffic runs on the I/O threads. Works for any device whose tensors
    support ``copy_`` to and from CPU tensors — a CPU "device" too, which is how the test suite
    exercises the three-level path without an accelerator.
    """

    level_kind = "host"

    def __init__(self, device: torch.device, budget: int, disk: DiskStore, pin: bool | None = None):
        self.device = torch.device(device)
        self.pool = PinnedPool(budget, pin=(self.device.type != "cpu") if pin is None else pin)
        self.disk = disk
        self.entries: dict[str, Segment] = {}
        self.on_disk: set[str] = set()  # pages whose disk copy is current
        self._lru: dict[str, int] = {}
        self._tick = 0
        self._lock = TimedLock("host level (pinned pool)")
        self.hits = self.misses = self.spills = 0
        self.bytes_in = self.bytes_out = 0
        self._nbytes: dict[str, int] = {}
        self._inflight: set[str] = set()  # read from disk into the host, not yet copied to the device

    # ---------------------------------------------------------------- host residency
    def _touch(self, key: str) -> None:
        self._tick += 1
        self._lru[key] = self._tick

    def _host_bytes(self, key: str) -> torch.Tensor:
        return self.pool.view(self.entries[key], self._nbytes[key])

    def _host_memoryview(self, key: str) -> memoryview:
        seg = self.entries[key]
        return cpu_byte_view(self.pool.slabs[seg.slab].untyped_storage())[seg.offset:seg.offset + self._nbytes[key]]

    def _spill_one(self, protect: str) -> bool:
        victims = sorted((k for k in self.entries if k != protect and k not in self._inflight),
                         key=lambda k: self._lru.get(k, 0))
        if not victims:
            return False
        key = victims[0]
        if key not in self.on_disk:
            nbytes = self._nbytes[key]
            t0 = time.perf_counter()
            self.disk.swap.write(key, self._host_memoryview(key))  # on this thread: the room is needed now
            self.disk.io.write_stats.add(nbytes, time.perf_counter() - t0)  # the NVMe level's counters
            self.on_disk.add(key)
            self.spills += 1
        self.pool.release(self.entries.pop(key))
        self._lru.pop(key, None)
        return True

    def _segment_for(self, key: str, nbytes: int) -> Segment:
        seg = self.entries.get(key)
        if seg is not None and seg.nbytes >= nbytes:
            return seg
        if seg is not None:
            self.pool.release(self.entries.pop(key))
        while True:
            seg = self.pool.alloc(nbytes)
            if seg is not None:
                break
            if not self._spill_one(protect=key):
                raise HostLevelFullError(
                    f"the host level ({self.pool.budget} bytes, {self.pool.used} in use) cannot hold the "
                    f"{nbytes}-byte page {key} next to the {len(self._inflight)} page(s) read into it and not yet "
                    "copied to the device; raise VB_HOST_BUDGET", in_flight=len(self._inflight)
                )
        self.entries[key] = seg
        self._nbytes[key] = nbytes
        return seg

    # ---------------------------------------------------------------- store interface
    def has(self, page: Page) -> bool:
        return page.key in self.entries or page.key in self.on_disk

    def start_write(self, page: Page, storage: torch.UntypedStorage) -> Future:
        with self._lock:
            self._segment_for(page.key, page.nbytes)
            self._host_bytes(page.key).copy_(byte_view(storage, 0, page.nbytes))  # device -> host
            self.on_disk.discard(page.key)  # the disk copy, if any, is stale now
            self.disk.remove(page)
            self._touch(page.key)
            self.bytes_in += page.nbytes
        return _done()

    def start_read(self, page: Page, storage: torch.UntypedStorage) -> Future:
        with self._lock:
            self._touch(page.key)
            if page.key in self.entries:
                self.hits += 1
                self._inflight.add(page.key)  # held until finish_read copies it up: never spilled before
                return _done()
            self.misses += 1
            self._segment_for(page.key, page.nbytes)
            self._inflight.add(page.key)
            view, key = self._host_memoryview(page.key), page.key
            return self.disk.io.submit_read(page.nbytes, lambda: self.disk.swap.read_into(key, view),
                                            f"read of page {page.label} ({page.nbytes} bytes) into the host level")

    def finish_read(self, page: Page, storage: torch.UntypedStorage) -> None:
        with self._lock:
            try:
                byte_view(storage, 0, page.nbytes).copy_(self._host_bytes(page.key))  # host -> device
            finally:
                self._inflight.discard(page.key)
            self.bytes_out += page.nbytes

    def abort_read(self, page: Page) -> None:
        """A disk read into the host failed: its host segment holds nothing valid."""
        with self._lock:
            if page.key in self._inflight:
                self._inflight.discard(page.key)
                seg = self.entries.pop(page.key, None)
                if seg is not None:
                    self.pool.release(seg)

    def read_to_cpu(self, page: Page, out: torch.Tensor) -> None:
        with self._lock:
            dst = byte_view(out.untyped_storage(), 0, page.nbytes)
            if page.key in self.entries:
                dst.copy_(self._host_bytes(page.key))
            else:
                self.disk.read_to_cpu(page, out)

    def remove(self, page: Page) -> None:
        self.discard(page.key)

    def discard(self, key: str) -> None:
        """Forget the copies (host and disk) stored under ``key``."""
        with self._lock:
            self._inflight.discard(key)
            seg = self.entries.pop(key, None)
            if seg is not None:
                self.pool.release(seg)
            self._nbytes.pop(key, None)
            self._lru.pop(key, None)
            self.on_disk.discard(key)
            self.disk.discard(key)

    def rename(self, key: str, new_key: str) -> bool:
        """Keep ``key``'s copies (host segment and/or disk file) under ``new_key``, no copying.
        Returns False if there are none."""
        with self._lock:
            if key not in self.entries and key not in self.on_disk:
                return False
            self.discard(new_key)
            if key in self.entries:
                self.entries[new_key] = self.entries.pop(key)
                self._nbytes[new_key] = self._nbytes.pop(key)
                self._lru[new_key] = self._lru.pop(key, 0)
            if key in self.on_disk:
                self.on_disk.discard(key)
                self.on_disk.add(new_key)
            self.disk.rename(key, new_key)
            return True

    def describe(self, key: str) -> str:
        """Where ``key``'s copy is, for error messages."""
        if key in self.entries:
            return "the host level"
        return self.disk.describe(key)

    def stats(self) -> dict:
        return {"resident_bytes": self.pool.used, "capacity": self.pool.budget, "pinned": self.pool.pin,
                "slabs": len(self.pool.slabs), "hits": self.hits, "misses": self.misses, "spills_to_disk": self.spills,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "disk": self.disk.stats()}

    def close(self) -> None:
        self.disk.close()
