"""Whether the script differentiates a graph again: ``create_graph=True`` or ``retain_graph=True``.

Some of the switch's speed-ups build graphs that PyTorch cannot differentiate twice or keep for
a second backward, where the script's eager model could:

* a compile rung's AOTAutograd graph: "torch.compile with aot_autograd does not currently support
  double backward" (a gradient penalty: ``torch.autograd.grad(..., create_graph=True)``), and, with
  buffers its backward reuses, "compiled with non-empty donated buffers which requires
  create_graph=False and retain_graph=False" (``backward(retain_graph=True)``,
  ``torch.autograd.functional.jacobian``);
* scaled-dot-product attention's fused CPU and GPU kernels: "derivative for
  aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented" (a WGAN-GP critic
  with ``nn.MultiheadAttention``, which the attention step routes to SDPA, or hand-written
  attention the override rung rewrites to it).

Until 2026-11-28 such scripts crashed under the switch at their first penalty (a probe's finding).
:class:`GraphReuseWatch` wraps ``torch.autograd.backward`` (which ``Tensor.backward`` calls) and
``torch.autograd.grad`` for the session. Policy:

* **Seen** (:attr:`GraphReuseWatch.seen`): the first call with ``create_graph=True`` and the first
  with ``retain_graph=True`` are noted with where they came from, and every subscriber is told
  once per kind: compile ladders give their rungs up (either kind), routed attention stops
  choosing the fused kernel (``create_graph``).
* **Ready** (:attr:`GraphReuseWatch.ready`): those features start only after the script has run
  :data:`READY_AFTER` backward calls with neither kind, so that a loop which differentiates twice
  in its first iterations (a penalty every step, or in a phase of the first iteration, as
  StyleGAN2's lazy regularization runs at iteration 0) is seen before a graph that cannot take it
  is built.
* **Read in the source** (:meth:`GraphReuseWatch.scan_source`): a script that first differentiates
  twice later (a penalty from some step on, a phase after pre-training) crashed at that call with
  PyTorch's error when a compiled rung had run that step's forward (a probe: a WGAN-GP penalty from
  step 70 on, in performance mode). So when the watch becomes ready, and again when a ladder would
  start a rung, the source files of the script's frames on the stack (not torch's, this package's,
  the standard library's or an installed package's), the ``__main__`` file and the model's class
  file are read once each for ``create_graph=`` with a value other than ``False`` and for
  ``hessian(`` / ``hvp(`` / ``vhp(`` (``torch.autograd.functional`` differentiates twice itself).
  A match counts as ``create_graph`` seen, with the file and line and "in the script's source".
  The cost of a false match (a comment, a branch never taken) is a rung not tried, never a wrong
  result. Still missed: a penalty written only in an installed package or in a file not on the
  stack then; such a script fails once, at that call, and the features stand aside from then on.

Cost: one Python call per backward; nothing per forward; each source file read once.
"""
from __future__ import annotations

import functools
import inspect
import linecache
import re
import sys
import sysconfig
import threading
import traceback
import weakref
from typing import Callable, Iterable

import torch

from apt_model.base.log import get_logger
from apt_model.base.patches import PatchSet

log = get_logger(__name__)

#: Backward calls the script runs with neither ``create_graph`` nor ``retain_graph`` before the
#: features that cannot take them start.
READY_AFTER = 4

KINDS = ("create_graph", "retain_graph")


