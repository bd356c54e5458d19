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

from apt_model.base.version import __version__
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


def _npu_version() -> str | None:
    """``torch_npu.__version__`` when torch_npu is loaded (never imported here: a broken plugin
    must not be touched again), else None."""
    mod = sys.modules.get("torch_npu")
    version = getattr(mod, "__version__", None) if mod is not None else None
    return None if version is None else str(version)


def get_device_info() -> dict:
    """Facts about the machine and the selected device (JSON-safe).

    Returns:
        The seed-era keys:

        * ``cuda_available`` (bool): a ``cuda`` device is usable (NVIDIA, or AMD/Hygon through ROCm);
        * ``npu_available`` (bool): an Ascend ``npu`` is usable;
        * ``device_count`` (int): devices of the selected kind (1 for the CPU);
        * ``device_name`` (str): the selected device's name (the CPU model for the CPU; the kind
          when the device cannot say);
        * ``device_type`` (str): the selected device's torch type, ``'cuda'|'npu'|'mlu'|'xpu'|'mps'|'cpu'``;
        * ``cuda_version`` (str or None): ``torch.version.cuda``;
        * ``npu_version`` (str or None): ``torch_npu.__version__`` when torch_npu is loaded.

        And what this project adds: ``device`` (``"npu:0"``), ``kind`` (``cuda``, ``rocm``, ``dcu``,
        ``npu``...), ``name`` (as ``device_name`` but None when unknown), ``count``, ``reason`` and
        ``ranking`` (how the ranking policy chose), ``dist_backend``, ``candidates`` (every kind with
        status and reason), ``torch``, ``cuda``, ``hip``, ``python``, ``platform``, ``apt_model``.

    Raises:
        ConfigError / DeviceSelectionError: for a bad or unusable ``VB_DEVICE``.
    """
    sel = select_device()
    backend = DeviceBackend(sel.device)
    cands = detect_devices()
    name = backend.get_device_name()
    idx = sel.device.index or 0
    fallback = sel.candidate.names[idx] if idx < len(sel.candidate.names) else sel.kind
    usable = {k for c in cands if c.available for k in (c.kind, c.device_type)}
    return {
        "cuda_available": "cuda" in usable,
        "npu_available": "npu" in usable,
        "device_count": int(sel.candidate.count),
        "device_name": str(name if name is not None else fallback),
        "device_type": sel.device.type,
        "cuda_version": torch.version.cuda,
        "npu_version": _npu_version(),
        "device": str(sel.device),
        "kind": sel.kind,
        "name": name,
        "count": sel.candidate.count,
        "reason": sel.reason,
        "ranking": list(sel.ranking),
        "dist_backend": sel.candidate.dist_backend,
        "candidates": [c.to_dict() for c in cands],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "apt_model": __version__,
    }


def _gib(n: int | None) -> float | None:
    return None if n is None else n / 2**30


def get_memory_info() -> dict:
    """Memory per tier.

    Returns:
        ``{"ram": {total, available, used, percent, process_rss}`` (bytes; ``percent`` a float),
        ``"vram"`` (CUDA/ROCm/DCU devices), ``"npu_memory"``, ``"mlu_memory"``, ``"xpu_memory"``,
        ``"mps_memory"``, ``"disk": {path, total, free}`` (bytes; ``error`` instead when the swap
        folder cannot be read)}``.

        Each device entry is a dict keyed ``"cuda_0"``, ``"npu_1"``... (the seed's keys); a kind with
        no usable device is ``{}``. A device's value has the seed's ``allocated_gb``,
        ``reserved_gb``, ``max_allocated_gb`` (float GB, where GB means 2**30 bytes as in
        ``bytes / 1024**3``; None where the device cannot report the figure) beside the
        byte-valued :meth:`DeviceBackend.get_memory_summary` keys ``device`` (``"npu:1"``),
        ``kind``, ``name``, ``total``, ``free``, ``allocated``, ``reserved``, ``peak`` and
        ``unavailable`` (the reason for each None figure).
    """
    vm = psutil.virtual_memory()
    out: dict = {
        "ram": {"total": int(vm.total), "available": int(vm.available), "used": int(vm.used),
                "percent": float(vm.percent), "process_rss": int(psutil.Process().memory_info().rss)},
    }
    for key in dict.fromkeys(_MEMORY_KEY.values()):
        out[key] = {}
    for c in detect_devices():
        key = _MEMORY_KEY.get(c.kind)
        if key is None or not c.available:
            continue
        for i in range(c.count):
            summary = DeviceBackend(f"{c.device_type}:{i}").get_memory_summary()
            out[key][f"{c.device_type}_{i}"] = {
                "allocated_gb": _gib(summary["allocated"]),
                "reserved_gb": _gib(summary["reserved"]),
                "max_allocated_gb": _gib(summary["peak"]),
                **summary,
            }
    from apt_model.base.settings import read_env
    from apt_model.memory.settings import SWAP_DIR

    found = read_env(SWAP_DIR)
    tmp = str(found[0]) if found is not None else tempfile.gettempdir()
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
