"""Autocast around a model's forward, attached as hooks (no change to the model's code).

Evaluation and generation — a model in eval mode called under ``no_grad`` / ``inference_mode`` —
run as written, in fp32.

A forward pre-hook enters ``torch.autocast(device_type, dtype)``; a forward hook that always
runs (also when forward raises) leaves it and converts floating outputs back to fp32
(:func:`~apt_model.base.outputs.to_fp32`: accelerate's ``convert_to_fp32``, and dataclass fields), so a loss computed outside the model sees fp32 logits as in
the user's plain script. If autocast is already on when the model is called (the script's own
``torch.autocast``), the user is managing precision: the hooks do nothing for that call. A
``torch.autocast(enabled=False)`` around the call is not taken as such: that is how scripts write
"AMP flag off" (``torch.autocast(device, enabled=args.amp)``), and autocast keeps no record that
would tell it apart from a section kept fp32 on purpose (``mixed_precision="off"`` keeps fp32); a
change on 2026-11-28 that honoured it made the switch's bf16 unreachable for such scripts and was
undone the same day. The hooks also do nothing when the model's parameters are no
longer fp32 (the script cast it after adoption, e.g. ``model.half()``). Backward needs no autocast: its ops
follow the dtypes chosen in forward (PyTorch AMP docs, "Autocasting").

With a :class:`~apt_model.devices.trial.SpeedTrial`, the first training calls (grad enabled,
module in train mode) alternate autocast on/off and are timed forward *and* backward: forward
from the pre-hook to the forward hook, backward from the first gradient reaching the model's
outputs to the end of that backward pass (:mod:`apt_model.devices.call_timer`). Forward alone would mislead: on CPUs bf16
can halve a small model's forward yet slow its backward. When the trial ends, autocast stays on
only if it was faster on this very model, and ``on_verdict`` is told either way.

**A forward that raises under the switch's autocast** runs again at once without it, and autocast
stays off for that model from then on, with the reason in the report and a warning. Ops that
mix dtypes in place fail under autocast and not without it: ``out.index_add_(0, idx, y)`` into an
fp32 buffer with ``y`` from a ``Linear`` (bf16 under autocast) raises "self (Float) and source
(BFloat16) must have the same scalar type" — hand-written mixture-of-experts and graph layers do
this —, as do ``scatter_add_``, ``masked_scatter_``, ``.numpy()`` of a bf16 tensor, and custom
kernels that take fp32 only. Before 2026-11-28 such a script crashed at its first call under the
switch's bf16 while it ran as written without the switch. Only an error whose message is about
dtypes (names the autocast dtype, fp32, "dtype" or "scalar type") is retried: a shape or device
error would only raise again. The retry wraps the model's whole call
(:mod:`~apt_model.base.call_wrapper`); in the first :data:`EARLY_CALLS` calls it starts from the
random state and the model's buffers the failed attempt started from, and later what the failed
attempt did before it raised stays done (a BatchNorm's running statistics updated once more,
random numbers drawn). If the retry raises too,
the error was not autocast's: that error propagates and autocast stays as it was. Out of memory
is never retried, nor is a call inside the script's own non-reentrant ``torch.utils.checkpoint``
(the failed attempt's saved tensors would stay counted there, and its backward raise
``CheckpointError``), nor a model compiled after adoption (``model.compile()`` replaces the
wrapper; a compiled function or ``torch.compile(model)`` of an adopted model raises from compiled
code, outside it). Backward is not covered: an op whose *backward* fails in bf16 still fails. Where a
trial decides (``mixed_precision="auto"``), its first training call runs as written and a graph
holding a custom autograd Function (:func:`custom_functions`: an extension's backward kernel often
takes fp32 only) ends the trial with autocast off; forced bf16 is not screened.

How a sample is timed — forward and backward, with device events, no thread-locals across
forward and backward, nothing after the verdict — is :mod:`apt_model.devices.call_timer`'s job
(the same mechanism times the compile ladder's trial).
"""
from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from apt_model.base.call_wrapper import wrap_call
from apt_model.base.forward_scope import ForwardScopes, eagerly, in_enclosing_checkpoint, watch_compilation
from apt_model.base.functional_call import in_function_transform
from apt_model.base.module_hooks import script_hooks
from apt_model.base.log import get_logger
from apt_model.base.outputs import output_tensors, to_fp32
from apt_model.devices.call_timer import CallTimer, in_backward
from apt_model.devices.trial import SpeedTrial
from apt_model.base.patches import PatchSet

