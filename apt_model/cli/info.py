"""``apt-vb info``: what this machine has, what was chosen and why, what runs there."""
from __future__ import annotations

import json

from apt_model.core.system import get_memory_info
from apt_model.devices.capabilities import get_speed, get_support
from apt_model.devices.detection import detect_devices
from apt_model.devices.device_backend import DeviceBackend
from apt_model.devices.ranking import select_device


def collect_info(device: str | None = None, probe: bool = True) -> dict:
    """Everything ``apt-vb info`` shows, as a JSON-safe dict.

    Keys: ``candidates`` (every kind: status, reason, count, names, dist backend, visible-devices
    variable), ``selected`` (device, kind, reason, ranking, dist_backend), ``memory`` (bytes per
    tier: ``device``, ``host``, ``disk``), ``capabilities`` (``support`` and ``speed`` probe
    results, or None with ``--no-probe``).
    """
    cands = detect_devices(refresh=True, allow_init=True)  # a CLI process may initialize devices
    sel = select_device(device=device, candidates=cands)
    backend = DeviceBackend(sel.device)
    mem = get_memory_info()
    tiers = {
        "device": backend.get_memory_summary(),
        "host": mem["ram"],
        "disk": mem["disk"],
    }
    caps = None
    if probe:
        caps = {"support": get_support(sel.device).to_dict(), "speed": get_speed(sel.device).to_dict()}
        from apt_model.memory.levels import VGPUStack

        stack = VGPUStack(sel.device, measure=True)  # capacities and measured bandwidths per level
        try:
            tiers["levels"] = stack.describe()["levels"]
            tiers["stack"] = str(stack).splitlines()
        finally:
            stack.close()
    return {
        "candidates": [c.to_dict() for c in cands],
        "selected": sel.to_dict(),
        "memory": tiers,
        "capabilities": caps,
    }


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.1f} GiB"


def format_info(info: dict) -> str:
    """The human-readable tables."""
    out = ["Device candidates (ranking: " + " > ".join(info["selected"]["ranking"]) + ")"]
    out.append(f"  {'kind':<6} {'status':<14} {'count':>5}  {'comm':<6} reason")
    for c in info["candidates"]:
        out.append(f"  {c['kind']:<6} {c['status']:<14} {c['count']:>5}  {str(c['dist_backend'] or '-'):<6} {c['reason']}")
    s = info["selected"]
    out.append(f"\nSelected: {s['device']} ({s['kind']}) — {s['reason']}")
    out.append(f"Communication backend: {s['dist_backend'] or 'none'}")
    m = info["memory"]
    if m.get("stack"):
        out.append("\nVGPU stack (capacity for this run, measured bandwidth)")
        out.extend(f"  {line}" for line in m["stack"])
    out.append("\nMemory tiers")
    dev = m["device"]
    if dev["kind"] == "cpu":
        out.append("  device  cpu      (no accelerator: the compute device's memory is host RAM)")
    else:
        out.append(f"  device  {dev['device']:<8} total {_gib(dev['total'])}, free {_gib(dev['free'])}")
    out.append(f"  host    RAM      total {_gib(m['host']['total'])}, available {_gib(m['host']['available'])}")
    if "free" in m["disk"]:
        out.append(f"  disk    {m['disk']['path']}  total {_gib(m['disk']['total'])}, free {_gib(m['disk']['free'])}")
    caps = info["capabilities"]
    if caps:
        sup, sp = caps["support"], caps["speed"]
        compute = [n for n, d in sup["dtypes"].items() if d.get("matmul") and d.get("add")]
        storage = [n for n, d in sup["dtypes"].items() if d.get("storage") and n not in compute]
        out.append(f"\nCapabilities of {sup['device']} (probed in {sup['seconds'] + sp['seconds']:.2f} s)")
        out.append(f"  compute dtypes: {', '.join(compute)}")
        out.append(f"  storage-only dtypes: {', '.join(storage) or '-'}")
        runs = [b for b, per in sup["sdpa_backends"].items() if per.get("float32") == "ok"]
        out.append(f"  SDPA backends (fp32): {', '.join(runs) or 'none'}")
        att = sp["attention"]
        if "speedup" in att:
            out.append(f"  SDPA vs hand-written attention (width {sp['width']}): {att['speedup']:.2f}x")
        for dt, r in sp["autocast"].items():
            if "speedup" in r:
                out.append(f"  {dt} autocast vs fp32 (width {sp['width']}): {r['speedup']:.2f}x")
            else:
                out.append(f"  {dt} autocast: {r.get('error')}")
        out.append(f"  FP8 matmul: {'yes' if sup['fp8_matmul'].get('supported') else 'no'} ({sup['fp8_matmul'].get('reason')})")
        out.append(f"  FP4 matmul: {'yes' if sup['fp4_matmul'].get('supported') else 'no'} ({sup['fp4_matmul'].get('reason')})")
    return "\n".join(out)


def run_info(args) -> int:
    info = collect_info(device=args.device, probe=not args.no_probe)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        print(format_info(info))
    return 0
