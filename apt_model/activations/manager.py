"""The switch's activation features for adopted models: checkpointing and offload.

One :class:`ActivationManager` per switch session. For each adopted model it

* checkpoints the model's repeated blocks by the configured policy (:mod:`.checkpoint`);
* wraps the model's forward in ``torch.autograd.graph.saved_tensors_hooks`` whose pack and
  unpack go to the session's :class:`~.offload.ActivationOffloader` (when offload is on), and,
  for the ``budget`` policy, count the bytes each block saves during the first training forward;
* describes every decision (what was checkpointed and how, what is offloaded where, the measured
  bytes behind the budget choice) as a :class:`~apt_model.base.feature.Decision`; the switch's
  steps (:mod:`apt_model.activations.step`) call it.

Everything goes through the switch's :class:`~apt_model.base.patches.PatchSet`: ``disable()``
removes the hooks, restores the blocks' forwards (or the Hugging Face checkpointing flags), and
stops the offloader's I/O threads.
"""
from __future__ import annotations

import inspect
import sys
from typing import Callable

import torch
import torch.nn as nn

from apt_model.activations.checkpoint import (
    BlockMeter,
    apply_to_blocks,
    blocks_for_budget,
    checkpointed_by_script,
    choose_blocks,
    find_blocks,
    other_block_lists,
    parse_policy,
    shared_layer_list,
)
from apt_model.activations.offload import ActivationOffloader
from apt_model.memory.swap import FORKED_CHILD_REASON
from apt_model.base.forward_scope import ForwardScopes
from apt_model.base.functional_call import in_function_transform
from apt_model.base.module_hooks import script_hooks
from apt_model.base.sizes import format_size
from apt_model.base.feature import Decision
from apt_model.base.patches import SessionHook


#: Layers that keep only their input (and weight) for backward: a list of them alone is no block
#: list worth checkpointing.
_INPUT_ONLY = (nn.Linear, nn.modules.conv._ConvNd)

#: How :func:`apply_to_blocks` checkpointed, in the report's words.
_HOW = {"hf": "Hugging Face activation checkpointing", "wrapped": "torch.utils.checkpoint, non-reentrant",
        "script": "the script's own Hugging Face activation checkpointing, left as it configured it"}


class _SavedTensorHooks:
    """Enters/leaves ``saved_tensors_hooks(pack, unpack)`` around one model's forward (re-entrant).
    Not inside a ``torch.func`` transform; with ``defer_to_outer`` (activation offload), not while
    saved-tensor hooks set outside the model are active (the script's own: before 2026-11-26 they
    no longer saw the tensors saved inside the model)."""

    def __init__(self, pack, unpack, defer_to_outer: bool = False):
        self.pack, self.unpack = pack, unpack
        self.defer_to_outer = defer_to_outer
        self._scopes = ForwardScopes()  # per thread; an interrupted call's hooks are left at the next call

    @staticmethod
    def stands_aside() -> bool:
        """Whether a call starting now runs as written: without grad nothing is saved for a backward
        (entering the hooks only cost time: a batch-1 policy forward of an RL loop took 1.5x its
        plain time in memory mode, a probe's finding), and torch.func refuses saved-tensor hooks."""
        return not torch.is_grad_enabled() or in_function_transform()

    def enter(self, *_):
        self._scopes.unwind()  # first: our own hooks an interrupt left entered are no script's
        if self.stands_aside():
            self._scopes.push(None)
            return
        if self.defer_to_outer and torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            # the script's own saved-tensor hooks (its offload or compression, a checkpoint it wraps
            # the model in) are active: ours would hide every tensor the model saves from them
            self._scopes.push(None)
            return
        ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        ctx.__enter__()
        self._scopes.push(ctx)

    def leave(self, *_):
        entry = self._scopes.pop()
        if entry is not None and entry[0] is not None:
            entry[0].__exit__(None, None, None)

    def unwind(self) -> int:
        """Leave every saved-tensor hooks context this thread's calls left entered (``disable()``)."""
        return self._scopes.unwind(live_only=False)


