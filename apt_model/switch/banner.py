"""Text shown to the user: the enable banner and the ``print_stats()`` table.

The banner (printed by ``enable()``, once per job, by rank 0 only) comes in two forms:

* short (the default): one header line (version, mode, device) and one line per feature giving
  the requested value and, in a few words, what the switch will do with it on this device;
* long (``verbose=True``, or the ``apt_model`` logger at INFO or DEBUG, e.g. ``VB_LOG_LEVEL=INFO``):
  the device choice with every candidate, each feature's source and description, the settings
  that differ from their defaults with their sources, and the ``.vbrc`` files read.

Every feature line says what the switch *will* do, which for most features depends on the model
and the device's probes: such lines say "where ..." and name the condition, never plain "on".
"""
from __future__ import annotations

from apt_model.base.version import __version__

#: What the banner says for a requested feature this version does not implement.
NOT_BUILT = "NOT BUILT in this version (requested by the mode; nothing is done)"


def _size(n) -> str:
    from apt_model.base.sizes import format_size

    return format_size(n)


def _device_note(selection, facts: dict) -> str:
    """A few words on why this device (the long form has the whole ranking)."""
    if selection is None:
        return ""
    src = selection.source
    if src == "argument":
        note = "as asked by device="
    elif src == "VB_DEVICE":
        note = "from VB_DEVICE"
    elif src == "force_cpu":
        note = "force_cpu=True"
    elif selection.device.type == "cpu" and len(selection.ranking) <= 1:  # the CPU is the only usable kind
        note = "no accelerator found"
    else:
        note = "first of the usable devices by the ranking"
    world = facts.get("world_size") or 1
    if world > 1:
        note += f"; {world} ranks sharing the CPU" if selection.device.type == "cpu" else f"; {world} ranks, each on its own device"
    return note


def feature_effect(name: str, value, config: dict, facts: dict) -> str:
    """What the switch will do with feature ``name`` at ``value`` on this device, in a few words.

    Args:
        name: a feature of :data:`apt_model.switch.modes.FEATURES`.
        value: its requested value.
        config: ``vb.get_config()`` (settings such as ``autocast_min_speedup`` and ``fp4_policy``).
        facts: ``device_type`` (``cpu``, ``cuda``...), ``budget`` (level-0 bytes for training
            state, or None when the switch built no memory stack), ``activation_budget`` (bytes or None).

    Returns:
        One line of text (no newline).
    """
    settings = {k: v.get("value") for k, v in (config.get("settings") or {}).items()}
    dev = facts.get("device_type") or "this device"
    budget = facts.get("budget")
    if value in (False, "off"):
        return "off"
    if name == "attention":
        if value == "sdpa":
            return f"SDPA for hand-written attention wherever SDPA runs on {dev}"
        return f"SDPA for hand-written attention where a probe on {dev} finds it as fast"
    if name == "mixed_precision":
        if value == "auto":
            probe = f"a probe (>={float(settings.get('autocast_min_speedup') or 1.1):.2f}x)"
            if settings.get("autocast_trial_calls") == 0:  # no on-line trial: the probe alone decides
                return f"bf16 only where {probe} finds it faster"
            return f"bf16 only where {probe} and a trial on the model find it faster"
        return f"{value} autocast wherever it runs on {dev} (forced" + ("; use a GradScaler)" if value == "fp16" else ")")
    if name == "compile":
        if value == "override":
            return "hand-written attention -> SDPA in the captured model, kept only if a trial finds it faster"
        return "torch.compile, else the SDPA override, else eager: each kept only if a trial on the model finds it faster"
    if name == "tf32":
        if dev != "cuda":
            return f"{dev} has no TF32 units: fp32 matmuls unchanged"
        return "fp32 matmuls on TF32 tensor cores where the GPU has them (compute capability >= 8.0)"
    if name == "fp4":
        fmt = str((settings.get("fp4_policy") or {}).get("format") or "nvfp4").upper()
        native_here = dev == "cuda"  # the only device type with FP4 matrix units (probed per model)
        storage = f"frozen nn.Linear weights in {fmt}; a model with no frozen layer is unchanged"
        if value == "storage":
            return storage
        if value == "native":
            if native_here:
                return "FP4 matmul for frozen layers where the probe finds FP4 units; else unchanged"
            return f"{dev} has no FP4 matmul: no layer changes"
        if native_here:
            return storage + "; FP4 matmul where the probe finds FP4 units"
        return f"frozen nn.Linear weights in {fmt} ({dev} has no FP4 matmul); a model with no frozen layer is unchanged"
    if name == "activation_checkpointing":
        return f"repeated blocks recompute activations in backward (policy {settings.get('checkpoint_policy') or 'all'})"
    if name == "activation_offload":
        ab = facts.get("activation_budget")
        return f"saved activations beyond {_size(ab) if ab else 'activation_budget'} go to host/swap until backward"
    if name == "paging":
        level0 = _size(budget) if budget else "the level-0 budget"
        text = (f"training state always paged (level 0: {level0})" if value == "always" else
                f"by budget: training state paged only if over {level0} (level 0)")
        if (facts.get("world_size") or 1) > 1 and settings.get("distributed", "auto") == "auto":
            text += "; never for a model under DDP"
        return text
    return str(value)


