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

How a sample is timed (the mechanism, and why):

* **No thread-locals across forward and backward.** PyTorch's autograd engine runs backward for
  accelerator tensors on a per-device worker thread, not the thread that ran forward. The sample
  awaiting its backward is therefore held by the hooks object itself (under a lock), and the
  backward hooks close over that sample; a thread-local written in forward would never be seen
  there (the defect found on an H100: the trial never finished and every step paid two device
  synchronizations).
* **Device events, not synchronizations.** Marks come from
  :func:`apt_model.devices.timing.clock_for`: timing events on accelerators, the host clock on
  the CPU. A sample's duration is read once its last event has completed, normally at a later
  call; at most ``max_lag`` finished samples wait to be read before the hooks block on the
  oldest one event (never on the whole device). The trial thus ends within its call budget
  (``settle_max + 2 * calls + max_lag`` training calls at most).
* **Nothing after the verdict.** Once the trial has decided, the hooks take no marks and never
  synchronize: a call costs the autocast context and nothing else.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable

import torch
import torch.nn as nn

from apt_model.devices.timing import clock_for
from apt_model.precision.trial import SpeedTrial
from apt_model.base.patches import PatchSet


class _Sample:
    """The marks of one timed call: forward ``t0``..``t1``, backward ``b0``..``b1`` (``b0`` stays
    None for a model without trainable parameters: forward only)."""

    __slots__ = ("t0", "t1", "b0", "b1", "handles")

    def __init__(self, t0: Any):
        self.t0, self.t1, self.b0, self.b1 = t0, None, None, None
        self.handles: list = []

    @property
    def end(self) -> Any:
        return self.b1 if self.b1 is not None else self.t1


