"""The forward fast path: an adopted model's submodules run without the switch's global hook.

The switch finds models at their first call through one global forward pre-hook
(``torch.nn.modules.module.register_module_forward_pre_hook``). While any global module hook is
registered, PyTorch's ``Module._call_impl`` leaves its fast path for *every* module call (it builds
the hook lists, wraps the call in ``try``) and calls the hook: about 1.6 us per module call on a
2-core EPYC (a 6-layer MLP's 178 us step took 189 us; side script, not a benchmark). Inside an
adopted model that work finds nothing: its submodules were seen at its adoption.

Policy (:class:`ForwardFastPath`; the transitions are its methods):

``warming``
    An adopted model (a *root*) runs its first :data:`WARM_CALLS` forward calls with the hook in
    place, so that a model first called inside its forward (a frozen network kept outside its
    module tree, a loss network passed in) is adopted as before.
``ready``
    At each later call of the root, the hook takes itself out of PyTorch's dictionary of global
    forward pre-hooks when the call starts (:meth:`ForwardFastPath.step_aside`, from the hook
    itself), and a forward hook on the root with ``always_call=True`` puts it back when the call
    ends, normally or by an exception (:meth:`ForwardFastPath.root_exit`). Only when it is the
    only global module hook: other global hooks keep the slow path anyway. Roots called inside
    that call (nested adopted models) find the hook out and leave it so.
``parts``
    A script that calls an adopted model's parts itself (``for layer in model.layers: x =
    layer(x)``, ``model.encoder(x)``) never calls the model: its parts become roots of their own
    after :data:`WARM_CALLS` calls made outside any root's call (a per-thread stack of the root
    calls under way), when they are a child of the model, or of a ``ModuleList`` / ``ModuleDict``
    child of it, and hold at least two modules (a leaf would pay the exit hook and save nothing).
``quiet``
    While no module with state exists that the switch has not seen, the hook stays out between
    calls too (:meth:`ForwardFastPath.quiet_ok`, from :meth:`~ForwardFastPath.step_aside` and
    :meth:`~ForwardFastPath.at_step`). Such modules are *pending*: those alive when the path first
    could go quiet (one pass over the garbage collector's objects), and every module given a
    parameter, buffer or submodule (PyTorch's global registration hooks) or unpickled
    (``copy.deepcopy``; ``nn.Module.__setstate__``, patched) from then on
    (:meth:`~ForwardFastPath.new_module`). A new pending module puts the hook back at once, so it
    is adopted at its first call; one made inside a root's call (a layer a forward builds) at the
    next optimizer step (or when a warming root's call ends). It leaves the set when seen or freed.
    Parameters written straight into ``module._parameters`` fire no hook: such a module is not
    noted. While quiet, the ready roots' exit hooks are out of their ``_forward_hooks`` too
    (:meth:`~ForwardFastPath._exits_aside`; a root that becomes ready while quiet, at once), so a
    root with no other hook runs PyTorch's hook-free call path as well; they go back in their
    places when the hook does. So a copy a ready root's forward makes while quiet, and the script
    calls before the next optimizer step, is adopted at its first call after that step.
``off``
    For the rest of the session, from the first ``torch.compile`` / ``Module.compile`` call (the
    script's or the compile ladder's; :meth:`ForwardFastPath.stop`), and from the start of any
    Dynamo compilation however it was asked for (a model compiled before ``enable()``,
    ``torch._dynamo.optimize``, a ``compile`` bound before the switch patched it: Dynamo's start
    callbacks, which run before the frame is traced): Dynamo traces a module's call differently
    with global hooks present or not and guards on their number, so compiled code traced with the
    hook out would recompile when it is back (and raise under ``error_on_recompile``). The hook is
    put back at once. A session starts off while Dynamo holds code compiled earlier in the process
    (traced with the hook in place, or with no hook before ``enable()``). ``torch._dynamo.reset()``
    drops Dynamo's start callbacks: the switch registers its own again at the next optimizer step.
    Also off when the switch is disabled (:meth:`ForwardFastPath.close`).

What the policy gives up: a model called for the first time inside the forward of a ready root is
not adopted by that call; it is at its first call elsewhere, or when the script moves it with
``.to()`` (docs/troubleshooting.md). While one thread runs a ready root's forward, a model another
thread calls for the first time is adopted at a later call. A call stopped by a ``BaseException``
that is not an ``Exception`` (``KeyboardInterrupt``) skips ``always_call`` hooks: the hook is put
back at that root's next call, at the next optimizer step, or when that root is freed (a notebook
cell run again builds a new model); until then a new model is adopted at none of its calls
(:meth:`ForwardFastPath.restore`). A root's calls inside its own forward count as calls.
"""
from __future__ import annotations

