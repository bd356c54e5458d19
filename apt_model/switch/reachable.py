"""The modules a compiled function can reach, found without running it.

A model first called inside a function compiled with ``torch.compile(fn)`` runs inside TorchDynamo's
trace, where the switch's global forward pre-hook must not change it, so it is never adopted there.
The switch instead looks, just before the compiled call, at what the function can reach
(:func:`reachable_modules`) and adopts those models first, eagerly: the compiled code then traces
the adopted model, as it does for ``model.compile()``.

Where it looks (the places a training step finds its model):

* the call's arguments, and the items of a list, tuple or dict of up to :data:`MAX_ITEMS` items
  among them (``step(model, batch)``, ``step(models=[a, b])``; a long list is data, not models,
  and is not walked on every call);
* the attributes of an argument that is an ordinary object with at most :data:`MAX_ATTRS` of them
  (``step(trainer)`` with ``trainer.model`` or ``trainer.models = [a, b]``; ``self.model`` for a
  method compiled in its class body, ``@torch.compile def step(self, x)``), one level deep (not
  ``trainer.state.model``), and not those of tensors, optimizers, classes, functions or Python
  modules;
* the function's closure cells (a model defined in an enclosing function);
* the module-level globals its code names, nested functions' code included (``model`` at the top
  of a script);
* for a bound method (``trainer.step``) or a callable object, the object itself when it is a module,
  else its attributes (``self.model``);
* for a ``functools.partial``, its bound arguments and its function, looked at the same way.

It does not follow attributes of attributes, nor modules reached through function calls (``get_model()``);
those models stay unadopted, and the optimizer's first step says so (``switch/controller.py``). Only the outermost modules are returned: a module inside another
one found (a model and its loss wrapper ``WithLoss(model)``, a block and its model) is dropped, so
one set of parameters is adopted once, as by a model's first forward, whatever the order found.
"""
from __future__ import annotations

import functools
import types
from typing import Any, Callable, Container, Iterable

import torch
import torch.nn as nn


def _code_names(code: types.CodeType, out: set[str]) -> None:
    out.update(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code_names(const, out)


#: Lists, tuples and dicts longer than this are not walked (a batch of tensors, not models).
MAX_ITEMS = 32


def _from_values(values: Iterable[Any], out: dict[int, nn.Module]) -> None:
    """Modules among ``values`` and one level into short lists, tuples and dicts among them."""
    for v in values:
        if isinstance(v, nn.Module):
            out[id(v)] = v
        elif isinstance(v, (list, tuple, dict)) and len(v) <= MAX_ITEMS:
            for w in v.values() if isinstance(v, dict) else v:
                if isinstance(w, nn.Module):
                    out[id(w)] = w


def _from_object(obj: Any, out: dict[int, nn.Module]) -> None:
    """``obj`` itself when it is a module, else the modules among its attributes."""
    if isinstance(obj, nn.Module):
        out[id(obj)] = obj
        return
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        _from_values(list(attrs.values()), out)


#: Argument objects with more attributes than this are not walked (on every call).
MAX_ATTRS = 64

#: Arguments whose attributes are never looked at: values, code, namespaces and optimizers.
_OPAQUE = (torch.Tensor, nn.Module, list, tuple, dict, str, bytes, int, float, complex, bool, type,
           types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial,
           torch.optim.Optimizer)


def _from_attributes(values: Iterable[Any], out: dict[int, nn.Module]) -> None:
    """The modules among the attributes of the ordinary objects in ``values`` (see the module
    docstring), and one level into short containers among those attributes."""
    for v in values:
        if v is None or isinstance(v, _OPAQUE):
            continue
        attrs = getattr(v, "__dict__", None)
        if isinstance(attrs, dict) and len(attrs) <= MAX_ATTRS:
            _from_values(list(attrs.values()), out)


def _outermost(mods: list[nn.Module]) -> list[nn.Module]:
    """``mods`` without those inside another of them (order kept)."""
    if len(mods) < 2:
        return mods
    inner: set[int] = set()
    for m in mods:
        for sub in m.modules():
            if sub is not m:
                inner.add(id(sub))
    return [m for m in mods if id(m) not in inner]


def _from_function(fn: Callable, out: dict[int, nn.Module], depth: int = 0) -> None:
    """Modules ``fn``'s closure, the globals its code names, its bound object or partial's
    arguments hold (see the module docstring)."""
    if depth > 4:
        return
    if isinstance(fn, functools.partial):
        _from_values(fn.args, out)
        _from_values(fn.keywords.values(), out)
        _from_function(fn.func, out, depth + 1)
        return
    if isinstance(fn, types.MethodType):
        _from_object(fn.__self__, out)
        _from_function(fn.__func__, out, depth + 1)
        return
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):  # a callable object: its __call__ and its attributes
        if not isinstance(fn, (type, types.BuiltinFunctionType)) and callable(fn):
            _from_object(fn, out)
            call = getattr(type(fn), "__call__", None)
            if call is not None and not isinstance(fn, nn.Module):
                _from_function(call, out, depth + 1)
        return
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            _from_values([cell.cell_contents], out)
        except ValueError:  # an empty cell (a name bound later in the enclosing function)
            pass
    names: set[str] = set()
    _code_names(code, names)
    glob = getattr(fn, "__globals__", None) or {}
    _from_values([glob[n] for n in names if n in glob], out)


def reachable_modules(fn: Callable, args: tuple = (), kwargs: dict | None = None, *,
                      through_function: bool = True, exclude: Container = ()) -> list[nn.Module]:
    """The outermost modules ``fn`` can reach when called with ``args`` and ``kwargs``.

    Args:
        fn: the function ``torch.compile`` was given (a function, bound method, ``functools.partial``
            or callable object).
        args, kwargs: the call's arguments.
        through_function: also look at ``fn``'s closure, globals and bound object (once per function
            is enough: they are found at its first call); False looks at the arguments only.
        exclude: modules not to return (those already seen; dropped before the containment check).

    Returns:
        Distinct modules, none inside another (in the order found: arguments, their attributes,
        then the function's own). Never raises: whatever cannot be inspected is skipped.
    """
    found: dict[int, nn.Module] = {}
    try:
        _from_values(args, found)
        _from_values((kwargs or {}).values(), found)
        _from_attributes(args, found)
        _from_attributes((kwargs or {}).values(), found)
        if through_function:
            _from_function(fn, found)
    except Exception:  # noqa: BLE001 - an exotic object that resists inspection: use what was found
        pass
    mods = [m for m in found.values() if m not in exclude]
    try:
        return _outermost(mods)
    except Exception:  # noqa: BLE001
        return mods
