"""The ``apt_model`` logger and its level control (environment variable ``VB_LOG_LEVEL``).

Library code logs through :func:`get_logger`; it never prints. Only the enable banner,
``print_stats()`` and the CLI print, because there the user asked for output.
"""
from __future__ import annotations

import logging

from apt_model.base.settings import LOG_LEVEL, read_env

ROOT_LOGGER = "apt_model"


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
    found = read_env(LOG_LEVEL)
    if found is None:
        return
    level = found[0]
    logger = logging.getLogger(ROOT_LOGGER)
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s: %(message)s"))
        logger.addHandler(handler)
