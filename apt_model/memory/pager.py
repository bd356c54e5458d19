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
* **Written, then cached.** :meth:`write_behind` writes a page out as :meth:`evict_now` would but
  keeps its memory: once the write lands the page is resident and clean, and eviction drops it
  with no I/O when room is needed — such copies first, before pages in use (least recently used
  first among each). Gradients, the states a step created or updated and the parameters it
  updated go down this way, so with room in the budget the next use reads nothing back. A clean page's scaling (gradient clipping) is applied in
  memory and also owed by its lower copy (``page.scales``), so the page stays clean.
* **Writes never race compute.** Acquiring a page whose write is in flight waits for the write.
  A write that completed at once (the host level's copy with the CPU standing in for a device)
  frees the page at once; an accelerator's device-to-host copy runs on a copy stream, and the
  page's device memory is freed only once its event completed (:meth:`reap`, or a wait for room):
  never while the copy still reads it.
* **Bounded waits.** Every wait (a read, a write, the lock) gives up after ``VB_SWAP_TIMEOUT``
  seconds with a :class:`~apt_model.memory.swap.SwapTimeoutError` naming the page, its bytes, the
  level and the I/O queues (:mod:`apt_model.memory.waits`).
* **The user's tensors may change under a page.** A gradient set to None, replaced
  (``p.grad = p.grad * 0.5``) or an optimizer state replaced is noticed the next time the pager
  touches the page (each page holds a weak reference to the tensor it manages, its *binding*):
  the old binding is settled first — I/O in flight finished; its bytes loaded back into the old
  tensor if anything still holds it, else forgotten — and the page then manages the new tensor
  (resident, dirty) or none. No tensor is ever left with 0-byte storage that someone can reach,
  and no background job ever touches freed memory (jobs hold the storage they move).
* **Steps are transactions.** :meth:`begin_step` / :meth:`protect` / :meth:`commit` /
  :meth:`rollback`: before an optimizer chunk modifies a page, the page's lower copy (its pre-step
  version) is set aside under another key — a rename, no I/O — and new versions are written
  beside it; a step that fails anywhere rolls every protected page back to that copy, and one that
  completes drops the old copies. A page whose pre-step bytes exist only in memory is written
  first. So a paging fault inside a step leaves the step either fully applied or not at all.
* **Faults lose nothing they did not have to.** A failed write leaves the page in memory (dirty);
  a failed read leaves it below, its file untouched. :meth:`close` brings back every page it can
  and lists the rest in a :class:`~apt_model.memory.swap.PagingRecoveryError` — after giving them
  memory (NaN-filled) and keeping the swap folder, never deleting the only copy of anything.
* **Any thread may drop an alias.** Releases requested by finalizers (an alias of a page that
  user code held, garbage-collected on whatever thread drops it last: an I/O thread, autograd's
  device thread) are queued and applied by the next pager call, never under the finalizer: the
  training thread may hold the pager lock while it waits for that very I/O thread.

The level below is a store (:mod:`apt_model.memory.stores`): the swap files directly on a
CPU-only run (where the compute level *is* host RAM), or host RAM with its own budget and the swap
files under it on an accelerator. Memory freed by eviction on the CPU is returned to the OS
(``malloc_trim`` every 64 MB freed and after each optimizer step; blocks of 1 MiB or more are
unmapped as they are freed, see :func:`~apt_model.memory.host.return_big_blocks_to_os`) so the
budget shows in the process's RSS, not only in our books; the paging report's ``host_rss`` says
what the RSS above it is made of.
"""
from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future

import torch

from apt_model.base.log import get_logger
from apt_model.memory.host import release_free_memory
from apt_model.memory.io_engine import IOEngine, JobTicket
from apt_model.memory.page_buffers import FreePageBuffers, supported as page_buffers_supported
from apt_model.memory.pages import Category, Page, State, alloc_storage, free_storage, frees_in_place
from apt_model.memory.stores import DiskStore, HostLevelFullError, byte_view
from apt_model.memory.swap import PagingRecoveryError, SwapError, SwapSpace, SwapTimeoutError
from apt_model.memory.waits import TimedLock, wait_future, wait_timeout

log = get_logger(__name__)

_TRIM_EVERY = 64 * 2**20  # return freed heap memory to the OS after this many bytes were freed
_BACKUP = "~pre"  # suffix of the key under which a protected page's pre-step copy is kept


def _labelled(err: BaseException, page: Page) -> BaseException:
    """``err`` (a swap error) with the page's tensor named in front of its message, same type."""
    if not isinstance(err, SwapError) or isinstance(err, PagingRecoveryError) or page.label in str(err):
        return err
    try:
        new = type(err)(f"{page.label} ({page.category.value}, {page.nbytes} bytes): {err}")
    except Exception:  # noqa: BLE001 - an error type with another signature: keep it as it is
        return err
    new.__cause__ = err.__cause__ or err
    return new


def _job_over(ticket: JobTicket, err: BaseException) -> bool:
    """After ``err`` left a read's submission or wait: whether the read will touch its memory no
    more (:meth:`JobTicket.settle`). A read that timed out is not waited for again."""
    return ticket.settle(0.0 if isinstance(err, SwapTimeoutError) else wait_timeout())


def fut_done_or_absent(fut: Future | None) -> bool:
    """Whether a job is over (or never started): only then may its buffer be freed."""
    return fut is None or fut.done()


