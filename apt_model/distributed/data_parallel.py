"""``nn.DataParallel`` under the switch: the seed's ``nn.DataParallel(model, device_ids=[0, 1])``.

DataParallel is single-process: each forward scatters the batch over ``device_ids``, copies the
module to each device (replicas), runs them in threads and gathers the outputs on
``output_device``. torch supports it for CUDA (ROCm, DCU) and for an out-of-tree device
registered as PrivateUse1 (Ascend ``npu``, Cambricon ``mlu``, through their plugins); with no
accelerator (CPU, and MPS) it runs the module as is and ignores ``device_ids``.

What the switch adds:

* ``device_ids`` are checked against the devices this process can see. Ids of devices that do
  not exist here are dropped, so the seed's ``device_ids=[0, 1]`` keeps working on a machine with
  one visible GPU (it runs on ``[0]``); the narrowing is logged as a warning and recorded in the
  report with the reason. Ids that cannot be honoured at all (none visible, a repeated or negative
  index, the CPU, something that is not a device) are a :class:`DeviceSelectionError` naming the
  vendor's visible-devices variable and the valid indices, instead of a driver error deep in a
  replica thread;
* replicas are never adopted as models of their own (they are rebuilt on every forward);
* paging is off for a model inside DataParallel (replicas are broadcast from the parameters'
  storage), and wrapping a model the switch already pages is refused with a clear error;
* the report records the wrapper, the devices and the reason.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from apt_model.devices.binding import describe_visible
from apt_model.base.errors import DeviceSelectionError


@dataclass(frozen=True)
class DeviceIdsPlan:
    """What ``nn.DataParallel`` is given under the switch, and why.

    Attributes:
        device_type: the device type DataParallel uses here, or None when it runs the module as is.
        device_ids: the ids passed on (the requested ones minus those not visible here; None = all).
        output_device: the output device passed on (None = ``device_ids[0]``).
        reason: one sentence for the report and the log.
        dropped: the requested ids that were removed because no such device is visible.
    """

    device_type: str | None
    device_ids: list | None
    output_device: object
    reason: str
    dropped: tuple = ()

    @property
    def narrowed(self) -> bool:
        """Whether some requested ids were dropped."""
        return bool(self.dropped)


def data_parallel_device_type() -> str | None:
    """The device type ``nn.DataParallel`` will use here (torch's own rule: cuda, mps, xpu, mtia,
    then the PrivateUse1 device), or None when it will run the module as is."""
    from torch._utils import _get_available_device_type

    dtype = _get_available_device_type()
    return None if dtype in (None, "mps") else dtype


def visible_data_parallel_devices() -> tuple[str | None, int, str | None, str | None]:
    """``(device_type, count, visible_env, visible_value)`` for DataParallel in this process: the
    device type it uses (:func:`data_parallel_device_type`), how many such devices this process
    sees (``torch.<type>.device_count()``, 0 without such a module), and that kind's
    visible-devices variable and its value (None when unknown or unset). Never raises."""
    dtype = data_parallel_device_type()
    if dtype is None:
        return None, 0, None, None
    mod = getattr(torch, dtype, None)
    try:
        count = int(mod.device_count()) if mod is not None and hasattr(mod, "device_count") else 0
    except Exception:  # noqa: BLE001 - a broken device module sees no device
        count = 0
    from apt_model.devices.detection import detect_devices

    cand = next((c for c in detect_devices() if c.device_type == dtype and c.available), None)
    if cand is None or cand.backend is None:
        return dtype, count, None, None
    return dtype, count, cand.visible_devices_env, cand.backend.visible_devices()


def _index(value, device_type: str) -> int | None:
    if isinstance(value, bool):
        raise DeviceSelectionError(f"DataParallel device id {value!r} is not a device index")
    if isinstance(value, int):
        if value < 0:
            raise DeviceSelectionError(f"DataParallel device id {value!r} is negative; device indices start at 0")
        return value
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError):
        raise DeviceSelectionError(f"DataParallel device id {value!r} is not a device; use an index or "
                                   f"'{device_type}:N'") from None
    if dev.type == "cpu":
        raise DeviceSelectionError(f"DataParallel device id {value!r} is the CPU; device_ids name {device_type} devices")
    return dev.index


def _split(n: int) -> str:
    return "the whole batch runs on that one device" if n == 1 else f"the batch is split over {n} devices"


def check_device_ids(device_ids: Sequence | None, output_device, device_type: str | None, count: int,
                     visible_env: str | None = None, visible_value: str | None = None) -> DeviceIdsPlan:
    """Fit DataParallel's ``device_ids`` and ``output_device`` to the devices this process sees.

    Ids naming a device index at or above ``count`` are dropped (the seed's ``device_ids=[0, 1]``
    with one visible GPU runs on ``[0]``); an ``output_device`` that was one of the dropped ids
    becomes the first remaining id. The caller logs and records a narrowing (``plan.narrowed``).

    Args:
        device_ids: as given to DataParallel (ints, ``torch.device`` or strings; None = all).
        output_device: as given (None = ``device_ids[0]``).
        device_type: :func:`data_parallel_device_type` (None: DataParallel ignores the ids).
        count: devices of ``device_type`` visible to this process.
        visible_env / visible_value: the kind's visible-devices variable and its value, for messages.

    Returns:
        A :class:`DeviceIdsPlan`: the ids and output device to pass on, the reason, the dropped ids.

    Raises:
        DeviceSelectionError: ``device_ids=[]``; no requested id is a visible device; a repeated or
            negative index; a CPU device; something that is not a device; an ``output_device``
            outside ``0..count-1`` that is not one of the requested ids. The message names the
            count, the visible-devices variable and the valid indices.
    """
    if device_type is None:
        return DeviceIdsPlan(None, None if device_ids is None else list(device_ids), output_device,
                             "no multi-device accelerator visible to torch (CPU or MPS): DataParallel runs the "
                             "module as is, on the device its parameters are on, and ignores device_ids")
    shown = describe_visible(visible_env, visible_value)
    valid = f"valid indices 0..{count - 1}" if count > 0 else "no valid index"
    if device_ids is None:
        return DeviceIdsPlan(device_type, None, output_device,
                             f"device_ids=None: all {count} visible {device_type} device(s) ({shown})")
    ids = list(device_ids)
    indices = [_index(v, device_type) for v in ids]
    if not indices:
        raise DeviceSelectionError("DataParallel device_ids=[] names no device; give at least one index")
    named = [i for i in indices if i is not None]
    if len(set(named)) != len(named):
        raise DeviceSelectionError(f"DataParallel device_ids={ids!r} repeats a device")
    kept = [v for v, i in zip(ids, indices) if i is None or i < count]
    dropped = tuple(v for v, i in zip(ids, indices) if i is not None and i >= count)
    if not kept:
        raise DeviceSelectionError(
            f"DataParallel device_ids={ids!r}: none is a visible {device_type} device; this process sees "
            f"{count} ({shown}), {valid}: name visible devices, or make these visible with "
            f"{visible_env or 'the vendor visible-devices variable'}")
    out = output_device
    out_note = ""
    if output_device is not None:
        o = _index(output_device, device_type)
        if o is not None and not 0 <= o < count:
            if o in {i for i in indices if i is not None and i >= count}:
                out = kept[0]
                out_note = f"; output_device={output_device!r} (dropped too) -> {kept[0]!r}"
            else:
                raise DeviceSelectionError(f"DataParallel output_device={output_device!r}: {valid} ({shown})")
    if dropped:
        reason = (f"device_ids={ids!r} narrowed to {kept!r}: {', '.join(repr(d) for d in dropped)} "
                  f"{'is not a visible' if len(dropped) == 1 else 'are not visible'} {device_type} "
                  f"device{'' if len(dropped) == 1 else 's'}; this process sees {count} ({shown}), {valid}"
                  f"{out_note}; {_split(len(kept))} (make more visible with "
                  f"{visible_env or 'the vendor visible-devices variable'} to use them); replicas are not "
                  "adopted and the module is not paged")
        return DeviceIdsPlan(device_type, kept, out, reason, dropped)
    return DeviceIdsPlan(device_type, ids, out,
                         f"device_ids={ids!r} on {device_type} ({count} visible, {shown}): {_split(len(kept))}; replicas are not adopted and the module is not paged")
