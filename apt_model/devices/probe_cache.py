"""Capability probe results kept on disk, per device model and software version.

Probing a device takes from a fraction of a second (a quiet CPU) to tens of seconds (a busy
2-core CPU, where two threads fight other processes for the cores); the answer only changes when
the hardware or the software changes. :mod:`apt_model.devices.capabilities` therefore stores
each probe result as one small JSON file and reads it back in later processes.

Key. A file is named after the device's *hardware identity*, independent of its index (two
identical GPUs share one file): the kind, the model name and a hash of what distinguishes models
(CUDA capability / gfx architecture, memory size and multiprocessor count for accelerators; CPU
model, instruction-set flags and logical CPU count for the CPU). The *software identity* — torch
version (with its CUDA / HIP version), apt_model version and :data:`SCHEMA` — is stored inside
the file; a file whose software or hardware identity differs from this process's is stale: it is
ignored and overwritten by the fresh result.

Location. ``$VB_CACHE_DIR/probes``; else ``$APT_MODEL_CACHE/probes`` (the folder the compiled
FP4 kernels use); else ``$XDG_CACHE_HOME/apt_model/probes``; else ``~/.cache/apt_model/probes``.

Control. ``VB_PROBE_CACHE``: ``1``/``on`` (default) reads and writes; ``0``/``off`` neither reads
nor writes; ``refresh`` probes again and overwrites (after the machine was busy during the first
probe, say).

Robustness. Writes are atomic (a temporary file in the same folder, then ``os.replace``), so a
reader never sees half a file, and concurrent processes (ranks of one job) at worst write the
same answer twice. A file that cannot be read, is not valid JSON or has the wrong shape is
ignored with a debug log and rewritten; a folder that cannot be written is logged at debug level
and the result is kept in memory only. Nothing here raises into the caller except
:func:`mode` for an invalid ``VB_PROBE_CACHE`` value.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import tempfile
import time
from pathlib import Path

import torch

from apt_model.base.log import get_logger
from apt_model.base.settings import read_env
from apt_model.devices.settings import CACHE_DIR, PROBE_CACHE

log = get_logger(__name__)

#: Bump when a probe's method or its record format changes: older files are then stale.
SCHEMA = 4  # 3: autocast probes pay their weight casts on every call (2026-11-27); 4: a candidate's
#            warm-up runs twice before the over-9x screen drops it (2026-11-28: a first bf16 call's
#            kernel generation had a CPU with bf16 units cached as "21.7x slower")
ENV_DIR = CACHE_DIR.env
ENV_MODE = PROBE_CACHE.env
_FORMAT = "apt_model probe cache"


def mode() -> str:
    """The cache mode from ``VB_PROBE_CACHE``: ``"on"`` (default), ``"off"`` or ``"refresh"``.

    Raises:
        ConfigError: when ``VB_PROBE_CACHE`` is set to anything else.
    """
    found = read_env(PROBE_CACHE)
    return PROBE_CACHE.default if found is None else found[0]


def cache_dir() -> Path:
    """The folder probe results are kept in (see the module docstring for the order); not created here."""
    from apt_model.base.user_cache import user_cache_dir

    found = read_env(CACHE_DIR)
    return (Path(found[0]).expanduser() if found is not None else user_cache_dir()) / "probes"


def _cpu_identity() -> dict:
    name, isa = "", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not name:
                    name = value.strip()
                elif key in ("flags", "Features") and not isa:
                    isa = hashlib.sha256(" ".join(sorted(value.split())).encode()).hexdigest()[:16]
                if name and isa:
                    break
    except OSError:
        pass
    return {"kind": "cpu", "name": name or platform.processor() or "unknown CPU", "machine": platform.machine(),
            "isa": isa, "logical_cpus": os.cpu_count() or 0}


def device_identity(device: torch.device, properties: dict) -> dict | None:
    """The index-independent hardware identity of ``device``, or None when it has none that is stable.

    Args:
        device: the probed device.
        properties: its properties as :meth:`AcceleratorBackend.device_properties` returns them
            (empty for the CPU).

    Returns:
        A JSON-safe dict (``kind``, ``name`` and the model-distinguishing figures), or None when
        an accelerator reports no name (then nothing is cached for it). Never raises.
    """
    try:
        if device.type == "cpu":
            return _cpu_identity()
        name = properties.get("name")
        if not name:
            mod = getattr(torch, device.type, None)
            get_name = getattr(mod, "get_device_name", None)
            name = get_name(device.index or 0) if get_name is not None else None
        if not name:
            return None
        ident = {"kind": device.type, "name": str(name)}
        if "major" in properties and "minor" in properties:
            ident["capability"] = f"{properties['major']}.{properties['minor']}"
        for key in ("gcnArchName", "total_memory", "multi_processor_count"):
            if properties.get(key) is not None:
                ident[key] = properties[key]
        return ident
    except Exception as err:  # noqa: BLE001 - no identity means no disk cache, never a failed probe
        log.debug("no probe-cache identity for %s: %s", device, err)
        return None


def software_identity() -> dict:
    """What a cached result is only valid for: torch (and its CUDA/HIP) version, apt_model version, schema."""
    from apt_model.base.version import __version__

    return {"torch": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip,
            "apt_model": __version__, "schema": SCHEMA}


def entry_path(identity: dict, entry: str) -> Path:
    """The file holding ``entry`` (``"support"``, ``"speed-..."``) for the device ``identity``."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", str(identity.get("name", "")))[:40].strip("_") or "device"
    safe_entry = re.sub(r"[^A-Za-z0-9._+-]+", "_", entry)
    return cache_dir() / f"{identity.get('kind', 'dev')}-{name}-{digest}-{safe_entry}.json"


