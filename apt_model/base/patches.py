"""Bookkeeping for every change the switch makes, so ``disable()`` restores each one exactly.

Attribute replacements (class methods such as ``nn.Module.to``, or per-module attributes) are
recorded with their previous value — or with "was absent", in which case restoring deletes the
attribute. Hook handles are removed. Other undo actions (a registry entry removed, a model's checkpointing
switched back) are registered as callables. Restoration runs in reverse order.

An undo action registered as *critical* (the paging session's: it brings the user's tensors back)
does not just get logged when it fails: every other action is still undone, then its error is
raised from :meth:`PatchSet.restore_all`, so ``vb.disable()`` raises it (a
:class:`~apt_model.memory.swap.PagingRecoveryError` naming what could not be brought back).
"""
from __future__ import annotations

import functools
import types
import weakref
from typing import Any, Callable

from apt_model.base.module_attrs import delete_attr, write_attr
from apt_model.base.module_hooks import HOOK_DICTS

_MISSING = object()


def _same(obj: Any) -> Any:
    return obj


class PatchSet:
    """An undo stack of patches."""

    def __init__(self):
        self._undo: list[tuple[str, Callable[[], None]]] = []
        self._serials: list[int] = []  # the entries' serial numbers (1, 2, ... in order added), beside _undo
        self._added = 0  # entries ever added: a mark() that prune() cannot shift
        self._critical: set[int] = set()  # id() of the undo callables whose failure must be raised
        # id() of an undo callable -> a check that says its target is gone (nothing left to undo)
        self._gone: dict[int, Callable[[], bool]] = {}

    def __len__(self) -> int:
        return len(self._undo)

    def _push(self, label: str, fn: Callable[[], None]) -> None:
        self._added += 1
        self._undo.append((label, fn))
        self._serials.append(self._added)

    def mark(self) -> int:
        """A mark for :meth:`restore_since`: the entries added after it are the ones it undoes,
        whatever :meth:`prune` dropped meanwhile (a length would shift: a feature step that prunes
        the stack while it works would have had older entries of its own left on it)."""
        return self._added

    def set_attr(self, obj: Any, name: str, value: Any, label: str | None = None) -> None:
        """``setattr(obj, name, value)``, remembering what was there (in ``obj.__dict__``) before.

        ``obj`` is held weakly where it can be (a module, a class): patching a model's blocks
        must not keep a model the script dropped alive; once it is gone there is nothing to undo.
        The undo puts the previous value back only while ``obj`` still holds ``value`` (known by
        identity, not held): what the script set there since is its own and stays (accelerate's
        ``add_hook_to_module`` on a checkpointed block after adoption was deleted by ``disable()``
        until 2026-11-28: a review probe's finding)."""
        previous = obj.__dict__.get(name, _MISSING) if hasattr(obj, "__dict__") else getattr(obj, name, _MISSING)
        write_attr(obj, name, value)
        try:
            target = weakref.ref(obj)
        except TypeError:  # no weak references to it: held
            target = functools.partial(_same, obj)
        # a method of ``obj`` bound in its own __dict__ (what copy.deepcopy of a block whose forward
        # was wrapped leaves there) would hold ``obj`` from the undo stack: kept as its function,
        # bound again at undo time
        rebind = (isinstance(previous, types.MethodType) and previous.__self__ is obj
                  and isinstance(target, weakref.ref))
        if rebind:
            previous = previous.__func__

        value_id, value_type = id(value), type(value)

        def undo():
            obj = target()
            if obj is None:
                return
            now = obj.__dict__.get(name, _MISSING) if hasattr(obj, "__dict__") else getattr(obj, name, _MISSING)
            if id(now) != value_id or type(now) is not value_type:
                return  # replaced since by the script: left as it is
            if previous is _MISSING:
                try:
                    delete_attr(obj, name)
                except AttributeError:
                    pass
            else:
                write_attr(obj, name, types.MethodType(previous, obj) if rebind else previous)

        self._push(label or f"{getattr(obj, '__name__', type(obj).__name__)}.{name}", undo)
        if isinstance(target, weakref.ref):
            self._gone[id(undo)] = lambda: target() is None

    def add_handle(self, handle: Any, label: str) -> None:
        """Remember a removable hook handle (anything with ``.remove()``)."""
        remove = handle.remove
        self._push(label, remove)
        hooks = getattr(handle, "hooks_dict_ref", None)  # torch's RemovableHandle: a weak ref to the hook dict
        if callable(hooks):
            self._gone[id(remove)] = lambda: hooks() is None

    def prune(self) -> int:
        """Drop the undo actions whose target is gone (the hooks and attributes of modules and
        tensors the script dropped): a sweep that makes model after model would grow the stack by
        every model's hooks (about 90 KB of Python objects per model). Returns how many went."""
        if not self._gone:
            return 0
        keep, serials, dropped = [], [], 0
        for (label, fn), serial in zip(self._undo, self._serials):
            gone = self._gone.get(id(fn))
            if gone is not None and gone():
                del self._gone[id(fn)]
                dropped += 1
            else:
                keep.append((label, fn))
                serials.append(serial)
        if dropped:
            self._undo, self._serials = keep, serials
        return dropped

    def add_undo(self, fn: Callable[[], None], label: str, critical: bool = False, owner: Any = None) -> None:
        """Remember an arbitrary undo action. A ``critical`` one's exception is raised by
        :meth:`restore_all` (after everything else was undone) instead of being returned. With
        ``owner`` (held weakly: a module, a tensor, a hook dictionary), :meth:`prune` drops the
        action once ``owner`` is gone; ``fn`` itself must not hold ``owner`` (or the model it
        belongs to) strongly, or the stack keeps a model the script dropped alive.

        Raises:
            TypeError: ``owner`` cannot be referenced weakly.
        """
        gone = None
        if owner is not None:
            ref = weakref.ref(owner)
            gone = lambda: ref() is None  # noqa: E731
        self._push(label, fn)
        if critical:
            self._critical.add(id(fn))
        if gone is not None:
            self._gone[id(fn)] = gone

    def labels(self) -> list[str]:
        return [label for label, _ in self._undo]

    def restore_all(self) -> list[str]:
        """Undo everything, newest first. Returns the labels of undo actions that failed (with errors).

        Raises:
            Exception: the error of the first *critical* undo action that failed (see
                :meth:`add_undo`), once every action was tried; the other failures are in its
                ``undo_failures`` attribute.
            BaseException: an interrupt (``KeyboardInterrupt``) inside an undo action, at once: that
                action and the older ones stay on the stack, and the next call goes on from there
                (an action cut short must be safe to run again).
        """
        failures = self.restore_since(0)
        self._gone.clear()
        self._critical.clear()
        return failures

    def restore_since(self, mark: int) -> list[str]:
        """Undo, newest first, the actions added after :meth:`mark` returned ``mark`` (a feature
        failed halfway: what it had done is taken back while the older entries stay). Returns,
        raises and keeps entries on an interrupt as :meth:`restore_all` does.

        Raises:
            ValueError: ``mark`` is negative or above every mark given so far.
        """
        if not 0 <= mark <= self._added:
            raise ValueError(f"restore_since: mark {mark} is not between 0 and the last mark {self._added}")
        failures = []
        critical: list[BaseException] = []
        while self._serials and self._serials[-1] > mark:
            serial = self._serials.pop()
            label, fn = self._undo.pop()
            is_critical = id(fn) in self._critical
            self._critical.discard(id(fn))
            self._gone.pop(id(fn), None)
            try:
                fn()
            except Exception as err:  # noqa: BLE001 - keep undoing the rest
                if is_critical:
                    critical.append(err)
                else:
                    failures.append(f"{label}: {type(err).__name__}: {err}")
            except BaseException:  # an interrupt (KeyboardInterrupt): this undo and the older ones stay for a retry
                self._undo.append((label, fn))
                self._serials.append(serial)
                if is_critical:
                    self._critical.add(id(fn))
                raise
        if critical:
            err = critical[0]
            err.undo_failures = failures + [f"{type(e).__name__}: {e}" for e in critical[1:]]
            raise err
        return failures