def fill_lost(t: torch.Tensor | None, storage: torch.UntypedStorage, nbytes: int) -> None:
    """Give ``storage`` ``nbytes`` of memory filled with NaN (zeros for integer and bool dtypes):
    what a tensor whose bytes were lost holds, so that using it by mistake shows at once."""
    alloc_storage(storage, nbytes)
    dtype = t.dtype if t is not None else torch.uint8
    with torch._C.DisableTorchFunction(), torch.no_grad():
        if (dtype.is_floating_point or dtype.is_complex) and nbytes % dtype.itemsize == 0:
            view = torch.empty(0, dtype=dtype, device=storage.device)
            view.set_(storage, 0, (nbytes // dtype.itemsize,), (1,))
            view.fill_(float("nan"))
        else:
            byte_view(storage).zero_()



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
        self.stall_by_phase = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0, "other": 0.0}  # of which, when
        self.peak_resident = 0  # bytes: pages resident, loading or writing, plus kept state
        self.over_budget_bytes = 0  # largest excess of the above over the level's budget
        #: bytes: the largest sum of pages resident, kept state and free page buffers held (CPU level;
        #: at most the level's budget plus ``over_budget_bytes``: buffers only use room pages leave)
        self.peak_with_free_buffers = 0

    def to_dict(self) -> dict:
        return {"hits": self.hits, "misses": self.loads, "faults": self.faults, "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "stall_s": round(self.stall_s, 4),
                "stall_s_by_phase": {k: round(v, 4) for k, v in self.stall_by_phase.items()},
                "peak_resident": self.peak_resident,
                "over_budget_bytes": self.over_budget_bytes, "peak_with_free_buffers": self.peak_with_free_buffers}


class _Saved:
    """What :meth:`Pager.rollback` needs to put one protected page back as it was before the step."""

    __slots__ = ("backup", "scales", "cached_norm", "zero_on_load")

    def __init__(self, page: Page, backup: bool):
        self.backup = backup  # the pre-step copy is kept under page.key + _BACKUP
        self.scales = list(page.scales)
        self.cached_norm = page.cached_norm
        self.zero_on_load = page.zero_on_load


_UNSHARED_WARNED: list = [False]


def _warn_unshared(label: str) -> None:
    """Once per process: a paged parameter was in shared memory (``model.share_memory()``: Hogwild
    workers update it there); paging gives it its own copy, so the workers' updates no longer reach
    the model, and theirs no longer reach the workers (a probe's finding: the parent ended
    untrained, silently, until 2026-11-28)."""
    if _UNSHARED_WARNED[0]:
        return
    _UNSHARED_WARNED[0] = True
    log.warning("apt_model: parameter %s is in shared memory (sent to another process by torch.multiprocessing): "
                "paging gives it its own copy, so if other processes update it (Hogwild-style training), their "
                "updates no longer reach this model. Keep such a model unpaged (paging='off', or a device budget "
                "that holds it)", label)


def _own_storage(t: torch.Tensor) -> None:
    """Give ``t`` a private copy of its bytes (``t.data = copy``): the storage it had may be shared
    or may not be freed in place, and paging frees the storage it manages."""
    with torch._C.DisableTorchFunction(), torch.no_grad():
        t.data = t.detach().clone()


class Pager:
    """Keeps registered pages within ``budget`` bytes on the compute level.

    Args:
        budget: bytes the resident pages may take.
        swap: the swap space (the bottom level).
        io: background I/O engine (one is created if None).
        store: the level right below (default: the swap files, for a CPU compute level); pass a
            :class:`~apt_model.memory.stores.HostStore` for an accelerator.
        device: the compute device (default: CPU).
        reuse_memory: on a CPU compute level, keep evicted pages' memory for the next load of the
            same size, within the budget (:mod:`~apt_model.memory.page_buffers`); the setting
            ``paging_reuse_memory``. Default: only where the level below is the swap files.
        owns_swap: whether :meth:`close` deletes ``swap``'s folder (with the default store); the
            switch's paging session passes False: the folder is the VGPU stack's, shared with the
            activation offloader (see :class:`~apt_model.memory.stores.DiskStore`).

    Attributes:
        kept_bytes: training state kept resident on this level outside the pages (set by the
            paging session from the placement plan); reported with the level, not paged.
    """

    def __init__(self, budget: int, swap: SwapSpace, io: IOEngine | None = None, store=None,
                 device: torch.device | str = "cpu", reuse_memory: bool | None = None, owns_swap: bool = True):
        self.buffers = None  # set below; the budget's setter looks at it
        self.budget = int(budget)
        self.kept_bytes = 0
        #: the whole level's budget (pages plus kept state), set by the paging session; None: the
        #: page budget plus the kept bytes (they differ once the kept bytes exceed the level's)
        self.level_budget: int | None = None
        self.swap = swap
        self.io = io or IOEngine()
        self.store = store if store is not None else DiskStore(swap, self.io, owns_swap)
        self.device = torch.device(device)
        self.pages: dict[str, Page] = {}
        self.by_tensor: dict[int, Page] = {}  # id(live tensor) -> page, for fault handling
        self.stats = LevelStats()
        #: what the training loop is doing, set by the paging hooks (forward, backward, optimizer,
        #: other): the stall is counted per phase (a label only; on an accelerator the backward
        #: hooks set it from autograd's thread)
        self.phase = "other"
        self._lock = TimedLock(f"pager ({self.device} level)")
        self._tick = 0
        self._resident = 0
        self._writing = 0  # bytes of resident pages whose copies below are being written
        self._writing_pages: dict[int, Page] = {}  # id(page) -> page, WRITING, in the order their writes began
        self._acquiring: list[set[int]] = []  # id(page) of the pages each acquire() under way brings in
        self._freed_since_trim = 0
        self.rss = None  # a host.RSSWatch sampled before each trim (set by the paging session)
        self._deferred: deque[Page] = deque()  # releases asked for by finalizers, applied by the next call
        self._txn: dict[str, tuple[Page, _Saved]] | None = None  # protected pages of the step under way
        self._closed = False
        #: on a CPU compute level, the memory of evicted pages kept for the next load of the same
        #: size, within the budget (see apt_model.memory.page_buffers); None elsewhere
        if reuse_memory is None:
            reuse_memory = store is None  # a CPU standing in for an accelerator (a host level below) keeps none
        self.buffers = (FreePageBuffers() if reuse_memory and self.device.type == "cpu" and page_buffers_supported()
                        else None)

    # ------------------------------------------------------------------ bookkeeping
    @property
    def budget(self) -> int:
        """Bytes the pages may take on this level (the level's budget minus the state kept
        resident outside the pages). Lowering it gives free page buffers back first."""
        return self._budget

    @budget.setter
    def budget(self, value: int) -> None:
        self._budget = int(value)
        if self.buffers is not None:
            self._fit_buffers()

    def _fit_buffers(self, arriving: int = 0) -> None:
        """Give free page buffers back until they fit in the room the pages leave (with
        ``arriving`` bytes about to be allocated), and record the peak: buffers held + pages
        resident <= budget, always."""
        room = self._budget - self._resident - arriving
        if self.buffers.held > room:
            self.buffers.shrink(room)
        self._note_buffers()

    @property
    def resident_bytes(self) -> int:
        """Bytes the managed pages hold on this level now (kept as a running total)."""
        return self._resident

    @property
    def largest_page(self) -> int:
        """Bytes of the largest managed page (0 if none)."""
        return max((p.nbytes for p in self.pages.values()), default=0)

    def overshoot(self, pages: Iterable[Page], new_bytes: int = 0) -> int:
        """Bytes by which holding ``pages`` resident now, plus ``new_bytes`` the caller is about to
        allocate on this level, would take it past its budget plus its largest page — the bound the
        budget promises — even after every page that may go was evicted (0: it fits). Pages pinned
        by someone else or kept stay where they are. Scans every page: for decisions taken once,
        not per tensor op."""
        with self._lock:
            want = {id(p) for p in pages if p is not None}
            need = sum(p.nbytes for p in self.pages.values() if id(p) in want) + new_bytes
            if self._resident + need <= self._budget + self.largest_page:
                return 0
            stuck = sum(p.occupies for p in self.pages.values() if id(p) not in want and (p.pins or p.keep))
            return max(0, stuck + need - self._budget - self.largest_page)

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
            self._writing_pages.pop(id(page), None)
        page.state = state
        if state is State.WRITING:
            self._writing += page.nbytes
            self._writing_pages[id(page)] = page
        self._resident += page.occupies - before
        if self.buffers is not None and page.occupies > before:  # only growth can break the bound or raise the peak
            self._fit_buffers()

    def _touch(self, page: Page) -> None:
        self._tick += 1
        page.last_use = self._tick

    def _note_buffers(self) -> None:
        total = self._resident + self.kept_bytes + self.buffers.held
        if total > self.stats.peak_with_free_buffers:
            self.stats.peak_with_free_buffers = total

    def _note_resident(self) -> None:
        r = self.resident_bytes + self.kept_bytes
        self.stats.peak_resident = max(self.stats.peak_resident, r)
        self.stats.over_budget_bytes = max(self.stats.over_budget_bytes, r - self.whole_budget)

    @property
    def whole_budget(self) -> int:
        """Bytes the level may hold in all: pages plus kept state (see :attr:`level_budget`)."""
        return self.budget + self.kept_bytes if self.level_budget is None else self.level_budget

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
            page = Page(category, tensor_of, int(t.untyped_storage().nbytes()), label, keep=keep)
            page.bind(t)
            self._resident += page.occupies
            if self.buffers is not None:
                self._fit_buffers()
            self.pages[page.key] = page
            self.by_tensor[id(t)] = page
            self._touch(page)
            self._note_resident()
            if self.resident_bytes > self.budget:
                self.make_room(0, protect=[page])
            return page

    # ------------------------------------------------------------------ bindings
    def _live(self, page: Page) -> torch.Tensor | None:
        """The tensor ``page`` manages, after reconciling its binding with ``tensor_of()`` (under
        the lock). None when there is none (the page is then ABSENT).

        Raises:
            SwapError: the old binding is still referenced by someone and its bytes could not be
                read back into it (they are lost: it is NaN-filled, never left at 0 bytes).
            SwapTimeoutError: I/O in flight on the old binding did not finish in time.
        """
        t = page.tensor_of()
        if page.ref is not None and t is not None and t is page.ref():
            return t
        if page.ref is None and t is None:
            return None
        self._rebind(page, t)
        return page.bound()

    def _settle(self, page: Page, keep_errors: bool = False) -> None:
        """Finish the I/O in flight on ``page`` without freeing it: a write leaves it RESIDENT (its
        data is in memory whether or not the write worked), a read RESIDENT or, failed, LOWER.
        Errors of failed I/O are swallowed unless ``keep_errors``; a timeout always raises."""
        if page.state is State.WRITING and page.future is not None:
            fut = page.future
            try:
                self._wait(fut, page, "write")
            except BaseException:
                if not fut.done():
                    raise
            page.future, page.retain = None, False
            self._set(page, State.RESIDENT)
            if fut.exception() is None:
                page.dirty = False
                page.scales = []
            elif keep_errors:
                raise _labelled(fut.exception(), page)
        elif page.state is State.LOADING:
            try:
                self._finish_load(page)
            except BaseException:
                if page.state is State.LOADING or keep_errors:
                    raise

    def _rebind(self, page: Page, new: torch.Tensor | None) -> None:
        """``page.tensor_of()`` is no longer the tensor the page manages: settle the old binding and
        bind ``new`` (None: the page becomes ABSENT). Under the lock."""
        old = page.bound()
        # I/O in flight on the old binding finishes first (a job holds its storage; a failed read
        # leaves the page LOWER, and the old tensor, if still held, is read back below)
        self._settle(page)
        # someone still holds the old tensor: its bytes go back into it before the page lets go
        self._read_back(page, old, log_loss=True)
        if self.by_tensor.get(page.tensor_id) is page:
            del self.by_tensor[page.tensor_id]
        self._drop_storage(page)
        page.pins = 0  # pins were taken on the old tensor; their releases are clamped at 0
        n = int(new.untyped_storage().nbytes()) if new is not None else 0
        page.bind(new if n else None)
        if n:
            self.by_tensor[id(new)] = page
            self._hold_new_storage(page, n)

    def _drop_storage(self, page: Page) -> None:
        """The page lets go of the storage it managed: its lower copy is dropped (a step's pre-step
        copy stays, under its backup key, for a roll-back), it is ABSENT, and what belonged to that
        storage (dirty, deferred zeroing and scales, cached norm, I/O future) is reset. Under the lock."""
        if self._txn is None or page.key not in self._txn:
            self.store.remove(page)
        else:
            self.store.discard(page.key)
        self._set(page, State.ABSENT)
        page.dirty, page.zero_on_load, page.scales, page.cached_norm, page.future = False, False, [], None, None

    def _hold_new_storage(self, page: Page, nbytes: int) -> None:
        """The page manages a new resident storage of ``nbytes`` bytes, none of them below yet. Under the lock."""
        page.nbytes = nbytes
        self._set(page, State.RESIDENT)
        page.dirty = True
        self._touch(page)
        self._note_resident()

    def _read_back(self, page: Page, t: torch.Tensor | None, log_loss: bool = False) -> None:
        """If ``page``'s bytes are on a lower level, read them back into ``t`` (a tensor still
        holding the page's storage); nothing to do for None or a page that is not LOWER. Under the lock.

        Raises:
            SwapError: (labelled with the page) the bytes could not be read; ``t`` is NaN-filled,
                never left with empty storage (logged as an error with ``log_loss``).
        """
        if t is None or page.state is not State.LOWER:
            return
        storage = t.untyped_storage()
        try:
            self._load_into(page, storage)
        except BaseException as err:
            fill_lost(t, storage, page.nbytes)
            if log_loss:
                log.error("the replaced tensor %s could not be read back (%s); it was filled with NaN", page.label, err)
            raise _labelled(err, page) from None

    def sync(self, page: Page) -> torch.Tensor | None:
        """Reconcile ``page`` with its tensor now (see :meth:`_live`) and make room if a new tensor
        put the level over its budget. Returns the tensor, or None."""
        with self._lock:
            t = self._live(page)
            if t is not None and self.resident_bytes > self.budget:
                self.make_room(0, protect=[page])
            return t

    def rebind(self, page: Page) -> None:
        """The page's tensor object may have changed (a new gradient tensor): see :meth:`sync`."""
        self.sync(page)

    def restorage(self, page: Page) -> None:
        """``page``'s tensor got new storage under the same tensor object (``p.data = x``, which
        ``Module.to(dtype)`` and ``vector_to_parameters`` do): the page manages the new storage
        from now on, whatever its size, and the lower copy of the old one is dropped (whoever
        still holds the old storage has its bytes: the fault handler loaded it for the op). The
        tensor first gets its own copy of the new storage — which may be shared (a view into one
        flat vector) or still held by the caller (``x`` after ``p.data = x``), and eviction frees
        a storage in place — so ``x`` and ``p`` no longer share memory, unlike without paging.
        Pins are kept (they are the page's, not the storage's).

        Raises:
            ValueError: the new storage is another page's (``a.data = b.data`` between two paged
                tensors: two pages cannot manage one storage).
        """
        with self._lock:
            t = page.bound()
            if t is None:
                return
            with torch._C.DisableTorchFunction():
                key = t.untyped_storage()._cdata
                other = next((pg for pg in self.pages.values() if pg is not page and pg.bound() is not None
                              and pg.storage()._cdata == key), None)
                if other is not None:
                    raise ValueError(
                        f"{page.label}.data was set to the storage of {other.label}, another paged tensor: two "
                        "pages cannot manage one storage. Tie parameters by assigning the Parameter "
                        "(a.weight = b.weight), or enable(paging='off')")
            if t.numel():
                # always its own copy: the new storage may be shared (a view into one flat vector)
                # or still held by the caller (x after p.data = x), and eviction frees it in place
                _own_storage(t)
            page.generation += 1
            self._settle(page)
            self._drop_storage(page)  # pins stay: they are the page's
            n = int(t.untyped_storage().nbytes())
            page.nbytes = n
            if n:
                self._hold_new_storage(page, n)
            if self.resident_bytes > self.budget:
                self.make_room(0, protect=[page])

    def unregister(self, page: Page) -> None:
        """Stop managing ``page``: its tensor gets its bytes back first if it has data below.

        Raises:
            SwapError: the bytes could not be read back (the tensor is NaN-filled, not left empty).
        """
        with self._lock:
            try:
                t = self._live(page)
                self._settle(page)
                self._read_back(page, t)
            finally:
                self._forget(page)

    def discard(self, page: Page) -> None:
        """Stop managing ``page`` and forget its lower copy, without reading it back: for pages
        whose tensor is being thrown away (states created by a step that is rolled back)."""
        with self._lock:
            try:
                self._settle(page)
            finally:
                self._forget(page)

    def _forget(self, page: Page) -> None:
        self.store.forget(page)
        if self._txn is not None:
            self._txn.pop(page.key, None)
        if self.pages.pop(page.key, None) is not None:
            self._set(page, State.ABSENT)
        if self.by_tensor.get(page.tensor_id) is page:
            del self.by_tensor[page.tensor_id]

    # ------------------------------------------------------------------ I/O primitives
    def _wait(self, fut: Future, page: Page, what: str) -> None:
        """Wait (bounded) for ``page``'s ``what`` ("read", "write") to finish; re-raises its error.

        Raises:
            ForkedPagingError: at once, in a process forked while the job was in flight (it runs, and
                finishes, only in the parent: the wait took ``VB_SWAP_TIMEOUT`` per page until
                2026-11-28, twelve minutes for a small model's ``state_dict()`` in a forked child).
        """
        if not fut.done():
            if self.io.forked():
                from apt_model.memory.swap import ForkedPagingError

                raise ForkedPagingError(
                    f"the {what} of page {page.label} was in flight when this process (pid {os.getpid()}) was forked "
                    f"from the one that pages the model (pid {self.io.pid}): it finishes only there. Use the model in "
                    "the parent, fork before enable(), or start workers with the 'spawn' method")
            t0 = time.perf_counter()
            try:
                wait_future(fut, f"{what} of page {page.label} ({page.key}, {page.nbytes} bytes) "
                                 f"{'from' if what == 'read' else 'to'} the {self.store.level_kind} level below "
                                 f"{self.device}", self.io, "read" if what == "read" else "write")
            finally:
                dt = time.perf_counter() - t0
                self.stats.stall_s += dt
                self.stats.stall_by_phase[self.phase] = self.stats.stall_by_phase.get(self.phase, 0.0) + dt
        else:
            fut.result()  # re-raise I/O errors

    def _load_into(self, page: Page, storage: torch.UntypedStorage) -> None:
        """Read ``page``'s lower copy into ``storage`` now (allocating it), scalings applied; the
        page's own state is not changed. On failure ``storage`` is left empty and the error raised."""
        self._alloc(storage, page.nbytes)
        if page.zero_on_load:
            byte_view(storage).zero_()
            return
        ticket = JobTicket()
        try:
            fut = self.store.start_read(page, storage, ticket)
            self._wait(fut, page, "read")
            self.store.finish_read(page, storage)
        except BaseException as err:
            # the read (even one queued just before an interrupt) must be over before the memory goes
            if _job_over(ticket, err) and fut_done_or_absent(locals().get("fut")):
                self.store.abort_read(page)
                free_storage(storage)
            raise
        bound = page.bound()
        if page.scales and bound is not None:
            with torch._C.DisableTorchFunction():
                view = torch.empty(0, dtype=bound.dtype, device=storage.device).set_(
                    storage, bound.storage_offset(), bound.shape, bound.stride())
            self._apply_scales(page, view)

    def _start_load(self, page: Page) -> None:
        storage = page.storage()
        if storage is None:
            raise RuntimeError(f"page {page.label} has no tensor to load into")
        if storage.nbytes() != page.nbytes and not frees_in_place(storage):
            storage = self._fresh_storage(page, storage)
        self._alloc(storage, page.nbytes)
        if page.zero_on_load:
            byte_view(storage).zero_()
            self._set(page, State.RESIDENT)
            page.dirty, page.zero_on_load, page.future = True, False, None
            return
        ticket = JobTicket()
        try:
            page.future = self._host_room(lambda: self.store.start_read(page, storage, ticket), page)
            self._set(page, State.LOADING)
        except BaseException:
            if page.state is not State.LOADING:  # not loading: the page stays below
                page.future = None
                if ticket.settle(wait_timeout()):  # a read queued before an interrupt: taken back or over
                    free_storage(storage)
            raise
        self.stats.loads += 1
        self.stats.bytes_in += page.nbytes

    def _finish_unused_load(self, page: Page) -> None:
        """Finish the load of ``page``, which nobody waits for (a prefetch). Its errors are not the
        caller's: a failed read leaves the page below (its room freed anyway; whoever uses it later
        meets the error), a timed-out one leaves it loading. A page whose tensor was dropped
        meanwhile is settled, not loaded."""
        if self._live(page) is None or page.state is not State.LOADING:
            return
        try:
            self._finish_load(page)
        except Exception as err:  # noqa: BLE001 - see the docstring
            log.debug("load of %s not finished (%s: %s)", page.label, type(err).__name__, err)

    def _let_go_of_prefetch(self, page: Page) -> None:
        """Finish the load of ``page`` (a prefetch nobody has used) and free it — clean, no write."""
        self._finish_unused_load(page)
        if page.state is State.RESIDENT and page.pins == 0:
            self._evict(page)

    def _submit_write(self, page: Page, storage: torch.UntypedStorage):
        """Start writing ``storage`` as ``page``'s lower copy; returns the write's future. Should an
        interrupt leave this call after the write was queued, the write is taken back or waited
        for first (:class:`~apt_model.memory.io_engine.JobTicket`): no write the caller does not
        know of is left to finish later (over a newer copy, or from memory given back)."""
        ticket = JobTicket()
        try:
            return self._host_room(lambda: self.store.start_write(page, storage, ticket), page)
        except BaseException:
            ticket.settle(wait_timeout())
            raise

    def _host_room(self, start, page: Page):
        """``start()`` (a store call that needs a host segment for ``page``); when the host level is
        full of this pager's own loads — pages read from disk into it, whose host-to-device copies
        only this thread makes — finish those loads, which frees their room, and call it again.
        Reads and writes alike: a write behind (an eviction, a pre-step copy) meets a host level
        full of prefetches as a load does.

        Raises:
            HostLevelFullError: still full with no load of this pager's in flight.
        """
        try:
            return start()
        except HostLevelFullError as err:
            loading = [p for p in self.pages.values() if p.state is State.LOADING and p is not page]
            if not err.in_flight or not loading:
                raise
            for p in loading:
                self._finish_unused_load(p)  # its user meets a read error; retry regardless
            return start()

    def _finish_load(self, page: Page) -> None:
        fut = page.future
        storage = page.storage()
        try:
            if fut is not None:  # None: an interrupted call of this method already waited for it
                self._wait(fut, page, "read")
        except BaseException as err:
            if not fut.done():  # timed out: the read still writes into the storage; keep both
                raise
            page.future = None
            self.store.abort_read(page)
            if storage is not None:
                free_storage(storage)
            self._set(page, State.LOWER)
            raise _labelled(err, page) from None
        try:
            if storage is None:
                raise RuntimeError(f"page {page.label} lost its tensor while loading")
            self.store.finish_read(page, storage)
        except BaseException as err:
            page.future = None
            self.store.abort_read(page)
            if storage is not None:
                free_storage(storage)
            self._set(page, State.LOWER)
            raise _labelled(err, page) from None
        page.future = None
        self._set(page, State.RESIDENT)
        page.dirty = False
        self._apply_scales(page)

    @staticmethod
    def _apply_scales(page: Page, t: torch.Tensor | None = None) -> None:
        """Apply to ``t`` (default: the page's tensor) the multiplications the lower copy still owes,
        in order and with the same op (``_foreach_mul_`` or ``mul_``) the caller would have used.
        The page stays clean: the lower copy plus ``page.scales`` is the current value.

        A tensor factor on another device than ``t`` (gradient clipping's coefficient is a 0-dim
        tensor on the accelerator; the host step materializes gradients into host buffers) is copied
        to ``t``'s device first: the same fp32 value, one 4-byte copy, which waits for the device."""
        if not page.scales:
            return
        t = page.bound() if t is None else t
        if t is None:
            return
        for factor, foreach in page.scales:
            Pager._apply_scale(t, factor, foreach)

    @staticmethod
    def _apply_scale(t: torch.Tensor, factor, foreach: bool) -> None:
        """``t *= factor`` with the op the caller would have used (see :meth:`_apply_scales`)."""
        with torch.no_grad(), torch._C.DisableTorchFunction():
            if isinstance(factor, torch.Tensor) and factor.device != t.device:
                factor = factor.to(t.device)
            if foreach:
                torch._foreach_mul_([t], factor)
            else:
                t.mul_(factor)

    def zero_lower(self, page: Page) -> bool:
        """Zero a paged-out page without reading it (``grad.zero_()`` by ``zero_grad(set_to_none=False)``):
        it loads as zeros next time. Returns False (the caller zeroes it in memory instead) unless
        the page is only below and unpinned."""
        with self._lock:
            if self._live(page) is None or page.state is not State.LOWER or page.pins:
                return False
            page.zero_on_load, page.scales, page.cached_norm = True, [], None
            return True

    def defer_scale(self, page: Page, factor: torch.Tensor, foreach: bool) -> bool:
        """Multiply a page by ``factor`` without making it dirty: a paged-out page lazily (on its
        next load); a clean resident one (a gradient :meth:`write_behind` kept) in memory now, the
        factor also owed by its lower copy, so that dropping it still costs no write. Returns False
        if the page is dirty and resident (the caller multiplies it in place instead)."""
        with self._lock:
            t = self._live(page)
            if t is None:
                return False
            if page.state is State.WRITING and page.future is not None:
                # scaling it in place would wait for this write too, then dirty the page and write
                # it again: wait (bounded) here and defer instead (an async device-to-host copy)
                self._finish_write(page, wait=True)
            clean_resident = (page.state is State.RESIDENT and not page.dirty and not page.zero_on_load
                              and self.store.has(page))
            if not clean_resident and page.state is not State.LOWER:
                return False
            page.scales.append((factor, foreach))
            if clean_resident:
                self._apply_scale(t, factor, foreach)
            page.cached_norm = None
            return True

    def _evict(self, page: Page, retain: bool = False) -> None:
        """Write ``page`` out if it is dirty and free it; with ``retain`` (:meth:`write_behind`) its
        memory is kept: the page ends resident and clean once the write lands."""
        page.retain = retain
        if self._live(page) is None or page.state is not State.RESIDENT:
            return  # its tensor is gone (or was replaced and is being written): nothing to free here
        storage = page.storage()
        if not frees_in_place(storage):
            # exported to NumPy (``p.detach().numpy()``: TensorBoard histograms), which fixes the
            # storage's size for good, or moved to shared memory (a DataLoader's spawn workers were
            # sent a model: torch.multiprocessing shares its tensors' storages; resizing that memory
            # crashed the process, until 2026-11-26): the tensor gets its own copy to page, the
            # export or the workers keep the old
            if page.category is Category.PARAM and storage.is_shared():
                _warn_unshared(page.label)
            _own_storage(page.bound())
            storage = page.storage()
            page.dirty = True
        if page.dirty or not self.store.has(page):
            page.future = self._submit_write(page, storage)
            self._set(page, State.WRITING)
            if page.future.done():  # a synchronous copy (CPU host level): free the bytes now; an
                self._finish_write(page, wait=False)  # async one is freed by reap() once its event completed
        elif not retain:
            self._free(page)

    def _alloc(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the page storage ``storage`` ``nbytes`` bytes: a kept buffer of that size if there
        is one (CPU level), else fresh memory."""
        if self.buffers is None:
            alloc_storage(storage, nbytes)
        elif not self.buffers.take(storage, nbytes):
            self._fit_buffers(arriving=nbytes)  # fresh memory: buffers give way before it is taken
            alloc_storage(storage, nbytes)

    def _fresh_storage(self, page: Page, storage: torch.UntypedStorage, nbytes: int | None = None) -> torch.UntypedStorage:
        """Bind ``page``'s tensor to a private storage of ``nbytes`` (default: the page's size) in
        place of ``storage``, which must not be resized: in shared memory (its storage shared
        directly, ``p.untyped_storage().share_memory_()``, or by ``torch.multiprocessing`` while a
        write of the page was in flight) or fixed in size. Resizing such a storage to 0 and back
        crashed the process at the page's next load (a segfault, found 2026-11-28); whoever shared
        the old storage keeps it. Returns the new storage."""
        bound = page.bound()
        if page.category is Category.PARAM and storage.is_shared():
            _warn_unshared(page.label)
        with torch._C.DisableTorchFunction(), torch.no_grad():
            fresh = torch.UntypedStorage(page.nbytes if nbytes is None else nbytes, device=storage.device)
            bound.data = torch.empty(0, dtype=bound.dtype, device=storage.device).set_(
                fresh, bound.storage_offset(), bound.shape, bound.stride())
        return page.storage()

    def _free(self, page: Page) -> None:
        storage = page.storage()
        page.cached = False
        self._set(page, State.LOWER)
        page.dirty = False
        self.stats.bytes_out += page.nbytes
        if storage is not None and not frees_in_place(storage) and page.bound() is not None:
            storage = self._fresh_storage(page, storage, nbytes=0)  # the old one is someone else's now
        if storage is not None:
            if self.buffers is not None and self.buffers.keep(storage, self.budget - self._resident):
                self._note_buffers()
                return  # the memory waits for the next load of its size, within the budget
            free_storage(storage)
        self._freed_since_trim += page.nbytes
        if self.device.type == "cpu" and self._freed_since_trim >= _TRIM_EVERY:
            self.trim()

    def _finish_write(self, page: Page, wait: bool, free: bool = False) -> bool:
        """Complete a page's write; frees it unless pinned or retained (:meth:`write_behind`; with
        ``free``, a retained page is freed too: its room is needed). Returns False if still running."""
        fut = page.future
        if fut is None:
            return True
        if not wait and not fut.done():
            return False
        try:
            self._wait(fut, page, "write")
        except BaseException as err:
            if fut.done():  # the write failed: the data is still in memory, nothing lost
                page.future = None
                self._set(page, State.RESIDENT)
                raise _labelled(err, page) from None
            # a timed-out write is still running and reading the page's memory: it stays WRITING
            raise
        page.future = None
        page.scales = []  # the new lower copy already has every scaling applied
        retained, page.retain = page.retain and not free, False
        if page.pins > 0 or page.bound() is None or retained:
            self._set(page, State.RESIDENT)
            page.dirty = False
            page.cached = retained and page.pins == 0
            if page.bound() is None:
                self._live(page)  # the tensor was dropped while it was written: settle the page now
        else:
            self._free(page)
        return True

    def reap(self) -> None:
        """Free the pages whose background writes have completed (and apply deferred releases).

        Only the pages being written are looked at, oldest write first; where the store's writes
        complete in the order they began (all on the host level's stream of copies down:
        ``store.writes_in_order``), the first
        write still running ends the look — every later one is running too.

        Raises:
            SwapFullError / SwapError: a write failed (the page stays resident, nothing is lost).
        """
        with self._lock:
            self._drain_deferred()
            in_order = self.store.writes_in_order
            for page in list(self._writing_pages.values()):  # all WRITING (kept by _set)
                if not self._finish_write(page, wait=False) and in_order:
                    break

    # ------------------------------------------------------------------ policy
    def make_room(self, nbytes: int, protect: Iterable[Page] = (), wait: bool = True) -> None:
        """Evict until ``nbytes`` more fit in the budget (as far as unpinned pages allow): least
        recently used resident pages first, then (``wait``) waiting for their writes, then
        finishing and freeing unused prefetches. With ``wait=False`` the writes of evicted dirty
        pages are started but not waited for.

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
            # written-behind copies nobody used since first (dropping them costs no I/O, and they are
            # what eviction at once would have freed), then least recently used
            victims = sorted((p for p in self.pages.values()
                              if p.state is State.RESIDENT and p.pins == 0 and not p.keep and id(p) not in protected),
                             key=lambda p: (not p.cached, p.last_use))
            for victim in victims:
                if need <= 0:
                    break
                if victim.state is not State.RESIDENT or victim.pins:
                    continue  # settled meanwhile (a replaced tensor's page)
                self._evict(victim)
                if victim.state is not State.RESIDENT:  # written behind, freed, or its tensor was gone
                    need -= victim.nbytes
            if not wait:
                return
            # evicted dirty pages still hold memory until their writes land: wait for enough of them
            for page in sorted(self._writing_pages.values(), key=lambda p: p.last_use):
                if self.resident_bytes + nbytes <= self.budget:
                    break
                self._finish_write(page, wait=True, free=True)
            if self.resident_bytes + nbytes <= self.budget:
                return
            # prefetches nobody has used hold room too (the step's first chunk, prefetched after a
            # backward that gradient accumulation follows with another backward): finish them, oldest
            # first, and free them — clean, they cost no write
            acquiring = set().union(*self._acquiring)  # loads an acquire() under way finishes and pins
            for page in sorted((p for p in self.pages.values() if p.state is State.LOADING and p.pins == 0
                                and p.future is not None and not p.keep and id(p) not in protected
                                and id(p) not in acquiring),
                               key=lambda p: p.last_use):  # (no future: its load is being finished)
                if self.resident_bytes + nbytes <= self.budget:
                    break
                self._let_go_of_prefetch(page)

    def acquire(self, pages: Iterable[Page], for_write: bool = False) -> None:
        """Make ``pages`` resident and pin them (waits for their loads and in-flight writes).
        Pages whose tensor is gone (a gradient set to None) are skipped: there is nothing to load.
        Either every page is pinned or, when this raises, none is.

        Raises:
            SwapCorruptionError / SwapError: a page's swap file failed its checks; the page
                stays on the lower level. The message names the tensor.
            SwapTimeoutError: a read or write did not finish within ``VB_SWAP_TIMEOUT`` seconds
                (the page stays loading or writing; a later call picks it up), or the pager's
                lock was held by another thread that long.
        """
        pages = [p for p in pages if p is not None]
        with self._lock:
            self._drain_deferred()
            pages = [p for p in pages if self._live(p) is not None]
            self._acquiring.append({id(p) for p in pages})  # not reclaimed by a make_room meanwhile
            try:
                self._acquire(pages, for_write)
            finally:
                self._acquiring.pop()

    def _acquire(self, pages: list[Page], for_write: bool) -> None:
        """:meth:`acquire`'s work (under the lock)."""
        missing = sum(p.nbytes for p in pages if p.state is State.LOWER)
        if missing:
            self.make_room(missing, protect=pages)
        pinned: list[Page] = []
        try:
            for p in pages:
                if p.state is State.WRITING:
                    p.pins += 1  # keeps _finish_write from freeing it
                    try:
                        self._finish_write(p, wait=True)  # a failed write raises; the page stays in memory
                    finally:
                        p.pins -= 1
                if p.state is State.LOWER:
                    self._start_load(p)
                elif p.state is State.RESIDENT:
                    self.stats.hits += 1
            for p in pages:
                if p.state is State.LOADING:
                    self._finish_load(p)
                if p.state is not State.RESIDENT:
                    continue  # dropped meanwhile
                p.pins += 1
                p.cached = False
                pinned.append(p)
                if for_write:
                    p.dirty = True
                    p.cached_norm = None
                self._touch(p)
        except BaseException:
            for p in pinned:
                p.pins = max(0, p.pins - 1)
            raise
        self._note_resident()

    def mark_written(self, pages: Iterable[Page]) -> None:
        """``pages``, resident and pinned by someone else (a module's hooks), were written in place
        (``torch.embedding_renorm_`` under ``nn.Embedding(max_norm=...)``, a weight clamped in its
        module's forward): their next eviction writes them out instead of dropping the bytes as
        clean."""
        with self._lock:
            for p in pages:
                if p.state is State.RESIDENT:
                    p.dirty = True
                    p.cached_norm = None

    def release(self, pages: Iterable[Page], evict: bool = False) -> None:
        """Unpin ``pages``; with ``evict``, start writing them out now (write-behind)."""
        with self._lock:
            self._drain_deferred()
            pages = [p for p in pages if p is not None]
            for p in pages:  # every pin goes first: an eviction below may raise
                p.pins = max(0, p.pins - 1)
            if evict:
                for p in pages:
                    if p.pins == 0 and not p.keep and p.state is State.RESIDENT:
                        self._evict(p)
            if self.resident_bytes > self.budget:
                self.make_room(0)

    def unpin(self, pages: Iterable[Page]) -> None:
        """Unpin ``pages`` and do nothing else (no eviction, no I/O): for failure paths."""
        with self._lock:
            for p in pages:
                if p is not None:
                    p.pins = max(0, p.pins - 1)

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
            todo = [p for p in pages if p is not None and p.state is State.LOWER and self._live(p) is not None
                    and p.state is State.LOWER]
            if not todo:
                return
            need = sum(p.nbytes for p in todo) + reserve
            if self.resident_bytes + need > self.budget:
                self.make_room(need, protect=todo, wait=False)
            for p in todo:
                if p.state is not State.LOWER:
                    continue
                if self.resident_bytes + p.nbytes + reserve > self.budget and self.resident_bytes > 0:
                    break
                self._start_load(p)
                self._touch(p)
            self._note_resident()

    def write_behind(self, pages: Iterable[Page]) -> None:
        """Start writing unpinned dirty resident ``pages`` to the level below and keep their memory:
        once a write lands the page is resident and clean — a cached copy that :meth:`make_room`
        drops without I/O when it needs the room, and that the next :meth:`acquire` finds resident
        (a hit, no read). A gradient is the case this is for: written as backward produces it (as
        :meth:`evict_now` would), read again by the optimizer step soon after, when the level often
        still has room for it. A clean page is left as it is.
        """
        self._evict_unpinned(pages, retain=True)

    def evict_now(self, pages: Iterable[Page]) -> None:
        """Write out (if dirty) and free unpinned ``pages`` now."""
        self._evict_unpinned(pages, retain=False)

    def _evict_unpinned(self, pages: Iterable[Page], retain: bool) -> None:
        with self._lock:
            self._drain_deferred()
            for p in pages:
                if p is not None and p.pins == 0 and not p.keep and p.state is State.RESIDENT:
                    self._evict(p, retain=retain)

    def drop(self, page: Page) -> None:
        """Forget the page's data (its tensor was set to None): see :meth:`sync`, which settles a
        page whose tensor is gone — its bytes go back into the old tensor if anything holds it."""
        self.sync(page)

    def revive(self, page: Page) -> None:
        """An ABSENT page's tensor exists again (a new gradient): see :meth:`sync`."""
        self.sync(page)

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
        """Return freed heap memory to the OS now (``malloc_trim``), sampling the RSS first."""
        if self.rss is not None:
            self.rss.sample()
        release_free_memory()
        self._freed_since_trim = 0

    def materialize(self, page: Page, out: torch.Tensor | None = None, settle: bool = True) -> torch.Tensor:
        """A CPU tensor with the page's current data (the page stays where it is): a new one, or
        ``out`` (a CPU tensor of the page's shape and dtype) filled in place. A page whose write
        to the host level is under way is read from that host copy once the copy's event completed
        (``settle``; see :meth:`_settle_write`), else from memory.

        Raises:
            SwapCorruptionError / SwapError: the page is only below and its copy cannot be read;
                the message names the tensor and the file.
            RuntimeError: the page has no tensor any more.
        """
        with self._lock:
            t = self._live(page)
            if t is None:
                raise RuntimeError(f"page {page.label} has no tensor (it was set to None)")
            if settle:
                self._settle_write(page)
            if page.state in (State.RESIDENT, State.WRITING, State.LOADING):
                if page.state is State.LOADING:
                    self._finish_load(page)
                if page.state is not State.LOWER:
                    with torch._C.DisableTorchFunction():
                        if out is None:
                            return t.detach().to("cpu", copy=True)
                        return out.copy_(t.detach())
            if out is None:
                out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
            if page.zero_on_load:
                out.zero_()
            else:
                try:
                    self.store.read_to_cpu(page, out)
                except BaseException as err:
                    raise _labelled(err, page) from None
                self._apply_scales(page, out)
            return out

    def host_copy(self, page: Page) -> torch.Tensor | None:
        """The page's current data as a CPU tensor sharing its lower copy in host memory (no copy),
        for reading at once; None where that is not the current data as is — the page is resident
        and dirty (or loading), owes deferred scalings or zeroing, or its copy is not in host memory
        (use :meth:`materialize`, with ``settle=False``: this already waited). A clean resident page
        (kept by :meth:`write_behind`) is read from its lower copy too: on an accelerator that spares
        a device-to-host copy. A write to the host level still running is waited for
        (:meth:`_settle_write`; never raises).
        """
        with self._lock:
            t = self._live(page)
            if t is None:
                return None
            self._settle_write(page)
            clean = page.state is State.LOWER or (page.state is State.RESIDENT and not page.dirty)
            if not clean or page.scales or page.zero_on_load:
                return None
            return self.store.host_tensor(page, t)

    def _settle_write(self, page: Page) -> None:
        """Where ``page`` is being written to the host level, wait for that copy's event (only it)
        so that the page can be read from its host copy: a copy from the device would wait for all
        the work queued on the compute stream. Never raises: a write that failed or did not finish
        in time leaves the bytes in memory, where the caller reads them (and the write's error
        reaches whoever waits for it next). On a CPU-only run (no host level) nothing is waited for."""
        if page.state is not State.WRITING or page.future is None or self.store.level_kind != "host":
            return
        try:
            self._finish_write(page, wait=True)
        except Exception as err:  # noqa: BLE001 - see the docstring
            log.debug("write of %s not settled (%s: %s); read from memory", page.label, type(err).__name__, err)

    # ------------------------------------------------------------------ step transactions
    def begin_step(self) -> None:
        """Start a step transaction: pages passed to :meth:`protect` until :meth:`commit` or
        :meth:`rollback` keep their pre-step copy."""
        with self._lock:
            if self._txn:
                self.commit()
            self._txn = {}

    def protect(self, pages: Iterable[Page]) -> None:
        """Keep the current version of ``pages`` (acquired: resident and pinned) as their pre-step
        copy before the step modifies them. A clean page's lower copy is renamed aside (no I/O); a
        page whose current bytes are only in memory is written first, synchronously. The pages are
        dirty afterwards: their next eviction writes a new version beside the old one.

        Raises:
            SwapFullError / SwapError: the pre-step bytes of a page held only in memory could not
                be written (nothing was modified; the caller rolls back what it already did).
            RuntimeError: no step transaction is open, or a page is not resident.
        """
        with self._lock:
            if self._txn is None:
                raise RuntimeError("protect() outside a step transaction (call begin_step() first)")
            for page in pages:
                if page is None or page.key in self._txn or self._live(page) is None:
                    continue
                if page.state is not State.RESIDENT:
                    raise RuntimeError(f"page {page.label} must be acquired before it is protected")
                if page.dirty and not page.zero_on_load:
                    page.pins += 1
                    try:
                        page.future = self._submit_write(page, page.storage())
                        self._set(page, State.WRITING)
                        self._finish_write(page, wait=True)
                    finally:
                        page.pins -= 1
                saved = _Saved(page, backup=self.store.rename(page.key, page.key + _BACKUP))
                self._txn[page.key] = (page, saved)
                page.dirty = True
                page.cached_norm = None
                page.scales = []  # the bytes in memory have every scaling applied already

    def in_transaction(self, page: Page) -> bool:
        """Whether ``page`` was protected by the open step transaction (the step modified it)."""
        txn = self._txn
        return bool(txn) and page.key in txn

    def commit(self) -> None:
        """The step completed: forget the pre-step copies of the protected pages."""
        with self._lock:
            txn, self._txn = self._txn or {}, None
            for page, saved in txn.values():
                if saved.backup:
                    self.store.discard(page.key + _BACKUP)

    def rollback(self) -> dict[str, str]:
        """The step failed: every protected page goes back to its pre-step copy (its new bytes, in
        memory or below, are dropped). Returns ``{label: why}`` for pages that could not be put
        back — only possible for a page someone else keeps pinned whose copy cannot be read."""
        lost: dict[str, str] = {}
        with self._lock:
            txn, self._txn = self._txn or {}, None
            for page, saved in txn.values():
                try:
                    self._settle(page)
                except BaseException as err:  # a timed-out write: it still reads the page's memory
                    lost[page.label] = (f"its write did not finish ({err}); "
                                        f"the pre-step copy is kept as {page.key}{_BACKUP}")
                    continue
                self.store.discard(page.key)
                if saved.backup:
                    self.store.rename(page.key + _BACKUP, page.key)
                page.scales, page.cached_norm, page.zero_on_load = saved.scales, saved.cached_norm, saved.zero_on_load
                if page.state is State.RESIDENT:
                    if page.pins == 0:
                        self._free(page)
                        self.stats.bytes_out -= page.nbytes  # a roll-back, not traffic
                    else:  # held by someone (an alias): give it the pre-step bytes in place
                        storage = page.storage()
                        try:
                            self._load_into(page, storage)
                            page.dirty = False
                        except BaseException as err:
                            fill_lost(page.bound(), storage, page.nbytes)
                            lost[page.label] = f"its pre-step copy could not be read: {err}"
                elif page.state is State.LOWER and not (saved.backup or saved.zero_on_load):
                    lost[page.label] = "it had no pre-step copy"
        return lost

    # copies of tensors the plan keeps resident (not pages): written straight from their memory
    def copy_out(self, t: torch.Tensor, label: str) -> Page:
        """Start writing ``t``'s bytes to the level below as a copy (not a managed page: ``t``
        keeps its memory). Returns the copy's handle for :meth:`copy_wait` / :meth:`copy_in` /
        :meth:`copy_drop`. ``t`` must not be modified until :meth:`copy_wait` returned."""
        copy = Page(Category.STATE, (lambda t=t: t), int(t.untyped_storage().nbytes()), f"{label} (pre-step copy)",
                    pre_step_copy=True)
        copy.bind(t)
        with self._lock:
            copy.future = self._submit_write(copy, t.untyped_storage())
        return copy

    def copy_wait(self, copy: Page) -> None:
        """Wait for :meth:`copy_out`'s write.

        Raises:
            SwapFullError / SwapError: the copy could not be written (named).
            SwapTimeoutError: it did not finish within ``VB_SWAP_TIMEOUT`` seconds.
        """
        fut = copy.future
        if fut is None:
            return
        try:
            self._wait(fut, copy, "write")
        except BaseException as err:
            if fut.done():
                copy.future = None
            raise _labelled(err, copy) from None
        copy.future = None

    def copy_in(self, copy: Page, t: torch.Tensor) -> None:
        """Read the copy back into ``t``'s memory (the pre-step value).

        Raises:
            SwapError: the copy cannot be read (the message names the tensor).
        """
        self.copy_wait(copy)
        storage = t.untyped_storage()
        with self._lock:
            ticket = JobTicket()
            try:
                fut = self.store.start_read(copy, storage, ticket)
                self._wait(fut, copy, "read")
                self.store.finish_read(copy, storage)
            except BaseException as err:
                _job_over(ticket, err)  # a read still running would write the pre-step bytes into ``t`` later
                self.store.abort_read(copy)
                raise _labelled(err, copy) from None

    def copy_drop(self, copy: Page) -> None:
        """Forget the copy (waiting for its write first, whatever its outcome)."""
        try:
            if copy.future is not None:
                self.copy_wait(copy)
        except SwapError:
            pass
        finally:
            self.store.forget(copy)  # a copy's key is never written again: its file goes too

    @property
    def in_step(self) -> bool:
        """Whether a step transaction is open."""
        return self._txn is not None

    # ------------------------------------------------------------------ teardown
    def recover(self) -> dict[str, str]:
        """Bring every page back into memory for good, as far as its bytes can be read; returns
        ``{label: why}`` for the pages whose bytes could not (their tensors get NaN-filled memory,
        never 0 bytes) — a corrupt, missing or unreadable file, or a read that did not finish.
        Every page is tried, whatever failed before it. The pager manages nothing afterwards.

        An interrupt (``KeyboardInterrupt`` from a signal handler) is no lost page: it stops the
        recovery and propagates, leaving every page as the pager knew it, so a second call finishes
        the job."""
        lost: dict[str, str] = {}
        with self._lock:
            self._drain_deferred()
            if self._txn:
                for label, why in self.rollback().items():
                    lost[label] = why
            budget, self.budget = self.budget, sys.maxsize  # everything comes back: nothing may be evicted meanwhile
            try:
                self._bring_back_all(lost)
            except BaseException:
                self.budget = budget  # interrupted: the pager goes on managing what is left
                raise
            self.pages.clear()
            self.by_tensor.clear()
            self._resident = 0
            self._writing = 0
            self._writing_pages.clear()
            if self.buffers is not None:
                self.buffers.clear()
        return lost

    def _bring_back_all(self, lost: dict[str, str]) -> None:
        """:meth:`recover`'s loop (under the lock): every live page resident, or named in ``lost``."""
        for p in list(self.pages.values()):
            try:
                t = self._live(p)
            except Exception as err:  # noqa: BLE001 - an old binding that could not be read back
                lost[p.label] = str(err)
                continue
            if t is None:
                continue
            try:
                self._settle(p)
            except Exception as err:  # noqa: BLE001 - a read that timed out is still running
                lost[p.label] = f"its read did not finish: {err}"
                if p.future is not None:  # its memory is the read's until it ends; if it fails, NaN
                    p.future.add_done_callback(
                        lambda f, t=t, st=t.untyped_storage(), n=p.nbytes: f.exception() is not None
                        and fill_lost(t, st, n))
                continue
            if p.state is State.LOWER:
                storage = t.untyped_storage()
                where = self.store.describe(p.key)
                try:
                    self._load_into(p, storage)
                except Exception as err:  # noqa: BLE001
                    fill_lost(t, storage, p.nbytes)
                    lost[p.label] = str(err) if where.split(" ")[-1] in str(err) else f"{where}: {err}"
                    log.error("paged tensor %s could not be brought back (%s): it holds NaN now", p.label, err)
                    continue
                self._set(p, State.RESIDENT)

    def close(self) -> None:
        """Bring every page back to memory, stop the I/O threads, delete the swap folder — unless a
        page's bytes were lost: then the folder is kept (:meth:`SwapSpace.retain`) and this raises.

        Raises:
            PagingRecoveryError: pages whose bytes could not be brought back, each named with the
                file and the reason; everything else was brought back first.
            SwapTimeoutError: the I/O threads did not stop within ``VB_SWAP_TIMEOUT`` seconds.
        """
        if self._closed:
            return
        if self.io.forked():
            self._close_forked()
        try:
            lost = self.recover()  # frees the free page buffers when it completes
        except BaseException:
            self._clear_buffers_after_failure()
            raise
        self._closed = True
        if lost:
            folder = self.swap.retain(lost)
            try:
                self.io.close()
            except BaseException as err:  # noqa: BLE001 - the lost pages are the news
                log.warning("swap I/O threads did not stop: %s", err)
            names = ", ".join(lost)
            raise PagingRecoveryError(
                f"{len(lost)} paged tensor(s) could not be brought back into memory and hold NaN now: {names}. "
                f"Every other tensor was restored. Their swap folder {folder} is kept for inspection "
                f"(see RECOVERY.txt there): " + "; ".join(f"{k}: {v}" for k, v in lost.items()),
                lost=lost, folder=folder)
        self.store.close()

    def _close_forked(self) -> None:
        """:meth:`close` in a child made by ``os.fork()`` after paging started: the reads and writes
        in flight at the fork, and the I/O threads, exist only in the parent, so waiting for them
        would wait out every timeout (about 2 minutes per page). The child's resident pages keep
        their bytes (the fork copied them); the others get NaN-filled memory (never 0 bytes) and
        are named. The parent's swap folder is left alone (the child neither reads nor deletes it).

        Raises:
            ForkedPagingError: some paged tensors had no bytes in this process (named).
        """
        from apt_model.memory.swap import ForkedPagingError

        self._closed = True
        lost = []
        for p in list(self.pages.values()):
            t = p.bound()
            if t is None or p.state in (State.RESIDENT, State.WRITING):
                continue
            fill_lost(t, t.untyped_storage(), p.nbytes)
            lost.append(p.label)
        self.pages.clear()
        self.by_tensor.clear()
        self._resident = self._writing = 0
        self._writing_pages.clear()
        if lost:
            raise ForkedPagingError(
                f"this process (pid {os.getpid()}) was forked by the process that pages the model (pid {self.io.pid}): "
                f"{len(lost)} paged tensor(s) had their bytes in the parent's swap files only and hold NaN here: "
                f"{', '.join(lost[:8])}{' ...' if len(lost) > 8 else ''}. The parent's paging is untouched; "
                "fork before enable(), or start workers with the 'spawn' method")

    def _clear_buffers_after_failure(self) -> None:
        """Free the free page buffers after :meth:`recover` failed (the lock may be what failed:
        then they are left to go with the pager, and a warning says so)."""
        if self.buffers is None:
            return
        try:
            with self._lock:
                self.buffers.clear()
        except Exception as err:  # noqa: BLE001 - the caller raises the first failure
            log.warning("free page buffers (%d bytes) not freed at close: %s", self.buffers.held, err)

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
        return {"budget": self.whole_budget, "page_budget": self.budget, "kept_bytes": self.kept_bytes,
                "largest_page": self.largest_page, "categories": by_cat, **self.stats.to_dict(),
                "free_page_buffers": self.buffers.report() if self.buffers is not None else None,
                "resident_bytes": self.resident_bytes + self.kept_bytes}
