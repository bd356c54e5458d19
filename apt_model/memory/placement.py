"""Deciding what stays resident and what pages, from sizes and measured bandwidths.

Per optimizer step, a paged category costs roughly these bytes of swap traffic:

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
module being computed, its prefetched neighbours and the optimizer chunk in flight). The plan
also estimates the bytes moved per step and their time at the measured disk bandwidth; the
report shows all of it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch.nn as nn

from apt_model.memory.sizes import format_size


@dataclass
class PlacementPlan:
    """What the pager does for one model. Sizes in bytes, times in seconds."""

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

    def to_dict(self) -> dict:
        return asdict(self)


def model_state_sizes(model: nn.Module) -> tuple[int, int]:
    """(parameter bytes, trainable-parameter bytes), tied parameters counted once."""
    seen, total, trainable = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel() * p.element_size()
        total += n
        if p.requires_grad:
            trainable += n
    return total, trainable


def plan_placement(model: nn.Module, budget: int, disk: dict | None, state_factor: float = 2.0,
                   force: bool = False) -> PlacementPlan:
    """Plan paging for ``model`` under a level-0 ``budget``.

    Args:
        budget: bytes of training state the compute level may hold.
        disk: measured ``{"read", "write"}`` GB/s of the swap disk (None: no time estimate).
        state_factor: optimizer-state bytes per trainable byte (2 for Adam/AdamW: m and v; 1 for
            SGD with momentum). The optimizer is usually built after the model is adopted, so the
            plan assumes Adam; states are paged for whatever optimizer actually steps.
        force: page every category regardless of fit (tests and benchmarks).
    """
    p_bytes, t_bytes = model_state_sizes(model)
    s_bytes = int(state_factor * t_bytes)
    total = p_bytes + t_bytes + s_bytes
    plan = PlacementPlan(False, False, False, False, budget, p_bytes, t_bytes, s_bytes, state_factor)
    if total <= budget and not force:
        plan.reason = (f"training state {format_size(total)} (parameters {format_size(p_bytes)}, gradients "
                       f"{format_size(t_bytes)}, optimizer states ~{format_size(s_bytes)}) fits the level-0 budget "
                       f"{format_size(budget)}: nothing is paged")
        return plan
    room = int(budget * 0.75)  # a quarter stays free for the streaming working set
    kept, paged = [], []
    for name, size in (("parameters", p_bytes), ("gradients", t_bytes), ("optimizer states", s_bytes)):
        if not force and size <= room:
            kept.append(name)
            room -= size
        else:
            paged.append(name)
    plan.paged = True
    plan.page_params = "parameters" in paged
    plan.page_grads = "gradients" in paged
    plan.page_states = "optimizer states" in paged
    plan.kept, plan.paged_categories = kept, paged
    read = write = 0
    if plan.page_params:
        read += 3 * p_bytes  # forward, backward, optimizer step
        write += t_bytes  # updated parameters
    if plan.page_grads:
        write += t_bytes
        read += t_bytes
    if plan.page_states:
        read += s_bytes
        write += s_bytes
    plan.read_bytes_per_step, plan.write_bytes_per_step = read, write
    if disk:
        plan.io_seconds_per_step = round(read / (disk["read"] * 1e9) + write / (disk["write"] * 1e9), 3)
    why = "forced by the caller" if force else f"training state {format_size(total)} exceeds the level-0 budget {format_size(budget)}"
    plan.reason = (f"{why}; kept resident: {', '.join(kept) or 'nothing'}; paged to the level below: "
                   f"{', '.join(paged)} (parameters are kept first: 4 bytes of traffic per byte paged, vs 2 for "
                   f"gradients and states); about {format_size(read)} read + {format_size(write)} written per step"
                   + (f", {plan.io_seconds_per_step:.2f} s at the measured disk bandwidth" if plan.io_seconds_per_step else ""))
    return plan
