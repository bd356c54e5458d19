"""The settings :mod:`apt_model.quantization` owns: which layers FP4 converts, and which CPU codec runs.

Declared here, next to the FP4 policy and the compiled codec; composed into the one table by
:mod:`apt_model.switch.settings` (see :mod:`apt_model.base.settings`).
"""
from __future__ import annotations

from apt_model.base.errors import ConfigError
from apt_model.base.settings import Setting, choice, relabel


def _fp4_policy(value, label):
    """None (the defaults), a dict of :class:`~apt_model.quantization.policy.FP4Policy` fields or
    an FP4Policy; returned as a plain dict (JSON-safe for the report) or None.

    Raises:
        ConfigError: unknown fields (the valid ones named) or invalid values.
    """
    if value is None:
        return None
    from apt_model.quantization.policy import FP4Policy

    try:
        return FP4Policy.coerce(value).to_dict()
    except ConfigError as err:
        raise relabel(err, "fp4_policy", label) from None


FP4_POLICY = Setting(
    "fp4_policy", None, None, "which layers FP4 converts: None (the defaults) or a dict of FP4Policy fields",
    _fp4_policy, values="a dict of FP4Policy fields")
FP4_KERNEL = Setting(
    "fp4_kernel", "auto", "VB_FP4_KERNEL",
    "the CPU FP4 codec: auto = compiled C where a compiler is found, else PyTorch ops; torch = "
    "always PyTorch ops", choice(("auto", "torch")), kind="process", values="auto, torch")

#: The entries :mod:`apt_model.quantization` owns.
SETTINGS = (FP4_POLICY, FP4_KERNEL)
