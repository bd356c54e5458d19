"""Recognise textbook attention written by hand in an FX graph and replace it with fused SDPA.

This is a graph rewrite for a custom ``torch.compile`` backend: TorchDynamo hands the backend a
:class:`torch.fx.GraphModule` captured at the torch-function level, the rewrite replaces each
hand-written attention site with one call of
:func:`torch.nn.functional.scaled_dot_product_attention` (SDPA), and the backend runs the
rewritten ``gm.forward``. Graphs from :func:`torch.fx.symbolic_trace` are accepted too.

What is matched (``q``, ``k``, ``v`` are any nodes)::

    scores = q @ k^T                      # torch.matmul / operator.matmul (@) / torch.bmm
    scores = scores * c | c * scores | scores / c      # optional, any number, c > 0 a number
    scores = scores.masked_fill(cond, -inf)            # optional, before or after the scale
        or   scores + mask                              #   (at most one mask)
    p      = softmax(scores, dim=-1)
    p      = dropout(p, p_drop, training)   # optional: F.dropout, torch.dropout, nn.Dropout
    out    = p @ v

* ``k^T``: ``k.transpose(-2, -1)`` (either order, method or ``torch.transpose``, also
  ``swapaxes``/``swapdims``), ``k.mT``, or a ``permute`` that swaps only the last two dims.
  Positive dims are accepted when the rank is known (from ``node.meta["example_value"]``, which
  dynamo records, or ``meta["val"]``); without metadata only ``(-2, -1)``/``(-1, -2)``.
* Scale: ``*``, ``/`` (also in place, ``torch.mul``/``torch.div`` without ``rounding_mode``)
  by a finite Python number ``> 0`` (dynamo turns ``1 / math.sqrt(k.size(-1))`` into one), or by
  a scalar node whose traced value is one (a float attribute such as ``self.scale`` that dynamo
  lifted to a graph input after a recompile arrives as ``tensor.item()``; the product is then
  computed at run time). The factors multiply into SDPA's ``scale``; no scale op gives
  ``scale=1.0``, passed explicitly because SDPA's default is ``1/sqrt(E)``.
* Boolean mask: ``masked_fill(cond, value)`` with ``value`` ``-inf``, ``<= -1e9`` or a float
  type's ``torch.finfo(dtype).min`` (and, when a scale follows it, ``value * later_scale <=
  -1e4``) becomes ``attn_mask=torch.logical_not(cond)``, or ``x`` itself when ``cond`` is
  ``~x`` (a boolean ``x``: ``masked_fill`` takes only boolean conditions) or
  ``torch.logical_not(x)`` of an ``x`` the metadata shows boolean (a number ``x`` is a 0/1 mask
  that SDPA would add to the scores).
* Additive mask: ``scores + mask`` / ``mask + scores`` (a tensor node) becomes
  ``attn_mask=mask`` (``mask * later_scale`` when a scale op follows the add, because SDPA adds
  the mask after scaling). With metadata the mask must have the scores' dtype (a boolean or
  other-dtype mask is left alone: SDPA would read a boolean as a keep-mask, and SDPA refuses a
  float mask of another dtype) and must not broadcast the scores to a larger shape; without
  metadata it is passed as ``mask.type_as(q)``.
* Softmax over the last dim: ``F.softmax``, ``torch.softmax``, ``Tensor.softmax``,
  ``torch.special.softmax`` with ``dim=-1`` (or ``rank - 1`` when the rank is known), or an
  ``nn.Softmax(dim=-1)`` submodule (``call_module``; dynamo inlines it to ``F.softmax``).
* Dropout: ``F.dropout(p, rate, training)`` / ``torch.dropout`` give
  ``dropout_p = rate if training else 0.0`` (``rate`` a number or a lifted scalar node,
  ``training`` a constant, as dynamo specialises it); an ``nn.Dropout`` submodule (``call_module``, as
  ``symbolic_trace`` leaves it) has its rate read at run time from the module's ``p`` and
  ``training``, since that graph does not bake the mode in.

The one-user rule: every intermediate node of the chain (the scores matmul, each scale and mask
op, the softmax, the dropout) must have exactly one user, the next op of the chain; otherwise the
site is left alone — e.g. when the attention weights are also returned to the caller, or a
scaled score matrix is reused. ``k^T`` and the mask may be used elsewhere (they are kept).

Not matched, and why:

* softmax with ``dtype=`` or over another dim, scores cast (``.float()``) before the softmax, two
  masks, a scale by a tensor (SDPA takes a number), a scale ``<= 0`` (it would turn a ``-inf``
  fill into ``+inf``, and SDPA's math path multiplies ``q`` and ``k`` by ``sqrt(scale)``), a fill
  value that does not remove the position (``-100.0``) — SDPA cannot express them exactly;
* ``einsum`` / ``baddbmm`` score products, ``log_softmax``, hand-written ``exp / sum`` softmax;
* with metadata: ``q``, ``k``, ``v`` of different rank, or ``k``/``v`` batch dims that are
  neither ``q``'s nor 1 (the result would take a batch shape other than ``q``'s; ``k``/``v``
  broadcast over ``q``, as in multi-query attention, are accepted: SDPA's math path broadcasts
  them like ``matmul``, its fused kernels decline them).

Semantics followed (PyTorch docs of ``scaled_dot_product_attention``): a boolean ``attn_mask``
marks with ``True`` the positions that take part in attention; a float mask is added to the
scaled scores; ``scale`` defaults to ``1/sqrt(E)``; ``dropout_p`` is applied to the attention
weights. The rewrite is exact up to float rounding except for two cases: a query row whose keys
are all masked by a ``-inf`` fill (the original gives NaN, SDPA zeros; with a finite fill value the
original averages ``v`` uniformly, and the rewrite puts that average in such rows after SDPA,
:func:`_all_masked_rows_averaged`), and the dropout pattern (SDPA draws its own random mask, and
a fully masked row's average is taken without dropout; compare with
``apt_model.compile.overrides.dropout_free``, which the override rung verifies with).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from apt_model.base.log import get_logger

__all__ = ["AttentionSite", "find_textbook_attention", "rewrite_textbook_attention"]

logger = get_logger(__name__)

_MISSING = object()
_SDPA = F.scaled_dot_product_attention

_MATMUL_FUNCS = {torch.matmul, operator.matmul, torch.bmm, torch.Tensor.matmul, torch.Tensor.bmm}
_MATMUL_METHODS = {"matmul", "bmm", "__matmul__"}
_SOFTMAX_FUNCS = {F.softmax, torch.softmax, torch.special.softmax, torch.Tensor.softmax}
_MUL_FUNCS = {operator.mul, operator.imul, torch.mul, torch.multiply, torch.Tensor.mul}
_MUL_METHODS = {"mul", "mul_", "__mul__", "__rmul__", "multiply"}
_DIV_FUNCS = {operator.truediv, operator.itruediv, torch.div, torch.divide, torch.true_divide, torch.Tensor.div}
_DIV_METHODS = {"div", "div_", "true_divide", "__truediv__", "divide"}
_ADD_FUNCS = {operator.add, operator.iadd, torch.add, torch.Tensor.add}
_ADD_METHODS = {"add", "add_", "__add__", "__radd__"}
_MASKED_FILL_FUNCS = {torch.masked_fill, torch.Tensor.masked_fill}
_MASKED_FILL_METHODS = {"masked_fill", "masked_fill_"}
_TRANSPOSE_FUNCS = {torch.transpose, torch.swapaxes, torch.swapdims, torch.Tensor.transpose}
_TRANSPOSE_METHODS = {"transpose", "swapaxes", "swapdims"}
_NOT_FUNCS = {operator.invert, torch.logical_not, torch.bitwise_not}
_NOT_METHODS = {"logical_not", "bitwise_not", "__invert__"}

#: A ``masked_fill`` value at or below this masks a position (besides ``-inf`` and finfo minima).
MASK_FILL_MAX = -1e9
#: After the scales that follow it, a finite fill value must still be at or below this.
MASK_EFFECTIVE_MAX = -1e4
_META_KEPT = ("example_value", "val", "tensor_meta", "stack_trace", "nn_module_stack")
_FINFO_MINS = {torch.finfo(d).min for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


@dataclass(frozen=True)
class AttentionSite:
    """One textbook attention site found (and, by :func:`rewrite_textbook_attention`, rewritten).

    Attributes:
        scores: name of the ``q @ k^T`` matmul node replaced.
        scale: SDPA's ``scale`` (product of the scale factors; 1.0 when there was none; the
            traced value where a factor is a scalar node computed at run time).
        mask: ``"boolean (masked_fill)"``, ``"additive"`` or ``None``.
        dropout_p: SDPA's ``dropout_p`` (the traced value of a scalar rate; for an
            ``nn.Dropout`` submodule its value when matched, the rewritten graph reads it at run
            time).
    """

    scores: str
    scale: float
    mask: str | None
    dropout_p: float


@dataclass
class _Match:
    out: fx.Node
    scores: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    chain: list  # intermediate nodes, scores first, then every op up to the dropout
    kt: fx.Node
    factors: tuple  # ("mul" | "div", number or scalar node), in graph order
    mask_kind: str | None
    mask: fx.Node | None  # the masked_fill condition or the additive mask
    mask_factors: tuple  # the factors applied after an additive mask (SDPA adds it after scaling)
    dropout_p: float  # as reported
    dropout_arg: Any  # SDPA's argument: float, scalar node, or ("module", target)
    mask_fill: float | None = None  # the masked_fill value (boolean masks)

    def site(self) -> AttentionSite:
        return AttentionSite(self.scores.name, _hint_product(self.factors), self.mask_kind, self.dropout_p)


class _NoMatch(Exception):
    """Why a candidate site is not textbook attention (logged at DEBUG)."""


# ---------------------------------------------------------------------------------------------
# node helpers


def _arg(node: fx.Node, index: int, name: str, default: Any = _MISSING) -> Any:
    """Argument ``index`` (``self`` counts as 0 for methods) or keyword ``name`` of ``node``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _is_call(node: Any, funcs: set, methods: set) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return node.target in funcs
    if node.op == "call_method":
        return node.target in methods
    return False


