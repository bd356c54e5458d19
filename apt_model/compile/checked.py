"""The compile rung's check: a graph that reads one of its inputs and then changes it in place is
compared, forward and backward, with the graph as captured before its compiled code is used.

Why: TorchInductor (torch 2.13, CPU) miscompiled MoCo's forward. The logits read a clone of the
queue of keys (a buffer), and the forward then wrote the new keys into the queue in place; the
compiled backward computed the query encoder's gradients from the overwritten queue, off by about
100%, without a word. Compiled in pieces (a graph break at ``int(self.ptr)``), the same forward
made the backward raise "one of the variables needed for gradient computation has been modified
by an inplace operation" (a probe's finding, performance and full modes, 2026-11-29).

Policy (:class:`CheckedBackend`, a ``torch.compile`` backend wrapping the rung's own):

* A graph no input of which is read and then changed in place
  (:func:`~apt_model.compile.overrides.read_then_changed`: plain models, batch norm's running
  statistics, an EMA update ``p_ema.mul_(d).add_(p)``) is compiled and used unchecked, as before.
* Otherwise the compiled graph and the captured one (run eagerly) are run on the call's inputs,
  every tensor but the parameters the graph does not change cloned for each run (so the check
  changes no state: until a review the same day, batch norm's running statistics, updated inside
  its op, were updated by both check runs),
  from one random state, with gradients on; then each is differentiated with the same random
  output gradients. Every output, every changed input, and the gradient of every input that
  requires one must agree within :data:`RELATIVE_TOLERANCE` (the norm of the difference over the
  norm of the eager value, per tensor). A graph that draws random numbers is not compared (a
  compiler's random streams are not eager's): it fails the check.
* A failed check raises :class:`CompileCheckError` at the compiled graph's first call, before
  the graph ran for it (with ``fullgraph=True`` the graph is the whole forward: none of the
  call ran), and the ladder leaves the rung with the reason (the call runs as written).

Cost: for the graphs checked only, one eager and one compiled forward and backward at the first
call after each capture (the warm-up's first call, a recompilation), and while they run two sets
of the gradients of the graph's inputs (the model's parameters among them).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from apt_model.base.log import get_logger
from apt_model.compile.overrides import (
    call_name,
    changed_in_place,
    copy_graph_module,
    is_dropout,
    isolated_inputs,
    read_then_changed,
    same_draws,
)

log = get_logger(__name__)

#: Largest ``|a - b| / |b|`` (norms, per tensor) between the compiled and the eager graph's outputs,
#: changed inputs and gradients: a compiler's fp32 rounding stays near 1e-6, a 16-bit one near 1e-2;
#: the miscompilation this check was made for was off by 1.0.
RELATIVE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 5e-2, torch.float16: 5e-2}

#: Calls that draw random numbers (by name: functions, methods and ``torch.ops`` overloads).
RANDOM_CALLS = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm", "bernoulli",
                "bernoulli_", "multinomial", "normal", "normal_", "uniform_", "exponential_", "geometric_",
                "cauchy_", "log_normal_", "random_", "rrelu", "rrelu_", "native_dropout", "poisson"}


class CompileCheckError(RuntimeError):
    """The compiled graph disagreed with the captured one (or could not be compared); the message
    names the tensor and by how much."""


def draws_random(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` (or a subgraph of it) draws random numbers: dropout, SDPA with a nonzero
    ``dropout_p``, or a call in :data:`RANDOM_CALLS`."""
    for g in [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]:
        for node in g.graph.nodes:
            if node.op not in ("call_function", "call_method", "call_module"):
                continue
            if is_dropout(node, g) or call_name(node.target).split(".")[0] in RANDOM_CALLS:
                return True
            if node.op == "call_function" and node.target is torch.nn.functional.scaled_dot_product_attention:
                p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
                if not (isinstance(p, (int, float)) and p == 0):
                    return True
    return False


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got.detach().double() - want.detach().double()).norm().item()
    scale = want.detach().double().norm().item()
    return diff / scale if scale > 0 else diff


def _run(fn: Callable, inputs: list, changed: set[int], cotangents: list | None):
    """One run of ``fn`` on isolated inputs (:func:`~apt_model.compile.overrides.isolated_inputs`:
    every tensor but the parameters the graph does not change cloned, batch norm's running statistics
    among them); returns (outputs, changed inputs after the run, gradients of the inputs that require
    one, the cotangents used)."""
    args = isolated_inputs(inputs, changed, keep_grad=True)
    with torch.enable_grad(), same_draws(inputs):
        out = fn(*args)
    leaves = list(torch.utils._pytree.tree_leaves(out))
    diff_outs = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    wrt = [x for x in args if isinstance(x, torch.Tensor) and x.requires_grad]
    if cotangents is None:
        gen = torch.Generator().manual_seed(0)
        cotangents = [torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.device, t.dtype)
                      for t in diff_outs]
    grads = []
    if diff_outs and wrt:
        grads = list(torch.autograd.grad(diff_outs, wrt, grad_outputs=cotangents, allow_unused=True))
    return leaves, [args[i] for i in sorted(changed)], grads, cotangents


