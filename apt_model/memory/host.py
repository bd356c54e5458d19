"""Host-memory helpers: giving freed memory back to the OS, and the process's resident size.

Where a freed block goes decides whether a host budget shows in the process's RSS:

* glibc serves a block below its *mmap threshold* from a heap (an *arena*) and keeps it there when
  it is freed. The threshold starts at 128 KiB but is *dynamic*: each time a block served by mmap
  is freed, it rises to that block's size (up to 32 MiB). The first tensors a program frees (a
  model's weights paged out at adoption, the first activations) lift it above every page and
  activation size, and from then on every freed page stays in the heap, resident.
  :func:`release_free_memory` (``malloc_trim(0)``, every arena since glibc 2.8) hands such free
  heap pages back, but only when called — in between, the freed bytes still count in the RSS.
* :func:`return_big_blocks_to_os` fixes the threshold instead (``mallopt(M_MMAP_THRESHOLD)``, which
  also turns the dynamic adjustment off): every block of ``MMAP_THRESHOLD`` bytes or more gets its
  own mapping and is unmapped the moment it is freed. The paging session calls it once when it
  starts on a CPU-only run, where the compute level is host RAM (measured with
  ``benchmarks/out_of_core_rss.py``, docs/tiers.md: the peak RSS growth of paged training went
  from 350 MB to 288 MB under a 96 MB budget, the difference being free heap memory between
  trims; the price is fresh pages, i.e. minor page faults, for every big temporary). glibc still
  reuses a free heap chunk that fits before it maps anything, so the trims stay. It is
  process-wide and stays set after ``disable()``: glibc cannot go back to the dynamic threshold.
  A threshold the user chose (``MALLOC_MMAP_THRESHOLD_``, or ``glibc.malloc.mmap_threshold`` in
  ``GLIBC_TUNABLES``) is left alone: ``MALLOC_MMAP_THRESHOLD_=33554432`` keeps freed blocks in
  the heap as before (fewer page faults, more RSS).

:class:`RSSWatch` samples the RSS cheaply (one read of ``/proc/self/statm``) at points the caller
chooses; the paging session keeps one for its ``host_rss`` report entry.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import psutil

from apt_model.base.log import get_logger

log = get_logger(__name__)

_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        _libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError):  # musl or no libc: nothing to trim
        _libc = None

#: Blocks of this many bytes or more get their own mapping once :func:`return_big_blocks_to_os`
#: ran. 1 MiB: pages and activations of real models are larger, so their bytes leave the RSS
#: when freed; smaller blocks stay in the heap (and go back at the next ``malloc_trim``).
MMAP_THRESHOLD = 1 << 20
_M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_big_blocks_set: bool | None = None  # None: not tried yet; else whether the threshold is ours


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_mallinfo2 = None
if _libc is not None and hasattr(_libc, "mallinfo2"):
    _mallinfo2 = _libc.mallinfo2
    _mallinfo2.restype = _Mallinfo2


def release_free_memory() -> bool:
    """Return freed heap memory to the OS (glibc ``malloc_trim``). Returns whether it could."""
    if _libc is None:
        return False
    _libc.malloc_trim(0)
    return True


def _user_chose_threshold(environ=None) -> str | None:
    env = os.environ if environ is None else environ
    if env.get("MALLOC_MMAP_THRESHOLD_", "").strip():
        return "MALLOC_MMAP_THRESHOLD_"
    if "mmap_threshold" in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return None


def return_big_blocks_to_os(threshold: int = MMAP_THRESHOLD) -> bool:
    """Have glibc serve every block of ``threshold`` bytes or more with its own mapping, unmapped
    when freed (``mallopt(M_MMAP_THRESHOLD)``; the top-of-heap trim threshold is set to twice it,
    glibc's own pairing). Idempotent and process-wide; see the module docstring for why.

    Returns:
        Whether the threshold is set (False without glibc, or when the user set one: kept).
    """
    global _big_blocks_set
    if _big_blocks_set is not None:
        return _big_blocks_set
    chosen = _user_chose_threshold()
    if _libc is None or not hasattr(_libc, "mallopt") or chosen is not None:
        if chosen is not None:
            log.info("the malloc mmap threshold set by %s is kept; freed pages may stay in the heap until "
                     "malloc_trim", chosen)
        _big_blocks_set = False
        return False
    ok = bool(_libc.mallopt(_M_MMAP_THRESHOLD, int(threshold))) and bool(
        _libc.mallopt(_M_TRIM_THRESHOLD, 2 * int(threshold)))
    _big_blocks_set = ok
    log.debug("malloc: blocks of %d bytes or more are mapped and unmapped on free (%s)", threshold,
              "set" if ok else "mallopt refused")
    return ok


#: c10's switch for huge-page-aligned CPU allocations (read once, at the first block of 2 MiB or more).
THP_VAR = "THP_MEM_ALLOC_ENABLE"
_aligned: bool | None = None


def align_big_allocations() -> bool:
    """Ask torch's CPU allocator for huge-page-aligned blocks of 2 MiB and more (``THP_MEM_ALLOC_ENABLE=1``,
    c10's switch, which also advises transparent huge pages for them), so that the swap files'
    O_DIRECT reads and writes move such a page in place, without the staging copy (see
    ``apt_model.memory.swap``), and a 4 MiB page costs 2 page faults instead of 1024.

    torch reads the variable once, at its first allocation of 2 MiB or more: set at ``enable()``
    before the model exists it takes effect; after that, nothing changes (and this says so). A
    value the user set (``0`` included) is kept. Process-wide, and stays after ``disable()``.
    Measured on the development CPU (docs/benchmarks.md): the out-of-core GPT's paged step 1.90 s
    -> 1.63 s, the optimizer's I/O stall 449 -> 223 ms per step.

    Returns:
        Whether blocks of 2 MiB and more are 4 KiB-aligned now (probed with one allocation).
    """
    global _aligned
    if _aligned is None:
        import torch

        if THP_VAR not in os.environ:
            os.environ[THP_VAR] = "1"
        probe = torch.empty(2 * 2**20 + 4096, dtype=torch.uint8)
        _aligned = probe.data_ptr() % 4096 == 0
        del probe
        if not _aligned:
            log.info("big CPU allocations are not page-aligned (%s=%s, or torch allocated a big block before "
                     "enable()): swap I/O goes through a staging copy", THP_VAR, os.environ.get(THP_VAR))
    return _aligned


def process_rss() -> int:
    """Resident set size of this process, in bytes."""
    return int(psutil.Process().memory_info().rss)


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


_statm: list = [None, None]  # [pid, fd] of /proc/self/statm, opened once per process


def rss_now() -> int:
    """Resident set size of this process in bytes, read the cheap way (one ``pread`` of
    ``/proc/self/statm`` kept open: ~3 microseconds); :func:`process_rss` (psutil) where there is
    no ``/proc``. The file is reopened in a forked child (its ``self`` was resolved at open)."""
    try:
        pid = os.getpid()
        if _statm[0] != pid:
            if _statm[1] is not None:  # a forked child: the parent's file, inherited
                os.close(_statm[1])
                _statm[1] = None
            _statm[:] = [pid, os.open("/proc/self/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))]
        return int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE_SIZE
    except (OSError, IndexError, ValueError, AttributeError):
        return process_rss()


def heap_in_use() -> int | None:
    """Bytes the C heap has handed out and not taken back (glibc ``mallinfo2``: in-use arena
    chunks plus mmapped blocks), or None where unavailable. Unlike RSS it ignores freed memory the
    allocator keeps, so it shows live data — what the activation benchmark reports besides RSS."""
    if _mallinfo2 is None:
        return None
    info = _mallinfo2()
    return int(info.uordblks + info.hblkhd)


class RSSWatch:
    """The process's RSS at a starting point and the largest value sampled since.

    Nothing runs in the background: :meth:`sample` is called at chosen points (the paging session:
    the start of each backward, the end of each optimizer step, before each ``malloc_trim``), so
    the peak is a lower bound of the true one — close to it when those points are where memory
    peaks. Each sample reads ``/proc/self/statm`` once.
    """

    def __init__(self):
        self.start: int | None = None
        self.peak = 0
        self.samples = 0

    def begin(self) -> None:
        """Take the starting point now (the peak starts there too)."""
        self.start = self.peak = rss_now()

    def sample(self) -> int:
        """Read the RSS now, keep it if it is the largest so far; returns it."""
        r = rss_now()
        self.samples += 1
        if r > self.peak:
            self.peak = r
        return r

    @property
    def growth(self) -> int:
        """Largest sampled RSS minus the starting point (0 before :meth:`begin`)."""
        return max(self.peak - self.start, 0) if self.start is not None else 0
