"""The ``apt-vb bench`` suite: short, bounded measurements of each device, side by side.

Per device:

* ``gemm`` — ``a @ b`` of square matrices (256, 1024, 2048) in each dtype that computes there
  (float32, bfloat16, float16): GFLOP/s = 2 n^3 / time. A size whose projected call time (from
  the previous size's rate) exceeds the case's time budget is skipped, with the reason.
* ``elementwise`` — ``copy``, ``add``, ``gelu`` on float32 vectors (64 MiB on a CPU, 256 MiB on an
  accelerator): GB/s = bytes read + written / time.
* ``norm`` — ``layer_norm``, ``rms_norm``, ``softmax`` over rows of 1024: GB/s likewise.
* ``attention`` — causal attention forward + backward, SDPA vs hand-written masked softmax,
  timed in turns (A B B A): ms each and the speed-up.
* ``transfer`` (accelerators) — host to device and device to host, pageable and pinned: GB/s.

Per machine: ``disk`` — write and cold read of the swap folder's disk through the swap level's
own I/O path (:func:`apt_model.memory.bandwidth.measure_disk`): GB/s.

Every figure is a median with quartiles (p25, p75) over its timed calls, after a warm-up; the
torch thread count is set explicitly and recorded, with the load average before and after.
``duration`` bounds the measurements: each case gets its share (by weight) of the time left, so
slack from quick cases flows to later ones; a case always makes at least one timed call after its
warm-up, so the suite can overrun by about one call; cases left when the time is spent are
listed as skipped. The disk is measured first (its share is :data:`DISK_WEIGHT` cases).

Each device is set up before the clock starts (its capability probes, which decide the dtypes
that compute there, and an accelerator's context): that one-off cost is no throughput figure, and
on an accelerator it can exceed a short ``duration`` by itself. It is recorded per device as
``setup_s``. Cases then run in turns across devices (each case on every device before the next
case), so a short ``duration`` cuts the same rows on every device instead of starving the device
listed last.

Every result has the same shape on every device, per group (documented in docs/cli.md):
``group`` and ``unit``, then either ``skipped`` or ``error`` (the reason), or the figures: rate
groups (``gemm``, ``elementwise``, ``norm``, ``transfer``) ``median``, ``p25``, ``p75``, ``n``,
``time_ms``, ``warmup_ms``, ``spread``, ``noisy``; ``attention`` the same statistics per variant
(``sdpa``, ``plain``) with ``speedup``, ``spread``, ``noisy``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import zip_longest
from typing import Callable

import torch
import torch.nn.functional as F

from apt_model.bench.measure import load_average, machine_info, summarize, time_calls, time_interleaved
from apt_model.base.log import get_logger

log = get_logger(__name__)

GEMM_SIZES = (256, 1024, 2048)
GEMM_DTYPES = ("float32", "bfloat16", "float16")
#: The groups, in the order the suite runs them.
GROUPS = ("gemm", "elementwise", "norm", "attention", "transfer", "disk")
#: A result whose interquartile range is over this fraction of its median is flagged ``noisy``.
NOISY = 0.25


@dataclass
class Case:
    """One measurement on one device.

    Attributes:
        group: ``gemm``, ``elementwise``, ``norm``, ``attention``, ``transfer`` or ``disk``.
        name: the row label (unique within the suite), e.g. ``gemm 1024 float32``.
        unit: ``GFLOP/s``, ``GB/s`` or ``ms``.
        work: FLOPs or bytes per call (the rate is ``work / time``); 0 for ``ms`` cases.
        make: builds the inputs and returns the call to time (a dict of calls: timed in turns).
        series: cases of one series grow in cost; the previous rate projects the next call's time.
        weight: its share of the time budget relative to other cases (timed-in-turns cases run
            several variants per round).
    """

    group: str
    name: str
    unit: str
    work: float
    make: Callable[[], object]
    series: str | None = None
    weight: float = 1.0


#: The disk's share of the budget, in cases: each of its samples writes and reads 64 MiB twice.
DISK_WEIGHT = 3.0


def _sync_for(device: torch.device) -> Callable[[], None]:
    if device.type == "cpu":
        return lambda: None
    from apt_model.devices.device_backend import DeviceBackend

    return DeviceBackend(device).synchronize


def default_devices() -> list[str]:
    """The CPU and device 0 of every available accelerator kind (the ranking's order)."""
    from apt_model.devices.detection import detect_devices
    from apt_model.devices.ranking import rank

    out = []
    for c in rank(detect_devices()):
        name = "cpu" if c.device_type == "cpu" else f"{c.device_type}:0"
        if name not in out:
            out.append(name)
    if "cpu" not in out:
        out.append("cpu")
    return out


def prepare_device(device: torch.device) -> float:
    """Set ``device`` up before any timing: run its capability probes (they decide which dtypes
    compute there; cached per process) and, on an accelerator, create its context with one small
    operation. Returns the seconds it took."""
    from apt_model.devices.capabilities import get_support

    t0 = time.perf_counter()
    get_support(device)
    if device.type != "cpu":
        torch.ones(8, device=device).add_(1)
        _sync_for(device)()
    return round(time.perf_counter() - t0, 3)


def interleave(devices: list[torch.device], per_device: list[list[Case]]) -> list[tuple[torch.device, Case]]:
    """One plan from each device's cases: grouped in :data:`GROUPS` order, each case on every
    device that has it (in ``devices`` order) before the next case."""
    first_seen: dict[str, int] = {}
    for row in zip_longest(*per_device):
        for case in row:
            if case is not None:
                first_seen.setdefault(case.name, len(first_seen))
    plan = [(dev, case) for dev, cases in zip(devices, per_device) for case in cases]
    return sorted(plan, key=lambda p: (GROUPS.index(p[1].group), first_seen[p[1].name], devices.index(p[0])))


def device_cases(device: torch.device) -> list[Case]:
    """The cases for ``device`` (dtypes that do not compute there are left out)."""
    from apt_model.devices.capabilities import get_support

    support = get_support(device)
    accel = device.type != "cpu"
    cases: list[Case] = []
    for dname in GEMM_DTYPES:
        if not support.dtype_computes(dname):
            continue
        dt = getattr(torch, dname)
        for n in GEMM_SIZES:
            def make(n=n, dt=dt):
                a = torch.randn(n, n, device=device).to(dt)
                b = torch.randn(n, n, device=device).to(dt)
                return lambda: a @ b
            cases.append(Case("gemm", f"gemm {n} {dname}", "GFLOP/s", 2.0 * n**3, make, series=f"gemm {dname}"))

    n = (1 << 26) if accel else (1 << 24)  # float32 elements: 256 MiB / 64 MiB per vector
    rows = n // 1024

    def vec(k: int = 1):
        return [torch.randn(n, device=device) for _ in range(k)]

    def make_copy():
        a, b = vec(2)
        return lambda: b.copy_(a)

    def make_add():
        a, b, c = vec(3)
        return lambda: torch.add(a, b, out=c)

    def make_gelu():
        (a,) = vec(1)
        return lambda: F.gelu(a)

    nb = 4 * n
    cases += [Case("elementwise", "copy float32", "GB/s", 2 * nb, make_copy),
              Case("elementwise", "add float32", "GB/s", 3 * nb, make_add),
              Case("elementwise", "gelu float32", "GB/s", 2 * nb, make_gelu)]

    def make_norm(kind: str):
        def make():
            x = torch.randn(rows, 1024, device=device)
            w = torch.ones(1024, device=device)
            if kind == "layer_norm":
                return lambda: F.layer_norm(x, (1024,), w)
            if kind == "rms_norm":
                return lambda: F.rms_norm(x, (1024,), w)
            return lambda: torch.softmax(x, -1)
        return make

    for kind in ("layer_norm", "rms_norm", "softmax"):
        cases.append(Case("norm", f"{kind} float32", "GB/s", 2 * nb, make_norm(kind)))

    batch, heads, seq, hd = (8, 16, 2048, 64) if accel else (4, 8, 512, 64)

    def make_attention():
        from apt_model.devices.probes import attention_workloads  # the same pair the switch's probe times

        fns = attention_workloads(device, batch, heads, seq, hd)
        return {"sdpa": fns["sdpa"], "plain": fns["eager"]}

    cases.append(Case("attention", f"attention fwd+bwd float32 (b{batch} h{heads} s{seq} d{hd})", "ms", 0.0,
                      make_attention, weight=2.0))

    if accel:
        size = 256 << 20

        def make_link(direction: str, pinned: bool):
            def make():
                host = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
                dev = torch.empty(size, dtype=torch.uint8, device=device)
                if direction == "h2d":
                    return lambda: dev.copy_(host, non_blocking=pinned)
                return lambda: host.copy_(dev, non_blocking=pinned)
            return make

        for direction in ("h2d", "d2h"):
            for pinned in (False, True):
                label = f"{'host->device' if direction == 'h2d' else 'device->host'} {'pinned' if pinned else 'pageable'}"
                cases.append(Case("transfer", label, "GB/s", float(size), make_link(direction, pinned)))
    return cases


def _rate_stats(times: list[float], work: float, scale: float) -> dict:
    t = summarize(times)
    med = work / t["median"] / scale
    return {"median": med, "p25": work / t["p75"] / scale, "p75": work / t["p25"] / scale, "n": t["n"],
            "time_ms": {k: round(v * 1e3, 4) for k, v in t.items() if k != "n"}}


def _spread(stats: dict) -> float:
    t = stats["time_ms"]
    return (t["p75"] - t["p25"]) / t["median"] if t["median"] else 0.0


def _run_case(case: Case, device: torch.device, budget: float, projected_rate: float | None) -> dict:
    scale = 1e9
    if projected_rate and case.work:
        projected = case.work / (projected_rate * scale)
        if projected > budget:
            return {"group": case.group, "unit": case.unit, "skipped":
                    f"projected {projected:.2f} s per call from the previous size exceeds this case's {budget:.2f} s budget"}
    sync = _sync_for(device)
    try:
        fn = case.make()
        if isinstance(fn, dict):
            times = time_interleaved(fn, sync, budget)
            out = {"group": case.group, "unit": case.unit}
            for name, ts in times.items():
                t = summarize(ts)
                out[name] = {"median": t["median"] * 1e3, "p25": t["p25"] * 1e3, "p75": t["p75"] * 1e3, "n": t["n"]}
            first, second = list(times)[:2]
            out["speedup"] = out[second]["median"] / out[first]["median"]  # plain / sdpa: above 1, SDPA is faster
            out["spread"] = max((v["p75"] - v["p25"]) / v["median"] for k, v in out.items()
                                if isinstance(v, dict) and v.get("median"))
            out["noisy"] = out["spread"] > NOISY
            return out
        times, warm = time_calls(fn, sync, budget)
    except Exception as err:  # noqa: BLE001 - a failing case is a result, not a crash
        from apt_model.devices.probes import short_error

        return {"group": case.group, "unit": case.unit, "error": short_error(err)}
    out = {"group": case.group, "unit": case.unit, **_rate_stats(times, case.work, scale), "warmup_ms": round(warm * 1e3, 4)}
    out["spread"] = _spread(out)
    out["noisy"] = out["spread"] > NOISY
    return out


def _disk_case(folder, budget: float) -> dict:
    from apt_model.memory.bandwidth import measure_disk
    from apt_model.memory.swap import default_swap_root

    root = folder or default_swap_root()
    t_start = time.perf_counter()
    writes, reads = [], []
    try:
        if folder is None:
            root.mkdir(parents=True, exist_ok=True)
        while True:
            bw = measure_disk(root, mb=64)
            writes.append(bw["write"])
            reads.append(bw["read"])
            elapsed = time.perf_counter() - t_start
            if elapsed * (len(writes) + 1) / len(writes) > budget or len(writes) >= 7:
                break
    except Exception as err:  # noqa: BLE001
        from apt_model.devices.probes import short_error

        return {"group": "disk", "unit": "GB/s", "error": short_error(err), "folder": str(root)}
    out = {"group": "disk", "unit": "GB/s", "folder": str(root)}
    for name, rates in (("write", writes), ("read", reads)):
        s = summarize(rates)
        out[name] = {"median": s["median"], "p25": s["p25"], "p75": s["p75"], "n": s["n"]}
    out["spread"] = max((v["p75"] - v["p25"]) / v["median"] for v in (out["write"], out["read"]) if v["median"])
    out["noisy"] = out["spread"] > NOISY
    return out


def check_arguments(duration: float, threads: int | None = None, groups: tuple[str, ...] | None = None,
                    disk: bool = True, swap_dir=None, names: dict[str, str] | None = None) -> None:
    """Check :func:`run_suite`'s arguments, so that a bad one fails before anything runs (a
    duration of ``nan`` or ``inf`` used to turn every case into an error, and a missing swap
    folder into an error cell of the table).

    Args:
        duration, threads, groups, disk, swap_dir: as for :func:`run_suite`.
        names: how the messages name ``duration``, ``threads`` and ``swap_dir`` (default: the
            parameter, ``duration=...``; ``apt-vb bench`` passes its flags, ``--duration=...``).

    Raises:
        ConfigError: a duration that is not a finite number > 0, a thread count < 1, an unknown
            group, or, when the disk is measured, a ``swap_dir`` that is not an existing folder
            this process can write to; the message names the value and what is valid.
    """
    import math
    import os

    from apt_model.base.errors import ConfigError

    label = {"duration": "duration", "threads": "threads", "swap_dir": "swap_dir", **(names or {})}
    if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not math.isfinite(duration) \
            or duration <= 0:
        raise ConfigError(f"{label['duration']}={duration!r} must be > 0 seconds (a finite number)")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"{label['threads']}={threads!r} must be a whole number >= 1")
    bad = [g for g in (groups or ()) if g not in GROUPS]
    if bad:
        raise ConfigError(f"unknown group(s) {bad}; valid groups: {', '.join(GROUPS)}")
    if swap_dir is not None and disk and (not groups or "disk" in groups):
        folder = os.fspath(swap_dir)
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
            what = "a folder this process cannot write to" if os.path.isdir(folder) else "not an existing folder"
            raise ConfigError(f"{label['swap_dir']}={str(swap_dir)!r} is {what}; give an existing, writable "
                              f"folder, or leave {label['swap_dir']} out to measure the default swap folder")


