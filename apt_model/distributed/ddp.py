"""DistributedDataParallel on the script's own model object.

Wrapping ``model = DDP(model)`` changes what the script holds: attributes move to
``model.module``, ``state_dict()`` keys gain a ``module.`` prefix, checkpoints stop loading
into the bare model. The switch cannot ask an unchanged script to cope with that, so it applies
DDP *in place*, the way ``torch.distributed._composable.replicate`` does: a real
:class:`~torch.nn.parallel.DistributedDataParallel` is built over the model (parameters and
buffers broadcast from rank 0, a reducer with bucketed gradient all-reduce hooked to every
trainable parameter), and the model's forward is bracketed by DDP's own ``_pre_forward`` /
``_post_forward`` through forward hooks. The model keeps its class, attributes, parameter objects
(so the optimizer the script built keeps working) and ``state_dict`` keys. Unlike ``replicate``,
every hook is removable, so ``disable()`` leaves a plain model again.

One difference from a DDP wrapper, on purpose: a forward with gradients disabled
(``torch.no_grad()``, ``inference_mode``, evaluation) runs locally, with no collective, so
rank-0-only evaluation does not hang; DDP's buffer broadcast happens at the next training forward.

When the model is wrapped
    At its first forward with gradients enabled (:class:`DistributedModelHook`), not when it is
    moved: a script that wraps it itself (``DDP(model)``, ``fully_shard(model)``, Accelerate's
    ``prepare``, the Trainer) does so after ``model.to(device)`` and before training, and is then
    left alone.
"""
from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn as nn

from apt_model.base.log import get_logger

log = get_logger(__name__)

#: DDP keyword arguments the ``ddp_options`` setting may pass, with their types.
DDP_OPTIONS = {
    "broadcast_buffers": bool,
    "bucket_cap_mb": (int, float),
    "find_unused_parameters": bool,
    "gradient_as_bucket_view": bool,
    "static_graph": bool,
}

_internal = threading.local()


def constructing_internally() -> bool:
    """True while the switch itself constructs a DDP object (its DDP patch must not count it as the script's)."""
    return getattr(_internal, "depth", 0) > 0


def _ddp_class():
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def trainable_ids(model: nn.Module) -> tuple[int, ...]:
    """id() of ``model``'s parameters that require grad, in order: what a DDP built now reduces."""
    return tuple(id(p) for p in model.parameters() if p.requires_grad)


class InPlaceDDP:
    """DDP semantics attached to ``model`` itself.

    Args:
        model: the adopted model; its parameters must all be on one device (DDP's rule).
        options: DDP keyword arguments (see :data:`DDP_OPTIONS`). Parameters another in-place
            DDP already reduces are excluded by the caller through the model's
            ``_ddp_params_and_buffers_to_ignore`` attribute, which DDP reads.

    Raises:
        whatever DDP's constructor raises (no trainable parameters, parameters on several
        devices, a backend that cannot move the tensors) — the caller turns it into a clear error.
    """

    def __init__(self, model: nn.Module, options: dict | None = None):
        DDP = _ddp_class()
        dev = next(model.parameters()).device
        device_ids = None if dev.type == "cpu" or dev.index is None else [dev.index]
        _internal.depth = getattr(_internal, "depth", 0) + 1
        try:
            self.ddp = DDP(model, device_ids=device_ids, **(options or {}))
        finally:
            _internal.depth -= 1
        self.ddp._vb_internal = True  # never adopted as a model of its own
        #: id() of the parameters the reducer reduces (those requiring grad when it was built)
        self.trainable = trainable_ids(model)
        self.device_ids = device_ids
        self._pending = False
        self._prev_active = None
        self.forwards = 0

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Before the model's forward: DDP's ``_pre_forward`` (reducer prepared, buffers synchronized,
        inputs moved to the device for ``device_ids``), only when gradients are enabled."""
        if not torch.is_grad_enabled():
            self._pending = False
            return None
        DDP = _ddp_class()
        self._prev_active = DDP._active_ddp_module
        DDP._active_ddp_module = self.ddp  # what torch.compile's DDP optimizer looks for
        try:
            args, kwargs = self.ddp._pre_forward(*args, **kwargs)
        except RuntimeError as err:
            DDP._active_ddp_module = self._prev_active
            if "find_unused_parameters" not in str(err):
                raise
            from apt_model.base.errors import DistributedError

            raise DistributedError(
                "the DDP the switch attached to this model in place found parameters that got no gradient in the "
                "last backward (a submodule the forward skipped). Enable the switch with "
                "ddp_options={'find_unused_parameters': True}, or with distributed='off' (VB_DISTRIBUTED=off) if the "
                f"script handles its ranks itself. torch's message: {err}") from err
        except BaseException:
            DDP._active_ddp_module = self._prev_active
            raise
        self._pending = True
        self.forwards += 1
        return tuple(args), dict(kwargs)

    def post(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """After the model's forward: DDP's ``_post_forward`` (marks the outputs for the reducer)."""
        if not self._pending:
            return None
        self._pending = False
        _ddp_class()._active_ddp_module = self._prev_active
        return self.ddp._post_forward(output)

    def remove(self) -> None:
        """Detach the reducer's gradient hooks; the model is a plain module again."""
        try:
            self.ddp._remove_autograd_hooks()
        except Exception as err:  # noqa: BLE001 - never fail disable(); the reducer dies with the object
            log.debug("could not remove DDP autograd hooks: %s", err)
        self._pending = False


class DistributedModelHook:
    """The forward hooks the switch puts on an adopted model when data parallelism may apply.

    Until the model's first forward with gradients enabled it is undecided; then
    ``decide(hook, module)`` (the session's policy) either attaches an :class:`InPlaceDDP` or
    leaves the model alone. A model with no trainable parameters yet stays undecided (a fine-tuning
    script that unfreezes after moving it). Where the set of parameters that require grad differs at
    a training forward from the one the DDP was built over (a layer unfrozen or frozen mid-training),
    ``decide`` runs again and builds a new one: a reducer only ever reduces the parameters it was
    built with (the others would train apart on each rank, or the reducer waits for gradients that
    never come). Replicas made by ``nn.DataParallel`` (which copy hooks) are ignored.
    """

    def __init__(self, decide, rec, record):
        self.state = "undecided"
        self.ddp: InPlaceDDP | None = None
        self.builds = 0  # InPlaceDDP objects built for the model (more than one: its trainable set changed)
        self._decide = decide
        self.rec = rec  # the model's adoption record
        self.record = record  # record(rec, chosen, reason): the model's "distributed" decision

    def pre(self, module: nn.Module, args: tuple, kwargs: dict):
        if module.__dict__.get("_is_replica", False):
            return None
        if self.state == "undecided" or (self.state == "ddp" and torch.is_grad_enabled()
                                           and trainable_ids(module) != self.ddp.trainable):
            if not torch.is_grad_enabled():
                return None
            self._decide(self, module)  # first decision, or DDP rebuilt over the parameters trainable now
        if self.state == "ddp":
            return self.ddp.pre(module, args, kwargs)
        return None

    def post(self, module: nn.Module, args: tuple, output: Any):
        if self.state == "ddp" and not module.__dict__.get("_is_replica", False):
            return self.ddp.post(module, args, output)
        return None

    def remove(self) -> None:
        if self.ddp is not None:
            self.ddp.remove()
        self.state = "removed"