def banner_lines(config: dict, selection, facts: dict | None = None, long: bool = False) -> list[str]:
    """The enable banner as lines (see the module docstring for the two forms).

    Args:
        config: ``vb.get_config()``.
        selection: the :class:`~apt_model.devices.ranking.Selection` (None: no device line detail).
        facts: see :func:`feature_effect`; also ``world_size``.
        long: the long form.

    Returns:
        The lines, without newlines: 1 + one per feature in the short form.
    """
    facts = facts or {}
    note = _device_note(selection, facts)
    lines = [f"Virtual Blackwell {__version__} enabled: mode={config['mode']}, device={config['device']}"
             + (f" ({note})" if note else "")]
    if long:
        lines.append(f"  mode from: {config.get('mode_source')}")
        if selection is not None:
            lines.append(f"  device: {selection.reason}")
    width = max((len(n) for n in config["features"]), default=10) + 2
    for name, f in config["features"].items():
        value = f["value"]
        effect = NOT_BUILT if f["status"] == "not built" else feature_effect(name, value, config, facts)
        lines.append(f"  {name:<{width}}{str(value):<13}{effect}")
        if long:
            lines.append(f"  {'':<{width}}{'':<13}(from {f.get('source')}) {f.get('description', '')}")
    if long:
        from apt_model.switch.config import SETTINGS

        changed = [(k, s) for k, s in (config.get("settings") or {}).items()
                   if s.get("source") not in (None, "default") and k in SETTINGS]
        for k, s in changed:
            lines.append(f"  setting {k} = {s['value']!r} (from {s['source']})")
        files = config.get("config_files") or []
        lines.append(f"  configuration files: {', '.join(files) if files else 'none'}")
        lines.append("  decisions: vb.get_report()['decisions'] or vb.print_stats()")
    return lines


