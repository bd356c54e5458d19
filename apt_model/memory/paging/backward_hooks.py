"""User code that runs inside backward runs under the page-fault handler.

Autograd runs a backward without the Python torch-function modes of the thread that called it, so
the page-fault handler (:mod:`~apt_model.memory.paging.fault`) does not see what user code does
there: a full backward hook that logs ``module.weight.norm()``, a gradient hook reading another
module's weight, or the recomputation of a reentrant activation checkpoint that uses a parameter
outside its own module read a page the backward had already let go — freed storage, a segfault or
"storage of size 0". While paging is on, such code runs with the handler pushed on the running
thread's mode stack (and taken off after it):

* module backward hooks — a module's own (``register_full_backward_hook``,
  ``register_full_backward_pre_hook``, ``register_backward_hook``) and the global ones
  (``register_module_full_backward_hook`` and its pre-hook and deprecated twins), however and
  whenever registered — are wrapped as ``Module._call_impl`` reads them at each forward;
* hooks given to ``Tensor.register_hook`` and ``Tensor.register_post_accumulate_grad_hook`` are
  wrapped when registered;
* the backward of every custom ``torch.autograd.Function`` (``torch.utils.checkpoint``'s reentrant
  ``CheckpointFunction`` among them, whose backward reruns the forward): autograd calls it through
  ``BackwardCFunction.apply``, which is patched.

Tensor hooks registered before paging started are wrapped when their model is paged
(:func:`wrap_existing`: its parameters' hooks); hooks on other tensors registered before are not. The
library's own hooks (:class:`~apt_model.base.patches.SessionHook`) are not wrapped: they page what
they touch themselves. A wrapped hook pickles (``torch.save(model)``, ``copy.deepcopy``) as the
user's own function.
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.nn as nn
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode

from apt_model.base.patches import SessionHook
from apt_model.memory.paging.compiled import compiling


_CURRENT: list = [None]  # the fault handler of the paging session open now (None: paging is off)


class UnderFaults:
    """``fn`` run with the open paging session's fault handler on the current thread's mode stack
    (pushed only when it is active and not there already). The handler is looked up at each call:
    a hook wrapped in one session runs plainly once paging is off and under the next session's
    handler after a new ``enable()``, and holds no closed session alive."""

    __slots__ = ("fn", "__wrapped__")

    def __init__(self, fn):
        self.fn = fn
        self.__wrapped__ = fn

    def __call__(self, *args, **kwargs):
        return _under_faults(self.fn, args, kwargs)

    def __reduce__(self):
        return (_identity, (self.fn,))


def open_handler():
    """The fault handler (:class:`~apt_model.memory.paging.fault.PageFaultMode`) of the paging
    session open now, or None."""
    return _CURRENT[0]


class ThreadFaults(TorchFunctionMode):
    """A stand-in for the fault handler at the bottom of a thread's mode stack
    (:mod:`~apt_model.memory.paging.threads`): each op goes to the handler of the paging session
    open at that moment (a pass-through while none is, or while it is paused), so a thread that
    outlives a session is served by the next one and keeps nothing of the old."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        mode = _CURRENT[0]
        if mode is None or not mode.active:
            return func(*args, **(kwargs or {}))
        return mode.__torch_function__(func, types, args, kwargs)


#: The one stand-in every such thread gets.
THREAD_FAULTS = ThreadFaults()


def _under_faults(fn, args, kwargs):
    """``fn(*args, **kwargs)`` with the open session's fault handler pushed if it is active and
    this thread's mode stack has neither it nor the stand-in already."""
    mode = _CURRENT[0]
    if mode is None or not mode.active:
        return fn(*args, **kwargs)
    stack = torch.overrides._get_current_function_mode_stack()
    if mode in stack or THREAD_FAULTS in stack:
        return fn(*args, **kwargs)
    torch._C._push_on_torch_function_stack(mode)
    try:
        return fn(*args, **kwargs)
    finally:
        torch._C._pop_torch_function_stack()


def _identity(fn):
    return fn


_METHODS = [
    (torch.Tensor, "register_hook"),
    (torch.Tensor, "register_post_accumulate_grad_hook"),
]