def _inert(*args, **kwargs):
    return None


def _inert_hook():
    return _inert


#: The switch session hooks made now belong to (:func:`end_session_hooks` moves it on).
_SESSION = [1]


def current_session() -> int:
    """The number of the switch session hooks made now belong to (it changes at each ``disable()``):
    for notes said once per session."""
    return _SESSION[0]


#: The hook dictionaries of a module a :class:`SessionHook` can sit in: the call hooks
#: (:data:`~apt_model.base.module_hooks.HOOK_DICTS`) and the state-dict ones.
MODULE_HOOK_DICTS = (*HOOK_DICTS, "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
                     "_load_state_dict_post_hooks")


def end_session_hooks(modules=()) -> int:
    """The switch session ended (``disable()``, after its undo stack ran): the session's
    :class:`SessionHook` objects still in the hook dictionaries of ``modules`` (copies a library
    registered again under handles of its own) are taken out, and every one made before does
    nothing from now on. Returns how many were taken out."""
    removed = 0
    try:
        for module in modules:
            for name in MODULE_HOOK_DICTS:
                hooks = module.__dict__.get(name)
                if not hooks:
                    continue
                for hook_id in [k for k, h in hooks.items() if isinstance(h, SessionHook) and h.session == _SESSION[0]]:
                    del hooks[hook_id]
                    for extra in ("_forward_hooks_always_called", "_forward_hooks_with_kwargs",
                                  "_forward_pre_hooks_with_kwargs"):
                        module.__dict__.get(extra, {}).pop(hook_id, None)
                    removed += 1
    finally:
        _SESSION[0] += 1
    return removed


class SessionHook:
    """A hook bound to this process's switch session: it does nothing once that session ended.
    ``disable()`` removes the session's hooks by their handles; copies that a library registered
    again under handles of its own (``torch.ao.quantization``'s ``swap_module``, eager-mode
    ``fuse_modules``: ``prepare_qat`` after adoption) stayed, and paging's called a closed session
    at every forward (a probe's finding). Pickling it (``torch.save(model)``, ``copy.deepcopy``)
    yields a no-op hook: a saved or copied model runs as a plain model. The no-op is a function of
    apt_model (a hook must be a picklable callable that returns None, and the standard library
    offers none that takes a hook's arguments), so loading a whole model pickled while the switch
    was on needs apt_model importable; a ``state_dict`` needs nothing."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.session = _SESSION[0]

    def __call__(self, *args, **kwargs):
        if self.session != _SESSION[0]:
            return None
        return self.fn(*args, **kwargs)

    def __reduce__(self):
        return (_inert_hook, ())
