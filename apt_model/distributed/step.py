"""The switch's distributed step: data parallelism per adopted model (policy in
:mod:`apt_model.distributed.session`).

The session-wide :class:`~apt_model.distributed.session.DistributedSession` (process group, the
rank's device, the constructor guards) is made by ``enable()`` before any model is adopted and
shared with this step as ``session.services["distributed"]``. Its decision carries the fact
``paging_blocked`` when DDP, FSDP or DataParallel will read parameter storage: the paging step
then leaves the model resident.
"""
from __future__ import annotations

import torch.nn as nn

from apt_model.base.feature import AdoptionContext, Decision, FeatureStep, StepSession
from apt_model.base.patches import PatchSet


class DistributedStep(FeatureStep):
    """Feature ``distributed`` (setting ``auto`` or ``off``); a no-op without a DistributedSession."""

    name = "distributed"

    def __init__(self, session: StepSession):
        super().__init__(session)
        self.dist = session.services.get("distributed")

    def decide(self, model: nn.Module, ctx: AdoptionContext) -> Decision:
        if self.dist is None:
            return Decision(self.name, ctx.config.distributed, "single process", "no distributed session")
        return self.dist.decide(model, ctx.record)

    def apply(self, model: nn.Module, ctx: AdoptionContext, patches: PatchSet, decision: Decision) -> Decision:
        hook = self.dist.apply(model, ctx.record, ctx.record_later)
        ctx.on_first_call(hook.pre)  # DDP must see the first training forward under way
        return decision

    def report(self) -> dict | None:
        return self.dist.report() if self.dist is not None else None
