"""``apt-vb info``: what this machine has, what was chosen and why, what runs there."""
from __future__ import annotations

import json
import sys

from apt_model.core.system import get_memory_info
from apt_model.devices.capabilities import get_speed, get_support
from apt_model.devices.detection import detect_devices
from apt_model.devices.device_backend import DeviceBackend
from apt_model.devices.ranking import select_device
from apt_model.base.sizes import format_size


def collect_info(device: str | None = None, probe: bool = True, progress=None) -> dict:
    """Everything ``apt-vb info`` shows, as a JSON-safe dict.

    Keys: ``candidates`` (every kind: status, reason, count, names, dist backend, visible-devices
    variable), ``selected`` (device, kind, reason, ranking, dist_backend), ``config`` (the mode and
    the budgets in force, with their sources, and the ``.vbrc`` files read), ``memory`` (bytes per
    tier: ``device``, ``host``, ``disk``; with probes also ``levels``, ``stack`` and ``swap_dir``:
    the VGPU stack this configuration gives, capacities in bytes, bandwidths measured in GB/s),
    ``capabilities`` (``support`` and ``speed`` probe results, or None with ``--no-probe``),
    ``compile_ladder`` (per detected kind: the rungs it offers, see
    :func:`apt_model.compile.backends.ladder_rungs`).

    Args:
        device: describe this device instead of the ranking's choice.
        probe: run the capability probes and measure the levels' bandwidths (a few seconds).
        progress: called with a label before each probing phase.

    Raises:
        ConfigError: a bad ``VB_*`` variable or ``.vbrc`` (the configuration is shown, so it is read).
    """
    from apt_model.switch.config import build_config

    step = progress or (lambda label: None)
    cfg = build_config(None, {})
    cands = detect_devices(refresh=True, allow_init=True)  # a CLI process may initialize devices
    sel = select_device(device=device or cfg.device, candidates=cands)
    backend = DeviceBackend(sel.device)
    mem = get_memory_info()
    tiers = {
        "device": backend.get_memory_summary(),
        "host": mem["ram"],
        "disk": mem["disk"],
    }
    caps = None
    if probe:
        step(f"probing what runs on {sel.device}")
        support = get_support(sel.device).to_dict()
        step(f"probing speed on {sel.device}")
        caps = {"support": support, "speed": get_speed(sel.device).to_dict()}
        from apt_model.memory.levels import HEADROOM, VGPUStack

        step("measuring the memory levels")
        headroom = HEADROOM["tight" if cfg.paging == "tight" else "over_budget"]
        stack = VGPUStack(sel.device, cfg.device_budget, cfg.host_budget, cfg.swap_dir, cfg.swap_budget,
                          headroom=headroom, measure=True)  # the stack enable() would build here
        try:
            levels = stack.describe()["levels"]
            for lv in levels:
                if lv["kind"] == "nvme":  # this process's folder is deleted at exit: show the swap dir
                    lv["device"] = f"nvme:{stack.swap.root}"
            tiers["levels"] = levels
            tiers["swap_dir"] = str(stack.swap.root)
            tiers["stack"] = [str(lv).replace(str(stack.swap.folder), str(stack.swap.root)) for lv in stack.levels]
        finally:
            stack.close()
    budget_keys = ("device_budget", "host_budget", "swap_dir", "swap_budget")
    config = {"mode": cfg.mode, "mode_source": cfg.sources["mode"], "paging": cfg.paging,
              "paging_source": cfg.sources["paging"],
              "budgets": {k: {"value": cfg.settings[k], "source": cfg.sources[k]} for k in budget_keys},
              "files": cfg.config_files()}
    from apt_model.compile.backends import ladder_rungs
    from apt_model.devices.registry import registered_backends
    from apt_model.switch.adoption import builtin_overrides

    builtin = builtin_overrides()
    ladder = {b.kind: ladder_rungs(b, builtin) for b in registered_backends()
              if any(c.kind == b.kind for c in cands)}
    return {
        "candidates": [c.to_dict() for c in cands],
        "compile_ladder": ladder,
        "selected": sel.to_dict(),
        "config": config,
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
    ladder = info.get("compile_ladder") or {}
    if ladder:
        out.append("\nCompile ladder per kind (rungs tried in order in performance mode; balanced: override, eager)")
        for kind, rungs in ladder.items():
            shown = "; ".join(f"{r['rung']}: {r['how'] if r['offered'] else 'not offered (' + r['how'] + ')'}"
                              for r in rungs)
            out.append(f"  {kind:<6} {shown}")
    s = info["selected"]
    out.append(f"\nSelected: {s['device']} ({s['kind']}) — {s['reason']}")
    out.append(f"Communication backend: {s['dist_backend'] or 'none'}")
    c = info["config"]
    budgets = ", ".join(f"{k} {v['value']} ({v['source']})" for k, v in c["budgets"].items() if v["value"] is not None)
    out.append(f"Configuration: mode {c['mode']} ({c['mode_source']}), paging {c['paging']} ({c['paging_source']})"
               + (f"; {budgets}" if budgets else "; budgets: defaults")
               + (f"; files: {', '.join(c['files'])}" if c["files"] else "; no .vbrc"))
    m = info["memory"]
    if m.get("levels"):
        out.append("\nVGPU stack (the levels enable() would build here: capacity for this run, measured bandwidth)")
        out.append(f"  {'level':<6} {'kind':<7} {'capacity':>10}  {'GB/s':>7}  {'measured':<30} backing")
        for lv in m["levels"]:
            gbps = f"{lv['gbps']:.2f}" if lv["gbps"] is not None else "-"
            detail = ", ".join(f"{k} {v:.2f}" for k, v in lv["detail"].items()) or (
                "copy (read+write)" if lv["index"] == 0 else "")
            backing = lv["device"] + (f"  [{lv['note']}]" if lv["note"] else "")
            out.append(f"  {lv['index']:<6} {lv['kind']:<7} {format_size(lv['capacity']):>10}  {gbps:>7}  {detail:<30} {backing}")
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
    """Print ``apt-vb info`` (tables, or JSON with ``--json``); a progress bar on stderr while probing."""
    from tqdm.auto import tqdm

    bar = tqdm(total=3 if not args.no_probe else 0, desc="info", unit="phase", file=sys.stderr,
               disable=None if not args.no_probe else True)

    def step(label: str) -> None:
        bar.set_postfix_str(label, refresh=False)
        bar.update(1)

    try:
        info = collect_info(device=args.device, probe=not args.no_probe, progress=step)
    finally:
        bar.close()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        print(format_info(info))
    return 0
