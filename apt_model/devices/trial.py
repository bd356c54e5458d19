"""An on-line A/B trial: is a setting really faster on the user's own model?

A probe on a representative block screens candidates cheaply, but the user's model (its width,
sequence length, head size, optimizer) decides. A :class:`SpeedTrial` therefore times early
training calls of the adopted model itself and keeps the setting only if it clearly wins. The
design guards against the usual traps of timing a live run:

* **settle first.** Calls alternate on/off in ABBA order (on, off, off, on) from the start, but
  none counts until each setting's last ``settle_window`` calls agree within
  ``settle_tolerance`` (max/min), or ``settle_max`` calls have passed. A fresh process is not in
  steady state: on the 2-core development VM, while another process held memory, a new process's
  fp32 steps wandered between 80 and 110 ms for ~30 steps before settling at 75 ms, while its
  smaller bf16 steps were steady — timing that phase made bf16 look 1.15x faster when it was
  1.15x slower. Both settings alternate while settling, so each one's memory footprint is
  established before timing starts.
* **ABBA timing.** ``calls`` timed calls in ABBA order, starting on a cycle boundary, cancel a
  linear drift in speed and give each call site of a model called twice per step both settings.
* **a clear loss ends it early.** While settling, at the end of each ABBA cycle, a setting whose
  fastest of its last ``settle_window`` calls is still :data:`CLEAR_LOSS` times slower than the
  slowest of the other's (allowing for ``min_speedup`` below 1) is off at once: a short script
  paid the whole settling phase for a setting twice as slow (bf16 on a CPU without fast bf16:
  10-step scripts ran 2-2.5x their plain time; a probe's finding).
* **a clear win.** "on" must be faster by ``min_speedup`` (medians) *and* its interquartile
  range must lie entirely below the "off" one. A promising but unclear result is extended once
  with as many calls again; still unclear means off — the user's own precision is never the
  risky choice.

Calls are *issued* (:meth:`SpeedTrial.issue`, when a call starts) and *recorded*
(:meth:`SpeedTrial.record`, when its duration is known) separately: on an accelerator the
duration of a call is read from device events some calls later, without stalling the device.
Durations are recorded in issue order; a call that will never be timed (its backward never
came) is withdrawn with :meth:`SpeedTrial.cancel_last` before the next call is issued, so the
recorded sequence is exactly ABBA.
"""
from __future__ import annotations

import statistics

_ABBA = (True, False, False, True)

#: How much slower "on"'s fastest settling call must be than "off"'s slowest to end the trial early.
CLEAR_LOSS = 1.5