def compiled_matches(reference: torch.fx.GraphModule, compiled: Callable, inputs: list) -> tuple[bool, str]:
    """Compare ``compiled`` with ``reference`` (the captured graph, run eagerly) forward and
    backward on ``inputs`` (see the module docstring). Returns ``(match, why)``."""
    if draws_random(reference):
        return False, ("the graph draws random numbers and changes an input it read in place: the compiled "
                       "code's random numbers are not eager's, so it cannot be checked")
    changed = changed_in_place(reference)
    want_out, want_changed, want_grads, cot = _run(reference, inputs, changed, None)
    got_out, got_changed, got_grads, _ = _run(compiled, inputs, changed, cot)
    pairs = ([(f"output {i}", a, b) for i, (a, b) in enumerate(zip(got_out, want_out))]
             + [(f"changed input {i}", a, b) for i, (a, b) in enumerate(zip(got_changed, want_changed))]
             + [(f"gradient {i}", a, b) for i, (a, b) in enumerate(zip(got_grads, want_grads))])
    if len(got_out) != len(want_out) or len(got_grads) != len(want_grads):
        return False, f"{len(got_out)} outputs and {len(got_grads)} gradients instead of {len(want_out)} and {len(want_grads)}"
    worst = 0.0
    for what, a, b in pairs:
        if not isinstance(b, torch.Tensor) or not isinstance(a, torch.Tensor):
            # a gradient None on both sides (an input the outputs do not use), equal Python values
            if type(a) is not type(b) or (not isinstance(b, torch.Tensor) and a != b):
                return False, f"{what}: {type(a).__name__} {a!r:.60} instead of {type(b).__name__} {b!r:.60}"
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return False, f"{what}: {tuple(a.shape)} {a.dtype} instead of {tuple(b.shape)} {b.dtype}"
        if not b.is_floating_point():
            if not torch.equal(a, b):
                return False, f"{what} differs"
            continue
        err = _relative_error(a, b)
        tol = RELATIVE_TOLERANCE.get(b.dtype, 0.0)
        if not err <= tol:
            return False, f"{what} differs from the eager graph's by {err:.3g} of its norm (tolerance {tol:g})"
        worst = max(worst, err)
    return True, f"forward and backward match the captured graph (largest relative difference {worst:.3g})"


class CheckedBackend:
    """A ``torch.compile`` backend: ``backend``'s compilation, checked where the graph reads an
    input and then changes it in place (see the module docstring). The check runs at the compiled
    graph's first call, before it runs for the call (not inside the backend: a backward compiled
    there, inside the forward's compilation, raised "Metric(s) {'is_forward'} have already been
    set"), on that call's inputs.

    Args:
        backend: the backend callable ``(gm, example_inputs) -> callable`` (a name resolved by
            the caller).
        name: the backend's name, for reports (``__name__``).

    Attributes:
        checked: checks run; ``failures``: why checks failed.
    """

    def __init__(self, backend: Callable, name: str):
        self.inner = backend
        self.__name__ = name
        self.checked = 0
        self.failures: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        if not read_then_changed(gm):
            return self.inner(gm, example_inputs)
        reference = copy_graph_module(gm)
        compiled = self.inner(gm, example_inputs)
        pending = [True]

        def run(*args):  # Dynamo calls a backend's callable with the graph's inputs, unboxed
            if pending:
                self._check(reference, compiled, list(args))
                pending.clear()
            return compiled(*args)

        return run

    def _check(self, reference: torch.fx.GraphModule, compiled: Callable, inputs: list) -> None:
        """Raises:
            CompileCheckError: the compiled graph disagreed with ``reference``, or could not be
                compared (the reason named)."""
        self.checked += 1
        try:
            ok, why = compiled_matches(reference, compiled, inputs)
        except Exception as err:  # noqa: BLE001 - an unchecked graph with this hazard is not used
            ok, why = False, f"the check raised {type(err).__name__}: {err}"
        if not ok:
            self.failures.append(why)
            raise CompileCheckError(
                f"{why} (the compiled forward reads a tensor and then changes it in place, so it is checked "
                "against the captured graph, run eagerly, before it is used)")
        log.info("compile check: %s", why)
