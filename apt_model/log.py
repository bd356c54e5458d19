"""The ``apt_model`` logger and its level control (environment variable ``VB_LOG_LEVEL``).

Library code logs through :func:`get_logger`; it never prints. Only the enable banner,
``print_stats()`` and the CLI print, because there the user asked for output.
"""
from __future__ import annotations

import logging
import os

ROOT_LOGGER = "apt_model"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def get_logger(name: str) -> logging.Logger:
    """Return the logger for module ``name`` under the ``apt_model`` hierarchy."""
    if not name.startswith(ROOT_LOGGER):
        name = f"{ROOT_LOGGER}.{name}"
    return logging.getLogger(name)


def apply_env_log_level() -> None:
    """Set the ``apt_model`` logger level from ``VB_LOG_LEVEL`` when it is set.

    Raises:
        ConfigError: when ``VB_LOG_LEVEL`` is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL.
    """
    value = os.environ.get("VB_LOG_LEVEL")
    if not value:
        return
    level = value.strip().upper()
    if level not in _LEVELS:
        from apt_model.errors import ConfigError

        raise ConfigError(f"VB_LOG_LEVEL={value!r} is not valid; use one of {', '.join(_LEVELS)}")
    logger = logging.getLogger(ROOT_LOGGER)
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s: %(message)s"))
        logger.addHandler(handler)
