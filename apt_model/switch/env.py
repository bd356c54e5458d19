"""Environment activation: ``ENABLE_VIRTUAL_BLACKWELL=1`` and ``VB_MODE=...``.

Read once when :mod:`apt_model` is imported (and by ``apt-vb run``). Invalid values raise
:class:`~apt_model.errors.ConfigError` naming the valid ones; nothing else happens at import.
"""
from __future__ import annotations

import os

from apt_model.errors import ConfigError

TRUE_VALUES = ("1", "true", "yes", "on")
FALSE_VALUES = ("0", "false", "no", "off", "")


def parse_bool_env(name: str, default: bool = False) -> bool:
    """Read a boolean environment variable.

    Raises:
        ConfigError: when the value is not one of 1/true/yes/on or 0/false/no/off (any case).
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in TRUE_VALUES:
        return True
    if value in FALSE_VALUES:
        return False
    raise ConfigError(
        f"{name}={raw!r} is not valid; use one of {', '.join(TRUE_VALUES)} to enable "
        f"or {', '.join(v for v in FALSE_VALUES if v)} to disable"
    )


def env_mode() -> str | None:
    """The validated ``VB_MODE`` value (lower-cased), or None when unset/empty.

    Raises:
        ConfigError: for a value that is not a known mode.
    """
    from apt_model.switch.modes import validate_mode

    raw = os.environ.get("VB_MODE")
    if raw is None or not raw.strip():
        return None
    return validate_mode(raw, source="VB_MODE")


def activate_from_environment() -> bool:
    """Enable the switch when ``ENABLE_VIRTUAL_BLACKWELL`` says so. Returns whether it did.

    Both variables are validated even when the switch stays off, so a typo fails loudly.
    """
    from apt_model.log import apply_env_log_level

    apply_env_log_level()
    wanted = parse_bool_env("ENABLE_VIRTUAL_BLACKWELL")
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
