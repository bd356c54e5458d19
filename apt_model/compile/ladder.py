"""The compile ladder of one model: compile → override → eager, each rung tried, timed, recorded.

States (per model; the policy is in this docstring, the transitions in :class:`CompileLadder`):

``waiting``
    Training calls run eagerly until the gate opens: the autocast trial (if any) has decided, so
    the two trials never time each other's variants. Evaluation calls never start a rung.
``warmup`` (rung *r*)
    The rung's callable is built (``torch.compile`` with the kind's compiler, or with the
    override backend) and the next :data:`WARMUP_CALLS` training calls run it untimed: that is
    where compilation happens (the forward graph at the first call, the backward graph at the
    first backward). Leaving the rung: building or running it raised (the exception text is
    recorded, the call is re-run eagerly, nothing is lost); the warm-up took longer than
    ``compile_warmup_budget`` seconds; the override rung found nothing to rewrite.
``trial`` (rung *r*)
    Training calls alternate the rung and eager in ABBA order and are timed forward+backward
    (:class:`~apt_model.devices.call_timer.CallTimer`, the autocast trial's mechanism: device
    events, no synchronize, nothing after the verdict). The rung is kept only if it is at least
    ``compile_min_speedup`` times faster with non-overlapping quartiles; otherwise the next rung
    starts. Recompilations are counted all along; more than ``compile_recompile_limit`` after the
    warm-up is a storm: the first storm recompiles the rung with ``dynamic=True`` (shapes
    symbolic, as ``torch._dynamo.mark_dynamic`` would make them), a second leaves the rung.
``done``
    The chosen rung's callable replaces the model's ``forward`` (eager: the instance attribute is
    removed, or the script's own instance ``forward`` put back); the ladder's hooks are removed,
    so a call costs nothing extra.

**Calls inside compiled code** (the script compiles a training step that calls the model, or
anything compiles or exports: ``torch.compiler.is_compiling()``) run the model's own forward and
neither start, advance nor time a rung: traced there, the ladder's hooks used to break the script's
graph (on ``time.perf_counter`` and on the rung's own ``torch.compile``) and compile a rung inside
the script's trace. A model called only there stays ``waiting`` until an optimizer step that runs
eagerly (outside compiled code) steps its parameters while the ladder has seen no training call
outside compiled code: then ``eager`` is concluded, with that reason (a step the script compiles
with its optimizer inside leaves it ``waiting``).

Every attempt is an entry of :attr:`CompileLadder.timeline` (rung, outcome, reason, warm-up
seconds, compilations, the trial's figures), reported per model. ``disable()`` restores the
model's own forward (parameters untouched: the optimizer keeps training the same tensors).
"""
from __future__ import annotations

import inspect
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from apt_model.base.log import get_logger
from apt_model.base.module_attrs import write_attr
from apt_model.base.module_hooks import script_hooks
from apt_model.base.patches import PatchSet
from apt_model.compile.hooks import hooks_inside_reason
from apt_model.compile.backends import CountingBackend, resolve_backend
from apt_model.compile.checked import CheckedBackend, CompileCheckError
from apt_model.compile.overrides import OverrideBackend
from apt_model.devices.call_timer import CallTimer
from apt_model.devices.rank_agreement import agreement_note, ranks_suffix
from apt_model.devices.trial import SpeedTrial

log = get_logger(__name__)


def profiler_enabled() -> bool:
    """Whether a ``torch.profiler`` / ``torch.autograd.profiler`` session is recording (a C call)."""
    return torch.autograd._profiler_enabled()


def _first_line(err: BaseException, limit: int) -> str:
    """The first line of ``err``'s message, at most ``limit`` characters ('' for an empty one)."""
    return (str(err).strip().splitlines() or [""])[0][:limit]


def graph_reuse_reason(kind: str, where: str) -> str:
    """Why no rung is used once the script called a backward with ``kind=True`` at ``where``
    (:mod:`apt_model.base.graph_reuse`)."""
    return (f"the script calls a backward with {kind}=True ({where}), which a compiled graph cannot take "
            "(AOTAutograd does not differentiate its backward again; fused attention has no second derivative)")


#: Untimed training calls a rung runs before its trial (compilation of forward and backward).
WARMUP_CALLS = 2


@dataclass(frozen=True)
class LadderPolicy:
    """How rungs are judged (the switch's settings; validated there).

    Attributes:
        trial_calls: timed calls of a rung's trial (multiple of 4).
        min_speedup: a kept rung is at least this many times faster than eager.
        warmup_budget_s: seconds a rung's warm-up may take.
        recompile_limit: recompilations after the warm-up that count as a storm.
    """

    trial_calls: int = 16
    min_speedup: float = 1.03
    warmup_budget_s: float = 900.0
    recompile_limit: int = 8