def format_banner(config: dict, selection, facts: dict | None = None, long: bool = False) -> str:
    """:func:`banner_lines` joined with newlines."""
    return "\n".join(banner_lines(config, selection, facts, long))


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
    dist = report.get("distributed") or {}
    world = dist.get("world_size") or 1
    # under a launcher every rank prints its own: say whose (a probe's finding: two identical tables)
    rank = f", rank {dist.get('rank', 0)} of {world}" if world > 1 else ""
    lines = [f"Virtual Blackwell {report['version']} — {'enabled' if s['enabled'] else 'disabled'}, "
             f"mode={cfg.get('mode')}, device={s['device']}{rank}"]
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
        for lv in levels:
            if lv.get("stale_bytes"):  # removed pages' files, kept for the next writes to reuse
                lines.append(f"  swap files: {_fmt_bytes(lv.get('resident_bytes'))} in use and "
                             f"{_fmt_bytes(lv['stale_bytes'])} stale on disk (removed pages' files, reused by the "
                             "next writes; counted against swap_budget)")
        top = levels[0]
        over = (top.get("resident_bytes") or 0) - (top.get("capacity") or 0)
        if top.get("capacity") and over > 0:  # a probe's finding: the table showed it with no word why
            lines.append(f"  level 0 holds {_fmt_bytes(over)} above its capacity now: pages that tensors the script "
                         "keeps still use (a model.state_dict() it holds is aliases of the parameters: on a CPU "
                         "run they stay resident, as without the switch) or pinned during an op; docs/tiers.md, "
                         "'Checkpoints' and 'Stats'")
        phases = (levels[0].get("stall_s_by_phase") or {}) if levels else {}
        if any(phases.values()):
            lines.append("  level 0 stalled in: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()))
    off = (report.get("activations") or {}).get("offload") or {}
    if off.get("packed"):
        lines.append(f"  activation offload: {off['packed']} saved tensors ({_fmt_bytes(off.get('packed_bytes'))}), "
                     f"{off.get('offloaded', 0)} offloaded ({_fmt_bytes(off.get('offloaded_bytes'))}, "
                     f"{_fmt_bytes(off.get('to_disk_bytes'))} to the swap files), "
                     f"{_fmt_bytes(off.get('loaded_bytes'))} read back, peak in memory "
                     f"{_fmt_bytes(off.get('peak_resident'))}, stalled {off.get('stall_s', 0) or 0:.2f} s")
    sib = ((report.get("memory") or {}).get("paging") or {}).get("step_in_backward")
    if sib:
        where = {"armed": "inside backward", "pending": "inside backward",
                 "learning": "after backward (learning the loop)"}.get(sib["state"], "after backward")
        lines.append(f"  paged optimizer step: {where} ({sib['steps_in_backward']} in backward, "
                     f"{sib['rolled_back']} rolled back): {sib['reason']}")
    dropped = [m for m in report["models"] if m.get("alive") is False]
    if dropped:  # a sweep's finished models: one line, not a block each
        lines.append(f"  models the script dropped (freed): {len(dropped)} ("
                     + ", ".join(f"{m['name']}#{m['id']}" for m in dropped[:8]) + (", ..." if len(dropped) > 8 else "")
                     + "); their decisions stay in get_report()['models']")
    for m in report["models"]:
        if m.get("alive") is False:
            continue
        lines.append(f"  model {m['name']}#{m['id']} ({m['parameters']:,} params on {m['device']}, via {m['trigger']}):")
        feats = m["features"]
        name_w = max((len(f) for f in feats), default=10) + 2
        chosen_w = max((len(str(d["chosen"])) for d in feats.values()), default=8) + 2
        for feat, d in feats.items():
            chosen, reason = str(d["chosen"]), str(d["reason"])
            if reason.startswith(chosen + ":"):  # "single process: single process: ..." reads as a glitch
                reason = reason[len(chosen) + 1:].lstrip()
            calls = d.get("calls")
            if feat == "activation_checkpointing" and calls and calls.get("inside another checkpoint"):
                # a model the script (timm, a library) checkpoints itself: the switch's blocks stand aside there
                reason += (f" [calls so far: {calls.get('checkpointed', 0)} checkpointed by the switch, "
                           f"{calls['inside another checkpoint']} inside another checkpoint, run as written]")
            if feat == "mixed_precision" and calls and (chosen in ("bf16", "fp16") or calls.get("script")):
                # a frozen teacher called in eval mode under no_grad is "bf16" yet runs fp32; a model
                # under Lightning's bf16-mixed runs the script's precision (probes' findings)
                parts = [f"{calls.get('autocast', 0)} under {chosen} autocast",
                         f"{calls.get('evaluation', 0)} evaluation calls as written in fp32"] if chosen in ("bf16", "fp16") else []
                if calls.get("script"):
                    parts.append(f"{calls['script']} under the script's own precision (its autocast, or parameters it cast)")
                if parts and calls.get("transform"):
                    parts.append(f"{calls['transform']} inside torch.func transforms as written")
                reason += f" [calls so far: {', '.join(parts)}]"
            lines.append(f"    {feat:<{name_w}}{chosen:<{chosen_w}}{reason}")
    return "\n".join(lines)
