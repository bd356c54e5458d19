"""Configuration suggestions for this machine, from what is measured here (``apt-vb config suggest``).

The rules, each with the reason it gives:

* **mode** — ``performance`` where the probe finds FP4 matrix units (it adds native FP4 matmul on
  frozen layers); ``memory`` on an accelerator with less than :data:`SMALL_DEVICE` bytes (tight
  paging and FP4 storage of frozen weights); otherwise ``balanced``. Features stay ``auto``: the
  switch probes each model anyway; the suggestion reports what the probes found.
* **host_budget** — 75% of host RAM (50% below 8 GiB), rounded down to a whole GiB: the rest
  stays for the OS, data loading and the page cache the swap files go through.
* **device_budget** — not set: at ``enable()`` it is the device's free memory minus headroom,
  which follows other processes on the device; a fixed figure would not.
* **swap_dir** — ``<folder>/apt_model-swap-<user id>`` on the candidate disk with the best measured
  bandwidth (the slower of write and cold read), among those with at least
  :data:`MIN_SWAP_FREE` bytes free that are not RAM-backed (tmpfs); candidates are the system
  temp folder and the user's cache folder.
* **swap_budget** — half the free space of that disk, rounded down to a whole GiB.
"""
from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Callable

import psutil

from apt_model.base.log import get_logger
from apt_model.base.sizes import format_size
from apt_model.memory.swap import swap_folder_name
from apt_model.switch.config import SETTINGS

log = get_logger(__name__)

GiB = 2**30
#: Accelerators with less memory than this get ``memory`` mode.
SMALL_DEVICE = 8 * GiB
#: A swap candidate needs at least this much free disk.
MIN_SWAP_FREE = 4 * GiB
_RAM_FS = ("tmpfs", "ramfs", "devtmpfs")


def _gib_floor(n: float) -> int:
    return max(1, int(math.floor(n / GiB)))


def filesystem_of(path: str | os.PathLike) -> str | None:
    """The file-system type of the mount that holds ``path`` (``ext4``, ``tmpfs``...), or None."""
    p = os.path.realpath(path)
    best, fstype = "", None
    try:
        parts = psutil.disk_partitions(all=True)
    except OSError:
        return None
    for part in parts:
        mp = part.mountpoint
        if (p == mp or p.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best):
            best, fstype = mp, part.fstype
    return fstype


def swap_candidates() -> list[Path]:
    """Folders considered for swap files: the system temp folder and the user's cache folder
    (:func:`apt_model.base.user_cache.user_cache_dir`: ``$APT_MODEL_CACHE``, else
    ``$XDG_CACHE_HOME/apt_model``, else ``~/.cache/apt_model``), first existing ancestor checked."""
    from apt_model.base.user_cache import user_cache_dir

    out = [Path(tempfile.gettempdir()), user_cache_dir()]
    seen, unique = set(), []
    for p in out:
        key = str(p.absolute())
        if key not in seen:
            seen.add(key)
            unique.append(p.absolute())
    return unique


