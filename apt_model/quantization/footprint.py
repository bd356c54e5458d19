"""A module's memory footprint, and releasing a frozen Parameter's memory without losing the Parameter.

Replacing a layer does not free its weight by itself: the old Parameter object is still referenced
by anything that collected ``model.parameters()`` earlier — an optimizer's param groups, a user's
list. :func:`release_parameter` empties the Parameter's storage in place (``param.data = empty``):
the object (and its identity in the optimizer) survives, its bytes go back to the allocator unless
something else still holds that storage, which it reports.
"""
from __future__ import annotations

import torch
import torch.nn as nn


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and shared weights counted once)."""
    seen: dict[tuple, int] = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        s = t.untyped_storage()
        seen[(t.device.type, t.device.index, s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (distinct storages)."""
    return storage_bytes([*module.parameters(), *module.buffers()])


def storage_holders(t: torch.Tensor) -> int | None:
    """How many tensors share ``t``'s storage (``t`` included), or None when this torch cannot tell."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    try:
        return int(count(t.untyped_storage()._cdata)) - 1  # minus the temporary storage object
    except Exception:  # noqa: BLE001 - a private helper; the answer is optional
        return None


def release_parameter(param: nn.Parameter) -> dict:
    """Replace a frozen Parameter's data with an empty tensor of the same dtype and device.

    The Parameter object stays the same (optimizers holding it keep a valid, empty entry).

    Returns:
        ``{"bytes": storage size, "freed": True | False | None, "holders": other holders or None}``:
        ``freed`` is False when other tensors (views, copies kept by the script) still share the
        storage, None when this torch cannot tell.

    Raises:
        ValueError: ``param`` requires grad (it is being trained; releasing it would break training).
    """
    if param.requires_grad:
        raise ValueError("release_parameter: the parameter requires grad (it is trained); only frozen ones can be released")
    nbytes = param.untyped_storage().nbytes()
    holders = storage_holders(param)
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    others = None if holders is None else holders - 1
    return {"bytes": nbytes, "freed": None if others is None else others == 0, "holders": others}
