"""The feature-step protocol: the one shape every switch feature has.

Adopting a model runs an ordered list of :class:`FeatureStep` objects (the list is
``apt_model.switch.adoption.FEATURE_STEPS``: placement, attention, precision, activation
checkpointing, activation offload, FP4, distributed, paging). For each step the adopter calls

1. ``decision = step.decide(model, ctx)`` — look at the model and the device's probes and say
   what to do and why, changing nothing. The :class:`Decision` is a frozen value: the feature,
   what was requested, what was chosen, the reason, the evidence tried, and whether
   :meth:`~FeatureStep.apply` should run (``act``);
2. ``decision = step.apply(model, ctx, patches, decision)`` — only when ``decision.act``: make the
   change, registering every undo action in ``patches`` (the switch's
   :class:`~apt_model.base.patches.PatchSet`), and return the decision, amended with what applying
   found (e.g. the sites routed);
3. records the decision in the model's :class:`ModelRecord` and the switch's timeline, and
   copies ``decision.facts`` into ``ctx.facts`` so later steps can read them (the distributed
   step's ``paging_blocked`` is how data parallelism turns paging off: data, not a return value).

A step may record a later decision about its feature (the autocast trial's verdict, the
checkpoint budget measured at the first training forward) with :meth:`AdoptionContext.record`.
Session-wide objects a step keeps (the paging session, the activation offloaders) live on the
step; what the report shows of them comes from :meth:`FeatureStep.report` and
:meth:`FeatureStep.stats`. Adding a feature is adding one step class to the list and its
settings entry (``docs/architecture.md`` walks through a toy step).

This module imports nothing from the rest of apt_model: every feature package implements it by
importing downward.
"""
from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from apt_model.base.patches import PatchSet


@dataclass
class ModelRecord:
    """What adoption did to one model. ``features[name]`` is ``{"requested", "chosen", "reason", ...}``
    (plus a step's ``details``)."""

    id: int
    name: str
    trigger: str
    device: str
    parameters: int
    width: int | None
    features: dict = field(default_factory=dict)
    ref: weakref.ref | None = field(default=None, repr=False)

    @property
    def scope(self) -> str:
        """The name the timeline uses for this model: ``model:<class>#<id>``."""
        return f"model:{self.name}#{self.id}"

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "name": self.name,
            "trigger": self.trigger,
            "device": self.device,
            "parameters": self.parameters,
            "width": self.width,
            "alive": self.ref is not None and self.ref() is not None,
            "features": self.features,
            # the compile ladder's rungs tried, each with its outcome and reason
            "timeline": list(self.features.get("compile", {}).get("timeline", [])),
        }


@dataclass(frozen=True)
class Decision:
    """What one step decided for one model.

    Attributes:
        feature: the feature's name in the report (``attention``, ``paging``...).
        requested: the configured value (the mode's request or the user's override).
        chosen: what was chosen (``"sdpa"``, ``"fp32"``, ``"off"``...), JSON-safe.
        reason: one sentence with the numbers behind the choice.
        tried: the evidence, one line each (probe timings, backends that run...).
        act: whether :meth:`FeatureStep.apply` runs for this decision.
        plan: what ``apply`` needs (not reported).
        details: extra JSON-safe entries for ``record.features[feature]`` (a plan, layer lists).
        facts: values later steps read from ``ctx.facts`` (e.g. ``paging_blocked``).

    Raises:
        ValueError: an empty feature name or reason (every decision says why).
    """

    feature: str
    requested: Any
    chosen: Any
    reason: str
    tried: tuple = ()
    act: bool = False
    plan: Any = field(default=None, compare=False, repr=False)
    details: Mapping = field(default_factory=dict)
    facts: Mapping = field(default_factory=dict)

    def __post_init__(self):
        if not self.feature or not isinstance(self.feature, str):
            raise ValueError(f"Decision.feature={self.feature!r} must be a non-empty feature name")
        if not self.reason or not isinstance(self.reason, str):
            raise ValueError(f"Decision for {self.feature!r} has reason={self.reason!r}: every decision says why")
        object.__setattr__(self, "tried", tuple(self.tried or ()))

    def amend(self, **changes) -> "Decision":
        """A copy with ``changes`` (``reason=``, ``chosen=``, ``details=``...)."""
        return dataclasses.replace(self, **changes)


