"""The pager: which pages are resident on the compute level, within its budget, and moving the
rest to and from the level below.

Policy:
* **Budget.** Resident, loading and writing pages may take ``budget`` bytes. Making room evicts
  least-recently-used pages that nobody pins; a clean page is freed at once, a dirty one is
  written in the background and freed when the write lands. A working set larger than the
  budget (one module's weights bigger than everything allowed) is loaded anyway and counted as
  ``over_budget_bytes`` — training does not stop for it.
* **Pins.** A page pinned by a running forward, backward or optimizer chunk is never evicted.
* **Prefetch.** Loads can start ahead of use on the reader thread; ``acquire`` waits for them.
* **Writes never race compute.** Acquiring a page whose write is in flight waits for the write.

The level below is a store (:mod:`apt_model.memory.stores`): the swap files directly on a
CPU-only run (where the compute level *is* host RAM), or host RAM with its own budget and the swap
files under it on an accelerator. Memory freed by eviction on the CPU is returned to the OS
(``malloc_trim``) so the budget shows in the process's RSS, not only in our books.
"""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future

import torch

from apt_model.log import get_logger
from apt_model.memory.host import release_free_memory
from apt_model.memory.io_engine import IOEngine
from apt_model.memory.pages import Category, Page, State, alloc_storage, free_storage
from apt_model.memory.stores import DiskStore, byte_view
from apt_model.memory.swap import SwapSpace

log = get_logger(__name__)

_TRIM_EVERY = 64 * 2**20  # return freed heap memory to the OS after this many bytes were freed


class LevelStats:
    """Counters of the compute level (level 0) kept by the pager."""

    def __init__(self):
        self.loads = 0  # misses: a page had to be read from below
        self.hits = 0  # acquires that found the page resident
        self.faults = 0  # pages touched outside the paging hooks and loaded on demand
        self.bytes_in = 0
        self.bytes_out = 0  # bytes freed from this level by eviction
        self.stall_s = 0.0  # seconds the training thread waited for I/O
        self.peak_resident = 0
        self.over_budget_bytes = 0  # largest excess over the budget forced by pinned working sets

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
    """

    def __init__(self, budget: int, swap: SwapSpace, io: IOEngine | None = None, store=None,
                 device: torch.device | str = "cpu"):
        self.budget = int(budget)
        self.swap = swap
        self.io = io or IOEngine()
        self.store = store if store is not None else DiskStore(swap, self.io)
        self.device = torch.device(device)
        self.pages: dict[str, Page] = {}
        self.by_tensor: dict[int, Page] = {}  # id(live tensor) -> page, for fault handling
        self.stats = LevelStats()
        self._lock = threading.RLock()
        self._tick = 0
        self._resident = 0
        self._writing = 0  # bytes of resident pages whose copies below are being written
        self._freed_since_trim = 0
        self._closed = False

    # ------------------------------------------------------------------ bookkeeping
    @property
    def resident_bytes(self) -> int:
        """Bytes the managed pages hold on this level now (kept as a running total)."""
        return self._resident

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
        r = self.resident_bytes
        self.stats.peak_resident = max(self.stats.peak_resident, r)
        self.stats.over_budget_bytes = max(self.stats.over_budget_bytes, r - self.budget)

    def register(self, category: Category, tensor_of, label: str, keep: bool = False) -> Page:
        """Start managing a resident tensor (returned by ``tensor_of()``). It has no lower copy yet."""
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
    def _wait(self, fut: Future) -> None:
        if not fut.done():
            t0 = time.perf_counter()
            fut.result()
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
        page.future = self.store.start_read(page, storage)
        self._set(page, State.LOADING)
        self.stats.loads += 1
        self.stats.bytes_in += page.nbytes

    def _finish_load(self, page: Page) -> None:
        fut, page.future = page.future, None
        try:
            self._wait(fut)
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
        page.future = None
        try:
            self._wait(fut)
        except BaseException:
            self._set(page, State.RESIDENT)  # the data is still in memory: nothing lost
            raise
        page.scales = []  # the new lower copy already has every scaling applied
        if page.pins > 0:
            self._set(page, State.RESIDENT)
            page.dirty = False
        else:
            self._free(page)
        return True

    def reap(self) -> None:
        """Free the pages whose background writes have completed."""
        with self._lock:
            for page in list(self.pages.values()):
                if page.state is State.WRITING:
                    self._finish_write(page, wait=False)

    # ------------------------------------------------------------------ policy
    def make_room(self, nbytes: int, protect: Iterable[Page] = (), wait: bool = True) -> None:
        """Evict until ``nbytes`` more fit in the budget (as far as unpinned pages allow). With
        ``wait=False`` the writes of evicted dirty pages are started but not waited for."""
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
        """
        pages = [p for p in pages if p is not None]
        with self._lock:
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
            for p in pages:
                if p is None:
                    continue
                p.pins = max(0, p.pins - 1)
                if evict and p.pins == 0 and not p.keep and p.state is State.RESIDENT:
                    self._evict(p)
            if self.resident_bytes > self.budget:
                self.make_room(0)

    def prefetch(self, pages: Iterable[Page]) -> None:
        """Start loading ``pages`` in the background if they fit without evicting pinned pages.

        A prefetch never blocks the training thread. Pages whose writes are in flight are about to
        be freed, so a prefetch may use their room early — up to a quarter of the budget: the
        level can exceed its budget by that much while the write-behind drains.
        """
        with self._lock:
            self.reap()
            todo = [p for p in pages if p is not None and p.state is State.LOWER]
            if not todo:
                return
            need = sum(p.nbytes for p in todo)
            if self.resident_bytes + need > self.budget:
                self.make_room(need, protect=todo, wait=False)
            allowance = self.budget + min(self._writing, self.budget // 4)
            for p in todo:
                if self.resident_bytes + p.nbytes > allowance and self.resident_bytes > 0:
                    break
                self._start_load(p)
                self._touch(p)
            self._note_resident()

    def evict_now(self, pages: Iterable[Page]) -> None:
        """Write out (if dirty) and free unpinned ``pages`` now."""
        with self._lock:
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
        """An ABSENT page's tensor exists again (a new gradient): it is resident and dirty."""
        with self._lock:
            self._set(page, State.RESIDENT)
            page.dirty = True

    def flush(self) -> None:
        """Wait for every background read and write to finish, and give freed memory back to the OS."""
        with self._lock:
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
        by_cat: dict[str, dict] = {}
        for p in self.pages.values():
            c = by_cat.setdefault(p.category.value, {"pages": 0, "bytes": 0, "resident": 0, "kept": 0})
            c["pages"] += 1
            c["bytes"] += p.nbytes
            c["resident"] += p.occupies
            c["kept"] += p.nbytes if p.keep else 0
        return {"budget": self.budget, "resident_bytes": self.resident_bytes, "categories": by_cat,
                **self.stats.to_dict()}
