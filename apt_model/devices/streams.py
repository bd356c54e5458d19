"""Copy streams and events: host<->device copies that run beside compute instead of in its way.

On an accelerator, work is queued on *streams* and runs asynchronously to the host. A copy
issued with ``copy_(..., non_blocking=True)`` on a side stream overlaps the kernels of the
compute stream; *events* order the two: an event recorded on one stream marks a point in its
queue, another stream can be made to wait for that point on the device (no host block), and the
host can ask whether the point was reached (``query``, non-blocking) or wait for that one point
(never for the whole device). PyTorch exposes this for every accelerator through ``torch.Stream``,
``torch.Event`` and ``torch.accelerator.current_stream`` (CUDA/ROCm, XPU, NPU and PrivateUse1
backends that implement streams); the device module (``torch.cuda``...) is the fallback.

Two layers:

* :class:`StreamOps` — the primitives of one device (current stream, new stream, new event,
  record, stream-waits-event, query, copy on a stream). :func:`stream_ops` builds one for a
  device, or returns None where copies stay synchronous: the CPU (no streams), and a device
  whose torch build offers no usable streams and events (the reason is logged). Tests replace
  :func:`stream_ops` to inject a fake stream and event layer.
* :class:`CopyStream` — one side stream for copies, ordered against the calling thread's
  current (compute) stream: :meth:`CopyStream.mark` records where compute is,
  :meth:`CopyStream.copy` makes the side stream wait for that point, enqueues the copy and
  returns a :class:`CopyEvent` for its completion, :meth:`CopyStream.join` makes compute wait
  for a copy on the device. :class:`EventFuture` wraps a :class:`CopyEvent` in the part of the
  ``concurrent.futures.Future`` interface the memory stack uses (``done``, ``result(timeout)``,
  ``exception``).

Nothing here ever calls a device-wide synchronize: host waits are for one event, bounded by the
caller's timeout (polled with ``query``; ``Event.synchronize`` only for an unbounded wait).
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

log = logging.getLogger(__name__)

_POLL_FIRST_S = 20e-6  # first sleep of a bounded event wait; doubles up to _POLL_MAX_S
_POLL_MAX_S = 1e-3


class StreamOps:
    """Stream and event primitives of one accelerator.

    Uses ``torch.accelerator.current_stream`` / ``torch.Stream`` / ``torch.Event`` when the device
    is the current accelerator, else the device module (``torch.<type>.current_stream``,
    ``.Stream``, ``.Event``, ``.stream``).

    Args:
        device: the accelerator (an index is filled in from the current device when missing).

    Raises:
        RuntimeError / AttributeError / TypeError: (from the constructor) the torch build offers no
            streams and events for this device; :func:`stream_ops` turns that into None.
    """

    def __init__(self, device: torch.device | str):
        dev = torch.device(device)
        acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        generic = acc is not None and acc.type == dev.type and hasattr(torch.accelerator, "current_stream")
        mod = getattr(torch, dev.type, None)
        if dev.index is None:
            if generic:
                dev = torch.device(dev.type, torch.accelerator.current_device_index())
            elif mod is not None and hasattr(mod, "current_device"):
                dev = torch.device(dev.type, mod.current_device())
        self.device = dev
        self._mod = mod
        self.source = "torch.accelerator / torch.Stream / torch.Event" if generic else f"torch.{dev.type}"
        self._generic = generic
        # probe every primitive once: a build without them fails here, not in the middle of a step
        stream, event = self.new_stream(), self.new_event()
        self.record(event, self.current_stream())
        self.wait_event(stream, event)
        self.query(event)

    def current_stream(self) -> Any:
        """The calling thread's current stream on the device (where compute is queued)."""
        if self._generic:
            return torch.accelerator.current_stream(self.device)
        return self._mod.current_stream(self.device)

    def new_stream(self) -> Any:
        """A new stream on the device."""
        if self._generic:
            return torch.Stream(device=self.device)
        return self._mod.Stream(device=self.device)

    def new_event(self) -> Any:
        """A new event (no timing) on the device."""
        if self._generic:
            return torch.Event(device=self.device)
        return self._mod.Event()

    def record(self, event: Any, stream: Any) -> None:
        """Record ``event`` at the end of ``stream``'s queue (returns at once)."""
        event.record(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make work queued on ``stream`` from now on wait for ``event`` (on the device; no host block)."""
        stream.wait_event(event)

    def query(self, event: Any) -> bool:
        """Whether the device has passed ``event`` (non-blocking)."""
        return bool(event.query())

    def synchronize_event(self, event: Any) -> None:
        """Block the host until the device has passed ``event`` (this event only)."""
        event.synchronize()

    @contextlib.contextmanager
    def using(self, stream: Any):
        """Make ``stream`` the calling thread's current stream for the ``with`` block, then give
        back the caller's stream (and current device). Re-entrant: it saves and restores the
        caller's stream itself rather than entering ``torch.Stream`` as a context manager, which is
        not re-entrant in some torch releases (a nested use left the side stream current for the
        rest of the run: seen on an H200, copies queued while the side stream was the caller's
        current stream)."""
        if self._generic:
            index = torch.accelerator.current_device_index()
            prev = torch.accelerator.current_stream(self.device)
            torch.accelerator.set_stream(stream)
            try:
                yield
            finally:
                torch.accelerator.set_stream(prev)
                if torch.accelerator.current_device_index() != index:
                    torch.accelerator.set_device_index(index)
        elif hasattr(self._mod, "stream"):
            with self._mod.stream(stream):  # a new context object per call: it keeps its own previous stream
                yield
        else:
            with stream:
                yield

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Enqueue ``dst.copy_(src, non_blocking=True)`` on ``stream`` (:meth:`using`). The copy runs
        with torch functions disabled: no torch-function mode sees it (the paging fault handler
        did, and ran Python, even evicted pages, while the side stream was current)."""
        with torch._C.DisableTorchFunction(), self.using(stream):
            dst.copy_(src, non_blocking=True)


def stream_ops(device: torch.device | str) -> StreamOps | None:
    """The stream primitives of ``device``, or None where copies stay synchronous: the CPU, or a
    device without usable streams and events (the reason is logged at INFO). Never raises."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return None
    try:
        return StreamOps(dev)
    except Exception as err:  # noqa: BLE001 - no streams on this kind: synchronous copies, still correct
        log.info("%s: no copy streams (%s: %s); host<->device copies run synchronously", dev,
                 type(err).__name__, err)
        return None


class CopyEvent:
    """The completion of one copy on a :class:`CopyStream`.

    Holds the tensors the copy reads and writes (and anything passed as ``keep``) until the copy
    is known to be complete, so their memory cannot go back to an allocator while the device
    still uses it (dropping the last reference to a tensor is not enough to free it early).

    Attributes:
        seq: issue order on its stream (copies on one stream complete in this order).
        stream: the :class:`CopyStream` it was issued on (None: a lone event).
        error: the exception a query raised (a device error), else None.
    """

    __slots__ = ("ops", "event", "seq", "stream", "error", "_done", "_keep")

    def __init__(self, ops: StreamOps, event: Any, seq: int, keep: tuple = (), stream: "CopyStream | None" = None):
        self.ops = ops
        self.event = event
        self.seq = seq
        self.stream = stream
        self.error: BaseException | None = None
        self._done = False
        self._keep = keep

    def done(self) -> bool:
        """Whether the copy has completed: known without asking the device when a later copy on
        its stream was seen complete (:attr:`CopyStream.completed`), else a non-blocking
        ``query`` (a query that raised counts as complete, with the error kept in :attr:`error`)."""
        if self._done:
            return True
        st = self.stream
        if st is not None and st.completed >= self.seq:
            self._done, self._keep = True, ()
            return True
        try:
            ok = self.ops.query(self.event)
        except Exception as err:  # noqa: BLE001 - a device error: reported by the future
            self.error, ok = err, True
        if ok:
            self._complete()
        return ok

    def _complete(self) -> None:
        self._done, self._keep = True, ()
        st = self.stream
        if st is not None and self.error is None and self.seq > st.completed:
            st.completed = self.seq  # a lost race between threads only costs later queries

    def wait(self, timeout: float | None) -> bool:
        """Block the host until the copy completed, at most ``timeout`` seconds (None: no limit,
        through ``Event.synchronize``). Returns whether it completed. Waits for this one event,
        never for the device."""
        if self.done():
            return True
        if timeout is None:
            try:
                self.ops.synchronize_event(self.event)
            except Exception as err:  # noqa: BLE001 - reported like a failed query
                self.error = err
            self._complete()
            return True
        deadline = time.monotonic() + timeout
        delay = _POLL_FIRST_S
        while not self.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(delay, left))
            delay = min(delay * 2, _POLL_MAX_S)
        return True


class EventFuture:
    """A :class:`CopyEvent` as a future: ``done()`` is the event's query, ``result(timeout)``
    waits for that event only and raises ``TimeoutError`` when it has not completed in time
    (as ``concurrent.futures.Future.result`` does). Its result is None."""

    def __init__(self, event: CopyEvent, what: str = "copy"):
        self.event = event
        self.what = what

    def done(self) -> bool:
        return self.event.done()

    def running(self) -> bool:
        return not self.event.done()

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        return False

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The device error of the copy, or None. Raises ``TimeoutError`` if not complete in time."""
        if not self.event.wait(timeout):
            raise TimeoutError(f"{self.what} has not completed after {timeout:g} s")
        return self.event.error

    def result(self, timeout: float | None = None) -> None:
        """Wait (at most ``timeout`` seconds; None: no limit) for the copy.

        Raises:
            TimeoutError: the copy has not completed in time (it goes on; nothing was freed).
            the device error the copy's event reported.
        """
        err = self.exception(timeout)
        if err is not None:
            raise err


class CopyStream:
    """A side stream for host<->device copies, ordered against the caller's current stream.

    Args:
        ops: the device's stream primitives (see :func:`stream_ops`).

    Attributes:
        stream: the side stream (never the device's default stream).
        issued: copies enqueued so far.
        completed: the highest ``seq`` seen complete: copies on one stream complete in issue order,
            so every copy up to it has (:meth:`CopyEvent.done` then asks the device nothing).
    """

    def __init__(self, ops: StreamOps):
        self.ops = ops
        self.device = ops.device
        self.stream = ops.new_stream()
        self.issued = 0
        self.completed = 0

    def mark(self) -> Any:
        """An event recorded now on the calling thread's current stream: where compute is. A copy
        given it as ``after`` starts only once the device got there."""
        ev = self.ops.new_event()
        self.ops.record(ev, self.ops.current_stream())
        return ev

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None, keep: tuple = (),
             behind: "CopyEvent | None" = None) -> CopyEvent:
        """Enqueue ``dst.copy_(src)`` on the side stream, after ``after`` (an event from
        :meth:`mark`; default: a mark taken now, i.e. after every kernel already queued on the
        current stream — which is what makes reading the bytes compute produced, or writing into
        memory the caching allocator handed out on the compute stream, safe) and after ``behind``
        (a copy on another side stream that touches the same memory). Returns at once.

        Returns:
            the :class:`CopyEvent` of its completion (holding ``dst``, ``src``, ``keep`` and
            ``behind``, whose own tensors then live until this copy completed).
        """
        ops = self.ops
        if behind is not None:
            ops.wait_event(self.stream, behind.event)
        ops.wait_event(self.stream, self.mark() if after is None else after)
        ops.copy(dst, src, self.stream)
        done = ops.new_event()
        ops.record(done, self.stream)
        self.issued += 1
        held = (dst, src, *keep) if behind is None else (dst, src, *keep, behind)  # behind's memory too
        return CopyEvent(ops, done, self.issued, keep=held, stream=self)

    def join(self, event: CopyEvent) -> None:
        """Make work queued on the calling thread's current stream from now on wait for ``event``
        (on the device: the host does not block)."""
        self.ops.wait_event(self.ops.current_stream(), event.event)

    def is_default_stream(self) -> bool:
        """Whether :attr:`stream` is the device's default stream (it never should be)."""
        mod = getattr(torch, self.device.type, None)
        default = getattr(mod, "default_stream", None)
        if default is None:
            return False
        return getattr(default(self.device), "stream_id", None) == getattr(self.stream, "stream_id", object())


