"""Apple silicon GPUs through Metal Performance Shaders (``torch.mps``).

MPS has no allocator peak counter and no per-device properties in torch; memory figures come
from ``torch.mps`` (current / driver-allocated / recommended maximum). It has no collective
communication library, so ``dist_backend`` is None.
"""
from __future__ import annotations

import torch

from apt_model.devices.backend import AVAILABLE, NOT_INSTALLED, UNAVAILABLE, AcceleratorBackend, Detection
from apt_model.devices.registry import register_backend
from apt_model.base.errors import FigureUnavailable


@register_backend
class MpsBackend(AcceleratorBackend):
    """Apple Metal (one device, unified memory)."""

    kind = "mps"
    device_type = "mps"
    vendor = "Apple Metal (MPS)"
    priority = 40
    dist_backend = None
    visible_devices_env = None

    def detect(self, allow_init: bool = False) -> Detection:
        if not torch.backends.mps.is_built():
            return Detection(NOT_INSTALLED, "this torch build has no MPS support (MPS exists only in macOS builds)")
        if not torch.backends.mps.is_available():
            return Detection(UNAVAILABLE, "torch has MPS support but MPS is not available (needs macOS 12.3+ with a Metal GPU)")
        return Detection(AVAILABLE, "found 1 device: Apple GPU (unified memory)", 1, ("Apple MPS",))

    def device_name(self, index: int = 0) -> str:
        return "Apple MPS"

    def device_properties(self, index: int = 0) -> dict:
        return {"name": "Apple MPS", "total_memory": self.memory_info(index)[1]}

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        total = int(torch.mps.recommended_max_memory())
        return max(total - int(torch.mps.driver_allocated_memory()), 0), total

    def memory_allocated(self, index: int = 0) -> int:
        return int(torch.mps.current_allocated_memory())

    def memory_reserved(self, index: int = 0) -> int:
        return int(torch.mps.driver_allocated_memory())

    def max_memory_allocated(self, index: int = 0) -> int:
        try:
            return super().max_memory_allocated(index)
        except FigureUnavailable as err:
            raise FigureUnavailable(f"MPS keeps no peak-allocation counter ({err})") from None

    def empty_cache(self) -> None:
        torch.mps.empty_cache()

    def synchronize(self, index: int | None = None) -> None:
        torch.mps.synchronize()
