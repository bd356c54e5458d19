"""The settings :mod:`apt_model.precision` owns: when autocast is worth it, by probe and by trial.

Declared here, next to the autocast hooks and the speed trial; composed into the one table by
:mod:`apt_model.switch.settings` (see :mod:`apt_model.base.settings`).
"""
from __future__ import annotations

from apt_model.base.settings import Setting, number_between, whole_number


AUTOCAST_MIN_SPEEDUP = Setting(
    "autocast_min_speedup", 1.10, None,
    "autocast only where the probe measured at least this speed-up (times)", number_between(0, 100),
    values="a number between 0 and 100")
AUTOCAST_TRIAL_CALLS = Setting(
    "autocast_trial_calls", 16, None,
    "timed training calls on the model itself confirming autocast (0: no trial)", whole_number(0, multiple=4),
    values="a multiple of 4, >= 0")
AUTOCAST_TRIAL_MIN_SPEEDUP = Setting(
    "autocast_trial_min_speedup", 1.05, None, "keep autocast after the trial only if this much faster (times)",
    number_between(0, 100), values="a number between 0 and 100")

#: The entries :mod:`apt_model.precision` owns.
SETTINGS = (AUTOCAST_MIN_SPEEDUP, AUTOCAST_TRIAL_CALLS, AUTOCAST_TRIAL_MIN_SPEEDUP)
