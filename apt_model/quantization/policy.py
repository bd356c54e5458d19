"""Which layers go to FP4, and the switch's FP4 step (``fp4`` toggle) — undone exactly by ``disable()``.

The policy (:class:`FP4Policy`) converts frozen ``nn.Linear`` layers and skips, with a reason each:

* embeddings (FP4 storage covers ``nn.Linear``; a lookup reads a few rows, there is nothing to gain);
* the output head — a layer named ``lm_head``/``head``/``output``/``classifier``/... — because its
  error goes straight into the logits (``skip_output_head=False`` or an ``include`` pattern
  overrides);
* layers with fewer than ``min_weights`` weights (default 16,384: a 128 x 128 layer): the bytes saved
  are small next to the per-call dequantization;
* layers whose names match a ``skip`` pattern (``fnmatch`` on the qualified name, e.g. ``"*.attn.*"``);
* always, whatever ``include`` says: trainable weights (storage is for frozen weights; use
  :class:`~apt_model.quantization.linear.FP4QATLinear` to train through FP4), weights shared with
  another module (tied embeddings), ``nn.Linear`` subclasses and layers inside
  ``nn.MultiheadAttention`` (their owners read ``.weight`` directly), layers carrying hooks (a
  replacement would drop them), and the adopted model itself.

``include`` patterns force conversion past the head, size and ``skip`` rules.

In the switch (``vb.enable("memory")`` or ``fp4=...``/``use_fp4=True``):

* ``storage`` / ``all``: eligible frozen layers become :class:`~apt_model.quantization.linear.FP4Linear`;
  compute is emulated (dequantize to the compute dtype), and for ``all`` native where the capability
  probe says the device has FP4 matrix units;
* ``native`` (performance mode): only where the probe says native FP4 runs — elsewhere nothing
  changes, because dequantizing on every call would make the script slower.

Each converted layer's fp32 weight is released (:func:`~apt_model.quantization.footprint.release_parameter`):
the Parameter object survives (an optimizer built earlier still holds it) but its memory is freed.
``disable()`` puts every original ``nn.Linear`` back, with the same Parameter objects; their values
are the FP4-rounded weights, because the originals were freed (that is the point of the mode).
"""
from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn as nn

from apt_model.base.errors import ConfigError
from apt_model.base.log import get_logger
from apt_model.base.module_attrs import module_attr
from apt_model.base.module_hooks import is_switch_hook
from apt_model.memory.host import release_free_memory
from apt_model.quantization.linear import FP4Linear, FP4QATLinear
from apt_model.quantization.footprint import release_parameter
from apt_model.quantization.mxfp4 import check_scale_rule
from apt_model.quantization.tensor import check_format

log = get_logger(__name__)

HEAD_NAMES = ("lm_head", "head", "output", "output_layer", "output_proj", "classifier", "score", "logits",
              "fc_out", "decoder")
USES = ("storage", "qat")


