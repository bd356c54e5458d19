"""Recognizing data-parallel wrappers the script (or a library) applied, and watching for new ones.

The switch must neither double-wrap a model nor fight a wrapper: a model under the script's
``DistributedDataParallel`` (also Accelerate's ``prepare`` and the Hugging Face Trainer, which use
it), FSDP2's ``fully_shard``, FSDP1 or ``nn.DataParallel`` is left to that wrapper.

Watching works through the wrappers' constructors, patched on the *classes* (so it works however
the script imported them; undone by ``disable()``): ``DistributedDataParallel.__init__``,
``DataParallel.__init__`` and FSDP2's parameter-group constructor (``fully_shard`` itself is a
function the script may have imported before the switch was on, so it cannot be patched
reliably; the class it instantiates can).
"""
from __future__ import annotations

import functools

import torch.nn as nn

from apt_model.base.log import get_logger

log = get_logger(__name__)


def _fsdp2_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule

        return FSDPModule
    except ImportError:  # pragma: no cover - torch builds without distributed
        return None


def _fsdp1_class():
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return None


def _ddp_class():
    try:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel
    except ImportError:  # pragma: no cover
        return None


def _has_dtensor_params(model: nn.Module) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def wrapper_kind(model: nn.Module) -> str | None:
    """Which data-parallel wrapper manages ``model``: ``"DDP"`` (the model is a
    DistributedDataParallel), ``"DataParallel"``, ``"FSDP2"`` (it or a submodule went through
    ``fully_shard``), ``"FSDP"`` (FSDP1), ``"DTensor"`` (parameters are DTensors: tensor/sequence
    parallel or a sharded model), or None."""
    ddp, fsdp2, fsdp1 = _ddp_class(), _fsdp2_module_class(), _fsdp1_class()
    if ddp is not None and isinstance(model, ddp):
        return "DDP"
    if isinstance(model, nn.DataParallel):
        return "DataParallel"
    mods = list(model.modules())
    if fsdp2 is not None and any(isinstance(m, fsdp2) for m in mods):
        return "FSDP2"
    if fsdp1 is not None and any(isinstance(m, fsdp1) for m in mods):
        return "FSDP"
    if _has_dtensor_params(model):
        return "DTensor"
    return None


def skip_adoption(module: nn.Module, seen) -> bool:
    """Whether the switch must not adopt ``module`` as a model of its own: a replica
    ``nn.DataParallel`` builds at every forward, or a DDP / DataParallel wrapper around a model
    that is already adopted (``seen`` holds the adopted modules; the wrapper is added to it)."""
    if getattr(module, "_is_replica", False):
        return True
    ddp = _ddp_class()
    wrappers = (nn.DataParallel,) if ddp is None else (nn.DataParallel, ddp)
    if isinstance(module, wrappers) and getattr(module, "module", None) in seen:
        seen.add(module)
        return True
    return False


def install_guards(patches, on_ddp, on_data_parallel, on_fsdp_params) -> list[str]:
    """Patch the wrappers' constructors so the session hears about each new wrapper first.

    Args:
        patches: the switch's :class:`~apt_model.base.patches.PatchSet`.
        on_ddp: ``on_ddp(module)``, before the script's ``DistributedDataParallel(module, ...)`` is built.
        on_data_parallel: ``on_data_parallel(module, device_ids, output_device)`` before
            ``nn.DataParallel(module, ...)`` is built; returns the ``(device_ids, output_device)`` to
            build it with (ids fitted to the visible devices) or None to keep them; may raise to refuse.
        on_fsdp_params: ``on_fsdp_params(params)`` before FSDP2 groups ``params`` (a list of
            Parameters); may raise to refuse.

    Returns:
        Labels of the guards installed (a guard whose class is missing in this torch is skipped).
    """
    installed = []
    ddp = _ddp_class()
    if ddp is not None:
        from apt_model.distributed.ddp import constructing_internally

        orig_ddp_init = ddp.__init__

        @functools.wraps(orig_ddp_init)
        def ddp_init(self, module, *args, **kwargs):
            if not constructing_internally():
                on_ddp(module)
            return orig_ddp_init(self, module, *args, **kwargs)

        patches.set_attr(ddp, "__init__", ddp_init, label="DistributedDataParallel.__init__")
        installed.append("DistributedDataParallel.__init__")

    orig_dp_init = nn.DataParallel.__init__

    @functools.wraps(orig_dp_init)
    def dp_init(self, module, device_ids=None, output_device=None, dim=0):
        fitted = on_data_parallel(module, device_ids, output_device)
        if fitted is not None:  # the ids fitted to the visible devices
            device_ids, output_device = fitted
        return orig_dp_init(self, module, device_ids, output_device, dim)

    patches.set_attr(nn.DataParallel, "__init__", dp_init, label="DataParallel.__init__")
    installed.append("DataParallel.__init__")

    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        FSDPParamGroup = None
        log.debug("FSDP2 parameter groups not found in this torch: no paging guard for fully_shard")
    if FSDPParamGroup is not None:
        orig_group_init = FSDPParamGroup.__init__

        @functools.wraps(orig_group_init)
        def group_init(self, params, *args, **kwargs):
            on_fsdp_params(list(params))
            return orig_group_init(self, params, *args, **kwargs)

        patches.set_attr(FSDPParamGroup, "__init__", group_init, label="FSDPParamGroup.__init__")
        installed.append("FSDPParamGroup.__init__")
    return installed
