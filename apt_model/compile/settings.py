"""The settings :mod:`apt_model.compile` owns: how the compile ladder's rungs are judged.

Declared here, next to the ladder; composed into the one table by :mod:`apt_model.switch.settings`
(see :mod:`apt_model.base.settings`).
"""
from __future__ import annotations

from apt_model.base.settings import Setting, number_between, positive_seconds, whole_number

COMPILE_TRIAL_CALLS = Setting(
    "compile_trial_calls", 16, None,
    "timed training calls (alternating the rung and eager, ABBA) deciding whether a rung is kept",
    whole_number(4, multiple=4), values="a multiple of 4, >= 4")
COMPILE_MIN_SPEEDUP = Setting(
    "compile_min_speedup", 1.03, None, "keep a rung only if its calls are this much faster than eager (times)",
    number_between(0, 100), values="a number between 0 and 100")
COMPILE_WARMUP_BUDGET = Setting(
    "compile_warmup_budget", 900.0, "VB_COMPILE_WARMUP_BUDGET",
    "seconds a rung's warm-up (its compilation, in its first calls) may take; slower: the rung is left",
    positive_seconds, values="seconds > 0")
COMPILE_RECOMPILE_LIMIT = Setting(
    "compile_recompile_limit", 8, None,
    "recompilations of one model after its warm-up that count as a storm (first answer: dynamic shapes; "
    "a second storm leaves the rung)", whole_number(1), values="a whole number >= 1")

#: The entries :mod:`apt_model.compile` owns.
SETTINGS = (COMPILE_TRIAL_CALLS, COMPILE_MIN_SPEEDUP, COMPILE_WARMUP_BUDGET, COMPILE_RECOMPILE_LIMIT)