@dataclass
class Rung:
    """One rung: ``name`` (``compile`` / ``override``), what it runs (``label``), and how to build
    its callable from the eager forward (``build(eager, dynamic) -> (callable, counter)``; the
    counter has ``compiles`` and ``seconds``; for the override rung its ``backend`` is the
    :class:`~apt_model.compile.overrides.OverrideBackend`, with ``sites`` / ``rejected``)."""

    name: str
    label: str
    build: Callable[[Callable, bool], tuple[Callable, Any]]


def _isolation() -> dict:
    """``torch.compile``'s ``isolate_recompiles=True`` where this torch has it (2.13 does).

    A rung compiles the forward of the model's class, one code object for every instance, with a
    backend of its own: without isolation each model of a sweep added an entry to that code
    object's one set, so after ``recompile_limit`` (8) models the ladder captured nothing, and the
    script's own ``torch.compile`` of that class ran eagerly without a word, even after
    ``disable()`` (until 2026-11-28: a probe's finding). Isolated, each rung's compiled entries
    count against its own limit and leave the script's untouched (Dynamo's global
    ``accumulated_recompile_limit``, 256, still caps them all)."""
    try:
        params = inspect.signature(torch.compile).parameters
        return {"isolate_recompiles": True} if "isolate_recompiles" in params else {}
    except (TypeError, ValueError):
        return {}


_ISOLATED = _isolation()  # looked up once (the switch's torch.compile wrapper keeps the signature)


def compile_rung(compile_fn: Callable, backend: Any, label: str) -> Rung:
    """The compile rung: ``compile_fn(eager, backend=CountingBackend(CheckedBackend(backend)),
    dynamic=..., fullgraph=True)`` (the device contract's ``compile``), in a recompilation region
    of its own (:func:`_isolation`).

    The forward is compiled whole or not at all (``fullgraph=True``): where Dynamo would split it
    (a graph break), the rung fails at its first call, before any of the forward ran, and the call
    runs as written. In pieces, eager code between them that changed a tensor a compiled piece had
    saved for backward made the step's backward raise (MoCo's queue of keys: a probe's finding,
    2026-11-29), where no retry is possible. Whole, a graph that reads an input and then changes it
    in place is checked against the captured graph, forward and backward
    (:mod:`apt_model.compile.checked`): TorchInductor computed that one's gradients from the
    changed queue."""

    def build(eager, dynamic):
        counter = CountingBackend(CheckedBackend(resolve_backend(backend), getattr(backend, "__name__", str(backend))))
        return (compile_fn(eager, backend=counter, dynamic=True if dynamic else None, fullgraph=True, **_ISOLATED),
                counter)

    return Rung("compile", label, build)


def override_rung(overrides: dict[str, Callable]) -> Rung:
    """The override rung: ``torch.compile`` with an :class:`OverrideBackend` over ``overrides``, in
    a recompilation region of its own (:func:`_isolation`)."""

    def build(eager, dynamic):
        counter = CountingBackend(OverrideBackend(overrides))
        return torch.compile(eager, backend=counter, dynamic=True if dynamic else None, **_ISOLATED), counter

    return Rung("override", f"registered rewrites ({', '.join(overrides)}), run eagerly", build)


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


#: Torch files an eager op runs through when the model's own code calls it (``F.cross_entropy``,
#: a module's forward, a tensor method): an error raised there, below the model's own frame and
#: with no compiler frame between, is the model's.
_EAGER_OP_FILES = tuple(os.path.join(_TORCH_DIR, f) for f in (
    "nn" + os.sep, "functional.py", "_tensor.py", "overrides.py", "utils" + os.sep + "checkpoint.py",
    "autograd" + os.sep, "amp" + os.sep, "random.py", "serialization.py"))
_APT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _generated(name: str) -> bool:
    return name.startswith("<") or "torchinductor" in name


