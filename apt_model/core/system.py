"""System helpers (seed-era path): device choice, device/memory info, cleanup, seeding."""
from __future__ import annotations

import gc
import os
import platform
import random
import sys
import tempfile

import numpy as np
import psutil
import torch

from apt_model._version import __version__
from apt_model.devices.detection import detect_devices
from apt_model.devices.device_backend import DeviceBackend
from apt_model.devices.ranking import select_device

#: get_memory_info() key per device kind (the seed used "vram" for GPUs, "npu_memory" for NPUs).
_MEMORY_KEY = {"cuda": "vram", "rocm": "vram", "dcu": "vram", "npu": "npu_memory", "mlu": "mlu_memory",
               "xpu": "xpu_memory", "mps": "mps_memory"}


def get_device(force_cpu: bool = False, prefer_npu: bool = False) -> torch.device:
    """The device to train on, by the one ranking policy (``VB_DEVICE`` honoured).

    When the switch is on and nothing is forced, this is the switch's selected device.

    Raises:
        ConfigError / DeviceSelectionError: for a bad or unusable ``VB_DEVICE``.
    """
    from apt_model.switch import controller

    if controller.is_enabled() and not force_cpu and not prefer_npu:
        return controller.device()
    return select_device(prefer=("npu",) if prefer_npu else None, force_cpu=force_cpu).device


def get_device_info() -> dict:
    """Facts about the machine and the selected device (JSON-safe).

    Keys: ``device``, ``kind``, ``name``, ``count``, ``reason``, ``ranking``, ``dist_backend``,
    ``candidates`` (every kind with status and reason), ``torch``, ``cuda``, ``hip``, ``python``,
    ``platform``, ``apt_model``.
    """
    sel = select_device()
    backend = DeviceBackend(sel.device)
    return {
        "device": str(sel.device),
        "kind": sel.kind,
        "name": backend.get_device_name(),
        "count": sel.candidate.count,
        "reason": sel.reason,
        "ranking": list(sel.ranking),
        "dist_backend": sel.candidate.dist_backend,
        "candidates": [c.to_dict() for c in detect_devices()],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "apt_model": __version__,
    }


def get_memory_info() -> dict:
    """Memory per tier, in bytes.

    Returns:
        ``{"ram": {total, available, used, percent, process_rss}, "vram": {...} | None,
        "npu_memory": {...} | None, "mlu_memory", "xpu_memory", "mps_memory", "disk": {path, total, free}}``.
        Each device entry maps ``"cuda:0"`` (etc.) to a :meth:`DeviceBackend.get_memory_summary`.
        A kind with no usable device has None.
    """
    vm = psutil.virtual_memory()
    out: dict = {
        "ram": {"total": int(vm.total), "available": int(vm.available), "used": int(vm.used),
                "percent": float(vm.percent), "process_rss": int(psutil.Process().memory_info().rss)},
    }
    for key in dict.fromkeys(_MEMORY_KEY.values()):
        out[key] = None
    for c in detect_devices():
        key = _MEMORY_KEY.get(c.kind)
        if key is None or not c.available:
            continue
        out[key] = out[key] or {}
        for i in range(c.count):
            b = DeviceBackend(f"{c.device_type}:{i}")
            out[key][str(b.device)] = b.get_memory_summary()
    tmp = os.environ.get("VB_SWAP_DIR") or tempfile.gettempdir()
    try:
        du = psutil.disk_usage(tmp)
        out["disk"] = {"path": tmp, "total": int(du.total), "free": int(du.free)}
    except OSError as err:
        out["disk"] = {"path": tmp, "error": str(err)}
    return out


def memory_cleanup() -> None:
    """Run the garbage collector and release cached memory on every usable device."""
    gc.collect()
    for c in detect_devices():
        if c.available and c.device_type != "cpu":
            for i in range(c.count):
                DeviceBackend(f"{c.device_type}:{i}").empty_cache()


def set_seed(seed: int, deterministic: bool = False) -> None:
    """Seed Python, NumPy and torch on every device (``torch.manual_seed`` seeds all device generators,
    vendor plugins included).

    Args:
        seed: the seed (int, 0 <= seed < 2**32 for NumPy).
        deterministic: also make torch use deterministic algorithms (``torch.use_deterministic_algorithms``,
            cuDNN deterministic, ``CUBLAS_WORKSPACE_CONFIG``). Off by default because it can slow a run
            down; when False nothing about algorithm choice is touched.

    Raises:
        ValueError: for a seed that is not an int in ``[0, 2**32)``.

    accelerate's ``set_seed`` is not used: it imports vendor plugins again, and a broken torch_mlu
    raises from it.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed!r} must be an int in [0, 2**32)")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
