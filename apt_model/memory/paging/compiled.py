"""``torch.compile`` while paging is on: paged models run eagerly, everything else compiles.

Paging loads a paged-out tensor when an op touches it, in the page-fault handler
(:mod:`~apt_model.memory.paging.fault`), a torch-function mode, and in the module hooks of
:mod:`~apt_model.memory.paging.model`. Code that TorchDynamo compiles runs neither: the compiled
graph calls kernels directly, so a paged tensor the graph reads outside the one module whose hook
loaded it would be freed storage (garbage or a crash), and tracing the handler's own Python (dicts
keyed by tensor id, a lock, the pager's I/O) is not something Dynamo can do. Before this module,
*any* ``torch.compile`` in a script with paging on failed while tracing the mode
(``NameError: ___get_torch_function_mode_stack_at``), a compiled loss function included.

So, while paging is on:

* the fault handler steps aside while Dynamo traces (``compiling``): what Dynamo traces is
  the user's op itself, and a compiled function that touches no paged model compiles and runs as
  it would without the switch;
* the streamed optimizer step (the global optimizer-step hooks of
  :mod:`~apt_model.memory.paging.optimizer`) runs eagerly when Dynamo reaches it (``torch.compile``
  of ``optimizer.step`` or of a training step that calls it);
* every module of a paged model (the root and all its submodules) is called through
  :func:`torch.compiler.disable` when Dynamo reaches it: ``torch.compile(model)``,
  ``model.compile()`` and a compiled training step that calls the model all run the paged model
  eagerly — with its hooks and the fault handler, exactly as without ``torch.compile`` — and
  compile the rest. Dynamo logs the graph break with the reason below.

This is done with one patch of ``nn.Module._call_impl`` (undone when paging closes) that checks
``compiling()`` first, so an eager call pays one function call more. ``torch.compile(...,
fullgraph=True)`` of code that reaches a paged model raises Dynamo's ``Unsupported`` error, whose
text gives the reason below (its hint to remove a ``torch.compiler.disable`` call means this one).
A model compiled with ``model.compile()`` *before* paging started is not paged (its compiled call
is bound to the unpatched ``_call_impl``; :func:`compiled_before`). Not covered: a compiled
function that reads a paged parameter directly, outside any module call (an L2 term over
``model.parameters()`` inside a compiled loss): Dynamo lifts the parameter as a graph input and
the kernel reads it without a fault — with Inductor, the default backend, a crash. Compile the
model (or the code around it), not code that reaches into a paged model's parameters.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

#: The reason Dynamo records for the graph break at a paged module.
REASON = ("apt_model pages this module's parameters: it runs eagerly under torch.compile (its pages are "
          "loaded by module hooks and a torch-function mode that compiled code would bypass)")

_PAGED: set[int] = set()  # id(module) of every module of a paged model (while paging is on)
#: True only while Dynamo traces the calling code (it folds the call to True); False when code
#: runs, on every thread. ``torch.compiler.is_compiling()`` is no substitute: at run time it reads
#: one process-wide flag, True for the whole of a compilation, so another thread's faults would
#: step aside while a compile is under way.
compiling = torch.compiler.is_dynamo_compiling


def install(patches) -> None:
    """Patch ``nn.Module._call_impl`` (through ``patches``, undone when paging closes) so that
    Dynamo, tracing a call of a module registered with :func:`add_model`, calls it through
    :func:`torch.compiler.disable` (eagerly, with everything it calls)."""
    real = nn.Module._call_impl
    eager = torch.compiler.disable(real, reason=REASON)

    @functools.wraps(real)
    def _call_impl(self, *args, **kwargs):
        if compiling() and id(self) in _PAGED:
            return eager(self, *args, **kwargs)
        return real(self, *args, **kwargs)

    patches.set_attr(nn.Module, "_call_impl", _call_impl, label="nn.Module._call_impl: paged modules run eagerly "
                                                                 "under torch.compile")
    patches.add_undo(_PAGED.clear, "paged modules under torch.compile")


def add_model(model: nn.Module, patches) -> None:
    """Register ``model`` and all its submodules as paged (run eagerly under ``torch.compile``)
    until paging closes."""
    ids = {id(m) for m in model.modules()}
    new = ids - _PAGED
    _PAGED.update(new)
    patches.add_undo(functools.partial(_PAGED.difference_update, new), "paged modules under torch.compile")


def runs_eagerly(module: nn.Module) -> bool:
    """Whether ``module`` belongs to a paged model (Dynamo calls it eagerly) now."""
    return id(module) in _PAGED


def eager_module_count() -> int:
    """How many modules are registered as paged (0 once paging closed)."""
    return len(_PAGED)


def compiled_before(model: nn.Module) -> str | None:
    """The name of a module of ``model`` compiled with ``Module.compile()`` (its compiled call
    bound to the unpatched ``_call_impl``: Dynamo would trace the paging hooks), or None."""
    for name, m in model.named_modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            return name or type(model).__name__
    return None