def raised_by_compiled_code(err: BaseException) -> bool:
    """Whether ``err``, raised by a rung's compiled call, is the compiler's (the rung failed: the
    call is re-run eagerly) rather than the model's own code's (re-raised as is: re-running would
    run the model's forward twice, its side effects too, and hide the script's error).

    The compiler's: a ``torch._dynamo.exc.TorchDynamoException`` (tracing and backend failures),
    or an error raised in generated code (Inductor's output files, FX's ``<eval_with_key>``
    modules) or in torch's own machinery (Dynamo, Inductor, AOTAutograd...). The model's: an error
    raised from its own files (Dynamo runs a ``raise`` in the traced code from the original
    frame), or from an eager torch op its code called with nothing but :data:`_EAGER_OP_FILES`
    (and apt_model's hooks) between — a bad target in ``F.cross_entropy``. Until 2026-11-26 only
    the innermost frame counted, so that one was taken for the compiler's and re-run eagerly."""
    stop = getattr(torch.utils.checkpoint, "_StopRecomputationError", None)
    if stop is not None and isinstance(err, stop):
        # torch's non-reentrant checkpoint ends a recomputation early by raising this through the
        # forward: not a failure (re-run eagerly, torch asserted "Unexpected state:
        # target_frame.early_stop is set": a probe's finding, a model inside a checkpointed block)
        return False
    if isinstance(err, CompileCheckError):  # the compile rung's check (compile/checked.py)
        return True
    exc_mod = getattr(getattr(torch, "_dynamo", None), "exc", None)
    base = getattr(exc_mod, "TorchDynamoException", None)
    if base is not None and isinstance(err, base):
        return True
    names = []
    tb = err.__traceback__
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    if not names:
        return True
    for i in range(len(names) - 1, -1, -1):  # the innermost frame of the model's own code
        name = names[i]
        if not (name.startswith(_TORCH_DIR) or _generated(name) or name.startswith(_APT_DIR)):
            return not all(d.startswith(_EAGER_OP_FILES) or d.startswith(_APT_DIR) for d in names[i + 1:])
    return True


class LadderForward:
    """The adopted model's ``forward`` while its ladder climbs: the ladder's dispatcher. A copy of
    the model (``copy.deepcopy``, pickling) gets a plain eager forward instead: the model's own
    (``previous``: the instance forward the script set, else the class's), not the compiled
    callables and the trial's state (until 2026-11-28 always the class's: a copy of a model with
    an instance forward ran another function: a probe's finding)."""

    def __init__(self, ladder: "CompileLadder | None", model: nn.Module, previous=None):
        self.ladder, self.model, self.previous = ladder, model, previous

    def _eager(self):
        """The model's own forward: the ladder's, or (a copy's) the previous instance forward or the class's."""
        if self.ladder is not None:
            return self.ladder.eager
        return self.previous if self.previous is not None else type(self.model).forward.__get__(self.model)

    @property
    def __signature__(self) -> inspect.Signature:
        """The model's own forward's: code that inspects ``model.forward`` sees its parameters, not
        ``(*args, **kwargs)`` (Hugging Face's Trainer then passed ``num_items_in_batch`` to a model
        whose forward does not take it, or dropped every input column as unused: a probe's
        finding, 2026-11-28)."""
        return inspect.signature(self._eager())

    def __call__(self, *args, **kwargs):
        if self.ladder is not None:
            return self.ladder._dispatch(*args, **kwargs)
        return self._eager()(*args, **kwargs)

    def _as_function(self) -> Callable:
        """The dispatcher as a function of the model, made once (``forward.__func__ is
        forward.__func__``, as for a bound method)."""
        made = self.__dict__.get("_function")
        if made is None:
            dispatcher = self

            def forward(model, *args, **kwargs):
                return dispatcher(*args, **kwargs)

            made = self.__dict__["_function"] = forward
        return made

    @property
    def __func__(self) -> Callable:
        """``forward(model, *args, **kwargs)``: the dispatcher as a function, for libraries that
        rebuild a model's forward as ``MethodType(model.forward.__func__, model)`` (accelerate's
        ``prepare`` with mixed precision and ``unwrap_model(keep_fp32_wrapper=False)``: the
        dispatcher object, bound, was handed the model as its first argument: a probe's finding)."""
        return self._as_function()

    @property
    def __code__(self):
        """The model's own forward's code object: ``torch.export`` reads ``model.forward.__code__``
        (``AttributeError`` once the dispatcher stayed after the verdict: a review probe's finding)."""
        return self._eager().__code__

    @property
    def __wrapped__(self) -> Callable:
        """The same function, where such a library looks for the function under wrappers
        (``inspect.signature`` stops at :attr:`__signature__` first)."""
        return self._as_function()

    def __getstate__(self):
        return {"ladder": None, "model": self.model, "previous": self.previous}

    def __setstate__(self, state):
        self.__dict__.update({"previous": None, **state})


class _WeakStepHook:
    """An optimizer-step post-hook that calls ``ladder._after_step`` while the ladder lives.

    The hooks of ladders that died with their model (dropped before the verdict) are removed when
    the next ladder is made (:func:`_remove_dead_step_hooks`): never from a finalizer or from the
    hook itself, which may run while ``optimizer.step()`` iterates over the hook dictionary."""

    def __init__(self, ladder):
        self.ref = weakref.ref(ladder)

    def __call__(self, opt, args, kwargs):
        ladder = self.ref()
        return None if ladder is None else ladder._after_step(opt, args, kwargs)


