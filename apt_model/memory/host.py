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


def release_free_memory() -> bool:
    """Return freed heap memory to the OS (glibc ``malloc_trim``). Returns whether it could."""
    if _libc is None:
        return False
    _libc.malloc_trim(0)
    return True


def process_rss() -> int:
    """Resident set size of this process, in bytes."""
    return int(psutil.Process().memory_info().rss)
