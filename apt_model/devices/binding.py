"""Binding each rank to its local device.

Under a launcher every process on a node sees the same devices (unless the launcher narrows them
per process through the vendor's visible-devices variable: ``CUDA_VISIBLE_DEVICES``,
``HIP_VISIBLE_DEVICES``, ``ASCEND_RT_VISIBLE_DEVICES``, ``MLU_VISIBLE_DEVICES``,
``ZE_AFFINITY_MASK``). Device indices are always *visible* indices: with
``CUDA_VISIBLE_DEVICES=2,3``, ``cuda:0`` is physical GPU 2. The rule:

* at least as many devices visible as there are local ranks (``LOCAL_WORLD_SIZE``): local rank
  *i* uses device *i*;
* fewer devices visible than local ranks: a :class:`~apt_model.base.errors.DeviceSelectionError` at
  ``enable()`` / device selection, on every local rank and before any collective, naming the
  ranks, the visible devices, the visible-devices variable and the fixes (fewer processes per
  node, or ``VB_DEVICE=cpu`` to train on the CPU with gloo). Two ranks on one device would
  otherwise fail much later inside the first collective (NCCL: "invalid usage ... Duplicate GPU
  detected"), or train twice as slowly where the library lets them share it;
* the one exception: exactly one device visible *and* a visible-devices variable set by a
  launcher that can narrow it per process (SLURM ``--gpus-per-task=1``, MPI wrappers): each
  rank's device 0 is then assumed to be a different physical device, and the reason says so.
  ``torchrun`` starts every local process with the environment it was started with, so under
  ``torchrun`` local ranks always see the same devices and the exception never applies;
* the CPU has no index: all ranks share it.

:func:`local_device_index` is the pure rule (used by the ranking policy, so ``vb.device()``,
``get_device()`` and the reports all give each rank its own device); :func:`set_current_device`
makes that device the process's current one, as NCCL/HCCL need.
"""
from __future__ import annotations

import torch

from apt_model.base.launch import LaunchEnv, read_launch_env
from apt_model.base.errors import DeviceSelectionError
from apt_model.base.log import get_logger

log = get_logger(__name__)


def describe_visible(visible_env: str | None, visible_value: str | None) -> str:
    """How messages show a kind's visible-devices variable: ``CUDA_VISIBLE_DEVICES='0,1'``,
    ``CUDA_VISIBLE_DEVICES unset``, or ``no visible-devices variable`` for a kind without one."""
    if visible_env and visible_value is not None:
        return f"{visible_env}={visible_value!r}"
    return f"{visible_env} unset" if visible_env else "no visible-devices variable"


def _ranks(first: int, last: int) -> str:
    return f"local rank {first}" if first == last else f"local ranks {first}..{last}"


