"""The switch's paging step: page training state that does not fit the level-0 budget.

Decision (per adopted model): ``paging=off`` or no memory stack: ``off``; an earlier step's fact
``paging_blocked`` (data parallelism reads the storage paging frees): ``off`` with that reason;
``off`` too for a model that produces sparse gradients (:func:`sparse_gradient_sources`: paging
pages dense tensors only; with ``paging=always`` a warning says so), and for a module whose
parameters a paged model pages already (one the script added to that model: its forward adopted
them);
otherwise the placement plan (:func:`~apt_model.memory.placement.plan_placement`) compares the
model's training state with the budget the models adopted before leave (what the paged ones'
plans keep resident, and the whole training state of those kept resident:
:class:`~apt_model.memory.paging.resident.ResidentModels`) — ``resident`` when it fits (unless
``paging=always``), else ``paged`` with what stays resident and why, using the levels' measured
bandwidths, and where the optimizer step runs (:mod:`~apt_model.memory.paging.step_placement`:
on the device, or on the host where the cost model predicts it faster and exactness allows).
Applying pages the model through the session's one
:class:`~apt_model.memory.paging.session.PagingSession` (created by the first paged model, shared
with the distributed step as ``services["paging"]``).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from apt_model.base.feature import AdoptionContext, Decision, FeatureStep
from apt_model.base.log import get_logger
from apt_model.base.patches import PatchSet
from apt_model.base.sizes import format_size, format_size_at_least
from apt_model.memory.paging.resident import ResidentModels
from apt_model.memory.paging.step_placement import StepPlacement, plan_optimizer_step, probe_host_step_rate
from apt_model.memory.placement import ALWAYS_ADVICE, PagingBudgetError, plan_placement
from apt_model.memory.swap import FORKED_CHILD_REASON

log = get_logger(__name__)


def sparse_gradient_sources(model: nn.Module) -> list[str]:
    """Where ``model`` holds or produces sparse tensors paging cannot page: its ``nn.Embedding`` /
    ``nn.EmbeddingBag`` modules built with ``sparse=True`` (by name), parameters of a sparse layout
    (a fixed adjacency kept as ``nn.Parameter(A.to_sparse(), requires_grad=False)``: paging one
    raised "Cannot access storage of SparseTensorImpl" at ``.to()``, and the plan sized it as dense,
    149 GiB for 7 MB: a probe's finding), and other parameters whose gradient is sparse already (a
    step taken before adoption). Empty when every parameter and gradient is dense. Never raises."""
    out, covered = [], set()
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and getattr(mod, "sparse", False):
            out.append(f"{type(mod).__name__}(sparse=True) at {name or '(the model)'}")
            covered.update(id(p) for p in mod.parameters())
    for name, p in model.named_parameters():
        g = p.grad
        if id(p) in covered:
            continue
        if p.layout is not torch.strided:
            out.append(f"the {p.layout} parameter {name}")
        elif g is not None and g.layout is not torch.strided:
            out.append(f"the {g.layout} gradient of {name}")
    return out



class PagingStep(FeatureStep):
    """Feature ``paging`` (``off``, ``over_budget``, ``tight``, ``always``); see the module docstring."""

    name = "paging"
    # the paging session's tables (models, pages, finalizers, resident models) are not all on the
    # undo stack: an apply that failed halfway cannot be taken back exactly, so its error is raised
    contain_apply_errors = False

    def __init__(self, session):
        super().__init__(session)
        self.plans: list = []  # the placement plans of the paged models
        self.resident = ResidentModels()  # the models whose plan keeps everything on level 0

    @property
    def paging(self):
        """The session's :class:`~apt_model.memory.paging.session.PagingSession`, or None before
        the first paged model."""
        return self.session.services.get("paging")

    def decide(self, model: nn.Module, ctx: AdoptionContext) -> Decision:
        req, stack = ctx.config.paging, self.session.stack
        if req == "off" or stack is None:
            return Decision(self.name, req, "off", "paging=off")
        blocked = ctx.facts.get("paging_blocked")
        if blocked:
            return Decision(self.name, req, "off", blocked)
        if stack.swap.forked():
            return Decision(self.name, req, "off", FORKED_CHILD_REASON)
        if torch.__future__.get_swap_module_params_on_conversion():
            # Module._apply and load_state_dict then swap parameter objects (torch.utils.swap_tensors),
            # which refuses a tensor with a weak reference: paging keeps one to each parameter, so
            # model.float(), .to() and load_state_dict() of a paged model raised (a probe's finding)
            reason = ("torch.__future__.set_swap_module_params_on_conversion(True) is on: conversions and "
                      "load_state_dict() swap parameter objects (torch.utils.swap_tensors), which refuses the "
                      "weak references paging keeps to them; the model's training state stays in memory")
            if req == "always":
                log.warning("paging='always' not applied: %s", reason)
            return Decision(self.name, req, "off", reason)
        if self.paging is not None and self.paging.owns_all(model):
            return Decision(self.name, req, "off", "its parameters are paged already, with the paged model the script "
                            "added it to (or that it wraps)")
        sparse = sparse_gradient_sources(model)
        if sparse:
            reason = (f"the model holds sparse tensors or produces sparse gradients ({'; '.join(sparse[:3])}"
                      f"{' ...' if len(sparse) > 3 else ''}), which paging cannot page (it pages dense tensors): its "
                      "training state stays in memory; build an embedding with sparse=False, or keep a sparse "
                      "constant as a buffer or an attribute, to page the rest")
            if req == "always":
                log.warning("paging='always' not applied: %s", reason)
            return Decision(self.name, req, "off", reason)
        # the models adopted before keep part of the level resident: paged ones by their plans,
        # and those kept whole (their parameters this model brings along aside)
        taken = self.resident.bytes(exclude=model, paged=self.paging.params if self.paging is not None else ())
        if self.paging is not None:
            self.paging.retire_dead()
            taken += self.paging.kept_total()
        budget = max(stack.compute_budget - taken, 0)
        later = self._adopted_after_others(model)
        plan = self._plan(model, budget, None, req == "always", taken, later)
        if not plan.paged:  # applied: remembered as resident (its bytes count for the models after it)
            return Decision(self.name, req, "resident", plan.reason, act=True, details={"plan": plan.to_dict()})
        bw = stack.measure()
        plan = self._plan(model, budget, bw["disk"], req == "always", taken, later, warn=True, levels=stack.levels,
                          device=ctx.device)
        self._check_capacity(model, plan)
        step = self._step_placement(plan, ctx)
        return Decision(self.name, req, "paged", plan.reason, [str(level) for level in stack.levels], act=True,
                        plan=plan, details={"plan": plan.to_dict(), "optimizer_step": step.to_dict()},
                        facts={"paged": True})

    def _adopted_after_others(self, model: nn.Module) -> bool:
        """Whether another live model was planned before ``model`` (kept whole, or paged: one
        whose pages keep nothing resident counts too)."""
        if any(m is not model for m in self.resident.models()):
            return True
        return self.paging is not None and any(pm.model is not None and pm.model is not model
                                               for pm in self.paging.models)

    def _plan(self, model: nn.Module, budget: int, disk, force: bool, taken: int, later: bool,
              warn: bool = False, **kw):
        """:func:`plan_placement` for ``model`` with the ``budget`` the models adopted before leave
        (``taken`` bytes they keep resident). Where that is too small for it, a model adopted
        ``later`` than others (a block a growing network adds at its first forward, a decoder first
        called in the middle of a step) is not refused in the middle of training: everything of it
        is paged, and (with ``warn``: the final plan) a warning says by how much level 0 will go
        over the budget and what budget holds it. The first model is refused as always. (Until
        2026-11-29 "first" meant "nothing kept resident before it": a decoder adopted after an
        encoder that was paged keeping nothing resident was refused in the middle of a step, a
        probe's finding.)"""
        setting = self.session.stack.budget_setting
        try:
            return plan_placement(model, budget, disk, force=force, budget_setting=setting, taken=taken, **kw)
        except PagingBudgetError as err:
            if not later:
                raise
            plan = plan_placement(model, budget, disk, force=True, budget_setting=setting, taken=taken, **kw)
            why = str(err).replace(ALWAYS_ADVICE, "")  # it is paged anyway: not a suggestion here
            if warn:
                log.warning("paging %s anyway, everything of it paged: %s", type(model).__name__, why)
            room = "what they keep resident" if taken else "the budget"  # they may keep nothing (a review probe's finding)
            plan.reason = (plan.reason.replace("forced by the caller", "everything paged: adopted after other "
                                               f"models, it does not fit {room}", 1) + f" ({why})")
            return plan

    def _check_capacity(self, model: nn.Module, plan) -> None:
        """Refuse a plan whose paged parameters and gradients alone cannot fit the room the levels
        have: level 0's room for pages, the host level, and the swap files' room left
        (``swap_budget`` or the disk's free space). Before 2026-11-28 such a model was refused
        halfway through being paged (``SwapFullError`` while its parameters were written out), left
        half-paged with the switch on: ``state_dict()`` and every later call raised again (a
        probe's finding). Optimizer states are not counted (the plan's figure assumes AdamW; the
        script's optimizer may keep fewer), only named in the suggestion.

        Raises:
            PagingBudgetError: naming the bytes, the levels' room and what to set.
        """
        stack = self.session.stack
        certain = (plan.params_bytes if plan.page_params else 0) + (plan.grads_bytes if plan.page_grads else 0)
        swap = stack.levels[-1]
        swap_room = max(swap.capacity - stack.swap.bytes_on_disk, 0)
        above = plan.page_budget + sum(level.capacity for level in stack.levels[1:-1])
        if certain <= above + swap_room:
            return
        states = plan.states_bytes if plan.page_states else 0
        need = certain + states - above + stack.swap.bytes_on_disk
        setting = ("raise swap_budget (VB_SWAP_BUDGET) to at least " if stack.swap_budget else
                   "free disk space there or give another swap_dir (VB_SWAP_DIR) with at least ")
        raise PagingBudgetError(
            f"{type(model).__name__} cannot be paged: its paged parameters"
            + (" and gradients" if plan.page_grads and plan.page_params else "")
            + f" alone are {format_size(certain)} (optimizer states ~{format_size(states)} more), but the memory "
            f"levels have {format_size(above + swap_room)} of room: level 0 {format_size(plan.page_budget)} for pages"
            + "".join(f", {level.kind} {format_size(level.capacity)}" for level in stack.levels[1:-1])
            + f", swap files {format_size(swap_room)} (in {stack.swap.folder}"
            + (f", swap_budget {format_size(stack.swap_budget)}" if stack.swap_budget else ", the disk's free space")
            + f"); {setting}{format_size_at_least(need)} ({need} bytes) for the swap files")

    def _step_placement(self, plan, ctx: AdoptionContext):
        """Where the paged model's optimizer step runs (:mod:`~apt_model.memory.paging.step_placement`)."""
        stack = self.session.stack
        exact = bool(getattr(ctx.config, "paging_exact", True))
        if stack.shared_host:
            return StepPlacement("device", "a CPU-only run: the compute level is host memory, the step already runs "
                                 "where the states are")
        levels = stack.levels
        host = levels[1] if len(levels) > 2 else None
        return plan_optimizer_step(
            getattr(ctx.config, "paging_step", "auto"), exact, ctx.device, plan.params_bytes, plan.grads_bytes,
            plan.states_bytes, plan.page_params, plan.page_states, host.gbps if host else None, levels[0].gbps,
            lambda: probe_host_step_rate(fused=not exact),
            host.capacity - plan.grads_bytes if host else None)

    def apply(self, model: nn.Module, ctx: AdoptionContext, patches: PatchSet, decision: Decision) -> Decision:
        if decision.chosen == "resident":
            self.resident.add(model)
            if self.paging is not None:
                self.paging.retire_dead()  # the pages' room shrinks by its bytes
            return decision
        plan, stack = decision.plan, self.session.stack
        session = self.paging
        if session is None:
            from apt_model.memory.paging.session import PagingSession

            host = None if stack.shared_host else stack.levels[1].capacity
            session = self.session.services["paging"] = PagingSession(
                stack.compute_budget, stack.swap, patches, page_states=plan.page_states, device=ctx.device,
                host_budget=host, step_in_backward=getattr(ctx.config, "paging_step_in_backward", "auto"),
                reuse_memory=bool(getattr(ctx.config, "paging_reuse_memory", True)), resident=self.resident)
        session.optimizers.page_states |= plan.page_states
        paged = session.page_model(model, plan.page_params, plan.page_grads)
        ctx.on_first_call(lambda module, args, kwargs: paged.first_call())  # adopted inside its first forward
        if plan.over_budget_expected:  # a forced plan past its working set: the bound is not promised
            session.backward_step.bound_promised = False
        step = decision.details.get("optimizer_step") or {}
        if step.get("where") == "host":
            session.step_on_host(model, exact=step.get("exact", True))
        self.plans.append(plan)
        return decision

    def report(self) -> dict | None:
        """The paging session's report, plus ``plan_vs_measured``: the plans' bytes and seconds
        per step (summed over the paged models) next to what was measured after the first steps."""
        if self.paging is None:
            return None
        out = self.paging.report()
        measured = self.paging.traffic()
        # a step taken inside backward finds each gradient still in memory: the plan's read of it in
        # the step does not happen. The measured steps are those after the first (which learns the
        # loop and never runs inside backward): the share of them that did
        n_in = self.paging.backward_step.steps_in_backward
        share = min(1.0, n_in / measured["steps"]) if measured and measured.get("steps") else float(n_in > 0)
        planned = {"read_bytes_per_step": int(sum(p.read_bytes_per_step - share * (p.grads_bytes if p.page_grads else 0)
                                                  for p in self.plans)),
                   "steps_inside_backward_share": round(share, 3),
                   "write_bytes_per_step": sum(p.write_bytes_per_step for p in self.plans),
                   "io_seconds_per_step": (None if any(p.io_seconds_per_step is None for p in self.plans)
                                           else round(sum(p.io_seconds_per_step for p in self.plans), 3))}
        ratios = None
        if measured is not None:
            ratios = {k: round(measured[k] / planned[k], 3) if planned[k] else None
                      for k in ("read_bytes_per_step", "write_bytes_per_step")}
            io_s = planned["io_seconds_per_step"]  # the estimate is the I/O floor; the stall is what was not hidden
            ratios["stall_over_io_floor"] = round(measured["stall_s_per_step"] / io_s, 3) if io_s else None
        out["plan_vs_measured"] = {"planned": planned, "measured": measured, "measured_over_planned": ratios}
        return out
