"""Timing a module's training calls (forward and backward) for an on-line A/B trial, without
stalling the device.

:class:`CallTimer` is the mechanism behind every on-line trial of the switch (autocast on/off in
:mod:`apt_model.precision.autocast`, compiled/eager in :mod:`apt_model.compile.ladder`): the
owner's forward pre-hook calls :meth:`CallTimer.begin` — which also says which variant this call
runs (the :class:`~apt_model.devices.trial.SpeedTrial`'s ABBA schedule) — and its forward hook
calls :meth:`CallTimer.end` with the output. A call is timed forward *and* backward: forward from
``begin`` to ``end``, backward from the first gradient reaching the module's outputs
(``torch.autograd.graph.register_multi_grad_hook``) to the end of that backward pass (a callback
queued on autograd's engine then, as DDP does). Until 2026-11-27 the end was the last gradient
reaching the module's parameters, a multi-grad hook on leaf tensors, which PyTorch refuses inside
``torch.autograd.grad``: a gradient penalty or ``torch.func.grad`` over an adopted model raised
"A leaf node was passed to _will_engine_execute_node" during a trial.

* **Which calls are timed.** Training calls only: grad enabled, module in train mode, and not run
  by a backward pass (activation checkpointing recomputing the forward). A call that is not timed
  never withdraws the call awaiting its backward (an evaluation between a forward and its
  backward, a target computed under ``no_grad``: before, each one withdrew it, so a loop with one
  never recorded a sample and the trial never ended); a recomputation inside backward runs the
  variant of the call it recomputes. A trial that has issued :data:`GIVE_UP_FACTOR` times the calls
  it needs without deciding gives up (the variant under trial is not kept), so nothing stays on
  trial for good.

* **No thread-locals across forward and backward.** PyTorch's autograd engine runs backward for
  accelerator tensors on a per-device worker thread, not the thread that ran forward. The sample
  awaiting its backward is held by the timer itself (under a lock), and the backward hooks close
  over that sample.
* **Device events, not synchronizations.** Marks come from
  :func:`apt_model.devices.timing.clock_for`: timing events on accelerators, the host clock on the
  CPU. A sample's duration is read once its last event has completed, normally at a later call; at
  most ``max_lag`` finished samples wait before the timer blocks on the oldest one event (never on
  the whole device). A trial thus ends within ``settle_max + 2 * calls + max_lag`` training calls.
* **Nothing after the verdict.** Once the trial has decided, ``begin`` takes no marks and never
  synchronizes, and no hook of the timer is left on the module: a sample's backward hooks are
  removed as soon as its marks are taken, a pending sample's at the verdict or when withdrawn, and
  all of them by :meth:`CallTimer.close` (the owner's detach).
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable

import torch
import torch.nn as nn

from apt_model.base.outputs import gradient_watch, output_tensors
from apt_model.devices.rank_agreement import WAIT_CALLS_FACTOR
from apt_model.devices.timing import clock_for
from apt_model.devices.trial import SpeedTrial


#: A trial gives up after issuing this many times the calls it needs (settling, timed, extended).
GIVE_UP_FACTOR = 4


def in_backward() -> bool:
    """Whether the calling thread is running a backward pass (a module called there is being
    recomputed by activation checkpointing)."""
    return torch._C._current_graph_task_id() != -1


class Sample:
    """The marks of one timed call: forward ``t0``..``t1``, backward ``b0``..``b1`` (``b0`` stays
    None for a module without trainable parameters: forward only); ``variant`` is what it ran."""

    __slots__ = ("t0", "t1", "b0", "b1", "handles", "variant")

    def __init__(self, t0: Any, variant: bool | None = None):
        self.t0, self.t1, self.b0, self.b1 = t0, None, None, None
        self.handles: list = []
        self.variant = variant

    @property
    def end(self) -> Any:
        return self.b1 if self.b1 is not None else self.t1

    def release(self) -> None:
        """Remove the sample's backward hooks (they sit on the module's parameters, which would
        otherwise keep them, and through them the timer and its owner, for the parameters' life)."""
        handles, self.handles = self.handles, []
        for h in handles:
            h.remove()


