"""Per-step time and memory of the user's training loop, for the run report.

A :class:`StepRecorder` installs two global optimizer hooks
(``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``..._post_hook``) — while the
switch is on they are in its undo stack, so ``disable()`` removes them. The post-hook notes each
optimizer step (its clock reading, and the memory when a reading is due); the notes are recorded in
batches, every :data:`DRAIN_AT` steps or when the figures are asked for, each as if at its own step.
For every step it records:

* ``step_s``: wall time since the same optimizer's previous step ended (the whole loop
  iteration: data, forward, backward, step); None for an optimizer's first step;
* ``optimizer_s``: the host's time inside ``optimizer.step()`` (with paging: the streamed step).
  On an accelerator the step only queues its kernels: this is the time to queue them (and any
  wait the step made), not the device's time; ``step_s`` is the device-paced figure;
* ``memory``: process RSS at the step's end (``process_rss``) and its peak since the previous
  reading (``process_rss_peak``: a background thread samples the RSS every ``peak_interval``
  seconds while the hooks are installed, so the forward/backward peak of a step longer than that
  is seen; the memory is read at most once per ``sample_interval``: a record kept sooner after the
  last reading carries that reading),
  and on an accelerator the bytes allocated on the device
  (:class:`~apt_model.devices.device_backend.DeviceBackend` figures);
* ``levels``: while paging is active, the bytes of training state on each level of the VGPU
  stack (level 0 resident pages, pinned host pool, bytes in swap files).

Memory stays bounded: at most ``max_records`` records are kept; when full, every other record is
dropped and the stride doubles (records stay evenly spaced over the whole run). Counts, totals,
means, minima, maxima and memory peaks cover every step; the median and quartiles of the step
time cover the last ``window`` steps.
"""
from __future__ import annotations

import collections
import statistics
import threading
import time
from typing import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from apt_model.base.log import get_logger
from apt_model.memory.host import rss_now

log = get_logger(__name__)

#: Defaults: records kept (then decimated), and steps in the median/quartile window.
MAX_RECORDS = 1000
WINDOW = 1024
#: Finished steps the post-hook lets wait before they are recorded, at most.
DRAIN_AT = 256
#: Seconds between two memory readings at step ends (a read of /proc/self/statm: ~3 us).
SAMPLE_INTERVAL = 0.005
#: Seconds between two RSS samples of the background thread (the peak between readings). Each wake
#: of the thread takes the interpreter lock from the training thread: at 5 ms (200 wakes a second,
#: until 2026-11-28) that cost a 0.3 ms step of a small model ~8 us, 3% (a benchmark ablation).
PEAK_INTERVAL = 0.05


class RssPeakSampler:
    """The process's peak RSS between two :meth:`take` calls, sampled by a daemon thread.

    Args:
        interval: seconds between samples (> 0); a peak shorter than this may be missed.

    Raises:
        ValueError: ``interval`` <= 0.
    """

    def __init__(self, interval: float = PEAK_INTERVAL):
        if not interval > 0:
            raise ValueError(f"interval={interval!r} must be > 0 seconds")
        self.interval = interval
        self._lock = threading.Lock()
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> int:
        rss = rss_now()
        with self._lock:
            if rss > self._peak:
                self._peak = rss
        return rss

    def _run(self) -> None:
        # a plain sleep, not Event.wait(timeout) (a new lock and a timed acquire per wake-up): the
        # thread wakes 200 times a second and cost ~50 ms of CPU per second that way, ~15 now
        while not self._stop.is_set():
            left = self.interval
            while left > 0 and not self._stop.is_set():  # slices of <= 50 ms: stop() never waits long
                time.sleep(min(left, 0.05))
                left -= 0.05
            try:
                self._sample()
            except Exception as err:  # noqa: BLE001 - a report figure must never break training
                log.debug("rss sampler: %s", err)
                return

    def start(self) -> None:
        """Start sampling (no-op when running)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="apt_model-rss-peak", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling and wait for the thread (safe to call more than once)."""
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(timeout=1.0)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def take(self, current: int | None = None) -> int:
        """The peak RSS (bytes) since the previous call, at least ``current`` (sampled now when None);
        the next peak starts from zero."""
        now = self._sample() if current is None else current
        with self._lock:
            peak, self._peak = max(self._peak, now), 0
        return peak


