"""The settings :mod:`apt_model.memory` owns: the levels' budgets, the swap folder, the wait limit.

Declared here, next to the levels, the swap space and the bounded waits that read them; composed
into the one table by :mod:`apt_model.switch.settings` (see :mod:`apt_model.base.settings`).
Sizes are bytes, written as ``512MB``, ``4GiB`` or a plain number (:mod:`apt_model.base.sizes`).
"""
from __future__ import annotations

from apt_model.base.settings import Setting, folder_path, positive_seconds, size_or_none

_SIZE = "a size: 512MB, 4GiB, bytes"

DEVICE_BUDGET = Setting(
    "device_budget", None, "VB_DEVICE_BUDGET",
    "level-0 bytes for training state (on a CPU-only run: host RAM); default: the device's free "
    "memory minus headroom", size_or_none, values=_SIZE)
HOST_BUDGET = Setting(
    "host_budget", None, "VB_HOST_BUDGET", "host-level bytes for paged training state", size_or_none,
    values=_SIZE)
SWAP_DIR = Setting(
    "swap_dir", None, "VB_SWAP_DIR",
    "where swap folders go (an explicit folder must exist; default: <system temp>/apt_model-swap)",
    folder_path, values="a folder")
SWAP_BUDGET = Setting(
    "swap_budget", None, "VB_SWAP_BUDGET", "bytes the swap level may hold (default: the disk's free space)",
    size_or_none, values=_SIZE)
SWAP_TIMEOUT = Setting(
    "swap_timeout", 120.0, "VB_SWAP_TIMEOUT",
    "seconds any single wait of the memory stack (a page's read or write, a lock) may block before "
    "a SwapTimeoutError naming what it waited for", positive_seconds, kind="process",
    values="seconds > 0")

#: The entries :mod:`apt_model.memory` owns.
SETTINGS = (DEVICE_BUDGET, HOST_BUDGET, SWAP_DIR, SWAP_BUDGET, SWAP_TIMEOUT)
