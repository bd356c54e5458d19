"""The override rung: registered graph rewrites, verified, run eagerly.

:class:`OverrideBackend` is a ``torch.compile`` backend. TorchDynamo captures the model's forward
as a ``torch.fx.GraphModule`` of torch-level calls (shapes and Python constants such as
``1 / math.sqrt(head_dim)`` already specialised); the backend applies every registered rewrite
(``tag -> fn(gm) -> sites``: hand-written attention to SDPA is built in, a device kind adds its
own with ``AcceleratorBackend.register_override``) and returns the rewritten graph's ``forward``,
which runs eagerly — no code generation, so the rung works on every device and costs only the
capture. No rewrite matched: the graph runs unchanged and the ladder leaves the rung.

**A rewrite is used only after it matched the original.** Before returning a rewritten graph the
backend runs the original and the rewritten graph on the first call's inputs (parameters
shared; user inputs and buffers cloned, so running twice changes no state) with gradients off
and dropout off in both (dropout calls become identity, SDPA's ``dropout_p`` 0: random masks
cannot match), and compares every output: ``|a - b| <= atol + rtol * |b|`` with
rtol = atol = 1e-4 for fp32 outputs and 2e-2 for 16-bit ones (a scaled-dot-product kernel sums in
a different order). A mismatch keeps the original graph and records why.
"""
from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn.functional as F

from apt_model.base.log import get_logger

log = get_logger(__name__)

#: (rtol = atol) per output dtype for the verification; other dtypes must match exactly
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 2e-2, torch.float16: 2e-2}

_DROPOUT = {F.dropout, torch.dropout, torch.nn.functional.dropout1d, torch.nn.functional.dropout2d,
            torch.nn.functional.alpha_dropout}


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule with its own copy of ``gm``'s graph (submodules and parameters shared)."""
    return torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))


def dropout_free(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose dropout calls are identity and whose SDPA calls have ``dropout_p=0``
    (for comparing two graphs that would otherwise draw different random masks)."""
    out = copy_graph_module(gm)
    for node in list(out.graph.nodes):
        if node.op == "call_function" and node.target in _DROPOUT:
            node.replace_all_uses_with(node.args[0])
            out.graph.erase_node(node)
        elif node.op == "call_module" and isinstance(out.get_submodule(node.target), torch.nn.modules.dropout._DropoutNd):
            node.replace_all_uses_with(node.args[0])
            out.graph.erase_node(node)
        elif node.op == "call_function" and node.target is F.scaled_dot_product_attention:
            if len(node.args) > 4:  # (query, key, value, attn_mask, dropout_p, ...)
                node.args = (*node.args[:4], 0.0, *node.args[5:])
            else:
                node.kwargs = {**node.kwargs, "dropout_p": 0.0}
    out.recompile()
    return out


def _isolated(inputs: list) -> list:
    """The inputs for one verification run: parameters shared (forward does not change them),
    other tensors (the user's inputs, buffers a forward may update in place) cloned."""
    return [x if isinstance(x, torch.nn.Parameter) or not isinstance(x, torch.Tensor) else x.detach().clone()
            for x in inputs]


def outputs_match(reference: torch.fx.GraphModule, candidate: torch.fx.GraphModule, inputs: list) -> tuple[bool, str]:
    """Run both graphs (dropout off, gradients off) on copies of ``inputs`` and compare every
    output tensor within :data:`TOLERANCE`. Returns ``(match, why)``."""
    with torch.no_grad():
        want = dropout_free(reference)(*_isolated(inputs))
        got = dropout_free(candidate)(*_isolated(inputs))
    want_leaves = torch.utils._pytree.tree_leaves(want)
    got_leaves = torch.utils._pytree.tree_leaves(got)
    if len(want_leaves) != len(got_leaves):
        return False, f"{len(got_leaves)} outputs instead of {len(want_leaves)}"
    worst = 0.0
    for i, (a, b) in enumerate(zip(got_leaves, want_leaves)):
        if not isinstance(b, torch.Tensor):
            if a != b:
                return False, f"output {i}: {a!r} instead of {b!r}"
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return False, f"output {i}: {tuple(a.shape)} {a.dtype} instead of {tuple(b.shape)} {b.dtype}"
        tol = TOLERANCE.get(b.dtype, 0.0)
        diff = (a.float() - b.float()).abs()
        bound = tol + tol * b.float().abs()
        if not bool((diff <= bound).all()):
            return False, (f"output {i} differs by up to {diff.max().item():.3g} "
                           f"(tolerance {tol:g} + {tol:g} x |value|)")
        worst = max(worst, diff.max().item() if diff.numel() else 0.0)
    return True, f"outputs match the captured graph within tolerance (largest difference {worst:.3g})"


class OverrideBackend:
    """A ``torch.compile`` backend applying registered rewrites (see the module docstring).

    Args:
        overrides: ``tag -> fn(gm) -> list of sites`` (each fn rewrites ``gm`` in place and returns
            what it rewrote; an empty list when nothing matched). It is applied to the captured
            graph and to each subgraph a higher-order op holds (a checkpointed block's body).

    Attributes:
        graphs: graphs captured so far.
        sites: ``[(tag, site), ...]`` rewrites in use (verified).
        rejected: why rewrites were not used (a failed verification, a rewrite that raised).
    """

    def __init__(self, overrides: dict[str, Callable]):
        self.overrides = dict(overrides)
        self.graphs = 0
        self.sites: list[tuple[str, object]] = []
        self.rejected: list[str] = []
        self.compiles = 0  # as CountingBackend: graphs handed to this backend
        self.seconds = 0.0
        self.name = "override"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list):
        import time

        start = time.perf_counter()
        self.graphs += 1
        self.compiles += 1
        try:
            reference = copy_graph_module(gm)
            found = []
            # the captured graph and the subgraphs of its higher-order ops (a checkpointed
            # block's body is one: torch.utils.checkpoint is captured as a higher-order op)
            graphs = [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
            for tag, fn in self.overrides.items():
                try:
                    sites = [site for g in graphs for site in (fn(g) or [])]
                except Exception as err:  # noqa: BLE001 - a broken rewrite must not break training
                    self.rejected.append(f"{tag}: the rewrite raised {type(err).__name__}: {err}")
                    log.debug("override %s raised", tag, exc_info=True)
                    return reference.forward
                found.extend((tag, site) for site in sites)
            if not found:
                return gm.forward
            ok, why = outputs_match(reference, gm, example_inputs)
            if not ok:
                tags = ", ".join(sorted({t for t, _ in found}))
                self.rejected.append(f"{tags}: not used: {why}")
                return reference.forward
            self.sites.extend(found)
            return gm.forward
        finally:
            self.seconds += time.perf_counter() - start


