"""Environment activation: ``ENABLE_VIRTUAL_BLACKWELL=1`` and ``VB_MODE=...``.

Read once when :mod:`apt_model` is imported (and by ``apt-vb run``). Invalid values raise
:class:`~apt_model.base.errors.ConfigError` naming the valid ones; nothing else happens at import.
"""
from __future__ import annotations

import os
import sys

from apt_model.base.settings import read_env
from apt_model.switch.settings import ENABLE, MODE


def env_mode() -> str | None:
    """The validated ``VB_MODE`` value (canonical: lower-cased, ``speed`` -> ``performance``), or
    None when unset/empty.

    Raises:
        ConfigError: for a value that is not a known mode.
    """
    found = read_env(MODE)
    return None if found is None else found[0]


def launched_as_cli() -> bool:
    """Whether this process is apt_model's own command line: ``apt-vb ...`` (the console script)
    or ``python -m apt_model ...``. Read from ``sys.argv[0]`` and ``sys.orig_argv``: the package
    is imported before the command line's code runs, so nothing else can tell yet."""
    if sys.argv and os.path.basename(sys.argv[0]) in ("apt-vb", "apt-vb.exe"):
        return True
    orig = list(getattr(sys, "orig_argv", ()))
    i = 1
    while i < len(orig):
        arg = orig[i]
        if arg in ("-X", "-W", "--check-hash-based-pycs"):  # interpreter options that take a value
            i += 2
            continue
        if arg.startswith("-m"):  # -m module, or -mmodule
            target = arg[2:] or (orig[i + 1] if i + 1 < len(orig) else "")
            return target == "apt_model" or target.startswith("apt_model.cli")
        if arg == "-c" or arg == "-" or not arg.startswith("-"):  # code, stdin or a script: not us
            return False
        i += 1
    return False


def activate_from_environment() -> bool:
    """Enable the switch when ``ENABLE_VIRTUAL_BLACKWELL`` says so. Returns whether it did.

    Both variables are validated even when the switch stays off, so a typo fails loudly. In
    apt_model's own command line (:func:`launched_as_cli`) nothing is enabled here: ``apt-vb run``
    enables the switch itself with its flags (``--mode``, ``--quiet``), and the other commands
    print data (``--json``) that a banner would corrupt.
    """
    from apt_model.base.log import apply_env_log_level

    apply_env_log_level()
    found = read_env(ENABLE)
    wanted = ENABLE.default if found is None else found[0]
    env_mode()  # validated even when the switch stays off
    if not wanted or launched_as_cli():
        return False
    from apt_model.switch import controller

    if controller.is_enabled():
        return True
    # mode stays unnamed here: build_config reads VB_MODE itself, so get_config() reports
    # mode_source "environment:VB_MODE" (validated above); unset: the .vbrc's mode, else balanced
    controller.enable(None, _source="environment")
    return True


def reimporting_parent_script() -> bool:
    """Whether this runs while a ``spawn`` or ``forkserver`` child of ``multiprocessing`` (a
    DataLoader worker, a ``Pool`` process) imports the parent's script again as ``__mp_main__``
    to find its functions: the script's top-level ``import apt_model`` (with
    ``ENABLE_VIRTUAL_BLACKWELL=1``) or ``vb.enable()`` then runs in every worker. Code called later
    from a function (a rank function given to ``torch.multiprocessing.spawn``) is not this. Found by
    the stack: a module-level frame run under the name ``__mp_main__`` (multiprocessing runs the
    script with that name, and sets ``sys.modules["__main__"]`` only after it ran)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return True
        frame = frame.f_back
    return False
