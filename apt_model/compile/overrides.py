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
shared, except those the graph changes in place; user inputs and buffers cloned, so running
twice changes no state) with gradients off
and dropout off in both (dropout calls become identity, SDPA's ``dropout_p`` 0: random masks
cannot match; both runs start from one random state, so a forward that draws its own noise draws
the same), and compares every output: ``|a - b| <= atol + rtol * |b|`` (equal values, infinities
included, and NaN beside NaN agree) with
rtol = atol = 1e-4 for fp32 outputs and 2e-2 for 16-bit ones (a scaled-dot-product kernel sums in
a different order). A mismatch keeps the original graph and records why.

**The script's own checkpoints run as written.** Every graph this backend returns has its captured
``torch.utils.checkpoint`` calls run by :func:`checkpoint_as_written` (the random state preserved
for the recomputation), and the reference it checks against has bodies of its own.
"""
from __future__ import annotations

import copy
import operator
from typing import Callable

import torch
import torch.nn.functional as F

from apt_model.base.log import get_logger

log = get_logger(__name__)

#: (rtol = atol) per output dtype for the verification; other dtypes must match exactly
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 2e-2, torch.float16: 2e-2}

#: what :func:`dropout_free` makes the identity
DROPOUT_FUNCTIONS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
                     torch.dropout, torch.dropout_, torch.alpha_dropout, torch.alpha_dropout_, torch.feature_dropout,
                     torch.feature_dropout_, torch.feature_alpha_dropout, torch.feature_alpha_dropout_}
DROPOUT_MODULES = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
                   torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule with its own copy of ``gm``'s graph and of every subgraph it holds (a
    higher-order op's body: the script's checkpointed block), parameters and other submodules
    shared. Until 2026-11-29 the bodies were shared, so a rewrite of the captured graph rewrote
    its reference's bodies too: the check compared rewritten with rewritten, and a rejected
    rewrite still ran (a probe's finding)."""
    out = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    for node in out.graph.nodes:
        if node.op == "get_attr":
            try:
                body = out.get_submodule(node.target)
            except AttributeError:
                continue
            if isinstance(body, torch.fx.GraphModule):
                parent, _, name = node.target.rpartition(".")
                setattr(out.get_submodule(parent) if parent else out, name, copy_graph_module(body))
    return out


