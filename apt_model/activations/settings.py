"""The settings :mod:`apt_model.activations` owns: which blocks are checkpointed, how much saved
activation memory stays resident, and what is too small to offload.

Declared here, next to the checkpointing and offload code; composed into the one table by
:mod:`apt_model.switch.settings` (see :mod:`apt_model.base.settings`).
"""
from __future__ import annotations

from apt_model.base.errors import ConfigError
from apt_model.base.settings import Setting, relabel, size, size_or_none


def _checkpoint_policy(value, label):
    """``all``, ``every:K`` (K >= 1) or ``budget`` (:func:`~apt_model.activations.checkpoint.parse_policy`),
    returned as given."""
    from apt_model.activations.checkpoint import parse_policy

    try:
        parse_policy(value)
    except ConfigError as err:  # name what the user wrote (the variable, the file line)
        raise relabel(err, "checkpoint_policy", label) from None
    return value


CHECKPOINT_POLICY = Setting(
    "checkpoint_policy", "all", "VB_CHECKPOINT_POLICY",
    "which repeated blocks are checkpointed when activation_checkpointing is on", _checkpoint_policy,
    values="all, every:K (K >= 1), budget")
ACTIVATION_BUDGET = Setting(
    "activation_budget", None, "VB_ACTIVATION_BUDGET",
    "bytes of saved activations kept in memory before offloading (default: a quarter of the level-0 budget)",
    size_or_none, values="a size: 256MB, 2GiB, bytes")
OFFLOAD_MIN_BYTES = Setting(
    "offload_min_bytes", 1 << 20, None, "saved tensors smaller than this many bytes are never offloaded",
    size, values="a size")

#: The entries :mod:`apt_model.activations` owns.
SETTINGS = (CHECKPOINT_POLICY, ACTIVATION_BUDGET, OFFLOAD_MIN_BYTES)
