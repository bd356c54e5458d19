"""Run reports on disk: the JSON report and, with the ``plot`` extra (matplotlib), a PNG of memory
per level and step time over the steps.

Every field of the report is described in ``docs/reports.md``.
"""
from __future__ import annotations

import json
from pathlib import Path

from apt_model.base.log import get_logger

log = get_logger(__name__)


def png_path(json_path: str | Path) -> Path:
    """Where the PNG of the report at ``json_path`` goes: the same name with ``.png``."""
    return Path(json_path).with_suffix(".png")


def write_report(report: dict, path: str | Path, png: bool | None = None, losses: list | None = None) -> dict:
    """Write ``report`` as JSON to ``path`` and, when asked or possible, its PNG beside it.

    Args:
        report: a JSON-safe report (``vb.get_report()``, or any dict with a ``steps`` section).
        path: the JSON file (folders are created).
        png: True: write the PNG (ImportError without matplotlib); False: never; None: when
            matplotlib is installed.
        losses: optional ``[(step, loss), ...]`` drawn in a third panel.

    Returns:
        ``{"json": str, "png": str | None}``.

    Raises:
        ImportError: ``png=True`` and matplotlib is not installed (the JSON is written first).
        OSError: the file cannot be written.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(report, indent=2, default=str), encoding="utf-8")
    out = {"json": str(p), "png": None}
    if png is False:
        return out
    from apt_model.reports.plot import have_matplotlib, plot_report

    if png is None and not have_matplotlib():
        log.debug("no PNG for %s: matplotlib is not installed (pip install 'apt_model[plot]')", p)
        return out
    out["png"] = str(plot_report(report, png_path(p), losses=losses))
    return out
