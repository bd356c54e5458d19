"""The settings :mod:`apt_model.memory` owns: the levels' budgets, the swap folder, the wait limit.

Declared here, next to the levels, the swap space and the bounded waits that read them; composed
into the one table by :mod:`apt_model.switch.settings` (see :mod:`apt_model.base.settings`).
Sizes are bytes, written as ``512MB``, ``4GiB`` or a plain number (:mod:`apt_model.base.sizes`).
"""
from __future__ import annotations

from apt_model.base.settings import Setting, choice, env_flag, folder_path, positive_seconds, size_or_none

_SIZE = "a size: 512MB, 4GiB, bytes"

DEVICE_BUDGET = Setting(
    "device_budget", None, "VB_DEVICE_BUDGET",
    "level-0 bytes for training state (on a CPU-only run: host RAM, and at most host_budget); default: "
    "the device's free memory minus headroom", size_or_none, values=_SIZE)
HOST_BUDGET = Setting(
    "host_budget", None, "VB_HOST_BUDGET", "host-level bytes for paged training state", size_or_none,
    values=_SIZE)
SWAP_DIR = Setting(
    "swap_dir", None, "VB_SWAP_DIR",
    "where swap folders go (an explicit folder must exist; default: <system temp>/apt_model-swap-<user id>)",
    folder_path, values="a folder")
SWAP_BUDGET = Setting(
    "swap_budget", None, "VB_SWAP_BUDGET", "bytes the swap level may hold (default: the disk's free space)",
    size_or_none, values=_SIZE)
SWAP_TIMEOUT = Setting(
    "swap_timeout", 120.0, "VB_SWAP_TIMEOUT",
    "seconds any single wait of the memory stack (a page's read or write, a lock) may block before "
    "a SwapTimeoutError naming what it waited for", positive_seconds, kind="process",
    values="seconds > 0")

PAGING_STEP = Setting(
    "paging_step", "auto", "VB_PAGING_STEP",
    "where a paged model's optimizer step runs: auto (the cost model picks), device (states travel "
    "to the device) or host (states stay in host memory; only with paging_exact off on an accelerator)",
    choice(("auto", "device", "host")), values="auto, device, host")
PAGING_EXACT = Setting(
    "paging_exact", True, "VB_PAGING_EXACT",
    "paged training stays bitwise the in-memory training; off allows the optimizer step on the host "
    "for a model on an accelerator (the host's rounding)", env_flag, values="1/0, true/false, on/off")

PAGING_STEP_IN_BACKWARD = Setting(
    "paging_step_in_backward", "auto", "VB_PAGING_STEP_IN_BACKWARD",
    "auto: where the first step shows one backward per optimizer.step() with untouched gradients, each "
    "paged parameter is stepped as its gradient lands (exact: undone when the loop changes), kept if a "
    "timed trial finds it faster; on: the same without the trial; off: the step always runs after backward",
    choice(("auto", "on", "off")), values="auto, on, off")

PAGING_REUSE_MEMORY = Setting(
    "paging_reuse_memory", True, "VB_PAGING_REUSE_MEMORY",
    "on a CPU-only run, the memory of evicted pages is kept, within the budget, for the next page of "
    "the same size (fewer page faults); off: freed at once and allocated afresh",
    env_flag, values="1/0, true/false, on/off")

#: The entries :mod:`apt_model.memory` owns.
SETTINGS = (DEVICE_BUDGET, HOST_BUDGET, SWAP_DIR, SWAP_BUDGET, SWAP_TIMEOUT, PAGING_STEP, PAGING_EXACT,
            PAGING_STEP_IN_BACKWARD, PAGING_REUSE_MEMORY)
