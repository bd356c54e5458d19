"""What a model's forward returned: its tensors, and the same output with fp16/bf16 tensors made fp32.

A forward may return a tensor, tuples, lists and dicts of them (``torch.utils._pytree``), a
``Mapping`` such as Hugging Face's ``ModelOutput`` (accelerate's ``convert_to_fp32`` keeps its
type), or a plain ``@dataclass`` instance, which neither library walks: the switch's trials (the
tensors a backward will reach) and autocast's fp32 outputs missed its fields until 2026-11-26
(the autocast trial never decided; ``out.logits`` came back bf16).
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import types
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

#: Dataclasses nested deeper than this are not walked (a cycle through fields, or data, not outputs).
MAX_DEPTH = 8


def _plain_dataclass(x: Any) -> bool:
    """A dataclass instance that is not a ``Mapping`` (those are walked as mappings)."""
    return dataclasses.is_dataclass(x) and not isinstance(x, type) and not isinstance(x, Mapping)


def output_tensors(output: Any, _depth: int = 0) -> list[torch.Tensor]:
    """Every tensor in ``output`` (pytree containers, and the fields of dataclass instances among
    them), in order. Never raises on an unknown object: it is not a tensor, so it is skipped."""
    found: list[torch.Tensor] = []
    for leaf in tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif isinstance(leaf, torch.distributions.Distribution) and _depth < MAX_DEPTH:  # a policy's Categorical
            for v in vars(leaf).values():
                if isinstance(v, torch.Tensor):
                    found.append(v)
                elif isinstance(v, torch.distributions.Distribution):  # Independent's base_dist...
                    found.extend(output_tensors(v, _depth + 1))
        elif _plain_dataclass(leaf) and _depth < MAX_DEPTH:
            for f in dataclasses.fields(leaf):
                found.extend(output_tensors(getattr(leaf, f.name, None), _depth + 1))
    return found


def to_fp32(output: Any, _depth: int = 0) -> Any:
    """``output`` with its fp16/bf16 floating tensors converted to fp32: accelerate's
    ``convert_to_fp32`` (tensors, sequences, mappings, named tuples), then every container
    ``torch.utils._pytree`` walks (``deque``, ``defaultdict``...), the fields of dataclass instances
    and the attributes of a ``types.SimpleNamespace``, the parameters of a ``torch.distributions``
    distribution, and the items of a mapping neither library walks — each in a shallow copy (the model's own object is not modified; a frozen dataclass too).

    Where accelerate cannot rebuild a mapping (it calls ``type(m)(dict)``: a ``defaultdict`` or a
    mapping class whose ``__init__`` takes other arguments raised ``TypeError`` until 2026-11-27),
    the walk above does it alone; ``deque`` and ``SimpleNamespace`` outputs came back in bf16."""
    from accelerate.utils.operations import convert_to_fp32

    cached = _transform_caches(output) if _depth == 0 else set()

    def leaf(x):
        if isinstance(x, torch.Tensor):
            return x.float() if _half(x) and id(x) not in cached else x
        if _depth >= MAX_DEPTH:
            return x
        if isinstance(x, torch.distributions.Distribution):
            # a policy network's Categorical(logits=...) / Normal(loc, scale): its parameters (and
            # the values it cached from them) in fp32, in a copy, so log_prob and entropy are fp32
            # as without autocast (they came back bf16: a probe's finding)
            # nested distributions too: Independent's base_dist, TransformedDistribution's (SAC's
            # tanh-squashed Normal), MixtureSameFamily's two (a review probe's finding)
            if not any(_half(t) for t in output_tensors(x)):
                return x
            new = copy.copy(x)
            for k, v in vars(x).items():
                if isinstance(v, torch.Tensor) and _half(v):
                    new.__dict__[k] = v.float()
                elif isinstance(v, torch.distributions.Distribution):
                    new.__dict__[k] = to_fp32(v, _depth + 1)
            return new
        if _plain_dataclass(x):
            new = copy.copy(x)
            for f in dataclasses.fields(x):
                if hasattr(x, f.name):
                    object.__setattr__(new, f.name, to_fp32(getattr(x, f.name), _depth + 1))
            return new
        if isinstance(x, types.SimpleNamespace):
            return types.SimpleNamespace(**{k: to_fp32(v, _depth + 1) for k, v in vars(x).items()})
        if isinstance(x, MutableMapping):  # a mapping type the pytree does not know
            if not any(_half(t) for t in output_tensors(list(x.values()))):
                return x  # nothing to convert (accelerate rebuilt it already): its methods are not called again
            try:
                if isinstance(x, dict):  # a copy made without the class's methods (a read-only
                    return _dict_copy(x, lambda v: to_fp32(v, _depth + 1))  # __setitem__ raised)
                new = copy.copy(x)
                for k in list(new.keys()):
                    new[k] = to_fp32(x[k], _depth + 1)
                return new
            except Exception:  # noqa: BLE001 - a mapping that cannot be copied: returned as the model made it
                return x
        return x

    if cached or any(_attributed_dict(x) for x in tree_leaves(output, is_leaf=_attributed_dict)):
        # accelerate would rebuild it with type(m)(dict), dropping its attributes; or it would convert
        # a tensor a returned distribution's transform caches (see _transform_caches)
        converted = output
    else:
        try:
            converted = convert_to_fp32(output)
        except TypeError:
            converted = output  # a mapping accelerate cannot rebuild: the walk below converts it
    return tree_map(leaf, converted, is_leaf=_attributed_dict)  # the leaf copies those itself


def _transform_caches(output: Any) -> set[int]:
    """``id``s of the tensors the transforms of a returned distribution cache (``TanhTransform(
    cache_size=1)``: a SAC policy returns ``(action, dist)`` with ``action = dist.rsample()``).
    They are left as they are: ``dist.log_prob(action)`` finds the action in the cache by identity;
    an fp32 copy missed it and computed ``atanh`` of a bf16-rounded 1.0, infinite, and the policy
    trained to NaN (a review probe's finding)."""
    ids: set[int] = set()
    todo = [x for x in tree_leaves(output) if isinstance(x, torch.distributions.Distribution)]
    while todo:
        d = todo.pop()
        for t in getattr(d, "transforms", None) or ():
            for parts in (getattr(t, "parts", None) or (t,)):  # a ComposeTransform's parts
                for cached in getattr(parts, "_cached_x_y", ()) or ():
                    if isinstance(cached, torch.Tensor):
                        ids.add(id(cached))
        todo.extend(v for v in vars(d).values() if isinstance(v, torch.distributions.Distribution))
    return ids


def _slots(cls: type) -> list[str]:
    names = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        for name in ((slots,) if isinstance(slots, str) else slots):
            if name not in ("__dict__", "__weakref__") and name not in names:
                names.append(name)
    return names


def _dict_copy(x: dict, convert) -> dict:
    """A copy of the dict-subclass instance ``x`` with ``convert`` applied to its values, made
    without running the class's own methods (its ``__init__``, ``__setitem__``, ``__setattr__``):
    its ``__dict__`` and slot attributes, a ``defaultdict``'s ``default_factory``, and its items
    through the base container's ``__setitem__`` in their order (an ``OrderedDict``'s keeps its
    links: ``dict.update`` left its ``keys()`` empty: a review probe's finding). ``convert`` is
    applied to the values of ``__dict__`` too (a ``ModelOutput``'s fields are attributes and
    items), once per object: a value held as an attribute and an item stays one object.

    Raises:
        Exception: whatever the class's ``__new__`` raises.
    """
    done: dict[int, Any] = {}

    def once(v):
        if id(v) not in done:
            done[id(v)] = convert(v)
        return done[id(v)]

    cls = type(x)
    new = cls.__new__(cls)
    if isinstance(x, collections.defaultdict):
        collections.defaultdict.default_factory.__set__(new, x.default_factory)
    if hasattr(x, "__dict__"):
        vars(new).update({k: once(v) for k, v in vars(x).items()})
    for name in _slots(cls):
        try:
            object.__setattr__(new, name, getattr(x, name))
        except AttributeError:  # an empty slot
            pass
    base = collections.OrderedDict if isinstance(x, collections.OrderedDict) else dict
    for k, v in base.items(x):
        base.__setitem__(new, k, once(v))
    return new


def _half(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float16, torch.bfloat16)


def _attributed_dict(x: Any) -> bool:
    """A ``dict`` subclass instance with attributes of its own: accelerate's ``type(m)(dict)``
    rebuild, and the pytree's for a registered class such as Hugging Face's ``ModelOutput``, drop
    them (``out.temperature`` raised AttributeError under autocast: a probe's finding). For a
    dataclass (``ModelOutput``, whose constructor sets its fields as attributes) only attributes
    that are not fields count (an ``out.extra`` the model set: lost until 2026-11-28)."""
    if not isinstance(x, dict) or type(x) in (dict, collections.OrderedDict, collections.defaultdict):
        return False
    own = getattr(x, "__dict__", None)
    if dataclasses.is_dataclass(x):
        fields = {f.name for f in dataclasses.fields(x)}
        return any(name not in fields for name in (own or ()))
    return bool(own) or any(hasattr(x, name) for name in _slots(type(x)))


def gradient_watch(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` plus the base of each one that is an autograd view, for a hook that must see
    the first gradient reaching them (``register_multi_grad_hook(..., mode="any")``).

    An in-place op on a view (``h = linear(x3d); h.relu_()``) rebases its history onto its base:
    a hook on the view itself then never fires, while the base's still does, just before the
    node that produced it runs. Adding bases can only make an "any" hook fire earlier, never later.
    """
    found = list(tensors)
    seen = {id(t) for t in found}
    for t in tensors:
        base = t._base if t._is_view() else None
        if base is not None and base.requires_grad and id(base) not in seen:
            seen.add(id(base))
            found.append(base)
    return found