class AutocastHooks:
    """Picklable pre/post forward hooks that run a module's forward under autocast.

    Args:
        device_type: torch device type (``cpu``, ``cuda``, ``npu``...).
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        trial: optional on-line trial deciding whether autocast stays on.
        on_verdict: called as ``on_verdict(keep: bool, summary: dict)`` when the trial ends (on
            the thread that completed the deciding sample: the forward thread, or autograd's
            device thread).
        device: the model's device (with index) for the trial's timing events; defaults to
            ``device_type``'s current device.
        clock: the trial's clock (``mark/ready/wait/elapsed``, see
            :mod:`apt_model.devices.timing`); default :func:`~apt_model.devices.timing.clock_for`.
        max_lag: finished samples allowed to wait for their events before the hooks block on the
            oldest (>= 0).

    Attributes:
        active: whether autocast is applied to calls (False after a trial turned it off).
        calls: number of calls that ran under this autocast.
        clock_reason: why the trial's clock was chosen (None until the first timed call).

    Raises:
        ValueError: ``max_lag`` negative.
    """

    def __init__(self, device_type: str, dtype: torch.dtype, trial: SpeedTrial | None = None,
                 on_verdict: Callable[[bool, dict], None] | None = None,
                 device: torch.device | str | None = None, clock: Any = None, max_lag: int = 2):
        if max_lag < 0:
            raise ValueError(f"max_lag={max_lag} must be >= 0")
        self.device_type = device_type
        self.device = torch.device(device) if device is not None else torch.device(device_type)
        self.dtype = dtype
        self.trial = trial
        self.on_verdict = on_verdict
        self.max_lag = max_lag
        self.active = True
        self.calls = 0
        self.clock = clock
        self.clock_reason: str | None = None if clock is None else "given"
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._tls = threading.local()  # the autocast context stack: entered and left on one thread
        self._lock = threading.RLock()
        self._pending: _Sample | None = None  # forward done, backward not yet through the model
        self._measured: deque[_Sample] = deque()  # all marks taken, durations not yet read

    _RUNTIME = ("_tls", "_lock", "_pending", "_measured", "on_verdict")

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if k not in self._RUNTIME}  # no live hooks
        state["on_verdict"] = None
        if state.get("clock_reason") != "given":
            state["clock"], state["clock_reason"] = None, None  # events do not pickle: chosen again
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_runtime()

    def _stack(self) -> list:
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        return stack

    def _clock(self):
        if self.clock is None:
            self.clock, self.clock_reason = clock_for(self.device)
        return self.clock

    def _drop_pending(self) -> None:
        """A timed call whose backward never came (evaluation with grad on, a second call site):
        no sample; its place in the ABBA order goes to the next call."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            for h in pending.handles:
                h.remove()
            self.trial.cancel_last()

    def _finish(self, sample: _Sample) -> None:
        """All marks of ``sample`` are taken: queue it and read what is ready."""
        with self._lock:
            if self._pending is sample:
                self._pending = None
            self._measured.append(sample)
        self._resolve()

    def _resolve(self) -> None:
        """Record the durations of finished samples in order, reading events only once they have
        completed; block on the oldest one event only when more than ``max_lag`` wait."""
        verdict_summary = None
        with self._lock:
            clock = self.clock
            while self._measured and self.trial.running:
                sample = self._measured[0]
                if not clock.ready(sample.end):
                    if len(self._measured) <= self.max_lag:
                        break
                    clock.wait(sample.end)
                self._measured.popleft()
                seconds = clock.elapsed(sample.t0, sample.t1)
                if sample.b0 is not None:
                    seconds += clock.elapsed(sample.b0, sample.b1)
                verdict = self.trial.record(seconds)
                if verdict is not None:
                    self.active = verdict
                    self._measured.clear()
                    verdict_summary = (verdict, self.trial.summary())
        if verdict_summary is not None and self.on_verdict is not None:
            self.on_verdict(*verdict_summary)

    def _time_backward(self, module: nn.Module, output, sample: _Sample) -> None:
        """Finish ``sample`` when backward has gone through the model (or now, if it cannot)."""
        from torch.autograd.graph import register_multi_grad_hook
        from torch.utils._pytree import tree_leaves

        outs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        params = [p for p in module.parameters() if p.requires_grad]
        if not outs:
            self.trial.cancel_last()  # nothing to differentiate: not a training call after all
            return
        if not params:
            self._finish(sample)  # forward only
            return
        clock = self.clock

        def backward_started(grads):
            if sample.b0 is None:
                sample.b0 = clock.mark()

        def backward_done(grads):
            with self._lock:
                if self._pending is not sample or sample.b0 is None:
                    return
                sample.b1 = clock.mark()
            self._finish(sample)

        sample.handles = [register_multi_grad_hook(outs, backward_started, mode="any"),
                          register_multi_grad_hook(params, backward_done, mode="all")]
        with self._lock:
            self._pending = sample

    def pre(self, module: nn.Module, args: tuple) -> None:
        timing = self.trial is not None and self.trial.running
        if timing:
            self._drop_pending()
            if self._measured:
                self._resolve()
        if not self.active or torch.is_autocast_enabled(self.device_type):
            self._stack().append(None)  # off, or the caller manages precision: leave it alone
            return None
        use, sample = True, None
        if timing and self.trial.running and torch.is_grad_enabled() and module.training:
            use = self.trial.issue()
            sample = _Sample(self._clock().mark())
        ctx = torch.autocast(self.device_type, dtype=self.dtype) if use else None
        if ctx is not None:
            ctx.__enter__()
            self.calls += 1
        self._stack().append((ctx, sample))
        return None

    def post(self, module: nn.Module, args: tuple, output):
        stack = self._stack()
        if not stack:
            return None
        entry = stack.pop()
        if entry is None:
            return None
        ctx, sample = entry
        if ctx is not None:
            ctx.__exit__(None, None, None)
            from accelerate.utils.operations import convert_to_fp32

            output = convert_to_fp32(output)
        if sample is not None:
            sample.t1 = self.clock.mark()
            self._time_backward(module, output, sample)
        return output if ctx is not None else None


def attach_autocast(model: nn.Module, device_type: str, dtype: torch.dtype, patches: PatchSet,
                    trial: SpeedTrial | None = None,
                    on_verdict: Callable[[bool, dict], None] | None = None,
                    device: torch.device | str | None = None, clock: Any = None) -> AutocastHooks:
    """Run ``model``'s forward under autocast; the hooks are removed when ``patches`` is restored.

    Arguments as for :class:`AutocastHooks`; returns the attached hooks object.
    """
    hooks = AutocastHooks(device_type, dtype, trial, on_verdict, device=device, clock=clock)
    patches.add_handle(model.register_forward_pre_hook(hooks.pre), f"autocast pre-hook {type(model).__name__}")
    patches.add_handle(model.register_forward_hook(hooks.post, always_call=True), f"autocast hook {type(model).__name__}")
    patches.set_attr(model, "_vb_autocast", hooks, label=f"autocast marker {type(model).__name__}")
    return hooks
