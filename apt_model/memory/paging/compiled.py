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
* a module with backward hooks (its own or global ones) is called the same way: Dynamo would
  graph-break there anyway, and with the fault handler on the stack it fails instead (a Dynamo
  bug with any torch-function mode);
* every module of a paged model (the root and all its submodules) is called through
  :func:`torch.compiler.disable` when Dynamo reaches it: ``torch.compile(model)``,
  ``model.compile()`` and a compiled training step that calls the model all run the paged model
  eagerly — with its hooks and the fault handler, exactly as without ``torch.compile`` — and
  compile the rest. Dynamo logs the graph break with the reason below.

This is done with one patch of ``nn.Module._call_impl`` (undone when paging closes) that checks
``compiling()`` first, so an eager call pays one function call more. ``torch.compile(...,
fullgraph=True)`` of code that reaches a paged model raises Dynamo's ``Unsupported`` error, whose
text gives the reason below (its hint to remove a ``torch.compiler.disable`` call means this one).
A model compiled with ``model.compile()`` *before* paging started has its compiled call bound to
torch's own ``_call_impl`` (Dynamo would trace the paging hooks): that call is taken off while the
model is paged, and given back when paging closes (:func:`add_model`).

**A compiled function that reads a paged parameter directly**, outside any module call (an L2 term
over ``model.parameters()`` inside a compiled loss): Dynamo lifts the parameter as an input of the
graph, and the compiled kernels read it without passing the fault handler — with Inductor, the
default backend, that read a page's freed memory and the process crashed (SIGSEGV). So every graph
compiled while paging is on is wrapped (:func:`install_graph_inputs`, a patch of Dynamo's
``OutputGraph.call_user_compiler``, the one place every backend's compiled function passes): when
it runs, the pages among its inputs (and among the tensors it reads as attributes, where Dynamo
installs parameters that way: ``install_free_tensors``) are loaded and pinned for the call, exactly as the fault
handler does for one eager op (``enter``/``exit``: pages the outputs alias stay pinned while the
alias lives), and the call runs under the saved-tensor hooks that keep what its backward reads
readable (:class:`~apt_model.memory.paging.saved.SavedPins`). Whether the call may write its inputs
is read from the captured graph (:func:`graph_may_write`), as the fault handler decides it for one
eager op. The result is bitwise that of the same compiled function without paging. The call holds
every page it reads at once. A graph compiled before paging started is wrapped only once Dynamo
recompiles it (the fault handler's mode changes the torch-function mode stack Dynamo guards on).
"""
from __future__ import annotations

import functools
import operator
import weakref

import torch
import torch.nn as nn
import torch.nn.modules.module as module_mod

from apt_model.base.call_wrapper import script_call
from apt_model.base.log import get_logger
from apt_model.base.post_import import when_imported
from apt_model.memory.pages import live_page

log = get_logger(__name__)

#: The reason Dynamo records for the graph break at a paged module.
REASON = ("apt_model pages this module's parameters: it runs eagerly under torch.compile (its pages are "
          "loaded by module hooks and a torch-function mode that compiled code would bypass)")

#: The reason at a module with backward hooks. Dynamo graph-breaks there anyway ("Module-level
#: backwards hooks require compiled autograd"); with a torch-function mode on the stack (the fault
#: handler) it fails instead (``AttributeError: 'bool' object has no attribute 'name'``, a Dynamo
#: bug seen with any mode).
HOOKED_REASON = ("a module with backward hooks runs eagerly under torch.compile while apt_model's paging is on "
                 "(Dynamo fails on it under a torch-function mode)")

#: Attribute set on the patched ``_call_impl`` (see :func:`_bound_to_torchs_call`).
PATCHED_MARK = "_apt_model_paging"

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
    hooked = torch.compiler.disable(real, reason=HOOKED_REASON)

    @functools.wraps(real)
    def _call_impl(self, *args, **kwargs):
        if compiling():
            if id(self) in _PAGED:
                return eager(self, *args, **kwargs)
            if (self._backward_hooks or self._backward_pre_hooks or module_mod._global_backward_hooks
                    or module_mod._global_backward_pre_hooks):
                return hooked(self, *args, **kwargs)
        return real(self, *args, **kwargs)

    setattr(_call_impl, PATCHED_MARK, True)
    patches.set_attr(nn.Module, "_call_impl", _call_impl, label="nn.Module._call_impl: paged modules run eagerly "
                                                                 "under torch.compile")
    patches.add_undo(_PAGED.clear, "paged modules under torch.compile")


def install_graph_inputs(session, patches) -> None:
    """Wrap every graph Dynamo compiles from now on so that the pages among its inputs are loaded
    and pinned while it runs (see the module docstring), for ``session`` (a
    :class:`~apt_model.memory.paging.session.PagingSession`, held weakly) until ``patches`` are
    undone. Dynamo's ``OutputGraph.call_user_compiler`` is patched when Dynamo is imported, by
    whoever imports it (importing it here raced with a script thread's first optimizer build, which
    imports it too: an ImportError there, a probe's finding, 2026-11-29; and it costs 2 s); where
    this torch's Dynamo has no such method, that is logged and graphs are not covered."""
    _SESSION[0] = weakref.ref(session)
    patches.add_undo(functools.partial(_SESSION.__setitem__, 0, None), "the session compiled graphs page for")

    def patch(module) -> None:
        graph_cls = getattr(module, "OutputGraph", None)
        real = getattr(graph_cls, "call_user_compiler", None)
        if real is None:
            log.info("compiled graphs that read paged parameters directly are not covered: this torch's Dynamo has "
                     "no OutputGraph.call_user_compiler")
            return

        @functools.wraps(real)
        def call_user_compiler(self, gm, *args, **kwargs):
            return _PagedInputs(real(self, gm, *args, **kwargs), graph_may_write(gm), graph_attr_tensors(gm))

        patches.set_attr(graph_cls, "call_user_compiler", call_user_compiler,
                         label="Dynamo's compiled graphs load the pages among their inputs")

    stop = when_imported("torch._dynamo.output_graph", patch)
    if stop is not None:
        patches.add_undo(stop, "waiting for Dynamo's import to wrap its compiled graphs")


#: [weakref to the paging session compiled graphs load pages for, or None when paging is off]
_SESSION: list = [None]

#: ``operator`` functions that write their first argument (``x += y``, ``x[i] = v`` in a graph).
_OPERATOR_WRITES = frozenset([operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                              operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                              operator.ilshift, operator.irshift, operator.imatmul, operator.setitem])


def graph_attr_tensors(gm) -> list:
    """Weak references to the tensors a captured graph reads as attributes of its module
    (``get_attr`` nodes: what Dynamo does with parameters under
    ``torch._dynamo.config.install_free_tensors``) rather than as inputs."""
    out = []
    graph = getattr(gm, "graph", None)
    for node in graph.nodes if graph is not None else ():
        if node.op != "get_attr":
            continue
        obj = gm
        try:
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        if isinstance(obj, torch.Tensor):
            out.append(weakref.ref(obj))
    return out


def graph_may_write(gm) -> bool:
    """Whether a graph Dynamo captured may write a tensor it was given: an in-place op by name
    (``mul_``, ``_foreach_div_``), an ``out=`` argument, ``.data``, an in-place operator
    (``x += y``, ``x[i] = v``) — as :func:`~apt_model.memory.paging.fault.may_write` decides for one
    eager op. A graph that is not an ``fx.GraphModule`` may write (unknown)."""
    from apt_model.memory.paging.fault import may_write, writes_by_name  # fault imports this module

    graph = getattr(gm, "graph", None)
    if graph is None:
        return True
    for node in graph.nodes:
        if node.op == "call_method":
            if writes_by_name(str(node.target)) or "out" in node.kwargs:
                return True
        elif node.op == "call_function":
            if node.target in _OPERATOR_WRITES or may_write(node.target, node.kwargs):
                return True
    return False


class _PagedInputs:
    """A compiled graph's function, run with the pages among its inputs loaded and pinned (see the
    module docstring). Once paging is off it calls the function as is."""

    def __init__(self, fn, writes: bool = True, attrs: list | None = None):
        functools.update_wrapper(self, fn)  # keeps the attributes callers read (``_boxed_call``...)
        self._paged_inputs_fn = fn
        self._paged_inputs_write = writes
        self._paged_inputs_attrs = attrs or []  # weak references to tensors the graph reads as attributes

    def __call__(self, *args):
        fn = self._paged_inputs_fn
        ref = _SESSION[0]
        session = ref() if ref is not None else None
        if session is None or not session.mode.active:
            return fn(*args)
        lookup = session.pager.by_tensor
        hit = []
        attrs = [ref() for ref in self._paged_inputs_attrs]
        for a in (*args, attrs):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):  # a boxed call passes one list
                if isinstance(t, torch.Tensor):
                    page = live_page(lookup, t)
                    if page is not None:
                        hit.append(page)
        if not hit:
            return fn(*args)
        held = session.enter(hit, writes=self._paged_inputs_write)  # as for one eager op
        out = None
        try:
            saving = session.graph_saves(hit, args, {})
            if saving is None:
                out = fn(*args)
            else:
                with saving:
                    out = fn(*args)
        finally:
            session.exit(held, out, hit)
        return out


def add_model(model: nn.Module, patches) -> None:
    """Register ``model`` and all its submodules as paged (run eagerly under ``torch.compile``)
    until paging closes. A module compiled with ``Module.compile()`` before paging started (its
    compiled call would have Dynamo trace the paging hooks) has its compiled call taken off — it
    would run eagerly anyway — and given back when paging closes."""
    for name, m in model.named_modules():
        if _bound_to_torchs_call(m):
            log.info("%s was compiled with Module.compile() before paging started: it runs eagerly while paged, "
                     "compiled again after disable()", name or type(model).__name__)
            patches.set_attr(m, "_compiled_call_impl", None, label=f"compiled call of {name or 'the model'} off")
    ids = {id(m) for m in model.modules()}
    new = ids - _PAGED
    _PAGED.update(new)
    for m in model.modules():
        if id(m) in new:  # a dropped model's ids leave at once: a new module may get one
            weakref.finalize(m, _PAGED.discard, id(m)).atexit = False
    patches.add_undo(functools.partial(_PAGED.difference_update, new), "paged modules under torch.compile")


def runs_eagerly(module: nn.Module) -> bool:
    """Whether ``module`` belongs to a paged model (Dynamo calls it eagerly) now."""
    return id(module) in _PAGED


def eager_module_count() -> int:
    """How many modules are registered as paged (0 once paging closed)."""
    return len(_PAGED)


def _bound_to_torchs_call(m: nn.Module) -> bool:
    """Whether ``m`` was compiled with ``Module.compile()`` while paging was off: its compiled call
    wraps torch's own ``_call_impl`` (one compiled while paging was on, in this or an earlier
    session, wraps the patched one and runs a paged module eagerly by itself)."""
    compiled = script_call(m)  # the switch's own call wrapper is not a compiled call
    if compiled is None:
        return False
    orig = getattr(compiled, "_torchdynamo_orig_callable", None)
    return not getattr(getattr(orig, "__func__", None), PATCHED_MARK, False)