def _example(node: Any) -> torch.Tensor | None:
    """The (fake) tensor recorded for ``node`` by dynamo (``example_value``) or export (``val``)."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("example_value", node.meta.get("val"))
    return val if isinstance(val, torch.Tensor) else None


def _rank(node: Any) -> int | None:
    val = _example(node)
    return val.dim() if val is not None else None


def _same(a: Any, b: Any) -> bool:
    """``a == b`` for sizes that may be symbolic; ``False`` unless statically known."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001 - an undecidable symbolic comparison is "not known equal"
        return False


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _last_dim(dim: Any, rank: int | None) -> bool:
    """``dim`` names the last dim: ``-1``, or ``rank - 1`` when the rank is known."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        return False
    return dim == -1 or (rank is not None and dim == rank - 1)


def _last_two(d0: Any, d1: Any, rank: int | None) -> bool:
    """``(d0, d1)`` are the last two dims in either order."""
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in (d0, d1)):
        return False
    if rank is not None:
        if rank < 2:
            return False
        if not (-rank <= d0 < rank and -rank <= d1 < rank):
            return False
        return {d0 % rank, d1 % rank} == {rank - 2, rank - 1}
    return {d0, d1} == {-2, -1}


def _transposed(node: Any) -> fx.Node | None:
    """``k`` when ``node`` is ``k`` with its last two dims swapped, else ``None``."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function" and node.target is getattr and len(node.args) == 2 and node.args[1] == "mT":
        src = node.args[0]
        return src if isinstance(src, fx.Node) else None
    if _is_call(node, _TRANSPOSE_FUNCS, _TRANSPOSE_METHODS):
        src = _arg(node, 0, "input")
        if node.target in ("swapaxes", torch.swapaxes):
            d0, d1 = _arg(node, 1, "axis0"), _arg(node, 2, "axis1")
        else:
            d0, d1 = _arg(node, 1, "dim0"), _arg(node, 2, "dim1")
        if isinstance(src, fx.Node) and _last_two(d0, d1, _rank(src)):
            return src
        return None
    if _is_call(node, {torch.permute, torch.Tensor.permute}, {"permute"}):
        src = node.args[0] if node.args else node.kwargs.get("input")
        if node.op == "call_method" and len(node.args) > 2:
            dims = list(node.args[1:])
        else:
            dims = _arg(node, 1, "dims")
        if not isinstance(src, fx.Node) or not isinstance(dims, (list, tuple)) or len(dims) < 2:
            return None
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
            return None
        n = len(dims)
        rank = _rank(src)
        if rank is not None and rank != n:
            return None
        norm = [d % n if -n <= d < n else None for d in dims]
        if norm == list(range(n - 2)) + [n - 1, n - 2]:
            return src
    return None


