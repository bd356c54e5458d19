"""Contexts a forward pre-hook enters and the forward hook leaves, kept straight across interrupts.

The switch enters contexts around a model's forward with hooks (autocast, activation offload's
saved-tensor hooks): the pre-hook enters, a forward hook registered with ``always_call=True``
leaves. PyTorch runs always-called hooks when the forward raises an ``Exception``, but not for a
``BaseException`` such as ``KeyboardInterrupt`` (Ctrl-C in a notebook): the context then stayed
entered on that thread for the rest of the process — every later op autocast, every later graph's
saved tensors offloaded — until 2026-11-26.

:class:`ForwardScopes` keeps, per thread, what each call entered together with that call's
``nn.Module._call_impl`` frame, which is on the stack exactly while the call runs. The next call's
pre-hook first leaves the entries whose frame is gone (:meth:`ForwardScopes.unwind`), and the
switch's ``disable()`` leaves whatever is left. Code the script runs between the interrupt and the
model's next call still sees the context.

Under compilation autocast's hooks run eagerly (:func:`eagerly`): Dynamo traces a module's hooks with
its forward, and a context entered by hand in a traced pre-hook is only simulated there — the
real autocast object never got its saved state, so the forward hook, run for real after a graph
break, raised ``AttributeError: 'autocast' object has no attribute 'prev'`` (``model.compile()``
on an adopted model, or a compiled wrapper of one, with bf16 autocast on: a probe's finding,
2026-11-28). Run eagerly, the hook enters the real context before the compiled forward, whose
graph is then traced and guarded under it.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import torch
import torch.nn as nn

from apt_model.base.post_import import when_imported

_CALL_IMPL = nn.Module._call_impl.__code__


def _call(fn: Callable, *args):
    return fn(*args)


#: ``[torch._dynamo.disable(_call)]`` once Dynamo is imported (importing it costs about a second:
#: the switch never does so itself), else empty.
_EAGER: list = []
_watching = [False]


def _dynamo_imported(dynamo) -> None:
    if not _EAGER:
        _EAGER.append(dynamo.disable(_call, reason="apt_model's autocast hooks enter and leave a context "
                                     "by hand, which a trace cannot carry across the model's call; with "
                                     "fullgraph=True, compile without it or enable(mixed_precision='off')"))


def watch_compilation() -> None:
    """Prepare :func:`eagerly` for compiled code: now if Dynamo is imported, else right after its
    first import (:func:`~apt_model.base.post_import.when_imported`). Called when hooks that use
    :func:`eagerly` are attached; idempotent."""
    if not _watching[0]:
        _watching[0] = True
        when_imported("torch._dynamo", _dynamo_imported)


def eagerly(fn: Callable, *args):
    """``fn(*args)``; called from code Dynamo traces, the call is a graph break and runs eagerly
    (``torch._dynamo.disable``), so the contexts ``fn`` enters or leaves are real ones (see the
    module docstring). A ``fullgraph=True`` compile of a model with such hooks therefore raises
    Dynamo's graph-break error instead of tracing them. Needs :func:`watch_compilation` first."""
    if _EAGER and torch.compiler.is_compiling():
        return _EAGER[0](fn, *args)
    return fn(*args)


def module_call_frame():
    """The innermost ``nn.Module._call_impl`` frame on this thread's stack, or None (a hook called
    by hand)."""
    f = sys._getframe(1)
    while f is not None and f.f_code is not _CALL_IMPL:
        f = f.f_back
    return f


def on_stack(frame) -> bool:
    """Whether ``frame`` is on the calling thread's stack (its call has not ended)."""
    f = sys._getframe(1)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False


class ForwardScopes:
    """Per-thread stack of ``(context, payload, frame)`` entries, one per hooked forward call.

    ``context`` is an entered context manager (left with ``__exit__(None, None, None)``) or None
    (the call entered nothing); ``payload`` is the owner's (a trial sample...), handed to
    ``on_abandon(payload)`` when its call is found ended without its hook. Copies (pickling,
    ``copy.deepcopy``) start empty and without ``on_abandon``.
    """

    def __init__(self, on_abandon: Callable[[Any], None] | None = None):
        self._tls = threading.local()
        self.on_abandon = on_abandon

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self._tls = threading.local()
        self.on_abandon = None

    def stack(self) -> list:
        """This thread's entries, innermost last."""
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        return stack

    def push(self, context: Any, payload: Any = None) -> None:
        """Record what the call now starting entered (from its pre-hook, which calls
        :meth:`unwind` first). Takes no frame while anything compiles (Dynamo would break the graph
        on it)."""
        frame = None if torch.compiler.is_compiling() else module_call_frame()
        self.stack().append((context, payload, frame))

    def pop(self) -> tuple[Any, Any] | None:
        """The innermost entry's ``(context, payload)`` (from the forward hook; the caller leaves
        the context), or None when there is none, or when it is not this call's (the call's
        pre-hook never pushed: an earlier pre-hook raised, and the entry is an enclosing call's)."""
        stack = self.stack()
        if not stack:
            return None
        frame = stack[-1][2]
        if frame is not None and not torch.compiler.is_compiling() and frame is not module_call_frame():
            return None
        context, payload, _ = stack.pop()
        return context, payload

    def unwind(self, live_only: bool = True) -> int:
        """Leave the entries of calls that ended without their forward hook: with ``live_only``,
        those whose frame is no longer on this thread's stack (innermost first, stopping at the
        first live one); else all of them (``disable()``). ``on_abandon(payload)`` is called for
        each left entry with a payload. Returns how many were left."""
        if live_only and torch.compiler.is_compiling():
            return 0  # frames are no business of a trace
        stack = self.stack()
        n = 0
        while stack:
            context, payload, frame = stack[-1]
            if live_only and (frame is None or on_stack(frame)):
                break
            stack.pop()
            if context is not None:
                context.__exit__(None, None, None)
            if payload is not None and self.on_abandon is not None:
                self.on_abandon(payload)
            n += 1
        return n


def in_enclosing_checkpoint() -> bool:
    """Whether the calling code runs inside a non-reentrant ``torch.utils.checkpoint`` region of
    the script's own — its forward or its recomputation in backward — as the innermost saved-tensor
    hooks show (PyTorch keeps no other record of it)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"
