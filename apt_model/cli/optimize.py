"""``apt-vb optimize [--apply]``: the backend manager's name for ``apt-vb config suggest`` / ``save``.

* ``apt-vb optimize`` measures this machine and prints the suggested mode and budgets, each with
  its reason (exactly ``apt-vb config suggest``; ``--json``, ``--device``, ``--no-measure``).
* ``apt-vb optimize --apply`` writes them to the ``.vbrc`` (exactly ``apt-vb config save``, with its
  ``--mode``, ``--set KEY=VALUE``, ``--all-features``, ``--format``, ``--force`` and destination
  options ``--project`` / ``--user`` / ``--path``).

Options that only mean something when writing are a usage error without ``--apply`` (exit status 2),
rather than silently ignored.
"""
from __future__ import annotations

#: Options of ``config save`` that need ``--apply``: (attribute, its value when not given, flag).
_APPLY_ONLY = (("mode", None, "--mode"), ("sets", [], "--set"), ("all_features", False, "--all-features"),
               ("format", None, "--format"), ("force", False, "--force"), ("user", False, "--user"),
               ("path", None, "--path"), ("project", False, "--project"))


def add_parser(sub) -> None:
    """Add ``optimize`` to the ``apt-vb`` sub-parsers."""
    from apt_model.cli.config import _add_destination

    o = sub.add_parser("optimize", help="suggest a mode and budgets for this machine; --apply writes the .vbrc",
                       description="Measure this machine and suggest the switch's configuration (apt-vb config "
                                   "suggest); with --apply, write it to a .vbrc (apt-vb config save).")
    o.add_argument("--apply", action="store_true", help="write the suggestion to a .vbrc (default ./.vbrc)")
    o.add_argument("--json", action="store_true", help="print the suggestion as JSON (without --apply)")
    o.add_argument("--device", default=None, help="plan for this device (default: the ranking's choice)")
    o.add_argument("--no-measure", action="store_true", help="sizes only: no probes, no disk measurement")
    _add_destination(o)
    o.add_argument("--mode", default=None, help="with --apply: use this mode instead of the suggested one")
    o.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="with --apply: set a key (repeatable), as in apt-vb config save")
    o.add_argument("--all-features", action="store_true",
                   help="with --apply: also write every feature toggle with the mode's value")
    o.add_argument("--format", choices=("json", "toml"), default=None, help="with --apply: file format")
    o.add_argument("--force", action="store_true", help="with --apply: replace an existing file")


def run_optimize(args) -> int:
    """Run ``apt-vb optimize``: ``config suggest``, or ``config save`` with ``--apply``. Returns the exit status.

    Raises:
        ConfigError: a write-only option given without ``--apply`` (naming it), ``--json`` with
            ``--apply``, or any error ``config suggest`` / ``config save`` raises.
    """
    from apt_model.cli.config import run_config
    from apt_model.base.errors import ConfigError

    if args.apply:
        if args.json:
            raise ConfigError("--json prints the suggestion; it does not combine with --apply")
        args.config_command = "save"
    else:
        given = [flag for attr, unset, flag in _APPLY_ONLY if getattr(args, attr) != unset]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise ConfigError(f"{', '.join(given)} only {verb} when writing the .vbrc; add --apply "
                              "(or drop them to see the suggestion)")
        args.config_command = "suggest"
    return run_config(args)
