"""apt_model — Virtual Blackwell: one switch that makes the accelerator you have behave like a
bigger, newer one.

Importing this package does two things only: it imports torch so that a broken vendor device
plugin cannot make the import fail (see :mod:`apt_model.devices.plugins`), and it honours
``ENABLE_VIRTUAL_BLACKWELL=1`` / ``VB_MODE`` (see :mod:`apt_model.switch.env`). Nothing is probed
or patched unless the switch is enabled.

A bad value there ends the program at this import with one line on stderr naming the variable or
file and the valid forms, and exit status 2 (``SystemExit(2)``); ``VB_LOG_LEVEL=DEBUG`` adds the
traceback. ``ENABLE_VIRTUAL_BLACKWELL``, ``VB_MODE`` and ``VB_LOG_LEVEL`` are checked always; the
other variables and the ``.vbrc`` files (a malformed file, an unusable ``VB_DEVICE``) when
``ENABLE_VIRTUAL_BLACKWELL=1`` enables the switch here, else by ``vb.enable()``.
"""
from apt_model.base.version import __version__
from apt_model.devices.plugins import import_torch as _import_torch

_import_torch()

from apt_model.base.errors import USER_ERRORS as _USER_ERRORS  # noqa: E402
from apt_model.switch.env import activate_from_environment as _activate  # noqa: E402

try:
    _activate()
except _USER_ERRORS as _err:  # a bad VB_* variable or .vbrc: one line naming it, exit status 2
    from apt_model.base.errors import USAGE_EXIT, report_user_error

    report_user_error(_err)
    raise SystemExit(USAGE_EXIT) from None

__all__ = ["__version__"]