class SpeedTrial:
    """Schedules and judges the calls of one trial.

    Args:
        calls: number of timed calls (a multiple of 4; 0 disables the trial: the setting stays on).
        min_speedup: keep the setting when median(off) / median(on) >= this (and the win is clear).
        settle_window: calls per setting that must agree before timing starts.
        settle_tolerance: max/min ratio under which a window counts as settled.
        settle_max: calls after which timing starts even if not settled.

    Raises:
        ValueError: for ``calls`` not a non-negative multiple of 4, or other out-of-range values.
    """

    def __init__(self, calls: int = 16, min_speedup: float = 1.05, settle_window: int = 4,
                 settle_tolerance: float = 1.2, settle_max: int = 48):
        if calls < 0 or calls % 4:
            raise ValueError(f"calls={calls} must be a multiple of 4 and >= 0")
        if min_speedup <= 0:
            raise ValueError(f"min_speedup={min_speedup} must be positive")
        if settle_window < 2 or settle_tolerance <= 1 or settle_max < 0:
            raise ValueError("settle_window must be >= 2, settle_tolerance > 1 and settle_max >= 0")
        self.calls = calls
        self.min_speedup = min_speedup
        self.settle_window = settle_window
        self.settle_tolerance = settle_tolerance
        self.settle_max = settle_max
        self.index = 0  # calls recorded
        self.issued = 0  # calls announced (>= index; more while durations are in flight)
        self.phase = "settle" if calls else "done"
        self.settle_calls = 0
        self.target = calls
        self.extended = False
        self._settling: dict[bool, list[float]] = {True: [], False: []}
        self.samples: dict[bool, list[float]] = {True: [], False: []}
        self.verdict: bool | None = None if calls else True
        self.gave_up: str | None = None  # why the trial ended without a clear verdict (give_up)
        self.stopped_early = False  # ended while settling: "on" clearly slower (CLEAR_LOSS)

    @property
    def running(self) -> bool:
        return self.verdict is None

    def next_setting(self) -> bool:
        """Whether the next call to be issued runs with the setting on."""
        return _ABBA[self.issued % 4]

    def issue(self) -> bool:
        """Announce a timed call; returns whether it runs with the setting on."""
        setting = self.next_setting()
        self.issued += 1
        return setting

    def cancel_last(self) -> None:
        """Withdraw the most recently issued call (it will never be recorded); the next call
        issued takes its place in the ABBA order. No-op when nothing is in flight."""
        if self.issued > self.index:
            self.issued -= 1

    @property
    def in_flight(self) -> int:
        """Calls issued whose duration has not been recorded yet."""
        return self.issued - self.index

    def _clear_loss(self) -> bool:
        """Whether "on"'s fastest of its last ``settle_window`` settling calls is over
        :data:`CLEAR_LOSS` times (divided by ``min_speedup`` where that is below 1) the slowest of
        "off"'s."""
        w = self.settle_window
        on, off = self._settling[True][-w:], self._settling[False][-w:]
        if len(on) < w or len(off) < w:
            return False
        return min(on) * min(1.0, self.min_speedup) > CLEAR_LOSS * max(off)

    def _settled(self) -> bool:
        w = self.settle_window
        for xs in self._settling.values():
            if len(xs) < w or max(xs[-w:]) > self.settle_tolerance * min(xs[-w:]):
                return False
        return True

    def record(self, seconds: float) -> bool | None:
        """Record the duration (seconds) of the oldest issued call not yet recorded (a call
        recorded without :meth:`issue` is issued implicitly); returns the verdict once decided
        (True: keep the setting), else None. After the verdict, further records are ignored."""
        if self.phase == "done":
            return self.verdict
        setting = _ABBA[self.index % 4]
        self.index += 1
        self.issued = max(self.issued, self.index)
        if self.phase == "settle":
            self._settling[setting].append(seconds)
            if self.index % 4 == 0 and self._clear_loss():
                w = self.settle_window
                self.samples = {k: list(v[-w:]) for k, v in self._settling.items()}
                self.settle_calls, self.stopped_early = self.index, True
                self.verdict, self.phase = False, "done"
                return False
            if self.index % 4 == 0 and (self._settled() or self.index >= self.settle_max):
                self.phase, self.settle_calls = "timed", self.index
            return None
        if self.phase != "timed":
            return self.verdict
        self.samples[setting].append(seconds)
        if len(self.samples[True]) + len(self.samples[False]) < self.target:
            return None
        promising = self.speedup() >= self.min_speedup
        if promising and not self.clear() and not self.extended:
            self.extended = True
            self.target += self.calls
            return None
        self.verdict = promising and self.clear()
        self.phase = "done"
        return self.verdict

    def speedup(self) -> float:
        """median(off) / median(on) over the timed calls so far (nan before both have samples)."""
        if not self.samples[True] or not self.samples[False]:
            return float("nan")
        return statistics.median(self.samples[False]) / statistics.median(self.samples[True])

    @staticmethod
    def _quartiles(xs: list[float]) -> tuple[float, float]:
        if len(xs) < 2:
            return xs[0], xs[0]
        q = statistics.quantiles(xs, n=4)
        return q[0], q[2]

    def clear(self) -> bool:
        """Whether "on" wins without overlap: its 75th percentile below the 25th of "off" — times
        ``min_speedup`` where that is below 1 (a setting allowed to be that much slower; before
        2026-11-27 such a setting could never be kept, and its verdict called the timings
        overlapping)."""
        if not self.samples[True] or not self.samples[False]:
            return False
        allowance = min(1.0, self.min_speedup)
        return self._quartiles(self.samples[True])[1] * allowance < self._quartiles(self.samples[False])[0]

    def needed(self) -> int:
        """Calls recorded at most before a verdict: settling, the timed calls, one extension."""
        return self.settle_max + 2 * self.calls + 4

    def give_up(self, reason: str) -> dict:
        """End the trial without a clear verdict: the setting is not kept (``verdict`` False).
        Returns :meth:`summary` with ``gave_up`` set to ``reason``."""
        self.verdict, self.phase, self.gave_up = False, "done", reason
        return self.summary()

    def summary(self) -> dict:
        on, off = self.samples[True], self.samples[False]
        return {
            "calls": len(on) + len(off),
            "settle_calls": self.settle_calls,
            "on_ms": round(1e3 * statistics.median(on), 3) if on else None,
            "off_ms": round(1e3 * statistics.median(off), 3) if off else None,
            "speedup": round(self.speedup(), 3) if on and off else None,
            "min_speedup": self.min_speedup,
            "clear": self.clear(),
            "extended": self.extended,
            "stopped_early": self.stopped_early,
            **({"gave_up": self.gave_up} if self.gave_up else {}),
        }
