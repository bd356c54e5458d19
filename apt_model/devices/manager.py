"""``UnifiedDeviceManager``: every device on the machine, ranked by the one policy."""
from __future__ import annotations

import gc

import torch

from apt_model.devices.detection import detect_devices
from apt_model.devices.device_backend import DeviceBackend
from apt_model.devices.ranking import rank, select_device


class UnifiedDeviceManager:
    """All device kinds, their devices, and the best one.

    Args:
        refresh: re-run detection instead of using this process's cached result.
    """

    def __init__(self, refresh: bool = False):
        self.candidates = detect_devices(refresh=refresh)
        self._backends: dict[str, DeviceBackend] = {}

    def get_all_devices(self) -> list[dict]:
        """Every usable device, best kind first: ``{device, kind, index, name, vendor, dist_backend}``."""
        out = []
        for c in rank(self.candidates):
            for i in range(c.count):
                dev = "cpu" if c.device_type == "cpu" else f"{c.device_type}:{i}"
                name = c.names[i] if i < len(c.names) else None
                out.append({"device": dev, "kind": c.kind, "index": i, "name": name, "vendor": c.vendor,
                            "dist_backend": c.dist_backend})
        return out

    def get_candidates(self) -> list[dict]:
        """Every registered kind, usable or not, with status and reason."""
        return [c.to_dict() for c in self.candidates]

    def get_best_device(self, prefer_npu: bool = False) -> torch.device:
        """The best device by the ranking policy (``VB_DEVICE`` honoured); NPU first if ``prefer_npu``."""
        return select_device(prefer=("npu",) if prefer_npu else None, candidates=self.candidates).device

    def get_backend(self, device: str | torch.device | None = None) -> DeviceBackend:
        """A (cached) :class:`DeviceBackend` for ``device`` (the best device when None)."""
        key = str(device) if device is not None else "__best__"
        if key not in self._backends:
            self._backends[key] = DeviceBackend(device)
        return self._backends[key]

    def get_device_summary(self) -> dict:
        """``{selected, reason, ranking, candidates, devices}`` with a memory summary per usable device."""
        sel = select_device(candidates=self.candidates)
        return {
            "selected": str(sel.device),
            "reason": sel.reason,
            "ranking": list(sel.ranking),
            "candidates": self.get_candidates(),
            "devices": [self.get_backend(d["device"]).get_memory_summary() for d in self.get_all_devices()],
        }

    def cleanup_all(self) -> None:
        """Collect garbage and release cached memory on every usable device."""
        gc.collect()
        for d in self.get_all_devices():
            self.get_backend(d["device"]).empty_cache()


_manager: UnifiedDeviceManager | None = None


def get_device_manager() -> UnifiedDeviceManager:
    """The process-wide :class:`UnifiedDeviceManager`."""
    global _manager
    if _manager is None:
        _manager = UnifiedDeviceManager()
    return _manager