def run_suite(devices: list[str] | None = None, duration: float = 30.0, threads: int | None = None,
              disk: bool = True, swap_dir=None, progress: Callable[[str], None] | None = None,
              groups: tuple[str, ...] | None = None) -> dict:
    """Run the suite on ``devices`` within about ``duration`` seconds.

    Args:
        devices: device names (``cpu``, ``cuda:0``...); None: :func:`default_devices`.
        duration: seconds for the measurements (> 0; each device's setup comes before and is recorded
            as its ``setup_s``); a call already running finishes.
        threads: torch CPU threads, set for the run and restored after (default: the current count).
        disk: also measure the disk of ``swap_dir`` (default: the swap level's folder).
        progress: called with each case's label as it starts (for a progress bar).
        groups: only these groups (``gemm``, ``elementwise``, ``norm``, ``attention``, ``transfer``, ``disk``).

    Returns:
        A JSON-safe dict: ``machine``, ``settings``, ``noise``, ``devices`` ({device: {"name",
        "setup_s", "cases": {name: result}}}), ``disk``, ``elapsed_s``. See docs/cli.md for every field.

    Raises:
        ConfigError / DeviceSelectionError: a malformed or unusable device; ConfigError (a
            ValueError), before anything runs: see :func:`check_arguments`.
    """
    from apt_model.devices.device_backend import DeviceBackend
    from apt_model.devices.ranking import select_device

    valid_groups = GROUPS
    check_arguments(duration, threads, groups, disk=disk, swap_dir=swap_dir)
    step = progress or (lambda label: None)
    t_begin = time.perf_counter()
    old_threads = torch.get_num_threads()
    threads = threads or old_threads
    torch.set_num_threads(threads)
    load_before = load_average()
    try:
        names = devices or default_devices()
        devs = list(dict.fromkeys(select_device(device=d).device for d in names))  # each device once
        result: dict = {"devices": {}}
        for dev in devs:  # before the clock: probes and context creation are no throughput figure
            result["devices"][str(dev)] = {"name": DeviceBackend(dev).get_device_name(),
                                           "setup_s": prepare_device(dev), "cases": {}}
        plan = interleave(devs, [[c for c in device_cases(dev) if not groups or c.group in groups] for dev in devs])
        do_disk = disk and (not groups or "disk" in groups)
        t_start = time.perf_counter()
        weight_left = sum(c.weight for _, c in plan) + (DISK_WEIGHT if do_disk else 0.0)
        result["disk"] = None
        if do_disk:
            step("disk")
            result["disk"] = _disk_case(swap_dir, (duration - (time.perf_counter() - t_start)) * DISK_WEIGHT / weight_left)
            weight_left -= DISK_WEIGHT
        last_rate: dict[tuple, float] = {}
        for dev, case in plan:
            left = duration - (time.perf_counter() - t_start)
            cases = result["devices"][str(dev)]["cases"]
            if left <= 0:
                cases[case.name] = {"group": case.group, "unit": case.unit, "skipped": "--duration reached"}
                continue
            step(f"{dev} {case.name}")
            budget = left * case.weight / weight_left
            weight_left -= case.weight
            r = _run_case(case, dev, budget, last_rate.get((str(dev), case.series)) if case.series else None)
            if case.series and "median" in r:
                last_rate[(str(dev), case.series)] = r["median"]
            cases[case.name] = r
    finally:
        torch.set_num_threads(old_threads)
    elapsed = time.perf_counter() - t_begin
    load_after = load_average()
    all_results = [r for d in result["devices"].values() for r in d["cases"].values()]
    if result.get("disk"):
        all_results.append(result["disk"])
    noisy = sum(1 for r in all_results if r.get("noisy"))
    result.update({
        "kind": "apt-vb bench",
        "machine": machine_info(threads),
        "settings": {"devices": [str(d) for d in devs], "duration_s": duration, "threads": threads,
                     "interop_threads": torch.get_num_interop_threads(), "groups": list(groups or valid_groups)},
        "noise": {"load_before": load_before, "load_after": load_after, "noisy_results": noisy,
                  "noisy_threshold": NOISY,
                  "note": _noise_note(threads, load_before, load_after, noisy)},
        "elapsed_s": round(elapsed, 3),
    })
    return result


