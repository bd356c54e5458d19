"""``apt-vb config suggest|show|save|load``: the persistent configuration (``.vbrc``).

* ``suggest`` — measure this machine and suggest a mode and budgets, each with its reason.
* ``show`` — which files are read (in order), and every value in force with its source.
* ``save`` — write the suggestion (with ``--mode`` / ``--set KEY=VALUE`` changes) to a ``.vbrc``.
* ``load FILE`` — check a file (the same errors ``enable()`` would give) and install it as the
  project's or the user's ``.vbrc``.

Exit status: 0 on success, 2 for a configuration error (bad file, bad value, a file that exists
without ``--force``).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from apt_model.base.errors import ConfigError


def add_parser(sub) -> None:
    """Add ``config`` and its sub-commands to the ``apt-vb`` sub-parsers."""
    cfg = sub.add_parser("config", help="suggest, show, save or load the persistent configuration (.vbrc)",
                         description="The .vbrc configuration file: see docs/configuration.md.")
    csub = cfg.add_subparsers(dest="config_command", metavar="ACTION")
    csub.required = True

    sug = csub.add_parser("suggest", help="suggest a mode and budgets for this machine, from measurements")
    sug.add_argument("--json", action="store_true", help="print JSON")
    sug.add_argument("--device", default=None, help="plan for this device (default: the ranking's choice)")
    sug.add_argument("--no-measure", action="store_true", help="sizes only: no probes, no disk measurement")

    show = csub.add_parser("show", help="the files read and every value in force, with its source")
    show.add_argument("--json", action="store_true", help="print JSON")

    save = csub.add_parser("save", help="write the suggestion (with changes) to a .vbrc")
    _add_destination(save)
    save.add_argument("--mode", default=None, help="use this mode instead of the suggested one")
    save.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                      help="set a key (repeatable); VALUE is read as JSON when it parses (true, 2, \"x\"), else as text")
    save.add_argument("--all-features", action="store_true",
                      help="also write every feature toggle with the mode's value (a template to edit)")
    save.add_argument("--format", choices=("json", "toml"), default=None,
                      help="file format (default: from the file name's suffix, else json)")
    save.add_argument("--device", default=None, help="plan for this device (default: the ranking's choice)")
    save.add_argument("--no-measure", action="store_true", help="sizes only: no probes, no disk measurement")
    save.add_argument("--force", action="store_true", help="replace an existing file")

    load = csub.add_parser("load", help="check a configuration file and install it as the .vbrc")
    load.add_argument("file", help="the file to check and install (JSON or TOML)")
    _add_destination(load)
    load.add_argument("--check", action="store_true", help="only check the file; install nothing")
    load.add_argument("--force", action="store_true", help="replace an existing file")


def _add_destination(p) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--project", action="store_true", help="./.vbrc in the current folder (the default)")
    where.add_argument("--user", action="store_true", help="the user's file ($XDG_CONFIG_HOME/apt_model/vbrc)")
    where.add_argument("--path", default=None, help="this file")


def _destination(args) -> Path:
    from apt_model.switch import vbrc

    if args.path:
        return Path(args.path).expanduser().absolute()
    if args.user:
        return vbrc.user_config_path()
    return vbrc.project_config_path()


def _progress(enabled: bool):
    """A tqdm bar on stderr advanced at each measuring phase (shown on a terminal only)."""
    from tqdm.auto import tqdm

    bar = tqdm(total=None, desc="measuring", unit="phase", file=sys.stderr, disable=None if enabled else True,
               bar_format="{desc}: {n_fmt} phases [{elapsed}]{postfix}")

    def step(label: str) -> None:
        bar.set_postfix_str(label, refresh=False)
        bar.update(1)

    return bar, step


def _suggest(args) -> dict:
    from apt_model.switch.suggest import suggest_config

    bar, step = _progress(not args.no_measure)
    try:
        return suggest_config(device=args.device, measure=not args.no_measure, progress=step)
    finally:
        bar.close()


def _parse_set(item: str) -> tuple[str, object]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: write KEY=VALUE, e.g. --set paging=tight")
    key, raw = item.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def resolved_config() -> dict:
    """What ``enable()`` with no arguments would use now: ``mode``, ``mode_source``, every
    feature and setting as ``{"value", "source"}``, and under ``variables`` the variables read
    where they are used (``VB_SWAP_TIMEOUT``, ``VB_LOG_LEVEL``...) as ``{"value", "source"}``
    (``default`` when unset), and under ``unknown_variables`` the ``VB_*`` variables set that no
    setting reads, each with the closest known name (``did_you_mean``, or None). Nothing is enabled.

    Raises:
        ConfigError: a bad environment variable or ``.vbrc`` (path and line named).
    """
    from apt_model.base.settings import read_env
    from apt_model.switch.config import build_config, unknown_env_names
    from apt_model.switch.settings import TABLE

    cfg = build_config(None, {})
    variables = {}
    for entry in TABLE.of_kind("process"):
        value, source = read_env(entry) or (entry.default, "default")
        variables[entry.env] = {"value": value, "source": source}
    return {"mode": cfg.mode, "mode_source": cfg.sources["mode"],
            "features": {k: {"value": v, "source": cfg.sources[k]} for k, v in cfg.features.items()},
            "settings": cfg.shown_settings(),
            "variables": variables,
            "unknown_variables": [{"name": n, "did_you_mean": c} for n, c in unknown_env_names()]}


def _files() -> list[dict]:
    from apt_model.switch import vbrc

    return [{"scope": scope, "path": str(path), "exists": exists} for scope, path, exists in vbrc.config_paths()]


def format_resolved(files: list[dict], resolved: dict) -> str:
    """``config show`` text: the files (lowest precedence first) and each value with its source."""
    out = ["Configuration files (lowest precedence first; VB_* variables and enable() arguments override them):"]
    if not files:
        out.append("  none (VB_CONFIG=none)")
    for f in files:
        out.append(f"  {f['scope']:<9} {f['path']}  ({'read' if f['exists'] else 'not found'})")
    out.append(f"\nmode: {resolved['mode']}  ({resolved['mode_source']})")
    for section in ("features", "settings", "variables"):
        out.append(f"{section}:" if section != "variables" else "variables read where they are used:")
        for k, v in resolved.get(section, {}).items():
            out.append(f"  {k:<27} {json.dumps(v['value'], default=str):<22} {v['source']}")
    unknown = resolved.get("unknown_variables") or []
    if unknown:
        out.append("unknown VB_* variables (ignored):")
        out.extend(f"  {u['name']}" + (f"  did you mean {u['did_you_mean']}?" if u["did_you_mean"] else "")
                   for u in unknown)
    return "\n".join(out)


def _format_suggestion(s: dict) -> str:
    out = [f"Suggested for this machine: {s['summary']}", ""]
    for k, v in s["values"].items():
        out.append(f"  {k:<12} {v:<24} {s['reasons'].get(k, '')}")
    for n in s["notes"]:
        out.append(f"  note: {n}")
    out.append("\nWrite it with: apt-vb config save   (./.vbrc; --user for every project)")
    return "\n".join(out)


def run_config(args) -> int:
    """Run ``apt-vb config ACTION``; returns the exit status (ConfigError propagates to the caller)."""
    from apt_model.switch import vbrc

    action = args.config_command
    if action == "suggest":
        s = _suggest(args)
        print(json.dumps(s, indent=2, default=str) if args.json else _format_suggestion(s))
        return 0
    if action == "show":
        files, resolved = _files(), resolved_config()
        if args.json:
            print(json.dumps({"files": files, "config": resolved}, indent=2, default=str))
        else:
            print(format_resolved(files, resolved))
        return 0
    dest = _destination(args)
    if action == "save":
        s = _suggest(args)
        values, reasons = dict(s["values"]), dict(s["reasons"])
        if args.mode:
            from apt_model.switch.modes import validate_mode

            values["mode"] = validate_mode(args.mode, source="--mode")
            reasons["mode"] = "chosen with --mode"
        if args.all_features:
            from apt_model.switch.modes import MODE_TABLE

            for k, v in MODE_TABLE[values["mode"]].items():
                values.setdefault(k, v)
                reasons.setdefault(k, f"the {values['mode']} mode's request (edit to override)")
        by_hand = [f"mode={values['mode']}"] if args.mode else []
        for item in args.sets:
            k, v = _parse_set(item)
            values[k] = v
            reasons[k] = "set with --set"
            by_hand.append(f"{k}={v}")
        # the summary is the suggestion's: what --mode and --set changed is said after it
        header = (f"Written by apt-vb config save; suggested for this machine: {s['summary']}"
                  + (f"; then set by hand: {', '.join(by_hand)}" if by_hand else "") + ".\n"
                  "Precedence: enable() arguments > VB_* variables > this file > the mode's defaults. "
                  "See docs/configuration.md.")
        try:
            path = vbrc.write_config_file(dest, values, args.format, header, reasons, overwrite=args.force)
        except FileExistsError as err:
            raise ConfigError(f"{err}") from None
        print(f"wrote {path}")
        swap = values.get("swap_dir")
        if swap and not Path(swap).exists():
            Path(swap).mkdir(parents=True, exist_ok=True)  # the switch requires an explicit swap dir to exist
            print(f"created the swap folder {swap}")
        return 0
    if action == "load":
        cf = vbrc.read_config_file(args.file)
        swap = cf.values.get("swap_dir")
        if swap and not Path(swap).expanduser().is_dir():  # enable() would refuse it: say so now
            raise ConfigError(f"{cf.path}: swap_dir={str(swap)!r} is not an existing folder; the switch needs one "
                              f"(create it with: mkdir -p {swap}), or remove the setting to use the system temp folder")
        print(f"{cf.path}: valid {cf.format} ({len(cf.values)} value(s): {', '.join(cf.values) or 'none'})")
        if args.check:
            return 0
        # installed verbatim (comments kept), so never converted: a .json/.toml name for the other
        # format would be unreadable, as config save --format refuses it
        try:
            vbrc.check_suffix(dest, cf.format)
        except ConfigError as err:
            raise ConfigError(f"{err}; {cf.path.name} is {cf.format} and is installed as written: "
                              f"give --path a .{cf.format} name") from None
        if dest.exists() and not args.force:
            raise ConfigError(f"{dest} exists; use --force to replace it")
        if dest.resolve() != cf.path.resolve():
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(cf.path.read_text(encoding="utf-8"), encoding="utf-8")  # verbatim: comments kept
        print(f"installed as {dest}")
        return 0
    raise ConfigError(f"unknown config action {action!r}; valid: suggest, show, save, load")