@dataclass
class StepSession:
    """What every step sees for the whole switch session (one per ``enable()``).

    Attributes:
        config: the switch's resolved ``VBConfig`` (features and settings by attribute).
        selected: the selected compute device.
        patches: the session's undo stack.
        stack: the memory levels (``apt_model.memory.levels.VGPUStack``) when paging or activation
            offload was requested, else None.
        services: session-wide objects shared between steps by name (``"distributed"``: the
            ``DistributedSession``; a step may add its own, e.g. ``"paging"``).
    """

    config: Any
    selected: torch.device
    patches: PatchSet
    stack: Any = None
    services: dict = field(default_factory=dict)


class AdoptionContext:
    """What a step sees while one model is adopted.

    Attributes:
        session: the :class:`StepSession`.
        record: the model's :class:`ModelRecord`.
        device: the model's device (its first parameter's).
        trigger: what caused adoption (``to()``, ``compile()``, ``compiled function``, ``first forward``, ``adopt()``).
        moved_note: extra words about the script's move (``" (redirected from cuda: ...)"``).
        facts: what earlier steps said for later ones (``paging_blocked``...).
    """

    def __init__(self, session: StepSession, record: ModelRecord, device: torch.device, trigger: str,
                 recorder: Callable[[ModelRecord, Decision], None], probes: Any = None, moved_note: str = ""):
        self.session = session
        self.record = record
        self.device = device
        self.trigger = trigger
        self.moved_note = moved_note
        self.facts: dict = {}
        self._recorder = recorder
        self._probes = probes
        self._first_call: list[Callable] = []

    @property
    def config(self):
        return self.session.config

    @property
    def patches(self) -> PatchSet:
        return self.session.patches

    def support(self):
        """The device's probed ``Support`` (``apt_model.devices.capabilities``), or None when no
        requested feature needs probes (then nothing is probed)."""
        return self._probes.support(self.device) if self._probes is not None else None

    def speed(self):
        """The device's probed ``Speed`` at the model's width, or None (see :meth:`support`)."""
        return self._probes.speed(self.device, self.record.width) if self._probes is not None else None

    def record_later(self, decision: Decision) -> None:
        """Record a decision made after adoption (a trial's verdict, a measured budget)."""
        self._recorder(self.record, decision)

    def on_first_call(self, fn: Callable[[nn.Module, tuple, dict], Any]) -> None:
        """Run ``fn(module, args, kwargs)`` when adoption happened inside the model's first forward:
        hooks a step adds are not run by PyTorch for the call already under way."""
        self._first_call.append(fn)

    def take_first_call_hooks(self) -> list[Callable]:
        """The functions given to :meth:`on_first_call`, handed over once: the context keeps none.
        (Kept, they held what they close over — a compile ladder and through it the model — for as
        long as anything held the context, such as a trial's verdict callback: a model the script
        dropped stayed alive.)"""
        hooks, self._first_call = self._first_call, []
        return hooks

    def first_call_mark(self) -> int:
        """How many first-call functions were given so far (for :meth:`drop_first_call_hooks`)."""
        return len(self._first_call)

    def drop_first_call_hooks(self, mark: int) -> None:
        """Forget the first-call functions given since :meth:`first_call_mark` returned ``mark``
        (a step that failed halfway: its hooks must not run)."""
        del self._first_call[mark:]


class FeatureStep:
    """One feature of the switch, decided and applied per adopted model.

    Subclasses set :attr:`name` (the feature name in the report) and implement :meth:`decide`;
    they override :meth:`apply` when a decision can act, :meth:`report` / :meth:`stats` when the
    step keeps session-wide state worth reporting. Constructed once per switch session with the
    :class:`StepSession`.
    """

    name: str = ""
    #: Whether the adopter may contain an unforeseen error of :meth:`apply` (roll the undo stack
    #: back, turn the feature off for the rest of the session, go on). False for a step whose
    #: session-wide state is not all on the undo stack (paging's session tables): its error
    #: reaches the script. An error of :meth:`decide` (which changes nothing) is always contained.
    contain_apply_errors: bool = True

    def __init__(self, session: StepSession):
        self.session = session

    def decide(self, model: nn.Module, ctx: AdoptionContext) -> Decision:
        """What to do for ``model`` and why; changes nothing."""
        raise NotImplementedError(f"{type(self).__name__}.decide")

    def apply(self, model: nn.Module, ctx: AdoptionContext, patches: PatchSet, decision: Decision) -> Decision:
        """Make the change ``decision`` describes (every undo in ``patches``); return the decision
        as recorded (amended with what applying found). Called only when ``decision.act``."""
        return decision

    def report(self) -> dict | None:
        """The step's session-wide section of ``vb.get_report()``, or None."""
        return None

    def stats(self) -> dict:
        """Counters the step adds to ``vb.get_stats()`` (e.g. ``autocast_calls``)."""
        return {}
