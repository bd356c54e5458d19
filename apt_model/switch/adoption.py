"""Adopting a model: the ordered list of feature steps, run once per model — and why each chose.

A model is adopted once: when the script moves it (``model.to(...)``, ``model.cuda()``), when it
is first called, or by ``vb.adopt(model)``. Adoption never replaces parameters (an optimizer built
before or after keeps training the same tensors); it only attaches hooks, flips attention
implementations and swaps frozen layers, all undone by ``disable()``.

Every feature is one :class:`~apt_model.base.feature.FeatureStep` (decide, then apply), run in
the order of :data:`FEATURE_STEPS`. The order matters twice: FP4 runs before paging (it shrinks
frozen weights before the paging plan counts them), and distributed runs before paging (its
``paging_blocked`` fact turns paging off under data parallelism). Adding a feature = adding its
step class here and its settings entry (``docs/architecture.md``).
"""
from __future__ import annotations

import weakref
from collections import Counter

import torch
import torch.nn as nn

from apt_model.activations.step import CheckpointStep, OffloadStep
from apt_model.attention.step import AttentionStep
from apt_model.compile.step import CompileStep
from apt_model.base.errors import USER_ERRORS, VBError
from apt_model.base.feature import AdoptionContext, Decision, FeatureStep, ModelRecord, StepSession
from apt_model.base.log import get_logger
from apt_model.base.module_attrs import module_attr
from apt_model.devices.capabilities import Speed, Support, get_speed, get_support
from apt_model.distributed.step import DistributedStep
from apt_model.memory.paging.step import PagingStep
from apt_model.precision.step import PrecisionStep
from apt_model.precision.tf32 import TF32Step
from apt_model.quantization.step import FP4Step
from apt_model.switch.modes import FEATURES
from apt_model.switch.placement import PlacementStep
from apt_model.switch.report import DecisionLog

#: The feature steps, in the order adoption runs them (see the module docstring). The compile
#: ladder comes last: it reads the facts of the steps before it (a paged model, the switch's DDP,
#: the autocast trial it must wait for) and starts at the model's first training calls.
FEATURE_STEPS: tuple[type[FeatureStep], ...] = (
    PlacementStep, AttentionStep, PrecisionStep, TF32Step, CheckpointStep, OffloadStep, FP4Step, DistributedStep, PagingStep,
    CompileStep,
)

log = get_logger(__name__)

__all__ = ["Adopter", "FEATURE_STEPS", "builtin_overrides", "ModelRecord", "ProbeBook", "infer_width", "model_device"]


def builtin_overrides() -> dict:
    """The override rung's built-in rewrites (``tag -> fn(gm) -> sites``), handed to the compile
    step as ``services["overrides"]``; a device kind adds its own with
    ``AcceleratorBackend.register_override``."""
    from apt_model.attention.textbook import rewrite_textbook_attention

    return {"textbook_attention": rewrite_textbook_attention}


def infer_width(model: nn.Module) -> int | None:
    """The model's hidden size: the ``in_features`` / ``embedding_dim`` carrying the most weights.

    Sizes come from the modules' shape attributes, never from ``m.weight``: on a parametrized
    module (``spectral_norm``) reading the weight runs the parametrization, whose power iteration
    updates buffers — adoption would change the training."""
    weight: Counter = Counter()
    for m in model.modules():
        if isinstance(m, nn.Linear):
            width, other = module_attr(m, "in_features"), module_attr(m, "out_features")
        elif isinstance(m, nn.Embedding):
            width, other = module_attr(m, "embedding_dim"), module_attr(m, "num_embeddings")
        else:
            continue
        # a subclass that skipped its base's __init__ lacks them: a model plain PyTorch trains,
        # which crashed adoption until 2026-11-28 (a probe's finding)
        if isinstance(width, int) and isinstance(other, int):
            weight[width] += width * other
    return weight.most_common(1)[0][0] if weight else None