import gc
import sys
import threading
import weakref
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.modules.module as module_mod

from apt_model.base.log import get_logger
from apt_model.base.module_attrs import is_internal
from apt_model.base.patches import PatchSet, SessionHook
from apt_model.base.post_import import when_imported

log = get_logger(__name__)

#: Forward calls an adopted model runs with the global hook in place before its later calls run
#: without it (models first called inside its forward during these are adopted as before).
WARM_CALLS = 2


def _may_be_a_model(module: nn.Module) -> bool:
    """Whether ``module`` has a parameter, a buffer or a submodule of its own (a wrapper of adopted
    models is a model too). Read from its ``__dict__``: a module being built or unpickled may not
    have these dictionaries yet (``Module.__getattr__`` raised for one whose ``__setstate__``
    rebuilt it after its base's: a review probe's finding)."""
    d = module.__dict__
    return any(v is not None for name in ("_parameters", "_buffers", "_modules") for v in (d.get(name) or {}).values())


def _module_types() -> set[type]:
    """``nn.Module`` and every subclass defined so far."""
    out, todo = {nn.Module}, [nn.Module]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.add(sub)
                todo.append(sub)
    return out


_CALL_IMPL = nn.Module._call_impl.__code__


def _inside_call_of(*roots) -> bool:
    """Whether the call of a module in one of ``roots`` (containers) is under way on this thread
    (a frame of its ``Module._call_impl`` on the stack; a walk of a few dozen frames, run only when
    a module is given state or submodules)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            module = frame.f_locals.get("self")
            if any(module in r for r in roots):
                return True
        frame = frame.f_back
    return False


def dynamo_compiled_before() -> bool:
    """Whether Dynamo holds code it compiled in this process (its frame counter since the last
    ``torch._dynamo.reset()``, which drops every compiled frame; False when Dynamo is not imported)."""
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    return bool(getattr(convert_frame, "FRAME_COUNTER", 0))


class ForwardFastPath:
    """Takes the switch's global forward pre-hook out while a ready adopted model runs forward, and
    between calls while nothing is pending (see the module docstring for the policy).

    Args:
        hooks: PyTorch's dictionary of global forward pre-hooks
            (``torch.nn.modules.module._global_forward_pre_hooks``), where the hook is registered.
        hook_id: the hook's key there (its ``RemovableHandle.id``).
        hook: the hook (put back under ``hook_id``).
        others: PyTorch's other global module hook dictionaries (forward, backward, backward-pre);
            the hook steps aside only while they are empty.
        warm_calls: forward calls of a root before it is ready (>= 0).
        on_stop: called once with the reason when the path turns off (the decision record); its
            errors are logged.
        owner_of: the adopted model a seen module belongs to (None: none); without it, parts are
            never made roots.
        is_seen: whether the switch has seen a module (adopted it, or decided it is no model);
            without it, the hook is never out between calls (``quiet``).

    Raises:
        ValueError: ``warm_calls`` < 0, or ``hook_id`` is not in ``hooks``.
    """

    def __init__(self, hooks: dict, hook_id: int, hook: Callable, others: tuple[dict, ...] = (),
                 warm_calls: int = WARM_CALLS, on_stop: Callable[[str], None] | None = None,
                 owner_of: Callable[[nn.Module], nn.Module | None] | None = None,
                 is_seen: Callable[[nn.Module], bool] | None = None):
        if warm_calls < 0:
            raise ValueError(f"warm_calls={warm_calls!r} must be >= 0")
        if hooks.get(hook_id) is not hook:
            raise ValueError(f"hook_id={hook_id!r} does not name the hook in the global hook dictionary")
        self._hooks, self._id, self._hook, self._others = hooks, hook_id, hook, others
        self.warm_calls = warm_calls
        self._warming: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root -> calls so far
        self._ready: weakref.WeakSet = weakref.WeakSet()
        self._away_for: weakref.ref | None = None  # the root whose call took the hook out
        self._lock = threading.RLock()  # re-entered by a root's weakref callback run by a collection
        self._on_stop = on_stop
        self._handler = None  # torch._dynamo.callback_handler, once watched
        self._started = self._compile_started  # bound once: at_step looks it up in Dynamo's list
        self._owner_of = owner_of
        self._parts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # part -> calls (-1: never a root)
        self._patches: PatchSet | None = None  # the session's, from attach()
        self._tls = threading.local()  # .roots: ids of this thread's root calls under way (innermost last)
        self._is_seen = is_seen
        self._pending: weakref.WeakSet = weakref.WeakSet()  # modules with state the switch has not seen yet
        self._pending_len = -1  # len(self._pending) when it was last pruned; -1: prune at the next look
        self._quiet = False  # the hook is out between calls (nothing pending)
        self._exits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root -> its exit hook's id
        self._exits_out: list[tuple[weakref.ref, int, Callable, int]] = []  # taken out while quiet
        self._scanned = True  # modules alive before were looked for (False: at the next quiet_ok())
        self.on = True
        self.off_reason: str | None = None
        self.calls = 0  # root calls that ran with the hook out
        if dynamo_compiled_before():
            self.on = False
            self.off_reason = ("Dynamo compiled code earlier in this process, traced with the global hook in "
                               "place: it stays in place")

    # ------------------------------------------------------------------ roots
    def attach(self, root: nn.Module, patches: PatchSet, ready: bool = False) -> None:
        """Start counting ``root``'s calls (an adopted model; ``ready``: a part, ready at once): an
        ``always_call`` forward hook on it, removed when ``patches`` is restored."""
        if not self.on or root in self._warming or root in self._ready:
            return
        self._patches = patches
        if self.warm_calls == 0 or ready:
            self._ready.add(root)
        else:
            self._warming[root] = 0
        handle = root.register_forward_hook(SessionHook(self.root_exit), always_call=True)
        self._exits[root] = handle.id
        patches.add_handle(handle, f"forward fast path: exit hook of {type(root).__name__}")

    def step_aside(self, module: nn.Module) -> None:
        """Called by the global hook for a module already seen: if ``module`` is a ready root, the
        path is on, nothing has taken the hook out and no other global hook is registered, take
        the hook out of the dictionary until ``module``'s call ends. A root's call is noted on this
        thread's stack of root calls; a part called outside any is counted (see ``parts``). When
        nothing is pending, the hook goes out until a module is made (``quiet``)."""
        if self._away_for is None and self.quiet_ok():
            self._go_quiet()
            return
        ready = module in self._ready
        if not ready and module not in self._warming:
            if self._owner_of is not None and self.on and not getattr(self._tls, "roots", None):
                self._count_part(module)
            return
        roots = getattr(self._tls, "roots", None)
        if roots is None:
            roots = self._tls.roots = []
        roots.append(id(module))  # ids: an interrupted call's entry must not keep its model alive
        if not ready or not self.on or self._away_for is not None:
            return
        if len(self._hooks) != 1 or any(self._others):
            return
        with self._lock:
            if self._away_for is None and self.on and self._hooks.pop(self._id, None) is not None:
                self._away_for = weakref.ref(module, self._root_freed)
                self.calls += 1

    def _count_part(self, module: nn.Module) -> None:
        n = self._parts.get(module)
        if n is None:
            n = 0 if self._is_part(module) else -1
        if n < 0:
            self._parts[module] = -1
            return
        n += 1
        if n < max(self.warm_calls, 1) or self._patches is None:
            self._parts[module] = n
            return
        self._parts.pop(module, None)
        self.attach(module, self._patches, ready=True)

    def _is_part(self, module: nn.Module) -> bool:
        """A child of its adopted model, or of a ``ModuleList`` / ``ModuleDict`` child of it, that
        holds at least two modules."""
        owner = self._owner_of(module)
        if owner is None or owner is module or sum(1 for _ in module.modules()) < 3:  # itself and two more
            return False
        for child in owner.children():
            if child is module:
                return True
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)) and any(c is module for c in child.children()):
                return True
        return False

    def _root_freed(self, ref: weakref.ref) -> None:
        if self._away_for is ref:  # freed while its call had the hook out (an interrupted call)
            self.restore()

    def root_exit(self, module: nn.Module, args: tuple, output) -> None:
        """The roots' forward hook (``always_call=True``): puts the hook back if this root's call
        took it out; else counts a warming root's call. Nothing inside compiled code (a count
        changed there would be a guard that recompiles at every call), nor once off."""
        if torch.compiler.is_compiling():
            return None
        roots = getattr(self._tls, "roots", None)
        if roots and roots[-1] == id(module):
            roots.pop()
        if not self.on:
            return None
        self._wake_if_pending()
        away = self._away_for
        if away is not None:
            if away() is module:
                self.restore()
            return
        calls = self._warming.get(module)
        if calls is not None:
            if calls + 1 >= self.warm_calls:
                self._warming.pop(module, None)
                self._ready.add(module)
                if self._quiet:  # ready while quiet: its exit hook goes out now (see _exits_aside)
                    with self._lock:
                        if self._quiet:
                            self._exit_aside(module)
            else:
                self._warming[module] = calls + 1
        return None

    # ------------------------------------------------------------------ new modules, quiet
    def watch_new_modules(self, patches: PatchSet) -> None:
        """Note every module with state that the switch has not seen: from now on each one given a
        parameter, a buffer or a submodule (PyTorch's global registration hooks: a model being
        built, a layer put into one, a wrapper around models) or unpickled (``copy.deepcopy``, ``torch.load`` of a whole model:
        ``nn.Module.__setstate__``, patched), and those alive before, found by one pass over the
        garbage collector's objects the first time the hook could go out (:meth:`quiet_ok`: tens of
        milliseconds in a large process, paid once, and only by a session that calls a model).
        The hooks and the patch are removed when ``patches`` is restored."""
        if self._is_seen is None:
            return
        self._scanned = False
        patches.add_handle(module_mod.register_module_parameter_registration_hook(self._registered),
                           "forward fast path: parameter registration hook")
        patches.add_handle(module_mod.register_module_buffer_registration_hook(self._registered),
                           "forward fast path: buffer registration hook")
        patches.add_handle(module_mod.register_module_module_registration_hook(self._registered),
                           "forward fast path: submodule registration hook")
        original = nn.Module.__setstate__

        def setstate(module: nn.Module, state: dict) -> None:
            original(module, state)
            try:
                if _may_be_a_model(module):
                    self.new_module(module)
            except Exception as err:  # noqa: BLE001 - unpickling must not fail for a note
                log.debug("forward fast path: noting %s: %s", type(module).__name__, err)

        setstate.__doc__ = original.__doc__
        patches.set_attr(nn.Module, "__setstate__", setstate, label="nn.Module.__setstate__ (forward fast path)")

    def _registered(self, module: nn.Module, name: str, value) -> None:
        # runs inside the script's module construction, on a module half built (its own
        # __getattr__ may raise anything): nothing here may break it
        if value is not None:
            try:
                self.new_module(module)
            except Exception as err:  # noqa: BLE001 - a missed note costs speed, never correctness
                log.debug("forward fast path: noting %s: %s", type(module).__name__, err)
        return None

    def new_module(self, module: nn.Module) -> None:
        """``module`` holds state (or submodules) and may be unseen: until the switch has seen it
        (or it is freed), the hook is in place between calls; put back now if ``quiet``. A module
        made inside an adopted model's call (a layer built in its forward, at every call: each
        would be adopted as a model of its own inside that call) puts it back only when a warming
        root's call ends (a ready root has no exit hook while quiet), or at the next optimizer
        step: so a copy made in a forward and called by the script after that is adopted at that
        call. Made inside another module's call (a loss module that builds its network lazily), it
        puts the hook back at once, as before."""
        if self.on and self._is_seen is not None:
            self._note(module, now=not (self._quiet and _inside_call_of(self._ready, self._warming)))

    def _note(self, module: nn.Module, now: bool = True) -> None:
        if self._is_seen(module) or is_internal(module):  # never getattr: a half-built module's may raise
            return
        with self._lock:
            self._pending.add(module)
            self._pending_len = -1
            if now and self._quiet:
                self.restore()

    def note_seen(self, module: nn.Module) -> None:
        """The switch has looked at ``module`` (adopted it, or decided it is no model): it and its
        submodules leave the pending set if seen now. Only these: a look at the whole set at every
        such call (a script that makes a loss module at every step, beside a copy kept and never
        called) cost a step 1.5x with 450 pending modules and 10x with 9000 (a probe's finding)."""
        if not len(self._pending):
            return
        try:
            with self._lock:
                in_sync = self._pending_len == len(self._pending)
                for m in module.modules():
                    if m in self._pending and self._is_seen(m):
                        self._pending.discard(m)
                if in_sync:
                    self._pending_len = len(self._pending)
        except Exception as err:  # noqa: BLE001 - a module whose modules() raises: the next look prunes
            log.debug("forward fast path: note_seen %s: %s", type(module).__name__, err)
            self._pending_len = -1

    def quiet_ok(self) -> bool:
        """Whether the hook may be out between calls: on, and every module noted by
        :meth:`new_module` seen or freed (pruned only when something changed: a look is a length)."""
        if not self.on or self._is_seen is None:
            return False
        if not self._scanned:
            self._scan()
        n = len(self._pending)
        if n != self._pending_len:
            with self._lock:  # another thread may be building a model
                for m in list(self._pending):
                    if self._is_seen(m):
                        self._pending.discard(m)
                n = self._pending_len = len(self._pending)
        return n == 0

    def _scan(self) -> None:
        self._scanned = True
        types = _module_types()
        for obj in gc.get_objects():  # a module in an unreachable cycle stays pending until collected
            if type(obj) in types and _may_be_a_model(obj):  # type(): no lazy proxy is asked its class
                self._note(obj)

    def _go_quiet(self) -> None:
        with self._lock:
            if self._pending_len != 0:  # a module noted (another thread) since quiet_ok() looked
                return
            if self._away_for is None and not self._quiet and self.on and self._hooks.pop(self._id, None) is not None:
                self._quiet = True
                self._exits_aside()

    def _exits_aside(self) -> None:
        """Entering ``quiet`` (under the lock): take each ready root's exit hook out of its
        ``_forward_hooks`` (and ``_forward_hooks_always_called``), noting its place, so that a root
        with no other hook runs PyTorch's hook-free call path too. Put back by :meth:`_exits_back`."""
        for root in list(self._ready):
            self._exit_aside(root)

    def _exit_aside(self, root: nn.Module) -> None:
        hook_id = self._exits.get(root)
        hooks = root.__dict__.get("_forward_hooks")
        if hook_id is None or not hooks or hook_id not in hooks:
            return
        place = list(hooks).index(hook_id)
        hook = hooks.pop(hook_id)
        root.__dict__.get("_forward_hooks_always_called", {}).pop(hook_id, None)
        self._exits_out.append((weakref.ref(root), hook_id, hook, place))

    def _exits_back(self) -> None:
        """Leaving ``quiet`` (under the lock): the exit hooks taken out go back in their places
        (forward hooks run in their dictionary's order; a hook the script added meanwhile keeps
        its order relative to the others)."""
        out, self._exits_out = self._exits_out, []
        for ref, hook_id, hook, place in out:
            root = ref()
            if root is None or self._exits.get(root) != hook_id:
                continue
            hooks = root.__dict__.get("_forward_hooks")
            if hooks is None or hook_id in hooks:
                continue
            items = list(hooks.items())
            items.insert(min(place, len(items)), (hook_id, hook))
            hooks.clear()
            hooks.update(items)
            root.__dict__.setdefault("_forward_hooks_always_called", {})[hook_id] = True

    def _wake_if_pending(self) -> None:
        """Quiet, and a module was noted without putting the hook back (made inside a call): put
        it back now if that module is still unseen."""
        if self._quiet and self._pending_len == -1 and not self.quiet_ok():
            self.restore()

    # ------------------------------------------------------------------ the hook
    @property
    def away(self) -> bool:
        """Whether the hook is out of the dictionary now (a root's call, or ``quiet``)."""
        return self._away_for is not None or self._quiet

    def restore(self) -> None:
        """Put the hook back (in its place: global hooks run in registration order) if it is out."""
        with self._lock:
            if self._away_for is None and not self._quiet:
                return
            if self._quiet:
                self._exits_back()
            self._away_for = None
            self._quiet = False
            if self._id in self._hooks:
                return
            self._hooks[self._id] = self._hook
            if len(self._hooks) > 1:  # a script's global hook registered meanwhile: ours ran first
                items = sorted(self._hooks.items())
                self._hooks.clear()
                self._hooks.update(items)

    def stop(self, reason: str) -> None:
        """Off for the rest of the session (``reason`` recorded in :attr:`off_reason`, passed to
        ``on_stop``); the hook is put back now."""
        with self._lock:
            first = self.on
            self.on = False
            if first:
                self.off_reason = reason
        self.restore()
        if first:
            log.debug("forward fast path off: %s", reason)
            if self._on_stop is not None:
                try:
                    self._on_stop(reason)
                except Exception as err:  # noqa: BLE001 - a record must not break a compile or a call
                    log.debug("forward fast path: on_stop: %s", err)

    def watch_dynamo(self, patches: PatchSet) -> None:
        """Turn off at the start of any Dynamo compilation (a start callback on
        ``torch._dynamo.callback_handler``, registered when Dynamo is imported); removed when
        ``patches`` is restored."""
        def install(dynamo) -> None:
            handler = getattr(dynamo, "callback_handler", None)
            if handler is not None and hasattr(handler, "register_start_callback"):
                self._handler = handler
                self.rewatch()

        def uninstall() -> None:
            handler, self._handler = self._handler, None
            if handler is not None and self._started in handler.start_callbacks:
                handler.remove_start_callback(self._started)

        patches.add_undo(uninstall, "forward fast path: Dynamo start callback")
        stop_watching = when_imported("torch._dynamo", install)
        if stop_watching is not None:
            patches.add_undo(stop_watching, "forward fast path: watch for torch._dynamo")

    def at_step(self) -> None:
        """An optimizer step (no root call is under way on this thread): put back a hook left out
        by an interrupted call, forget such calls' entries, and :meth:`rewatch`."""
        if self._away_for is not None:
            self.restore()
        if getattr(self._tls, "roots", None):
            self._tls.roots = []
        self.rewatch()
        self._wake_if_pending()
        if not self._quiet and self.quiet_ok():
            self._go_quiet()

    def rewatch(self) -> None:
        """Register the start callback again where ``torch._dynamo.reset()`` cleared it (called at
        each optimizer step; a list look-up)."""
        handler = self._handler
        if handler is not None and self.on and self._started not in handler.start_callbacks:
            handler.register_start_callback(self._started)

    def _compile_started(self, args=None) -> None:
        if self.on:
            self.stop("Dynamo began compiling: compiled code is traced with the global hook in place, and stays so")

    def close(self) -> None:
        """The switch is being disabled: off, and the hook is not put back (its handle removes it)."""
        with self._lock:
            self.on = False
            self.off_reason = self.off_reason or "the switch was disabled"
            self._away_for = None
            self._quiet = False
            self._exits_out = []  # their handles remove them from the roots (or left out: gone already)

    def describe(self) -> dict:
        """The report's figures: ``on``, ``off_reason``, ``warm_calls``, ``ready_models``,
        ``calls`` (root calls that ran with the hook out), ``away`` (whether it is out now),
        ``quiet`` (out between calls), ``pending`` (modules with state not seen yet, at the last look)."""
        return {"on": self.on, "off_reason": self.off_reason, "warm_calls": self.warm_calls,
                "ready_models": len(self._ready), "calls": self.calls, "away": self.away, "quiet": self._quiet,
                "pending": len(self._pending)}
