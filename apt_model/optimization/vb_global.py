"""The Virtual Blackwell switch — the public face users import::

    import apt_model.optimization.vb_global as vb
    vb.enable_balanced_mode()

Implementation: :mod:`apt_model.switch.controller`.
"""
from __future__ import annotations

from apt_model.switch.controller import (
    adopt,
    device,
    disable,
    enable,
    enabled,
    ensure_process_group,
    get_config,
    get_report,
    get_stats,
    is_enabled,
    print_stats,
    selection,
    session,
)

__all__ = [
    "adopt",
    "device",
    "disable",
    "enable",
    "enable_balanced_mode",
    "enable_full_optimization",
    "enable_memory_mode",
    "enable_performance_mode",
    "enable_speed_mode",
    "enabled",
    "ensure_process_group",
    "get_config",
    "get_report",
    "get_stats",
    "is_enabled",
    "print_stats",
    "save_report",
    "selection",
    "session",
]


def enable_performance_mode(**overrides):
    """``enable("performance")``: fused attention, mixed precision where faster, native FP4 where the hardware has it."""
    return enable("performance", **overrides)


def enable_speed_mode(**overrides):
    """Alias of :func:`enable_performance_mode`."""
    return enable("performance", **overrides)


def enable_balanced_mode(**overrides):
    """``enable("balanced")`` (recommended): fused attention and mixed precision where the device is faster."""
    return enable("balanced", **overrides)


def enable_memory_mode(**overrides):
    """``enable("memory")``: balanced plus FP4 storage of frozen weights, activation checkpointing/offload, tight paging."""
    return enable("memory", **overrides)


def enable_full_optimization(**overrides):
    """``enable("full")``: every feature requested."""
    return enable("full", **overrides)


def save_report(path, png: bool | None = None) -> str:
    """Write :func:`get_report` as JSON to ``path`` (bytes-valued sizes) and, with the ``plot``
    extra (matplotlib), a PNG of memory per level and step time beside it (``path`` with ``.png``).

    Args:
        path: the JSON file; folders are created.
        png: None (default): the PNG when matplotlib is installed; True: always (ImportError
            without matplotlib); False: never.

    Returns:
        The JSON path as a string. Fields: docs/reports.md.
    """
    from apt_model.reports import write_report

    return write_report(get_report(), path, png=png)["json"]
