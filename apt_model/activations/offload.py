"""Activation offload: tensors saved for backward leave fast memory between forward and backward.

Installed with ``torch.autograd.graph.saved_tensors_hooks`` around an adopted model's forward.
The pack hook returns a :class:`SavedActivation` handle for each eligible saved tensor — identity
is the handle itself, never a storage address (the first implementation keyed a cache by storage
address, which the caching allocator reuses, so backward could receive another tensor's data).

* Eligible: a dense tensor on the compute device of at least ``min_bytes`` that is neither a
  parameter nor a view of one (parameters are the paging's business), nor on the storage of a
  module's buffer (:attr:`ActivationOffloader.module_storages`): the buffer stays alive anyway, so
  offloading it frees nothing, and a kernel may change it in place after autograd saved it without
  bumping its version (batch norm's running statistics), which raced the write to the swap file
  (a ``SwapCorruptionError`` at backward, until 2026-11-26). Everything else is saved as usual.
* Up to ``budget`` bytes of handles keep their tensor in memory: the most recent ones, which
  backward needs first. Older ones are offloaded: on a CPU-only run to the swap files (the level
  below host RAM), written by the I/O threads; below an accelerator to the host level first
  (pinned pool), spilling to the swap files when the host budget is full.
* Backward unpacks in roughly reverse order; unpacking one handle starts reading the ones packed
  just before it, so they are back in memory when needed.
* **Copies to and from the host level overlap compute on an accelerator** (until 2026-11-27 each
  was a plain ``copy_``, which made the host wait for the device at every offload and reload):
  a copy down runs on a side stream after the point compute had reached (the tensor is final
  there) and the tensor is let go once the copy's event completed (its memory is never handed
  back to the allocator while the copy reads it); a copy up runs on a second side stream into
  memory allocated on the compute stream, started when backward prefetches the handle, and
  compute waits for its event on the device before the first use (the host does not block). A
  host segment is spilled or reused only once no copy uses it. On the CPU (and a device without
  streams) the copies stay synchronous. The same scheme as the paging's host level
  (:class:`~apt_model.memory.stores.HostStore`, :mod:`apt_model.devices.streams`).
* A saved tensor changed in place raises at backward, as plain PyTorch does: changed before its
  offload, it is kept in memory and its unpack raises; changed after its bytes went below, its
  unpack raises while the caller still holds the tensor object it saved (a local of a forward
  that has returned is gone: then, as with ``torch.autograd.graph.save_on_cpu``, the change is not
  seen and backward uses the saved bytes). An activation the host level cannot hold at all stays
  in memory (``kept_too_big``).
* A failed write (disk full, swap folder gone) keeps the tensor in memory and raises the
  :class:`~apt_model.memory.swap.SwapError` at the next pack or unpack; a failed read raises from
  backward. A gradient is never computed from missing or altered data.

Memory is freed by dropping the handle's reference: if the user still holds the tensor, nothing
is freed (and nothing is lost). A graph dropped without a backward frees its host segments too
(until 2026-11-27 the host level held its handles, so they stayed until spilled to disk: dead
bytes written to the swap files).

Threads: the pack hook runs on the training thread; on an accelerator the unpack hook runs on
autograd's device thread, and a handle can be dropped on any thread (autograd's, or an I/O thread
whose garbage collection frees it). So the I/O jobs hold only the bytes they move (never a handle,
whose finalizer would then run on the I/O thread), a dropped handle's clean-up is queued and done
by the next hook call, and every wait — a write or read in flight, the offloader's lock — is
bounded by ``VB_SWAP_TIMEOUT`` and raises a :class:`~apt_model.memory.swap.SwapTimeoutError`
naming the activation, its bytes and the I/O queues (:mod:`apt_model.memory.waits`).
"""
from __future__ import annotations

import itertools
import time
import weakref
from collections import deque
from concurrent.futures import Future

import torch
import torch.nn as nn

from apt_model.base.log import get_logger
from apt_model.devices import streams as device_streams
from apt_model.memory.io_engine import IOEngine
from apt_model.memory.pages import cpu_byte_view
from apt_model.memory.stores import PinnedPool, byte_view
from apt_model.memory.swap import SwapSpace
from apt_model.memory.waits import ENV as WAIT_ENV
from apt_model.memory.waits import TimedLock, timeout_error, wait_future, wait_timeout

log = get_logger(__name__)

