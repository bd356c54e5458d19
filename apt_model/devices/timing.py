"""Timing work on a device without stalling it: one clock interface for hosts and accelerators.

Accelerator kernels run asynchronously: a host timestamp taken after launching work measures the
launch, not the work. The usual fix, a device synchronize around each timestamp, is correct but
drains the device's queue every time, so a training loop timed that way runs slower than one
that is not timed. Device events are the cure: an event is recorded into the stream in order with
the kernels, the device stamps it when it gets there, and the host reads the difference of two
stamps later, once the second event has completed (``query()`` is non-blocking). PyTorch exposes
this for every accelerator through ``torch.Event`` (CUDA/ROCm, XPU, NPU and other PrivateUse1
backends that implement events; PyTorch docs, "torch.Event").

Three clocks, one interface (``mark``, ``ready``, ``wait``, ``elapsed``):

* :class:`HostClock` for the CPU: ``time.perf_counter`` (CPU ops are synchronous).
* :class:`EventClock` for accelerators with timing events: never synchronizes the device;
  ``wait`` blocks on one event only when a caller must have the figure now.
* :class:`SyncClock` for accelerators without events: a device synchronize, then the host clock
  (correct, and costly: callers should use it for a bounded number of marks only).

:func:`clock_for` picks one per device and says why. :func:`synchronize` is the project's one
"wait for the device" call.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

log = logging.getLogger(__name__)


def synchronize(device: torch.device | str) -> None:
    """Block the host until all queued work on ``device`` (its current device when it has no
    index) has finished; no-op on the CPU.

    Uses the kind's module (``torch.cuda``, ``torch.xpu``, ``torch.npu``...) when it has
    ``synchronize``; a kind without one is left alone (nothing to wait for that PyTorch exposes).
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        return
    mod = getattr(torch, dev.type, None)
    if mod is not None and hasattr(mod, "synchronize"):
        if dev.index is None:
            mod.synchronize()
        else:
            mod.synchronize(dev)


class HostClock:
    """Host wall clock for synchronous devices (the CPU). Marks are ``float`` seconds."""

    kind = "host"

    def mark(self) -> float:
        """A timestamp (seconds, ``time.perf_counter``)."""
        return time.perf_counter()

    def ready(self, mark: Any) -> bool:
        """Host marks are always complete."""
        return True

    def wait(self, mark: Any) -> None:
        """Nothing to wait for."""

    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end``."""
        return end - start


class SyncClock(HostClock):
    """Host clock after a device synchronize: for accelerators without timing events. Each
    :meth:`mark` drains the device queue (correct, but it stalls the device)."""

    kind = "host+synchronize"

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self) -> float:
        """Synchronize the device, then a host timestamp (seconds)."""
        synchronize(self.device)
        return time.perf_counter()


class EventClock:
    """Device timing events (``torch.Event(enable_timing=True)``): marks are events recorded on the
    device's current stream; no host-device synchronization unless :meth:`wait` is called.

    Args:
        device: the accelerator (with index) whose current stream the events are recorded on.
    """

    kind = "device events"

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self) -> torch.Event:
        """Record an event on the device's current stream (returns at once). The stream is that of
        :attr:`device` itself: ``torch.Event(device=...)`` keeps only the device's type, and
        ``record()`` without a stream records on the *current* device's stream, so a model on
        ``cuda:1`` while ``cuda:0`` is current was timed on an idle device (launch time, not its
        kernels)."""
        ev = torch.Event(device=self.device, enable_timing=True)
        try:
            stream = torch.accelerator.current_stream(self.device)
        except Exception:  # noqa: BLE001 - a backend without it: the current device's stream
            stream = None
        if stream is None:
            ev.record()
        else:
            ev.record(stream)
        return ev

    def ready(self, mark: torch.Event) -> bool:
        """Whether the device has reached ``mark`` (non-blocking)."""
        return bool(mark.query())

    def wait(self, mark: torch.Event) -> None:
        """Block the host until the device has reached ``mark`` (this one event, not the device)."""
        mark.synchronize()

    def elapsed(self, start: torch.Event, end: torch.Event) -> float:
        """Seconds between two completed events (``elapsed_time`` reports milliseconds)."""
        return start.elapsed_time(end) / 1e3


def clock_for(device: torch.device | str) -> tuple[HostClock | SyncClock | EventClock, str]:
    """The cheapest correct clock for ``device`` and why it was chosen.

    Returns:
        ``(clock, reason)``: :class:`HostClock` for ``cpu``; :class:`EventClock` when a timing event
        can be created, recorded and queried on the device; :class:`SyncClock` otherwise, with the
        event error in ``reason``. Never raises.
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        return HostClock(), "cpu: host clock (synchronous device)"
    if dev.index is None:
        try:
            mod = getattr(torch, dev.type)
            dev = torch.device(dev.type, mod.current_device())
        except Exception:  # noqa: BLE001 - a kind without current_device: events pick the current one
            pass
    try:
        clock = EventClock(dev)
        start, end = clock.mark(), clock.mark()
        clock.wait(end)
        clock.elapsed(start, end)
        return clock, f"{dev}: device timing events"
    except Exception as exc:  # noqa: BLE001 - any failure means: no usable events on this kind
        why = f"{dev}: no timing events ({type(exc).__name__}: {exc}); host clock after synchronize"
        log.debug(why)
        return SyncClock(dev), why
