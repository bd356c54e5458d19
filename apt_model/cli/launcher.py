"""``apt-vb run``: run an unmodified script with the switch on.

apt_model is imported before the script imports torch, so a broken vendor plugin is contained
(see :mod:`apt_model.devices.plugins`) and the switch's patches are in place before the script
builds its model. The script runs in this process as ``__main__`` (``runpy``), with ``sys.argv``
and ``sys.path[0]`` set as ``python script.py`` would set them; ``-m module`` as ``python -m
module`` would (the current folder first on ``sys.path``, ``sys.argv[0]`` the module's file).
"""
from __future__ import annotations

import os
import runpy
import sys

from apt_model.base.errors import ConfigError


def run_script(args) -> int:
    """Enable the switch, run ``args.script`` (or ``-m args.module``), optionally save the report."""
    import apt_model.optimization.vb_global as vb
    from apt_model.switch.modes import validate_mode

    wanted = validate_mode(args.mode, source="--mode") if args.mode else None  # None: VB_MODE, .vbrc, balanced
    if args.script and not os.path.isfile(args.script):
        raise ConfigError(f"script {args.script!r} not found")
    if args.report:
        check_output_path(args.report, "--report")
    old_argv = sys.argv[:]
    # sys.path[0] as python sets it: the script's folder (inserted just before it runs), or for -m
    # the current folder, which python -m puts first and the apt-vb console script does not: for
    # the check and the run
    first = os.getcwd() if args.module else os.path.dirname(os.path.abspath(args.script))
    inserted = False
    if args.module:
        sys.path.insert(0, first)
        inserted = True
    status = 0
    try:
        if args.module:
            _check_module(args.module)
        current = vb.get_config()["mode"] if vb.is_enabled() else None
        if current is None or (wanted is not None and wanted != current) or args.device:
            # --quiet wins over a .vbrc's verbose: true (it echoed every decision anyway)
            vb.enable(wanted, device=args.device, banner=not args.quiet, **({"verbose": False} if args.quiet else {}))
        try:
            if args.module:  # runpy sets sys.argv[0] to the module's file, as python -m does
                sys.argv = [args.module, *args.args]
                runpy.run_module(args.module, run_name="__main__", alter_sys=True)
            else:
                sys.argv = [args.script, *args.args]
                sys.path.insert(0, first)
                inserted = True
                runpy.run_path(args.script, run_name="__main__")
        except SystemExit as exc:  # the script's own exit status
            code = exc.code
            status = code if isinstance(code, int) else (0 if code is None else 1)
            if not isinstance(code, int) and code is not None:
                print(code, file=sys.stderr)
        finally:
            if args.report:
                try:
                    vb.save_report(args.report)
                except OSError as err:  # the script ran: say so plainly, without a traceback over its output
                    print(f"apt-vb: could not write the report to {args.report}: {err}", file=sys.stderr)
                    status = status or 1
    finally:
        sys.argv = old_argv
        if inserted and sys.path and sys.path[0] == first:
            sys.path.pop(0)
    return status


def _check_module(name: str) -> None:
    """Raises ConfigError when ``-m name`` names no importable module (before the switch is on and
    the banner printed; ``runpy`` raised a traceback through this file)."""
    import importlib.util

    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing, or the name is malformed
        found = False
    if not found:
        raise ConfigError(f"module {name!r} not found (python -m {name} would fail too)")


def check_output_path(path: str, flag: str) -> None:
    """Raises ConfigError, naming ``flag`` (``--report``, ``--json``), when ``path`` cannot be
    written, before the command's work begins: the check used to come at the end, after the
    whole run, with a traceback and the output lost. The file's folder is created."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{flag} {path!r}: its folder cannot be created ({err})") from None
    if os.path.isdir(path) or not os.access(folder, os.W_OK):
        raise ConfigError(f"{flag} {path!r}: not a writable file path")
    existed = os.path.exists(path)
    try:  # os.access answers yes to root for folders no file can be made in (/proc): try it
        with open(path, "a"):
            pass
    except OSError as err:
        raise ConfigError(f"{flag} {path!r}: not a writable file path ({err.strerror})") from None
    if not existed:
        try:
            os.remove(path)
        except OSError:
            pass