RESIDENT, WRITING, HOST, LOADING, DISK = "resident", "writing", "host", "loading", "disk"
_OOM = getattr(torch, "OutOfMemoryError", MemoryError)  # a device allocation that failed


class SavedActivation:
    """The pack hook's handle for one saved tensor (see the module docstring)."""

    __slots__ = ("seq", "tensor", "nbytes", "shape", "stride", "dtype", "device", "state", "future", "key",
                 "segment", "version", "source", "copy_version", "__weakref__")

    def __init__(self, seq: int, t: torch.Tensor, key: str):
        self.seq = seq
        self.tensor: torch.Tensor | None = t.detach()  # not ``t``: see _unlinked
        self.nbytes = t.numel() * t.element_size()
        self.shape, self.stride, self.dtype, self.device = t.shape, t.stride(), t.dtype, t.device
        self.version = t._version
        #: the tensor autograd saved, held weakly: once its bytes were copied below, an in-place change
        #: of the caller's tensor (its version counter) still raises at backward while it lives
        self.source = weakref.ref(t)
        #: the version of the copy read back from below (None: ``tensor`` is the saved tensor itself)
        self.copy_version: int | None = None
        self.state = RESIDENT
        self.future: Future | None = None
        self.key = key
        self.segment = None


class OffloadStats:
    """Counters of one offloader (bytes, counts, seconds)."""

    def __init__(self):
        self.packed = 0
        self.packed_bytes = 0
        self.kept_small = 0
        self.kept_too_big = 0  # too big for the host level: left in memory
        self.offloaded = 0
        self.offloaded_bytes = 0
        self.to_disk_bytes = 0
        self.loaded_bytes = 0
        self.prefetched = 0
        self.peak_resident = 0
        self.stall_s = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class KeptActivation:
    """The pack hook's handle for a saved tensor that is not offloaded (too small, a parameter, a
    tensor subclass): the tensor itself and its version when saved. Autograd checks a saved
    tensor's version (the "modified by an inplace operation" error) only for tensors saved without
    hooks; once a pack hook handles them the check is the hook's. Returning such tensors bare, as
    this module did until 2026-11-26, let a saved activation modified in place afterwards (a
    sigmoid's output, ``h.add_(1)``) reach backward silently: wrong gradients where plain PyTorch
    raises."""

    __slots__ = ("tensor", "version", "shape")

    def __init__(self, t: torch.Tensor, version: int):
        self.tensor, self.version, self.shape = _unlinked(t), version, t.shape


def _unlinked(t: torch.Tensor) -> torch.Tensor:
    """What a handle holds of a saved tensor ``t``: ``t.detach()`` (the same storage and version
    counter, no autograd history) for a plain tensor with a history, ``t`` itself otherwise.

    A pack hook's result is kept by the autograd node that saved ``t``; when ``t`` is that node's
    output (a ReLU's, a sigmoid's), ``t`` holds the node back through ``t.grad_fn``: a cycle through
    C++ that Python's garbage collector cannot see, so a graph never backpropagated (a validation
    loss computed without ``no_grad``, a forward that raised, ``retain_graph=True`` then dropped)
    stayed alive with the model's parameters (until 2026-11-28: a probe's finding). Autograd puts
    the history back on what an unpack hook returns (higher-order gradients are unchanged).
    Parameters and their views are kept as they are: the paging may change a parameter's storage
    between forward and backward, which a detached alias would not see."""
    if type(t) is not torch.Tensor or t.grad_fn is None or isinstance(t._base, nn.Parameter):
        return t
    return t.detach()


def _modified(h, now: int | None = None) -> RuntimeError:
    now = h.tensor._version if now is None else now
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"a tensor of shape {tuple(h.shape)} saved for backward was modified in place after it was saved "
        f"(version {h.version} -> {now}); its gradient cannot be computed from the saved value"
    )


def _version(t: torch.Tensor) -> int | None:
    """``t._version``, or None for a tensor that keeps no version counter."""
    try:
        return t._version
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


