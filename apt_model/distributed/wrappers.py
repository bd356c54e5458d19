"""Recognizing data-parallel wrappers the script (or a library) applied, and watching for new ones.

The switch must neither double-wrap a model nor fight a wrapper: a model under the script's
``DistributedDataParallel`` (also Accelerate's ``prepare`` and the Hugging Face Trainer, which use
it), FSDP2's ``fully_shard``, FSDP1 or ``nn.DataParallel`` is left to that wrapper.

Watching works through the wrappers' constructors, patched on the *classes* (so it works however
the script imported them; undone by ``disable()``): ``DistributedDataParallel.__init__``,
``DataParallel.__init__`` and FSDP2's parameter-group constructor (``fully_shard`` itself is a
function the script may have imported before the switch was on, so it cannot be patched
reliably; the class it instantiates can).

FSDP and DTensor are never imported here: importing ``torch.distributed.fsdp`` takes about a second
(it pulls in DTensor and SymPy: 1.0 s of ``enable()``'s 1.0 s on the development CPU, measured
with cProfile), and no model can be an FSDP module or hold DTensor parameters before the script
imported them. The FSDP2 guard is installed when FSDP2's parameter-group module is imported, now
or later (:func:`~apt_model.base.post_import.when_imported`).
"""
from __future__ import annotations

import functools
import sys

import torch.nn as nn

from apt_model.base.log import get_logger
from apt_model.base.module_attrs import module_attr
from apt_model.base.post_import import when_imported

log = get_logger(__name__)

#: FSDP2's parameter groups (their constructor is the guard's hook).
FSDP_PARAM_GROUP_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_param_group"


def _fsdp2_module_class():
    mod = sys.modules.get("torch.distributed.fsdp")  # not imported: no model can be an FSDPModule
    return getattr(mod, "FSDPModule", None)


def _fsdp1_class():
    mod = sys.modules.get("torch.distributed.fsdp")
    return getattr(mod, "FullyShardedDataParallel", None)


def _ddp_class():
    try:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel
    except ImportError:  # pragma: no cover
        return None


def _has_dtensor_params(model: nn.Module) -> bool:
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # not imported: none exists
    return dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())


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
    if module.__dict__.get("_is_replica", False):  # not getattr: the script's __getattr__ may raise anything
        return True
    ddp = _ddp_class()
    wrappers = (nn.DataParallel,) if ddp is None else (nn.DataParallel, ddp)
    if isinstance(module, wrappers) and module_attr(module, "module") in seen:
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
        Labels of the guards installed (a guard whose class is missing in this torch is skipped;
        the FSDP2 guard's label says ``at import`` when FSDP2 is not imported yet: it is installed
        when it is, while ``patches`` is open).
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

    def guard_fsdp2(module) -> None:
        group_cls = getattr(module, "FSDPParamGroup", None)
        if group_cls is None:
            log.debug("FSDP2 parameter groups not found in this torch: no paging guard for fully_shard")
            return
        orig_group_init = group_cls.__init__

        @functools.wraps(orig_group_init)
        def group_init(self, params, *args, **kwargs):
            on_fsdp_params(list(params))
            return orig_group_init(self, params, *args, **kwargs)

        patches.set_attr(group_cls, "__init__", group_init, label="FSDPParamGroup.__init__")

    now = FSDP_PARAM_GROUP_MODULE in sys.modules
    undo = when_imported(FSDP_PARAM_GROUP_MODULE, guard_fsdp2)
    if undo is not None:  # not imported yet: stop watching at disable()
        patches.add_undo(undo, f"import watch for {FSDP_PARAM_GROUP_MODULE}")
    installed.append("FSDPParamGroup.__init__" if now else "FSDPParamGroup.__init__ (at import)")
    return installed
