"""The switch's compile step: the ladder (compile → override → eager) per adopted model.

Decision (per adopted model), ``compile`` = ``auto`` (performance, full), ``override`` (balanced,
memory) or ``off``:

* ``off``: the model runs as written;
* the model is paged (an earlier step's fact ``paged``): eager — the page-fault handler is a
  ``TorchFunctionMode`` that runs Python on every op and the paging hooks move storage, neither of
  which a captured graph can follow;
* the switch attaches DDP at the first training forward (fact ``ddp``): eager — compiling the
  switch's in-place DDP is not supported in this version;
* the script compiles the model, or modules in it, itself (``model.compile()``, which sets a
  module's compiled call, or the ``OptimizedModule`` of ``torch.compile(model)``): eager — the
  ladder would compile or capture above or beneath the script's own compiled calls and time its
  trial through them; the script's compilation stays what runs;
* the model was adopted as one a compiled function reaches (trigger ``compiled function``,
  ``torch.compile(fn)``): eager, for the same reason;
* otherwise the rungs this device kind offers, in order: ``compile`` (only with ``auto``; the
  kind's compiler from the device contract, e.g. TorchInductor, needing a C++ compiler on the
  CPU), ``override`` (the registered rewrites: hand-written attention → SDPA, plus the kind's
  own), then eager. The ladder (:mod:`apt_model.compile.ladder`) starts at the first training call
  after the autocast trial has decided, and records every rung tried in the model's timeline
  (``vb.get_report()["models"][i]["timeline"]``).
"""
from __future__ import annotations

import io
import re
import sys
import textwrap
import tokenize
import weakref

import torch
import torch.nn as nn

from apt_model.base.call_wrapper import script_call
from apt_model.base import graph_reuse
from apt_model.base.feature import AdoptionContext, Decision, FeatureStep, StepSession
from apt_model.base.patches import PatchSet
from apt_model.compile.backends import compiler_for
from apt_model.compile.hooks import HookWatch
from apt_model.compile.ladder import CompileLadder, LadderPolicy, compile_rung, graph_reuse_reason, override_rung


def softmax_callers(model: nn.Module) -> list[str]:
    """Classes of ``model``'s modules whose ``forward`` source names ``softmax`` (not ``log_softmax``:
    :data:`_SOFTMAX`): where a
    hand-written attention (the built-in override) can be. A cheap screen before any capture, so
    models without one never pay for the override rung. Not candidates: a class whose source
    cannot be read (built in C, generated), torch.nn's own, and classes with an SDPA
    implementation of their own (``supported_attn_implementations`` with ``"sdpa"``, Hugging Face
    ``_supports_sdpa``), which the attention step routes."""
    import inspect

    found = []
    for cls in {type(m) for m in model.modules()}:
        forward = getattr(cls, "forward", None)
        if forward is None or cls.__module__.startswith("torch.nn"):
            continue
        if "sdpa" in getattr(cls, "supported_attn_implementations", ()):
            continue  # it has an SDPA implementation of its own: the attention step chooses it
        if getattr(cls, "_supports_sdpa", False) is True:
            continue  # a Hugging Face model with SDPA attention: the attention step routes it
        try:
            source = inspect.getsource(forward)
        except (OSError, TypeError):
            continue
        if any(_SOFTMAX.search(name) for name in _names(source)):
            found.append(cls.__name__)
    return sorted(found)


def _names(source: str) -> list[str]:
    """The names in ``source`` (Python tokens: no comment, docstring or string: "the softmax" in a
    comment made a ``log_softmax`` classifier a candidate again: a review probe's finding); the
    source's words where it does not tokenize."""
    try:
        return [t.string for t in tokenize.generate_tokens(io.StringIO(textwrap.dedent(source)).readline)
                if t.type == tokenize.NAME]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return source.split()


