"""Route a model's attention through fused SDPA without the user editing the model.

Three kinds of target are recognized:

* ``nn.MultiheadAttention`` (not a subclass with a ``forward`` of its own, whose signature may not
  take ``need_weights``, nor the attention of torch's ``TransformerEncoderLayer`` /
  ``TransformerDecoderLayer``, which pass ``need_weights=False`` themselves and whose inference
  fast path a hook would turn off) — its forward takes the SDPA path only with ``need_weights=False``;
  torch's default is ``True`` (the slow explicit softmax). A forward pre-hook makes ``False`` the
  default **when the caller does not pass ``need_weights``**; the returned weights are then
  ``None``. A caller that passes ``need_weights=True`` still gets the weights.
* Hugging Face ``PreTrainedModel``: reported (``sdpa`` is already fused), never switched. Where
  a model supports SDPA, Hugging Face's default is already ``"sdpa"``; ``"eager"`` there is the
  script's choice — often for ``output_attentions``, which SDPA does not return — and is left as
  chosen. (Until 2026-11-27 the switch set such models to ``"sdpa"``: their attentions came back
  empty, and switching a model's implementation between a forward and its backward made
  activation checkpointing recompute with the other one — a ``CheckpointError``, or with
  attention dropout silently different gradients.)
* Any module that declares ``supported_attn_implementations`` containing ``"sdpa"`` and has an
  ``attn_implementation`` attribute (the project's :class:`CausalSelfAttention`, or the user's).

Every change goes through a :class:`~apt_model.base.patches.PatchSet`, so it is undone by
``disable()``. Only picklable hooks and plain attributes are used: ``torch.save(model)`` and
``copy.deepcopy(model)`` keep working on an adopted model (loading such a pickle needs apt_model
importable: the hooks are its functions). A copy's hooks act only for modules the switch routed
itself (:data:`_ROUTED`): an ``nn.MultiheadAttention`` copied while the switch is on returns
weights as plain PyTorch does (before 2026-11-27 copies stayed routed for good).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

from apt_model.base.module_attrs import has_module_attr, module_attr
from apt_model.base.patches import PatchSet


@dataclass
class AttentionTarget:
    """One place where attention can be routed: ``kind`` is ``mha``, ``hf`` or ``protocol``;
    ``state`` is ``eager`` (routable) or ``sdpa`` (already fused)."""

    name: str
    kind: str
    module: nn.Module
    state: str


#: The modules routed by the switch and not yet restored (copies of them are not in it).
_ROUTED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


class _NoWeights:
    """Forward pre-hook of a routed ``nn.MultiheadAttention``: ``need_weights=False`` (SDPA) unless
    the caller passed it (5th positional or keyword) or ``average_attn_weights`` (which asks how the
    weights come back: a caller that uses them; a probe's finding). In a training call (train mode, grad enabled)
    only once ``reuse`` (the session's :class:`~apt_model.base.graph_reuse.GraphReuseWatch`; None:
    always) is ready without ``create_graph``: SDPA's fused kernels have no second derivative, and
    the math path torch takes with ``need_weights=True`` does (a WGAN-GP critic with attention
    crashed in balanced mode until 2026-11-28: a probe's finding)."""

    def __init__(self, reuse=None):
        self.reuse = reuse

    def __reduce__(self):
        # a copy (torch.save(model), copy.deepcopy) is not routed: it needs no watch, and the
        # watch (a lock, weak references) cannot be pickled
        return (_NoWeights, ())

    def __call__(self, module: nn.MultiheadAttention, args: tuple, kwargs: dict):
        if module not in _ROUTED:  # a copy, or after disable(): as plain PyTorch
            return None
        if len(args) >= 5 or "need_weights" in kwargs or "average_attn_weights" in kwargs:
            return None  # the caller says how it wants the weights (average_attn_weights: per head): it gets them
        reuse = self.reuse
        if reuse is not None and module.training and torch.is_grad_enabled() \
                and not reuse.ready_without(("create_graph",)):
            return None
        kwargs = dict(kwargs)
        kwargs["need_weights"] = False
        return args, kwargs


def _declares_sdpa(declared) -> bool:
    """Whether a module's ``supported_attn_implementations`` names ``"sdpa"``: a collection of
    strings (a permissive ``__getattr__`` answers any name with a default: a number, True)."""
    return isinstance(declared, (list, tuple, set, frozenset)) and "sdpa" in declared


def find_attention_targets(model: nn.Module) -> list[AttentionTarget]:
    """All attention sites in ``model`` (including ``model`` itself)."""
    targets: list[AttentionTarget] = []
    hf_roots: list[str] = []
    # the attention of torch's Transformer layers: they call it with need_weights=False already, and
    # a hook on it would turn off the layers' inference fast path (found by a probe, 2026-11-27)
    in_layers = {id(getattr(mod, attr)) for mod in model.modules()
                 if isinstance(mod, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer))
                 for attr in ("self_attn", "multihead_attn") if isinstance(getattr(mod, attr, None), nn.Module)}
    for name, mod in model.named_modules():
        hf_impl = module_attr(module_attr(mod, "config"), "_attn_implementation")
        if hf_impl is not None and has_module_attr(mod, "set_attn_implementation"):
            if any(name == r or name.startswith(r + ".") or r == "" for r in hf_roots):
                continue  # set_attn_implementation on the outer model covers its sub-models
            hf_roots.append(name)
            state = str(hf_impl)
            if hf_impl == "eager":
                state = "eager, chosen by the script" if module_attr(mod, "_supports_sdpa", False) else "eager-only"
            targets.append(AttentionTarget(name, "hf", mod, state))
        elif isinstance(mod, nn.MultiheadAttention):
            routed = mod in _ROUTED
            if id(mod) in in_layers:
                state = "sdpa"  # called with need_weights=False by its layer
            elif type(mod).forward is not nn.MultiheadAttention.forward:
                # a subclass with a forward of its own: its signature is not torch's, so the hook's
                # need_weights keyword could reach a forward that does not take it (a TypeError)
                state = "own forward"
            else:
                state = "sdpa" if routed else "eager"
            targets.append(AttentionTarget(name, "mha", mod, state))
        elif _declares_sdpa(module_attr(mod, "supported_attn_implementations")) and has_module_attr(mod, "attn_implementation"):
            targets.append(AttentionTarget(name, "protocol", mod, "sdpa" if mod.attn_implementation == "sdpa" else "eager"))
    return targets


def route_to_sdpa(targets: list[AttentionTarget], patches: PatchSet, reuse=None) -> list[str]:
    """Switch every ``eager`` target to SDPA, recording undo actions in ``patches``; an
    ``nn.MultiheadAttention`` in a training call only while ``reuse`` allows (see :class:`_NoWeights`).

    Returns:
        Descriptions of what was routed (``"mha:encoder.layers.0.self_attn"``...).
    """
    routed = []
    for t in targets:
        if t.state != "eager":
            continue
        if t.kind == "mha":
            handle = t.module.register_forward_pre_hook(_NoWeights(reuse), with_kwargs=True)
            _mark_routed(t.module, patches, t.name)
            patches.add_handle(handle, f"mha need_weights hook {t.name}")
        else:
            patches.set_attr(t.module, "attn_implementation", "sdpa", label=f"attn_implementation {t.name}")
        routed.append(f"{t.kind}:{t.name or type(t.module).__name__}")
    return routed


def _mark_routed(module: nn.Module, patches: PatchSet, name: str) -> None:
    """Put ``module`` in :data:`_ROUTED` until ``patches`` are undone."""
    _ROUTED.add(module)
    ref = weakref.ref(module)

    def unmark() -> None:
        m = ref()
        if m is not None:
            _ROUTED.discard(m)

    patches.add_undo(unmark, f"routed attention marker {name}")