def _observers_in(modules) -> str | None:
    """The name of the first quantization observer or fake-quantize module (``torch.ao``) among
    ``modules`` and their submodules, or None. They update scale, zero point and min/max inside one
    op (``fused_moving_avg_obs_fake_quant``) without bumping the tensors' versions, so the
    checkpoint's detection of written buffers misses them: a recomputation updated them twice and
    the gradients used the new scale (QAT trained wrongly in memory mode: a probe's finding)."""
    quant = sys.modules.get("torch.ao.quantization")
    kinds = tuple(k for k in (getattr(quant, "FakeQuantizeBase", None), getattr(quant, "ObserverBase", None)) if k)
    if not kinds:
        return None
    for block in modules:
        for m in block.modules():
            if isinstance(m, kinds):
                return type(m).__name__
    return None


class ActivationManager:
    """Applies ``activation_checkpointing`` / ``activation_offload`` to adopted models.

    Args:
        config: the switch's resolved configuration.
        patches: the switch's undo stack.
        stack: the VGPU stack (its swap space and level-0 capacity), or None when offload is off.
        device: the selected compute device.

    Offload follows each model's own device, not only the selected one: a model the script keeps
    on the CPU of an accelerator machine (``model.to("cpu")``) saves CPU activations, which go
    straight to the swap files as on a CPU-only run (host RAM is the memory they relieve); a
    model on the accelerator offloads to the pinned host level first. One offloader per device.
    """

    def __init__(self, config, patches, stack, device: torch.device):
        self.config = config
        self.patches = patches
        self.stack = stack
        self.device = torch.device(device)
        self.offloaders: dict[str, ActivationOffloader] = {}
        self.records: list[dict] = []

    @property
    def offloader(self) -> ActivationOffloader | None:
        """The first offloader created (the one of the first model adopted with offload), or None."""
        return next(iter(self.offloaders.values()), None)

    def budget(self, device: torch.device | None = None) -> int | None:
        """Bytes of saved activations to keep in memory on ``device`` (default: the selected one):
        the ``activation_budget`` setting, else a quarter of that device's level (level 0, or the
        host level for a CPU model on an accelerator machine)."""
        from apt_model.base.sizes import parse_size

        if self.config.activation_budget is not None:
            return parse_size(self.config.activation_budget, "activation_budget")
        if self.stack is not None:
            dev = self.device if device is None else torch.device(device)
            if dev.type == "cpu" and not self.stack.shared_host:
                return self.stack.levels[1].capacity // 4
            return self.stack.compute_budget // 4
        return None

    def host_budget(self, device: torch.device | str) -> int | None:
        """Bytes of pinned host memory the offloader of a model on ``device`` may use: on an
        accelerator, a quarter of the host level (the paging level's own pinned pool is sized to the
        whole host budget, so the two together stay within 1.25x of it, not 2x); None (no host
        level: straight to disk) for a model on the CPU or where the host is level 0."""
        dev = torch.device(device)
        if dev.type == "cpu" or self.stack is None or self.stack.shared_host:
            return None
        return max(self.stack.levels[1].capacity // 4, 1 << 20)

    def _offloader(self, device: torch.device) -> ActivationOffloader:
        dev = torch.device(device)
        key = str(dev)
        if key not in self.offloaders:
            host = self.host_budget(dev)
            off = ActivationOffloader(self.budget(dev), self.stack.swap, dev,
                                      min_bytes=int(self.config.offload_min_bytes), host_budget=host)
            self.offloaders[key] = off
            self.patches.add_undo(off.close, f"activation offloader ({key})")
        return self.offloaders[key]

    # ------------------------------------------------------------------ per model
    def record_for(self, rec) -> dict:
        """The report entry of the model ``rec`` describes (created on first use)."""
        for record in self.records:
            if record["model"] == rec.scope:
                return record
        record = {"model": rec.scope, "checkpointed": [], "offload": None}
        self.records.append(record)
        return record

    def decide_checkpointing(self, model: nn.Module, rec) -> Decision:
        """Which repeated blocks to checkpoint (``plan``: ``("blocks", blocks, indices)`` or
        ``("measure", blocks, budget)`` for the budget policy); changes nothing."""
        self.record_for(rec)
        feature = "activation_checkpointing"
        req = self.config.activation_checkpointing
        if not req:
            return Decision(feature, req, "off", "activation_checkpointing=off")
        blocks = find_blocks(model)
        if blocks is None:
            shared = shared_layer_list(model)
            if shared is not None:
                return Decision(feature, req, "off", f"{shared} repeats one layer instance (weights shared across depth): "
                                "not checkpointed in this version (blocks are distinct layers of one class)")
            return Decision(feature, req, "off",
                            "no repeated blocks found (an nn.ModuleList/Sequential of >= 2 layers of one class)")
        if all(isinstance(m, _INPUT_ONLY) and next(m.children(), None) is None for m in blocks.modules):
            # a linear or convolution layer keeps only its input for backward (and not even that when
            # its weight is frozen), and a checkpoint keeps its block's input: recomputing it saves
            # nothing. Until 2026-11-28 such blocks were checkpointed (and counted in the report even
            # where FP4 storage then replaced a frozen one, leaving its checkpoint on the layer it
            # removed); single convolutions until 2026-11-29 (a detection backbone's Sequential of
            # Conv2d layers: a probe's finding)
            return Decision(feature, req, "off", f"the repeated blocks in {blocks.name or 'the model'} are single "
                            f"{blocks.kind} layers, which keep no activation a checkpoint would not keep: nothing to save")
        if all(isinstance(m, nn.RNNCellBase) for m in blocks.modules):
            # a cell runs once per time step of the script's loop: a checkpoint per call, for the
            # little a cell saves (a 50-step GRUCell forecaster ran 2.5-3x slower: a probe's finding)
            return Decision(feature, req, "off", f"the repeated blocks in {blocks.name or 'the model'} are "
                            f"recurrent cells ({blocks.kind}), called once per time step: a checkpoint per call "
                            "costs more than the little each saves")
        observed = _observers_in(blocks.modules)
        if observed:
            return Decision(feature, req, "off", f"{observed} inside the {blocks.kind} blocks (quantization-aware "
                            "training) updates its statistics in place where version counters do not see it: a "
                            "recomputation in backward would update them a second time")
        if isinstance(inspect.getattr_static(type(blocks.modules[0]), "forward", None), property):
            # the wrapper could not be put in its place (no setter), or a setter would take it
            # somewhere disable() cannot take it back from (a review probe's finding)
            return Decision(feature, req, "off", f"the {blocks.kind} blocks' forward is a property of their "
                            "class: their forward cannot be wrapped")
        policy, k = parse_policy(self.config.checkpoint_policy)
        n = len(blocks.modules)
        note = ""
        if policy == "budget":
            budget = self.budget()
            if budget is not None:
                return Decision(feature, True, "measuring",
                                f"policy budget ({format_size(budget)}): the first training forward measures what "
                                f"each of the {n} {blocks.kind} blocks saves, then the fewest blocks that fit are "
                                "checkpointed", act=True, plan=("measure", blocks, budget))
            note = "checkpoint_policy=budget needs activation_budget; checkpointing every block"
            policy = "all"
        indices = choose_blocks(n, policy, k)
        why = (f"{note + '; ' if note else ''}policy {self.config.checkpoint_policy}: {len(indices)} of {n} "
               f"{blocks.kind} blocks in {blocks.name or 'the model'} recompute their activations in backward")
        others = other_block_lists(model, blocks)
        if others:
            # an encoder-decoder's other stack: "2 of 2 blocks" read as if all were covered (a probe's finding)
            why += (f"; not checkpointed (one list of blocks per model, the one with the most parameters): "
                    f"{', '.join(others[:3])}{' ...' if len(others) > 3 else ''}")
        hooked = [(i, h) for i in indices if (h := script_hooks(blocks.modules[i]))]
        if hooked:
            (first, hooks), where = hooked[0], f"{blocks.name}." if blocks.name else "block "
            more = ", ..." if len(hooked) > 1 or len(hooks) > 1 else ""
            why += (f"; {len(hooked)} of them hold the script's hooks ({hooks[0]} in {where}{first}{more}) and run "
                    "uncheckpointed while they do: a recomputation would run those hooks a second time")
        return Decision(feature, req, f"{len(indices)}/{n} blocks", why, act=True, plan=("blocks", blocks, indices))

    def apply_checkpointing(self, model: nn.Module, rec, decision: Decision, record_later,
                            on_first_call: Callable | None = None) -> Decision:
        """Apply :meth:`decide_checkpointing`'s plan; ``record_later(decision)`` records the budget
        policy's choice after the first training forward; ``on_first_call(fn)`` (the adoption
        context's) runs ``fn(module, args, kwargs)`` for the call that adopted the model, when it
        is under way (PyTorch does not run the hooks added during a call for that call)."""
        kind, blocks, arg = decision.plan
        record = self.record_for(rec)
        if kind == "measure":
            self._measure_then_choose(model, blocks, arg, record, record_later, on_first_call)
            return decision
        counts = {"checkpointed": 0, "inside another checkpoint": 0}  # live: the wrapped blocks count their calls
        how = apply_to_blocks(model, blocks, arg, self.patches, counts)
        if how == "script":
            record["checkpointed"] = [f"{blocks.name}.{i}" for i in checkpointed_by_script(blocks)]
            return decision.amend(chosen="the script's own", reason=(
                f"the script already enabled Hugging Face activation checkpointing on {len(record['checkpointed'])} "
                f"of {len(blocks.modules)} {blocks.kind} block(s): left as it configured it (and so after disable())"))
        record["checkpointed"] = [f"{blocks.name}.{i}" for i in arg]
        details = {**decision.details, "calls": counts} if how == "wrapped" else decision.details
        return decision.amend(reason=f"{decision.reason} ({_HOW[how]})", details=details)

    def _measure_then_choose(self, model, blocks, budget, record, record_later, on_first_call=None) -> None:
        meter = BlockMeter(blocks)
        handles = []
        for i, block in enumerate(blocks.modules):
            handles.append(block.register_forward_pre_hook(SessionHook(lambda m, a, i=i: meter.pre(i, a))))
            handles.append(block.register_forward_hook(SessionHook(lambda m, a, o: meter.post()), always_call=True))
        hooks = _SavedTensorHooks(lambda t: (meter.count(t), t)[1], lambda t: t)

        def root_pre(m, a):
            if m.training and torch.is_grad_enabled() and not meter.done:
                hooks.enter()

        def root_post(m, a, o):
            if not (m.training and torch.is_grad_enabled()) or meter.done:
                return
            hooks.leave()
            meter.done = True
            for h in handles:
                h.remove()
            chosen = blocks_for_budget(meter.per_block, meter.inputs, meter.outside, budget)
            total = meter.outside + sum(meter.per_block)
            if chosen:
                how = apply_to_blocks(model, blocks, chosen, self.patches)
                record["checkpointed"] = [f"{blocks.name}.{i}" for i in
                                          (checkpointed_by_script(blocks) if how == "script" else chosen)]
            after = total - sum(meter.per_block[i] - meter.inputs[i] for i in chosen)
            record["measured"] = {"per_block": meter.per_block, "block_inputs": meter.inputs, "outside": meter.outside,
                                  "total": total, "after": after, "budget": budget}
            record_later(Decision(
                "activation_checkpointing", True, f"{len(chosen)}/{len(blocks.modules)} blocks",
                f"policy budget: the first training forward saved {format_size(total)} for backward "
                f"({format_size(max(meter.per_block))} in the largest {blocks.kind}); checkpointing "
                f"{len(chosen)} block(s) from the next step brings it to about {format_size(after)} "
                f"(budget {format_size(budget)})"
                + (f" via {_HOW[how]}" if chosen else "")))

        self.patches.add_handle(model.register_forward_pre_hook(SessionHook(root_pre)), "checkpoint meter pre-hook")
        self.patches.add_handle(model.register_forward_hook(SessionHook(root_post), always_call=True),
                                "checkpoint meter hook")
        if on_first_call is not None:  # adopted inside its first forward: measure that one (it measured 0 B)
            on_first_call(lambda module, args, kwargs: root_pre(module, args))
        for h in handles:
            self.patches.add_handle(h, "checkpoint meter block hook")

    def decide_offload(self, rec) -> Decision:
        """Whether saved activations of the model ``rec`` describes are offloaded; changes nothing."""
        self.record_for(rec)
        req = self.config.activation_offload
        if not req:
            return Decision("activation_offload", req, "off", "activation_offload=off")
        if self.stack is None:
            return Decision("activation_offload", req, "off", "no VGPU stack (swap dir) in this session")
        if self.stack.swap.forked():
            return Decision("activation_offload", req, "off", FORKED_CHILD_REASON)
        return Decision("activation_offload", req, "on", "offload requested", act=True)

    def apply_offload(self, model: nn.Module, rec, decision: Decision,
                      on_first_call: Callable | None = None) -> Decision:
        """Wrap the model's forward in saved-tensor hooks going to its device's offloader
        (``on_first_call`` as for :meth:`apply_checkpointing`: the adopting call is offloaded too)."""
        off = self._offloader(torch.device(rec.device))
        hooks = _SavedTensorHooks(off.pack, off.unpack, defer_to_outer=True)
        key = id(model)

        def enter(module, args):
            # the model's buffers now (a forward may rebind them): tensors on them are not offloaded
            # (dense ones: a sparse buffer, a GCN's adjacency, has no storage to ask, and is never
            # offloaded; asking raised "Cannot access storage of SparseTensorImpl": a probe's finding).
            # Only when the hooks will be entered: inside torch.func (functional_call's buffers under
            # vmap/grad are functorch wrappers) asking raised "Cannot access storage of
            # TensorWrapper" (a probe's finding: per-sample gradients in memory mode)
            if not hooks.stands_aside():
                off.module_storages[key] = frozenset(b.untyped_storage().data_ptr() for b in module.buffers()
                                                     if b.layout is torch.strided)
            hooks.enter(module, args)

        self.patches.add_undo(lambda: off.module_storages.pop(key, None), "offload: the model's buffers")
        self.patches.add_handle(model.register_forward_pre_hook(SessionHook(enter)), "offload pre-hook")
        self.patches.add_handle(model.register_forward_hook(SessionHook(hooks.leave), always_call=True), "offload hook")
        if on_first_call is not None:
            on_first_call(lambda module, args, kwargs: enter(module, args))
        self.patches.add_undo(hooks.unwind, "offload hooks an interrupted forward left entered")
        target = ("the host level (pinned), spilling to the swap files" if off.host is not None
                  else f"the swap files in {self.stack.swap.folder}")
        self.record_for(rec)["offload"] = {"budget": off.budget, "min_bytes": off.min_bytes, "target": target,
                                           "device": str(off.device)}
        return decision.amend(reason=f"saved activations >= {format_size(off.min_bytes)} (not parameters) beyond "
                                     f"{format_size(off.budget)} in memory go to {target}; backward reads them back "
                                     "ahead of use")

    def report(self) -> dict:
        """``models``: per adopted model, what was checkpointed and offloaded; ``offload``: the
        offloaders' counters (bytes, counts, seconds) summed over devices (``peak_resident``: the
        largest), with ``devices`` listing each one's own."""
        if not self.offloaders:
            return {"models": self.records, "offload": None}
        per = {k: off.stats.to_dict() for k, off in self.offloaders.items()}
        total: dict = {}
        for stats in per.values():
            for k, v in stats.items():
                total[k] = max(total.get(k, 0), v) if k == "peak_resident" else total.get(k, 0) + v
        total["devices"] = per
        return {"models": self.records, "offload": total}