#: ``softmax`` in any case, also inside a name (``F.softmax``, ``nn.Softmax``, ``masked_softmax``,
#: ``self.attn_softmax``), but not ``log_softmax`` / ``LogSoftmax``: a CTC or NLL classifier calls
#: that, and balanced mode captured every one of them for a rewrite that never applies (seconds of
#: capture, Dynamo's warnings, the forward fast path off for the session: a probe's finding).
_SOFTMAX = re.compile(r"(?<!log_)(?<!log)softmax", re.IGNORECASE)


def profiled_callers(model: nn.Module) -> list[str]:
    """Classes of ``model``'s modules whose ``forward`` names ``record_function`` (a profiler range
    the script marks): TorchDynamo drops it from a captured graph ("Profiler record function ...
    will be ignored"), so such a model's ranges vanished from the script's profiles once a rung
    captured it (until 2026-11-28: a probe's finding). Read from the code object's names: no
    source is read."""
    found = []
    for cls in {type(m) for m in model.modules()}:
        code = getattr(getattr(cls, "forward", None), "__code__", None)
        if code is not None and "record_function" in code.co_names:
            found.append(cls.__name__)
    return sorted(found)


def compiled_by_script(model: nn.Module) -> bool:
    """Whether ``model`` is compiled by the script: ``model.compile()`` was called (the module's
    ``_compiled_call_impl`` is set) or it is the ``OptimizedModule`` ``torch.compile(model)`` returns."""
    if script_call(model) is not None:  # not the switch's own call wrapper (base/call_wrapper.py)
        return True
    # looked up, never imported: a model adopted on one thread while another builds its first
    # optimizer (which imports Dynamo) made the two imports race, and one thread's raised
    # ImportError ("partially initialized module 'torch._dynamo.eval_frame'": a probe's finding,
    # 2026-11-29). Without Dynamo imported there is no OptimizedModule to be.
    frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(frame, "OptimizedModule", None)
    return optimized is not None and isinstance(model, optimized)


