"""The page-fault handler on the script's threads.

The handler (:class:`~apt_model.memory.paging.fault.PageFaultMode`) is a torch-function mode,
and torch keeps one mode stack per thread: the session pushes it on the thread that starts paging
only. A paged model's forward, backward and optimizer step page through their module, tensor and
optimizer hooks on any thread; any other op on a paged-out tensor — a gradient norm logged on a
training thread, an EMA update, a read of the weights — needs the handler on the thread that runs
it, or it reads freed memory (on the CPU a segmentation fault: found 2026-11-27 by a probe).

* **Threads started while paging is on** (``threading.Thread``, its subclasses, thread pools)
  run their whole life with a stand-in for the handler at the bottom of their mode stack
  (:class:`~apt_model.memory.paging.backward_hooks.ThreadFaults`: each op goes to the handler of
  the session open at that moment): ``Thread._bootstrap_inner``, the one entry every Python thread
  runs, is wrapped for as long as the session is open. A thread that outlives the session (a
  thread pool) is a pass-through until the next ``enable()`` pages again, and is then served by the
  new session (until 2026-11-27 it kept the closed session's handler: a segmentation fault). The
  memory stack's own threads (names starting with :data:`INTERNAL_PREFIXES`: swap I/O, probes,
  retries) are left alone: they handle pages themselves.
* **Threads that were running before paging started** cannot be given a mode from outside (torch
  has no call for another thread's stack). Where paging starts off the main thread (a model first
  moved or called on a worker), the main thread is one of them: a warning says so
  (:func:`warn_if_off_main_thread`), and ``docs/tiers.md`` says how to avoid it.
"""
from __future__ import annotations

import threading

import torch

from apt_model.base.log import get_logger
from apt_model.memory.paging.backward_hooks import THREAD_FAULTS

log = get_logger(__name__)

#: Thread-name prefixes of the project's own threads (swap I/O pools ``vb-swap-*``, the disk
#: probe ``vb-bw-disk``, interrupt retries ``vb-interrupt-retry``, FP4 kernels ``apt-fp4``, the
#: RSS sampler ``apt_model-rss-peak``): they run without the handler.
INTERNAL_PREFIXES = ("vb-", "apt-", "apt_model-")


def install(patches) -> bool:
    """Run every thread started from now on (until ``patches`` are undone) with the fault
    handler's stand-in (:data:`~apt_model.memory.paging.backward_hooks.THREAD_FAULTS`: the handler
    of whichever paging session is open at each op) at the bottom of its torch-function mode stack,
    except the project's own threads. Returns False, changing nothing, where ``threading.Thread``
    has no ``_bootstrap_inner`` (a Python that lacks it: then only the starting thread and the
    hooks have the handler)."""
    real = getattr(threading.Thread, "_bootstrap_inner", None)
    if real is None:
        log.debug("threading.Thread._bootstrap_inner not found: threads started while paging get no fault handler")
        return False

    def _bootstrap_inner(thread):
        if thread.name.startswith(INTERNAL_PREFIXES):
            return real(thread)
        torch._C._push_on_torch_function_stack(THREAD_FAULTS)
        try:
            return real(thread)
        finally:
            torch._C._pop_torch_function_stack()

    patches.set_attr(threading.Thread, "_bootstrap_inner", _bootstrap_inner,
                     label="threading.Thread._bootstrap_inner (fault handler on new threads)")
    return True


def warn_if_off_main_thread() -> None:
    """Warn when paging starts on a thread other than the main one (see the module docstring)."""
    here = threading.current_thread()
    if here is threading.main_thread():
        return
    log.warning("paging started on thread %r, not the main thread: threads already running (the main thread among "
                "them) have no page-fault handler, and an op there on a paged-out tensor outside the model's forward, "
                "backward and optimizer step (reading the weights, logging a gradient norm) reads freed memory. "
                "Move the model with model.to(device) (or vb.adopt(model)) on the main thread before the worker "
                "starts, or call vb.disable() before using the model elsewhere", here.name)