class GraphReuseWatch:
    """Notes ``create_graph`` / ``retain_graph`` backward calls (see the module docstring).

    Args:
        read_source: whether :meth:`scan_source` reads the script's source (tests of the calls alone
            turn it off: their own file mentions ``create_graph``).

    Attributes:
        seen: ``{kind: where}`` for each kind seen (``where``: the script's line that called it).
        backwards: backward calls seen so far (``torch.autograd.backward`` and ``grad``).
        counted: whether :data:`READY_AFTER` backward calls were seen (flips once: what
            :meth:`ready_without` reads, so that TorchDynamo, which inlines a routed attention's
            hook, guards on a value that changes once and not at every backward — a probe saw a
            model recompiled at every step until Dynamo's recompile limit).
    """

    def __init__(self, read_source: bool = True):
        self.seen: dict[str, str] = {}
        self.backwards = 0
        self.counted = False
        self.read_source = read_source
        self._read: set[str] = set()  # source files already read by scan_source
        self._subscribers: list = []  # weak references to callables f(kind, where)
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        """Whether features that cannot take either kind may start: neither seen, after
        :data:`READY_AFTER` backward calls."""
        return self.ready_without(KINDS)

    def ready_without(self, kinds: tuple[str, ...]) -> bool:
        """Whether features that cannot take ``kinds`` may start: none of them seen, after
        :data:`READY_AFTER` backward calls."""
        return self.counted and not any(k in self.seen for k in kinds)

    def subscribe(self, callback: Callable[[str, str], None]) -> None:
        """Call ``callback(kind, where)`` when a kind is first seen (held weakly: a bound method's
        object may die)."""
        ref = weakref.WeakMethod(callback) if hasattr(callback, "__self__") else weakref.ref(callback)
        with self._lock:
            self._subscribers = [r for r in self._subscribers if r() is not None] + [ref]

    def note(self, create_graph: bool, retain_graph: bool) -> None:
        """A backward call starts with these arguments."""
        self.backwards += 1
        new = [k for k, on in zip(KINDS, (create_graph, retain_graph)) if on and k not in self.seen]
        if new:
            self._saw(new, _caller())
        if not self.counted and self.backwards >= READY_AFTER:
            if not new:  # about to be ready: the loop's files are on the stack now
                self.scan_source()
            self.counted = True

    def scan_source(self, extra: Iterable[str | None] = (), stack: bool = True) -> None:
        """Read the script's source for a second differentiation it has not run yet (see the module
        docstring): the files of this thread's frames that are the script's and the ``__main__`` file
        (``stack``), and ``extra`` (a model's class file), each once. A match is ``create_graph`` seen, told to the
        subscribers; nothing when reading is off or ``create_graph`` was seen already. Never raises."""
        if not self.read_source or "create_graph" in self.seen:
            return
        try:
            files = _script_files(extra, stack)
            for path in files:
                if path in self._read:
                    continue
                self._read.add(path)
                where = _differentiates_twice(path)
                if where is not None:
                    self._saw(["create_graph"], f"{where}, in the script's source: not called yet")
                    return
        except Exception as err:  # noqa: BLE001 - a file that cannot be read costs a look, never a call
            log.debug("graph reuse: reading the script's source: %s: %s", type(err).__name__, err)

    def _saw(self, new: list[str], where: str) -> None:
        with self._lock:
            new = [k for k in new if k not in self.seen]
            for kind in new:
                self.seen[kind] = where
            subscribers = [r() for r in self._subscribers]
        for kind in new:
            log.info("the script differentiates with %s=True (%s): features whose graphs cannot take it "
                     "stand aside", kind, where)
            for fn in subscribers:
                if fn is None:
                    continue
                try:
                    fn(kind, where)
                except Exception as err:  # noqa: BLE001 - a feature's reaction must not break the backward
                    log.warning("apt_model: reacting to %s=True failed: %s: %s", kind, type(err).__name__, err)

    def install(self, patches: PatchSet) -> None:
        """Wrap ``torch.autograd.backward`` and ``torch.autograd.grad``; undone with ``patches``."""
        real_backward, real_grad = torch.autograd.backward, torch.autograd.grad

        @functools.wraps(real_backward)
        def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, *args, **kwargs):
            self.note(bool(create_graph), bool(retain_graph))
            return real_backward(tensors, grad_tensors, retain_graph, create_graph, *args, **kwargs)

        @functools.wraps(real_grad)
        def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False, *args, **kwargs):
            self.note(bool(create_graph), bool(retain_graph))
            return real_grad(outputs, inputs, grad_outputs, retain_graph, create_graph, *args, **kwargs)

        # run eagerly under Dynamo (a backward inside a compiled step breaks its graph there anyway)
        backward = torch.compiler.disable(backward, reason="apt_model notes backward arguments")
        grad = torch.compiler.disable(grad, reason="apt_model notes backward arguments")
        patches.set_attr(torch.autograd, "backward", backward, label="torch.autograd.backward (graph reuse watch)")
        patches.set_attr(torch.autograd, "grad", grad, label="torch.autograd.grad (graph reuse watch)")


#: What in a script's line says it differentiates a graph twice: ``create_graph=`` with a value
#: other than ``False`` (``True``, a variable), or a ``torch.autograd.functional`` call that does
#: it itself.
_TWICE = re.compile(r"\bcreate_graph\s*=\s*(?!False\b)|\b(?:hessian|hvp|vhp)\s*\(")

#: Folders whose files are not the script's: the standard library and installed packages.
_LIBRARY_DIRS = tuple(sorted({p for k in ("stdlib", "platstdlib", "purelib", "platlib")
                              if (p := sysconfig.get_paths().get(k))}))


def is_script_file(path: str) -> bool:
    """Whether ``path`` is one of the script's own source files: not generated (``<...>``), not torch's
    or apt_model's, not the standard library's or an installed package's."""
    name = path.replace("\\", "/")
    return (bool(path) and not path.startswith("<") and "/torch/" not in name and "/apt_model/" not in name
            and "site-packages/" not in name and "dist-packages/" not in name and not path.startswith(_LIBRARY_DIRS))


def _script_files(extra: Iterable[str | None] = (), stack: bool = True) -> list[str]:
    """The script's source files: of this thread's frames (innermost first) and ``__main__``'s
    (``stack``), and ``extra``."""
    out: list[str] = []
    frame = sys._getframe(1) if stack else None
    while frame is not None:
        out.append(frame.f_code.co_filename)
        frame = frame.f_back
    if stack:
        out.append(getattr(sys.modules.get("__main__"), "__file__", None) or "")
    out.extend(p for p in extra if p)
    seen: set[str] = set()
    return [p for p in out if is_script_file(p) and not (p in seen or seen.add(p))]


def _differentiates_twice(path: str) -> str | None:
    """``path:line`` of the first line of ``path`` that matches :data:`_TWICE` outside a comment, or None."""
    for number, line in enumerate(linecache.getlines(path), 1):
        if _TWICE.search(line.split("#", 1)[0]):
            return f"{path}:{number}"
    return None


def source_file(obj) -> str | None:
    """The file ``obj`` (a class) is defined in, or None (a built-in, a class made at run time)."""
    try:
        return inspect.getsourcefile(obj)
    except (TypeError, OSError):
        return None


def _caller() -> str:
    """The first frame outside torch and this package: ``file:line``."""
    for frame in reversed(traceback.extract_stack(limit=16)[:-2]):
        name = frame.filename.replace("\\", "/")
        if "/torch/" not in name and "/apt_model/" not in name:
            return f"{frame.filename}:{frame.lineno}"
    return "unknown"


def watch_for(services: dict, patches: PatchSet) -> GraphReuseWatch:
    """The session's watch (``services["graph_reuse"]``), made and installed at the first ask."""
    watch = services.get("graph_reuse")
    if watch is None:
        watch = services["graph_reuse"] = GraphReuseWatch()
        watch.install(patches)
    return watch