class ActivationOffloader:
    """Pack/unpack hooks that keep at most ``budget`` bytes of saved activations in memory.

    Args:
        budget: bytes of eligible saved activations kept on the compute device.
        swap: the swap space (the bottom level).
        device: the compute device.
        min_bytes: smaller saved tensors stay where they are.
        host_budget: on an accelerator, bytes of the pinned host level (None: no host level, straight
            to disk — also how a CPU-only run works). ``host_pin`` says whether host slabs are pinned.
        prefetch_bytes: how many bytes backward reads ahead (default: half the budget).
    """

    def __init__(self, budget: int, swap: SwapSpace, device: torch.device | str = "cpu", min_bytes: int = 1 << 20,
                 host_budget: int | None = None, host_pin: bool | None = None, prefetch_bytes: int | None = None):
        self.budget = int(budget)
        self.swap = swap
        self.device = torch.device(device)
        self.min_bytes = int(min_bytes)
        self.io = IOEngine(readers=2, writers=2)
        self.host = (PinnedPool(host_budget, pin=(self.device.type != "cpu") if host_pin is None else host_pin)
                     if host_budget else None)
        self.prefetch_bytes = int(prefetch_bytes if prefetch_bytes is not None else max(self.budget // 2, 1))
        self.stats = OffloadStats()
        self._seq = itertools.count()
        self._keys: list[str] = []  # swap-file names free for reuse
        self._key_ids = itertools.count()
        self._held: dict[int, int] = {}  # seq -> bytes, for every handle holding its tensor in memory
        self._evictable: dict[int, weakref.ref] = {}  # resident handles in pack order (oldest first)
        self._writing: dict[int, SavedActivation] = {}  # writes in flight (the write needs the tensor)
        self._by_seq: dict[int, weakref.ref] = {}
        # handles whose bytes are in a host segment with no copy in flight, oldest first (spilled
        # first); held weakly, so a handle autograd dropped frees its segment (see _forget)
        self._on_host: dict[int, weakref.ref] = {}
        self._segments: dict = {}  # seq -> its host segment (also while a copy uses it)
        self._seg_copy: dict[int, device_streams.CopyEvent] = {}  # seq -> the copy in flight on its segment
        # dropped handles whose device memory a copy in flight still holds: counted until it completed
        self._draining: dict[int, device_streams.CopyEvent] = {}
        #: side streams of the copies down to the host level and up from it (None: synchronous, the CPU)
        self.down, self.up = device_streams.copy_streams(self.device) if self.host is not None else (None, None)
        self.resident_bytes = 0
        self._lock = TimedLock(f"activation offloader ({self.device})")
        self._forgotten: deque[tuple[int, str]] = deque()  # handles dropped on any thread, cleaned up by the next hook
        self._error: BaseException | None = None
        self.closed = False
        #: storage data pointers of the adopted models' buffers, per model (set by the manager at
        #: each forward): tensors on them are never offloaded
        self.module_storages: dict[int, frozenset] = {}

    # ------------------------------------------------------------------ hooks
    def eligible(self, t: torch.Tensor) -> bool:
        """Offloadable: a plain dense row-major tensor on the compute device, not a parameter, >= min_bytes."""
        if type(t) is not torch.Tensor:
            return False  # parameters, tensor subclasses (FP4 weights, DTensor...) keep their own semantics
        if isinstance(t._base, nn.Parameter):
            return False
        if t.device.type != self.device.type or t.layout is not torch.strided:
            return False
        if t.numel() * t.element_size() < self.min_bytes:
            return False
        if not t.is_contiguous():  # what goes down is exactly the storage range
            return False
        if self.module_storages:
            ptr = t.untyped_storage().data_ptr()
            if any(ptr in ptrs for ptrs in self.module_storages.values()):
                return False
        return True

    def pack(self, t: torch.Tensor):
        self._raise_pending()
        if not self.eligible(t):
            self.stats.kept_small += 1
            version = _version(t)
            return t if version is None else KeptActivation(t, version)
        with self._lock:
            self._drain_forgotten()
            h = SavedActivation(next(self._seq), t, self._new_key())
            self._hold(h)
            self._evictable[h.seq] = weakref.ref(h)
            self._by_seq[h.seq] = weakref.ref(h)
            weakref.finalize(h, self._forgotten.append, (h.seq, h.key))
            self.stats.packed += 1
            self.stats.packed_bytes += h.nbytes
            self._offload_to_budget()
        return h

    def unpack(self, h):
        if isinstance(h, KeptActivation):
            if h.tensor._version != h.version:
                raise _modified(h)
            return h.tensor
        if not isinstance(h, SavedActivation):
            return h
        self._raise_pending()
        with self._lock:
            self._drain_forgotten()
            t = self._load(h)
            self._prefetch_before(h.seq)
            return t

    # ------------------------------------------------------------------ bookkeeping
    def _hold(self, h: SavedActivation) -> None:
        if h.seq not in self._held:
            self._held[h.seq] = h.nbytes
            self.resident_bytes += h.nbytes
            self.stats.peak_resident = max(self.stats.peak_resident, self.resident_bytes)

    def _unhold(self, seq: int) -> None:
        self.resident_bytes -= self._held.pop(seq, 0)

    def _new_key(self) -> str:
        return self._keys.pop() if self._keys else f"act{next(self._key_ids)}"

    def _drain_forgotten(self) -> None:
        """Clean up after the handles dropped since the last hook (under the lock)."""
        while self._forgotten:
            try:
                seq, key = self._forgotten.popleft()
            except IndexError:
                break
            self._forget(seq, key)

    def _forget(self, seq: int, key: str) -> None:
        """The autograd graph dropped a handle: release what it held (memory, host slab, file)."""
        with self._lock:
            event = self._seg_copy.get(seq)
            if event is not None and not event.done():
                # its copy down (reading the tensor) or up (writing a new one) still holds that device
                # memory: it stays counted until the copy completed (before, the books fell short by it)
                self._draining[seq] = event
            else:
                self._unhold(seq)
            self._evictable.pop(seq, None)
            self._writing.pop(seq, None)
            self._by_seq.pop(seq, None)
            self._on_host.pop(seq, None)
            if self.host is not None:
                self._let_go_segment(seq)
            if not self.closed:
                self.swap.remove(key)
                self._keys.append(key)

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _let_go_segment(self, seq: int) -> None:
        """Give ``seq``'s host segment back to the pool — once the copy in flight on it, if any,
        completed (:meth:`PinnedPool.release_after`)."""
        seg = self._segments.pop(seq, None)
        event = self._seg_copy.pop(seq, None)
        if seg is not None:
            self.host.release_after(seg, event)

    def _landed_on_host(self, h: SavedActivation) -> None:
        """``h``'s bytes are in its host segment: its tensor is let go; it may be spilled now."""
        self._seg_copy.pop(h.seq, None)
        h.state, h.tensor = HOST, None
        self._unhold(h.seq)
        self._on_host[h.seq] = weakref.ref(h)

    def _reap(self) -> None:
        """Drop the tensors whose copies below have landed (the write threads never free memory)."""
        if self.host is not None:
            self.host.reclaim()
        for seq in device_streams.completed(list(self._draining.items())):
            del self._draining[seq]
            self._unhold(seq)
        down_running = False  # a copy down seen running: the later ones (same stream, issued later) are too
        for seq, h in list(self._writing.items()):
            if h.future is None or (h.segment is not None and down_running):
                continue
            if not h.future.done():
                down_running = down_running or h.segment is not None
                continue
            fut, h.future = h.future, None
            del self._writing[seq]
            try:
                fut.result()
                if h.tensor._version != h.version:
                    raise _modified(h)
            except BaseException as err:  # noqa: BLE001 - keep the data, report at the next hook
                h.state = RESIDENT
                if h.segment is not None:
                    self._let_go_segment(seq)
                    h.segment = None
                self._error = err
                continue
            if h.segment is not None:
                self._landed_on_host(h)
                continue
            h.state, h.tensor = DISK, None
            self._unhold(seq)

    def _offload_to_budget(self) -> None:
        self._reap()
        over = self.resident_bytes - self.budget
        for seq in list(self._evictable):
            if over <= 0:
                break
            h = self._evictable.pop(seq)()
            if h is None or h.state != RESIDENT or h.tensor is None:
                continue
            over -= h.nbytes
            self._offload(h)
        if self.resident_bytes > 2 * self.budget and self._writing:  # far over: wait for the oldest writes
            for h in sorted(self._writing.values(), key=lambda x: x.seq):
                if self.resident_bytes <= self.budget:
                    break
                if h.future is not None:  # an earlier _reap in this loop may have completed it
                    try:
                        self._wait(h.future, h, "write")
                    except BaseException:  # noqa: BLE001 - _reap records a failed write and keeps the data
                        if not h.future.done():
                            raise  # timed out: the write is still running
                self._reap()

    def _offload(self, h: SavedActivation) -> None:
        if h.tensor._version != h.version:
            # changed in place since it was saved: its bytes are not the saved value. It stays in
            # memory, and its unpack raises the error plain PyTorch raises at backward.
            return
        if self.host is not None:
            if self._to_host(h):
                self.stats.offloaded += 1
                self.stats.offloaded_bytes += h.nbytes
            return
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += h.nbytes
        t = h.tensor
        view = cpu_byte_view(t.untyped_storage())[t.storage_offset() * t.element_size():][:h.nbytes]
        h.state = WRITING
        key = h.key
        # the job holds the tensor (its bytes must outlive the write), never the handle
        h.future = self.io.submit_write(h.nbytes, lambda t=t: self.swap.write(key, view),
                                        f"write of saved activation {key} ({h.nbytes} bytes)")
        self._writing[h.seq] = h
        self.stats.to_disk_bytes += h.nbytes

    def _to_host(self, h: SavedActivation) -> bool:
        """Copy ``h`` into the host level; False (``h`` left in memory) if it cannot hold it at all."""
        fits = h.nbytes <= self.host.budget
        seg = self.host.alloc(h.nbytes) if fits else None
        while seg is None and fits and (self._spill_host() or self._wait_for_a_copy_down()):
            seg = self.host.alloc(h.nbytes)
        if seg is None and fits:
            # the level is held by copies up (backward's read-ahead): it stays in memory for now and
            # is offered again at the next pack
            self._evictable[h.seq] = weakref.ref(h)
            log.debug("the host level is held by copies up; a %d-byte saved activation waits in memory", h.nbytes)
            return False
        if seg is None:  # larger than the whole host level: it stays where it is (as if not eligible)
            self.stats.kept_too_big += 1
            log.info("a %d-byte saved activation is larger than the host level (%d bytes): kept in memory",
                     h.nbytes, self.host.budget)
            return False
        t = h.tensor
        dst = self.host.view(seg, h.nbytes)
        src = byte_view(t.untyped_storage(), t.storage_offset() * t.element_size(), h.nbytes)
        h.segment = self._segments[h.seq] = seg
        if self.down is None:
            dst.copy_(src)  # device -> host, synchronous (the CPU)
            self._landed_on_host(h)
            return True
        # device -> host on the side stream, after the compute that made the tensor; the tensor is
        # held (h.tensor, and the copy's event) until _reap sees the copy complete
        event = self.down.copy(dst, src, keep=(t.untyped_storage(),))
        self._seg_copy[h.seq] = event
        h.state = WRITING
        h.future = device_streams.EventFuture(
            event, f"copy of saved activation {h.key} ({h.nbytes} bytes) from {self.device} to the host level")
        self._writing[h.seq] = h
        return True

    def _wait_for_a_copy_down(self) -> bool:
        """No room on the host level and nothing to spill: wait (bounded) for the oldest copy that
        holds a segment — one let go (its segment then goes back) or, else, one going down (its
        handle can then be spilled) — and reap. Returns False when no such copy is in flight.
        (Before, the activation was kept in memory for good, and called too big for the level.)

        Raises:
            SwapTimeoutError: that copy did not complete within the wait limit.
        """
        if self.host.pending:
            event = self.host.pending[0][1]
        else:
            h = next((x for x in self._writing.values() if x.segment is not None and x.future is not None), None)
            if h is None:
                return False
            event = h.future.event
        limit = wait_timeout()
        t0 = time.perf_counter()
        try:
            if not event.wait(limit):
                raise timeout_error(
                    f"waited {limit:g} s for a copy between {self.device} and the activation offloader's host level "
                    f"({self.host.used} of {self.host.budget} bytes in use, {len(self._seg_copy)} copies in flight) "
                    f"to make room; it has not completed; raise {WAIT_ENV} if the device is only busy, else look for "
                    "a hung device")
        finally:
            self.stats.stall_s += time.perf_counter() - t0
        self._reap()
        return True

    def _spill_host(self) -> bool:
        """Write the oldest host copy to the swap files and give its segment back (False: none left)."""
        while self._on_host:
            seq = next(iter(self._on_host))
            h = self._on_host.pop(seq)()
            seg = self._segments.get(seq)
            if seg is None:
                continue
            if h is None:  # autograd dropped it (its clean-up is queued): nothing to write
                self._let_go_segment(seq)
                return True
            mv = cpu_byte_view(self.host.slabs[seg.slab].untyped_storage())[seg.offset:seg.offset + h.nbytes]
            t0 = time.perf_counter()
            self.swap.write(h.key, mv)
            self.io.write_stats.add(h.nbytes, time.perf_counter() - t0)
            self.stats.to_disk_bytes += h.nbytes
            self._let_go_segment(seq)
            h.segment, h.state = None, DISK
            return True
        return False

    def _start_host_load(self, h: SavedActivation) -> None:
        """Start copying ``h`` up from its host segment into new device memory (state LOADING):
        on the side stream after the point compute has reached (the memory was just handed out on
        the compute stream), or at once on the CPU. :meth:`_load` finishes it."""
        out = torch.empty(h.shape, dtype=h.dtype, device=h.device)  # first: a failed allocation changes nothing
        self._on_host.pop(h.seq, None)
        dst, src = byte_view(out.untyped_storage(), 0, h.nbytes), self.host.view(h.segment, h.nbytes)
        h.tensor, h.state = out, LOADING
        self._hold(h)
        if self.up is None:
            dst.copy_(src)  # host -> device, synchronous (the CPU)
            return
        event = self.up.copy(dst, src, behind=self._seg_copy.get(h.seq))
        self._seg_copy[h.seq] = event
        h.future = device_streams.EventFuture(
            event, f"copy of saved activation {h.key} ({h.nbytes} bytes) from the host level to {self.device}")

    def _wait(self, fut: Future, h: SavedActivation, what: str) -> None:
        """Wait (bounded) for ``h``'s ``what`` ("write", "read"); re-raises the job's error."""
        t0 = time.perf_counter()
        try:
            where = "the host level" if h.segment is not None else f"the swap files in {self.swap.folder}"
            wait_future(fut, f"{what} of saved activation {h.key} ({h.nbytes} bytes, shape {tuple(h.shape)}) "
                             f"{'to' if what == 'write' else 'from'} {where}", self.io,
                             "write" if what == "write" else "read")
        finally:
            self.stats.stall_s += time.perf_counter() - t0

    def _start_read(self, h: SavedActivation) -> None:
        out = torch.empty(h.shape, dtype=h.dtype, device="cpu")
        view = cpu_byte_view(out.untyped_storage())
        h.tensor = out
        self._hold(h)
        key = h.key
        # the job holds the destination tensor (the read writes into it), never the handle
        h.future = self.io.submit_read(h.nbytes, lambda out=out: self.swap.read_into(key, view),
                                       f"read of saved activation {key} ({h.nbytes} bytes)")

    def _load(self, h: SavedActivation) -> torch.Tensor:
        self._reap()
        if h.state == WRITING and h.segment is not None:
            # a copy to the host level in flight: the tensor is still here, the copy not needed and not
            # waited for (its event holds the tensor's memory until it completed; then the segment goes)
            self._writing.pop(h.seq, None)
            h.future, h.state = None, RESIDENT
            self._let_go_segment(h.seq)
            h.segment = None
        if h.state == WRITING:  # still in memory: keep it; the write to disk is simply not needed
            try:
                self._wait(h.future, h, "write")
            except BaseException as err:  # noqa: BLE001 - a failed write is reported at the next hook
                if not h.future.done():
                    raise  # timed out: the write still reads the tensor; it stays WRITING
                self._error = self._error or err  # the tensor is still here: backward can use it
            self._writing.pop(h.seq, None)
            h.future, h.state = None, RESIDENT
        if h.state == RESIDENT and h.copy_version is None:  # the saved tensor itself
            if h.tensor._version != h.version:
                raise _modified(h)
            return h.tensor
        src = h.source()
        now = None if src is None else _version(src)
        if now is not None and now != h.version:  # the caller's tensor changed after its bytes went below
            raise _modified(h, now)
        if h.state == RESIDENT:  # a copy read back for an earlier backward (retain_graph=True)
            if h.tensor._version != h.copy_version:
                raise _modified(h, h.version + h.tensor._version - h.copy_version)
            return h.tensor
        if self.closed:
            raise RuntimeError(
                f"saved activation {h.key} ({h.nbytes} bytes, shape {tuple(h.shape)}) was offloaded when the switch was "
                "disabled and could not be brought back then (see the log): run backward before vb.disable()")
        if h.state in (HOST, LOADING):
            if h.state == HOST:  # not prefetched
                self._start_host_load(h)
            if h.future is not None:  # compute waits for the copy up, on the device (the host does not)
                fut = h.future
                self.up.join(fut.event)
                h.future = None
                # a query is not a wait: a copy still running is not waited for here; one the device
                # reported an error for leaves the tensor unusable (its host copy stays, for a retry)
                if fut.done() and fut.event.error is not None:
                    self._unhold(h.seq)
                    h.tensor, h.state = None, HOST
                    self._on_host[h.seq] = weakref.ref(h)
                    raise RuntimeError(f"{fut.what} failed on the device: {fut.event.error}") from fut.event.error
            self._let_go_segment(h.seq)  # given back once the copy up completed
            h.segment, h.state, h.copy_version = None, RESIDENT, h.tensor._version
            self.stats.loaded_bytes += h.nbytes
            return h.tensor
        if h.future is None:  # on disk and not prefetched
            self._start_read(h)
        try:
            self._wait(h.future, h, "read")
        except BaseException:
            if h.future.done():  # the read failed; a timed-out one still writes into h.tensor: keep it
                h.tensor, h.future = None, None
                self._unhold(h.seq)
            raise
        h.future, h.state = None, RESIDENT
        self.stats.loaded_bytes += h.nbytes
        if h.device.type != "cpu":
            h.tensor = h.tensor.to(h.device)
        h.copy_version = h.tensor._version
        return h.tensor

    def _prefetch_before(self, seq: int) -> None:
        """Read ahead the handles packed before ``seq``: up to ``prefetch_bytes`` of them on their way
        back at once, counting those an earlier unpack started (before 2026-11-27 only the ones this
        call started counted, so the window grew through backward: copies up to the device of most
        of the graph's activations at once). A read-ahead the device has no memory for stops it."""
        ahead = 0
        s = seq - 1
        while s >= 0 and ahead < self.prefetch_bytes and seq - s <= 4096:
            ref = self._by_seq.get(s)
            h = ref() if ref is not None else None
            s -= 1
            if h is None:
                continue
            if h.state == LOADING or (h.state == DISK and h.future is not None):
                ahead += h.nbytes  # on its way already
            elif h.state == DISK:
                self._start_read(h)
                self.stats.prefetched += 1
                ahead += h.nbytes
            elif h.state == HOST and self.up is not None:  # its copy up overlaps backward
                try:
                    self._start_host_load(h)
                except _OOM:  # the unpack allocates when it needs the tensor
                    log.debug("activation read-ahead stopped: no device memory for a %d-byte tensor", h.nbytes)
                    return
                self.stats.prefetched += 1
                ahead += h.nbytes

    def close(self) -> None:
        """Bring the activations of graphs still alive back into memory, then stop the I/O threads
        (the swap files and the host level go with the switch's session: a backward run after
        ``disable()``, as in ``with vb.enabled(...): loss = model(x)`` followed by
        ``loss.backward()``, failed with "cannot schedule new futures after shutdown" until
        2026-11-27). One that cannot be brought back raises a clear error at its unpack.

        Raises:
            SwapTimeoutError: an I/O thread did not finish its queued jobs within the wait limit.
        """
        if not self.closed:
            with self._lock:
                self._drain_forgotten()
                self._let_copies_complete()
                self._bring_back_live()
            self.closed = True
            self.io.close()

    def _bring_back_live(self) -> None:
        """Load every live handle whose bytes are below memory (see :meth:`close`); logs the bytes."""
        back, failed = 0, []
        for ref in list(self._by_seq.values()):
            h = ref()
            if h is None or (h.state == RESIDENT and h.tensor is not None):
                continue
            try:
                self._load(h)
                back += h.nbytes
            except Exception as err:  # noqa: BLE001 - reported at its unpack (and logged here)
                failed.append(f"{h.key}: {err}")
        if back:
            log.info("activation offload closing: %d bytes of saved activations of graphs still alive were brought "
                     "back into memory for their backward", back)
        if failed:
            log.warning("activation offload closing: %d saved activation(s) of graphs still alive could not be brought "
                        "back (their backward will raise): %s", len(failed), "; ".join(failed[:3]))

    def _let_copies_complete(self) -> None:
        """Wait (all within one wait limit) for the copies to and from the host level still in
        flight: a pinned segment must not go while the device still reads or writes it. A copy
        left over is logged."""
        deadline = time.monotonic() + wait_timeout()
        for event in [*self._seg_copy.values(), *(e for _, e in (self.host.pending if self.host else ()))]:
            if not event.wait(max(0.0, deadline - time.monotonic())):
                log.warning("activation offload: a copy between %s and the host level did not complete at close",
                            self.device)
        self._reap()
