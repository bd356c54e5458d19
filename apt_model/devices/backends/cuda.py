"""NVIDIA CUDA, and AMD ROCm / Hygon DCU (which torch presents as ``cuda``).

Detection never initializes CUDA unless asked: availability and count come from NVML (AMD SMI
on ROCm) through torch's fork-safe paths, the same check accelerate's ``is_cuda_available`` uses.
"""
from __future__ import annotations

import os
import re
import shutil

import torch

from apt_model.devices.backend import (
    AVAILABLE,
    ERROR,
    NOT_INSTALLED,
    UNAVAILABLE,
    AcceleratorBackend,
    Detection,
)
from apt_model.devices.plugins import describe_exception
from apt_model.devices.registry import register_backend

#: Device-name and gfx-architecture hints that identify a Hygon DCU (DTK stack) among ROCm devices.
DCU_NAME_PATTERN = re.compile(r"\b(DCU|Hygon|K100|Z100|BW\d+)", re.IGNORECASE)
DCU_GFX_ARCHS = ("gfx926", "gfx928", "gfx936")


def _cuda_count() -> int:
    """Visible device count without creating a CUDA context (NVML / AMD SMI based)."""
    from accelerate.utils.imports import is_cuda_available  # NVML-based, does not poison fork

    if not is_cuda_available():
        return 0
    return int(torch.cuda.device_count())


def _names(count: int, allow_init: bool) -> tuple[tuple[str, ...], str]:
    """Device names and where they came from; empty when reading them would initialize CUDA."""
    if allow_init or torch.cuda.is_initialized():
        return tuple(torch.cuda.get_device_name(i) for i in range(count)), "torch.cuda"
    try:  # NVML reads names without a CUDA context; the package is optional
        import pynvml

        pynvml.nvmlInit()
        names = []
        for i in range(count):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        return tuple(names), "NVML"
    except Exception:  # noqa: BLE001 - names are optional in detection
        return (), "not read: it would initialize CUDA before a possible fork (run `apt-vb info` to see them)"


@register_backend
class CudaBackend(AcceleratorBackend):
    """NVIDIA GPUs through torch's CUDA build."""

    kind = "cuda"
    device_type = "cuda"
    vendor = "NVIDIA CUDA"
    priority = 0
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

    def detect(self, allow_init: bool = False) -> Detection:
        if torch.version.hip:
            return Detection(UNAVAILABLE, f"this torch build targets ROCm (HIP {torch.version.hip}); see the rocm candidate")
        if not torch.backends.cuda.is_built():
            return Detection(NOT_INSTALLED, f"this torch build ({torch.__version__}) has no CUDA support")
        try:
            count = _cuda_count()
        except Exception as err:  # noqa: BLE001
            return Detection(ERROR, f"CUDA device count failed: {describe_exception(err)}")
        details = {"cuda_version": torch.version.cuda, self.visible_devices_env: self.visible_devices()}
        if count == 0:
            return Detection(
                UNAVAILABLE,
                f"torch built for CUDA {torch.version.cuda}, but no CUDA device is visible "
                f"(driver missing or CUDA_VISIBLE_DEVICES={self.visible_devices()!r})",
                details=details,
            )
        names, source = _names(count, allow_init)
        details["names_from"] = source
        return Detection(AVAILABLE, _found(count, names), count, names, details=details)


@register_backend
class RocmBackend(AcceleratorBackend):
    """AMD GPUs (ROCm/HIP) and Hygon DCUs (DTK, a ROCm derivative); torch calls both ``cuda``.

    A Hygon DCU is told apart by its device name / gfx architecture (needs the device names,
    read with ``allow_init`` or once CUDA is initialized) or by the DTK tools on the machine
    (``hy-smi``, ``/opt/dtk``); it is then reported with kind ``dcu``.
    """

    kind = "rocm"
    device_type = "cuda"
    refined_kinds = ("dcu",)
    vendor = "AMD ROCm (HIP)"
    priority = 1
    dist_backend = "nccl"  # RCCL, exposed under the nccl name
    visible_devices_env = "HIP_VISIBLE_DEVICES"

    def detect(self, allow_init: bool = False) -> Detection:
        if not torch.version.hip:
            return Detection(NOT_INSTALLED, f"this torch build ({torch.__version__}) is not a ROCm build (torch.version.hip is None)")
        try:
            count = int(torch.cuda.device_count())
        except Exception as err:  # noqa: BLE001
            return Detection(ERROR, f"ROCm device count failed: {describe_exception(err)}")
        details = {"hip_version": torch.version.hip, self.visible_devices_env: self.visible_devices()}
        if count == 0:
            return Detection(UNAVAILABLE, f"torch built for ROCm {torch.version.hip}, but no device is visible", details=details)
        names, source = _names(count, allow_init)
        archs: list[str] = []
        if allow_init or torch.cuda.is_initialized():
            archs = [str(getattr(torch.cuda.get_device_properties(i), "gcnArchName", "")) for i in range(count)]
        details.update(names_from=source, gcn_arch=archs)
        kind = "dcu" if is_hygon_dcu(names, archs) else "rocm"
        return Detection(AVAILABLE, _found(count, names), count, names, kind=kind, details=details)


def is_hygon_dcu(names: tuple[str, ...] | list[str], archs: list[str]) -> bool:
    """Whether ROCm devices are Hygon DCUs, from names, gfx archs, or the DTK tools on the machine."""
    if any(DCU_NAME_PATTERN.search(n) for n in names):
        return True
    if any(a.split(":")[0] in DCU_GFX_ARCHS for a in archs):
        return True
    return shutil.which("hy-smi") is not None or os.path.isdir("/opt/dtk")


def _found(count: int, names: tuple[str, ...]) -> str:
    if names:
        distinct = sorted(set(names))
        return f"found {count} device(s): " + ", ".join(distinct)
    return f"found {count} device(s)"
