"""Route a model's attention through fused SDPA without the user editing the model.

Three kinds of target are recognized:

* ``nn.MultiheadAttention`` — its forward takes the SDPA path only with ``need_weights=False``;
  torch's default is ``True`` (the slow explicit softmax). A forward pre-hook makes ``False`` the
  default **when the caller does not pass ``need_weights``**; the returned weights are then
  ``None``. A caller that passes ``need_weights=True`` still gets the weights.
* Hugging Face ``PreTrainedModel`` whose ``config._attn_implementation`` is ``"eager"`` and that
  supports SDPA — switched with ``model.set_attn_implementation("sdpa")``.
* Any module that declares ``supported_attn_implementations`` containing ``"sdpa"`` and has an
  ``attn_implementation`` attribute (the project's :class:`CausalSelfAttention`, or the user's).

Every change goes through a :class:`~apt_model.base.patches.PatchSet`, so it is undone by
``disable()``. Only picklable hooks and plain attributes are used: ``torch.save(model)`` and
``copy.deepcopy(model)`` keep working on an adopted model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from apt_model.base.patches import PatchSet


@dataclass
class AttentionTarget:
    """One place where attention can be routed: ``kind`` is ``mha``, ``hf`` or ``protocol``;
    ``state`` is ``eager`` (routable) or ``sdpa`` (already fused)."""

    name: str
    kind: str
    module: nn.Module
    state: str


def _mha_default_no_weights(module: nn.MultiheadAttention, args: tuple, kwargs: dict):
    """Forward pre-hook: ``need_weights=False`` unless the caller passed it (5th positional or keyword)."""
    if len(args) < 5 and "need_weights" not in kwargs:
        kwargs = dict(kwargs)
        kwargs["need_weights"] = False
        return args, kwargs
    return None


def find_attention_targets(model: nn.Module) -> list[AttentionTarget]:
    """All attention sites in ``model`` (including ``model`` itself)."""
    targets: list[AttentionTarget] = []
    hf_roots: list[str] = []
    for name, mod in model.named_modules():
        hf_impl = getattr(getattr(mod, "config", None), "_attn_implementation", None)
        if hf_impl is not None and hasattr(mod, "set_attn_implementation"):
            if any(name == r or name.startswith(r + ".") or r == "" for r in hf_roots):
                continue  # set_attn_implementation on the outer model covers its sub-models
            hf_roots.append(name)
            state = str(hf_impl)
            if hf_impl == "eager" and not getattr(mod, "_supports_sdpa", False):
                state = "eager-only"
            targets.append(AttentionTarget(name, "hf", mod, state))
        elif isinstance(mod, nn.MultiheadAttention):
            routed = getattr(mod, "_vb_sdpa_hook", None) is not None
            targets.append(AttentionTarget(name, "mha", mod, "sdpa" if routed else "eager"))
        elif "sdpa" in getattr(mod, "supported_attn_implementations", ()) and hasattr(mod, "attn_implementation"):
            targets.append(AttentionTarget(name, "protocol", mod, "sdpa" if mod.attn_implementation == "sdpa" else "eager"))
    return targets


def route_to_sdpa(targets: list[AttentionTarget], patches: PatchSet) -> list[str]:
    """Switch every ``eager`` target to SDPA, recording undo actions in ``patches``.

    Returns:
        Descriptions of what was routed (``"mha:encoder.layers.0.self_attn"``...).
    """
    routed = []
    for t in targets:
        if t.state != "eager":
            continue
        if t.kind == "hf":
            t.module.set_attn_implementation("sdpa")
            patches.add_undo(lambda m=t.module: m.set_attn_implementation("eager"), f"hf attn_implementation {t.name or 'model'}")
        elif t.kind == "mha":
            handle = t.module.register_forward_pre_hook(_mha_default_no_weights, with_kwargs=True)
            patches.set_attr(t.module, "_vb_sdpa_hook", True, label=f"mha marker {t.name}")
            patches.add_handle(handle, f"mha need_weights hook {t.name}")
        else:
            patches.set_attr(t.module, "attn_implementation", "sdpa", label=f"attn_implementation {t.name}")
        routed.append(f"{t.kind}:{t.name or type(t.module).__name__}")
    return routed
