"""Free page buffers: the memory of evicted pages, kept for the next page of the same size.

On a CPU-only run the compute level is host RAM. A page evicted to the swap files gives its
memory back (its storage resized to 0 bytes) and a page loaded later asks the allocator for
fresh memory. Since the paging session has glibc map every block of 1 MiB or more on its own
(:func:`~apt_model.memory.host.return_big_blocks_to_os`, so that evicted bytes leave the RSS),
each such fresh block costs page faults, and the kernel zeroes every page before the O_DIRECT read
overwrites it; each freed one costs an ``munmap``. ``perf record`` of the offload benchmark's paged
step (2026-11-26, AMD EPYC Zen 3, 2 vCPUs, docs/benchmarks.md) put 14% of all CPU samples in page
faults, a third of them inside the swap reads' ``preadv``.

:class:`FreePageBuffers` keeps freed page memory, by exact byte size, and gives it to the next
page of that size to be loaded. The memory moves between storages with
``torch.UntypedStorage._swap_data_ptr_`` (torch's swap of two storages' allocations; a private
method, so it is probed: :func:`supported`): the page's storage keeps its identity, so every view of
it, autograd's saved references and the optimizer's stay valid, exactly as with ``resize_``. A
buffer's bytes are whatever the last page held; every load overwrites all of them (or zeroes them).

Policy (the pager applies it; this class only holds buffers):

* **Bounded by the budget.** The pager keeps ``held + resident pages <= page budget``: a freed
  page is kept only if it fits under that bound, and whenever the resident bytes grow by
  something other than a buffer taken from here (a gradient from backward, a state from the step,
  a page of a size not held — before its fresh memory is allocated) or the budget is lowered,
  buffers are dropped first (:meth:`shrink`). They are all freed when the pager closes. So the memory the pages
  may take in the RSS is still the budget — the buffers hold part of what the budget allows and
  the pages do not use at the moment.
* **Big blocks only**: ``min_bytes`` (default 1 MiB, the mmap threshold above); smaller blocks come
  from glibc's heap, which reuses them already.
* **Exact sizes**, newest buffer first; :meth:`shrink` drops the largest sizes first (fewest frees).
* Nothing here is thread-safe: the pager calls it under its lock.

Where ``_swap_data_ptr_`` is missing (an older torch) or refuses a storage, nothing is kept:
pages get fresh memory as before (:func:`supported` says which).
"""
from __future__ import annotations

import torch

from apt_model.memory.host import MMAP_THRESHOLD
from apt_model.memory.pages import frees_in_place

_SWAP = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)


def supported() -> bool:
    """Whether this torch can move an allocation between storages (``UntypedStorage._swap_data_ptr_``)."""
    return _SWAP is not None


class FreePageBuffers:
    """Host memory of freed pages, by byte size, for reuse by pages loaded later (see the module
    docstring for the policy and the measurement behind it).

    Args:
        min_bytes: smallest buffer kept, in bytes (default 1 MiB).

    Raises:
        ValueError: ``min_bytes`` is below 1.
    """

    def __init__(self, min_bytes: int = MMAP_THRESHOLD):
        if int(min_bytes) < 1:
            raise ValueError(f"min_bytes must be >= 1, got {min_bytes}")
        self.min_bytes = int(min_bytes)
        self._free: dict[int, list[torch.UntypedStorage]] = {}  # nbytes -> holders, oldest first
        self.held = 0  # bytes held now
        self.peak_held = 0
        self.hits = 0  # loads served from a held buffer
        self.misses = 0  # loads of a size >= min_bytes that found none
        self.kept = 0  # freed pages whose memory was kept
        self.dropped = 0  # buffers given back to the allocator by shrink()

    def _eligible(self, storage: torch.UntypedStorage, nbytes: int) -> bool:
        return _SWAP is not None and nbytes >= self.min_bytes and storage.device.type == "cpu"

    def take(self, storage: torch.UntypedStorage, nbytes: int) -> bool:
        """Give the empty ``storage`` a held buffer of exactly ``nbytes`` bytes (its contents are
        stale: the caller overwrites them). Returns whether it did; on False ``storage`` is
        untouched and the caller allocates."""
        if not self._eligible(storage, nbytes) or storage.nbytes() != 0 or not storage.resizable():
            return False
        holders = self._free.get(nbytes)
        if not holders:
            self.misses += 1
            return False
        holder = holders.pop()
        if not holders:
            del self._free[nbytes]
        self.held -= nbytes
        storage._swap_data_ptr_(holder)  # storage: the buffer's bytes; holder: empty, dropped
        self.hits += 1
        return True

    def keep(self, storage: torch.UntypedStorage, limit: int) -> bool:
        """Keep the memory of ``storage`` (a page's, whose bytes are no longer needed) if the buffers
        then hold at most ``limit`` bytes; ``storage`` is left with 0 bytes, as ``resize_(0)`` would.
        Returns whether it did; on False ``storage`` is untouched and the caller frees it."""
        n = storage.nbytes()
        if not self._eligible(storage, n) or self.held + n > limit:
            return False
        if not frees_in_place(storage):  # exported to NumPy, or shared memory
            return False
        holder = torch.UntypedStorage(0, device="cpu")
        try:
            holder._swap_data_ptr_(storage)
        except RuntimeError:  # defensive: torch checks only sizes today; on refusal the caller frees it
            return False
        self._free.setdefault(n, []).append(holder)
        self.held += n
        self.peak_held = max(self.peak_held, self.held)
        self.kept += 1
        return True

    def shrink(self, limit: int) -> None:
        """Give buffers back to the allocator, largest sizes first, until at most ``limit`` bytes
        (clamped at 0) are held."""
        limit = max(int(limit), 0)
        for n in sorted(self._free, reverse=True):
            holders = self._free[n]
            while holders and self.held > limit:
                holders.pop(0)  # the oldest; its memory is freed with the holder
                self.held -= n
                self.dropped += 1
            if not holders:
                del self._free[n]
            if self.held <= limit:
                return

    def clear(self) -> None:
        """Give every buffer back to the allocator."""
        self.shrink(0)

    def report(self) -> dict:
        """``held_bytes``, ``peak_held_bytes``, ``hits``, ``misses``, ``kept``, ``dropped``,
        ``min_bytes``."""
        return {"held_bytes": self.held, "peak_held_bytes": self.peak_held, "hits": self.hits,
                "misses": self.misses, "kept": self.kept, "dropped": self.dropped, "min_bytes": self.min_bytes}