def _noise_note(threads: int, before, after, noisy: int) -> str:
    import psutil

    cores = psutil.cpu_count(logical=True) or 1
    parts = [f"{threads} torch thread(s) on {cores} logical core(s)"]
    if before and after:
        parts.append(f"load average {before[0]:.2f} -> {after[0]:.2f}")
        # judged on the load before the run: the load after includes the suite's own threads
        # (the 1-minute average also lags, so a busy minute just before the run counts too)
        if before[0] > max(0.5, cores - threads):
            parts.append("other processes were competing for the cores: treat the figures as lower bounds")
    if noisy:
        parts.append(f"{noisy} result(s) with an interquartile range over {int(NOISY * 100)}% of the median")
    return "; ".join(parts)


def _fmt(r: dict | None) -> str:
    if r is None:
        return "-"
    if "skipped" in r:
        return "skipped"
    if "error" in r:
        return "error"
    flag = " ~" if r.get("noisy") else ""  # every result the footer counts as noisy is marked
    if "speedup" in r:
        s, p = r["sdpa"], r["plain"]
        return f"SDPA {s['median']:.1f} / plain {p['median']:.1f} ms ({r['speedup']:.2f}x){flag}"
    return f"{r['median']:.1f} ({r['p25']:.1f}-{r['p75']:.1f}){flag}"


