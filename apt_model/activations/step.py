"""The switch's two activation steps, sharing one :class:`~apt_model.activations.manager.ActivationManager`
per session (kept in the session's services as ``"activations"``):

* :class:`CheckpointStep` — feature ``activation_checkpointing``: recompute the repeated blocks'
  activations in backward, chosen by ``checkpoint_policy`` (``all``, ``every:K``, ``budget``);
* :class:`OffloadStep` — feature ``activation_offload``: saved activations beyond the activation
  budget leave fast memory between forward and backward.
"""
from __future__ import annotations

import torch.nn as nn

from apt_model.activations.manager import ActivationManager
from apt_model.base.feature import AdoptionContext, Decision, FeatureStep, StepSession
from apt_model.base.patches import PatchSet


def activation_manager(session: StepSession) -> ActivationManager:
    """The session's activation manager (created on first use, kept in ``session.services``)."""
    manager = session.services.get("activations")
    if manager is None:
        manager = session.services["activations"] = ActivationManager(session.config, session.patches, session.stack,
                                                                      session.selected)
    return manager


class CheckpointStep(FeatureStep):
    """Feature ``activation_checkpointing``; reports the session's activation records."""

    name = "activation_checkpointing"

    def __init__(self, session: StepSession):
        super().__init__(session)
        self.manager = activation_manager(session)

    def decide(self, model: nn.Module, ctx: AdoptionContext) -> Decision:
        return self.manager.decide_checkpointing(model, ctx.record)

    def apply(self, model: nn.Module, ctx: AdoptionContext, patches: PatchSet, decision: Decision) -> Decision:
        return self.manager.apply_checkpointing(model, ctx.record, decision, ctx.record_later, ctx.on_first_call)

    def report(self) -> dict:
        return self.manager.report()


class OffloadStep(FeatureStep):
    """Feature ``activation_offload`` (its figures are in :class:`CheckpointStep`'s report)."""

    name = "activation_offload"

    def __init__(self, session: StepSession):
        super().__init__(session)
        self.manager = activation_manager(session)

    def decide(self, model: nn.Module, ctx: AdoptionContext) -> Decision:
        return self.manager.decide_offload(ctx.record)

    def apply(self, model: nn.Module, ctx: AdoptionContext, patches: PatchSet, decision: Decision) -> Decision:
        return self.manager.apply_offload(model, ctx.record, decision, ctx.on_first_call)
