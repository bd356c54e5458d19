"""How ``apt-vb`` (and the main job) report a mistake in what the user typed: one line on stderr,
``<prog>: error: <what was typed>: <what is wrong>; <the valid forms>``, and exit status 2.

* :class:`OneLineArgumentParser`: argparse's own errors (an unknown option, a bad choice) as one
  line pointing to ``--help``, instead of the usage block and the error;
* :func:`check_flags`: the ``--device`` and ``--mode`` values checked before a command runs, so the
  message names the flag (``--device='gpu': unknown kind 'gpu'; valid kinds: ...``);
* :func:`report_cli_error`: a :data:`~apt_model.base.errors.USER_ERRORS` error (or a ``ValueError`` of a
  command's arguments) printed as that line, the traceback only with ``VB_LOG_LEVEL=DEBUG``.
"""
from __future__ import annotations

import argparse
import sys

from apt_model.base.errors import USAGE_EXIT, report_user_error


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line: ``<prog>: error: <message> (see <prog> --help)``,
    exit status 2. Sub-parsers made from it (``add_subparsers``) are of the same class."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr, flush=True)
        raise SystemExit(USAGE_EXIT)


def _values(value) -> list[str]:
    """A flag's values: a string, or a list of them (``action="append"``), comma-separated lists split."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return [d.strip() for item in items if item for d in str(item).split(",") if d.strip()]


def check_flags(args: argparse.Namespace) -> None:
    """Check the ``--device`` values (and ``apt-vb test``'s positional devices) and the ``--mode``
    value of a parsed command line before the command runs, so an error names the flag.

    Only the form is checked here (a known device kind, a known mode); whether the device is usable
    is the command's business (``apt-vb info`` may initialize devices to find out).

    Raises:
        ConfigError: a malformed device, an unknown device kind or an unknown mode, naming the flag
            and the valid forms.
    """
    from apt_model.devices.ranking import parse_device_spec
    from apt_model.switch.modes import validate_mode

    for label, attr in (("--device", "device"), ("device", "devices")):
        for spec in _values(getattr(args, attr, None)):
            if spec.lower() != "auto":
                parse_device_spec(spec, label=label)
    mode = getattr(args, "mode", None)
    if isinstance(mode, str) and mode.strip():
        validate_mode(mode, source="--mode")


def report_cli_error(err: BaseException, args: argparse.Namespace | None = None, prog: str = "apt-vb") -> int:
    """Print ``err`` as one line for ``apt-vb <command>`` and return the exit status (2).

    A device error raised for the value of ``--device`` (its message starts ``device=``) is
    labelled with the flag the user typed.
    """
    command = getattr(args, "command", None) if args is not None else None
    name = f"{prog} {command}" if command else prog
    text = str(err)
    if args is not None and getattr(args, "device", None) and text.startswith("device="):
        text = "--" + text
    return report_user_error(err, name, message=text)
