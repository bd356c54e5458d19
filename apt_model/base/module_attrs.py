"""Reading optional attributes of the script's modules without trusting their ``__getattr__``.

The switch looks at a model for optional marks (a Hugging Face ``config``, a
``gradient_checkpointing_enable`` method, ``supports_gradient_checkpointing``). ``getattr(m, name,
default)`` catches only ``AttributeError``, but a module's class may define ``__getattr__`` to look
names up elsewhere and raise anything on a miss (``KeyError`` from a config dictionary). Plain
PyTorch never asks such a module for a name it lacks; the switch did, and its model's first call
crashed with the switch on (found 2026-11-28).
"""
from __future__ import annotations

from typing import Any

__all__ = ["module_attr", "has_module_attr"]


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
