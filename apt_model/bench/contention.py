"""Are the CPU cores shared with other processes? A cheap check for long jobs on the CPU.

Two threads on two cores can run 10-20x slower than on idle cores when another process wants the
same cores (DESIGN.md section 4), and nothing in the job's own output says why. :class:`CoreShare`
gives two signals, both free to read:

* the load average (other processes' runnable threads) before the job and at its end, beyond what
  the job's own threads account for — as ``apt-vb bench`` judges its runs;
* the CPU time the process actually got while running, as a fraction of ``threads x wall time``
  (only meaningful when the work runs on the CPU: with an accelerator the host threads mostly wait).
  Where it is measured it decides, the load averages only adding context: a 1-minute average
  still shows a job that ended seconds before the run.

:func:`contention_note` turns them into one line for the user, or None when the cores look free.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

#: Below this fraction of the CPU time its threads asked for, a CPU job is judged to be sharing cores.
#: Measured with the main job on the 2-core EPYC (2 threads): 0.97-0.99 on idle cores; 0.86 at
#: 1.2x its idle time; 0.71 at 2x; 0.51-0.54 at 6-14x (waiting threads spin, so the share falls
#: more slowly than the speed).
MIN_CPU_SHARE = 0.8


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS tells, else the logical count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _load() -> float | None:
    try:
        return float(os.getloadavg()[0])
    except (OSError, AttributeError):
        return None


def others_load(load: float | None, own_threads: int = 0) -> float | None:
    """Runnable threads of other processes in a 1-minute load average that includes ``own_threads``
    of this job (0 before it starts). The average lags, so this errs low: a conservative signal."""
    if load is None:
        return None
    return max(0.0, load - own_threads)


def contention_note(threads: int, cores: int, load_before: float | None, load_after: float | None = None,
                    cpu_share: float | None = None) -> str | None:
    """One line saying the cores are shared, or None when neither signal says so.

    Args:
        threads: the job's torch threads.
        cores: cores the job may use (:func:`usable_cores`).
        load_before: 1-minute load average before the job's work started (None: unknown).
        load_after: the same at its end (includes the job's own ``threads``), or None.
        cpu_share: CPU seconds the process got / (``min(threads, cores)`` x wall seconds), or None
            (not measured, or the work ran on an accelerator). When given it decides: at or above
            :data:`MIN_CPU_SHARE` the cores are judged free whatever the load averages say.

    Returns:
        The note (no newline), or None.
    """
    # load other processes may add without taking our cores (+0.5: the average's noise, and the
    # job's own work in the minute before the run)
    free = cores - min(threads, cores) + 0.5
    signals = []
    before = others_load(load_before)
    after = others_load(load_after, min(threads, cores))
    if before is not None and before > free:
        signals.append(f"load average {load_before:.1f} on {cores} core(s) before the run")
    elif after is not None and after > free:
        signals.append(f"load average {load_after:.1f} on {cores} core(s) at the end")
    if cpu_share is not None:
        # measured: it decides (the 1-minute load average lags: a job that just ended still shows)
        if cpu_share >= MIN_CPU_SHARE:
            return None
        signals.append(f"the job got {100 * cpu_share:.0f}% of the CPU time its {min(threads, cores)} thread(s) asked for")
    if not signals:
        return None
    return (f"the CPU cores look shared with other processes ({'; '.join(signals)}): step times can be several "
            f"times (up to 10-20x) longer than on idle cores; try --threads 1, or run when the machine is idle "
            f"(README: Troubleshooting)")


@dataclass
class CoreShare:
    """Measure both signals around a piece of work: ``m = CoreShare(threads); ...; m.stop()``.

    Args:
        threads: the job's torch threads.
        on_cpu: whether the work runs on the CPU (else the CPU-share signal is not used).
    """

    threads: int
    on_cpu: bool = True
    cores: int = 0
    load_before: float | None = None
    _cpu0: float = field(default=0.0, repr=False)
    _wall0: float = field(default=0.0, repr=False)

    def __post_init__(self):
        self.cores = self.cores or usable_cores()
        self.load_before = _load()
        self._cpu0, self._wall0 = time.process_time(), time.perf_counter()

    def before_note(self) -> str | None:
        """The note from the load before the work alone (to say it at the start), or None."""
        return contention_note(self.threads, self.cores, self.load_before)

    def stop(self) -> dict:
        """The figures and the verdict: ``threads``, ``cores``, ``load_before``, ``load_after``,
        ``cpu_share`` (None off the CPU or for a sub-10 ms interval), ``note`` (None: cores look free)."""
        wall = time.perf_counter() - self._wall0
        cpu = time.process_time() - self._cpu0
        share = None
        if self.on_cpu and wall > 0.01:
            share = round(cpu / (min(self.threads, self.cores) * wall), 3)
        after = _load()
        return {"threads": self.threads, "cores": self.cores, "load_before": self.load_before, "load_after": after,
                "cpu_share": share, "note": contention_note(self.threads, self.cores, self.load_before, after, share)}
