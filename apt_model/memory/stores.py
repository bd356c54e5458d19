"""Where a page's bytes go when they leave the compute level: the levels below, as stores.

* :class:`DiskStore` — the swap files (the level below host RAM; on a CPU-only run, the level
  right below the compute memory, which *is* host RAM). Reads and writes run on the I/O threads.
* :class:`HostStore` — host RAM below an accelerator: page copies live in a :class:`PinnedPool`
  (pinned slabs allocated once and reused, never per-tensor pinning); when the host budget is
  full, the least recently used host copies spill to a :class:`DiskStore`. On an accelerator its
  copies run on two side copy streams (one per direction), ordered with events
  (:mod:`apt_model.devices.streams`).

A store moves bytes between a page's storage on the compute device and itself:
``start_write(page, storage) -> Future``, ``start_read(page, storage) -> Future`` and
``finish_read(page, storage)`` (the part that must run on the training thread, e.g. the
host-to-device copy after a disk read; afterwards the bytes are in ``storage`` for work queued on
the calling thread's current stream), ``abort_read(page)``, plus ``has``, ``remove``,
``read_to_cpu`` and ``close``; and, by key, ``rename(key, new_key)`` (a page's lower copy kept under another name: the previous
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

from apt_model.base.log import get_logger
from apt_model.devices import streams as device_streams
from apt_model.memory.io_engine import IOEngine, JobTicket
from apt_model.memory.pages import Page, cpu_byte_view
from apt_model.memory.swap import SwapSpace
from apt_model.memory.waits import ENV as WAIT_ENV
from apt_model.memory.waits import TimedLock, timeout_error, wait_timeout

log = get_logger(__name__)

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
    writes_in_order = False  # the I/O threads complete writes in any order (the pager's reap)

    def __init__(self, swap: SwapSpace, io: IOEngine, owns_swap: bool = True):
        """``owns_swap``: whether :meth:`close` deletes the swap folder too. The switch's paging
        session passes False: the folder is the VGPU stack's, shared with the activation
        offloader, whose saved activations a backward after ``disable()`` still reads (the paging
        session, closed first, deleted the folder under them until 2026-11-28: a probe's finding)."""
        self.swap = swap
        self.io = io
        self.owns_swap = owns_swap

    def has(self, page: Page) -> bool:
        return self.swap.has(page.key)

    def start_write(self, page: Page, storage: torch.UntypedStorage, ticket: JobTicket | None = None) -> Future:
        view, key = cpu_byte_view(storage), page.key
        # the job holds ``storage``: its memory stays valid even if the tensor is dropped meanwhile
        return self.io.submit_write(page.nbytes, lambda storage=storage: self.swap.write(key, view),
                                    f"write of page {page.label} ({page.nbytes} bytes)", ticket)

    def start_read(self, page: Page, storage: torch.UntypedStorage, ticket: JobTicket | None = None) -> Future:
        view, key = cpu_byte_view(storage), page.key
        return self.io.submit_read(page.nbytes, lambda storage=storage: self.swap.read_into(key, view),
                                   f"read of page {page.label} ({page.nbytes} bytes)", ticket)

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

    def in_memory(self, page: Page) -> bool:
        """Always False: every copy here is on disk (see :meth:`HostStore.in_memory`)."""
        return False

    def host_tensor(self, page: Page, like: torch.Tensor) -> None:
        """Always None: no copy here is in memory (see :meth:`HostStore.host_tensor`)."""
        return None

    def read_to_cpu(self, page: Page, out: torch.Tensor) -> None:
        self.swap.read_into(page.key, cpu_byte_view(out.untyped_storage()))

    def remove(self, page: Page) -> None:
        self.swap.remove(page.key)

    def forget(self, page: Page) -> None:
        """Drop ``page``'s copy and its file for good: the page is no longer managed."""
        self.swap.delete(page.key)

    def stats(self) -> dict:
        return {"bytes_on_disk": self.swap.bytes_on_disk, "written": self.io.write_stats.to_dict(),
                "read": self.io.read_stats.to_dict()}

    def close(self) -> None:
        self.io.close()
        if self.owns_swap:
            self.swap.close()


class HostLevelFullError(MemoryError):
    """The pinned host level has no room for a page: everything left in it is a page read from
    disk whose copy to the device has not been made yet (``in_flight`` of them). The pager
    finishes those loads (which is what frees them) and tries again before giving up."""

    def __init__(self, message: str, in_flight: int = 0):
        super().__init__(message)
        self.in_flight = in_flight


def pinned_bytes(nbytes: int, pin: bool = True) -> int:
    """Host bytes a ``torch.empty(nbytes, pin_memory=True)`` takes: PyTorch's caching host allocator
    rounds every pinned allocation up to a power of two before asking the driver for it
    (``ATen/core/CachingHostAllocator.h``, ``PowerOf2Ceil``), so 65 MiB pins 128 MiB. Unpinned
    (``pin`` False): ``nbytes``."""
    nbytes = int(nbytes)
    if not pin or nbytes <= 1:
        return max(nbytes, 0)
    return 1 << (nbytes - 1).bit_length()


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


@dataclass
class Segment:
    """A piece of a pinned slab: slab index, byte offset and size (bytes, rounded up to 4 KiB)."""

    slab: int
    offset: int
    nbytes: int  # as allocated (rounded up to 4 KiB)


class PinnedPool:
    """Host memory for page copies: slabs of ``slab_bytes`` allocated on demand (pinned when
    ``pin``), up to ``budget`` bytes, sub-allocated first-fit in 4 KiB units and reused. Pinned
    slabs are powers of two (:func:`pinned_bytes`: what PyTorch pins for them anyway), so the bytes
    counted against the budget are the bytes pinned. A page larger than ``slab_bytes`` gets a slab
    of its own, rounded up the same way (its rest holds other pages) where that fits the budget;
    where only the page's own size fits, the slab is that size, as the pool has always held such a
    page, and PyTorch pins more than the budget says: :attr:`pinned_bytes` counts it.

    A segment a copy may still read or write is given back with :meth:`release_after` and that
    copy's event: it stays counted, and is neither handed out nor merged, until :meth:`reclaim`
    sees the copy complete (the host level and the activation offloader both give segments back
    this way). Slabs are never freed while the pool lives.

    Raises:
        ValueError: for a budget below one 4 KiB unit.
    """

    def __init__(self, budget: int, pin: bool, slab_bytes: int = 64 * 2**20):
        if budget < _ALIGN:
            raise ValueError(f"host pool budget {budget} bytes is below one {_ALIGN}-byte unit")
        self.budget = budget
        self.pin = pin
        self.slab_bytes = self._slab_cap(slab_bytes)
        self.slabs: list[torch.Tensor] = []
        self.free: list[list[tuple[int, int]]] = []  # per slab: sorted (offset, length) holes
        self.used = 0
        #: segments given back while a copy used them, oldest first: (segment, the copy's event)
        self.pending: list[tuple[Segment, device_streams.CopyEvent]] = []

    def _slab_cap(self, slab_bytes: int) -> int:
        """The standard slab size within the budget (pinned: a power of two)."""
        return min(slab_bytes, _pow2_floor(self.budget) if self.pin else self.budget)

    def _own_size(self, nbytes: int) -> int:
        """At least ``slab_bytes``, room for ``nbytes`` in 4 KiB units."""
        return max(self.slab_bytes, (int(nbytes) + _ALIGN - 1) // _ALIGN * _ALIGN)

    def slab_size_for(self, nbytes: int) -> int:
        """Bytes a new slab holding an ``nbytes`` segment takes (and counts against the budget):
        at least ``slab_bytes``, in 4 KiB units; pinned, rounded up to a power of two."""
        return pinned_bytes(self._own_size(nbytes), self.pin)

    @property
    def pinned_bytes(self) -> int:
        """Host bytes the slabs really take (pinned ones rounded up to a power of two each)."""
        return sum(pinned_bytes(s.numel(), self.pin) for s in self.slabs)

    def _new_slab(self, at_least: int) -> int | None:
        size = self.slab_size_for(at_least)
        held = sum(s.numel() for s in self.slabs)
        if held + size > self.budget:
            size = self._own_size(at_least)  # the page's own size (PyTorch pins it rounded up)
            if held + size > self.budget:
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

    def shrink(self, nbytes: int) -> None:
        """Give ``nbytes`` of the budget to another user of host memory (never below one 4 KiB
        unit); slabs allocated from now on fit the smaller budget."""
        self.budget = max(self.budget - int(nbytes), _ALIGN)
        self.slab_bytes = self._slab_cap(self.slab_bytes)

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

    def release_after(self, seg: Segment, event: device_streams.CopyEvent | None) -> None:
        """Give ``seg`` back once ``event`` (the last copy that reads or writes it) completed: now
        if there is none or it has, else at a later :meth:`reclaim`."""
        if event is None or event.done():
            self.release(seg)
        else:
            self.pending.append((seg, event))

    def reclaim(self) -> None:
        """Give back the segments of :attr:`pending` whose copies completed."""
        if self.pending:
            left = []
            for seg, event in self.pending:
                if event.done():
                    self.release(seg)
                else:
                    left.append((seg, event))
            self.pending = left

    def view(self, seg: Segment, nbytes: int) -> torch.Tensor:
        return self.slabs[seg.slab][seg.offset:seg.offset + nbytes]


class HostStore:
    """Host RAM below an accelerator (Level 1), spilling to disk (Level 2) when full.

    **Copies overlap compute on accelerators.** Device-to-host and host-to-device copies run on
    two side *copy streams* (:class:`~apt_model.devices.streams.CopyStream`), one per direction,
    ordered against the calling thread's current (compute) stream with events. One stream per
    direction lets a load up run while writes down are queued (a GPU moves the two directions on
    separate copy engines): on one stream, a prefetch issued in backward queued behind every
    gradient write already queued, each waiting for the compute that produces its gradient, and
    started only once they had completed (until 2026-11-27). A load up still waits for the point
    compute had reached when it was issued (see below), not for the writes. Two copies touching one
    host segment on the two streams are ordered by an event (:meth:`_behind`). The training
    thread never waits for
    the device as a whole (no device-wide synchronize), and waits for one copy's event only where
    the bytes are needed on the host now. Disk traffic runs on the I/O threads. On the CPU (and a
    device without usable streams and events) the copies are plain synchronous ``copy_`` calls —
    which is how the test suite exercises the three-level path without an accelerator, with a
    fake stream layer to make the copies late.

    How each copy is ordered, and when memory is given back:

    * **Device -> host** (:meth:`start_write`): an event is recorded on the compute stream (the
      page's bytes are final there), the copy stream waits for it, copies into the page's pinned
      segment (``non_blocking``) and records a *done* event; the returned future's ``done()`` is
      that event's ``query()`` and ``result(timeout)`` waits for that event only, bounded. The
      page's device memory is freed by the pager only once that future is done (the page stays
      WRITING until then, and counts on the level): memory is never handed back to the caching
      allocator while the copy stream still reads it. This was chosen over ``record_stream``,
      which frees at once but lets the allocator hold the block for an unknown time — the pager's
      books would then show free memory the device does not have — and which is not a generic
      API across device kinds. The copy event also holds the storage until it completes, so a
      tensor dropped meanwhile (``zero_grad(set_to_none=True)``) cannot free it early either.
      Until the copy completed, the segment is never spilled to disk (spilling reads it on the
      CPU) nor reused.
    * **Host -> device** (:meth:`start_read` / :meth:`finish_read`): a host hit starts the copy at
      :meth:`start_read` time (so a prefetch overlaps compute), after the point the compute stream
      had reached (the page's device memory was just handed out by the caching allocator on the
      compute stream: earlier kernels there may still use the block); a page read from disk is
      copied at :meth:`finish_read` (after its disk read completed), after the point compute had
      reached at :meth:`start_read`. :meth:`finish_read` makes the compute stream wait for the
      copy's event on the device — the host does not block. The host segment stays *in flight*
      (not spillable, not reusable) until that event completed; it is given back lazily: every
      call that needs room first releases the segments whose copies completed, and when only
      in-flight segments are left, waits for the oldest copy's event (bounded), not the device.
    * :meth:`abort_read` and :meth:`discard` of a page whose copy to the device is in flight make
      the compute stream wait for it before the caller frees the page's device memory.

    Args:
        device: the compute device.
        budget: bytes of the host level (the pinned pool's budget).
        disk: the level below (swap files).
        pin: pin the slabs (default: on any device but the CPU).

    Raises:
        HostLevelFullError: (from :meth:`start_write` / :meth:`start_read`) no room is left but
            pages read into the level and not yet copied to the device.
        SwapTimeoutError: (idem, and :meth:`read_to_cpu`) a copy whose segment was needed did not
            complete within ``VB_SWAP_TIMEOUT`` seconds.
    """

    level_kind = "host"
    #: page writes complete in the order they began: all are copies on the one stream of copies
    #: down (asynchronous) or done at once (the CPU), never on the I/O threads (the pager's reap)
    writes_in_order = True

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
        #: bytes written into this level by what they are (``Page.kind``: param, grad, state, pre-step copy)
        self.bytes_in_by_kind: dict[str, int] = {}
        self._nbytes: dict[str, int] = {}
        self._inflight: set[str] = set()  # being read (start_read), not yet finished: never spilled
        self._from_disk: set[str] = set()  # of those, the ones read from disk into the host (misses)
        #: the side streams of the copies down (device -> host) and up (host -> device); None:
        #: synchronous copies (the CPU). Where a second stream cannot be made, both are one.
        self.down, self.up = device_streams.copy_streams(self.device)
        # segments with a copy in flight, in issue order: id(segment) -> (segment, its latest copy)
        self._copying: dict[int, tuple[Segment, device_streams.CopyEvent]] = {}
        self._loads: dict[str, device_streams.CopyEvent] = {}  # host-to-device copies started by start_read
        self._marks: dict[str, object] = {}  # misses: where compute was at start_read (the copy starts after it)
        self.copy_waits = 0  # host waits for one copy's event, to get room

    # ---------------------------------------------------------------- host residency
    def _touch(self, key: str) -> None:
        self._tick += 1
        self._lru[key] = self._tick

    def _host_bytes(self, key: str) -> torch.Tensor:
        return self.pool.view(self.entries[key], self._nbytes[key])

    def _host_memoryview(self, key: str) -> memoryview:
        seg = self.entries[key]
        return cpu_byte_view(self.pool.slabs[seg.slab].untyped_storage())[seg.offset:seg.offset + self._nbytes[key]]

    def _track(self, seg: Segment, event: device_streams.CopyEvent) -> None:
        """``event`` is the latest copy reading or writing ``seg``. It completing means every earlier
        copy of ``seg`` did: those on its stream complete in issue order, and a copy on the other
        stream came after them (:meth:`_behind`)."""
        self._copying.pop(id(seg), None)
        self._copying[id(seg)] = (seg, event)

    def _reclaim(self) -> None:
        """Forget the copies that completed; give their released segments back to the pool.
        ``_copying`` is in issue order (:meth:`_track` re-inserts), so the device is asked about
        the oldest running copy of each stream only (:func:`~apt_model.devices.streams.completed`;
        asking every copy was the volume the H200's profile had counted before the issue-order rule)."""
        for sid in device_streams.completed((sid, event) for sid, (_, event) in self._copying.items()):
            del self._copying[sid]
        self.pool.reclaim()

    def _release(self, seg: Segment) -> None:
        """Give ``seg`` back to the pool — once its copy in flight, if any, completed."""
        held = self._copying.get(id(seg))
        self.pool.release_after(seg, None if held is None else held[1])

    def _busy(self, seg: Segment) -> bool:
        return id(seg) in self._copying

    def _behind(self, seg: Segment, stream: device_streams.CopyStream) -> device_streams.CopyEvent | None:
        """The copy in flight on ``seg`` that a new copy on ``stream`` must wait for: its latest, when
        that runs on the other stream (a load up reading a segment a write down still fills, or a
        write down into a segment a load up still reads). On the same stream the queue orders them."""
        held = self._copying.get(id(seg))
        if held is None or held[1].stream is stream or held[1].done():
            return None
        return held[1]

    def _wait_copy(self, seg: Segment, event: device_streams.CopyEvent, why: str) -> None:
        """Block (bounded) until ``event`` — one copy — completed, then reclaim.

        Raises:
            SwapTimeoutError: it did not complete within the wait limit.
        """
        limit = wait_timeout()
        if not event.wait(limit):
            raise timeout_error(
                f"waited {limit:g} s for a copy between {self.device} and the host level (a {seg.nbytes}-byte "
                f"segment, {len(self._copying)} copies in flight) {why}; it has not completed; raise {WAIT_ENV} "
                "if the device is only busy, else look for a hung device")
        self.copy_waits += 1
        self._reclaim()

    def _spill_one(self, protect: str) -> bool:
        victims = sorted((k for k in self.entries if k != protect and k not in self._inflight
                          and not self._busy(self.entries[k])),
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
            return seg  # a copy in flight on it comes before the next one (its stream, or _behind)
        if seg is not None:
            self._release(self.entries.pop(key))
        while True:
            seg = self.pool.alloc(nbytes)
            if seg is not None:
                break
            if self._spill_one(protect=key):
                continue
            # the room is held by copies in flight: wait for the oldest (one event) whose segment it
            # frees or makes spillable (not one of a page waiting for finish_read: that frees nothing)
            waiting = {id(self.entries[k]) for k in self._inflight if k in self.entries}
            held = next((pair for sid, pair in self._copying.items() if sid not in waiting), None)
            if held is not None:
                self._wait_copy(held[0], held[1], f"to make room for the {nbytes}-byte page {key}")
                continue
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

    def start_write(self, page: Page, storage: torch.UntypedStorage, ticket: JobTicket | None = None) -> Future:
        """Copy the page's device bytes into its host segment (no I/O thread: ``ticket`` is unused).

        Returns:
            a future: done at once on the CPU; on an accelerator an
            :class:`~apt_model.devices.streams.EventFuture` done when the copy's event completed
            (the device memory must not be freed before).
        """
        with self._lock:
            self._reclaim()
            seg = self._segment_for(page.key, page.nbytes)
            dst, src = self._host_bytes(page.key), byte_view(storage, 0, page.nbytes)
            try:
                if self.down is None:
                    dst.copy_(src)  # device -> host
                    fut = _done()
                else:  # device -> host, after compute (and after a load up still reading the segment)
                    event = self.down.copy(dst, src, keep=(storage,), behind=self._behind(seg, self.down))
                    self._track(seg, event)
                    fut = device_streams.EventFuture(
                        event, f"copy of page {page.label} ({page.nbytes} bytes) from {self.device} to the host level")
            except BaseException:
                self._release(self.entries.pop(page.key))  # half-written: the disk copy, if any, stays current
                self._nbytes.pop(page.key, None)
                raise
            self.on_disk.discard(page.key)  # the disk copy, if any, is stale now
            self.disk.remove(page)
            self._touch(page.key)
            self.bytes_in += page.nbytes
            self.bytes_in_by_kind[page.kind] = self.bytes_in_by_kind.get(page.kind, 0) + page.nbytes
        return fut

    def start_read(self, page: Page, storage: torch.UntypedStorage, ticket: JobTicket | None = None) -> Future:
        """Start bringing the page into ``storage`` (device memory already allocated): a host hit
        starts its host-to-device copy now; a miss reads the page from disk into a host segment
        on an I/O thread (``ticket``: see :class:`~apt_model.memory.io_engine.JobTicket`).
        :meth:`finish_read` completes either (after the returned future)."""
        with self._lock:
            self._reclaim()
            self._touch(page.key)
            if page.key in self.entries:
                self.hits += 1
                self._inflight.add(page.key)  # held until finish_read copies it up: never spilled before
                if self.up is not None:
                    seg = self.entries[page.key]
                    try:  # host -> device, overlapping compute (after a write down still filling the segment)
                        event = self.up.copy(byte_view(storage, 0, page.nbytes), self._host_bytes(page.key),
                                             keep=(storage,), behind=self._behind(seg, self.up))
                    except BaseException:
                        self._inflight.discard(page.key)
                        raise
                    self._track(seg, event)
                    self._loads[page.key] = event
                return _done()
            self.misses += 1
            self._segment_for(page.key, page.nbytes)
            self._inflight.add(page.key)
            self._from_disk.add(page.key)
            if self.up is not None:
                self._marks[page.key] = self.up.mark()  # the device memory is safe to write after this
            view, key = self._host_memoryview(page.key), page.key
            return self.disk.io.submit_read(page.nbytes, lambda: self.disk.swap.read_into(key, view),
                                            f"read of page {page.label} ({page.nbytes} bytes) into the host level",
                                            ticket)

    def finish_read(self, page: Page, storage: torch.UntypedStorage) -> None:
        """Complete a read (its future done): the page's bytes are in ``storage`` for any work
        queued on the calling thread's current stream from now on (on an accelerator the compute
        stream waits for the copy on the device; the host does not block)."""
        with self._lock:
            key = page.key
            try:
                event = self._loads.pop(key, None)
                after = self._marks.pop(key, None)
                if self.up is None:
                    byte_view(storage, 0, page.nbytes).copy_(self._host_bytes(key))  # host -> device
                else:
                    if event is None:  # read from disk: copy it up now
                        seg = self.entries[key]
                        event = self.up.copy(byte_view(storage, 0, page.nbytes), self._host_bytes(key),
                                             after=after, keep=(storage,), behind=self._behind(seg, self.up))
                        self._track(seg, event)
                    self.up.join(event)
            finally:
                self._inflight.discard(key)
                self._from_disk.discard(key)
            self.bytes_out += page.nbytes

    def _cancel_load(self, key: str) -> None:
        """A load of ``key`` ends without :meth:`finish_read`: the caller frees the page's device
        memory next, so a copy into it still in flight must come before any later use of that
        memory on the compute stream (where the caching allocator hands it out again)."""
        self._marks.pop(key, None)
        event = self._loads.pop(key, None)
        if event is not None and self.up is not None:
            self.up.join(event)

    def abort_read(self, page: Page) -> None:
        """A read did not complete: a page read from disk leaves nothing valid in its host segment
        (given back); a host hit keeps its host copy (it may be the only one)."""
        with self._lock:
            self._cancel_load(page.key)
            if page.key in self._inflight:
                self._inflight.discard(page.key)
                if page.key in self._from_disk:
                    self._from_disk.discard(page.key)
                    seg = self.entries.pop(page.key, None)
                    if seg is not None:
                        self._release(seg)

    def in_memory(self, page: Page) -> bool:
        """Whether the page's lower copy is in host memory (reading it cannot meet a disk error)."""
        with self._lock:
            return page.key in self.entries

    def host_tensor(self, page: Page, like: torch.Tensor) -> torch.Tensor | None:
        """The page's lower copy in host memory, as a CPU tensor shaped like ``like`` (the page's
        tensor: same dtype, shape, strides and storage offset) sharing the pinned segment — no
        copy; None when the copy is not in host memory or a copy into it is still running. Valid
        until the page is next written, spilled or discarded: for reading at once, never to keep."""
        with self._lock:
            self._reclaim()
            seg = self.entries.get(page.key)
            if seg is None or self._busy(seg):
                return None
            item = like.element_size()
            if seg.offset % item:
                return None
            flat = self._host_bytes(page.key).view(like.dtype)
            return flat.as_strided(like.shape, like.stride(), flat.storage_offset() + like.storage_offset())

    def read_to_cpu(self, page: Page, out: torch.Tensor) -> None:
        """Copy the page's lower copy into the CPU tensor ``out`` (waiting, bounded, for a copy
        still writing its host segment)."""
        with self._lock:
            self._reclaim()
            dst = byte_view(out.untyped_storage(), 0, page.nbytes)
            if page.key in self.entries:
                seg = self.entries[page.key]
                if self._busy(seg):
                    self._wait_copy(seg, self._copying[id(seg)][1], f"to read page {page.label} on the host")
                dst.copy_(self._host_bytes(page.key))
            else:
                self.disk.read_to_cpu(page, out)

    def remove(self, page: Page) -> None:
        self.discard(page.key)

    def forget(self, page: Page) -> None:
        """Drop ``page``'s copies (host and disk, its file included) for good: it is no longer managed."""
        self.discard(page.key)
        self.disk.forget(page)

    def discard(self, key: str) -> None:
        """Forget the copies (host and disk) stored under ``key``."""
        with self._lock:
            self._cancel_load(key)
            self._inflight.discard(key)
            self._from_disk.discard(key)
            seg = self.entries.pop(key, None)
            if seg is not None:
                self._release(seg)
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
                self.entries[new_key] = self.entries.pop(key)  # a copy in flight follows its segment
                self._nbytes[new_key] = self._nbytes.pop(key)
                self._lru[new_key] = self._lru.pop(key, 0)
            for held in (self._inflight, self._from_disk):
                if key in held:
                    held.discard(key)
                    held.add(new_key)
            for pending in (self._loads, self._marks):
                if key in pending:
                    pending[new_key] = pending.pop(key)
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
        """The level's figures: bytes resident, capacity, host bytes the slabs really take
        (``pinned_bytes``), and moved in/out (``bytes_in_by_kind``: the
        bytes written in, by what they are: param, grad, state, pre-step copy), hits, misses, spills,
        whether copies run on side streams (``async_copies``) and on how many (``copy_streams``: 2,
        one per direction; 1 where a second could not be made), the copies in flight now and the
        host waits for one copy's event (``copy_waits``), and the disk level's."""
        return {"resident_bytes": self.pool.used, "capacity": self.pool.budget, "pinned": self.pool.pin,
                "pinned_bytes": self.pool.pinned_bytes,
                "slabs": len(self.pool.slabs), "hits": self.hits, "misses": self.misses, "spills_to_disk": self.spills,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "bytes_in_by_kind": dict(self.bytes_in_by_kind), "async_copies": self.down is not None,
                "copy_streams": 0 if self.down is None else 1 if self.up is self.down else 2,
                "copies_in_flight": len(self._copying), "copy_waits": self.copy_waits, "disk": self.disk.stats()}

    def close(self) -> None:
        """Let the copies in flight complete (their events, not the device; all within one wait
        limit — copies left over are logged), then close the disk level."""
        with self._lock:
            self._reclaim()
            deadline = time.monotonic() + wait_timeout()
            for seg, event in list(self._copying.values()):
                if not event.wait(max(0.0, deadline - time.monotonic())):
                    log.warning("host level: a copy of a %d-byte segment to or from %s did not complete at close",
                                seg.nbytes, self.device)
            self._reclaim()
        self.disk.close()