log = get_logger(__name__)


def _cast_by_script(module: nn.Module) -> torch.dtype | None:
    """The dtype of ``module``'s first floating parameter when it is not fp32 (the script cast the
    model after adoption, e.g. ``model.half()`` after ``model.to(device)``), else None."""
    for p in module.parameters():
        if p.is_floating_point():
            return None if p.dtype == torch.float32 else p.dtype
    return None


def _framework_autocast(module: nn.Module) -> bool:
    """Whether a framework wrapped the model's forward in its own autocast: accelerate's
    ``prepare`` (with mixed precision) keeps the forward it wrapped as ``_original_forward``. That
    autocast starts inside the call, after the pre-hook looked, so the trial compared bf16 with
    bf16 and reported on it (a probe's finding, 2026-11-28)."""
    return "forward" in module.__dict__ and module.__dict__.get("_original_forward") is not None


#: Words in an error's message (lower-cased) that name an autocast dtype: a forward that raised
#: with one of them (or "dtype", "scalar type", fp32) under the switch's autocast runs again without it.
DTYPE_WORDS = {torch.bfloat16: ("bfloat16", "bf16"), torch.float16: ("half", "float16", "fp16")}


#: Training calls in a row the script manages precision for (its own autocast on, the model cast)
#: after which a running trial gives up: its report said "on trial" for good (a probe's finding).
SCRIPT_MANAGED_CALLS = 8

#: Calls under the switch's autocast, from the model's first, during which the forward is watched
#: for sparse tensors (:class:`SparseWatch`) and the random state is kept for a retry.
EARLY_CALLS = 2


_SPARSE_LAYOUTS = frozenset(getattr(torch, name) for name in
                            ("sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc") if hasattr(torch, name))


class SparseOperandUnderAutocast(RuntimeError):
    """Raised inside a forward under the switch's autocast when an op is given a sparse tensor:
    the call wrapper runs the call again without autocast, which stays off for the model."""


class SparseWatch(TorchFunctionMode):
    """Watches a forward under the switch's autocast for an op given a sparse tensor (a GCN's
    ``torch.sparse.mm(adj, x)``): autocast runs that forward, but the op's backward mixes float32
    and the autocast dtype and raises ("expected scalar type Float but found BFloat16"), out of
    reach of the forward's retry; PyTorch's own autocast fails the same way. Such a model's calls
    run as written (a probe's finding, 2026-11-28: a GCN crashed at its first backward under the
    switch's bf16 where plain PyTorch trains). Active in the first :data:`EARLY_CALLS` calls only:
    a model that first uses a sparse tensor later still meets the error."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor) and a.layout in _SPARSE_LAYOUTS:
                name = getattr(func, "__name__", str(func))
                raise SparseOperandUnderAutocast(
                    f"{name} was given a {a.layout} tensor under {str(self.dtype).replace('torch.', '')} autocast: "
                    "its backward mixes float32 and the autocast dtype, which PyTorch does not support")
        return func(*args, **kwargs)


class _Watched:
    """An autocast context with a :class:`SparseWatch` inside it (entered after, left before)."""

    def __init__(self, autocast, watch: SparseWatch):
        self.autocast, self.watch = autocast, watch

    def __enter__(self):
        self.autocast.__enter__()
        self.watch.__enter__()

    def __exit__(self, *exc):
        try:
            self.watch.__exit__(*exc)
        finally:
            self.autocast.__exit__(*exc)
        return False


def _rng_state(device: torch.device) -> tuple:
    """The CPU generator's state and, off the CPU, the device's default generator's."""
    module = getattr(torch, device.type, None) if device.type != "cpu" else None
    get = getattr(module, "get_rng_state", None)
    return torch.get_rng_state(), (get() if callable(get) else None)


def _set_rng_state(device: torch.device, state: tuple) -> None:
    cpu, dev = state
    torch.set_rng_state(cpu)
    if dev is not None:
        getattr(torch, device.type).set_rng_state(dev)


#: Bytes of a model's buffers an early call copies so that a retried call starts from them (past
#: it, buffers are only watched: a change the retry repeats is logged).
BUFFER_COPY_LIMIT = 64 << 20