class CompileStep(FeatureStep):
    """Feature ``compile``; see the module docstring. ``session.services["overrides"]`` holds the
    built-in override rewrites (``tag -> fn``), wired by the switch."""

    name = "compile"

    def __init__(self, session: StepSession):
        super().__init__(session)
        # weakly: a ladder lives as long as its model (which holds it through its forward and
        # hooks), so a model the script drops is freed, and its ladder leaves the report
        self.ladders: list[weakref.ref] = []
        self.hook_watch: HookWatch | None = None  # installed with the first ladder (compile/hooks.py)

    def decide(self, model: nn.Module, ctx: AdoptionContext) -> Decision:
        req = ctx.config.compile
        if req == "off":
            return Decision(self.name, req, "eager", "compile=off")
        if ctx.facts.get("paged"):
            return Decision(self.name, req, "eager", "the model is paged: the page-fault handler (a TorchFunctionMode "
                            "running Python on every op) and the paging hooks cannot be captured in a graph")
        if ctx.facts.get("ddp"):
            return Decision(self.name, req, "eager", "a multi-rank job: the model is wrapped in DDP at its first "
                            "training forward (by the switch, or by the script's own DistributedDataParallel); the "
                            "ladder does not compile a model under DDP in this version")
        reuse = self.session.services.get("graph_reuse")
        if reuse is not None and reuse.seen:
            return Decision(self.name, req, "eager", graph_reuse_reason(*next(iter(reuse.seen.items()))))
        if torch.are_deterministic_algorithms_enabled():
            return Decision(self.name, req, "eager", "torch.use_deterministic_algorithms(True) is on: a rung is kept "
                            "by a timed trial, so runs of the script could compute differently (compiled or eager)")
        # the script's hooks inside the model are looked at when a rung would start, not now: a
        # summary tool (torchinfo) calls the model first with hooks on every module and removes
        # them; decided here, the model stayed eager for good with a reason no longer true (until
        # 2026-11-28: a probe's finding)
        profiled = profiled_callers(model)
        if profiled:
            return Decision(self.name, req, "eager", f"{', '.join(profiled[:3])} mark profiler ranges in forward "
                            "(record_function), which a captured graph drops: the model runs as written, so the "
                            "script's profiles keep them")
        if ctx.trigger == "compiled function":
            return Decision(self.name, req, "eager", "the script calls this model from a function it compiles itself "
                            "(torch.compile(fn)): the compiled function is left as it is, with no rung beneath it")
        if any(compiled_by_script(m) for m in model.modules()):
            return Decision(self.name, req, "eager", "the script compiles this model (or modules in it) itself "
                            "(model.compile() or torch.compile(model)): its compiled calls are left as they are, "
                            "with no rung above or beneath them")
        backend, why, kind = compiler_for(ctx.device)
        overrides = dict(self.session.services.get("overrides", {}))
        if kind is not None:
            overrides.update(kind.overrides())
        rungs, tried = [], []
        if req == "auto":
            if backend is not None:
                tag = ctx.record.scope
                rungs.append(compile_rung(lambda fn, **options: kind.compile(fn, tag, **options), backend,
                                          f"torch.compile with {why}"))
                tried.append(f"compile: {why}")
            else:
                tried.append(f"compile: not offered ({why})")
        if overrides:
            calls = softmax_callers(model)
            if calls:
                rungs.append(override_rung(overrides))
                tried.append(f"override: {', '.join(overrides)} (softmax called in {', '.join(calls[:3])})")
            else:
                tried.append("override: no module's forward calls softmax, so no registered rewrite can apply")
        if not rungs:
            return Decision(self.name, req, "eager", "no rung offered on this device: " + "; ".join(tried), tried)
        names = " → ".join([r.name for r in rungs] + ["eager"])
        # watched from now on (apt_model/base/graph_reuse.py): the gate counts the script's backward
        # calls from here; nothing is watched in a session that offers no rung
        graph_reuse.watch_for(self.session.services, self.session.patches)
        return Decision(self.name, req, "on trial",
                        f"ladder {names}: each rung warms up (compiles) at the first training calls after the autocast "
                        "trial, then is kept only if an A/B trial against eager shows it faster", tried,
                        act=True, plan=rungs)

    def apply(self, model: nn.Module, ctx: AdoptionContext, patches: PatchSet, decision: Decision) -> Decision:
        cfg = ctx.config
        policy = LadderPolicy(cfg.compile_trial_calls, cfg.compile_min_speedup, cfg.compile_warmup_budget,
                              cfg.compile_recompile_limit)
        autocast_trial = ctx.facts.get("autocast_trial")

        reuse = graph_reuse.watch_for(self.session.services, self.session.patches)
        class_file = graph_reuse.source_file(type(model))

        def gate() -> bool:
            # after the autocast trial, and once the script's first backward calls showed no graph
            # differentiated twice and its source (the files on the stack now, the model's class
            # file) names no such call (apt_model/base/graph_reuse.py)
            if (autocast_trial is not None and autocast_trial.running) or not reuse.ready:
                return False
            reuse.scan_source((class_file,))
            return reuse.ready

        def record(chosen: str, reason: str, details: dict) -> None:
            ctx.record_later(Decision(self.name, decision.requested, chosen, reason, details=details))

        agreement = ctx.session.services.get("agreement")
        model_ref = weakref.ref(model)  # the ladder lives on the model: no strong reference back
        channel_for = ((lambda trial: agreement.channel(model_ref(), trial) if model_ref() is not None else None)
                       if agreement is not None else None)
        ladder = CompileLadder(model, decision.plan, policy, ctx.device, record, gate, tag=ctx.record.scope,
                               channel_for=channel_for)
        ladder.attach(patches)
        reuse.subscribe(ladder.graph_reused)
        if self.hook_watch is None:  # a hook the script registers later sends the model back to eager
            self.hook_watch = HookWatch(patches)
        self.hook_watch.watch(ladder)
        ctx.on_first_call(lambda module, args, kwargs: ladder.first_call(module))
        self.ladders = [r for r in self.ladders if r() is not None] + [weakref.ref(ladder)]
        return decision.amend(details={"timeline": ladder.timeline})

    def report(self) -> dict:
        return {"ladders": [ladder.describe() for ref in self.ladders if (ladder := ref()) is not None]}
