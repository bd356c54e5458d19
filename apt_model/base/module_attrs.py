"""Reading optional attributes of the script's modules without trusting their ``__getattr__``.

Writing, the other way round: the switch puts its own callables on the script's modules (a
checkpointed block's ``forward``, the compile ladder's dispatcher, a call wrapper). A class may
override ``__setattr__`` to record plain attributes (into a config it saves as JSON) or to
refuse new ones; plain PyTorch never writes these names, so :func:`write_attr` writes them the
way ``nn.Module.__setattr__`` ends up writing a plain value (``object.__setattr__``), without the
class's own (found 2026-11-28: a model's saved config held the switch's ``CheckpointedForward``).

The switch looks at a model for optional marks (a Hugging Face ``config``, a
``gradient_checkpointing_enable`` method, ``supports_gradient_checkpointing``). ``getattr(m, name,
default)`` catches only ``AttributeError``, but a module's class may define ``__getattr__`` to look
names up elsewhere and raise anything on a miss (``KeyError`` from a config dictionary). Plain
PyTorch never asks such a module for a name it lacks; the switch did, and its model's first call
crashed with the switch on (found 2026-11-28).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

__all__ = ["module_attr", "has_module_attr", "write_attr", "delete_attr", "is_internal"]


def module_attr(obj: Any, name: str, default: Any = None) -> Any:
    """``getattr(obj, name, default)``, where any exception of the lookup (not only
    ``AttributeError``) means the attribute is absent. Never raises (but ``BaseException`` such as
    ``KeyboardInterrupt`` passes)."""
    try:
        return getattr(obj, name, default)
    except Exception:  # noqa: BLE001 - the script's __getattr__ may raise anything for a missing name
        return default


def has_module_attr(obj: Any, name: str) -> bool:
    """``hasattr(obj, name)``, where any exception of the lookup means False. Never raises."""
    marker = object()
    return module_attr(obj, name, marker) is not marker


def is_internal(module: nn.Module) -> bool:
    """Whether ``module`` is one of the switch's own (a probe's block, the switch's DDP wrapper):
    ``_vb_internal`` set on the instance or its class, read without the class's ``__getattr__``
    (a half-built module's raises ``KeyError``; a script's may raise anything)."""
    return bool(module.__dict__.get("_vb_internal") or getattr(type(module), "_vb_internal", False))


def write_attr(obj: Any, name: str, value: Any) -> None:
    """``setattr(obj, name, value)``; on an ``nn.Module`` instance, a value that is no tensor or
    module is written with ``object.__setattr__`` (what ``nn.Module.__setattr__`` does for such a
    value), so a class's own ``__setattr__`` is not run."""
    if isinstance(obj, nn.Module) and not isinstance(value, (nn.Module, torch.Tensor)):
        object.__setattr__(obj, name, value)
    else:
        setattr(obj, name, value)


def delete_attr(obj: Any, name: str) -> None:
    """``delattr(obj, name)``; on an ``nn.Module`` instance whose ``__dict__`` holds ``name``,
    ``object.__delattr__`` (a class's own ``__delattr__`` is not run).

    Raises:
        AttributeError: ``obj`` has no such attribute.
    """
    if isinstance(obj, nn.Module) and name in vars(obj):
        object.__delattr__(obj, name)
    else:
        delattr(obj, name)
