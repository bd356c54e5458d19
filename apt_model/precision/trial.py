"""An on-line A/B trial: is a setting really faster on the user's own model?

A probe on a representative block screens candidates cheaply, but the user's model (its width,
sequence length, head size, optimizer) decides. A :class:`SpeedTrial` therefore times early
training calls of the adopted model itself and keeps the setting only if its median is faster
by ``min_speedup``. The design guards against the usual traps of timing a live run:

* the first ``skip`` calls are not timed (allocator growth, first optimizer-state allocation,
  thread-pool start), then one warm-up call with each setting;
* the timed calls follow an ABBA order (on, off, off, on, ...), which cancels a linear drift in
  speed, and gives each call site of a model called twice per step both settings.
"""
from __future__ import annotations

import statistics


class SpeedTrial:
    """Schedules and judges ``calls`` timed calls (half with the setting on, half off).

    Args:
        calls: number of timed calls (even; 0 disables the trial, the setting stays on).
        min_speedup: keep the setting when median(off) / median(on) >= this.
        skip: untimed calls (setting on) before the warm-up pair.

    Raises:
        ValueError: for a negative or odd ``calls``, a negative ``skip`` or a non-positive ``min_speedup``.
    """

    def __init__(self, calls: int = 16, min_speedup: float = 1.05, skip: int = 4):
        if calls < 0 or calls % 2:
            raise ValueError(f"calls={calls} must be an even number >= 0")
        if min_speedup <= 0:
            raise ValueError(f"min_speedup={min_speedup} must be positive")
        if skip < 0:
            raise ValueError(f"skip={skip} must be >= 0")
        abba = (True, False, False, True)
        order = [abba[i % 4] for i in range(calls)]
        self.untimed = skip + 2  # the skipped calls and the warm-up pair
        self.schedule = [True] * skip + [True, False] + order if calls else []
        self.min_speedup = min_speedup
        self.samples: dict[bool, list[float]] = {True: [], False: []}
        self.index = 0
        self.verdict: bool | None = None if calls else True

    @property
    def running(self) -> bool:
        return self.verdict is None

    def next_setting(self) -> bool:
        """Whether the next timed call runs with the setting on."""
        return self.schedule[self.index]

    def record(self, seconds: float) -> bool | None:
        """Record the duration of the call :meth:`next_setting` announced; returns the verdict
        once the schedule is complete (True: keep the setting), else None."""
        setting = self.schedule[self.index]
        if self.index >= self.untimed:
            self.samples[setting].append(seconds)
        self.index += 1
        if self.index == len(self.schedule):
            self.verdict = self.speedup() >= self.min_speedup
        return self.verdict

    def speedup(self) -> float:
        """median(off) / median(on) over the timed calls so far (nan before both have samples)."""
        if not self.samples[True] or not self.samples[False]:
            return float("nan")
        return statistics.median(self.samples[False]) / statistics.median(self.samples[True])

    def summary(self) -> dict:
        on, off = self.samples[True], self.samples[False]
        return {
            "calls": len(on) + len(off),
            "on_ms": round(1e3 * statistics.median(on), 3) if on else None,
            "off_ms": round(1e3 * statistics.median(off), 3) if off else None,
            "speedup": round(self.speedup(), 3) if on and off else None,
            "min_speedup": self.min_speedup,
        }
