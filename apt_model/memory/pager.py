"""The pager: which pages are resident on the compute level, within its budget, and moving the
rest to and from the level below.

Policy:
* **Budget (a promise).** Resident, loading and writing pages may take ``budget`` bytes; the
  training state the placement plan keeps resident outside the pages (``kept_bytes``) is counted
  on the level too. Every path that adds bytes keeps the level within ``budget`` plus the one page
  that is arriving: ``acquire`` makes room before loading; a page created by torch (a gradient
  from backward, an optimizer state from the step) makes room as it is registered, waiting for
  write-behind to land if it must; a prefetch only uses room that is free; the optimizer makes
  room for the states a step will create before it runs (see paging/optimizer.py). The placement
  plan refuses a budget smaller than its smallest working set (see :mod:`~apt_model.memory.placement`);
  only a forced plan (``paging="always"``) or pins taken outside the hooks (a page faulted in
  during a forward stays pinned to the end of its backward) can go over, and the excess is counted
  as ``over_budget_bytes``.
* **Pins.** A page pinned by a running forward, backward or optimizer chunk is never evicted.
* **Prefetch.** Loads can start ahead of use on the reader thread; ``acquire`` waits for them.
* **Writes never race compute.** Acquiring a page whose write is in flight waits for the write.
  A write that completed at once (the host level's device-to-host copy) frees the page at once.
* **Bounded waits.** Every wait (a read, a write, the lock) gives up after ``VB_SWAP_TIMEOUT``
  seconds with a :class:`~apt_model.memory.swap.SwapTimeoutError` naming the page, its bytes, the
  level and the I/O queues (:mod:`apt_model.memory.waits`).
* **Any thread may drop an alias.** Releases requested by finalizers (an alias of a page that
  user code held, garbage-collected on whatever thread drops it last: an I/O thread, autograd's
  device thread) are queued and applied by the next pager call, never under the finalizer: the
  training thread may hold the pager lock while it waits for that very I/O thread.

The level below is a store (:mod:`apt_model.memory.stores`): the swap files directly on a
CPU-only run (where the compute level *is* host RAM), or host RAM with its own budget and the swap
files under it on an accelerator. Memory freed by eviction on the CPU is returned to the OS
(``malloc_trim``) so the budget shows in the process's RSS, not only in our books.
"""
from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future

import torch

from apt_model.log import get_logger
from apt_model.memory.host import release_free_memory
from apt_model.memory.io_engine import IOEngine
from apt_model.memory.pages import Category, Page, State, alloc_storage, free_storage
from apt_model.memory.stores import DiskStore, HostLevelFullError, byte_view
from apt_model.memory.swap import SwapSpace
from apt_model.memory.waits import TimedLock, wait_future

log = get_logger(__name__)

_TRIM_EVERY = 64 * 2**20  # return freed heap memory to the OS after this many bytes were freed


class LevelStats:
    """Counters of the compute level (level 0) kept by the pager. Resident figures include the
    training state kept resident outside the pages (``kept_bytes``)."""

    def __init__(self):
        self.loads = 0  # misses: a page had to be read from below
        self.hits = 0  # acquires that found the page resident
        self.faults = 0  # pages touched outside the paging hooks and loaded on demand
        self.bytes_in = 0
        self.bytes_out = 0  # bytes freed from this level by eviction
        self.stall_s = 0.0  # seconds the training thread waited for I/O
        self.peak_resident = 0  # bytes: pages resident, loading or writing, plus kept state
        self.over_budget_bytes = 0  # largest excess of the above over the level's budget

    def to_dict(self) -> dict:
        return {"hits": self.hits, "misses": self.loads, "faults": self.faults, "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "stall_s": round(self.stall_s, 4), "peak_resident": self.peak_resident,
                "over_budget_bytes": self.over_budget_bytes}