def _graphs(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    """``gm`` and every GraphModule it holds (higher-order ops' bodies), outermost first."""
    return [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]


_CHECKPOINT_HOP = getattr(getattr(torch.ops, "higher_order", None), "tag_activation_checkpoint", None)

#: ``torch.utils.checkpoint.checkpoint`` options a captured checkpoint keeps (``use_reentrant`` is
#: always False once captured).
_CHECKPOINT_OPTIONS = ("preserve_rng_state", "context_fn", "determinism_check", "debug")


def checkpoint_as_written(body, *args, **kwargs):
    """A captured ``torch.utils.checkpoint`` call run eagerly as the script wrote it: non-reentrant,
    and the random state preserved for the recomputation unless the script said otherwise.

    Dynamo captures the script's checkpoint as the ``tag_activation_checkpoint`` higher-order op,
    whose eager implementation sets ``preserve_rng_state=False`` (Inductor replays the random
    numbers itself). Run eagerly, as this rung runs every graph, a dropout inside the checkpoint
    drew other masks in the backward's recomputation: the same loss, other gradients, at every
    call of the rung's warm-up and trial (a probe's finding, 2026-11-29)."""
    opts = {k: v for k, v in kwargs.items() if k in _CHECKPOINT_OPTIONS}
    opts.setdefault("preserve_rng_state", True)
    return torch.utils.checkpoint.checkpoint(body, *args, use_reentrant=False, **opts)


def eager_checkpoints(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` (changed in place, and returned) with each captured checkpoint, in it and in its
    bodies, calling :func:`checkpoint_as_written`."""
    if _CHECKPOINT_HOP is None:
        return gm
    for g in _graphs(gm):
        changed = False
        for node in g.graph.nodes:
            if node.op == "call_function" and node.target is _CHECKPOINT_HOP:
                node.target = checkpoint_as_written
                changed = True
        if changed:
            g.recompile()
    return gm


def is_dropout(node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    """Whether ``node`` calls dropout (:data:`DROPOUT_FUNCTIONS`, or an ``nn.Dropout*`` submodule of ``gm``)."""
    if node.op == "call_function":
        return node.target in DROPOUT_FUNCTIONS
    if node.op == "call_module":
        try:
            return isinstance(gm.get_submodule(node.target), DROPOUT_MODULES)
        except AttributeError:
            return False
    return False


def dropout_free(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` in which every dropout is the identity, for checking a rewrite.

    Dropout calls (:data:`DROPOUT_FUNCTIONS`) and ``nn.Dropout*`` submodules are replaced by their
    input, and SDPA calls get ``dropout_p=0.0``, so an original and a rewritten graph can be
    compared on a probe input in training mode (their random masks cannot match). The copy has its
    own graph and shares ``gm``'s parameters, buffers and submodules; ``gm`` is not changed.

    Raises:
        TypeError: when ``gm`` is not a ``torch.fx.GraphModule``.
    """
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(f"expected a torch.fx.GraphModule, got {type(gm).__name__}")
    out = copy_graph_module(gm)
    for g in _graphs(out):  # the checkpointed bodies too (a review probe's finding)
        for node in list(g.graph.nodes):
            if is_dropout(node, g):
                node.replace_all_uses_with(node.args[0] if node.args else node.kwargs.get("input"))
                g.graph.erase_node(node)
            elif node.op == "call_function" and node.target is F.scaled_dot_product_attention:
                if len(node.args) > 4:  # (query, key, value, attn_mask, dropout_p, ...)
                    node.args = (*node.args[:4], 0.0, *node.args[5:])
                else:
                    node.kwargs = {**node.kwargs, "dropout_p": 0.0}
        g.graph.lint()
        g.recompile()
    return out


def concrete_size(x):
    """A symbolic size Dynamo passes to a graph recaptured with dynamic shapes (``s0``) as the
    number it stands for in this call; anything else unchanged. Raises what torch raises when the
    size has no value (the caller rejects the rewrite)."""
    if not isinstance(x, torch.SymInt):
        return x
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    return int(optimization_hint(x))


#: Operators that change their first argument in place (besides methods and functions whose name
#: ends in one underscore, ``add_``, and calls with ``inplace=True`` or ``out=``).
_INPLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
                      operator.ixor, operator.ilshift, operator.irshift, operator.imatmul}

#: Calls whose result shares its first argument's memory (an in-place change of it changes that).
_VIEWS = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "expand", "expand_as",
          "squeeze", "unsqueeze", "flatten", "unflatten", "narrow", "select", "split", "chunk", "unbind",
          "movedim", "swapaxes", "swapdims", "diagonal", "as_strided", "detach", "contiguous", "unfold",
          "__getitem__", "getitem", "real", "imag", "view_as_real", "view_as_complex"}


def call_name(target) -> str:
    """A graph node's target by name: a method's name, a function's ``__name__`` ("" if none)."""
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def changed_in_place(gm: torch.fx.GraphModule) -> set[int]:
    """Indices of ``gm``'s inputs (placeholders, in order) that an operation of the graph changes in
    place, directly or through a view: ``p.add_(1)``, ``p[0] = v``, ``p += 1``, ``F.relu(p,
    inplace=True)``, ``torch.add(a, b, out=p)``. A graph holding subgraphs (a higher-order op: a
    checkpointed block's body) counts every input an in-place operation anywhere in it could reach:
    all of them, when one exists."""
    return _input_accesses(gm)[0]


def read_then_changed(gm: torch.fx.GraphModule) -> set[int]:
    """Indices of ``gm``'s inputs that an operation of the graph reads (directly or through a
    view: a ``clone()``, a matmul) before another changes them in place (a queue of keys read, then
    written: MoCo's). Updates alone (``p.mul_(m).add_(q)``, a counter's ``add_(1)``, batch norm's
    running statistics, updated inside its op) are not such. A graph holding subgraphs with an
    in-place operation counts all of its inputs (as :func:`changed_in_place`)."""
    return _input_accesses(gm)[1]


def _input_accesses(gm: torch.fx.GraphModule) -> tuple[set[int], set[int]]:
    """``(changed, read_then_changed)``: see :func:`changed_in_place` and :func:`read_then_changed`."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    alias = {n: i for i, n in enumerate(placeholders)}
    changed: set[int] = set()
    read: set[int] = set()
    hazards: set[int] = set()
    for g in [gm] + [m for name, m in gm.named_modules() if name and isinstance(m, torch.fx.GraphModule)]:
        for node in g.graph.nodes:
            if node.op not in ("call_function", "call_method"):
                continue
            name = call_name(node.target)
            inplace = ((name.endswith("_") and not name.endswith("__")) or node.target in _INPLACE_OPERATORS
                       or node.kwargs.get("inplace") is True)
            targets = [node.args[0]] if node.args and inplace else []
            if isinstance(node.kwargs.get("out"), torch.fx.Node):
                targets.append(node.kwargs["out"])
            if g is not gm:
                if targets:  # inside a subgraph: its inputs are the outer graph's operands
                    every = set(range(len(placeholders)))
                    return every, every
                continue
            for t in targets:
                if t in alias:
                    changed.add(alias[t])
                    if alias[t] in read:
                        hazards.add(alias[t])
            first = node.args[0] if node.args else None
            if not inplace and first in alias and (name in _VIEWS or node.target is operator.getitem):
                alias[node] = alias[first]
                continue  # a view is no read: what reads it is
            operands = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n)
            written = {id(t) for t in targets}
            for leaf in torch.utils._pytree.tree_leaves(operands):
                if isinstance(leaf, torch.fx.Node) and leaf in alias and id(leaf) not in written:
                    read.add(alias[leaf])
    return changed, hazards


def isolated_inputs(inputs: list, changed: set[int] = frozenset(), keep_grad: bool = False) -> list:
    """The inputs for one verification run: parameters shared (forward does not change them),
    except those in ``changed`` (a step counter or running mean kept as a ``Parameter`` with
    ``requires_grad=False`` and updated in forward: the two check runs updated it twice more, a
    probe's finding), other tensors (the user's inputs, buffers a forward may update in place, also
    inside an op such as batch norm's) cloned, with their ``requires_grad`` where ``keep_grad``
    (the compile check differentiates its runs), symbolic sizes made concrete (a graph recaptured
    for another batch size takes its sizes as inputs: run eagerly with them, ``reshape`` raised
    "SymIntArrayRef expected to contain only concrete integers" into the script's call; a probe's
    finding)."""
    def one(i: int, x):
        if not isinstance(x, torch.Tensor):
            return concrete_size(x)
        if isinstance(x, torch.nn.Parameter) and i not in changed:
            return x
        c = x.detach().clone()
        return c.requires_grad_(x.requires_grad) if keep_grad else c

    return [one(i, x) for i, x in enumerate(inputs)]


def same_draws(inputs: list):
    """A context in which a check run draws the random numbers the other run draws (a forward that
    injects noise: without it, every such graph failed the check, "output 0 differs by up to
    0.0459", blaming the rewrite; a probe's finding): torch's CPU generator and those of the
    inputs' accelerator are saved on entry and put back on exit."""
    devices = {t.device for t in inputs if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")}
    if not devices:
        return torch.random.fork_rng(devices=[])
    kind = sorted(d.type for d in devices)[0]
    return torch.random.fork_rng(devices=sorted({d.index or 0 for d in devices if d.type == kind}), device_type=kind)


def outputs_match(reference: torch.fx.GraphModule, candidate: torch.fx.GraphModule, inputs: list) -> tuple[bool, str]:
    """Run both graphs (dropout off, gradients off) on copies of ``inputs`` and compare every
    output tensor within :data:`TOLERANCE`. Returns ``(match, why)``."""
    changed = changed_in_place(reference)
    with torch.no_grad():
        with same_draws(inputs):
            want = dropout_free(reference)(*isolated_inputs(inputs, changed))
        with same_draws(inputs):
            got = dropout_free(candidate)(*isolated_inputs(inputs, changed))
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
        af, bf = a.float(), b.float()
        # equal values (the same inf: a float causal mask among the outputs) and NaN beside NaN
        # agree; |inf - inf| is NaN, and every such graph failed "differs by up to nan" (a probe's finding)
        diff = (af - bf).abs().masked_fill((af == bf) | (af.isnan() & bf.isnan()), 0.0)
        bound = tol + tol * bf.abs()
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
        graphs: graphs captured so far (the ladder counts compilations and their seconds by
            wrapping this backend in a :class:`~apt_model.compile.backends.CountingBackend`).
        sites: ``[(tag, site), ...]`` rewrites in use (verified).
        rejected: why rewrites were not used (a failed verification, a rewrite that raised).
    """

    def __init__(self, overrides: dict[str, Callable]):
        self.overrides = dict(overrides)
        self.graphs = 0
        self.sites: list[tuple[str, object]] = []
        self.rejected: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list):
        self.graphs += 1
        reference = copy_graph_module(gm)
        found = []
        # the captured graph and the subgraphs of its higher-order ops (a checkpointed
        # block's body is one: torch.utils.checkpoint is captured as a higher-order op)
        graphs = _graphs(gm)
        for tag, fn in self.overrides.items():
            try:
                sites = [site for g in graphs for site in (fn(g) or [])]
            except Exception as err:  # noqa: BLE001 - a broken rewrite must not break training
                self.rejected.append(f"{tag}: the rewrite raised {type(err).__name__}: {err}")
                log.debug("override %s raised", tag, exc_info=True)
                return eager_checkpoints(reference).forward
            found.extend((tag, site) for site in sites)
        if not found:
            return eager_checkpoints(gm).forward
        try:
            ok, why = outputs_match(reference, gm, example_inputs)
        except Exception as err:  # noqa: BLE001 - a check that cannot run keeps the graph as captured
            ok, why = False, f"the check against the captured graph raised {type(err).__name__}: {err}"
            log.debug("override verification raised", exc_info=True)
        if not ok:
            tags = ", ".join(sorted({t for t, _ in found}))
            self.rejected.append(f"{tags}: not used: {why}")
            return eager_checkpoints(reference).forward
        self.sites.extend(found)
        return eager_checkpoints(gm).forward


