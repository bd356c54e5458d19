"""The report's PNG: memory per level and step time over the optimizer steps (matplotlib).

Drawn with matplotlib's object API on an Agg canvas, so the user's pyplot state and backend are
left alone. Panels:

1. (while paging) the training state on each level of the VGPU stack over the steps;
2. process memory over the steps: the process's peak RSS within each step (sampled during the
   step, so the forward/backward peak shows), its RSS at the step's end and, on an accelerator, the
   bytes allocated on the device;
3. step time over the steps (ms), with the median and the p25-p75 band of the last window, and a
   dotted line where the switch made a decision after the first step (e.g. the autocast trial's
   verdict);
4. (with ``losses`` / ``evals``) the training loss and the held-out loss.

The x axis is the optimizer step, with integer ticks. :func:`plot_data` returns what is drawn as
plain data (for tests and for other plotting tools).
"""
from __future__ import annotations

from pathlib import Path

_GiB, _MiB = 2**30, 2**20


def have_matplotlib() -> bool:
    """Whether matplotlib can be imported (the ``plot`` extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _scale(peak: float) -> tuple[float, str]:
    return (_GiB, "GiB") if peak >= _GiB else (_MiB, "MiB")


_LABELS = {"process_rss_peak": "process RSS, peak within the step", "process_rss": "process RSS at the step's end",
           "device_allocated": "device allocated"}


def _series(xs: list, values: list[dict]) -> dict[str, list[tuple]]:
    """``{key: [(step, bytes), ...]}`` for every key of ``values`` (records without it skipped)."""
    keys: dict[str, None] = {}
    for v in values:
        keys.update(dict.fromkeys(v))
    out = {}
    for k in keys:
        pts = [(x, v[k]) for x, v in zip(xs, values) if v.get(k) is not None]
        if pts:
            out[k] = pts
    return out


def plot_data(report: dict, losses: list | None = None, evals: list | None = None) -> dict:
    """What :func:`plot_report` draws, panel by panel, as plain data (no matplotlib needed).

    Args:
        report: a report with a ``steps`` section (see :func:`plot_report`).
        losses: ``[(step, loss), ...]`` of the training loss, or None.
        evals: ``[(step, held-out loss), ...]``, or None.

    Returns:
        ``{"levels": {label: [(step, bytes)]} or None (not paging), "memory": {field: [(step, bytes)]}``
        (``process_rss_peak`` is the peak RSS within each step, ``process_rss`` the RSS at its end),
        ``"step_time_ms": [(step, ms)]``, ``"loss": {"train": [...], "held-out": [...]}`` or None,
        ``"max_step"``: the last step (0 without records)}.
    """
    steps = report.get("steps") or {}
    records = steps.get("records") or []
    xs = [r["step"] for r in records]
    loss = None
    if losses or evals:
        loss = {}
        if losses:
            loss["train"] = [(int(s), float(v)) for s, v in losses]
        if evals:
            loss["held-out"] = [(int(s), float(v)) for s, v in evals]
    last = max([xs[-1] if xs else 0] + [p[0] for pts in (loss or {}).values() for p in pts[-1:]])
    return {
        "levels": _series(xs, [r.get("levels") or {} for r in records]) if steps.get("levels") else None,
        "memory": _series(xs, [r.get("memory") or {} for r in records]),
        "step_time_ms": [(r["step"], r["step_s"] * 1e3) for r in records if r.get("step_s") is not None],
        "loss": loss,
        "max_step": last,
    }


def plot_lines(ax, series: dict[str, list[tuple]], what: str) -> None:
    """One line per series (bytes), in MiB or GiB."""
    peak = max((y for pts in series.values() for _, y in pts), default=0)
    div, unit = _scale(peak)
    for k, pts in series.items():
        style = "-" if k != "process_rss" else "--"
        ax.plot([p[0] for p in pts], [p[1] / div for p in pts], style, label=_LABELS.get(k, k))
    ax.set_ylim(bottom=0)
    ax.set_ylabel(f"{what} ({unit})")
    if series:
        ax.legend(loc="best", fontsize="small")
    ax.grid(alpha=0.3)


def plot_report(report: dict, path: str | Path, losses: list | None = None, title: str | None = None,
                evals: list | None = None) -> Path:
    """Draw ``report["steps"]`` (see :class:`apt_model.switch.steps.StepRecorder`) to a PNG at ``path``.

    The panels' data is :func:`plot_data`'s. The x axis is the optimizer step, with integer ticks.

    Args:
        report: a report with a ``steps`` section (None or missing: the image says no steps were recorded);
            ``decisions`` and ``config`` are used when present.
        path: the PNG file (folders are created).
        losses: optional ``[(step, loss), ...]``: the training loss, in a last panel.
        title: the figure title (default: mode and device from the report).
        evals: optional ``[(step, held-out loss), ...]``, drawn with markers in the loss panel.

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'apt_model[plot]'``).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ImportError("the report's PNG needs matplotlib: pip install 'apt_model[plot]'") from None

    data = plot_data(report, losses, evals)
    steps = report.get("steps") or {}
    records = steps.get("records") or []
    paged = data["levels"] is not None
    panels = 2 + (1 if paged else 0) + (1 if data["loss"] else 0)
    fig = Figure(figsize=(9, 2.6 * panels + 0.6), dpi=100)
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(panels, 1, sharex=True))
    cfg = report.get("config") or {}
    if title is None:
        title = f"Virtual Blackwell run: mode {cfg.get('mode') or 'off'}, device {steps.get('device') or cfg.get('device') or '?'}"
    stride = steps.get("stride", 1)
    if records:
        title += f" ({steps.get('count', 0)} steps" + (f", every {stride}th drawn)" if stride > 1 else ")")
    fig.suptitle(title)
    all_axes = list(axes)
    level_ax = axes.pop(0) if paged else None
    mem_ax, time_ax = axes[0], axes[1]
    if not records:
        for ax in [level_ax, mem_ax, time_ax]:
            if ax is not None:
                ax.text(0.5, 0.5, "no optimizer steps were recorded", ha="center", va="center", transform=ax.transAxes)
    else:
        if level_ax is not None:
            plot_lines(level_ax, data["levels"], "training state")
        plot_lines(mem_ax, data["memory"], "process memory")
        timed = data["step_time_ms"]
        if timed:
            time_ax.plot([t[0] for t in timed], [t[1] for t in timed], ".", markersize=3, label="step time")
            st = steps.get("step_time") or {}
            if st.get("median_s") is not None:
                time_ax.axhline(st["median_s"] * 1e3, color="C1", label=f"median {st['median_s'] * 1e3:.1f} ms "
                                                                      f"(last {st.get('window')} steps)")
                time_ax.axhspan(st["p25_s"] * 1e3, st["p75_s"] * 1e3, color="C1", alpha=0.15, label="p25-p75")
        # decisions made once steps were running (t is seconds since enable, like the records' t)
        times = [(r["t"], r["step"]) for r in records]
        marked = False
        for d in report.get("decisions") or []:
            if d.get("t") is None or d["t"] < times[0][0]:
                continue
            step_at = next((s for t, s in times if t >= d["t"]), times[-1][1])
            time_ax.axvline(step_at, color="gray", linestyle=":", label=None if marked else "switch decision")
            marked = True
        time_ax.set_ylabel("step time (ms)")
        time_ax.legend(loc="best", fontsize="small")
        time_ax.grid(alpha=0.3)
    if data["loss"]:
        ax = axes[-1]
        train = data["loss"].get("train")
        if train:
            ax.plot([s for s, _ in train], [v for _, v in train], "-", linewidth=1, label="training loss")
        held = data["loss"].get("held-out")
        if held:
            ax.plot([s for s, _ in held], [v for _, v in held], "o-", markersize=4, label="held-out loss")
        ax.set_ylabel("loss")
        ax.legend(loc="best", fontsize="small")
        ax.grid(alpha=0.3)
    for ax in all_axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    axes[-1].set_xlabel("optimizer step")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