class Pager:
    """Keeps registered pages within ``budget`` bytes on the compute level.

    Args:
        budget: bytes the resident pages may take.
        swap: the swap space (the bottom level).
        io: background I/O engine (one is created if None).
        store: the level right below (default: the swap files, for a CPU compute level); pass a
            :class:`~apt_model.memory.stores.HostStore` for an accelerator.
        device: the compute device (default: CPU).

    Attributes:
        kept_bytes: training state kept resident on this level outside the pages (set by the
            paging session from the placement plan); reported with the level, not paged.
    """

    def __init__(self, budget: int, swap: SwapSpace, io: IOEngine | None = None, store=None,
                 device: torch.device | str = "cpu"):
        self.budget = int(budget)
        self.kept_bytes = 0
        self.swap = swap
        self.io = io or IOEngine()
        self.store = store if store is not None else DiskStore(swap, self.io)
        self.device = torch.device(device)
        self.pages: dict[str, Page] = {}
        self.by_tensor: dict[int, Page] = {}  # id(live tensor) -> page, for fault handling
        self.stats = LevelStats()
        self._lock = TimedLock(f"pager ({self.device} level)")
        self._tick = 0
        self._resident = 0
        self._writing = 0  # bytes of resident pages whose copies below are being written
        self._freed_since_trim = 0
        self._deferred: deque[Page] = deque()  # releases asked for by finalizers, applied by the next call
        self._closed = False

    # ------------------------------------------------------------------ bookkeeping
    @property
    def resident_bytes(self) -> int:
        """Bytes the managed pages hold on this level now (kept as a running total)."""
        return self._resident

    @property
    def largest_page(self) -> int:
        """Bytes of the largest managed page (0 if none)."""
        return max((p.nbytes for p in self.pages.values()), default=0)

    def defer_release(self, page: Page) -> None:
        """Unpin ``page`` at the next pager call. Safe from any thread and from finalizers: takes no
        lock (a finalizer may run on an I/O thread while the training thread holds the pager lock
        waiting for that thread)."""
        self._deferred.append(page)

    def _drain_deferred(self) -> None:
        """Apply the releases queued by :meth:`defer_release` (under the lock)."""
        while self._deferred:
            try:
                page = self._deferred.popleft()
            except IndexError:
                break
            page.pins = max(0, page.pins - 1)

    def _set(self, page: Page, state: State) -> None:
        before = page.occupies
        if page.state is State.WRITING:
            self._writing -= page.nbytes
        page.state = state
        if state is State.WRITING:
            self._writing += page.nbytes
        self._resident += page.occupies - before

    def _touch(self, page: Page) -> None:
        self._tick += 1
        page.last_use = self._tick

    def _note_resident(self) -> None:
        r = self.resident_bytes + self.kept_bytes
        self.stats.peak_resident = max(self.stats.peak_resident, r)
        self.stats.over_budget_bytes = max(self.stats.over_budget_bytes, r - self.budget - self.kept_bytes)

    def register(self, category: Category, tensor_of, label: str, keep: bool = False) -> Page:
        """Start managing a resident tensor (returned by ``tensor_of()``). It has no lower copy yet.

        The tensor already occupies the level (torch created it: a gradient, an optimizer state),
        so room is made right after, evicting other unpinned pages and waiting for their writes
        if need be: the level stays within the budget plus this page.

        Raises:
            ValueError: the tensor is missing or on another device type than this pager's.
            SwapTimeoutError: a write that had to land for the room did not finish in time.
        """
        t = tensor_of()
        if t is None or t.device.type != self.device.type:
            raise ValueError(f"page {label}: this pager manages {self.device.type} tensors, got {None if t is None else t.device}")
        with self._lock:
            page = Page(category, tensor_of, int(t.untyped_storage().nbytes()), label, keep=keep, tensor_id=id(t))
            self._resident += page.occupies
            self.pages[page.key] = page
            self.by_tensor[id(t)] = page
            self._touch(page)
            self._note_resident()
            if self.resident_bytes > self.budget:
                self.make_room(0, protect=[page])
            return page

    def rebind(self, page: Page) -> None:
        """The page's tensor object changed (a new gradient tensor): update size and lookup."""
        with self._lock:
            if self.by_tensor.get(page.tensor_id) is page:
                del self.by_tensor[page.tensor_id]
            t = page.tensor_of()
            if t is not None:
                page.tensor_id = id(t)
                self.by_tensor[id(t)] = page
                n = int(t.untyped_storage().nbytes())
                if n:  # a paged-out tensor reports 0 bytes: keep the recorded size
                    before = page.occupies
                    page.nbytes = n
                    self._resident += page.occupies - before
                    self._note_resident()

    def unregister(self, page: Page) -> None:
        """Stop managing ``page``: bring it back to memory first if it has data below."""
        with self._lock:
            if page.state in (State.LOWER, State.LOADING, State.WRITING):
                self.acquire([page])
                page.pins -= 1
            self.store.remove(page)
            if self.pages.pop(page.key, None) is not None:
                self._resident -= page.occupies
            if self.by_tensor.get(page.tensor_id) is page:
                del self.by_tensor[page.tensor_id]

    # ------------------------------------------------------------------ I/O primitives
    def _wait(self, fut: Future, page: Page, what: str) -> None:
        """Wait (bounded) for ``page``'s ``what`` ("read", "write") to finish; re-raises its error."""
        if not fut.done():
            t0 = time.perf_counter()
            try:
                wait_future(fut, f"{what} of page {page.label} ({page.key}, {page.nbytes} bytes) "
                                 f"{'from' if what == 'read' else 'to'} the {self.store.level_kind} level below "
                                 f"{self.device}", self.io.describe())
            finally:
                self.stats.stall_s += time.perf_counter() - t0
        else:
            fut.result()  # re-raise I/O errors

    def _start_load(self, page: Page) -> None:
        storage = page.storage()
        alloc_storage(storage, page.nbytes)
        if page.zero_on_load:
            byte_view(storage).zero_()
            self._set(page, State.RESIDENT)
            page.dirty, page.zero_on_load, page.future = True, False, None
            return
        try:
            try:
                page.future = self.store.start_read(page, storage)
            except HostLevelFullError as err:
                # the host level is full of this pager's own loads (prefetches) whose host-to-device
                # copies only this thread makes: finish them — that frees their room — and retry
                loading = [p for p in self.pages.values() if p.state is State.LOADING and p is not page]
                if not err.in_flight or not loading:
                    raise
                for p in loading:
                    self._finish_load(p)
                page.future = self.store.start_read(page, storage)
        except BaseException:
            free_storage(storage)  # nothing was loaded: the page stays below
            raise
        self._set(page, State.LOADING)
        self.stats.loads += 1
        self.stats.bytes_in += page.nbytes

    def _finish_load(self, page: Page) -> None:
        fut = page.future
        try:
            self._wait(fut, page, "read")
        except BaseException:
            if not fut.done():  # timed out: the read still writes into the storage; keep both
                raise
            page.future = None
            self.store.abort_read(page)
            free_storage(page.storage())
            self._set(page, State.LOWER)
            raise
        page.future = None
        try:
            self.store.finish_read(page, page.storage())
        except BaseException:
            self.store.abort_read(page)
            free_storage(page.storage())
            self._set(page, State.LOWER)
            raise
        self._set(page, State.RESIDENT)
        page.dirty = False
        self._apply_scales(page)

    @staticmethod
    def _apply_scales(page: Page, t: torch.Tensor | None = None) -> None:
        """Apply to ``t`` (default: the page's tensor) the multiplications the lower copy still owes,
        in order and with the same op (``_foreach_mul_`` or ``mul_``) the caller would have used.
        The page stays clean: the lower copy plus ``page.scales`` is the current value."""
        if not page.scales:
            return
        t = page.tensor_of() if t is None else t
        with torch.no_grad(), torch._C.DisableTorchFunction():
            for factor, foreach in page.scales:
                if foreach:
                    torch._foreach_mul_([t], factor)
                else:
                    t.mul_(factor)

    def defer_scale(self, page: Page, factor: torch.Tensor, foreach: bool) -> bool:
        """Multiply a paged-out page by ``factor`` lazily (on its next load). Returns False if the
        page is resident (the caller multiplies it in place instead)."""
        with self._lock:
            if page.state is not State.LOWER:
                return False
            page.scales.append((factor, foreach))
            page.cached_norm = None
            return True

    def _evict(self, page: Page) -> None:
        storage = page.storage()
        if page.dirty or not self.store.has(page):
            page.future = self.store.start_write(page, storage)
            self._set(page, State.WRITING)
            if page.future.done():  # the host level copies synchronously: free the device bytes now
                self._finish_write(page, wait=False)
        else:
            self._free(page)

    def _free(self, page: Page) -> None:
        free_storage(page.storage())
        self._set(page, State.LOWER)
        page.dirty = False
        self.stats.bytes_out += page.nbytes
        self._freed_since_trim += page.nbytes
        if self.device.type == "cpu" and self._freed_since_trim >= _TRIM_EVERY:
            release_free_memory()
            self._freed_since_trim = 0

    def _finish_write(self, page: Page, wait: bool) -> bool:
        """Complete a page's write; frees it unless pinned. Returns False if still running."""
        fut = page.future
        if fut is None:
            return True
        if not wait and not fut.done():
            return False
        try:
            self._wait(fut, page, "write")
        except BaseException:
            if fut.done():  # the write failed: the data is still in memory, nothing lost
                page.future = None
                self._set(page, State.RESIDENT)
            # a timed-out write is still running and reading the page's memory: it stays WRITING
            raise
        page.future = None
        page.scales = []  # the new lower copy already has every scaling applied
        if page.pins > 0:
            self._set(page, State.RESIDENT)
            page.dirty = False
        else:
            self._free(page)
        return True

    def reap(self) -> None:
        """Free the pages whose background writes have completed (and apply deferred releases)."""
        with self._lock:
            self._drain_deferred()
            for page in list(self.pages.values()):
                if page.state is State.WRITING:
                    self._finish_write(page, wait=False)

    # ------------------------------------------------------------------ policy
    def make_room(self, nbytes: int, protect: Iterable[Page] = (), wait: bool = True) -> None:
        """Evict until ``nbytes`` more fit in the budget (as far as unpinned pages allow). With
        ``wait=False`` the writes of evicted dirty pages are started but not waited for.

        Raises:
            SwapFullError / SwapError: a write failed (the page stays resident, nothing is lost).
            SwapTimeoutError: a write that had to land did not within ``VB_SWAP_TIMEOUT`` seconds.
        """
        with self._lock:
            self.reap()
            protected = {id(p) for p in protect}
            need = self.resident_bytes + nbytes - self.budget
            if need <= 0:
                return
            victims = sorted((p for p in self.pages.values()
                              if p.state is State.RESIDENT and p.pins == 0 and not p.keep and id(p) not in protected),
                             key=lambda p: p.last_use)
            for victim in victims:
                if need <= 0:
                    break
                self._evict(victim)
                need -= victim.nbytes
            if not wait:
                return
            # evicted dirty pages still hold memory until their writes land: wait for enough of them
            for page in sorted((p for p in self.pages.values() if p.state is State.WRITING), key=lambda p: p.last_use):
                if self.resident_bytes + nbytes <= self.budget:
                    break
                self._finish_write(page, wait=True)

    def acquire(self, pages: Iterable[Page], for_write: bool = False) -> None:
        """Make ``pages`` resident and pin them (waits for their loads and in-flight writes).

        Raises:
            SwapCorruptionError / SwapError: a page's swap file failed its checks; the page
                stays on the lower level.
            SwapTimeoutError: a read or write did not finish within ``VB_SWAP_TIMEOUT`` seconds
                (the page stays loading or writing; a later call picks it up), or the pager's
                lock was held by another thread that long.
        """
        pages = [p for p in pages if p is not None]
        with self._lock:
            self._drain_deferred()
            missing = sum(p.nbytes for p in pages if p.state is State.LOWER)
            if missing:
                self.make_room(missing, protect=pages)
            for p in pages:
                if p.state is State.WRITING:
                    p.pins += 1  # keeps _finish_write from freeing it
                    try:
                        self._finish_write(p, wait=True)
                    finally:
                        p.pins -= 1
                if p.state is State.LOWER:
                    self._start_load(p)
                elif p.state is State.RESIDENT:
                    self.stats.hits += 1
            for p in pages:
                if p.state is State.LOADING:
                    self._finish_load(p)
                if p.state is State.ABSENT:
                    raise RuntimeError(f"page {p.label} has no data (its tensor was released)")
                p.pins += 1
                if for_write:
                    p.dirty = True
                    p.cached_norm = None
                self._touch(p)
            self._note_resident()

    def release(self, pages: Iterable[Page], evict: bool = False) -> None:
        """Unpin ``pages``; with ``evict``, start writing them out now (write-behind)."""
        with self._lock:
            self._drain_deferred()
            for p in pages:
                if p is None:
                    continue
                p.pins = max(0, p.pins - 1)
                if evict and p.pins == 0 and not p.keep and p.state is State.RESIDENT:
                    self._evict(p)
            if self.resident_bytes > self.budget:
                self.make_room(0)

    def prefetch(self, pages: Iterable[Page], reserve: int = 0) -> None:
        """Start loading ``pages`` in the background, in order, as far as they fit in the budget
        with ``reserve`` bytes left free (room the caller is about to need, e.g. for optimizer
        states a step will create).

        A prefetch never blocks the training thread: it starts the writes of least-recently-used
        unpinned pages to make room, but only uses room that is free now — never the room of
        pages whose writes are still in flight, which would put the level over its budget.
        """
        with self._lock:
            self.reap()
            todo = [p for p in pages if p is not None and p.state is State.LOWER]
            if not todo:
                return
            need = sum(p.nbytes for p in todo) + reserve
            if self.resident_bytes + need > self.budget:
                self.make_room(need, protect=todo, wait=False)
            for p in todo:
                if self.resident_bytes + p.nbytes + reserve > self.budget and self.resident_bytes > 0:
                    break
                self._start_load(p)
                self._touch(p)
            self._note_resident()

    def evict_now(self, pages: Iterable[Page]) -> None:
        """Write out (if dirty) and free unpinned ``pages`` now."""
        with self._lock:
            self._drain_deferred()
            for p in pages:
                if p is not None and p.pins == 0 and not p.keep and p.state is State.RESIDENT:
                    self._evict(p)

    def drop(self, page: Page) -> None:
        """Forget the page's data (its tensor was set to None): delete the lower copy."""
        with self._lock:
            if page.state is State.WRITING:
                self._finish_write(page, wait=True)
            if page.state is State.LOADING:
                self._finish_load(page)
            self.store.remove(page)
            self._set(page, State.ABSENT)
            page.dirty, page.zero_on_load, page.scales, page.cached_norm = False, False, [], None

    def revive(self, page: Page) -> None:
        """An ABSENT page's tensor exists again (a new gradient): it is resident and dirty. Room is
        made right after, as for :meth:`register`."""
        with self._lock:
            self._set(page, State.RESIDENT)
            page.dirty = True
            self._touch(page)
            self._note_resident()
            if self.resident_bytes > self.budget:
                self.make_room(0, protect=[page])

    def flush(self) -> None:
        """Wait for every background read and write to finish, and give freed memory back to the OS."""
        with self._lock:
            self._drain_deferred()
            for p in list(self.pages.values()):
                if p.state is State.LOADING:
                    self._finish_load(p)
                elif p.state is State.WRITING:
                    self._finish_write(p, wait=True)
            self.trim()

    def trim(self) -> None:
        """Return freed heap memory to the OS now (``malloc_trim``)."""
        release_free_memory()
        self._freed_since_trim = 0

    def materialize(self, page: Page) -> torch.Tensor:
        """A new CPU tensor with the page's current data (the page stays where it is)."""
        with self._lock:
            t = page.tensor_of()
            if page.state in (State.RESIDENT, State.WRITING, State.LOADING):
                if page.state is State.LOADING:
                    self._finish_load(page)
                with torch._C.DisableTorchFunction():
                    return t.detach().to("cpu", copy=True)
            out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
            if page.zero_on_load:
                out.zero_()
            else:
                self.store.read_to_cpu(page, out)
                self._apply_scales(page, out)
            return out

    def close(self) -> None:
        """Bring every page back to memory, stop the I/O threads, delete the swap folder."""
        if self._closed:
            return
        with self._lock:
            self.budget = sys.maxsize  # everything comes back: nothing may be evicted meanwhile
            for p in list(self.pages.values()):
                if p.state in (State.LOWER, State.LOADING, State.WRITING):
                    self.acquire([p])
                    p.pins -= 1
            self.pages.clear()
            self.by_tensor.clear()
            self._resident = 0
            self._writing = 0
            self._closed = True
        self.store.close()

    def report(self) -> dict:
        """The level's figures in bytes: ``budget`` (the level's: pages plus kept state),
        ``page_budget``, ``kept_bytes``, ``resident_bytes`` and ``peak_resident`` (pages plus kept
        state), ``largest_page``, per-category page figures, and the :class:`LevelStats` counters."""
        by_cat: dict[str, dict] = {}
        for p in self.pages.values():
            c = by_cat.setdefault(p.category.value, {"pages": 0, "bytes": 0, "resident": 0, "kept": 0})
            c["pages"] += 1
            c["bytes"] += p.nbytes
            c["resident"] += p.occupies
            c["kept"] += p.nbytes if p.keep else 0
        return {"budget": self.budget + self.kept_bytes, "page_budget": self.budget, "kept_bytes": self.kept_bytes,
                "largest_page": self.largest_page, "categories": by_cat, **self.stats.to_dict(),
                "resident_bytes": self.resident_bytes + self.kept_bytes}