def format_table(result: dict) -> str:
    """The side-by-side table: one row per case, one column per device (median and p25-p75)."""
    devs = list(result["devices"])
    rows: dict[str, str] = {}
    for d in devs:
        for name, r in result["devices"][d]["cases"].items():
            rows.setdefault(name, r["unit"])
    width = max([len(n) for n in rows] + [10]) + 2
    col = max(30, *(len(_fmt(result["devices"][d]["cases"].get(n))) + 2 for d in devs for n in rows)) if rows else 30
    s = result["settings"]
    out = [f"apt-vb bench: {result['machine']['cpu']}, torch {result['machine']['torch']}, "
           f"{s['threads']} thread(s), {result['elapsed_s']:.1f} s (--duration {s['duration_s']:g})",
           f"{'case':<{width}}{'unit':<9}" + "".join(f"{d + ' ' + (result['devices'][d]['name'] or ''):<{col}}"[:col]
                                                   for d in devs)]
    for name, unit in rows.items():
        out.append(f"{name:<{width}}{unit:<9}" + "".join(f"{_fmt(result['devices'][d]['cases'].get(name)):<{col}}" for d in devs))
    disk = result.get("disk")
    if disk:
        if "write" in disk:
            w, r = disk["write"], disk["read"]
            out.append(f"{'disk ' + disk['folder']:<{width}}{'GB/s':<9}write {w['median']:.2f} ({w['p25']:.2f}-{w['p75']:.2f}), "
                       f"cold read {r['median']:.2f} ({r['p25']:.2f}-{r['p75']:.2f})" + (" ~" if disk.get("noisy") else ""))
        else:
            out.append(f"{'disk':<{width}}{'GB/s':<9}{disk.get('skipped') or disk.get('error')}")
    skipped = [(d, n, r["skipped"]) for d in devs for n, r in result["devices"][d]["cases"].items() if "skipped" in r]
    errors = [(d, n, r["error"]) for d in devs for n, r in result["devices"][d]["cases"].items() if "error" in r]
    for d, n, why in skipped:
        out.append(f"  skipped on {d}: {n}: {why}")
    for d, n, why in errors:
        out.append(f"  error on {d}: {n}: {why}")
    out.append(f"medians over timed calls after a warm-up, (p25-p75); ~ = interquartile range over "
               f"{int(NOISY * 100)}% of the median. Noise: {result['noise']['note']}")
    return "\n".join(out)