def _matmul_args(node: Any) -> tuple[Any, Any] | None:
    """``(a, b)`` when ``node`` is a plain matrix product ``a @ b``."""
    if not _is_call(node, _MATMUL_FUNCS, _MATMUL_METHODS):
        return None
    if len(node.args) != 2 or node.kwargs:
        return None  # out= or a malformed call
    return node.args[0], node.args[1]


def _only_user(node: fx.Node, user: fx.Node, what: str) -> None:
    if len(node.users) != 1 or user not in node.users:
        raise _NoMatch(f"{what} {node.name!r} has {len(node.users)} users (one-user rule)")


# ---------------------------------------------------------------------------------------------
# matching


def _softmax_of(node: Any, gm: fx.GraphModule) -> fx.Node | None:
    """The input of ``node`` when it is a softmax over the last dim without ``dtype``; raises
    :class:`_NoMatch` for a softmax of another form; ``None`` when not a softmax at all."""
    if isinstance(node, fx.Node) and node.op == "call_module":  # nn.Softmax left by symbolic_trace
        try:
            mod = gm.get_submodule(node.target)
        except AttributeError:
            return None
        if type(mod) is not nn.Softmax or len(node.args) != 1 or node.kwargs:
            return None
        src, dim = node.args[0], mod.dim
        if not isinstance(src, fx.Node) or not _last_dim(dim, _rank(src)):
            raise _NoMatch(f"softmax {node.name!r} is over dim={dim}, not the last")
        return src
    if not _is_call(node, _SOFTMAX_FUNCS, {"softmax"}):
        return None
    src = _arg(node, 0, "input")
    dim = _arg(node, 1, "dim", None)
    if node.op == "call_function" and node.target is F.softmax:
        dtype = _arg(node, 3, "dtype", None)
    else:
        dtype = _arg(node, 2, "dtype", None)
    if dtype is not None:
        raise _NoMatch(f"softmax {node.name!r} has dtype={dtype}")
    if not isinstance(src, fx.Node):
        raise _NoMatch(f"softmax {node.name!r} of a non-node")
    rank = _rank(src)
    if not _last_dim(dim, rank):
        raise _NoMatch(f"softmax {node.name!r} is over dim={dim}, not the last (rank {rank})")
    return src


