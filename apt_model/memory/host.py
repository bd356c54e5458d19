"""Host-memory helpers: giving freed memory back to the OS, and the process's resident size.

glibc keeps freed blocks in its heap once its dynamic mmap threshold has grown, so a storage
freed by paging would still count in the process's RSS and the host budget would be fiction.
:func:`release_free_memory` calls ``malloc_trim(0)``, which returns free heap pages to the OS.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

import psutil

_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):  # musl or no libc: nothing to trim
        _libc = None


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


def process_rss() -> int:
    """Resident set size of this process, in bytes."""
    return int(psutil.Process().memory_info().rss)


def heap_in_use() -> int | None:
    """Bytes the C heap has handed out and not taken back (glibc ``mallinfo2``: in-use arena
    chunks plus mmapped blocks), or None where unavailable. Unlike RSS it ignores freed memory the
    allocator keeps, so it shows live data — what the activation benchmark reports besides RSS."""
    if _mallinfo2 is None:
        return None
    info = _mallinfo2()
    return int(info.uordblks + info.hblkhd)