_step_hooks: list = []  # (_WeakStepHook, its handle) of every ladder made, until removed


def _remove_dead_step_hooks() -> None:
    """Remove the step hooks of ladders that are gone: each was called at every later optimizer
    step of the session (a sweep of 50 evaluated models left 50; a probe's finding)."""
    global _step_hooks
    alive = []
    for hook, handle in _step_hooks:
        ladder = hook.ref()
        if ladder is None or ladder._step_hook_spent:
            handle.remove()
        elif handle.id in (handle.hooks_dict_ref() or {}):
            alive.append((hook, handle))
    _step_hooks = alive


class CompileLadder:
    """Climbs the rungs for one model (see the module docstring).

    Args:
        model: the adopted model.
        rungs: the rungs to try, in order (eager is always the last resort, implicit).
        policy: the judging policy.
        device: the model's device (the trial's timing events).
        record: ``record(chosen, reason, details)`` — called at every verdict (the switch records
            it as the model's ``compile`` decision).
        gate: returns True once training calls may start a rung (the autocast trial is done).
        tag: the model's name in the timeline and logs.
        channel_for: ``channel_for(trial_name)`` gives the channel on which a rung's verdict is
            agreed between the ranks of a job (rank 0 decides: :mod:`apt_model.devices.rank_agreement`),
            or None (this process decides alone).
    """

    def __init__(self, model: nn.Module, rungs: list[Rung], policy: LadderPolicy, device: torch.device,
                 record: Callable[[str, str, dict], None], gate: Callable[[], bool] = lambda: True, tag: str = "model",
                 channel_for: Callable[[str], Any] | None = None):
        self.model_ref = model
        self.channel_for = channel_for
        self.rungs = list(rungs)
        self.policy = policy
        self.device = torch.device(device)
        self.record = record
        self.gate = gate
        self.tag = tag
        self.timeline: list[dict] = []
        self.state = "waiting"
        self._closed = False  # the switch was disabled: a dispatcher still called runs eager
        self._step_hook_spent = False  # its optimizer-step hook has done its job (removed later)
        self.index = 0  # the rung under way
        self.chosen: str | None = None
        self.eager = model.forward  # the model's own forward (bound), captured before ours replaces it
        self._fn: Callable | None = None
        self._counter: Any = None
        self._dynamic = False
        self._storms = 0
        self._warm_calls = 0
        self._warm_start = 0.0
        self._warm_seconds = 0.0
        self._baseline_compiles = 0
        self._timer: CallTimer | None = None
        self._tls = threading.local()
        self._handles: list = []
        self._patches: PatchSet | None = None
        self._uncompiled = False  # a training call ran outside compiled code
        self._step_hook = None  # the optimizer-step check for a model trained only in compiled code
        self._kept: dict | None = None  # the kept rung's timeline entry (its counts kept up to date)

    def __getstate__(self):
        """A copy of an adopted model (pickling, ``copy.deepcopy``) carries an inert ladder: its
        hooks do nothing and its forward is the eager one (compiled callables do not travel)."""
        return {"model_ref": self.model_ref, "state": "done", "chosen": "eager", "rungs": [], "index": 0,
                "timeline": list(self.timeline), "tag": self.tag, "_timer": None, "_fn": None, "_handles": [],
                "channel_for": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.__dict__.setdefault("_closed", False)
        self.__dict__.setdefault("_step_hook_spent", False)
        self.__dict__.setdefault("_step_hook", None)
        self._tls = threading.local()

    # ------------------------------------------------------------------ attach / detach
    def attach(self, patches: PatchSet) -> None:
        """Replace the model's forward by the ladder's dispatcher and add the trial's hooks; all
        undone by ``patches`` (the model's own forward comes back)."""
        model = self.model_ref
        self._patches = patches
        self._previous_forward = vars(model).get("forward")  # the script's own instance forward, if any
        self._dispatcher = LadderForward(self, model, self._previous_forward)
        write_attr(model, "forward", self._dispatcher)  # not through the class's own __setattr__
        # the undo stack holds the model and the ladder weakly: a model the script drops is freed
        # (these two undo actions held the ladder, and through it the model, until 2026-11-28: a
        # slow test, which CI does not run, failed at this session's start)
        model_ref, ladder_ref = weakref.ref(model), weakref.ref(self)

        def restore_forward():
            m, ladder = model_ref(), ladder_ref()
            if ladder is not None:
                # a wrapper the script put around the dispatcher since (accelerate's hook) keeps
                # calling it: from now on it runs the model's own forward, not a compiled one (it ran
                # the kept rung after disable() until 2026-11-28: a probe's finding)
                ladder._closed = True
            if m is not None and ladder is not None and vars(m).get("forward") is ladder._dispatcher:
                ladder._put_back_forward(m)  # else the script replaced it since (accelerate's wrapper): left

        def drop_timer():
            ladder = ladder_ref()
            if ladder is not None:
                ladder._drop_timer()

        patches.add_undo(restore_forward, f"compile ladder forward {self.tag}")
        pre = model.register_forward_pre_hook(self._pre)
        post = model.register_forward_hook(self._post, always_call=True)
        self._params = {id(p) for p in model.parameters()}
        # a global hook: it holds the ladder weakly, so a model the script drops is freed
        _remove_dead_step_hooks()
        hook = _WeakStepHook(self)
        self._step_hook = register_optimizer_step_post_hook(hook)
        _step_hooks.append((hook, self._step_hook))
        self._handles = [pre, post, self._step_hook]
        patches.add_handle(pre, f"compile ladder pre-hook {self.tag}")
        patches.add_handle(post, f"compile ladder hook {self.tag}")
        patches.add_handle(self._step_hook, f"compile ladder optimizer-step check {self.tag}")
        patches.add_undo(drop_timer, f"compile ladder trial's backward hooks {self.tag}")

    def _drop_timer(self) -> None:
        """Close the trial's timer (its hooks off the parameters, no verdict after) and let it go."""
        if self._timer is not None:
            self._timer.close()
        self._timer = None

    def _finish(self, chosen: str, fn: Callable | None) -> None:
        """Enter ``done``: the dispatcher runs the chosen callable from now on (eager: the model's own
        forward is put back), the hooks go."""
        self.state, self.chosen = "done", chosen
        model = self.model_ref
        self._final = fn
        if vars(model).get("forward") is not self._dispatcher:
            # the script replaced model.forward since the ladder attached (accelerate wraps it in its
            # autocast; its wrapper calls the dispatcher, which runs the chosen callable from now
            # on): replacing it again would drop the script's wrapper (until 2026-11-28 it did)
            pass
        elif fn is None:
            self._put_back_forward(model)
        # else the dispatcher stays, running the chosen callable: written in its place, a compiled
        # function (no __func__) was bound to the model a second time by accelerate's
        # unwrap_model(keep_fp32_wrapper=False) (TypeError: a probe's finding)
        for h in self._handles:
            h.remove()
        self._drop_timer()

    def _put_back_forward(self, model: nn.Module) -> None:
        """The forward the model had before the ladder: the script's own instance forward, or the
        class's (no instance attribute: not a wrapper, not a cost)."""
        if self._previous_forward is not None:
            write_attr(model, "forward", self._previous_forward)
        else:
            vars(model).pop("forward", None)

    # ------------------------------------------------------------------ the per-call path
    def _dispatch(self, *args, **kwargs):
        if torch.compiler.is_compiling() or torch.jit.is_tracing() or self._closed:
            # traced by the script's own compiled code or export, by torch.jit.trace (or ONNX's
            # exporter on it: "using FX to torch.jit.trace a dynamo-optimized function" with a rung
            # kept: a review probe's finding), or the switch was disabled: the model's forward
            return self.eager(*args, **kwargs)
        if self.state == "done":  # a rung kept (or a wrapper the script put around the dispatcher)
            final = getattr(self, "_final", None)
            if final is None or not (torch.is_grad_enabled() and self.model_ref.training):
                # evaluation and generation run as written: the trial timed training calls only, and
                # each grad mode, cache or decoding shape was a fresh compilation (28 s against
                # 0.13 s of plain decoding, up to Dynamo's recompile limit: a probe's finding)
                return self.eager(*args, **kwargs)
            try:
                return final(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - see below
                if not raised_by_compiled_code(err):
                    raise  # the model's own code raised: as without the switch
                failed = err
            # the compiled callable failed: this call runs as written. If it raises too, the input
            # was bad (a too-long sequence: eager's IndexError, not Dynamo's TorchRuntimeError from
            # the fake-tensor trace, which a script's `except IndexError` missed: a probe's finding)
            # and the rung stays; else the rung is given up
            out = self.eager(*args, **kwargs)
            self.give_up(f"a later training call raised {type(failed).__name__} in the compiled forward "
                         f"({_first_line(failed, 200)}) where the model's own forward runs")
            return out
        if getattr(self._tls, "use", False) and self._fn is not None:
            fn = self._fn
            try:
                return fn(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - the rung's failure is re-run eagerly; the script's is its own
                if not raised_by_compiled_code(err):
                    raise  # the model's own code raised (a check, a bad input): as without the switch
                self._leave(f"raised {type(err).__name__}: {_first_line(err, 300)}",
                            outcome="failed")
        return self.eager(*args, **kwargs)

    def _pre(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():  # see "Calls inside compiled code" in the module docstring
            return None
        self._tls.use, self._tls.sample = False, None
        if self._step_hook_spent and self._step_hook is not None:
            self._drop_step_hook()
        if self.state == "done":
            return None
        training = torch.is_grad_enabled() and module.training
        if training and not self._uncompiled:
            self._uncompiled = True
            self._drop_step_hook()
        if profiler_enabled():
            # under torch.profiler the ladder neither starts, warms up nor times a rung: the call
            # runs eagerly. A capture there freed code objects the profiler's stack tracer still
            # pointed at (key_averages() raised UnicodeDecodeError with with_stack=True), and the
            # profiler's own cost made the trial's timings meaningless (a probe's findings)
            return None
        if self.state == "waiting":
            if not training or not self.gate():
                return None
            self._start()
        if self.state == "warmup":
            if not training:
                return None
            if self._warm_calls >= WARMUP_CALLS:
                self._end_warmup()
            else:
                self._warm_calls += 1
                self._tls.use = True
                return None
        if self.state == "trial":
            self._check_storm()
        if self.state == "trial":
            variant, sample = self._timer.begin(module)
            self._tls.use = bool(variant) if variant is not None else False
            self._tls.sample = sample
        elif self.state == "warmup":  # a storm restarted the warm-up
            self._warm_calls += 1
            self._tls.use = True
        return None

    def first_call(self, module: nn.Module) -> None:
        """The call that adopted the model, already under way with the model's own forward when
        the ladder was attached (PyTorch does not run hooks added during a call): a training call
        outside compiled code, as :meth:`_pre` would have counted it. Without it, a model adopted
        at its first forward and trained one call per step was concluded ``eager`` at its first
        optimizer step as "trained only inside code the script compiles itself" (a probe's finding,
        2026-11-27): no rung was ever tried."""
        if torch.compiler.is_compiling() or self.state == "done":
            return
        if torch.is_grad_enabled() and module.training and not self._uncompiled:
            self._uncompiled = True
            self._drop_step_hook()

    def _post(self, module: nn.Module, args: tuple, output) -> None:
        sample = getattr(self._tls, "sample", None)
        timer = self._timer
        if sample is not None and timer is not None:
            self._tls.sample = None
            timer.end(module, output, sample)
        return None

    def _after_step(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """After an eager optimizer step: if it stepped this model's parameters while every training
        call so far ran inside the script's compiled code, conclude ``eager`` (the ladder can never
        run there). Does nothing while anything compiles."""
        if self._uncompiled or self.state != "waiting" or torch.compiler.is_compiling():
            return None
        if not any(id(p) in self._params and p.grad is not None for g in opt.param_groups for p in g["params"]):
            return None
        # Concluded, but the dispatcher and hooks stay (inert now): removing them would change what
        # the script's compiled code guards on and recompile it.
        self.state, self.chosen = "done", "eager"
        # not removed here: torch is iterating over the step hooks (with another ladder's hook
        # after this one: "OrderedDict mutated during iteration" at the first step of a script
        # that compiles two models itself, full mode: a probe's finding); removed at this model's
        # next call or when the next ladder is made (it does nothing meanwhile)
        self._step_hook_spent = True
        self.record("eager", f"no training call of the model itself ran before {type(opt).__name__}.step(): it is "
                    "trained only inside code the script compiles itself (left as it is, with no rung beneath it), or "
                    "through its parts called by the script (model.forward_features(x) rather than model(x)), which run "
                    "as written", self._details())
        return None

    def _drop_step_hook(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    # ------------------------------------------------------------------ the script's hooks
    def holds_submodule(self, module: nn.Module) -> bool:
        """Whether ``module`` is a submodule of this ladder's model now (not the model itself;
        looked up at each question: a submodule swapped in after attach counts)."""
        model = self.model_ref
        return module is not model and any(m is module for m in model.modules())

    def script_hook_added(self, description: str) -> None:
        """The script registered a hook compiled code would trace (:mod:`apt_model.compile.hooks`):
        :meth:`give_up`."""
        self.give_up(f"the script registered {description} inside the model, which compiled code would not run "
                     "as eager does (torch.compile traces hooks once and does not see hooks added later)")

    def graph_reused(self, kind: str, where: str) -> None:
        """The script called a backward with ``kind=True`` (``create_graph`` / ``retain_graph``,
        :mod:`apt_model.base.graph_reuse`), which a compiled graph (or the override rung's SDPA)
        cannot take: as :meth:`give_up`."""
        why = graph_reuse_reason(kind, where)
        if self.state == "waiting":
            self._skip_rungs(why)
        else:
            self.give_up(why)

    def give_up(self, why: str) -> None:
        """A rung warming up or on trial is given up, a kept rung's compiled forward is dropped, and
        the model runs as written from then on (``why`` recorded). Nothing changes for a ladder
        still waiting (its rung's start looks again) or already eager."""
        if self.state in ("warmup", "trial"):
            self._drop_timer()
            self._fn = None
            self._skip_rungs(why)
        elif self.state == "done" and self.chosen not in (None, "eager") and getattr(self, "_final", None) is not None:
            was, model = self.chosen, self.model_ref
            if vars(model).get("forward") is self._dispatcher:
                self._put_back_forward(model)
            self._final, self.chosen = None, "eager"
            self._entry(self.rungs[min(self.index, len(self.rungs) - 1)], "given up", why)
            log.warning("apt_model: compile ladder %s: the %s rung kept for this model is given up: %s; "
                        "it runs as written from now on", self.tag, was, why)
            self.record("eager", f"the model runs as written: the {was} rung was kept, then given up: {why}",
                        self._details())

    def _skip_rungs(self, why: str) -> None:
        """Every rung left is not applicable (``why``); eager is concluded."""
        for rung in self.rungs[self.index:]:
            self._entry(rung, "not applicable", why)
        self.index = len(self.rungs)
        self._finish("eager", None)
        self.record("eager", f"the model runs as written: {why}", self._details())

    # ------------------------------------------------------------------ transitions
    def _start(self) -> None:
        """Build the rung at :attr:`index` and begin its warm-up (or go to the next one) — none
        where the script's hooks sit inside the model (:func:`~apt_model.base.module_hooks.script_hooks`)."""
        hooked = script_hooks(self.model_ref)
        if hooked:
            return self._skip_rungs(hooks_inside_reason(hooked))
        while self.index < len(self.rungs):
            rung = self.rungs[self.index]
            try:
                self._fn, self._counter = rung.build(self.eager, self._dynamic)
            except Exception as err:  # noqa: BLE001 - recorded; the next rung is tried
                self._entry(rung, "failed", f"could not be built: {type(err).__name__}: {err}")
                self.index += 1
                continue
            self.state, self._warm_calls, self._warm_start = "warmup", 0, time.perf_counter()
            return
        self._conclude_eager()

    def _end_warmup(self) -> None:
        rung = self.rungs[self.index]
        self._warm_seconds = time.perf_counter() - self._warm_start
        if self._warm_seconds > self.policy.warmup_budget_s:
            return self._leave(f"warm-up took {self._warm_seconds:.1f} s, over the {self.policy.warmup_budget_s:g} s "
                               "budget (compile_warmup_budget)", outcome="too slow to warm up")
        override = getattr(self._counter, "backend", None)
        if rung.name == "override" and not getattr(override, "sites", None):
            rejected = "; ".join(getattr(override, "rejected", []) or [])
            return self._leave("no registered rewrite matched the captured graphs"
                               + (f" ({rejected})" if rejected else ""), outcome="not applicable")
        self._baseline_compiles = self._counter.compiles
        trial = SpeedTrial(self.policy.trial_calls, self.policy.min_speedup)
        channel = None
        if self.channel_for is not None:
            channel = self.channel_for(f"compile/{self.index}-{rung.name}/{'dynamic' if self._dynamic else 'static'}")
        self._timer = CallTimer(trial, self._verdict, self.device, channel=channel)
        self.state = "trial"

    def _check_storm(self) -> None:
        extra = self._counter.compiles - self._baseline_compiles
        if extra <= self.policy.recompile_limit:
            return
        self._storms += 1
        if self._storms == 1 and not self._dynamic:
            self._entry(self.rungs[self.index], "recompile storm",
                        f"{extra} recompilations after the warm-up (limit {self.policy.recompile_limit}): "
                        "compiled again with dynamic shapes (dynamic=True)")
            self._dynamic = True
            self._drop_timer()  # the trial starts again after a new warm-up, with a timer of its own
            self._start()
            return
        self._leave(f"{extra} recompilations after the warm-up (limit {self.policy.recompile_limit})"
                    + (" even with dynamic shapes" if self._dynamic else ""), outcome="recompile storm")

    def _verdict(self, keep: bool, summary: dict) -> None:
        """The trial's verdict (possibly on autograd's device thread). A closed timer gives none
        (:meth:`CallTimer.close`: the rung was left, or the switch disabled, meanwhile)."""
        rung = self.rungs[self.index]
        if summary.get("gave_up"):
            self._leave(f"the trial gave up: {summary['gave_up']}", outcome="not faster", trial=summary)
            return
        timing = (f"{rung.name} {summary['on_ms']} ms vs eager {summary['off_ms']} ms per forward+backward "
                  f"(median of {summary['calls'] // 2} calls each): {summary['speedup']:.2f}x")
        # a rank that followed rank 0's verdict says so; otherwise the trial's own words (and the ranks')
        followed = agreement_note(keep, summary, timing)
        if keep:
            reason = followed or f"{timing} >= {summary['min_speedup']:.2f}x, a clear win{ranks_suffix(summary)}"
            entry = self._kept = self._entry(rung, "kept", reason, trial=summary)
            if self._counter is not None and hasattr(self._counter, "after"):
                # weakly: Dynamo's cache keeps the backend, which must not keep the ladder (and its model)
                method = weakref.WeakMethod(self._kept_compiled)
                self._counter.after = lambda: (m := method()) is not None and m()
            self._finish(rung.name, self._fn)
            self.record(rung.name, f"{rung.label}: {entry['reason']}", self._details())
            return
        if followed is None:
            clear = summary["speedup"] >= summary["min_speedup"]
            followed = f"{timing}: " + ("no clear win (the timings overlap)" if clear
                                        else f"below {summary['min_speedup']:.2f}x") + ranks_suffix(summary)
            if summary.get("stopped_early"):
                followed += " (stopped while settling: clearly slower)"
        self._leave(followed, outcome="not faster", trial=summary)

    def _leave(self, reason: str, outcome: str, trial: dict | None = None) -> None:
        """The rung under way is left (``outcome``, ``reason``); the next one starts at the next
        training call, or eager is concluded."""
        rung = self.rungs[self.index]
        self._entry(rung, outcome, reason, trial=trial)
        self._drop_timer()  # a call timed before the rung was left may still await its backward
        self._fn, self._dynamic, self._storms = None, False, 0
        self.index += 1
        self.state = "waiting"
        if self.index >= len(self.rungs):
            self._conclude_eager()

    def _conclude_eager(self) -> None:
        tried = "; ".join(_tried(e) for e in self.timeline) or "no rung offered"
        self._finish("eager", None)
        self.record("eager", f"the model runs as written ({tried})", self._details())

    def _entry(self, rung: Rung, outcome: str, reason: str, trial: dict | None = None) -> dict:
        entry = {"rung": rung.name, "runs": rung.label, "outcome": outcome, "reason": reason,
                 "warmup_s": round(self._warm_seconds, 3) if self._warm_seconds else None,
                 "dynamic": self._dynamic}
        entry.update(self._compile_counts())
        if trial is not None:
            entry["trial"] = trial
        self.timeline.append(entry)
        log.info("compile ladder %s: %s %s: %s", self.tag, rung.name, outcome, reason)
        return entry

    def _compile_counts(self) -> dict:
        """The rung's compilations so far (``compiles``, ``compile_s``; ``rewrites``: each distinct
        rewrite once, with how many times it was made: recompilations repeat them)."""
        counter = self._counter
        out = {"compiles": getattr(counter, "compiles", None), "compile_s": round(getattr(counter, "seconds", 0.0), 3)}
        sites = getattr(getattr(counter, "backend", None), "sites", None)
        if sites:
            counts: dict[str, int] = {}
            for tag, site in sites:
                counts[f"{tag}: {site}"] = counts.get(f"{tag}: {site}", 0) + 1
            out["rewrites"] = [f"{n} x {text}" for text, n in counts.items()]
        return out

    def _details(self) -> dict:
        return {"timeline": list(self.timeline)}

    # ------------------------------------------------------------------ report
    def _kept_compiled(self) -> None:
        """The kept rung compiled again (a training call of a new shape after the verdict): its
        timeline entry, which the model's decision holds too, gets the counts (until 2026-11-29
        the report kept those of the verdict's moment)."""
        if self._kept is not None and getattr(self, "_final", None) is not None:
            self._kept.update(self._compile_counts())

    def describe(self) -> dict:
        """State, chosen rung and timeline (JSON-safe)."""
        return {"state": self.state, "chosen": self.chosen, "rung": self.rungs[self.index].name
                if self.index < len(self.rungs) and self.state != "done" else None, "timeline": list(self.timeline)}


def _tried(entry: dict) -> str:
    """One rung of the timeline for the eager verdict's reason: ``compile: failed (raised
    InductorError: ...)`` — a failure's own reason, shortened, so ``print_stats`` shows why."""
    text = f"{entry['rung']}: {entry['outcome']}"
    reason = (str(entry.get("reason") or "").splitlines() or [""])[0]
    if entry["outcome"] == "failed" and reason:
        text += f" ({reason if len(reason) <= 100 else reason[:99] + '…'})"
    return text