def _scalar_hint(node: Any) -> float | None:
    """The traced value of a scalar node (a float module attribute that dynamo made a graph input
    after a recompile reaches the graph as ``tensor.item()``, a ``SymFloat``); ``None`` if unknown."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("example_value", node.meta.get("val"))
    if _number(val):
        return float(val)
    if isinstance(val, (torch.SymFloat, torch.SymInt)):
        hint = getattr(val.node, "hint", None)
        return float(hint) if _number(hint) else None
    return None


def _dropout_of(node: fx.Node, gm: fx.GraphModule) -> tuple[fx.Node, float, Any] | None:
    """``(input, reported dropout_p, SDPA's dropout_p argument)`` when ``node`` is a dropout the
    rewrite understands. The argument is a float, a scalar node, or ``("module", target)`` for an
    ``nn.Dropout`` submodule whose rate is read at run time."""
    if node.op == "call_function" and node.target is F.dropout:
        src, p = _arg(node, 0, "input"), _arg(node, 1, "p", 0.5)
        training = _arg(node, 2, "training", True)
    elif node.op == "call_function" and node.target in (torch.dropout, torch.dropout_):
        src, p, training = _arg(node, 0, "input"), _arg(node, 1, "p"), _arg(node, 2, "train")
    elif node.op == "call_module":
        try:
            mod = gm.get_submodule(node.target)
        except AttributeError:
            return None
        if not isinstance(mod, nn.Dropout) or type(mod).forward is not nn.Dropout.forward:
            return None
        if len(node.args) != 1 or node.kwargs:
            return None
        return node.args[0], (float(mod.p) if mod.training else 0.0), ("module", node.target)
    else:
        return None
    if not isinstance(src, fx.Node) or not isinstance(training, bool):
        raise _NoMatch(f"dropout {node.name!r} has a mode that is not a constant")
    if _number(p):
        return src, (float(p) if training else 0.0), (float(p) if training else 0.0)
    hint = _scalar_hint(p)
    if hint is None or not 0.0 <= hint <= 1.0:
        raise _NoMatch(f"dropout {node.name!r} has a rate that is neither a number nor a scalar")
    return src, (hint if training else 0.0), (p if training else 0.0)


def _factor(node: fx.Node, op: str, value: Any) -> tuple[str, Any]:
    """A scale factor ``(op, value)``: ``op`` ``"mul"`` or ``"div"``, ``value`` a finite number
    > 0 or a scalar node whose traced value is one."""
    hint = float(value) if _number(value) else _scalar_hint(value)
    if hint is None:
        raise _NoMatch(f"scale {node.name!r} is by a tensor, SDPA takes a number")
    if not (math.isfinite(hint) and hint > 0):
        raise _NoMatch(f"scale {node.name!r} factor {hint} is not a finite number > 0")
    return op, (float(value) if _number(value) else value)


def _scale_factor(node: fx.Node) -> tuple[fx.Node, tuple[str, Any]] | None:
    """``(scores, factor)`` when ``node`` multiplies or divides a tensor node by a number."""
    if _is_call(node, _MUL_FUNCS, _MUL_METHODS):
        if len(node.args) != 2 or node.kwargs:
            return None
        a, b = node.args
        if not isinstance(a, fx.Node) and not isinstance(b, fx.Node):
            return None
        if isinstance(a, fx.Node) and isinstance(b, fx.Node):  # which one is the scalar?
            if _scalar_hint(b) is not None:
                return a, _factor(node, "mul", b)
            if _scalar_hint(a) is not None:
                return b, _factor(node, "mul", a)
            raise _NoMatch(f"scale {node.name!r} is by a tensor, SDPA takes a number")
        if isinstance(a, fx.Node):
            return a, _factor(node, "mul", b)
        return b, _factor(node, "mul", a)
    if _is_call(node, _DIV_FUNCS, _DIV_METHODS):
        if len(node.args) != 2 or node.kwargs:
            return None  # rounding_mode=..., out=...
        a, b = node.args
        if isinstance(a, fx.Node):
            return a, _factor(node, "div", b)
    return None


def _hint_product(factors: tuple) -> float:
    out = 1.0
    for op, value in factors:
        hint = float(value) if _number(value) else _scalar_hint(value)
        out = out * hint if op == "mul" else out / hint
    return out


def _additive_operands(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    if not _is_call(node, _ADD_FUNCS, _ADD_METHODS):
        return None
    alpha = node.kwargs.get("alpha", 1)
    if len(node.args) != 2 or set(node.kwargs) - {"alpha"} or alpha != 1:
        return None
    a, b = node.args
    if isinstance(a, fx.Node) and isinstance(b, fx.Node):
        return a, b
    return None


def _fill_masks(value: Any, later_scale: float) -> bool:
    """A ``masked_fill`` value that removes the position from the softmax."""
    if not _number(value):
        return False
    value = float(value)
    if value == -math.inf:
        return True
    if not (value <= MASK_FILL_MAX or value in _FINFO_MINS) or value >= 0:
        return False
    return value * later_scale <= MASK_EFFECTIVE_MAX


def _walk_scores(node: Any, user: fx.Node, later: tuple, mask: tuple | None, chain: list,
                 ) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node, tuple, tuple | None, list]:
    """Walk back from the softmax input to the scores matmul through scale and mask ops.

    ``later`` holds the scale factors met so far (those applied after ``node``). Returns
    ``(scores, q, k, k^T, factors, mask, chain)``; ``mask`` is ``(kind, node, factors after
    it)``. Raises :class:`_NoMatch`.
    """
    if not isinstance(node, fx.Node):
        raise _NoMatch("softmax input is not a node")
    _only_user(node, user, "node")
    mm = _matmul_args(node)
    if mm is not None:
        q, kt = mm
        k = _transposed(kt)
        if isinstance(q, fx.Node) and k is not None:
            return node, q, k, kt, later, mask, [node, *chain]
        raise _NoMatch(f"matmul {node.name!r} is not q @ k^T over the last two dims")
    scaled = _scale_factor(node)
    if scaled is not None:
        src, factor = scaled
        return _walk_scores(src, node, (factor, *later), mask, [node, *chain])
    if _is_call(node, _MASKED_FILL_FUNCS, _MASKED_FILL_METHODS):
        src, cond, value = _arg(node, 0, "input"), _arg(node, 1, "mask"), _arg(node, 2, "value")
        if mask is not None:
            raise _NoMatch(f"second mask {node.name!r}: SDPA takes one")
        if not isinstance(cond, fx.Node) or not _fill_masks(value, _hint_product(later)):
            raise _NoMatch(f"masked_fill {node.name!r} with value {value!r} does not remove positions")
        cond_val = _example(cond)
        if cond_val is not None and cond_val.dtype != torch.bool:
            raise _NoMatch(f"masked_fill {node.name!r} condition is {cond_val.dtype}, not bool")
        return _walk_scores(src, node, later, ("boolean (masked_fill)", cond, (), float(value)), [node, *chain])
    operands = _additive_operands(node)
    if operands is not None:
        if mask is not None:
            raise _NoMatch(f"second mask {node.name!r}: SDPA takes one")
        reasons = []
        for chain_side, other in (operands, operands[::-1]):
            try:
                found = _walk_scores(chain_side, node, later, ("additive", other, later), [node, *chain])
            except _NoMatch as err:
                reasons.append(str(err))
                continue
            _check_additive(node, other, found[0])
            return found
        raise _NoMatch(f"add {node.name!r}: neither operand leads to q @ k^T ({'; '.join(reasons)})")
    raise _NoMatch(f"{node.name!r} ({node.op} {getattr(node.target, '__name__', node.target)}) "
                   "is not a scale, mask or q @ k^T")


def _check_additive(add: fx.Node, mask: fx.Node, scores: fx.Node) -> None:
    mask_val, scores_val, add_val = _example(mask), _example(scores), _example(add)
    if mask_val is not None and scores_val is not None:
        if mask_val.dtype != scores_val.dtype:
            raise _NoMatch(f"additive mask {mask.name!r} is {mask_val.dtype}, scores are {scores_val.dtype}")
    if add_val is not None and scores_val is not None:
        if add_val.dim() != scores_val.dim() or not all(_same(a, b) for a, b in zip(add_val.shape, scores_val.shape)):
            raise _NoMatch(f"additive mask {mask.name!r} broadcasts the scores to a larger shape")


def _check_shapes(q: fx.Node, k: fx.Node, v: fx.Node) -> None:
    qv, kv, vv = _example(q), _example(k), _example(v)
    if qv is None or kv is None or vv is None:
        return
    if not (qv.dim() == kv.dim() == vv.dim()) or qv.dim() < 2:
        raise _NoMatch(f"q, k, v ranks {qv.dim()}, {kv.dim()}, {vv.dim()} differ or are below 2")
    for name, t in (("k", kv), ("v", vv)):
        for a, b in zip(qv.shape[:-2], t.shape[:-2]):
            if not (_same(a, b) or _same(b, 1)):
                raise _NoMatch(f"{name} batch dims {tuple(t.shape[:-2])} do not broadcast over q's "
                               f"{tuple(qv.shape[:-2])}")
    if not (qv.is_floating_point() and qv.dtype == kv.dtype == vv.dtype):
        raise _NoMatch(f"q, k, v dtypes {qv.dtype}, {kv.dtype}, {vv.dtype}")


def _match(out: fx.Node, gm: fx.GraphModule) -> _Match | None:
    """The attention site ending at ``out`` (``p @ v``), or ``None``; logs why a site that
    reaches a softmax is rejected."""
    mm = _matmul_args(out)
    if mm is None or out.op not in ("call_function", "call_method"):
        return None
    probs, v = mm
    if not isinstance(probs, fx.Node) or not isinstance(v, fx.Node):
        return None
    try:
        chain_tail: list[fx.Node] = []
        dropout_p, dropout_arg = 0.0, 0.0
        soft = probs
        dropped = _dropout_of(probs, gm)
        if dropped is not None:
            _only_user(probs, out, "dropout")
            soft, dropout_p, dropout_arg = dropped
            chain_tail.append(probs)
            if not isinstance(soft, fx.Node):
                return None
            src = _softmax_of(soft, gm)
            if src is None:
                return None
            _only_user(soft, probs, "softmax")
        else:
            src = _softmax_of(soft, gm)
            if src is None:
                return None
            _only_user(soft, out, "softmax")
        chain_tail.insert(0, soft)
        scores, q, k, kt, factors, mask, chain = _walk_scores(src, soft, (), None, chain_tail)
        _check_shapes(q, k, v)
    except _NoMatch as err:
        logger.debug("not textbook attention at %s: %s", out.name, err)
        return None
    mask_kind, mask_node, mask_factors, *fill = mask if mask is not None else (None, None, ())
    return _Match(out=out, scores=scores, q=q, k=k, v=v, chain=chain, kt=kt, factors=factors,
                  mask_kind=mask_kind, mask=mask_node, mask_factors=mask_factors,
                  dropout_p=dropout_p, dropout_arg=dropout_arg, mask_fill=fill[0] if fill else None)


def _check_gm(gm: Any) -> None:
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"expected a torch.fx.GraphModule, got {type(gm).__name__}")


# ---------------------------------------------------------------------------------------------
# public API


def find_textbook_attention(gm: fx.GraphModule) -> list[AttentionSite]:
    """The textbook attention sites of ``gm``, in graph order; the graph is not changed.

    Args:
        gm: a graph captured by TorchDynamo (torch-function level) or ``torch.fx.symbolic_trace``.
            Any tensor shapes (``q``: ``(..., L, E)``, ``k``: ``(..., S, E)``, ``v``:
            ``(..., S, Ev)``) and floating dtypes; ranks, dims and dtypes are checked from
            ``node.meta["example_value"]`` where present.

    Returns:
        One :class:`AttentionSite` per site that :func:`rewrite_textbook_attention` would rewrite.

    Raises:
        TypeError: when ``gm`` is not a ``torch.fx.GraphModule``.
    """
    _check_gm(gm)
    sites = []
    for node in gm.graph.nodes:
        m = _match(node, gm)
        if m is not None:
            sites.append(m.site())
    return sites


def _module_dropout_p(module: nn.Module) -> float:
    """The dropout rate an ``nn.Dropout`` applies now (0.0 in eval mode); called by rewritten
    ``symbolic_trace`` graphs, where the mode is read at run time."""
    return float(module.p) if module.training else 0.0


def _emit_scale(graph: fx.Graph, factors: tuple) -> Any:
    """The product of ``factors``: a float, or (with scalar nodes among them) a node computing it
    at run time."""
    const, expr = 1.0, None
    for op, value in factors:
        if isinstance(value, fx.Node):
            if op == "mul":
                expr = value if expr is None else graph.call_function(operator.mul, (expr, value))
            else:
                expr = graph.call_function(operator.truediv, (1.0 if expr is None else expr, value))
        else:
            const = const * value if op == "mul" else const / value
    if expr is None:
        return const
    return expr if const == 1.0 else graph.call_function(operator.mul, (expr, const))


def _rewrite(gm: fx.GraphModule, m: _Match) -> tuple[set, set]:
    """Insert the SDPA call for ``m`` before its ``out`` node, reroute ``out``'s users, erase
    ``out`` and the chain; return the erased nodes and those that may now be dead (``k^T``, the
    mask, the chain's other inputs)."""
    graph = gm.graph
    with graph.inserting_before(m.out):
        attn_mask = None
        if m.mask_kind == "boolean (masked_fill)":
            cond = m.mask
            if _is_call(cond, _NOT_FUNCS, _NOT_METHODS) and len(cond.args) == 1 and not cond.kwargs \
                    and isinstance(cond.args[0], fx.Node):
                inner_val = _example(cond.args[0])
                # masked_fill(~keep) -> attn_mask=keep, for a boolean keep only: SDPA would add a
                # number keep to the scores. ~ and bitwise_not give a boolean condition (which
                # masked_fill requires) only of a boolean; logical_not of a number tensor is
                # "== 0", so without metadata (symbolic_trace) its input may be a number mask
                bitwise = cond.target in (operator.invert, torch.bitwise_not, "bitwise_not", "__invert__")
                if (inner_val.dtype == torch.bool) if inner_val is not None else bitwise:
                    attn_mask = cond.args[0]
            if attn_mask is None:
                attn_mask = graph.call_function(torch.logical_not, (cond,))
                attn_mask.meta.update({k: v for k, v in cond.meta.items() if k in ("example_value", "val")})
        elif m.mask_kind == "additive":
            attn_mask = m.mask
            if _example(m.mask) is None:
                attn_mask = graph.call_method("type_as", (attn_mask, m.q))
            if m.mask_factors:
                factor = _emit_scale(graph, m.mask_factors)
                attn_mask = graph.call_function(operator.mul, (attn_mask, factor))
                if _example(m.mask) is not None:
                    attn_mask.meta["example_value"] = _example(m.mask)
        dropout_p = m.dropout_arg
        if isinstance(dropout_p, tuple):
            module_node = graph.get_attr(dropout_p[1])
            dropout_p = graph.call_function(_module_dropout_p, (module_node,))
        sdpa = graph.call_function(_SDPA, (m.q, m.k, m.v), {"attn_mask": attn_mask, "dropout_p": dropout_p,
                                                             "scale": _emit_scale(graph, m.factors)})
        sdpa.meta.update({key: val for key, val in m.out.meta.items() if key in _META_KEPT})
        result = sdpa
        if m.mask_fill is not None and math.isfinite(m.mask_fill):
            # a query row whose keys are all masked: a finite fill makes its scores all equal, so the
            # original averages v uniformly; SDPA gives zeros there (found by a probe, 2026-11-27)
            result = graph.call_function(_all_masked_rows_averaged, (sdpa, attn_mask, m.v))
            result.meta.update({key: val for key, val in m.out.meta.items() if key in _META_KEPT})
    m.out.replace_all_uses_with(result)
    inputs = {arg for node in m.chain for arg in node.all_input_nodes}
    erased = [m.out, *reversed(m.chain)]  # each has one user, the node erased before it
    for node in erased:
        graph.erase_node(node)
    return set(erased), ({m.kt, m.mask} | inputs) - {None} - set(erased)


def _all_masked_rows_averaged(out: torch.Tensor, keep: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA's output ``out`` (``(..., L, Ev)``) with each query row that ``keep`` (boolean,
    broadcastable to ``(..., L, S)``, True = takes part) masks entirely replaced by the mean of
    ``v`` (``(..., S, Ev)``) over its keys: what softmax over equal scores (a finite
    ``masked_fill`` value everywhere in the row) followed by ``@ v`` computes, up to rounding."""
    none_kept = torch.logical_not(keep.any(-1, keepdim=True))
    return torch.where(none_kept, v.mean(-2, keepdim=True).to(out.dtype), out)


def _removable(node: fx.Node, maybe_dead: set) -> bool:
    """Whether dead-code elimination may erase ``node``: only the rewritten sites' ``k^T``, masks
    and other chain inputs (such as a dropout rate's ``.item()``), and not when in-place or impure;
    the rest of the user's graph is kept as it was (``Node.is_impure`` calls every
    ``call_method`` pure, so a plain ``eliminate_dead_code()`` would drop an unused ``x.add_(1)``)."""
    if node not in maybe_dead or node.op not in ("call_function", "call_method", "get_attr"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return not name.endswith("_") and not node.is_impure()


def rewrite_textbook_attention(gm: fx.GraphModule) -> list[AttentionSite]:
    """Replace every textbook attention site of ``gm`` with SDPA, in place.

    Each site's ``p @ v`` node is replaced by one ``call_function`` node
    ``torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=..., dropout_p=...,
    scale=...)`` (plus ``torch.logical_not(cond)`` for a ``masked_fill`` mask); the site's chain
    is erased, and so are ``k^T`` and the chain's other inputs where they are left without users
    (only those: other dead nodes of the user's graph, such as in-place ops whose result is unused,
    are kept), then the graph is linted and recompiled.
    Shapes and dtypes are those of the original site: output ``(..., L, Ev)`` in ``q``'s dtype.

    Args:
        gm: as for :func:`find_textbook_attention`.

    Returns:
        The sites rewritten, in graph order (empty: ``gm`` is untouched, not even recompiled).

    Raises:
        TypeError: when ``gm`` is not a ``torch.fx.GraphModule``.
        RuntimeError: from ``Graph.lint`` if the rewritten graph were malformed (a bug here).
    """
    _check_gm(gm)
    graph = gm.graph
    sites: list[AttentionSite] = []
    maybe_dead: set = set()
    erased: set = set()
    for node in list(graph.nodes):  # later sites see the SDPA nodes of earlier ones as inputs
        if node in erased:
            continue
        m = _match(node, gm)
        if m is None:
            continue
        sites.append(m.site())
        gone, maybe = _rewrite(gm, m)
        erased |= gone
        maybe_dead = (maybe_dead | maybe) - erased
        logger.debug("rewrote attention: %s", sites[-1])
    if not sites:
        return sites
    graph.eliminate_dead_code(is_impure_node=lambda n: not _removable(n, maybe_dead))
    graph.lint()
    gm.recompile()
    logger.info("textbook attention -> SDPA at %d site(s): %s", len(sites), ", ".join(s.scores for s in sites))
    return sites