def local_device_index(kind: str, count: int, local_rank: int, visible_env: str | None = None,
                       visible_value: str | None = None, local_world_size: int | None = None,
                       launcher: str | None = None, dist_backend: str | None = None,
                       names: tuple[str, ...] | list[str] = (), device_type: str | None = None) -> tuple[int, str]:
    """The device index local rank ``local_rank`` uses, and why.

    Args:
        kind: the device kind (``cuda``, ``npu``...), for messages.
        count: devices of that kind visible to this process (after the visible-devices variable).
        local_rank: the process's rank on its node (``LOCAL_RANK``), 0-based.
        visible_env / visible_value: the kind's visible-devices variable and its value (None: unset).
        local_world_size: processes on this node (``LOCAL_WORLD_SIZE``), if known; when unknown,
            ``local_rank + 1`` processes are assumed.
        launcher: :attr:`~apt_model.base.launch.LaunchEnv.launcher` (``torchrun``,
            ``slurm``...). Under ``torchrun`` every local rank sees the same devices.
        dist_backend: the kind's collective backend (``nccl``, ``hccl``...), for messages.
        names: device names when known (``NVIDIA H100 80GB HBM3``), for messages.
        device_type: the torch device type (``cuda`` for rocm/dcu; default ``kind``), for messages.

    Returns:
        ``(index, reason)``; the index is a visible-device index.

    Raises:
        DeviceSelectionError: ``count`` is 0; or fewer devices are visible than there are local
            ranks (``max(LOCAL_WORLD_SIZE, LOCAL_RANK + 1)``), except for one device visible through
            a per-process visible-devices variable (see the module docstring). The message names the
            local ranks, the visible devices, the visible-devices variable and its value, and the
            fixes (``torchrun --nproc_per_node=<count>``, ``VB_DEVICE=cpu`` to train with gloo).
    """
    dtype = device_type or kind
    shown = describe_visible(visible_env, visible_value)
    if count < 1:
        raise DeviceSelectionError(f"LOCAL_RANK={local_rank}: no {kind} device is visible ({shown})")
    local_ranks = max(local_world_size or 1, local_rank + 1)
    if count >= local_ranks:
        return local_rank, f"LOCAL_RANK={local_rank}: {dtype}:{local_rank} of {count} visible ({shown})"
    per_process = (count == 1 and launcher != "torchrun" and visible_env is not None
                   and bool((visible_value or "").strip()))
    if per_process:
        return 0, (f"LOCAL_RANK={local_rank}: 1 {kind} device visible to this process ({shown}): {dtype}:0, "
                   f"assumed to be a device of its own because {visible_env} is set per process by the launcher "
                   f"({launcher or 'environment'}); if other ranks on this node see the same device they share it, "
                   "which gloo allows but NCCL/HCCL refuse: give each rank its own device with "
                   f"{visible_env}")
    size = (f"LOCAL_WORLD_SIZE={local_world_size}" if local_world_size is not None
            else f"at least {local_ranks} (LOCAL_WORLD_SIZE unset)")
    devices = ", ".join(f"{dtype}:{i}" + (f" ({names[i]})" if i < len(names) and names[i] else "")
                        for i in range(count))
    if dist_backend == "nccl":
        refusal = "which nccl refuses at the first collective ('invalid usage ... Duplicate GPU detected')"
    elif dist_backend:
        refusal = f"which {dist_backend} refuses at the first collective"
    else:
        refusal = f"and {kind} has no collective library to synchronize them"
    raise DeviceSelectionError(
        f"LOCAL_RANK={local_rank}: {local_ranks} processes on this node ({size}, {_ranks(0, local_ranks - 1)}) "
        f"but only {count} {kind} device(s) visible to them: {devices} ({shown}); "
        f"{_ranks(count, local_ranks - 1)} would have no {kind} device of its own and share one with another "
        f"rank, {refusal}. Fix: start at most {count} process(es) per node (torchrun --nproc_per_node={count}), "
        f"or train on the CPU with gloo (VB_DEVICE=cpu), or make {local_ranks} {kind} devices visible "
        f"({visible_env or 'the vendor visible-devices variable'})")


def bind_for_launcher(candidate, env: LaunchEnv | None = None) -> tuple[int, str] | None:
    """The rank's device index for an accelerator ``candidate`` under a launcher, or None when
    there is nothing to bind (no launcher, no ``LOCAL_RANK``, or a CPU candidate).

    ``candidate`` is a :class:`~apt_model.devices.detection.Candidate`.

    Raises:
        ConfigError: malformed launcher variables.
        DeviceSelectionError: fewer devices of the candidate's kind visible than local ranks, or
            none (see :func:`local_device_index`).
    """
    env = read_launch_env() if env is None else env
    if env is None or env.local_rank is None or candidate.device_type == "cpu":
        return None
    visible = candidate.backend.visible_devices() if candidate.backend is not None else None
    return local_device_index(candidate.kind, candidate.count, env.local_rank, candidate.visible_devices_env,
                              visible, env.local_world_size, launcher=env.launcher,
                              dist_backend=candidate.dist_backend, names=tuple(candidate.names),
                              device_type=candidate.device_type)


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