def _buffer_state(module: nn.Module | None) -> list[tuple[nn.Module, str, torch.Tensor, int, torch.Tensor | None]]:
    """``(owner, name, buffer, version, copy or None)`` for each dense buffer of ``module`` (copies
    up to :data:`BUFFER_COPY_LIMIT` bytes in all)."""
    out, total = [], 0
    for owner in module.modules() if module is not None else ():
        for name, b in owner._buffers.items():
            if b is None or b.layout is not torch.strided or b.is_inference():
                continue  # no version counter to watch
            size = b.numel() * b.element_size()
            copy = b.detach().clone() if total + size <= BUFFER_COPY_LIMIT else None
            total += size if copy is not None else 0
            out.append((owner, name, b, b._version, copy))
    return out


def _restore_buffers(state: list, model_name: str) -> None:
    """Put back the buffers a failed attempt changed (a batch norm's running statistics, a running
    normaliser's counts), so that its retry changes them once, as plain PyTorch's one call does:
    a buffer the attempt re-assigned (``self.n = self.n + k``) is bound to its old tensor again,
    one changed in place gets its old values back."""
    repeated = 0
    with torch.no_grad():
        for owner, name, b, version, copy in state:
            if owner._buffers.get(name) is not b:
                owner._buffers[name] = b  # re-assigned by the attempt (a review probe's finding)
            if copy is None:
                repeated += b._version != version
            elif not torch.equal(b, copy):
                # by value: batch norm's kernel updates its running statistics without bumping their
                # version; and a buffer left as it was is not written (a previous call's graph may
                # have saved it for its backward)
                b.copy_(copy)
    if repeated:
        log.warning("apt_model: %s's forward changed %d large buffer(s) before it raised under autocast; its "
                    "retry without autocast changes them again", model_name, repeated)


#: Forward classes of autograd Functions that are no custom code (the library's own, torch's).
_OWN_FUNCTIONS = ("torch.", "apt_model.")


