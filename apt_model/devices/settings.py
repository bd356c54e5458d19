"""The settings :mod:`apt_model.devices` owns: which device, which kinds first, the probe cache.

Declared here, next to the ranking and the probe cache that read them; composed into the one
table by :mod:`apt_model.switch.settings` (see :mod:`apt_model.base.settings`).
"""
from __future__ import annotations

from apt_model.base.errors import ConfigError
from apt_model.base.settings import Setting, any_text


def _device(value, label):
    """None, ``"auto"`` (the ranking's choice), a ``torch.device`` or ``KIND[:INDEX]`` naming a
    known kind or device type; returned as given (``"auto"`` lower-cased).

    Raises:
        ConfigError: not a string or device, malformed, or an unknown kind (the valid kinds named).
    """
    if value is None:
        return None
    import torch

    if isinstance(value, torch.device):
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{label}={value!r} must be a string such as 'cpu' or 'cuda:0'")
    if value.strip().lower() in ("", "auto"):
        return "auto"
    from apt_model.devices.ranking import parse_device_spec

    parse_device_spec(value, label=label)
    return value


def _prefer(value, label):
    """None, a kind, or a sequence of kinds (a list becomes a tuple); the kinds themselves are
    checked by the ranking against the detected devices."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ConfigError(f"{label}={value!r} must be a device kind or a sequence of kinds")


def _probe_cache(value, label):
    v = str(value).strip().lower()
    for canonical, words in (("on", ("1", "on", "true", "yes")), ("off", ("0", "off", "false", "no")),
                             ("refresh", ("refresh",))):
        if v in words:
            return canonical
    raise ConfigError(f"{label}={value!r} is not valid; use 1/on, 0/off or refresh")


DEVICE = Setting(
    "device", None, "VB_DEVICE",
    "the device to use instead of the ranking's choice (an unusable one is an error, never a silent "
    "CPU fall-back)", _device, values="cpu, cuda:1, npu:0, rocm, mlu, xpu, mps, ...; auto (the ranking's choice)",
    env_at_use=True)
PREFER = Setting(
    "prefer", None, None, "device kinds ranked first (a kind or a sequence of kinds)", _prefer,
    values="a kind or a sequence of kinds")
PROBE_CACHE = Setting(
    "probe_cache", "on", "VB_PROBE_CACHE",
    "reuse device probe results kept on disk (per device model and software version); refresh "
    "probes again and overwrites", _probe_cache, kind="process", values="1/on, 0/off, refresh")
CACHE_DIR = Setting(
    "probe_cache_dir", None, "VB_CACHE_DIR",
    "where probe results are kept (in <folder>/probes; default: the user's cache folder)",
    any_text("a folder path"), kind="process", values="a folder")

#: The entries :mod:`apt_model.devices` owns.
SETTINGS = (DEVICE, PREFER, PROBE_CACHE, CACHE_DIR)
