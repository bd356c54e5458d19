"""Device backend API (seed-era path): one interface over CUDA, ROCm/DCU, NPU, MLU, XPU, MPS and CPU.

The original guide's shapes hold here: ``DeviceBackend(device).device_type``, its figure methods
taking ``index``, ``memory_stats()``, ``get_device_manager().get_all_devices()`` as a list of
``torch.device`` and ``get_device_summary()`` with ``total_devices`` / ``cuda_devices`` /
``npu_devices`` / ``devices`` keyed by device string. The table: ``docs/seed-contract.md``.

Implementation: :mod:`apt_model.devices`.
"""
from __future__ import annotations

import torch

from apt_model.devices.detection import detect_devices
from apt_model.devices.device_backend import DeviceBackend
from apt_model.devices.manager import UnifiedDeviceManager, get_device_manager
from apt_model.devices.ranking import select_device

__all__ = [
    "DeviceBackend",
    "UnifiedDeviceManager",
    "get_accelerator_type",
    "get_device_manager",
    "get_unified_backend",
    "is_cuda_available",
    "is_npu_available",
]


def get_unified_backend(device: str | torch.device | None = None) -> DeviceBackend:
    """A :class:`DeviceBackend` for ``device``, or for the best device when None."""
    return DeviceBackend(device)


def _available(kind: str) -> bool:
    return any(c.available and kind in (c.kind, c.device_type) for c in detect_devices())


def is_npu_available() -> bool:
    """Whether an Ascend NPU is usable (torch_npu loaded and at least one device visible)."""
    return _available("npu")


def is_cuda_available() -> bool:
    """Whether a ``cuda`` device is usable (NVIDIA, or AMD/Hygon through ROCm), checked without initializing CUDA."""
    return _available("cuda")


def get_accelerator_type() -> str:
    """The kind of the best device: ``cuda``, ``rocm``, ``dcu``, ``npu``, ``mlu``, ``xpu``, ``mps`` or ``cpu``."""
    return select_device().kind
