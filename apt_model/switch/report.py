"""The decision timeline: what the switch tried, what it chose, and why.

This is what users read when asking "why is this not faster?". Each entry names its scope (the
process, the device, or one adopted model), the feature, what was requested, what was chosen,
and the reason — including the measured numbers behind a fall-back.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TimelineEntry:
    """One decision. ``t`` is seconds since the switch was enabled."""

    t: float
    scope: str
    feature: str
    requested: Any
    chosen: Any
    reason: str
    tried: list = field(default_factory=list)


class DecisionLog:
    """An append-only list of :class:`TimelineEntry` entries, optionally echoed to stdout (``verbose``)."""

    def __init__(self, echo: bool = False):
        self.start = time.monotonic()
        self.entries: list[TimelineEntry] = []
        self.echo = echo

    def record(self, scope: str, feature: str, requested: Any, chosen: Any, reason: str,
               tried: list | None = None) -> TimelineEntry:
        d = TimelineEntry(round(time.monotonic() - self.start, 4), scope, feature, requested, chosen, reason, list(tried or []))
        self.entries.append(d)
        if self.echo:  # the user asked for verbose output
            print(f"[vb] {scope}: {feature} {requested} -> {chosen}: {reason}")
        return d

    def for_scope(self, scope: str) -> list[TimelineEntry]:
        return [d for d in self.entries if d.scope == scope]

    def to_list(self) -> list[dict]:
        return [asdict(d) for d in self.entries]
