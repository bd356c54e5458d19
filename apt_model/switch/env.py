"""Environment activation: ``ENABLE_VIRTUAL_BLACKWELL=1`` and ``VB_MODE=...``.

Read once when :mod:`apt_model` is imported (and by ``apt-vb run``). Invalid values raise
:class:`~apt_model.base.errors.ConfigError` naming the valid ones; nothing else happens at import.
"""
from __future__ import annotations

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


def activate_from_environment() -> bool:
    """Enable the switch when ``ENABLE_VIRTUAL_BLACKWELL`` says so. Returns whether it did.

    Both variables are validated even when the switch stays off, so a typo fails loudly.
    """
    from apt_model.base.log import apply_env_log_level

    apply_env_log_level()
    found = read_env(ENABLE)
    wanted = ENABLE.default if found is None else found[0]
    env_mode()  # validated even when the switch stays off
    if not wanted:
        return False
    from apt_model.switch import controller

    if controller.is_enabled():
        return True
    # mode stays unnamed here: build_config reads VB_MODE itself, so get_config() reports
    # mode_source "environment:VB_MODE" (validated above); unset: the .vbrc's mode, else balanced
    controller.enable(None, _source="environment")
    return True
