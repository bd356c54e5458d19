"""The settings :mod:`apt_model.attention` owns: when routing attention to SDPA is worth it.

Declared here, next to the attention routing; composed into the one table by
:mod:`apt_model.switch.settings` (see :mod:`apt_model.base.settings`).
"""
from __future__ import annotations

from apt_model.base.settings import Setting, number_between

SDPA_MIN_SPEEDUP = Setting(
    "sdpa_min_speedup", 1.0, None,
    "route attention to SDPA only where the probe finds it at least this fast vs the hand-written "
    "attention (times)", number_between(0, 100), values="a number between 0 and 100")

#: The entries :mod:`apt_model.attention` owns.
SETTINGS = (SDPA_MIN_SPEEDUP,)
