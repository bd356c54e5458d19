"""Binding each rank to its local device.

Under a launcher every process on a node sees the same devices (unless the launcher narrows them
per process through the vendor's visible-devices variable: ``CUDA_VISIBLE_DEVICES``,
``HIP_VISIBLE_DEVICES``, ``ASCEND_RT_VISIBLE_DEVICES``, ``MLU_VISIBLE_DEVICES``,
``ZE_AFFINITY_MASK``). Device indices are always *visible* indices: with
``CUDA_VISIBLE_DEVICES=2,3``, ``cuda:0`` is physical GPU 2. The rule:

* more than one device visible: local rank *i* uses device *i* (it must exist);
* exactly one device visible: every local rank uses device 0 (the usual per-process
  visibility set up by SLURM ``--gpus-per-task=1`` and similar; several ranks on one device
  work with gloo but not with NCCL/HCCL, which is said in the reason);
* the CPU has no index: all ranks share it.

:func:`local_device_index` is the pure rule (used by the ranking policy, so ``vb.device()``,
``get_device()`` and the reports all give each rank its own device); :func:`set_current_device`
makes that device the process's current one, as NCCL/HCCL need.
"""
from __future__ import annotations

import torch

from apt_model.distributed.launch import LaunchEnv, read_launch_env
from apt_model.errors import DeviceSelectionError
from apt_model.log import get_logger

log = get_logger(__name__)


def local_device_index(kind: str, count: int, local_rank: int, visible_env: str | None = None,
                       visible_value: str | None = None, local_world_size: int | None = None) -> tuple[int, str]:
    """The device index local rank ``local_rank`` uses, and why.

    Args:
        kind: the device kind (``cuda``, ``npu``...), for messages.
        count: devices of that kind visible to this process (after the visible-devices variable).
        local_rank: the process's rank on its node (``LOCAL_RANK``).
        visible_env / visible_value: the kind's visible-devices variable and its value (None: unset).
        local_world_size: processes on this node (``LOCAL_WORLD_SIZE``), if known.

    Returns:
        ``(index, reason)``; the index is a visible-device index.

    Raises:
        DeviceSelectionError: ``count`` is 0, or more than one device is visible and ``local_rank``
            is not below ``count`` (the message names the visible-devices variable and its value).
    """
    shown = f"{visible_env}={visible_value!r}" if visible_env and visible_value is not None else (
        f"{visible_env} unset" if visible_env else "no visible-devices variable")
    if count < 1:
        raise DeviceSelectionError(f"LOCAL_RANK={local_rank}: no {kind} device is visible ({shown})")
    if count == 1:
        why = f"LOCAL_RANK={local_rank}: 1 {kind} device visible to this process ({shown}): {kind}:0"
        if local_rank > 0 or (local_world_size or 1) > 1:
            why += ("; if other ranks on this node see the same device they share it, which gloo allows "
                    f"but NCCL/HCCL refuse: give each rank its own device with {visible_env or 'the launcher'}")
        return 0, why
    if local_rank >= count:
        raise DeviceSelectionError(
            f"LOCAL_RANK={local_rank} needs a {kind} device of its own, but only {count} are visible ({shown}); "
            f"valid local ranks 0..{count - 1}: start at most {count} processes per node "
            f"(torchrun --nproc_per_node={count}) or make more devices visible")
    return local_rank, f"LOCAL_RANK={local_rank}: {kind}:{local_rank} of {count} visible ({shown})"


def bind_for_launcher(candidate, env: LaunchEnv | None = None) -> tuple[int, str] | None:
    """The rank's device index for an accelerator ``candidate`` under a launcher, or None when
    there is nothing to bind (no launcher, no ``LOCAL_RANK``, or a CPU candidate).

    ``candidate`` is a :class:`~apt_model.devices.detection.Candidate`.

    Raises:
        ConfigError: malformed launcher variables.
        DeviceSelectionError: see :func:`local_device_index`.
    """
    env = read_launch_env() if env is None else env
    if env is None or env.local_rank is None or candidate.device_type == "cpu":
        return None
    visible = candidate.backend.visible_devices() if candidate.backend is not None else None
    return local_device_index(candidate.kind, candidate.count, env.local_rank, candidate.visible_devices_env,
                              visible, env.local_world_size)


def set_current_device(device: torch.device) -> tuple[int | None, str]:
    """Make ``device`` the current device of its type (``torch.accelerator.set_device_index`` where
    it is the current accelerator, else ``torch.<type>.set_device``).

    Returns:
        ``(previous_index, note)``: the index that was current before (None when it could not be
        read), and a note for the report. Never raises: a device module without the call is
        reported in the note.
    """
    if device.type == "cpu" or device.index is None:
        return None, "the CPU has no current-device setting"
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    errors = []
    if acc is not None and acc.type == device.type:
        try:
            prev = torch.accelerator.current_device_index()
            torch.accelerator.set_device_index(device.index)
            now = torch.accelerator.current_device_index()
            if now == device.index:
                return prev, f"current {device.type} device set to {device.index} (torch.accelerator)"
            errors.append(f"torch.accelerator.set_device_index({device.index}) left the current device at {now}")
        except Exception as err:  # noqa: BLE001 - fall back to the device module
            errors.append(f"torch.accelerator: {type(err).__name__}: {err}")
    mod = getattr(torch, device.type, None)
    if mod is not None and hasattr(mod, "set_device"):
        try:
            prev = mod.current_device() if hasattr(mod, "current_device") else None
            mod.set_device(device.index)
            now = mod.current_device() if hasattr(mod, "current_device") else device.index
            if now == device.index:
                return prev, f"current {device.type} device set to {device.index} (torch.{device.type}.set_device)"
            errors.append(f"torch.{device.type}.set_device({device.index}) left the current device at {now}")
        except Exception as err:  # noqa: BLE001
            errors.append(f"torch.{device.type}.set_device: {type(err).__name__}: {err}")
    note = f"could not set the current {device.type} device: " + ("; ".join(errors) or f"torch.{device.type} has no set_device")
    log.warning(note)
    return None, note
