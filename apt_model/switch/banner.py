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
    for m in report["models"]:
        lines.append(f"  model {m['name']}#{m['id']} ({m['parameters']:,} params on {m['device']}, via {m['trigger']}):")
        for feat, d in m["features"].items():
            lines.append(f"    {feat:<25} {str(d['chosen']):<10} {d['reason']}")
    return "\n".join(lines)