def _wrapped(hooks: list) -> list:
    return [UnderFaults(h) if callable(h) and not isinstance(h, (SessionHook, UnderFaults)) else h for h in hooks]


def install(mode, patches) -> None:
    """Make ``mode`` (the session's fault handler) the one user code inside backward runs under,
    and patch (through ``patches``, undone when paging closes):

    * the tensor hook registrations, to wrap the hook in :class:`UnderFaults` (they pass through
      ``mode``: registering a hook reads no data);
    * ``nn.Module._get_backward_hooks`` / ``_get_backward_pre_hooks``, through which
      ``Module._call_impl`` reads a module's own and the global backward hooks at each forward:
      what they return is wrapped, however and whenever the hook was registered (an imported
      ``register_module_full_backward_hook``, the deprecated ``register_module_backward_hook``);
    * ``BackwardCFunction.apply`` / ``apply_boxed``: a custom Function's backward.
    """
    _CURRENT[0] = mode
    patches.add_undo(functools.partial(_clear, mode), "backward hooks: fault handler")
    for owner, name in _METHODS:
        real = getattr(owner, name)

        def register(self, hook, *args, _real=real, **kwargs):
            if callable(hook) and not isinstance(hook, (SessionHook, UnderFaults)):
                hook = UnderFaults(hook)
            return _real(self, hook, *args, **kwargs)

        register = functools.wraps(real)(register)
        mode.passthrough.add(register)
        patches.set_attr(owner, name, register, label=f"{owner.__name__}.{name}")
    real_hooks, real_pre = nn.Module._get_backward_hooks, nn.Module._get_backward_pre_hooks

    @functools.wraps(real_hooks)
    def _get_backward_hooks(self):
        full, non_full = real_hooks(self)
        if compiling():  # Dynamo traces this: it handles the hooks itself (no paged module is traced)
            return full, non_full
        return _wrapped(full), _wrapped(non_full)

    @functools.wraps(real_pre)
    def _get_backward_pre_hooks(self):
        hooks = real_pre(self)
        return hooks if compiling() else _wrapped(hooks)

    patches.set_attr(nn.Module, "_get_backward_hooks", _get_backward_hooks,
                     label="nn.Module._get_backward_hooks: module backward hooks under faults")
    patches.set_attr(nn.Module, "_get_backward_pre_hooks", _get_backward_pre_hooks,
                     label="nn.Module._get_backward_pre_hooks: module backward pre-hooks under faults")
    for name in ("apply", "apply_boxed"):
        real = getattr(BackwardCFunction, name, None)
        if real is None:
            continue

        def apply(self, *args, _real=real):
            return _under_faults(_real, (self, *args), {})

        patches.set_attr(BackwardCFunction, name, functools.wraps(real)(apply),
                         label=f"autograd.function.BackwardCFunction.{name}: custom backward under faults")


def _clear(mode) -> None:
    if _CURRENT[0] is mode:
        _CURRENT[0] = None


def wrap_existing(model: nn.Module, patches) -> None:
    """Wrap the tensor hooks already registered on ``model``'s parameters (registered before
    paging started) in :class:`UnderFaults`; the originals come back when paging closes. (Module
    backward hooks need nothing here: they are wrapped as ``_call_impl`` reads them.)"""
    dicts = []
    with torch._C.DisableTorchFunction():  # reading a paged tensor's hook dicts must not fault it in
        for p in model.parameters():
            dicts += [getattr(p, "_backward_hooks", None), getattr(p, "_post_accumulate_grad_hooks", None)]
    for hooks in dicts:
        if not hooks:
            continue
        for key, fn in list(hooks.items()):
            if callable(fn) and not isinstance(fn, (SessionHook, UnderFaults)):
                hooks[key] = UnderFaults(fn)
                # the dictionary held weakly: it holds the script's hook, which may hold the model
                patches.add_undo(functools.partial(_unwrap, weakref.ref(hooks), key), f"backward hook {key} under faults",
                                 owner=hooks)


def _unwrap(hooks_ref: weakref.ref, key) -> None:
    hooks = hooks_ref()
    if hooks is None:
        return
    fn = hooks.get(key)
    if isinstance(fn, UnderFaults):
        hooks[key] = fn.fn
