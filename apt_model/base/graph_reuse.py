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
  is built. A script that first does so later fails at that call with PyTorch's error, and the
  features stand aside from the next call on.

Cost: one Python call per backward; nothing per forward.
"""
from __future__ import annotations

import functools
import threading
import traceback
import weakref
from typing import Callable

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

    Attributes:
        seen: ``{kind: where}`` for each kind seen (``where``: the script's line that called it).
        backwards: backward calls seen so far (``torch.autograd.backward`` and ``grad``).
    """

    def __init__(self):
        self.seen: dict[str, str] = {}
        self.backwards = 0
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
        return self.backwards >= READY_AFTER and not any(k in self.seen for k in kinds)

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
        if not new:
            return
        where = _caller()
        with self._lock:
            new = [k for k in new if k not in self.seen]
            for kind in new:
                self.seen[kind] = where
            subscribers = [r() for r in self._subscribers]
        for kind in new:
            log.info("the script called a backward with %s=True (%s): features whose graphs cannot take it "
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
