"""A module's whole call — its hooks included — wrapped per instance.

``nn.Module.__call__`` (``_wrapped_call_impl``) calls ``module._compiled_call_impl`` instead of
``module._call_impl`` whenever that attribute is set; ``Module.compile()`` is what sets it. It is
the one place where one model's calls can be wrapped *around* its forward hooks without replacing
its ``forward``, which frameworks read and replace (Hugging Face reads its signature, accelerate
wraps it). The switch uses it where something must happen around a whole call: a forward that
raises under the switch's autocast runs again without it (:mod:`apt_model.precision.autocast`).

A wrapper carries the call it wraps (attribute ``_apt_model_wraps``: the script's compiled call,
or None), so :func:`script_call` still tells ``Module.compile()`` apart from the switch's
wrapper. A ``Module.compile()`` after the wrapper replaces it (the wrapper is then simply gone);
undoing puts back what was there only while the wrapper is still in place, so a compiled call
the script set since is kept. Copies drop the wrapper: torch's ``Module.__getstate__`` (pickling,
``copy.deepcopy``) leaves ``_compiled_call_impl`` out.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch.nn as nn

from apt_model.base.module_attrs import write_attr

#: The attribute a wrapper carries: the call it wraps (None: the module's own ``_call_impl``).
WRAPS = "_apt_model_wraps"

_ABSENT = object()


def script_call(module: nn.Module) -> Callable | None:
    """The compiled call the script gave ``module`` (``Module.compile()``), looking through the
    switch's wrappers; None when there is none."""
    call = getattr(module, "_compiled_call_impl", None)
    while call is not None and hasattr(call, WRAPS):
        call = getattr(call, WRAPS)
    return call


def wrap_call(module: nn.Module, make: Callable[[Callable], Callable], patches, label: str) -> Callable:
    """Wrap every call of ``module`` (``module(...)``, hooks included) from now on.

    Args:
        module: the module whose calls are wrapped.
        make: ``make(inner) -> wrapper``; ``inner(*args, **kwargs)`` runs the call as it ran before
            (the compiled call that was set, or the module's ``_call_impl``); ``wrapper`` is called
            with the call's arguments and returns its result. It must be a plain function (Dynamo
            traces it when a compiled caller calls the module).
        patches: the :class:`~apt_model.base.patches.PatchSet` whose undo takes the wrapper off.
        label: the undo's label.

    Returns:
        The wrapper installed.
    """
    previous = module.__dict__.get("_compiled_call_impl", _ABSENT)
    wrapped = getattr(module, "_compiled_call_impl", None)

    def inner(*args, **kwargs):
        return wrapped(*args, **kwargs) if wrapped is not None else module._call_impl(*args, **kwargs)

    wrapper = make(inner)
    setattr(wrapper, WRAPS, wrapped)
    write_attr(module, "_compiled_call_impl", wrapper)  # not through the class's own __setattr__
    # the undo stack must not keep a model the script dropped alive (the wrapper holds it)
    ref, wrapper_ref = weakref.ref(module), weakref.ref(wrapper)

    def undo() -> None:
        m, w = ref(), wrapper_ref()
        if m is None or w is None or m.__dict__.get("_compiled_call_impl") is not w:
            return  # gone, or the script compiled it since: its compiled call stays
        if previous is _ABSENT:
            del m.__dict__["_compiled_call_impl"]
        else:
            write_attr(m, "_compiled_call_impl", previous)

    patches.add_undo(undo, label)
    return wrapper
