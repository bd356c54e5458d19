"""Autocast around a model's forward, attached as hooks (no change to the model's code).

A forward pre-hook enters ``torch.autocast(device_type, dtype)``; a forward hook that always
runs (also when forward raises) leaves it and converts floating outputs back to fp32 with
accelerate's ``convert_to_fp32``, so a loss computed outside the model sees fp32 logits as in
the user's plain script. If autocast is already active when the model is called, the user is
managing precision: the hooks do nothing for that call. Backward needs no autocast: its ops
follow the dtypes chosen in forward (PyTorch AMP docs, "Autocasting").

With a :class:`~apt_model.precision.trial.SpeedTrial`, the first training calls (grad enabled,
module in train mode) alternate autocast on/off and are timed forward *and* backward: forward
from the pre-hook to the forward hook, backward from the first gradient reaching the model's
outputs to the last gradient reaching its trainable parameters
(``torch.autograd.graph.register_multi_grad_hook``). Forward alone would mislead: on CPUs bf16
can halve a small model's forward yet slow its backward. When the trial ends, autocast stays on
only if it was faster on this very model, and ``on_verdict`` is told either way.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import torch
import torch.nn as nn

from apt_model.precision.trial import SpeedTrial
from apt_model.switch.patches import PatchSet


def _sync(device_type: str) -> None:
    if device_type != "cpu":
        mod = getattr(torch, device_type, None)
        if mod is not None and hasattr(mod, "synchronize"):
            mod.synchronize()


class AutocastHooks:
    """Picklable pre/post forward hooks that run a module's forward under autocast.

    Args:
        device_type: torch device type (``cpu``, ``cuda``, ``npu``...).
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        trial: optional on-line trial deciding whether autocast stays on.
        on_verdict: called as ``on_verdict(keep: bool, summary: dict)`` when the trial ends.

    Attributes:
        active: whether autocast is applied to calls (False after a trial turned it off).
        calls: number of calls that ran under this autocast.
    """

    def __init__(self, device_type: str, dtype: torch.dtype, trial: SpeedTrial | None = None,
                 on_verdict: Callable[[bool, dict], None] | None = None):
        self.device_type = device_type
        self.dtype = dtype
        self.trial = trial
        self.on_verdict = on_verdict
        self.active = True
        self.calls = 0
        self._tls = threading.local()

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if k not in ("_tls", "on_verdict")}  # no live hooks
        state["on_verdict"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._tls = threading.local()

    def _stack(self) -> list:
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        return stack

    def _drop_pending(self) -> None:
        pending = getattr(self._tls, "pending", None)
        if pending is not None:
            for h in pending["handles"]:
                h.remove()
            self._tls.pending = None

    def _time_backward(self, module: nn.Module, output, forward_s: float) -> None:
        """Finish the trial sample when backward has gone through the model (or now, if it cannot)."""
        from torch.autograd.graph import register_multi_grad_hook
        from torch.utils._pytree import tree_leaves

        outs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        params = [p for p in module.parameters() if p.requires_grad]
        if not outs:
            return  # nothing to differentiate: not a training call after all; no sample
        if not params:
            self._record(forward_s)
            return
        pending = {"t_b0": None, "handles": []}
        tls = self._tls

        def backward_started(grads):
            _sync(self.device_type)
            pending["t_b0"] = time.perf_counter()

        def backward_done(grads):
            if pending["t_b0"] is None or getattr(tls, "pending", None) is not pending:
                return
            _sync(self.device_type)
            tls.pending = None
            self._record(forward_s + time.perf_counter() - pending["t_b0"])

        pending["handles"] = [register_multi_grad_hook(outs, backward_started, mode="any"),
                              register_multi_grad_hook(params, backward_done, mode="all")]
        self._tls.pending = pending

    def _record(self, seconds: float) -> None:
        verdict = self.trial.record(seconds)
        if verdict is not None:
            self.active = verdict
            if self.on_verdict is not None:
                self.on_verdict(verdict, self.trial.summary())

    def pre(self, module: nn.Module, args: tuple) -> None:
        self._drop_pending()  # a previous trial call whose backward never came: no sample
        if not self.active or torch.is_autocast_enabled(self.device_type):
            self._stack().append(None)  # off, or the caller manages precision: leave it alone
            return None
        use, timed = True, False
        if self.trial is not None and self.trial.running and torch.is_grad_enabled() and module.training:
            use, timed = self.trial.next_setting(), True
            _sync(self.device_type)
        ctx = torch.autocast(self.device_type, dtype=self.dtype) if use else None
        if ctx is not None:
            ctx.__enter__()
            self.calls += 1
        self._stack().append((ctx, time.perf_counter() if timed else None))
        return None

    def post(self, module: nn.Module, args: tuple, output):
        stack = self._stack()
        if not stack:
            return None
        entry = stack.pop()
        if entry is None:
            return None
        ctx, t0 = entry
        if ctx is not None:
            ctx.__exit__(None, None, None)
            from accelerate.utils.operations import convert_to_fp32

            output = convert_to_fp32(output)
        if t0 is not None:
            _sync(self.device_type)
            self._time_backward(module, output, time.perf_counter() - t0)
        return output if ctx is not None else None


def attach_autocast(model: nn.Module, device_type: str, dtype: torch.dtype, patches: PatchSet,
                    trial: SpeedTrial | None = None,
                    on_verdict: Callable[[bool, dict], None] | None = None) -> AutocastHooks:
    """Run ``model``'s forward under autocast; the hooks are removed when ``patches`` is restored."""
    hooks = AutocastHooks(device_type, dtype, trial, on_verdict)
    patches.add_handle(model.register_forward_pre_hook(hooks.pre), f"autocast pre-hook {type(model).__name__}")
    patches.add_handle(model.register_forward_hook(hooks.post, always_call=True), f"autocast hook {type(model).__name__}")
    patches.set_attr(model, "_vb_autocast", hooks, label=f"autocast marker {type(model).__name__}")
    return hooks