def model_device(model: nn.Module) -> torch.device | None:
    """Device of the model's first parameter (or buffer); None for a model with neither."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return None


def _model_name(model: nn.Module) -> str:
    """The report's name of ``model``: its class, seen through ``torch.compile(model)``'s wrapper
    (``OptimizedModule(TinyLM)``: the name the script knows is ``TinyLM``) and through
    ``DistributedDataParallel`` / ``DataParallel`` (``GPT (DistributedDataParallel)``)."""
    inner = module_attr(model, "_orig_mod")  # not getattr: the script's __getattr__ may raise anything
    if isinstance(inner, nn.Module):
        return f"{type(inner).__name__} (compiled)"
    inner = module_attr(model, "module")
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)) and isinstance(inner, nn.Module):
        return f"{type(inner).__name__} ({type(model).__name__})"  # the script's DDP(model): GPT, not the wrapper
    return type(model).__name__


class ProbeBook:
    """The device probes adoption uses, run when a model is adopted and kept for the report.

    Support (what runs) is probed only when attention or mixed precision is requested; speed
    (what is faster, at the model's width) only when one of them is ``auto`` or precision is
    forced — as before any step asks. ``supports`` / ``speeds`` are the report's dicts.
    """

    def __init__(self, config):
        self.config = config
        self.supports: dict[str, dict] = {}
        self.speeds: dict[str, dict] = {}
        self._got: dict[tuple, object] = {}  # (device[, width]) -> the probe object, asked once

    def _needed(self) -> bool:
        return self.config.attention != "off" or self.config.mixed_precision != "off"

    def support(self, dev: torch.device) -> Support | None:
        if not self._needed():
            return None
        key = (str(dev),)
        if key not in self._got:
            sup = self._got[key] = get_support(dev)
            self.supports[sup.device] = sup.to_dict()
        return self._got[key]

    def speed(self, dev: torch.device, width: int | None) -> Speed | None:
        cfg = self.config
        if not self._needed() or not (cfg.attention == "auto" or cfg.mixed_precision in ("auto", "bf16", "fp16")):
            return None
        key = (str(dev), width)
        if key not in self._got:
            dtypes = ("bfloat16",) if cfg.mixed_precision != "fp16" else ("bfloat16", "float16")
            sp = self._got[key] = get_speed(dev, width, dtypes)
            self.speeds[f"{sp.device}/w{sp.width}"] = sp.to_dict()
        return self._got[key]

    def seconds(self) -> float:
        """Seconds spent probing (support and speed) in this session."""
        return sum(s.get("seconds", 0) for s in self.supports.values()) + sum(s.get("seconds", 0) for s in self.speeds.values())


class Adopter:
    """Runs the feature steps on each adopted model, recording every decision in a :class:`DecisionLog`.

    Args:
        session: the :class:`~apt_model.base.feature.StepSession` the steps are built with.
        log: the switch's decision timeline.
        steps: the step classes, in order (default :data:`FEATURE_STEPS`).
    """

    def __init__(self, session: StepSession, log: DecisionLog, steps: tuple[type[FeatureStep], ...] | None = None):
        self.session = session
        self.config = session.config
        self.log = log
        self.probes = ProbeBook(session.config)
        self.steps: list[FeatureStep] = [cls(session) for cls in (FEATURE_STEPS if steps is None else steps)]
        self.records: list[ModelRecord] = []
        #: feature -> "<model> (<error>)": a step whose apply failed, off for the rest of the session
        self.failed: dict[str, str] = {}

    def step(self, name: str) -> FeatureStep | None:
        """The step for feature ``name``, or None."""
        return next((s for s in self.steps if s.name == name), None)

    def adopt(self, model: nn.Module, trigger: str, moved_note: str = "") -> tuple[ModelRecord, AdoptionContext]:
        """Run every step on ``model`` (decide, then apply what acts) and return its record and the
        adoption context (whose ``take_first_call_hooks()`` the caller runs when adoption happened
        inside the model's first forward). ``trigger`` says what caused adoption (``to()``, ``compile()``,
        ``compiled function``, ``first forward``, ``adopt()``)."""
        dev = model_device(model) or torch.device("cpu")
        rec = ModelRecord(id=len(self.records) + 1, name=_model_name(model), trigger=trigger, device=str(dev),
                          parameters=sum(p.numel() for p in model.parameters()), width=infer_width(model),
                          ref=weakref.ref(model))
        self.records.append(rec)
        ctx = AdoptionContext(self.session, rec, dev, trigger, self.record, self.probes, moved_note)
        ctx.support(), ctx.speed()  # probed up front (not at a step's first need): adoption's cost stays in one place
        for step in self.steps:
            failed = self.failed.get(step.name)
            if failed is not None:  # its apply failed on an earlier model: off for the session
                self.record(rec, Decision(step.name, getattr(ctx.config, step.name, None), "off",
                                          f"off for the rest of the session: applying it to {failed} failed",
                                          details={"error": failed}))
                continue
            mark, hooks, applying = self.session.patches.mark(), ctx.first_call_mark(), False
            try:
                decision = step.decide(model, ctx)
                if decision.act:
                    applying = True
                    decision = step.apply(model, ctx, self.session.patches, decision)
            except USER_ERRORS as err:  # refused (a budget too small for the plan): the record says so too
                self.record(rec, Decision(step.name, getattr(ctx.config, step.name, None), "refused",
                                          f"{type(err).__name__}: {err}"))
                raise
            except VBError:  # the switch's own refusals (paging under DDP, swap errors) reach the script
                raise
            except Exception as err:  # noqa: BLE001 - a defect, or a model the step did not foresee
                if applying and not step.contain_apply_errors:
                    raise
                decision = self._contain(step, rec, ctx, err, mark, hooks, applying)
            self.record(rec, decision)
            ctx.facts.update(decision.facts)
        self._not_built(rec)
        return rec, ctx

    def _contain(self, step: FeatureStep, rec: ModelRecord, ctx: AdoptionContext, err: Exception, mark: int,
                 hooks: int, applying: bool) -> Decision:
        """A step raised something unforeseen (a bug of the switch, or a model it did not foresee:
        a ``__getattr__`` that raises ``KeyError``): what it did so far is undone (the undo stack
        back to ``mark``, its first-call hooks dropped), the feature is off for this model with the
        error as the reason, and a warning with the traceback is logged. An error of ``apply``
        also turns the feature off for the rest of the session: session-wide objects the step made
        for it (an activation offloader, the compile step's hook watch) were closed by the undo and
        would be handed to the next model (a review probe's finding). Until 2026-11-28 the error
        reached the script, so enabling the switch made a working script crash in its model's
        first call (a probe's finding).

        Raises:
            Exception: a critical undo action failed (it names what it could not bring back).
        """
        what = f"{type(err).__name__}: {err}"
        scope = "the rest of the session" if applying else "this model"
        log.warning("%s: the %s step failed on %s (%s) while %s it; the feature is off for %s. A model built "
                    "in a way the switch did not foresee, or a defect of the switch: please report it with "
                    "this traceback", rec.scope, step.name, rec.name, what, "applying" if applying else "deciding",
                    scope, exc_info=err)
        ctx.drop_first_call_hooks(hooks)
        failures = self.session.patches.restore_since(mark)
        if applying:
            self.failed[step.name] = f"{rec.name} ({what})"
        reason = f"failed, so off for {scope}: {what} (the log has the traceback)"
        if failures:
            reason += f"; undoing what it had done failed too: {'; '.join(failures)}"
        return Decision(step.name, getattr(ctx.config, step.name, None), "off", reason, details={"error": what})

    def record(self, rec: ModelRecord, decision: Decision) -> None:
        """Put ``decision`` in the model's record and the timeline."""
        rec.features[decision.feature] = {"requested": decision.requested, "chosen": decision.chosen,
                                          "reason": decision.reason, **decision.details}
        self.log.record(rec.scope, decision.feature, decision.requested, decision.chosen, decision.reason,
                        list(decision.tried) or None)

    def stats(self) -> dict:
        """The steps' counters merged (``autocast_calls``...)."""
        out: dict = {}
        for step in self.steps:
            out.update(step.stats())
        return out

    def _not_built(self, rec: ModelRecord) -> None:
        for name, spec in FEATURES.items():
            if spec.built:
                continue
            value = self.config.features[name]
            if value in (False, "off"):
                continue
            rec.features[name] = {"requested": value, "chosen": "off", "reason": "not built in this version"}
