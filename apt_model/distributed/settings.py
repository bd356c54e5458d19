"""The settings :mod:`apt_model.distributed` owns: whether the switch drives ``torch.distributed``
under a launcher, and the keyword arguments of the DDP it builds.

Declared here, next to the session and DDP code; composed into the one table by
:mod:`apt_model.switch.settings` (see :mod:`apt_model.base.settings`).
"""
from __future__ import annotations

from apt_model.base.errors import ConfigError
from apt_model.base.settings import Setting, choice


def _ddp_options(value, label):
    """None, or a dict of DDP keyword arguments from :data:`~apt_model.distributed.ddp.DDP_OPTIONS`
    (flags True/False, ``bucket_cap_mb`` a positive number); returned as a new dict.

    Raises:
        ConfigError: not a dict, an unknown key (the valid keys named) or a bad value.
    """
    if value is None:
        return None
    from apt_model.distributed.ddp import DDP_OPTIONS

    if not isinstance(value, dict):
        raise ConfigError(f"{label}={value!r} must be a dict of DDP keyword arguments ({', '.join(DDP_OPTIONS)})")
    for key, v in value.items():
        if key not in DDP_OPTIONS:
            raise ConfigError(f"{label} has unknown key {key!r}; valid keys: {', '.join(DDP_OPTIONS)}")
        want_bool = DDP_OPTIONS[key] is bool
        if want_bool != isinstance(v, bool) or not isinstance(v, DDP_OPTIONS[key]) or (not want_bool and v <= 0):
            raise ConfigError(f"{label}[{key!r}]={v!r} must be {'True or False' if want_bool else 'a positive number'}")
    return dict(value)


DISTRIBUTED = Setting(
    "distributed", "auto", "VB_DISTRIBUTED",
    "auto: under a launcher (torchrun), the process group, each rank's device and DDP; off: leave "
    "torch.distributed alone", choice(("auto", "off")), values="auto, off")
DDP_OPTIONS_SETTING = Setting(
    "ddp_options", None, None,
    "keyword arguments for the switch's DDP (find_unused_parameters, bucket_cap_mb, ...)", _ddp_options,
    values="a dict of DDP keyword arguments")

#: The entries :mod:`apt_model.distributed` owns.
SETTINGS = (DISTRIBUTED, DDP_OPTIONS_SETTING)