def copy_stream(device: torch.device | str) -> CopyStream | None:
    """A :class:`CopyStream` for ``device``, or None where copies stay synchronous (see
    :func:`stream_ops`). Never raises."""
    ops = stream_ops(device)
    if ops is None:
        return None
    try:
        return CopyStream(ops)
    except Exception as err:  # noqa: BLE001 - the side stream could not be made: synchronous copies
        log.info("%s: no copy stream (%s: %s); host<->device copies run synchronously", device,
                 type(err).__name__, err)
        return None


def completed(events: Iterable[tuple[Any, CopyEvent]]) -> list[Any]:
    """The keys of the ``(key, event)`` pairs whose copies completed, given in issue order per
    stream: the device is asked about the oldest running copy of each stream only, since a later
    copy of a stream seen running is running too (asking every copy in flight made a query per copy
    per call: 10,000 for 200 writes over 50 calls). A pair out of issue order is at worst reported
    a call later. Lone events (no stream) are each asked."""
    running: set[int] = set()  # id() of the streams seen with a copy still running
    done = []
    for key, event in events:
        stream = event.stream
        if stream is not None and id(stream) in running:
            continue
        if event.done():
            done.append(key)
        elif stream is not None:
            running.add(id(stream))
    return done


def copy_streams(device: torch.device | str) -> tuple[CopyStream | None, CopyStream | None]:
    """``(down, up)``: a side stream for device -> host copies and one for host -> device copies,
    so a copy up never queues behind the copies down (a GPU runs the two directions on separate
    copy engines). Both None where copies stay synchronous; both the same stream where only one
    could be made. Never raises."""
    down = copy_stream(device)
    if down is None:
        return None, None
    return down, copy_stream(device) or down