class CallTimer:
    """Times the training calls of one module for a :class:`~apt_model.devices.trial.SpeedTrial`.

    Args:
        trial: the trial (its schedule says which variant each timed call runs).
        on_verdict: called as ``on_verdict(keep: bool, summary: dict)`` when the trial ends (on the
            thread that completed the deciding sample: the forward thread, or autograd's device thread).
        device: the module's device (with index) for the timing events.
        clock: the clock (``mark/ready/wait/elapsed``, see :mod:`apt_model.devices.timing`);
            default :func:`~apt_model.devices.timing.clock_for` of ``device``.
        max_lag: finished samples allowed to wait for their events before blocking on the oldest (>= 0).
        channel: where the verdict is agreed between the ranks of a job
            (:class:`~apt_model.devices.rank_agreement.TrialChannel`), or None (this process decides
            alone). With one, ``on_verdict`` gets the agreed verdict: at once on rank 0 and where
            rank 0 has decided already, else at a later training call; meanwhile the calls go on
            alternating the variants, untimed, and :attr:`running` stays True.

    Attributes:
        verdict: None while the trial runs, then whether the variant under trial is kept.
        clock_reason: why the clock was chosen (None until the first timed call).

    Raises:
        ValueError: ``max_lag`` negative.
    """

    def __init__(self, trial: SpeedTrial, on_verdict: Callable[[bool, dict], None] | None = None,
                 device: torch.device | str = "cpu", clock: Any = None, max_lag: int = 2, channel: Any = None):
        if max_lag < 0:
            raise ValueError(f"max_lag={max_lag} must be >= 0")
        self.trial = trial
        self.channel = channel
        self._awaiting = False  # the local verdict is in; rank 0's is awaited (see ``channel``)
        self.on_verdict = on_verdict
        self.device = torch.device(device)
        self.max_lag = max_lag
        self.clock = clock
        self.clock_reason: str | None = None if clock is None else "given"
        self.verdict: bool | None = None
        self.issued = 0  # timed calls issued (withdrawn ones too): the give-up count
        self.untimed = 0  # calls without grad in train mode before any timed call (a target network's)
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._lock = threading.RLock()
        self._closed = False  # close() ran: a backward finishing after it records nothing, decides nothing
        self._pending: Sample | None = None  # forward done, backward not yet through the module
        self._measured: deque[Sample] = deque()  # all marks taken, durations not yet read

    _RUNTIME = ("_lock", "_closed", "_pending", "_measured", "on_verdict", "channel")

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if k not in self._RUNTIME}  # no live hooks
        state["on_verdict"], state["channel"], state["_awaiting"] = None, None, False
        if state.get("clock_reason") != "given":
            state["clock"], state["clock_reason"] = None, None  # events do not pickle: chosen again
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_runtime()

    @property
    def running(self) -> bool:
        """Whether no verdict has been applied yet (the trial runs, or rank 0's verdict is awaited)."""
        return self.trial.running or self._awaiting

    def _clock(self):
        if self.clock is None:
            self.clock, self.clock_reason = clock_for(self.device)
        return self.clock

    def begin(self, module: nn.Module) -> tuple[bool | None, Sample | None]:
        """At a call's start: ``(variant, sample)`` — ``variant`` True/False is the trial's choice
        for this timed call (None: not a timed call, use the current verdict), ``sample`` the marks
        to pass to :meth:`end` (None when not timed). Only training calls (grad enabled, module in
        train mode) are timed."""
        if self._awaiting:
            return self._await(module)
        if not self.trial.running or self._closed:
            return None, None
        recomputing = in_backward()
        if not (torch.is_grad_enabled() and module.training) or recomputing:
            if not recomputing and self.untimed_call():
                return None, None
            with self._lock:
                pending = self._pending
            if self._measured:
                self._resolve()
            if recomputing and pending is not None:
                return pending.variant, None  # a recomputation runs what its call ran
            return None, None
        self.settle()
        if not self.trial.running:
            return None, None
        if torch.are_deterministic_algorithms_enabled():  # turned on after the trial began
            self.give_up("torch.use_deterministic_algorithms(True) was turned on: a verdict taken by timing would make "
                         "runs of the script differ")
            return None, None
        self.issued += 1
        if self.issued > GIVE_UP_FACTOR * self.trial.needed():
            self.give_up(f"no verdict after {self.issued - 1} timed training calls: their backward passes could "
                         "not be matched to them")
            return None, None
        use = self.trial.issue()
        if self.channel is not None:
            self.channel.start()  # rank 0 says it runs this trial (once there is a process group)
        return use, Sample(self._clock().mark(), use)

    def untimed_call(self, kind: str = "called only without gradients (a target network, a frozen reference)") -> bool:
        """A call that is not timed (no grad, or eval mode; not a recomputation), outside
        :meth:`begin` or in it: before any timed call, the trial gives up once such calls exceed
        :data:`GIVE_UP_FACTOR` times the calls it needs (a target network or a frozen reference,
        called only without gradients and never trained: no verdict would ever come, and the
        report said "on trial" for good: probes' findings). ``kind`` says how such a model is
        called, in the reason. Returns whether it gave up now."""
        if self.issued or not self.running or self._closed:
            return False
        self.untimed += 1
        if self.untimed <= GIVE_UP_FACTOR * self.trial.needed():
            return False
        self.give_up(f"no training call (grad enabled, train mode) in its first {self.untimed - 1} calls: a model "
                     f"{kind} is never timed")
        return True

    def _await(self, module: nn.Module) -> tuple[bool | None, None]:
        """A call while rank 0's verdict is awaited: a training call looks for it (and gives up
        waiting after :data:`~apt_model.devices.rank_agreement.WAIT_CALLS_FACTOR` times the
        trial's length) and runs the next variant of the ABBA order, untimed, or the verdict once
        it is in; others run the current setting (None)."""
        if not (torch.is_grad_enabled() and module.training) or in_backward():
            return None, None
        got = self.channel.poll()
        if got is None and self.channel.waited > WAIT_CALLS_FACTOR * self.trial.needed():
            got = self.channel.give_up()
        if got is not None:
            self._awaiting = False
            self._deliver(*got)
            return got[0], None  # this call runs the verdict already
        return self.trial.issue(), None

    def _conclude(self, keep: bool, summary: dict, final: bool = False) -> None:
        """The local verdict: agreed through the channel (or not, alone) and delivered, or awaited."""
        if self.channel is not None:
            got = self.channel.settle(keep, summary, final=final)
            if got is None:
                with self._lock:
                    self._awaiting = True
                return
            keep, summary = got
        self._deliver(keep, summary)

    def _deliver(self, keep: bool, summary: dict) -> None:
        self.verdict = keep
        if self.on_verdict is not None:
            self.on_verdict(keep, summary)

    def give_up(self, reason: str) -> None:
        """End a running trial without a verdict: the setting stays off, ``on_verdict(False,
        summary)`` is told (``summary["gave_up"]`` is ``reason``), and the timer closes."""
        if not self.running or (self._closed and not self._awaiting):
            return
        with self._lock:
            summary = self.trial.give_up(reason)
            self.verdict = False
        self.close()
        self._conclude(False, summary, final=True)

    def settle(self) -> None:
        """At a training call's start: withdraw a call whose backward never came (a second call
        site), and read the samples whose events have completed."""
        if self.trial.running:
            self._drop_pending()
            if self._measured:
                self._resolve()

    def end(self, module: nn.Module, output, sample: Sample | None) -> None:
        """At a call's end (the forward hook), with the module's output."""
        if sample is None:
            return
        sample.t1 = self.clock.mark()
        self._time_backward(module, output, sample)

    def abandon(self) -> None:
        """A call :meth:`begin` timed never reached :meth:`end` (an interrupt skipped the forward
        hook): no sample; its place in the ABBA order goes to the next call."""
        self.trial.cancel_last()

    def _drop_pending(self) -> None:
        """A timed call whose backward never came (evaluation with grad on, a second call site):
        no sample; its place in the ABBA order goes to the next call."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.release()
            self.trial.cancel_last()

    def close(self) -> None:
        """Remove every hook the timer placed (a pending sample's and any not yet removed) and drop
        the samples; the trial keeps whatever it has recorded, and nothing more is recorded (a
        backward still running on autograd's device thread delivers no verdict afterwards). For
        the owner's detach, and at the verdict; idempotent."""
        with self._lock:
            self._closed, self._awaiting = True, False
            pending, self._pending = self._pending, None
            measured = list(self._measured)
            self._measured.clear()
        for sample in ([pending] if pending is not None else []) + measured:
            sample.release()

    def _finish(self, sample: Sample) -> None:
        """All marks of ``sample`` are taken: remove its hooks, queue it and read what is ready."""
        sample.release()  # PyTorch allows a hook to be removed while it runs (it holds the hooks)
        with self._lock:
            if self._pending is sample:
                self._pending = None
            if self._closed:
                return
            self._measured.append(sample)
        self._resolve()

    def _resolve(self) -> None:
        """Record the durations of finished samples in order, reading events only once they have
        completed; block on the oldest one event only when more than ``max_lag`` wait."""
        verdict_summary = None
        with self._lock:
            clock = self.clock
            while self._measured and self.trial.running and not self._closed:
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
                    verdict_summary = (verdict, self.trial.summary())
        if verdict_summary is not None:
            self.close()  # drops the samples left; a call timed before the verdict may still await its backward
            self._conclude(*verdict_summary)

    def _time_backward(self, module: nn.Module, output, sample: Sample) -> None:
        """Finish ``sample`` when backward has gone through the module (or now, if it cannot)."""
        from torch.autograd.graph import register_multi_grad_hook

        outs = [t for t in output_tensors(output) if t.requires_grad]
        if not outs:
            self.trial.cancel_last()  # nothing to differentiate: not a training call after all
            return
        if not any(p.requires_grad for p in module.parameters()):
            self._finish(sample)  # forward only
            return
        clock = self.clock

        def backward_done():
            with self._lock:
                if self._pending is not sample or sample.b0 is None:
                    return
                sample.b1 = clock.mark()
            self._finish(sample)

        def backward_started(grads):
            if sample.b0 is None:
                sample.b0 = clock.mark()
                # runs when this backward pass ends (on the engine, after its last node)
                torch.autograd.Variable._execution_engine.queue_callback(backward_done)

        sample.handles = [register_multi_grad_hook(gradient_watch(outs), backward_started, mode="any")]
        with self._lock:
            self._pending = sample
