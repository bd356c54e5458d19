"""Deciding what stays resident and what pages, from sizes and measured bandwidths.

Per optimizer step, a paged category costs roughly these bytes of traffic to the level below:

========== =============================================== ==================
category   traffic when paged                              per byte of state
========== =============================================== ==================
parameters read in forward, read in backward, read and      4x
           written by the optimizer step
gradients  written when produced, read by the step          2x (+2x if clipped)
states     read and written by the step (Adam: m and v)     2x
========== =============================================== ==================

So parameters are kept resident first, then gradients, then optimizer states, as long as what
is kept fits the level-0 budget minus a streaming reserve (a quarter of the budget, for the
module being computed, its prefetched neighbours and the optimizer chunk in flight).

**The budget is a promise.** The pager holds level 0 (kept categories plus pages) within the
budget plus the largest page. That is only possible when the smallest set of pages that must be
resident at once — the *working set*: a module's parameters while it runs (plus one gradient in
backward), or one parameter's pages in the optimizer step (parameter, gradient and states) — fits
in the room the kept categories leave, plus the largest page. When it does not, the plan gives
kept categories back to paging (cheapest traffic first: states, gradients, parameters); when even
paging everything does not make it fit, the plan is refused with a :class:`PagingBudgetError`
naming the working set and the smallest budget that works. Only ``paging="always"`` (tests,
benchmarks) pages anyway; its reason says by how much level 0 will go over.

**The time estimate uses the levels the plan really uses.** Below an accelerator, pages go to the
host level first, over the host<->device link; they reach the swap files only when the host
level cannot hold them all (and then, since an LRU cache smaller than a cyclic working set hits
nothing, the whole traffic is counted at the disk's bandwidth as well). On a CPU-only run (or for
a model the script keeps on the CPU) the level below *is* the swap files.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from apt_model.base.errors import ConfigError
from apt_model.base.sizes import format_size, format_size_at_least


#: Average parameter size under which the plan's I/O time, from bandwidth alone, is called a floor.
SMALL_PAGE_BYTES = 256 << 10

#: The refusal's last suggestion, left out where a model is paged anyway (adopted after others).
ALWAYS_ADVICE = ", or page anyway with paging='always' (level 0 will then go over the budget)"


class PagingBudgetError(ConfigError):
    """The level-0 budget is smaller than the smallest working set paging needs resident at once,
    so paging could not hold it; the message names the working set and the smallest budget that works."""


@dataclass
class PlacementPlan:
    """What the pager does for one model. Sizes in bytes, times in seconds.

    Attributes (besides the categories and sizes):
        kept_bytes: training state kept resident on level 0 outside the pages.
        page_budget: the budget left for pages (``budget - kept_bytes``).
        largest_page: the largest single tensor paged.
        working_set: bytes the pager must hold at once at least (see the module docstring), and
            ``working_set_what`` which tensors those are.
        over_budget_expected: for a forced plan whose budget is below the working set, by how many
            bytes level 0 may exceed the budget (0 otherwise).
        io_path: the levels the paged bytes move to (``["nvme"]``, ``["host"]``, ``["host", "nvme"]``).
        link_seconds_per_step / disk_seconds_per_step: the parts of ``io_seconds_per_step``.
    """

    paged: bool
    page_params: bool
    page_grads: bool
    page_states: bool
    budget: int
    params_bytes: int
    grads_bytes: int
    states_bytes: int
    state_factor: float
    read_bytes_per_step: int = 0
    write_bytes_per_step: int = 0
    io_seconds_per_step: float | None = None
    reason: str = ""
    kept: list = field(default_factory=list)
    paged_categories: list = field(default_factory=list)
    kept_bytes: int = 0
    page_budget: int = 0
    largest_page: int = 0
    working_set: int = 0
    working_set_what: str = ""
    over_budget_expected: int = 0
    io_path: list = field(default_factory=list)
    link_seconds_per_step: float | None = None
    disk_seconds_per_step: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def model_state_sizes(model: nn.Module) -> tuple[int, int]:
    """(parameter bytes, trainable-parameter bytes), tied parameters counted once."""
    return params_state_sizes(model.parameters())


def params_state_sizes(params) -> tuple[int, int]:
    """(parameter bytes, trainable-parameter bytes) of the tensors ``params``, each counted once."""
    seen, total, trainable = set(), 0, 0
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel() * p.element_size()
        total += n
        if p.requires_grad:
            trainable += n
    return total, trainable


def working_set(model: nn.Module, page_params: bool, page_grads: bool, page_states: bool,
                state_factor: float = 2.0) -> tuple[int, str, int]:
    """The smallest set of pages the pager must hold resident at once for ``model``.

    Returns:
        ``(bytes, what, largest_page)``: the largest of (a) a module's own parameters while it runs,
        plus one of its gradients arriving in backward, when parameters are paged, and (b) one
        parameter's paged tensors in the optimizer step (the parameter, its gradient and
        ``state_factor`` times its size of state); ``what`` says which; ``largest_page`` is the
        largest single paged tensor.
    """
    best, what, largest = 0, "nothing", 0
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel() * p.element_size()
        if page_params or page_grads or page_states:
            largest = max(largest, n)
        if not p.requires_grad:
            continue
        step = (n if page_params else 0) + (n if page_grads else 0) + (int(state_factor * n) if page_states else 0)
        if step > best:
            parts = [k for k, on in (("parameter", page_params), ("gradient", page_grads),
                                     ("optimizer states", page_states)) if on]
            best, what = step, f"the optimizer step of {name} ({' + '.join(parts)})"
    if page_params:
        for mname, module in model.named_modules():
            own, size, grad = set(), 0, 0
            for p in module.parameters(recurse=False):
                if id(p) in own:
                    continue
                own.add(id(p))
                n = p.numel() * p.element_size()
                size += n
                if p.requires_grad and page_grads:
                    grad = max(grad, n)
            if size + grad > best:
                best = size + grad
                what = f"module {mname or type(model).__name__}'s parameters" + (" and one gradient" if grad else "")
    return best, what, largest


def _io_estimate(plan: PlacementPlan, disk: dict | None, levels, device) -> str:
    """Fill the plan's time estimate from the levels its pages really move to; returns the reason's clause."""
    read, write = plan.read_bytes_per_step, plan.write_bytes_per_step
    paged_bytes = ((plan.params_bytes if plan.page_params else 0) + (plan.grads_bytes if plan.page_grads else 0)
                   + (plan.states_bytes if plan.page_states else 0))
    host = None
    if (levels and device is not None and torch.device(device).type != "cpu" and len(levels) > 2
            and levels[0].kind == "device" and levels[1].kind == "host"):
        host = levels[1]
    disk_s = None
    if disk:
        disk_s = round(read / (disk["read"] * 1e9) + write / (disk["write"] * 1e9), 3)
    if host is None:
        plan.io_path = ["nvme"]
        plan.disk_seconds_per_step = plan.io_seconds_per_step = disk_s
        return f", {disk_s:.2f} s at the measured disk bandwidth" if disk_s else ""
    link = host.detail or {}
    link_s = None
    if link.get("h2d") and link.get("d2h"):
        link_s = round(read / (link["h2d"] * 1e9) + write / (link["d2h"] * 1e9), 3)
    plan.link_seconds_per_step = link_s
    link_txt = (f"{link_s:.2f} s over the host<->device link ({link['h2d']:.1f} / {link['d2h']:.1f} GB/s "
                "to / from the device)") if link_s is not None else "the host<->device link (not measured)"
    if paged_bytes <= host.capacity:
        plan.io_path = ["host"]
        plan.disk_seconds_per_step = 0.0
        plan.io_seconds_per_step = link_s
        return (f"; the host level ({format_size(host.capacity)}) holds all {format_size(paged_bytes)} paged: "
                f"{link_txt}, no disk traffic once the pages are in place")
    plan.io_path = ["host", "nvme"]
    plan.disk_seconds_per_step = disk_s
    plan.io_seconds_per_step = None if link_s is None or disk_s is None else round(link_s + disk_s, 3)
    disk_txt = f"{disk_s:.2f} s at the measured disk bandwidth" if disk_s is not None else "the disk (not measured)"
    return (f"; {format_size(paged_bytes)} paged exceed the host level ({format_size(host.capacity)}), so pages "
            f"also spill to the swap files: {link_txt} plus {disk_txt}")


def _left(taken: int) -> str:
    return f" (left after the {format_size(taken)} the models adopted before keep resident)" if taken else ""


def plan_placement(model: nn.Module, budget: int, disk: dict | None, state_factor: float = 2.0,
                   force: bool = False, levels=None, device=None,
                   budget_setting: str = "device_budget (VB_DEVICE_BUDGET)", taken: int = 0) -> PlacementPlan:
    """Plan paging for ``model`` under a level-0 ``budget``.

    Args:
        budget: bytes of training state the compute level may hold.
        disk: measured ``{"read", "write"}`` GB/s of the swap disk (None: no time estimate).
        state_factor: optimizer-state bytes per trainable byte (2 for Adam/AdamW: m and v; 1 for
            SGD with momentum). The optimizer is usually built after the model is adopted, so the
            plan assumes Adam; states are paged for whatever optimizer actually steps.
        force: page every category regardless of fit (tests and benchmarks), even when the
            budget is below the working set.
        levels: the VGPU stack's levels (:class:`~apt_model.memory.levels.Level`); with
            ``device``, decides which levels the pages move to for the time estimate.
        device: the device the model's training state is on (None: as on a CPU).
        budget_setting: the setting that sets ``budget``, as the error names it (on a CPU-only run
            ``host_budget`` where it is the smaller; see ``VGPUStack.budget_setting``).
        taken: bytes of the level the plans of models adopted before keep resident: ``budget`` is
            what they leave (the error's suggestion adds them back).

    Raises:
        PagingBudgetError: paging is needed but no plan can hold ``budget`` (its smallest working
            set does not fit); not raised when ``force``.
    """
    p_bytes, t_bytes = model_state_sizes(model)
    s_bytes = int(state_factor * t_bytes)
    total = p_bytes + t_bytes + s_bytes
    plan = PlacementPlan(False, False, False, False, budget, p_bytes, t_bytes, s_bytes, state_factor)
    if total <= budget and not force:
        plan.kept_bytes = total
        plan.reason = (f"training state {format_size(total)} (parameters {format_size(p_bytes)}, gradients "
                       f"{format_size(t_bytes)}, optimizer states ~{format_size(s_bytes)}) fits the level-0 budget "
                       f"{format_size(budget)}{_left(taken)}: nothing is paged")
        return plan
    sizes = {"parameters": p_bytes, "gradients": t_bytes, "optimizer states": s_bytes}
    room = int(budget * 0.75)  # a quarter stays free for the streaming working set
    kept = []
    for name, size in sizes.items():
        if not force and size <= room:
            kept.append(name)
            room -= size

    def shape(kept_now):
        paged_now = [n for n in sizes if n not in kept_now]
        ws, what, largest = working_set(model, "parameters" in paged_now, "gradients" in paged_now,
                                        "optimizer states" in paged_now, state_factor)
        page_budget = budget - sum(sizes[n] for n in kept_now)
        return paged_now, ws, what, largest, page_budget

    paged, ws, what, largest, page_budget = shape(kept)
    given_back = []
    while ws > page_budget + largest and kept and not force:
        given_back.append(kept.pop())  # cheapest traffic first: states, then gradients, then parameters
        paged, ws, what, largest, page_budget = shape(kept)
    if ws > page_budget + largest and not force:
        raise PagingBudgetError(
            f"the level-0 budget {format_size(budget)} cannot be held while paging {type(model).__name__} "
            f"(training state {format_size(total)}): {what} needs {format_size(ws)} resident at once, more than "
            f"the budget plus the largest page ({format_size(largest)}) allows"
            + _left(taken) + f"; set {budget_setting} "
            f"to at least {format_size_at_least(taken + ws - largest)} ({taken + ws - largest} bytes){ALWAYS_ADVICE}"
            + ("; the plan assumes the model trains (AdamW: a gradient and two states per trainable parameter): a "
               "model that is only evaluated needs its parameters alone, so call model.requires_grad_(False) "
               "before moving it" if what.startswith("the optimizer step") else "")
        )
    plan.paged = True
    plan.page_params = "parameters" in paged
    plan.page_grads = "gradients" in paged
    plan.page_states = "optimizer states" in paged
    plan.kept, plan.paged_categories = kept, paged
    plan.kept_bytes = sum(sizes[n] for n in kept)
    plan.page_budget = max(page_budget, 0)
    plan.largest_page, plan.working_set, plan.working_set_what = largest, ws, what
    plan.over_budget_expected = ws - plan.page_budget if ws > plan.page_budget + largest else 0
    read = write = 0
    if plan.page_params:
        # forward, backward, optimizer step; a model with nothing to train (a frozen teacher) is
        # only run forward (its estimate was 3x until 2026-11-28: a probe's finding)
        read += 3 * p_bytes if t_bytes else p_bytes
        write += t_bytes  # updated parameters
    if plan.page_grads:
        write += t_bytes
        read += t_bytes
    if plan.page_states:
        read += s_bytes
        write += s_bytes
    plan.read_bytes_per_step, plan.write_bytes_per_step = read, write
    where = _io_estimate(plan, disk, levels, device)
    tensors = [p for p in model.parameters() if p.numel()]
    if disk and tensors and p_bytes / len(tensors) < SMALL_PAGE_BYTES:
        # a WaveNet of 1.3 KB tensors: "0.00 s at the measured disk bandwidth" for a step that went
        # from 33 to 371 ms, each page's file operations setting the pace (a probe's finding)
        avg = f"its {len(tensors)} parameters average {format_size(p_bytes // len(tensors))}"
        where += (f", a floor: {avg}, and pages that small cost their file operations more than their bytes" if where
                  else f"; {avg}: pages that small cost their file operations more than their bytes, so paging it "
                  "is slower than its bytes suggest")
    why = ("forced by the caller" if force else
           f"training state {format_size(total)} exceeds the level-0 budget {format_size(budget)}{_left(taken)}")
    plan.reason = (f"{why}; kept resident: {', '.join(kept) or 'nothing'}; paged to the level below: "
                   f"{', '.join(paged)} (parameters are kept first: 4 bytes of traffic per byte paged, vs 2 for "
                   f"gradients and states); about {format_size(read)} read + {format_size(write)} written per step"
                   + ("" if t_bytes else " (forward only: nothing in it trains)")
                   + where)
    if given_back:
        plan.reason += (f"; {', '.join(given_back)} paged too, to leave room for the working set ({what}, "
                        f"{format_size(ws)})")
    if plan.over_budget_expected:
        plan.reason += (f"; the budget is below the working set ({what}, {format_size(ws)}): level 0 will go over "
                        f"it by up to {format_size(plan.over_budget_expected)}")
    return plan
