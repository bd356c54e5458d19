"""Measurement helpers for the scripts in this folder. The statistics and the machine description
have one implementation, in the package (:mod:`apt_model.bench.measure`), shared with
``apt-vb bench``; :func:`train_step` is the training step the benchmarks time.

Rules every benchmark follows (DESIGN.md section 9): warm-up first, A and B interleaved in one
run, medians with spread, the thread count fixed and recorded, results written as JSON with the
machine description and printed as a short table.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from apt_model.bench.measure import machine_info, summarize, write_json  # noqa: F401 (the scripts import them here)


class StepClock:
    """Times whole steps on ``device``, draining the device's queue once per step boundary (never
    per op). CUDA: a ``torch.cuda.Event`` pair on the device's current stream (recorded at
    :meth:`start`, recorded and synchronized at :meth:`stop`); another accelerator:
    ``torch.<type>.synchronize()`` at both ends; CPU: ``time.perf_counter`` alone.

    Usage: ``clock.start(); ...one step...; seconds = clock.stop()``; ``clock.wall`` is the host
    wall time of the same interval (equal to ``seconds`` off CUDA).
    """

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        mod = getattr(torch, self.device.type, None) if self.device.type not in ("cpu", "cuda") else None
        self._sync = getattr(mod, "synchronize", None)
        self._start = None
        self._t0 = 0.0
        self.wall = 0.0

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(torch.cuda.current_stream(self.device))
        elif self._sync is not None:
            self._sync()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds since :meth:`start` (device-event time on CUDA, wall time elsewhere)."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            end.synchronize()
            self.wall = time.perf_counter() - self._t0
            return self._start.elapsed_time(end) / 1e3
        if self._sync is not None:
            self._sync()
        self.wall = time.perf_counter() - self._t0
        return self.wall


class WorkerDied(RuntimeError):
    """A benchmark's worker process ended (or went silent) before it answered."""


def from_worker(conn, proc, what: str, timeout: float | None = None):
    """The next message of the worker process ``proc`` on ``conn`` (a ``multiprocessing`` pipe end
    whose other end the parent has closed after ``proc.start()``).

    Raises:
        WorkerDied: ``proc`` ended without a message (its own traceback is on stderr; the message
            says ``what`` it was doing and its exit code), or sent none in ``timeout`` seconds
            (then it is terminated). Without this a parent waited forever on a dead worker.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while not conn.poll(1.0):
        if not proc.is_alive() and not conn.poll(0):
            proc.join(5)
            raise WorkerDied(f"the worker died while {what} (exit code {proc.exitcode})")
        if deadline is not None and time.monotonic() > deadline:
            proc.terminate()
            raise WorkerDied(f"no answer from the worker in {timeout:g} s while {what}")
    try:
        return conn.recv()
    except EOFError:
        proc.join(5)
        raise WorkerDied(f"the worker died while {what} (exit code {proc.exitcode})") from None


def start_worker(target, *args, what: str = "starting", timeout: float | None = None):
    """Start ``target(conn, *args)`` in a spawned process and wait for its ``"ready"``; returns
    ``(conn, proc)``. Workers are started one at a time by the callers, so one worker's set-up
    (the switch's probes, a compile) never shares the cores with another's.

    Raises:
        WorkerDied: the worker ended or answered something else first (see :func:`from_worker`).
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    child.close()  # the worker holds the only other end: its death ends the pipe
    answer = from_worker(parent, proc, what, timeout)
    if answer != "ready":
        proc.terminate()
        raise WorkerDied(f"the worker answered {answer!r} instead of 'ready' while {what}")
    return parent, proc


def serve(conn, handle) -> None:
    """A worker's loop: send ``"ready"``, then answer each message with ``handle(message)`` until
    ``"stop"``."""
    conn.send("ready")
    while (msg := conn.recv()) != "stop":
        conn.send(handle(msg))


def stop_workers(workers: dict) -> dict:
    """Send ``"stop"`` to each ``name -> (conn, proc)`` worker; returns each one's last message
    (its report) and joins it."""
    finals = {}
    for name, (conn, proc) in workers.items():
        conn.send("stop")
        finals[name] = from_worker(conn, proc, f"{name}: stopping")
        proc.join(timeout=60)
    return finals


def cpu_and_minor_faults() -> tuple[float, int]:
    """CPU seconds of every thread of this process (``time.process_time``) and its minor page
    faults so far (``getrusage``): take two readings and subtract."""
    import resource

    return time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def train_step(model, opt, corpus, gen, batch_size: int, seq_len: int, device="cpu", clip: float | None = 1.0,
               autocast_dtype: torch.dtype | None = None) -> float:
    """One full training step of a byte-level LM on ``corpus`` (batch, forward, loss, backward,
    clipping, optimizer step); returns its wall time in seconds (``loss.item()`` included, so the
    device has finished). ``autocast_dtype``: forward and loss under ``torch.autocast`` written by
    hand, as a user tuning the script would."""
    t0 = time.perf_counter()
    x, y = corpus.batch("train", batch_size, seq_len, gen, device)
    dev_type = torch.device(device).type
    with torch.autocast(dev_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss = F.cross_entropy(model(x).reshape(-1, 256).float(), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    loss.item()
    return time.perf_counter() - t0
