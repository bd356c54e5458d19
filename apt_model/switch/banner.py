"""Text shown to the user: the enable banner and the ``print_stats()`` table."""
from __future__ import annotations

from apt_model._version import __version__

_STATUS_WORD = {"off": "off", "requested": "on (decided per model on the device's probes)",
                "not built": "NOT BUILT in this version (requested by the mode; nothing is done)"}


def format_banner(config: dict, selection) -> str:
    """The enable banner: mode, device and why, and one line per feature with its status."""
    lines = [f"Virtual Blackwell {__version__} enabled: mode={config['mode']}, device={config['device']}"]
    if selection is not None:
        lines.append(f"  device: {selection.reason}")
    for name, f in config["features"].items():
        value = f["value"]
        lines.append(f"  {name:<25} {str(value):<12} {_STATUS_WORD[f['status']]}")
    lines.append("  decisions: vb.get_report()['decisions'] or vb.print_stats()")
    return "\n".join(lines)


def _fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def format_stats(report: dict) -> str:
    """``print_stats()`` text: counters, memory, and each adopted model's decisions."""
    s = report["stats"]
    cfg = report["config"]
    lines = [f"Virtual Blackwell {report['version']} — {'enabled' if s['enabled'] else 'disabled'}, "
             f"mode={cfg.get('mode')}, device={s['device']}"]
    lines.append(f"  adopted models: {s['adopted_models']}, attention on SDPA: {s['attention_routed']}, "
                 f"autocast: {s['autocast_models']} ({s['autocast_calls']} calls), "
                 f".cuda() redirects: {s['cuda_redirects']}, probes: {s['probe_seconds']:.2f} s")
    mem = s.get("memory") or {}
    if mem:
        lines.append("  memory: " + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in mem.items()))
    levels = s.get("levels")
    if levels:
        lines.append(f"  {'level':<22} {'capacity':>10} {'resident':>10} {'in':>10} {'out':>10} "
                     f"{'hits':>6} {'misses':>7} {'GB/s':>11} {'stall s':>8}")
        for lv in levels:
            gbps = lv.get("measured_gbps")
            if lv["kind"] == "nvme" and lv.get("write_gbps"):
                gbps_txt = f"w{lv['write_gbps']:.2f}/r{(lv.get('read_gbps') or 0):.2f}"
            else:
                gbps_txt = f"{gbps:.1f}" if gbps else "-"
            lines.append(
                f"  Level {lv['level']} {lv['kind']:<14} {_fmt_bytes(lv['capacity']):>10} "
                f"{_fmt_bytes(lv.get('resident_bytes')):>10} {_fmt_bytes(lv.get('bytes_in')):>10} "
                f"{_fmt_bytes(lv.get('bytes_out')):>10} {str(lv.get('hits', '-')):>6} {str(lv.get('misses', '-')):>7} "
                f"{gbps_txt:>11} {lv.get('stall_s', 0) or 0:>8.2f}")
    for m in report["models"]:
        lines.append(f"  model {m['name']}#{m['id']} ({m['parameters']:,} params on {m['device']}, via {m['trigger']}):")
        for feat, d in m["features"].items():
            lines.append(f"    {feat:<25} {str(d['chosen']):<10} {d['reason']}")
    return "\n".join(lines)