def load(identity: dict, entry: str) -> tuple[dict | None, str]:
    """Read a cached result.

    Returns:
        ``(data, why)``: the stored data dict, or None with the reason (missing, stale, unreadable).
        A corrupt or foreign file is logged at debug level and reported as a miss; never raises.
    """
    path = entry_path(identity, entry)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, f"no cached result at {path}"
    except OSError as err:
        log.debug("probe cache %s unreadable, probing again: %s", path, err)
        return None, f"unreadable cache file {path}: {err}"
    try:
        rec = json.loads(text)
        if not isinstance(rec, dict) or rec.get("format") != _FORMAT or not isinstance(rec.get("data"), dict):
            raise ValueError("not a probe cache record")
    except ValueError as err:  # JSONDecodeError is a ValueError
        log.debug("probe cache %s is corrupt, ignoring it and probing again: %s", path, err)
        return None, f"corrupt cache file {path} ignored: {err}"
    soft = software_identity()
    if rec.get("software") != soft:
        return None, f"stale cache file {path}: written for {rec.get('software')}, now {soft}"
    if rec.get("hardware") != json.loads(json.dumps(identity, default=str)):
        return None, f"cache file {path} belongs to another device: {rec.get('hardware')}"
    return rec["data"], f"read from {path}"


def store(identity: dict, entry: str, data: dict) -> tuple[Path | None, str]:
    """Write ``data`` (JSON-safe) atomically as the cached ``entry`` for ``identity``.

    Returns:
        ``(path, why)``; path is None when the folder cannot be written (logged at debug level;
        the caller keeps the result in memory). Never raises.
    """
    path = entry_path(identity, entry)
    rec = {"format": _FORMAT, "hardware": identity, "software": software_identity(), "entry": entry,
           "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "data": data}
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(rec, f, indent=1, default=str)
        os.replace(tmp, path)
        return path, f"written to {path}"
    except (OSError, TypeError, ValueError) as err:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        log.debug("probe cache %s not written (result kept in memory only): %s", path, err)
        return None, f"not written ({type(err).__name__}: {err})"


def clear() -> int:
    """Delete every cached probe file in :func:`cache_dir`. Returns how many were removed; never raises."""
    removed = 0
    try:
        files = list(cache_dir().glob("*.json"))
    except OSError:
        return 0
    for p in files:
        try:
            p.unlink()
            removed += 1
        except OSError as err:
            log.debug("could not remove probe cache file %s: %s", p, err)
    return removed
