"""``UnifiedDeviceManager``: every device on the machine, ranked by the one policy.

The seed-era shapes are kept: :meth:`UnifiedDeviceManager.get_all_devices` returns
``torch.device`` objects (so ``[d for d in manager.get_all_devices() if d.type == 'npu']`` works),
and :meth:`~UnifiedDeviceManager.get_device_summary` has ``total_devices``, ``cuda_devices``,
``npu_devices`` and ``devices`` keyed by device string. The richer per-device records (kind,
vendor, name, communication backend) are :meth:`~UnifiedDeviceManager.get_device_records`.
"""
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

    def get_device_records(self) -> list[dict]:
        """Every usable device, best kind first, one record each.

        Returns:
            ``[{device, type, kind, index, name, vendor, dist_backend}]``: ``device`` is the string
            (``"npu:0"``, ``"cpu"``), ``type`` the torch device type, ``index`` an int (0 for the
            CPU), ``name`` the device name when detection could read it without initializing the
            device (else None). A device reachable through two kinds (a registered kind that runs on
            the CPU) is listed once, under the better-ranked kind.
        """
        out, seen = [], set()
        for c in rank(self.candidates):
            for i in range(c.count):
                dev = "cpu" if c.device_type == "cpu" else f"{c.device_type}:{i}"
                if dev in seen:
                    continue
                seen.add(dev)
                name = c.names[i] if i < len(c.names) else None
                out.append({"device": dev, "type": c.device_type, "kind": c.kind, "index": i, "name": name,
                            "vendor": c.vendor, "dist_backend": c.dist_backend})
        return out

    def get_all_devices(self) -> list[torch.device]:
        """Every usable device as a ``torch.device``, best kind first (e.g. ``[npu:0, npu:1, cpu]``).

        Returns:
            ``List[torch.device]``; the CPU is always last unless a registered kind ranks after it.
            The same order and entries as :meth:`get_device_records`.
        """
        return [torch.device(r["device"]) for r in self.get_device_records()]

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
        """Every usable device with its name and memory, and how the best one was chosen.

        Returns:
            A dict with

            * ``total_devices`` (int): number of usable devices, the CPU included
              (``len(get_all_devices())``);
            * ``cuda_devices`` / ``npu_devices`` (int): how many of them are ``cuda`` (NVIDIA, and
              AMD/Hygon through ROCm) / ``npu`` devices; ``device_counts`` maps every device type
              present to its count;
            * ``devices``: ``{"npu:0": {...}, ..., "cpu": {...}}`` keyed by device string, each value
              with ``device_name`` (str or None when the device cannot say), ``type``, ``kind``,
              ``index``, ``vendor``, ``dist_backend`` and the memory figures of
              :meth:`DeviceBackend.get_memory_summary` (``total``, ``free``, ``allocated``,
              ``reserved``, ``peak`` in bytes, ``unavailable`` reasons);
            * ``selected``, ``reason``, ``ranking`` (the ranking policy's choice and why) and
              ``candidates`` (every registered kind with status and reason).
        """
        sel = select_device(candidates=self.candidates)
        records = self.get_device_records()
        devices = {}
        for r in records:
            mem = self.get_backend(r["device"]).get_memory_summary()
            name = mem["name"] if mem["name"] is not None else r["name"]
            devices[r["device"]] = {**mem, **r, "name": name, "device_name": name}
        counts: dict[str, int] = {}
        for r in records:
            counts[r["type"]] = counts.get(r["type"], 0) + 1
        return {
            "total_devices": len(records),
            "cuda_devices": counts.get("cuda", 0),
            "npu_devices": counts.get("npu", 0),
            "device_counts": counts,
            "devices": devices,
            "selected": str(sel.device),
            "reason": sel.reason,
            "ranking": list(sel.ranking),
            "candidates": self.get_candidates(),
        }

    def cleanup_all(self) -> None:
        """Collect garbage and release cached memory on every usable device."""
        gc.collect()
        for d in self.get_device_records():
            self.get_backend(d["device"]).empty_cache()


_manager: UnifiedDeviceManager | None = None


def get_device_manager() -> UnifiedDeviceManager:
    """The process-wide :class:`UnifiedDeviceManager`."""
    global _manager
    if _manager is None:
        _manager = UnifiedDeviceManager()
    return _manager