def custom_functions(output: Any, inputs: Any = (), limit: int = 100_000) -> list[str]:
    """Names of the custom autograd Functions in the graph that produced ``output``'s tensors from
    ``inputs``' (the walk stops at the nodes that made the inputs: an upstream model's Functions
    are not this call's): a ``torch.autograd.Function`` defined outside torch and apt_model, or the
    backward of a custom op registered from Python (``torch.library.custom_op(...).register_autograd``),
    whose generated Function torch names ``GeneratedBackwardFor_<namespace>_<op>``. At most
    ``limit`` graph nodes are visited (once per model). Not seen: Functions inside a re-entrant
    ``torch.utils.checkpoint`` of the script's (its graph is built only in backward)."""
    found: list[str] = []
    todo = [t.grad_fn for t in output_tensors(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[int] = {id(t.grad_fn) for t in output_tensors(inputs)
                      if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        cls = getattr(node, "_forward_cls", None)
        if cls is not None:
            name = cls.__name__
            if name.startswith("GeneratedBackwardFor_") or not cls.__module__.startswith(_OWN_FUNCTIONS):
                name = name.replace("GeneratedBackwardFor_", "custom op ")
                if name not in found:
                    found.append(name)
        todo.extend(fn for fn, _ in getattr(node, "next_functions", ()))
    return found


class AutocastHooks:
    """Picklable pre/post forward hooks that run a module's forward under autocast.

    Args:
        device_type: torch device type (``cpu``, ``cuda``, ``npu``...).
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        trial: optional on-line trial deciding whether autocast stays on (timed by a
            :class:`~apt_model.devices.call_timer.CallTimer`).
        on_verdict: called as ``on_verdict(keep: bool, summary: dict)`` when the trial ends (on
            the thread that completed the deciding sample: the forward thread, or autograd's
            device thread).
        device: the model's device (with index) for the trial's timing events; defaults to
            ``device_type``'s current device.
        clock: the trial's clock (``mark/ready/wait/elapsed``, see
            :mod:`apt_model.devices.timing`); default :func:`~apt_model.devices.timing.clock_for`.
        max_lag: finished samples allowed to wait for their events before the hooks block on the
            oldest (>= 0).
        channel: where the trial's verdict is agreed between the ranks of a job (rank 0 decides:
            :mod:`apt_model.devices.rank_agreement`), or None.
        screen: with a trial, its first training call runs as written and the trial gives up if
            that call's graph holds a custom autograd Function (:meth:`_screen`).

    Attributes:
        active: whether autocast is applied to calls (False after a trial turned it off).
        calls: number of calls that ran under this autocast.
        counts: ``{"autocast": calls under this autocast, "evaluation": evaluation calls run as
            written in fp32, "script": calls whose precision the script managed (its own
            ``torch.autocast``, a framework's, or parameters it cast away from fp32), run as
            written}``, kept up to date (the model's report shows them: a frozen teacher called in
            eval mode under ``no_grad`` is reported bf16 yet all its calls run fp32; a model under
            Lightning's ``bf16-mixed`` was reported fp32).
        timer: the trial's :class:`~apt_model.devices.call_timer.CallTimer` (None without a trial).

    Raises:
        ValueError: ``max_lag`` negative.
    """

    def __init__(self, device_type: str, dtype: torch.dtype, trial: SpeedTrial | None = None,
                 on_verdict: Callable[[bool, dict], None] | None = None,
                 device: torch.device | str | None = None, clock: Any = None, max_lag: int = 2,
                 channel: Any = None, screen: bool = False):
        if max_lag < 0:
            raise ValueError(f"max_lag={max_lag} must be >= 0")
        self.device_type = device_type
        self.device = torch.device(device) if device is not None else torch.device(device_type)
        self.dtype = dtype
        self.on_verdict = on_verdict
        self.active = True
        self.counts = {"autocast": 0, "evaluation": 0, "script": 0, "transform": 0}
        #: the parameters' dtype when the script cast the model away from fp32 after adoption (its
        #: calls then run as written: autocast would compute an fp16 model in bf16, and return fp32)
        self.cast_by_script: torch.dtype | None = None
        # whether the latest training call outside backward ran under autocast: a recomputation
        # of it in backward (activation checkpointing) must run the same (a verdict may have come
        # in between: the recomputation would save tensors of other dtypes, a CheckpointError)
        self._last_use: bool | None = None
        self._script_calls = 0  # training calls in a row the script managed precision for
        # the trial's first training call runs as written and its graph is looked at for custom
        # autograd Functions (see _screen) before any call runs under autocast
        self._screened = not screen
        #: why autocast was turned off after a forward raised under it (None: it never did)
        self.failure: str | None = None
        self._max_lag = max_lag
        self.timer = (CallTimer(trial, self._verdict, self.device, clock, max_lag, channel=channel)
                      if trial is not None else None)
        self._init_runtime()
        watch_compilation()

    calls = property(lambda self: self.counts["autocast"])

    # the trial's figures, read by tests and benchmarks
    trial = property(lambda self: self.timer.trial if self.timer is not None else None)
    max_lag = property(lambda self: self._max_lag)
    clock = property(lambda self: self.timer.clock if self.timer is not None else None)
    clock_reason = property(lambda self: self.timer.clock_reason if self.timer is not None else None)

    def _init_runtime(self) -> None:
        # the autocast contexts the calls under way entered, per thread (left by the forward hook,
        # or after an interrupt by the next call / disable())
        self._scopes = ForwardScopes(on_abandon=self._abandon)
        # per thread: ``raised`` — the exception a call raised under this autocast (left by the
        # forward hook for the call wrapper to see); ``retrying`` — the wrapper's retry is running
        self._tls = threading.local()
        if self.timer is not None:
            self.timer.on_verdict = self._verdict

    def _abandon(self, sample) -> None:
        if self.timer is not None:
            self.timer.abandon()

    def unwind(self) -> int:
        """Leave every autocast context this thread's calls left entered (``disable()``)."""
        return self._scopes.unwind(live_only=False)

    def __getstate__(self):
        """A copy of the model (``copy.deepcopy`` for an EMA, ``torch.save(model)``) carries inert
        hooks: it runs as written, in fp32, like any copy of an adopted model (before 2026-11-26 it
        kept autocast, also after ``disable()`` and when loaded without the switch)."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("_scopes", "_tls")}
        state["on_verdict"] = None
        state["active"] = False
        state["timer"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_runtime()

    def _verdict(self, keep: bool, summary: dict) -> None:
        self.active = keep
        if self.failure is not None:
            summary = {**summary, "failed": self.failure}
        if self.on_verdict is not None:
            self.on_verdict(keep, summary)

    def pre(self, module: nn.Module, args: tuple) -> None:
        """The forward pre-hook (eagerly also under compilation: :func:`~apt_model.base.forward_scope.eagerly`)."""
        return eagerly(self._pre, module, args)

    def adopting_call(self, module: nn.Module, args: tuple) -> None:
        """The pre-hook's part for the call during which the model was adopted (PyTorch ran its
        pre-hooks before the hooks existed): that call runs as written, in fp32. Its forward is
        under way outside :meth:`the_call`, which could not run it again had it raised under
        autocast; autocast and its trial start at the next call."""
        return eagerly(self._adopting_call, module, args)

    def _adopting_call(self, module: nn.Module, args: tuple) -> None:
        self._as_written(module, in_backward())

    def _as_written(self, module: nn.Module, recomputing: bool) -> None:
        """This call runs as written, in fp32 (the adopting call, the call wrapper's retry)."""
        if torch.is_grad_enabled() and module.training and not recomputing:
            self._last_use = False  # its recomputation in backward (checkpointing) runs the same
        self._scopes.push(None)

    def post(self, module: nn.Module, args: tuple, output):
        """The forward hook, always called (eagerly also under compilation)."""
        return eagerly(self._post, module, args, output)

    def _pre(self, module: nn.Module, args: tuple) -> None:
        timer = self.timer
        self._scopes.unwind()  # calls an interrupt ended without the forward hook: their autocast is left
        recomputing = in_backward()
        if self._last_use is not None and recomputing and not torch.is_autocast_enabled(self.device_type):
            ctx = torch.autocast(self.device_type, dtype=self.dtype) if self._last_use else None
            if ctx is not None:
                ctx.__enter__()
            self._scopes.push(ctx, None)
            return None
        if getattr(self._tls, "retrying", False):  # the call wrapper's retry of a call that raised under autocast
            self._as_written(module, recomputing)
            return None
        if in_function_transform():
            # torch.func (vmap(grad(...)) per-sample gradients, DP-SGD): PyTorch's own bf16 autocast
            # fails in the transform's backward, where no retry can run (a probe's finding, at the
            # second step of a trial): such calls run as written, untimed, and a model called only
            # there gives its trial up
            self.counts["transform"] += 1
            if timer is not None:
                timer.untimed_call("called only inside torch.func transforms (per-sample gradients)")
            self._scopes.push(None)
            return None
        if not torch.is_grad_enabled() and not module.training:
            # evaluation and generation (a model in eval mode under no_grad / inference_mode) run as
            # written: the trial timed training calls only, and at decoding shapes (a token at a
            # time, a small batch) bf16 was 1.5-2x slower than fp32 where it had won the trial on
            # training calls (a probe's finding, 2026-11-28); their outputs are plain PyTorch's fp32
            # ones too. Not a model in train mode: a reentrant torch.utils.checkpoint around it runs
            # its forward under no_grad, and its recomputation in backward must run the same
            self.counts["evaluation"] += 1
            if timer is not None:
                timer.untimed_call()  # a model only ever evaluated gives its trial up (a frozen reference)
            self._scopes.push(None)
            return None
        training = torch.is_grad_enabled() and module.training and not recomputing
        cast = _cast_by_script(module) if self.active else None
        if cast is not None and cast != self.cast_by_script:
            self.cast_by_script = cast
            log.info("the model's parameters are %s now (cast after adoption): the script manages precision, "
                     "autocast is left off for its calls", str(cast).replace("torch.", ""))
        managed = (cast is not None or torch.is_autocast_enabled(self.device_type)
                   or (self.active and _framework_autocast(module)))
        if not self.active or managed:
            if managed:
                self.counts["script"] += 1
            if timer is not None:
                timer.settle()
                if training and self.active:
                    self._script_calls += 1
                    if self._script_calls >= SCRIPT_MANAGED_CALLS:
                        timer.give_up(f"the script managed precision in {self._script_calls} training calls in a "
                                      "row (its own torch.autocast, a framework's autocast around the model's "
                                      "forward such as accelerate's, or the model cast away from fp32)")
            if training:
                self._last_use = False
            self._scopes.push(None)  # off, or the caller manages precision: leave it alone
            return None
        use, sample = True, None
        self._script_calls = 0
        if timer is not None and training and timer.running:
            hooks = script_hooks(module, skip_torch=True, include_root=True)
            if hooks:
                # per-sample gradients built from captured activations and gradient outputs
                # (Opacus's way), feature taps: under autocast they saw bf16 tensors, and the
                # script's einsum of the two raised, or its p.grad = ... did (a probe's finding);
                # the model's own hooks too: a hook keeping the logits got bf16 (a review's finding)
                timer.give_up(f"the script's hooks on the model's layers ({', '.join(hooks)}) would see bf16 "
                              "activations and gradients under autocast")
        if timer is not None and training and timer.running and not self._screened:
            self._screened = True  # this call runs as written; its forward hook looks at its graph
            self._tls.screen = True
            self._last_use = False
            self._scopes.push(None)
            return None
        if timer is not None:
            variant, sample = timer.begin(module)
            if variant is not None:
                use = variant
            elif timer.running or not self.active:
                # a call the trial does not time (no grad in train mode: a target network, a
                # rollout) while it has no verdict runs as written: it ran under autocast before,
                # and a target network, never trained, got no verdict and ran bf16 for good, off
                # by bf16's rounding and slower (a probe's finding, 2026-11-29); so does the call
                # whose begin() just ended the trial without autocast
                use = False
        if training:
            self._last_use = use
        ctx = torch.autocast(self.device_type, dtype=self.dtype) if use else None
        if ctx is None and not torch.is_grad_enabled():
            self.counts["evaluation"] += 1  # a call without grad, as written
        if ctx is not None:
            if self.counts["autocast"] < EARLY_CALLS and not recomputing and not in_enclosing_checkpoint():
                # (inside the script's own checkpoint no retry can run: its error would be the watch's)
                ctx = _Watched(ctx, SparseWatch(self.dtype))
            ctx.__enter__()
            self.counts["autocast"] += 1
        self._scopes.push(ctx, sample)
        return None

    def _post(self, module: nn.Module, args: tuple, output):
        entry = self._scopes.pop()
        if getattr(self._tls, "screen", False):
            self._tls.screen = False
            self._screen(output, getattr(self._tls, "call_inputs", args))
            self._tls.call_inputs = None
        if entry is None:
            return None
        ctx, sample = entry
        if ctx is None and sample is None:
            return None
        if ctx is not None:
            ctx.__exit__(None, None, None)
            raised = sys.exc_info()[1]
            if raised is not None and output is None and not in_backward():
                # forward raised (torch runs this hook in its except clause); not a recomputation
                self._tls.raised = raised  # for the call wrapper (the_call), which runs the call again without autocast
                if sample is not None:
                    self.timer.abandon()
                return None
            output = to_fp32(output)
        if sample is not None:
            self.timer.end(module, output, sample)
        return output if ctx is not None else None

    def _screen(self, output, inputs=()) -> None:
        """The trial's first training call ran as written: if its graph holds a custom autograd
        Function (:func:`custom_functions`), whose backward no retry can cover and may take fp32
        only, the trial gives up and the model keeps the script's precision (a forward under the
        switch's bf16 made such a backward raise "expected Float" inside the script's
        ``loss.backward()``, where plain PyTorch trains: a probe's finding). Never raises."""
        try:
            found = custom_functions(output, inputs)
        except Exception as err:  # noqa: BLE001 - a look that fails leaves the trial as it is
            log.debug("autocast: looking for custom autograd Functions: %s", err)
            return
        if found and self.timer is not None:
            self.timer.give_up(f"its forward runs custom autograd Functions ({', '.join(found[:3])}), whose backward "
                               "may take fp32 only and cannot be run again; mixed_precision='bf16' forces bf16")

    def the_call(self, inner: Callable, model_ref: Callable[[], nn.Module | None] = lambda: None) -> Callable:
        """The model's call wrapped (:func:`~apt_model.base.call_wrapper.wrap_call`): a call that
        raised under this autocast runs again without it; if that succeeds, autocast is off for
        this model from then on (:meth:`_turn_off`), else the retry's error propagates. In the
        first :data:`EARLY_CALLS` calls the retry starts from the random state and the buffers of
        the model (``model_ref()``) the failed attempt started from (a batch norm's statistics, a
        running normaliser: updated twice before, a probe's finding)."""
        tls = self._tls

        def call(*args, **kwargs):
            if not self._screened:  # the screen stops at the call's inputs, keyword ones too (the hooks see no kwargs)
                tls.call_inputs = (args, kwargs)
            if not self.active or torch.compiler.is_compiling() or in_backward():
                # autocast is off for good (a verdict, a failure): nothing to run again; a
                # recomputation in backward (checkpointing) runs what its forward ran, and stops
                # early by raising: never run again
                return inner(*args, **kwargs)
            tls.raised = None
            # the early calls keep the random state: a retry draws what the first attempt drew
            # (dropout masks: without it the run's masks differed from plain PyTorch's from the
            # retried call on, a probe's finding)
            early = self.counts["autocast"] < EARLY_CALLS
            rng = _rng_state(self.device) if early else None
            buffers = _buffer_state(model_ref()) if early else []
            try:
                return inner(*args, **kwargs)
            except Exception as err:
                raised, tls.raised = getattr(tls, "raised", None), None
                if (raised is not err or isinstance(err, torch.OutOfMemoryError) or getattr(tls, "retrying", False)
                        or not self._about_dtypes(err)):
                    raise
                if in_enclosing_checkpoint():
                    # inside the script's non-reentrant torch.utils.checkpoint, the failed attempt's
                    # saved tensors stay counted: a retry there made its backward raise
                    # CheckpointError (a probe's finding); the error is the script's to see
                    raise
                tls.retrying = True
                if rng is not None:
                    _set_rng_state(self.device, rng)
                _restore_buffers(buffers, type(model_ref()).__name__)
                try:
                    out = inner(*args, **kwargs)
                except Exception as again:  # not autocast's: the error plain PyTorch raises, alone
                    raise again from None
                finally:
                    tls.retrying = False
                self._turn_off(err)
                return out

        return call

    def _about_dtypes(self, err: Exception) -> bool:
        """Whether ``err``'s message is about dtypes (names this autocast's dtype, fp32, a dtype or a
        scalar type): only such a call is run again. A shape or device error would raise again
        without autocast; running the forward twice would only repeat its side effects."""
        if isinstance(err, SparseOperandUnderAutocast):
            return True
        text = str(err).lower()
        names = DTYPE_WORDS.get(self.dtype, ()) + ("dtype", "scalar type", "scalartype", "float32", "fp32")
        return any(w in text for w in names)

    def _turn_off(self, err: Exception) -> None:
        if self.failure is not None:  # another thread's call got there first: said once
            return
        first = (str(err).strip().splitlines() or [""])[0][:200]
        self.failure = (f"the forward raised under {str(self.dtype).replace('torch.', '')} autocast "
                        f"({type(err).__name__}: {first}) and ran without it")
        log.warning("apt_model: %s; autocast stays off for this model", self.failure)
        timer = self.timer
        if timer is not None and timer.running:  # also while rank 0's verdict is awaited
            timer.give_up(self.failure)  # -> _verdict(False, summary with "failed")
        else:
            self._verdict(False, {"failed": self.failure})


def attach_autocast(model: nn.Module, device_type: str, dtype: torch.dtype, patches: PatchSet,
                    trial: SpeedTrial | None = None,
                    on_verdict: Callable[[bool, dict], None] | None = None,
                    device: torch.device | str | None = None, clock: Any = None, channel: Any = None,
                    screen: bool = False) -> AutocastHooks:
    """Run ``model``'s forward under autocast; the hooks are removed when ``patches`` is restored.

    Arguments as for :class:`AutocastHooks`; returns the attached hooks object.
    """
    hooks = AutocastHooks(device_type, dtype, trial, on_verdict, device=device, clock=clock, channel=channel,
                          screen=screen)
    patches.add_handle(model.register_forward_pre_hook(hooks.pre), f"autocast pre-hook {type(model).__name__}")
    patches.add_handle(model.register_forward_hook(hooks.post, always_call=True), f"autocast hook {type(model).__name__}")
    patches.set_attr(model, "_vb_autocast", hooks, label=f"autocast marker {type(model).__name__}")
    patches.add_undo(hooks.unwind, f"autocast contexts left entered {type(model).__name__}")
    model_ref = weakref.ref(model)  # the wrapper lives on the model: no strong reference back
    wrap_call(model, lambda inner: hooks.the_call(inner, model_ref), patches,
              f"autocast retry around the call of {type(model).__name__}")
    if hooks.timer is not None:
        patches.add_undo(hooks.timer.close, f"autocast trial's backward hooks {type(model).__name__}")
    return hooks
