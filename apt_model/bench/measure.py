"""Measurement helpers shared by ``apt-vb bench`` and the scripts in ``benchmarks/``: machine
description, robust statistics, bounded timing loops, JSON output.

Rules every benchmark follows (DESIGN.md section 9): warm-up first, A and B interleaved in one
run, medians with spread, the thread count fixed and recorded, results written as JSON with the
machine description and printed as a short table.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import psutil
import torch


def machine_info(threads: int | None = None, device: str | None = None) -> dict:
    """CPU model, cores, threads, RAM, torch version, accelerator name (JSON-safe).

    Args:
        threads: the torch thread count the measurement used (default: the current one).
        device: also name this device (``device``, ``device_name``).
    """
    from apt_model.devices.backends.cpu import cpu_model_name
    from apt_model.devices.device_backend import DeviceBackend

    info = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu_model_name(),
        "cpu_isa": torch.backends.cpu.get_cpu_capability(),
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cores": psutil.cpu_count(logical=True),
        "torch_threads": threads if threads is not None else torch.get_num_threads(),
        "ram_bytes": psutil.virtual_memory().total,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if device:
        b = DeviceBackend(device)
        info["device"] = device
        info["device_name"] = b.get_device_name()
    return info


def load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (other processes competing for the cores), or None."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def summarize(samples: list[float]) -> dict:
    """Median, quartiles and min/max of ``samples`` (seconds), plus the count.

    Raises:
        ValueError: for an empty list.
    """
    if not samples:
        raise ValueError("summarize() needs at least one sample")
    s = sorted(samples)
    q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0], s[0], s[0]]
    return {"n": len(s), "median": statistics.median(s), "p25": q[0], "p75": q[2], "min": s[0], "max": s[-1]}


def time_calls(fn: Callable[[], object], sync: Callable[[], None] = lambda: None, budget_s: float = 1.0,
               max_reps: int = 20, warmup: int = 1) -> tuple[list[float], float]:
    """Time ``fn`` after ``warmup`` untimed calls, repeating within ``budget_s`` seconds.

    The warm-up call's time sets the number of timed calls (as many as fit the budget left,
    between 1 and ``max_reps``); the loop also stops once the budget is spent. ``sync`` is called
    before and after each timed call (an accelerator's queue must be empty for the time to mean
    anything).

    Returns:
        (per-call seconds of the timed calls, seconds of the last warm-up call).
    """
    t_start = time.perf_counter()
    warm = 0.0
    for _ in range(max(warmup, 0)):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        warm = time.perf_counter() - t0
    left = budget_s - (time.perf_counter() - t_start)
    reps = max(1, min(max_reps, int(left / warm) if warm > 0 else max_reps))
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - t_start > budget_s:
            break
    return times, warm


def write_json(result: dict, path: str | Path | None) -> None:
    """Write ``result`` as indented JSON to ``path`` (folders created); nothing when ``path`` is empty."""
    if path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(result, indent=2, default=str), encoding="utf-8")


def time_interleaved(fns: dict[str, Callable[[], object]], sync: Callable[[], None] = lambda: None,
                     budget_s: float = 1.0, max_rounds: int = 10) -> dict[str, list[float]]:
    """Time several variants of one computation in turns (A B B A, A B B A, ...), after one
    warm-up call each, so that a burst of noise hits them alike.

    Returns:
        ``{name: [per-call seconds]}``, the same count for every variant (at least one each).
    """
    t_start = time.perf_counter()
    names = list(fns)
    warm = 0.0
    for name in names:
        sync()
        t0 = time.perf_counter()
        fns[name]()
        sync()
        warm += time.perf_counter() - t0
    left = budget_s - (time.perf_counter() - t_start)
    rounds = max(1, min(max_rounds, int(left / warm) if warm > 0 else max_rounds))
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            sync()
            t0 = time.perf_counter()
            fns[name]()
            sync()
            out[name].append(time.perf_counter() - t0)
        if time.perf_counter() - t_start > budget_s:
            break
    return out
