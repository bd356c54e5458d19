"""``DeviceBackend``: one device of any kind behind one API that never raises for a missing figure.

Each figure method returns bytes (or a name / dict), or ``None`` when the device cannot report
it; :meth:`DeviceBackend.why` then gives the reason. On the CPU every figure comes from psutil
and nothing raises.

The seed-era signatures take an optional device ``index`` (``backend.memory_allocated(0)``,
``backend.get_device_name(index=1)``): None means the backend's own device. An index that is not
an int is a ``TypeError``; one outside ``0..device_count()-1`` of a usable kind is a
:class:`~apt_model.base.errors.DeviceSelectionError` naming the valid range.
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch

from apt_model.devices.backend import AcceleratorBackend
from apt_model.devices.detection import Candidate, detect_devices
from apt_model.devices.plugins import describe_exception
from apt_model.devices.ranking import candidate_names, parse_device_spec, select_device
from apt_model.base.errors import DeviceSelectionError


class DeviceBackend:
    """Uniform access to one device.

    Args:
        device: ``torch.device`` or string (``"cuda:0"``, ``"npu:1"``, ``"rocm"``, ``"cpu"``); None
            means the device the ranking policy selects (see :func:`apt_model.devices.select_device`).

    Attributes:
        device: the ``torch.device``; None for a kind torch cannot address on this machine
            (``npu`` without torch_npu).
        device_type: the torch device type (str): ``cuda`` (also for ROCm and DCU), ``npu``,
            ``mlu``, ``xpu``, ``mps``, ``cpu``... Set even when :attr:`device` is None.
        kind: the candidate's kind (``cuda``, ``rocm``, ``dcu``, ``npu``...).

    Raises:
        ConfigError: for a malformed device string or an unknown kind. A known kind that is not
            usable here does not raise: :meth:`is_available` is False and figures are None.
    """

    def __init__(self, device: str | torch.device | None = None):
        cands = detect_devices()
        if device is None:
            sel = select_device(candidates=cands)
            self.device, self.candidate = sel.device, sel.candidate
        else:
            name, index = parse_device_spec(device, cands)
            matching = sorted((c for c in cands if name in candidate_names(c)),
                              key=lambda c: (not c.available, c.priority))
            self.candidate: Candidate = matching[0]
            dtype = self.candidate.device_type
            name = "cpu" if dtype == "cpu" else f"{dtype}:{index or 0}"
            try:
                self.device = torch.device(name)
            except RuntimeError:  # a kind whose plugin is absent: torch cannot even parse its name
                self.device = None
            self._name = name
        if device is None:
            self._name = str(self.device)
        self.kind = self.candidate.kind
        self.device_type: str = self.device.type if self.device is not None else self.candidate.device_type
        self.reasons: dict[str, str] = {}
        self._impl: AcceleratorBackend = self.candidate.backend

    def __repr__(self) -> str:
        return f"DeviceBackend({self._name!r}, kind={self.kind!r}, status={self.candidate.status!r})"

    @property
    def index(self) -> int:
        """The backend's own device index (0 for the CPU and for a kind torch cannot address here)."""
        return (self.device.index or 0) if self.device is not None else 0

    def _index(self, index: int | None) -> int:
        """``index`` checked against this kind's devices; None means :attr:`index`.

        Raises:
            TypeError: ``index`` is not an integer (``operator.index``; bool is refused too).
            DeviceSelectionError: ``index`` is outside ``0..device_count()-1`` of a usable kind (or
                negative); the message names the valid range.
        """
        if index is None:
            return self.index
        try:
            if isinstance(index, bool):
                raise TypeError
            index = operator.index(index)  # int, numpy integers, 0-d integer tensors
        except TypeError:
            raise TypeError(f"index={index!r} must be an int device index of {self.kind} (or None for "
                            f"{self._name}), not {type(index).__name__}") from None
        count = self.candidate.count
        if index < 0 or (self.candidate.available and index >= count):
            valid = f"valid indices 0..{count - 1}" if count else "no usable device"
            raise DeviceSelectionError(f"index={index} names no {self.kind} device here: {self.kind} has "
                                       f"{count} device(s), {valid}")
        return index

    def _figure(self, name: str, fn: Callable[[], Any]) -> Any:
        if not self.candidate.available:
            self.reasons[name] = f"{self.kind} is {self.candidate.status}: {self.candidate.reason}"
            return None
        try:
            value = fn()
        except Exception as err:  # noqa: BLE001 - a missing figure is None plus a reason
            self.reasons[name] = describe_exception(err)
            return None
        self.reasons.pop(name, None)
        return value

    def why(self, figure: str) -> str | None:
        """Why ``figure`` (a method name such as ``"memory_reserved"``) returned None last time."""
        return self.reasons.get(figure)

    # ---------------------------------------------------------------- identity
    def is_available(self) -> bool:
        """Whether this device kind was found on this machine."""
        return self.candidate.available

    def device_count(self) -> int:
        """Number of usable devices of this kind (0 when unavailable)."""
        return self.candidate.count

    def get_device_name(self, index: int | None = None) -> str | None:
        """The name of device ``index`` (default: this backend's device); may initialize the device.

        Raises:
            TypeError / DeviceSelectionError: a bad ``index`` (see the module docstring).
        """
        i = self._index(index)
        return self._figure("get_device_name", lambda: self._impl.device_name(i))

    def get_device_properties(self, index: int | None = None) -> dict | None:
        """Properties of device ``index`` (default: this backend's device) as a dict: ``total_memory``
        in bytes, plus what the kind reports (capability, cores...).

        Raises:
            TypeError / DeviceSelectionError: a bad ``index``.
        """
        i = self._index(index)
        return self._figure("get_device_properties", lambda: self._impl.device_properties(i))

    # ---------------------------------------------------------------- memory (bytes)
    def total_memory(self, index: int | None = None) -> int | None:
        """Total memory of device ``index`` (default: this backend's device) in bytes (host RAM for the CPU)."""
        i = self._index(index)
        info = self._figure("total_memory", lambda: self._impl.memory_info(i))
        return None if info is None else info[1]

    def free_memory(self, index: int | None = None) -> int | None:
        """Free memory of device ``index`` in bytes (available host RAM for the CPU)."""
        i = self._index(index)
        info = self._figure("free_memory", lambda: self._impl.memory_info(i))
        return None if info is None else info[0]

    def memory_allocated(self, index: int | None = None) -> int | None:
        """Bytes held by tensors on device ``index`` (default: this backend's device; process RSS on the CPU).

        Raises:
            TypeError / DeviceSelectionError: a bad ``index``.
        """
        i = self._index(index)
        return self._figure("memory_allocated", lambda: self._impl.memory_allocated(i))

    def memory_reserved(self, index: int | None = None) -> int | None:
        """Bytes reserved by the caching allocator on device ``index`` (process RSS on the CPU).

        Raises:
            TypeError / DeviceSelectionError: a bad ``index``.
        """
        i = self._index(index)
        return self._figure("memory_reserved", lambda: self._impl.memory_reserved(i))

    def max_memory_allocated(self, index: int | None = None) -> int | None:
        """Peak bytes held by tensors on device ``index`` (peak process RSS on the CPU).

        Raises:
            TypeError / DeviceSelectionError: a bad ``index``.
        """
        i = self._index(index)
        return self._figure("max_memory_allocated", lambda: self._impl.max_memory_allocated(i))

    def reset_peak_memory_stats(self, index: int | None = None) -> bool:
        """Reset the peak counter of device ``index``; False (with a reason) where the device cannot."""
        i = self._index(index)
        return self._figure("reset_peak_memory_stats", lambda: self._impl.reset_peak_memory_stats(i) or True) is True

    def memory_stats(self, index: int | None = None) -> dict:
        """Memory of device ``index`` (default: this backend's device) in the OmniRT-style shape.

        Returns:
            ``{"peak_bytes", "allocated_bytes", "reserved_bytes", "total_bytes", "free_bytes"}``:
            int bytes, each the same figure as :meth:`max_memory_allocated`, :meth:`memory_allocated`,
            :meth:`memory_reserved`, :meth:`total_memory` and :meth:`free_memory`; None where the
            device cannot report it (:meth:`why` names the reason under the method's name).

        Raises:
            TypeError / DeviceSelectionError: a bad ``index``.
        """
        i = self._index(index)
        return {
            "peak_bytes": self.max_memory_allocated(i),
            "allocated_bytes": self.memory_allocated(i),
            "reserved_bytes": self.memory_reserved(i),
            "total_bytes": self.total_memory(i),
            "free_bytes": self.free_memory(i),
        }

    def empty_cache(self) -> None:
        """Release cached memory; a no-op where there is no cache. Never raises."""
        self._figure("empty_cache", self._impl.empty_cache)

    def synchronize(self, index: int | None = None) -> None:
        """Wait for queued work on device ``index`` (default: this backend's device). A device that
        cannot synchronize is recorded under :meth:`why` (``"synchronize"``), never raised.

        Raises:
            TypeError / DeviceSelectionError: a bad ``index`` (checked before anything runs).
        """
        i = self._index(index)
        self._figure("synchronize", lambda: self._impl.synchronize(i))

    def to_device(self, obj: Any, non_blocking: bool = False) -> Any:
        """Move a tensor, a module, or nested lists/tuples/dicts of tensors to this device.

        Modules are moved in place (``module.to``), so parameter identity is kept. Nested
        structures go through accelerate's ``send_to_device``.

        Raises:
            RuntimeError: when this device kind is not usable here (nothing is moved).
        """
        if self.device is None:
            raise RuntimeError(f"{self._name} is not usable here: {self.candidate.reason}")
        if isinstance(obj, torch.nn.Module):
            return obj.to(self.device)
        from accelerate.utils import send_to_device

        return send_to_device(obj, self.device, non_blocking=non_blocking)

    def get_memory_summary(self) -> dict:
        """``{device, kind, name, total, free, allocated, reserved, peak, unavailable}``; sizes in bytes,
        ``unavailable`` maps each None figure to its reason."""
        summary = {
            "device": self._name,
            "kind": self.kind,
            "name": self.get_device_name(),
            "total": self.total_memory(),
            "free": self.free_memory(),
            "allocated": self.memory_allocated(),
            "reserved": self.memory_reserved(),
            "peak": self.max_memory_allocated(),
        }
        summary["unavailable"] = {k: self.reasons[m] for k, m in (
            ("name", "get_device_name"), ("total", "total_memory"), ("free", "free_memory"),
            ("allocated", "memory_allocated"), ("reserved", "memory_reserved"), ("peak", "max_memory_allocated"),
        ) if summary[k] is None and m in self.reasons}
        return summary