@dataclass(frozen=True)
class FP4Policy:
    """Which layers FP4 conversion touches (see the module docstring for the rules).

    Attributes:
        format: ``"nvfp4"`` (default: better quality, 4.5 bits) or ``"mxfp4"`` (4.25 bits).
        scale_rule: MXFP4 scale rule, ``"floor"`` or ``"rceil"``.
        min_weights: layers with fewer weights are skipped.
        skip_output_head: skip layers named like an output head (``head_names``).
        head_names: last name components that mark an output head.
        skip: ``fnmatch`` patterns of qualified module names never converted.
        include: patterns converted even when the head, size or ``skip`` rules would skip them.
    """

    format: str = "nvfp4"
    scale_rule: str = "floor"
    min_weights: int = 16384
    skip_output_head: bool = True
    head_names: tuple = HEAD_NAMES
    skip: tuple = ()
    include: tuple = ()

    def __post_init__(self):
        try:
            object.__setattr__(self, "format", check_format(self.format))
            object.__setattr__(self, "scale_rule", check_scale_rule(self.scale_rule))
        except ValueError as err:
            raise ConfigError(f"fp4_policy: {err}") from None
        if not isinstance(self.min_weights, int) or isinstance(self.min_weights, bool) or self.min_weights < 0:
            raise ConfigError(f"fp4_policy: min_weights={self.min_weights!r} must be an integer >= 0")
        if not isinstance(self.skip_output_head, bool):
            raise ConfigError(f"fp4_policy: skip_output_head={self.skip_output_head!r} must be True or False")
        for name in ("head_names", "skip", "include"):
            value = getattr(self, name)
            value = (value,) if isinstance(value, str) else tuple(value)
            if not all(isinstance(v, str) for v in value):
                raise ConfigError(f"fp4_policy: {name}={value!r} must be strings")
            object.__setattr__(self, name, value)

    @classmethod
    def coerce(cls, value) -> FP4Policy:
        """An FP4Policy from None (the defaults), a dict of fields, or an FP4Policy.

        Raises:
            ConfigError: unknown field names (the message lists the valid ones) or invalid values.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            valid = [f.name for f in fields(cls)]
            unknown = [k for k in value if k not in valid]
            if unknown:
                raise ConfigError(f"fp4_policy: unknown field(s) {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")
            return cls(**value)
        raise ConfigError(f"fp4_policy={value!r} must be None, a dict or an FP4Policy")

    def to_dict(self) -> dict:
        d = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def raw_weight(m: nn.Module):
    """``m.weight`` without running a parametrization on it: for a parametrized module, the
    stored ``original`` (reading ``.weight`` of a ``spectral_norm`` layer in training mode runs a
    power iteration, which updates its ``_u`` / ``_v``: the planner's look at a model changed it,
    until 2026-11-26). None when ``m`` has no weight, or its parametrization keeps several
    tensors (``weight_norm``)."""
    from torch.nn.utils import parametrize

    if parametrize.is_parametrized(m, "weight"):
        return getattr(m.parametrizations.weight, "original", None)  # weight_norm keeps original0/1: None
    return module_attr(m, "weight")


@dataclass
class Candidate:
    """One layer the policy looked at: where it is, and whether (and why) it converts."""

    name: str
    parent: nn.Module | None = field(repr=False)
    attr: str
    module: nn.Module = field(repr=False)
    convert: bool
    reason: str

    def summary(self) -> dict:
        w = raw_weight(self.module)
        return {"name": self.name, "type": type(self.module).__name__,
                "shape": list(w.shape) if isinstance(w, torch.Tensor) else None, "reason": self.reason}


def _shared_parameters(model: nn.Module) -> dict[int, list[str]]:
    """Parameter storages referenced from more than one module name (tied weights)."""
    owners: dict[int, list[str]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for pname, p in m.named_parameters(recurse=False):
            if p is None or p.device.type == "meta" or type(p.data) is not torch.Tensor \
                    or p.layout is not torch.strided or p.untyped_storage().nbytes() == 0:
                continue  # a DTensor (FSDP2's shards), a sparse tensor: no storage of their own to compare
            owners.setdefault(p.untyped_storage().data_ptr(), []).append(f"{mname}.{pname}" if mname else pname)
    return {k: v for k, v in owners.items() if len(set(v)) > 1}


def _match(name: str, patterns: tuple) -> str | None:
    return next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)


def _hooks(m: nn.Module) -> list:
    """The hook functions on ``m`` (forward, forward pre-, backward, backward pre-)."""
    return [fn for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks,
                         getattr(m, "_backward_pre_hooks", None) or {}) for fn in d.values()]


def _judge(name: str, parent, m: nn.Module, policy: FP4Policy, use: str, shared: dict) -> tuple[bool, str]:
    if isinstance(m, nn.Embedding):
        return False, "embedding: FP4 storage covers nn.Linear; a lookup reads a few rows, nothing to gain"
    if type(m) is not nn.Linear:
        return False, f"nn.Linear subclass: {type(m).__name__} may read .weight itself"
    if parent is None:
        return False, "the model itself: an adopted nn.Linear cannot be replaced in place"
    if isinstance(parent, nn.MultiheadAttention):
        return False, "inside nn.MultiheadAttention: it reads .weight directly"
    w = m.weight
    if not w.is_floating_point() or w.device.type == "meta" or w.layout is not torch.strided:
        return False, f"not a materialized dense floating weight: {w.dtype} {w.layout} on {w.device}"
    if use == "storage" and w.requires_grad:
        return False, "trainable weight: FP4 storage is for frozen weights (FP4QATLinear trains through FP4)"
    tied = shared.get(w.untyped_storage().data_ptr())
    if tied:
        return False, f"tied weight: shared with {', '.join(t for t in tied if not t.startswith(name + '.'))}"
    hooks = _hooks(m)
    if any(not is_switch_hook(fn) for fn in hooks):
        return False, "hooks: the layer has hooks that a replacement would drop"
    if hooks and use == "storage":  # the switch's own: paging's page-in/out hooks on the layer
        return False, ("paged by the switch: FP4 storage releases the weight, which paging holds; enable FP4 "
                       "storage before the model is moved (fp4='storage'), so that it is decided at adoption")
    # QAT keeps the layer's Parameter objects: paging follows the new module (until 2026-11-29 the
    # paging hooks read as the script's, and convert_to_fp4(use='qat') after .to() converted nothing,
    # silently: a probe's finding)
    if "forward" in vars(m):
        # accelerate's add_hook_to_module (device alignment, offload), a script's monkey-patch:
        # the FP4 layer would run without it (until 2026-11-28 it did: a probe's finding)
        return False, "its own forward: the instance's forward was replaced (a library's hook), which a replacement would drop"
    if use == "storage" and policy.format == "nvfp4" and not bool(torch.isfinite(w).all()):
        # NVFP4's tensor scale is taken from the largest magnitude: quantizing raised ValueError at
        # adoption, for a model plain PyTorch runs (NaN out, as the script would see without the switch)
        return False, "non-finite weights: NVFP4 needs finite values; the layer keeps its NaN/Inf as they are"
    forced = _match(name, policy.include)
    if forced:
        return True, f"included: policy pattern {forced!r}"
    excluded = _match(name, policy.skip)
    if excluded:
        return False, f"skip pattern: {excluded!r}"
    if policy.skip_output_head and name.rsplit(".", 1)[-1] in policy.head_names:
        return False, "output head: its FP4 error goes straight into the logits"
    if w.numel() < policy.min_weights:
        return False, f"small: {w.numel()} weights, below min_weights={policy.min_weights}"
    return True, f"{'frozen' if use == 'storage' else 'linear'} layer: {w.numel()} weights"


def plan_fp4(model: nn.Module, policy: FP4Policy | dict | None = None, use: str = "storage") -> list[Candidate]:
    """Every ``nn.Linear``-like layer and embedding of ``model`` with the policy's verdict and reason.

    Raises:
        ValueError: ``use`` is not ``"storage"`` or ``"qat"``.
    """
    if use not in USES:
        raise ValueError(f"use={use!r} is not valid; valid: {', '.join(USES)}")
    policy = FP4Policy.coerce(policy)
    shared = _shared_parameters(model)
    parents = {id(child): (m, attr) for m in model.modules() for attr, child in m.named_children()}
    out = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.Linear, nn.Embedding)) or isinstance(m, (FP4QATLinear, FP4Linear)):
            continue
        parent, attr = parents.get(id(m), (None, ""))
        convert, reason = _judge(name, parent, m, policy, use, shared)
        out.append(Candidate(name or type(m).__name__, parent, attr, m, convert, reason))
    return out


def convert_to_fp4(model: nn.Module, use: str = "storage", policy: FP4Policy | dict | None = None,
                   compute: str = "emulated", release: bool = True) -> list[Candidate]:
    """Convert ``model``'s eligible layers in place (outside the switch; nothing to undo).

    Args:
        model: the model.
        use: ``"storage"`` (frozen layers -> :class:`FP4Linear`) or ``"qat"`` (linear layers ->
            :class:`FP4QATLinear`, sharing their Parameter objects).
        policy: an :class:`FP4Policy`, a dict of its fields, or None for the defaults.
        compute: for storage: ``"emulated"``, ``"native"`` or ``"auto"`` (see :class:`FP4Linear`).
        release: for storage: free each converted layer's fp32 weight (:func:`release_parameter`).

    Returns:
        The plan: every candidate with ``convert`` and ``reason``.
    """
    policy = FP4Policy.coerce(policy)
    plan = plan_fp4(model, policy, use)
    for c in plan:
        if not c.convert:
            continue
        if use == "qat":
            new = FP4QATLinear.from_linear(c.module, policy.format, policy.scale_rule)
        else:
            new = FP4Linear.from_linear(c.module, policy.format, policy.scale_rule, compute=compute)
            if release:
                release_parameter(c.module.weight)
        setattr(c.parent, c.attr, new)
    if release and use == "storage":
        release_free_memory()  # hand the freed weights' pages back to the OS (glibc keeps small frees)
    return plan
