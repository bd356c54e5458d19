"""Measurement helpers shared by the benchmarks: machine description, robust statistics, output.

Rules every benchmark follows (DESIGN.md section 9): warm-up first, A and B interleaved in one
run, medians with spread, the thread count fixed and recorded, results written as JSON with the
machine description and printed as a short table.
"""
from __future__ import annotations

import datetime as _dt
import json
import platform
import statistics
from pathlib import Path

import psutil
import torch


def machine_info(threads: int | None = None, device: str | None = None) -> dict:
    """CPU model, cores, threads, RAM, torch version, accelerator name (JSON-safe)."""
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


def summarize(samples: list[float]) -> dict:
    """Median, quartiles and min/max of ``samples`` (seconds), plus the count."""
    s = sorted(samples)
    q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0], s[0], s[0]]
    return {"n": len(s), "median": statistics.median(s), "p25": q[0], "p75": q[2], "min": s[0], "max": s[-1]}


def write_json(result: dict, path: str | Path | None) -> None:
    if path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(result, indent=2, default=str), encoding="utf-8")


def train_step(model, opt, corpus, gen, batch_size: int, seq_len: int, device="cpu", clip: float | None = 1.0) -> float:
    """One full training step of a byte-level LM on ``corpus`` (batch, forward, loss, backward,
    clipping, optimizer step); returns its wall time in seconds (``loss.item()`` included, so the
    device has finished)."""
    import time

    import torch.nn.functional as F

    t0 = time.perf_counter()
    x, y = corpus.batch("train", batch_size, seq_len, gen, device)
    loss = F.cross_entropy(model(x).reshape(-1, 256).float(), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    loss.item()
    return time.perf_counter() - t0
