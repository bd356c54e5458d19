"""apt_model — Virtual Blackwell: one switch that makes the accelerator you have behave like a
bigger, newer one.

Importing this package does two things only: it imports torch so that a broken vendor device
plugin cannot make the import fail (see :mod:`apt_model.devices.plugins`), and it honours
``ENABLE_VIRTUAL_BLACKWELL=1`` / ``VB_MODE`` (see :mod:`apt_model.switch.env`). Nothing is probed
or patched unless the switch is enabled.
"""
from apt_model._version import __version__
from apt_model.devices.plugins import import_torch as _import_torch

_import_torch()

from apt_model.switch.env import activate_from_environment as _activate  # noqa: E402

_activate()

__all__ = ["__version__"]