class StepRecorder:
    """Records the time and memory of every optimizer step (see the module docstring).

    Args:
        device: the compute device (its allocated bytes are recorded when it is an accelerator).
        levels: a callable returning bytes per level (``PagingSession.residency``: ``{"level0:<kind>": bytes, ...}``) (or None when not paging);
            None records no levels.
        max_records: records kept before decimating (>= 2).
        window: step times the median and quartiles are computed over (>= 1).
        sample_interval: seconds between two memory readings at step ends (> 0).
        peak_interval: seconds between the background thread's RSS samples for ``process_rss_peak``
            while installed (> 0).

    Raises:
        ValueError: ``max_records`` < 2, ``window`` < 1, or ``sample_interval`` or ``peak_interval`` <= 0.
    """

    def __init__(self, device: torch.device | str = "cpu", levels: Callable[[], dict | None] | None = None,
                 max_records: int = MAX_RECORDS, window: int = WINDOW, sample_interval: float = SAMPLE_INTERVAL,
                 peak_interval: float = PEAK_INTERVAL):
        if max_records < 2 or window < 1:
            raise ValueError(f"max_records={max_records!r} must be >= 2 and window={window!r} >= 1")
        for name, value in (("sample_interval", sample_interval), ("peak_interval", peak_interval)):
            if not value > 0:
                raise ValueError(f"{name}={value!r} must be > 0 seconds")
        self.sample_interval = sample_interval
        self.device = torch.device(device)
        self._levels = levels
        self.max_records = max_records
        self.window = window
        self._backend = None
        if self.device.type != "cpu":
            from apt_model.devices.device_backend import DeviceBackend

            self._backend = DeviceBackend(self.device)
        self._sampler = RssPeakSampler(peak_interval)
        self._lock = threading.Lock()
        self.start = time.perf_counter()
        self.records: list[dict] = []
        self.stride = 1
        self.count = 0
        self._optimizers: dict[int, int] = {}  # id(optimizer) -> index in order of first step
        self._began: dict[int, float] = {}
        self._last_end: dict[int, float] = {}
        self._times: collections.deque = collections.deque(maxlen=window)
        self._n_times = 0
        self._total = 0.0
        self._min = float("inf")
        self._max = 0.0
        self._opt_total = 0.0
        self._memory_at = float("-inf")  # perf_counter() of the last memory reading
        self._last_reading: tuple[dict, dict | None] | None = None  # (memory, levels) read then
        self.memory_peak: dict[str, int] = {}
        self.level_labels: list[str] = []
        self._handles: list = []
        self._done: collections.deque = collections.deque()  # (key, began, ended, reading) noted by the post-hook
        self._drain_lock = threading.Lock()

    # ------------------------------------------------------------------ hooks
    def install(self, patches=None) -> None:
        """Register the global optimizer hooks; with ``patches`` (a PatchSet) their removal is in its undo stack."""
        pre = register_optimizer_step_pre_hook(self._pre)
        post = register_optimizer_step_post_hook(self._post)
        self._sampler.take()  # the first step's peak counts from here
        self._sampler.start()
        if patches is not None:
            patches.add_handle(pre, "step recorder: optimizer step pre-hook")
            patches.add_handle(post, "step recorder: optimizer step post-hook")
            patches.add_undo(self._sampler.stop, "step recorder: RSS peak sampler thread")
        else:
            self._handles += [pre, post]

    def remove(self) -> None:
        """Remove hooks installed without a PatchSet (and stop the RSS sampler)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._sampler.stop()

    def _pre(self, opt, args, kwargs):
        if torch.compiler.is_compiling():  # a step compiled by the script: not timed (a clock read
            return None  # would break its graph, and Dynamo would run the whole step eagerly)
        self._began[id(opt)] = time.perf_counter()
        return None

    def _post(self, opt, args, kwargs):
        if torch.compiler.is_compiling():
            return None
        now = time.perf_counter()
        reading = self._reading_due(now) if now - self._memory_at >= self.sample_interval else None
        self._done.append((id(opt), self._began.pop(id(opt), None), now, reading))
        if len(self._done) >= DRAIN_AT:
            try:
                self._drain()
            except Exception as err:  # noqa: BLE001 - a report figure must never break training
                log.debug("step recorder: %s", err)
        return None

    def _reading_due(self, now: float) -> tuple[dict, dict | None] | None:
        """The memory reading for a step that ended at ``now`` when one is due (``sample_interval``
        since the last), else None. Never raises (a failed reading is None)."""
        if now - self._memory_at < self.sample_interval:
            return None
        self._memory_at = now
        try:
            return self._memory()
        except Exception as err:  # noqa: BLE001 - a report figure must never break training
            log.debug("step recorder: memory reading: %s", err)
            return None

    def _drain(self) -> None:
        """Record the finished steps noted by the post-hook, oldest first. The hook only notes a
        step (a clock read, a deque append, and every ``sample_interval`` a memory reading: what a
        step of a tiny model can afford); they are recorded here in one batch when :data:`DRAIN_AT`
        wait or when the figures are asked for — each exactly as if recorded at its own step, with
        the reading taken at its step. (Until 2026-11-28 every memory reading also recorded the
        batch, a dozen steps every 5 ms: ~9 us per 0.3 ms step in a cold cache, as a benchmark
        ablation showed.)"""
        with self._drain_lock:
            done = self._done
            if not done:
                return
            events = [done.popleft() for _ in range(len(done))]
            with self._lock:
                for key, began, now, reading in events:
                    if reading is not None:
                        self._take_reading(*reading)
                    self._record(key, began, now)

    # ------------------------------------------------------------------ recording
    def _memory(self) -> tuple[dict, dict | None]:
        rss = rss_now()
        mem = {"process_rss": rss, "process_rss_peak": self._sampler.take(rss)}
        if self._backend is not None:
            alloc = self._backend.memory_allocated()
            if alloc is not None:
                mem["device_allocated"] = int(alloc)
        levels = self._levels() if self._levels is not None else None
        return mem, levels

    def record_step(self, key: int = 0, began: float | None = None) -> None:
        """Record one finished step of optimizer ``key`` now (for loops without an optimizer; the
        post-hook notes its steps, recorded in batches). ``began``: ``perf_counter()`` when the step
        started, if known.

        The memory is read at most once per ``sample_interval`` seconds: a read costs about as much
        as the rest of the recording, which counts on a model whose step takes a few hundred
        microseconds. A record kept sooner carries the last reading (the sampler thread sees the
        peaks in between)."""
        now = time.perf_counter()
        self._done.append((key, began, now, self._reading_due(now)))
        self._drain()

    def _take_reading(self, mem: dict, levels: dict | None) -> None:
        # under self._lock
        self._last_reading = (mem, levels)
        for k, v in {**mem, **(levels or {})}.items():
            if v > self.memory_peak.get(k, -1):
                self.memory_peak[k] = v
        if levels:
            for k in levels:
                if k not in self.level_labels:
                    self.level_labels.append(k)

    def _record(self, key: int, began: float | None, now: float) -> None:
        # under self._lock; the memory reading due at this step (if any) was taken just before
        self.count += 1
        count = self.count
        index = self._optimizers.setdefault(key, len(self._optimizers))
        prev = self._last_end.get(key)
        self._last_end[key] = now
        step_s = None if prev is None else now - prev
        if step_s is not None:
            self._times.append(step_s)
            self._n_times += 1
            self._total += step_s
            if step_s < self._min:
                self._min = step_s
            if step_s > self._max:
                self._max = step_s
        opt_s = None if began is None else now - began
        if opt_s is not None:
            self._opt_total += opt_s
        if (count - 1) % self.stride == 0 and self._last_reading is not None:
            self._keep_record(count, index, now, step_s, opt_s, *self._last_reading)

    def _keep_record(self, count: int, index: int, now: float, step_s, opt_s, mem: dict, levels: dict | None) -> None:
        # under self._lock
        rec = {"step": count, "optimizer": index, "t": round(now - self.start, 6),
               "step_s": None if step_s is None else round(step_s, 6),
               "optimizer_s": None if opt_s is None else round(opt_s, 6), "memory": dict(mem)}
        if levels is not None:
            rec["levels"] = dict(levels)
        self.records.append(rec)
        if len(self.records) > self.max_records:
            self.records = self.records[::2]
            self.stride *= 2

    # ------------------------------------------------------------------ output
    def summary(self) -> dict:
        """Step-time statistics (seconds): ``n``, ``total_s``, ``mean_s``, ``min_s``, ``max_s`` over every
        timed step; ``window``, ``median_s``, ``p25_s``, ``p75_s`` over the last ``window`` of them."""
        self._drain()
        with self._lock:
            times = list(self._times)
            out = {"n": self._n_times, "total_s": round(self._total, 6),
                   "mean_s": round(self._total / self._n_times, 6) if self._n_times else None,
                   "min_s": round(self._min, 6) if self._n_times else None,
                   "max_s": round(self._max, 6) if self._n_times else None,
                   "window": len(times), "median_s": None, "p25_s": None, "p75_s": None}
        if times:
            q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
            out.update(median_s=round(statistics.median(times), 6), p25_s=round(q[0], 6), p75_s=round(q[2], 6))
        return out

    def to_dict(self) -> dict:
        """The report's ``steps`` section (JSON-safe); see docs/reports.md for every field."""
        summary = self.summary()
        with self._lock:
            return {
                "count": self.count,
                "optimizers": len(self._optimizers),
                "kept": len(self.records),
                "stride": self.stride,
                "max_records": self.max_records,
                "device": str(self.device),
                "memory_fields": ["process_rss", "process_rss_peak"] + (["device_allocated"] if self._backend is not None else []),
                "levels": list(self.level_labels),
                "step_time": summary,
                "optimizer_time_total_s": round(self._opt_total, 6),
                "memory_peak": dict(self.memory_peak),
                "records": [dict(r) for r in self.records],
            }
