"""Exceptions raised by apt_model.

Every error names the bad value and the valid ones, so a user can fix their call or
environment without reading our source.
"""


class VBError(Exception):
    """Base class of every apt_model error."""


class ConfigError(VBError, ValueError):
    """An invalid setting: bad argument to ``enable()``, bad environment variable, bad file."""


class DeviceSelectionError(VBError, RuntimeError):
    """The requested device (``VB_DEVICE``, ``device=``) does not exist or is not usable here."""


class FigureUnavailable(VBError, RuntimeError):
    """A memory or device figure cannot be read on this device; the message says why."""


class DistributedError(VBError, RuntimeError):
    """A multi-process setup that cannot work here (a backend with no devices to serve, a model the
    switch pages being handed to DDP/FSDP/DataParallel); the message says what to do instead."""
