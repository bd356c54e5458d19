"""Intel GPUs (XPU) through stock torch's ``torch.xpu`` (torch >= 2.4 ships it)."""
from __future__ import annotations

import torch

from apt_model.devices.backend import AVAILABLE, ERROR, NOT_INSTALLED, UNAVAILABLE, AcceleratorBackend, Detection
from apt_model.devices.plugins import describe_exception
from apt_model.devices.registry import register_backend


@register_backend
class XpuBackend(AcceleratorBackend):
    """Intel Data Center / Arc GPUs. Communication through ``xccl`` (torch >= 2.8)."""

    kind = "xpu"
    device_type = "xpu"
    vendor = "Intel XPU (Level Zero)"
    priority = 30
    dist_backend = "xccl"
    visible_devices_env = "ZE_AFFINITY_MASK"

    def detect(self, allow_init: bool = False) -> Detection:
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu._is_compiled():
            return Detection(NOT_INSTALLED, f"this torch build ({torch.__version__}) has no XPU support")
        try:
            from accelerate.utils.imports import is_xpu_available

            count = int(xpu.device_count()) if is_xpu_available() else 0
        except Exception as err:  # noqa: BLE001
            return Detection(ERROR, f"torch.xpu.device_count() failed: {describe_exception(err)}")
        if count == 0:
            return Detection(UNAVAILABLE, f"torch has XPU support but no device is visible (ZE_AFFINITY_MASK={self.visible_devices()!r})")
        names = tuple(xpu.get_device_name(i) for i in range(count)) if allow_init else ()
        return Detection(AVAILABLE, f"found {count} device(s)" + (": " + ", ".join(sorted(set(names))) if names else ""), count, names)
