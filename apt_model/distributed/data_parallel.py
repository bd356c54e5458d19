"""``nn.DataParallel`` under the switch: the seed's ``nn.DataParallel(model, device_ids=[0, 1])``.

DataParallel is single-process: each forward scatters the batch over ``device_ids``, copies the
module to each device (replicas), runs them in threads and gathers the outputs on
``output_device``. torch supports it for CUDA (ROCm, DCU) and for an out-of-tree device
registered as PrivateUse1 (Ascend ``npu``, Cambricon ``mlu``, through their plugins); with no
accelerator (CPU, and MPS) it runs the module as is and ignores ``device_ids``.

What the switch adds:

* ``device_ids`` are checked against the devices this process can see, with an error naming the
  vendor's visible-devices variable instead of a driver error deep in a replica thread;
* replicas are never adopted as models of their own (they are rebuilt on every forward);
* paging is off for a model inside DataParallel (replicas are broadcast from the parameters'
  storage), and wrapping a model the switch already pages is refused with a clear error;
* the report records the wrapper, the devices and the reason.
"""
from __future__ import annotations

from typing import Sequence

import torch

from apt_model.errors import DeviceSelectionError


def data_parallel_device_type() -> str | None:
    """The device type ``nn.DataParallel`` will use here (torch's own rule: cuda, mps, xpu, mtia,
    then the PrivateUse1 device), or None when it will run the module as is."""
    from torch._utils import _get_available_device_type

    dtype = _get_available_device_type()
    return None if dtype in (None, "mps") else dtype


def _index(value, device_type: str) -> int | None:
    if isinstance(value, bool):
        raise DeviceSelectionError(f"DataParallel device id {value!r} is not a device index")
    if isinstance(value, int):
        return value
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError):
        raise DeviceSelectionError(f"DataParallel device id {value!r} is not a device; use an index or "
                                   f"'{device_type}:N'") from None
    if dev.type == "cpu":
        raise DeviceSelectionError(f"DataParallel device id {value!r} is the CPU; device_ids name {device_type} devices")
    return dev.index


def check_device_ids(device_ids: Sequence | None, output_device, device_type: str | None, count: int,
                     visible_env: str | None = None, visible_value: str | None = None) -> str:
    """Check DataParallel's ``device_ids`` and ``output_device`` against the visible devices.

    Args:
        device_ids: as given to DataParallel (ints, ``torch.device`` or strings; None = all).
        output_device: as given (None = ``device_ids[0]``).
        device_type: :func:`data_parallel_device_type` (None: DataParallel ignores the ids).
        count: devices of ``device_type`` visible to this process.
        visible_env / visible_value: the kind's visible-devices variable and its value, for messages.

    Returns:
        The reason for the report.

    Raises:
        DeviceSelectionError: an index outside ``0..count-1``, a repeated index, a CPU device, or
            something that is not a device; the message names the count and the variable.
    """
    if device_type is None:
        return ("no multi-device accelerator visible to torch (CPU or MPS): DataParallel runs the module "
                "as is, on the device its parameters are on, and ignores device_ids")
    shown = (f"{visible_env}={visible_value!r}" if visible_env and visible_value is not None
             else f"{visible_env} unset" if visible_env else "no visible-devices variable")
    if device_ids is None:
        return f"device_ids=None: all {count} visible {device_type} device(s) ({shown})"
    indices = [_index(v, device_type) for v in device_ids]
    if not indices:
        raise DeviceSelectionError("DataParallel device_ids=[] names no device; give at least one index")
    named = [i for i in indices if i is not None]
    for value, i in zip(device_ids, indices):
        if i is not None and not 0 <= i < count:
            raise DeviceSelectionError(
                f"DataParallel device_ids={list(device_ids)!r}: {value!r} is not a visible {device_type} device; "
                f"this process sees {count} ({shown}), valid indices 0..{count - 1}")
    if len(set(named)) != len(named):
        raise DeviceSelectionError(f"DataParallel device_ids={list(device_ids)!r} repeats a device")
    if output_device is not None:
        o = _index(output_device, device_type)
        if o is not None and not 0 <= o < count:
            raise DeviceSelectionError(f"DataParallel output_device={output_device!r}: valid indices 0..{count - 1} "
                                       f"({shown})")
    return (f"device_ids={list(device_ids)!r} on {device_type} ({count} visible, {shown}): the batch is split "
            f"over {len(indices)} device(s); replicas are not adopted and the module is not paged")
