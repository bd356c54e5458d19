"""Autocast around a model's forward, attached as hooks (no change to the model's code).

A forward pre-hook enters ``torch.autocast(device_type, dtype)``; a forward hook that always
runs (also when forward raises) leaves it and converts floating outputs back to fp32 with
accelerate's ``convert_to_fp32``, so a loss computed outside the model sees fp32 logits as in
the user's plain script. If autocast is already active when the model is called, the user is
managing precision: the hooks do nothing for that call. Backward needs no autocast: its ops
follow the dtypes chosen in forward (PyTorch AMP docs, "Autocasting").
"""
from __future__ import annotations

import threading

import torch
import torch.nn as nn

from apt_model.switch.patches import PatchSet


class AutocastHooks:
    """Picklable pre/post forward hooks that run a module's forward under autocast.

    Args:
        device_type: torch device type (``cpu``, ``cuda``, ``npu``...).
        dtype: ``torch.bfloat16`` or ``torch.float16``.
    """

    def __init__(self, device_type: str, dtype: torch.dtype):
        self.device_type = device_type
        self.dtype = dtype
        self.calls = 0
        self._tls = threading.local()

    def __getstate__(self):
        return {"device_type": self.device_type, "dtype": self.dtype, "calls": self.calls}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._tls = threading.local()

    def _stack(self) -> list:
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        return stack

    def pre(self, module: nn.Module, args: tuple) -> None:
        if torch.is_autocast_enabled(self.device_type):
            self._stack().append(None)  # the caller manages precision: leave it alone
            return None
        ctx = torch.autocast(self.device_type, dtype=self.dtype)
        ctx.__enter__()
        self._stack().append(ctx)
        self.calls += 1
        return None

    def post(self, module: nn.Module, args: tuple, output):
        stack = self._stack()
        if not stack:
            return None
        ctx = stack.pop()
        if ctx is None:
            return None
        ctx.__exit__(None, None, None)
        from accelerate.utils.operations import convert_to_fp32

        return convert_to_fp32(output)


def attach_autocast(model: nn.Module, device_type: str, dtype: torch.dtype, patches: PatchSet) -> AutocastHooks:
    """Run ``model``'s forward under autocast; the hooks are removed when ``patches`` is restored."""
    hooks = AutocastHooks(device_type, dtype)
    patches.add_handle(model.register_forward_pre_hook(hooks.pre), f"autocast pre-hook {type(model).__name__}")
    patches.add_handle(model.register_forward_hook(hooks.post, always_call=True), f"autocast hook {type(model).__name__}")
    patches.set_attr(model, "_vb_autocast", hooks, label=f"autocast marker {type(model).__name__}")
    return hooks