def _existing_ancestor(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _describe_disk(folder: Path, measure: bool) -> dict:
    base = _existing_ancestor(folder)
    info = {"folder": str(folder), "filesystem": filesystem_of(base), "free": None, "bandwidth": None, "error": None}
    try:
        info["free"] = int(psutil.disk_usage(str(base)).free)
    except OSError as err:
        info["error"] = str(err)
        return info
    if measure and info["filesystem"] not in _RAM_FS and info["free"] >= MIN_SWAP_FREE:
        from apt_model.memory.bandwidth import measure_disk

        probe_root = base if os.access(base, os.W_OK) else None
        if probe_root is None:
            info["error"] = f"{base} is not writable"
            return info
        try:
            bw = measure_disk(probe_root, mb=64)
            info["bandwidth"] = {k: round(v, 3) for k, v in bw.items()}
        except Exception as err:  # noqa: BLE001 - an unusable disk is a reason, not a crash
            info["error"] = str(err)
    return info


def _disk_line(d: dict) -> str:
    """One candidate disk in words: file system, measured bandwidth, free space, or why it is unusable."""
    if d["error"]:
        return f"unusable ({d['error']})"
    if d.get("same_disk_as"):
        return f"the same disk as {d['same_disk_as']}"
    if d["filesystem"] in _RAM_FS:
        return f"{d['filesystem']} (RAM-backed: swapping there saves no memory)"
    if d["free"] < MIN_SWAP_FREE:
        return f"only {format_size(d['free'])} free"
    bw = d["bandwidth"]
    bw_txt = f"write {bw['write']:.2f} GB/s, read {bw['read']:.2f} GB/s, " if bw else ""
    return f"{d['filesystem'] or 'disk'}, {bw_txt}{format_size(d['free'])} free"


def suggest_config(device: str | None = None, measure: bool = True,
                   progress: Callable[[str], None] | None = None) -> dict:
    """Suggest a mode and budgets for this machine.

    Args:
        device: the device to plan for (default: the ranking policy's choice).
        measure: run the capability probes on the device and measure each swap candidate's disk
            (a few seconds); False uses sizes only.
        progress: called with a short label before each measuring phase (for a progress bar).

    Returns:
        ``{"values": {key: value}`` (ready for a ``.vbrc``), ``"reasons": {key: why}``,
        ``"notes": [str]``, ``"machine": {...}`` (device, host RAM, cores, swap candidates with
        free space, file system and measured bandwidth), ``"summary": str}``.

    Raises:
        ConfigError / DeviceSelectionError: for a bad or unusable ``device``.
    """
    from apt_model.devices.device_backend import DeviceBackend
    from apt_model.devices.ranking import select_device

    step = progress or (lambda label: None)
    sel = select_device(device=device)
    dev = sel.device
    backend = DeviceBackend(dev)
    vm = psutil.virtual_memory()
    accel = dev.type != "cpu"
    machine = {
        "device": str(dev), "kind": sel.kind, "device_name": backend.get_device_name(),
        "device_memory": backend.total_memory() if accel else None,
        "host_ram": int(vm.total), "host_available": int(vm.available),
        "cpu_cores": psutil.cpu_count(logical=False), "cpu_threads": psutil.cpu_count(logical=True),
    }
    values, reasons, notes = {}, {}, []

    support = speed = None
    if measure:
        from apt_model.devices.capabilities import get_speed, get_support

        step(f"probing {dev}")
        support = get_support(dev)
        step(f"speed probes on {dev}")
        speed = get_speed(dev)
        machine["probes"] = {"support_seconds": support.seconds, "speed_seconds": speed.seconds}

    # ---- mode
    fp4 = bool(support and support.fp4_matmul.get("supported"))
    if fp4:
        values["mode"] = "performance"
        reasons["mode"] = f"the probe found FP4 matrix units on {dev}: performance adds native FP4 matmul on frozen layers"
    elif accel and machine["device_memory"] and machine["device_memory"] < SMALL_DEVICE:
        values["mode"] = "memory"
        reasons["mode"] = (f"{dev} has {format_size(machine['device_memory'])} (< {format_size(SMALL_DEVICE)}): "
                           "memory mode pages early (tight budget) and stores frozen weights in FP4")
    else:
        values["mode"] = "balanced"
        where = f"{dev} with {format_size(machine['device_memory'])}" if accel else "no accelerator"
        reasons["mode"] = f"{where}: balanced (fused attention, mixed precision where the probes find it faster; paging only over budget)"
    if speed is not None:
        att = speed.attention.get("speedup")
        if att:
            notes.append(f"SDPA probe on {dev}: {att:.2f}x vs hand-written attention (auto routes where >= 1.0x)")
        for dt, r in speed.autocast.items():
            if "speedup" in r:
                verdict = ("auto will try it on each model" if r["speedup"] >= SETTINGS["autocast_min_speedup"]
                           else "auto will keep it off")
                notes.append(f"{dt} autocast probe on {dev}: {r['speedup']:.2f}x vs fp32 ({verdict})")

    # ---- budgets
    share = 0.75 if vm.total >= 8 * GiB else 0.5
    host = _gib_floor(vm.total * share)
    values["host_budget"] = f"{host}GiB"
    reasons["host_budget"] = (f"{int(share * 100)}% of {format_size(vm.total)} host RAM, rounded down: the rest stays for "
                              "the OS, data loading and the page cache" +
                              ("" if accel else "; on a CPU-only run this is also the level-0 budget"))
    if accel:
        notes.append("device_budget left unset: enable() uses the device's free memory minus headroom, "
                     "which follows other processes on the device")

    # ---- swap
    disks, measured = [], {}
    for folder in swap_candidates():
        try:
            dev_id = os.stat(_existing_ancestor(folder)).st_dev
        except OSError:
            dev_id = None
        if dev_id is not None and dev_id in measured:  # same disk as an earlier candidate: measured once
            first = measured[dev_id]
            d = dict(_describe_disk(folder, False), bandwidth=first["bandwidth"], same_disk_as=first["folder"])
        else:
            step(f"measuring disk at {folder}" if measure else f"checking {folder}")
            d = _describe_disk(folder, measure)
            measured[dev_id] = d
        disks.append(d)
    machine["swap_candidates"] = disks
    usable = [d for d in disks if d["free"] and d["free"] >= MIN_SWAP_FREE and d["filesystem"] not in _RAM_FS
              and not d["error"]]
    if usable:
        def score(d):
            bw = d["bandwidth"]
            return (min(bw.values()) if bw else 0.0, d["free"])

        best = max(usable, key=score)
        values["swap_dir"] = str(Path(best["folder"]) / swap_folder_name())
        reasons["swap_dir"] = _disk_line(best)
        if len(disks) > 1:
            reasons["swap_dir"] += "; other candidates: " + "; ".join(
                f"{d['folder']}: {_disk_line(d)}" for d in disks if d is not best)
        values["swap_budget"] = f"{_gib_floor(best['free'] * 0.5)}GiB"
        reasons["swap_budget"] = f"half of the {format_size(best['free'])} free on that disk, rounded down"
    else:
        why = "; ".join(f"{d['folder']}: {_disk_line(d)}" for d in disks)
        notes.append(f"no swap folder suggested ({why}); set swap_dir to a folder on a local disk with space")

    swap_txt = f", swap dir {values['swap_dir']}" if "swap_dir" in values else ""
    head = (f"{machine['device_name'] or dev} {format_size(machine['device_memory'])}, " if accel else "no accelerator, ")
    summary = (f"host RAM {format_size(vm.total)}, {head}{values['mode']}, host budget {values['host_budget']}"
               f"{swap_txt}")
    log.debug("suggestion: %s", summary)
    return {"values": values, "reasons": reasons, "notes": notes, "machine": machine, "summary": summary}
