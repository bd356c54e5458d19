"""Where an adopted model's inputs belong: the switch's one placement rule, and its error hint.

The rule (docs/architecture.md, "Placement"):

* **The script places models; the switch never moves one.** A model the script moved
  (``model.to(device)``, ``model.cuda()``) stays where the script put it, and building its
  inputs on that device is the script's job, exactly as in plain PyTorch. A model the script
  never moved stays where it was built (the CPU), with the reason recorded. ``vb.device()`` is
  the device the switch recommends: ``model.to(vb.device())`` and ``x.to(vb.device())``.
* The one exception is CUDA redirection: where CUDA is absent, ``.cuda()`` / ``.to("cuda")`` on
  modules *and* tensors go to the selected device, so a CUDA script keeps its inputs beside its
  model.
* A script written on a CPU, where every device is the same, may never have moved its inputs.
  On an accelerator that surfaces as PyTorch's "Expected all tensors to be on the same device"
  inside the model's forward. The switch does not silently move those tensors (a copy per step
  the script did not ask for, and a loss built outside the model would then meet a device it
  did not expect); it adds one line to that error naming the model's device and the fix.
  Only where a mismatch can happen: not for a CPU model on a machine with no accelerator
  (:func:`hint_useful`), whose calls then skip the hook's cost.

The hint is a forward hook with ``always_call=True``: PyTorch runs such hooks while the exception
from ``forward`` is being handled, then re-raises it, so the hook sees the exception in
``sys.exc_info()`` and adds a note (``BaseException.add_note``, PEP 678; on Python 3.10 the line
is appended to the message). The exception object, its type and traceback are unchanged.
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn

from apt_model.base.feature import AdoptionContext, Decision, FeatureStep
from apt_model.base.log import get_logger
from apt_model.base.patches import PatchSet, SessionHook

log = get_logger(__name__)

#: How PyTorch words a device mismatch: the CUDA/ATen checks, and the generic device guard
#: ("Tensor on device cpu is not on the expected device meta!") other backends raise.
MISMATCH = ("Expected all tensors to be on the same device", "is not on the expected device")


def mismatch_hint(model_device: torch.device | str) -> str:
    """The line added to a device-mismatch error raised inside an adopted model on ``model_device``."""
    return (f"apt_model: this model's parameters are on {model_device} (where the script put it); "
            f"its inputs must be there too: build them with device=vb.device() or move them with "
            f"x.to(vb.device()) (docs/troubleshooting.md, 'Expected all tensors to be on the same device')")


def _add_line(exc: BaseException, line: str) -> None:
    if getattr(exc, "_vb_hinted", False):
        return  # an inner adopted model already said it
    if hasattr(exc, "add_note"):
        exc.add_note(line)
    elif exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{line}", *exc.args[1:])
    try:
        exc._vb_hinted = True
    except AttributeError:  # exceptions with __slots__: a second note is harmless
        pass


class DeviceMismatchHint:
    """Forward hook (``always_call=True``) adding :func:`mismatch_hint` to a device-mismatch
    ``RuntimeError`` raised in the model's forward; a no-op for every other call.

    Args:
        model: the adopted model; its device is read when the error happens (it may have moved).
    """

    def __init__(self, model: nn.Module):
        self._name = type(model).__name__

    def __call__(self, module: nn.Module, args: tuple, output):
        exc = sys.exc_info()[1]
        if exc is not None and isinstance(exc, RuntimeError) and any(m in str(exc) for m in MISMATCH):
            first = next(module.parameters(), None)
            _add_line(exc, mismatch_hint(first.device if first is not None else "cpu"))
        return None


def accelerator_present() -> bool:
    """Whether this process sees an accelerator (``torch.accelerator.is_available()``: CUDA/ROCm,
    XPU, MPS, or a registered PrivateUse1 backend such as Ascend's); True when that query raises
    (the hint is then attached, as it always was)."""
    try:
        return bool(torch.accelerator.is_available())
    except Exception as err:  # noqa: BLE001 - a broken vendor plugin: keep the hint
        log.debug("placement: torch.accelerator.is_available() raised %s: the mismatch hint is kept", err)
        return True


def hint_useful(selected: torch.device, model_device: torch.device) -> bool:
    """Whether a model on ``model_device``, adopted in a session whose selected device is
    ``selected``, gets the device-mismatch hint: unless both are the CPU and no accelerator is
    present, where every tensor a script builds is on the CPU already (a mismatch there is with a
    ``meta`` tensor, which the hint's advice does not fix). The hint is a forward hook on the model,
    and any hook takes PyTorch's slower call path for it at every call."""
    return selected.type != "cpu" or model_device.type != "cpu" or accelerator_present()


def attach_mismatch_hint(model: nn.Module, patches: PatchSet) -> None:
    """Attach :class:`DeviceMismatchHint` to ``model``; removed when ``patches`` is restored."""
    handle = model.register_forward_hook(SessionHook(DeviceMismatchHint(model)), always_call=True)
    patches.add_handle(handle, f"device-mismatch hint {type(model).__name__}")


class PlacementStep(FeatureStep):
    """The placement feature: records where the model is and why (the script's placement is kept,
    never changed), and attaches the device-mismatch hint where :func:`hint_useful` says it can
    help. Always acts (the record)."""

    name = "placement"

    def decide(self, model: nn.Module, ctx: AdoptionContext) -> Decision:
        sel, dev = self.session.selected, ctx.device
        same = dev.type == sel.type and (dev.index or 0) == (sel.index or 0)
        if ctx.trigger == "to()":
            why = f"moved by the script to {dev}{ctx.moved_note}"
            if not same:
                why += f"; the selected device is {sel}, but an explicit placement is kept"
        elif same:
            why = f"already on the selected device {sel}"
        else:
            why = (f"left on {dev}: the script never moved it (inputs it builds are on {dev} too); "
                   f"move it with model.to(vb.device()) to use {sel}")
        return Decision(self.name, str(sel), str(dev), why, act=True)

    def apply(self, model: nn.Module, ctx: AdoptionContext, patches: PatchSet, decision: Decision) -> Decision:
        if hint_useful(self.session.selected, ctx.device):
            attach_mismatch_hint(model, patches)
        return decision
