"""The compiler a device kind offers, and a wrapper that counts what it compiles.

The device contract (:class:`~apt_model.devices.backend.AcceleratorBackend`) names the
``torch.compile`` backend per kind (``compile_backend``: TorchInductor by default, its C++ backend
on the CPU only where a C++ compiler is on the PATH, a kind's own graph mode where it has one).
:class:`CountingBackend` wraps that backend so the ladder sees every compilation: the first, each
recompilation (a new input shape, a guard that failed), and each piece a graph break leaves — the
count behind recompile-storm detection — and the seconds spent compiling.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch

from apt_model.base.log import get_logger
from apt_model.devices.registry import registered_backends

log = get_logger(__name__)


def device_backend(device: torch.device | str):
    """The registered :class:`~apt_model.devices.backend.AcceleratorBackend` for ``device``'s type
    (the first registered kind with that device type), or None."""
    dtype = torch.device(device).type
    for backend in registered_backends():
        if backend.device_type == dtype:
            return backend
    return None


def compiler_for(device: torch.device | str) -> tuple[Any, str, Any]:
    """``(backend, reason, device_backend)`` of the compile rung on ``device``: backend is None
    (with the reason) where the kind offers no compiler."""
    kind = device_backend(device)
    if kind is None:
        return None, f"no device backend is registered for {torch.device(device).type}", None
    backend, reason = kind.compile_backend()
    return backend, reason, kind


def resolve_backend(backend: str | Callable) -> Callable:
    """A backend name (``"inductor"``, ``"eager"``...) as the callable ``torch.compile`` would use."""
    if callable(backend):
        return backend
    from torch._dynamo import lookup_backend  # torch.compile's own name -> backend table

    return lookup_backend(backend)


class CountingBackend:
    """A ``torch.compile`` backend that delegates to ``backend`` and counts.

    Args:
        backend: a backend name or callable ``(gm, example_inputs) -> callable``.

    Attributes:
        compiles: graphs compiled so far (first compilation, recompilations, graph-break pieces).
        seconds: wall seconds spent inside the backend (forward graphs; a backward graph compiled
            lazily at the first backward is not counted here).
        name: the backend's name for the report.
        backend: the backend as given (the override rung reads its ``sites`` / ``rejected``).
        after: called with no argument after each compilation (None: nothing), its errors
            logged: the ladder brings a kept rung's report entry up to date.
    """

    def __init__(self, backend: str | Callable):
        self.name = backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)
        self.backend = backend
        self._inner = resolve_backend(backend)
        self.compiles = 0
        self.seconds = 0.0
        self.after: Callable[[], None] | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list):
        start = time.perf_counter()
        self.compiles += 1
        try:
            with keep_saved_buffers():
                return self._inner(gm, example_inputs)
        finally:
            self.seconds += time.perf_counter() - start
            if self.after is not None:
                try:
                    self.after()
                except Exception as err:  # noqa: BLE001 - a report's update must not fail a compilation
                    log.debug("compile counter: after(): %s", err)


def keep_saved_buffers():
    """A context in which AOTAutograd compiles a backward that does not reuse ("donate") the
    buffers its forward saved (``torch._functorch.config.donated_buffer=False``; a no-op where this
    torch has no such setting). A backward with donated buffers refuses a graph kept for a second
    backward ("compiled with non-empty donated buffers which requires create_graph=False and
    retain_graph=False"): a script's ``loss.backward(retain_graph=True)`` or
    ``torch.autograd.functional.jacobian`` over a model on a compile rung raised, where plain
    PyTorch runs (until 2026-11-28: a probe's finding). The setting is read while the graph
    compiles, so only the switch's rungs are compiled so; the script's own ``torch.compile`` is not
    changed. The cost: the backward allocates those buffers anew."""
    try:
        import torch._functorch.config as functorch_config
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(functorch_config, "donated_buffer"):
        return contextlib.nullcontext()
    return functorch_config.patch(donated_buffer=False)


def ladder_rungs(kind, builtin_overrides: dict) -> list[dict]:
    """The rungs a device kind offers, for ``apt-vb info``: ``[{"rung", "offered", "how"}, ...]``
    (compile: the kind's compiler or why there is none; override: the built-in rewrites plus the
    kind's own; eager: always).

    Args:
        kind: an :class:`~apt_model.devices.backend.AcceleratorBackend`.
        builtin_overrides: the switch's built-in override rewrites (``tag -> fn``).
    """
    backend, why = kind.compile_backend()
    overrides = [*builtin_overrides, *(t for t in kind.overrides() if t not in builtin_overrides)]
    return [{"rung": "compile", "offered": backend is not None, "how": why},
            {"rung": "override", "offered": bool(overrides),
             "how": ", ".join(overrides) + " (captured graph rewritten, verified, run eagerly)" if overrides else "none registered"},
            {"rung": "eager", "offered": True, "how": "the model as written"}]
