"""The script's module hooks, told apart from the switch's own.

Features whose mechanism changes when a module's hooks run decline where the script's hooks sit
inside a model: the autocast trial (the hooks would see bf16 activations and gradients:
:mod:`apt_model.precision.autocast`), the compile ladder (``torch.compile`` traces submodule hooks once and, by default,
never sees hooks added later: :mod:`apt_model.compile.hooks`) and activation checkpointing (a
block's recomputation in backward runs the forward hooks of the layers inside it a second time:
:mod:`apt_model.activations.checkpoint`).
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch.nn as nn
import torch.nn.modules.module as module_mod

#: A module's hook dictionaries, and what each holds.
HOOK_DICTS = {"_forward_hooks": "forward hook", "_forward_pre_hooks": "forward pre-hook",
              "_backward_hooks": "backward hook", "_backward_pre_hooks": "backward pre-hook"}
#: The global hook dictionaries of ``torch.nn.modules.module`` (every module's calls run these).
GLOBAL_HOOK_DICTS = {"_global_forward_hooks": "global forward hook",
                     "_global_forward_pre_hooks": "global forward pre-hook",
                     "_global_backward_hooks": "global backward hook",
                     "_global_backward_pre_hooks": "global backward pre-hook"}


def is_switch_hook(fn: Callable) -> bool:
    """Whether ``fn`` is one of the switch's own hooks (defined in apt_model). A user's hook the
    switch wrapped (``functools.wraps``, the paging's fault-handler wrapper) is the user's."""
    try:
        fn = inspect.unwrap(fn)
    except ValueError:
        pass
    owner = getattr(fn, "__module__", None) or type(fn).__module__ or ""
    return owner == "apt_model" or owner.startswith("apt_model.")


def is_torch_hook(fn: Callable) -> bool:
    """Whether ``fn`` is a hook object or function defined in torch itself (``spectral_norm``'s
    and ``weight_norm``'s pre-hooks, ``torch.nn.utils.prune``'s methods): they compute a layer's
    weight from its parameters, and never see the activations."""
    owner = getattr(fn, "__module__", None) or type(fn).__module__ or ""
    return owner == "torch" or owner.startswith("torch.")


def script_hooks(model: nn.Module, kinds: tuple[str, ...] = tuple(HOOK_DICTS), limit: int = 3,
                 include_root: bool = False, include_global: bool = True, skip_torch: bool = False) -> list[str]:
    """The script's hooks of the given ``kinds`` (names of :data:`HOOK_DICTS`) on ``model``'s
    submodules (the model itself too with ``include_root``: by default not, its hooks run around
    its forward) and, with ``include_global``, the global module hooks of the same kinds (with
    ``skip_torch``, not those torch defines: :func:`is_torch_hook`); at most ``limit``
    descriptions plus a count of the rest (``["forward hook on blocks.0.mlp.0", "full backward
    hook on ...", "2 more"]``). Empty when there are none."""
    def theirs(fn) -> bool:
        return not is_switch_hook(fn) and not (skip_torch and is_torch_hook(fn))

    found = []
    for name, kind in GLOBAL_HOOK_DICTS.items() if include_global else ():
        if name.replace("_global", "") in kinds:
            found += [kind] * sum(theirs(fn) for fn in getattr(module_mod, name, {}).values())
    for qual, sub in model.named_modules():
        if sub is model and not include_root:
            continue
        for attr in kinds:
            hooks = getattr(sub, attr, None)
            if hooks:
                found += [f"{HOOK_DICTS[attr]} on {qual}"] * sum(theirs(fn) for fn in hooks.values())
    if len(found) > limit:
        found = found[:limit] + [f"{len(found) - limit} more"]
    return found
