"""``apt-vb``: entry point and sub-command dispatch (one module per command in this folder).

Sub-commands:
    info    devices (every candidate with status and reason), chosen device, memory per tier,
            probed capabilities, communication backend (``--json`` for machines)
    bench   a short measurement suite per device (GEMM, elementwise, normalization, attention,
            host<->device and disk bandwidth), side by side, as a table and JSON
            (``benchmark`` is the same command)
    test    a functional self-test of a device (exit status 1 when a check fails); the device
            positionally (``apt-vb test cpu``) or with ``--device``
    config  suggest|show|save|load the persistent configuration (``.vbrc``)
    optimize  ``config suggest``; with ``--apply``, ``config save``
    run     run an unmodified script with the switch on, like ``torchrun`` runs one distributed

Exit statuses: 0 success; 1 a failed ``test`` check; 2 a usage or configuration error (the
message names the bad value and the valid ones); a script run by ``run`` exits with its own status;
141 (128 + SIGPIPE), quietly, when stdout's reader stops early (``apt-vb info --json | head``).
"""
from __future__ import annotations

import argparse
import sys

from apt_model.base.version import __version__


def build_parser() -> argparse.ArgumentParser:
    """The ``apt-vb`` argument parser with every sub-command."""
    from apt_model.cli import bench, config, optimize, selftest
    from apt_model.cli.errors import OneLineArgumentParser  # usage errors as one line, exit status 2

    p = OneLineArgumentParser(prog="apt-vb", description="Virtual Blackwell: device info, benchmarks, "
                                                           "self-test, configuration and the switch launcher.")
    p.add_argument("--version", action="version", version=f"apt_model {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    info = sub.add_parser("info", help="devices, memory tiers, probed capabilities")
    info.add_argument("--json", action="store_true", help="print JSON instead of tables")
    info.add_argument("--no-probe", action="store_true", help="skip the capability probes")
    info.add_argument("--device", default=None, help="describe this device instead of the ranking's choice")

    bench.add_parser(sub)
    selftest.add_parser(sub)
    config.add_parser(sub)
    optimize.add_parser(sub)

    run = sub.add_parser("run", help="run a script (or -m module) with the switch on",
                         description="Run an unmodified training script with Virtual Blackwell enabled.")
    run.add_argument("--mode", default=None, help="performance|speed|balanced|memory|full (default: VB_MODE, else the .vbrc mode, else balanced)")
    run.add_argument("--device", default=None, help="device to use (default: VB_DEVICE or the ranking's choice)")
    run.add_argument("--report", default=None, help="write the switch's JSON report here when the script ends")
    run.add_argument("--quiet", action="store_true", help="no enable banner and no decision echo (even with verbose on in a .vbrc)")
    run.add_argument("-m", dest="module", default=None, help="run a module as a script, like python -m")
    run.add_argument("script", nargs="?", help="the script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    #: the run options that take a value, for split_run_argv
    p.run_value_options = [o for a in run._actions if a.option_strings and a.nargs != 0 for o in a.option_strings]
    return p


def _dispatch(parser: argparse.ArgumentParser, args) -> int:
    if args.command == "info":
        from apt_model.cli.info import run_info

        return run_info(args)
    if args.command in ("bench", "benchmark"):
        from apt_model.cli.bench import run_bench

        return run_bench(args)
    if args.command == "test":
        from apt_model.cli.selftest import run_selftest

        return run_selftest(args)
    if args.command == "config":
        from apt_model.cli.config import run_config

        return run_config(args)
    if args.command == "optimize":
        from apt_model.cli.optimize import run_optimize

        return run_optimize(args)
    if args.command == "run":
        from apt_model.cli.launcher import run_script

        if not args.module and not args.script:
            parser.error("run needs a script path or -m MODULE")
        if args.module and args.script:  # with -m, the first positional is the module's first argument
            args.args = [args.script, *args.args]
            args.script = None
        return run_script(args)
    parser.print_help()
    return 0


def split_run_argv(argv: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str] | None]:
    """For ``apt-vb run``: ``(the launcher's own arguments up to the script or -m MODULE, the
    script's arguments verbatim)``; ``(argv, None)`` for other commands. argparse would drop the
    first ``--`` among the script's arguments, which ``python script.py -- --x`` passes on."""
    if not argv or argv[0] != "run":
        return argv, None
    takes_value = getattr(parser, "run_value_options", ())
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "--":  # the launcher's own separator: the script comes next
            i += 1
            break
        if a == "-m" or (a.startswith("-m") and not a.startswith("--")):
            end = i + 2 if a == "-m" else i + 1
            return argv[:end], argv[end:]
        if a.startswith("-") and a != "-":
            name = a.split("=", 1)[0]
            value_opt = "=" not in a and (name in takes_value or (
                name.startswith("--") and any(o.startswith(name) for o in takes_value if o.startswith("--"))))
            i += 2 if value_opt else 1
            continue
        break
    return argv[:i + 1], argv[i + 1:]


#: Exit status when stdout is closed early (``apt-vb info --json | head``): 128 + SIGPIPE, the
#: status a shell shows for a command the closed pipe stopped (``yes | head``).
BROKEN_PIPE_EXIT = 128 + 13


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit status (2 with a one-line message for a configuration
    error; :data:`BROKEN_PIPE_EXIT`, quietly, when the reader of stdout has gone, as with ``| head``)."""
    argv = sys.argv[1:] if argv is None else argv
    args = None
    try:
        parser = build_parser()
        head, script_args = split_run_argv(argv, parser)
        try:
            args = parser.parse_args(head)
            if script_args is not None:
                args.args = script_args
        except SystemExit:
            sys.stdout.flush()  # --help, --version: a closed pipe is met here rather than at exit
            raise
        status = _run(parser, args)
        if args.command != "run":  # a script's output is left to the interpreter, as under python
            sys.stdout.flush()
        return status
    except BrokenPipeError:
        if args is not None and args.command == "run":
            raise  # the script's own (a socket's, say): its traceback is kept
        return _stdout_closed()


def _run(parser: argparse.ArgumentParser, args) -> int:
    from apt_model.base.errors import ConfigError, DeviceSelectionError
    from apt_model.cli.errors import check_flags, report_cli_error

    try:
        check_flags(args)  # --device / --mode errors name the flag
        return _dispatch(parser, args)
    except (ConfigError, DeviceSelectionError, ValueError) as err:
        if args.command == "run" and not isinstance(err, (ConfigError, DeviceSelectionError)):
            raise  # a script's own ValueError keeps its traceback
        return report_cli_error(err, args)  # one line (the traceback with VB_LOG_LEVEL=DEBUG), exit status 2


def _stdout_closed() -> int:
    """Stop quietly when stdout's reader has gone: stdout is pointed at the null device, so the
    interpreter's last flush of what is still buffered does not fail again at exit."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no file descriptor (a replaced sys.stdout)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - kept open until exit
    return BROKEN_PIPE_EXIT


if __name__ == "__main__":
    sys.exit(main())
