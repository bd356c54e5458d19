"""Activation checkpointing without editing the model: ``torch.utils.checkpoint`` per block.

Blocks are found, not declared: the repeated layers of a transformer are the children of the
``nn.ModuleList`` (or ``nn.Sequential``) with at least two children of one class that holds the
most parameters (``GPT.blocks``, Hugging Face ``transformer.h`` / ``model.layers`` ...).

* Hugging Face models whose layers are ``GradientCheckpointingLayer`` (transformers >= 4.52) are
  switched with the library's own ``activation_checkpointing_enable`` (``use_reentrant=False``,
  ``every_n_layers``), which also turns the KV cache off inside checkpointed layers; older ones with
  ``gradient_checkpointing_enable``. ``disable()`` calls the matching ``..._disable``.
* Any other model's chosen blocks get an instance-level ``forward`` that runs the class's forward
  through ``torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)`` when
  the block is training with grad enabled (plain forward otherwise). Non-reentrant checkpointing
  stashes and restores torch's RNG state, so dropout draws the same masks in the recomputation and
  gradients are bit-identical to the uncheckpointed run. The recomputation must see what the
  forward saw in three more ways (:class:`Replay`): Python's ``random`` and NumPy's global
  generators and the ``torch.Generator`` objects the block holds are put back as they were when
  its forward began (a LayerDrop decision, a NumPy mask); so are the buffers the forward changes
  in place (running statistics, an EMA, a counter tensor), given back their values afterwards;
  and a block that modifies its input in place (``x.mul_(0.5)``, which
  plain PyTorch allows) is recomputed from a copy of the input as it was (learned at its first
  call, which copies the inputs once).

What cannot be replayed: Python side effects of the forward itself run again in the
recomputation (a Python counter incremented in ``forward``). The **script's hooks** on layers
inside a block (forward, forward pre-, backward hooks, and the global module hooks) would run a
second time too — a forward hook that records an activation recorded two per step, and one that
calls ``retain_grad()`` on it saw ``.grad`` stay None (a probe's finding, 2026-11-28) — so a block
holding such hooks runs uncheckpointed for as long as it holds them (looked at each call, cheaply:
the hook dictionaries' sizes; hooks on the block itself run around the checkpoint and do not
count). ``activation_checkpointing=False`` turns checkpointing off.

Policies: ``all`` blocks; ``every:K`` (blocks 0, K, 2K, ...); ``budget`` — the first training
forward runs unchanged while the bytes each block saves for backward are counted (saved-tensor
hooks), then the fewest blocks whose recomputation brings the total under the activation budget
are checkpointed from the next step on.
"""
from __future__ import annotations

import contextlib
import functools
import random
import re
import inspect
import operator
import sys
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.modules.module as module_mod
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from apt_model.base import functional_call
from apt_model.base.errors import ConfigError
from apt_model.base.forward_scope import in_enclosing_checkpoint
from apt_model.base.log import get_logger
from apt_model.base.module_attrs import has_module_attr, module_attr
from apt_model.base.module_hooks import GLOBAL_HOOK_DICTS, HOOK_DICTS, script_hooks
from apt_model.base.patches import SessionHook

log = get_logger(__name__)

_EVERY = re.compile(r"^every:(\d+)$")


def parse_policy(policy: str) -> tuple[str, int]:
    """``"all"`` -> ("all", 1); ``"every:3"`` -> ("every", 3); ``"budget"`` -> ("budget", 0).

    Raises:
        ConfigError: for anything else (naming the valid forms).
    """
    p = str(policy).strip().lower()
    if p in ("all", "budget"):
        return p, 1 if p == "all" else 0
    m = _EVERY.match(p)
    if m and int(m.group(1)) >= 1:
        return "every", int(m.group(1))
    raise ConfigError(f"checkpoint_policy={policy!r} is not valid; use 'all', 'every:K' (K >= 1) or 'budget'")


@dataclass
class Blocks:
    """The repeated layers of a model."""

    name: str
    modules: list = field(default_factory=list)

    @property
    def kind(self) -> str:
        return type(self.modules[0]).__name__ if self.modules else "-"


def _block_lists(model: nn.Module) -> list[tuple[Blocks, int]]:
    """Every ``nn.ModuleList``/``Sequential`` of ``model`` with >= 2 children of one class, as
    ``(Blocks, parameter count)``, in module order."""
    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        kids = list(mod.children())
        if len(kids) < 2:
            continue
        cls, count = Counter(type(k) for k in kids).most_common(1)[0]
        if count < 2:
            continue
        layers = [k for k in kids if type(k) is cls]
        out.append((Blocks(name, layers), sum(p.numel() for k in layers for p in k.parameters())))
    return out


def find_blocks(model: nn.Module) -> Blocks | None:
    """The repeated blocks (see the module docstring), or None when the model has none."""
    best, best_params = None, 0
    for blocks, n in _block_lists(model):
        if n > best_params:
            best, best_params = blocks, n
    return best


def other_block_lists(model: nn.Module, chosen: Blocks) -> list[str]:
    """The other lists of repeated blocks (modules with submodules and parameters), outside
    ``chosen`` and not holding it (an encoder-decoder's encoder layers where its decoder layers were
    chosen), as ``"name (n Class)"``: only ``chosen`` is checkpointed in this version."""
    inside = lambda a, b: a == b or (b and a.startswith(b + ".")) or not b  # noqa: E731 - a in b's subtree
    return [f"{b.name} ({len(b.modules)} {b.kind})" for b, n in _block_lists(model)
            if n and not inside(b.name, chosen.name) and not inside(chosen.name, b.name)
            and any(next(m.children(), None) is not None for m in b.modules)]  # single layers: nothing to gain


def shared_layer_list(model: nn.Module) -> str | None:
    """The name of an ``nn.ModuleList``/``Sequential`` whose >= 2 entries are all one module
    instance (a layer shared across depth, ALBERT-style), or None. :func:`find_blocks` does not
    count those as repeated blocks (``children()`` yields the instance once)."""
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)):
            entries = [m for m in mod._modules.values() if m is not None]
            if len(entries) >= 2 and len({id(m) for m in entries}) == 1:
                return name or "the model"
    return None


def _hf_checkpointing(model: nn.Module) -> nn.Module | None:
    """The Hugging Face model that can switch checkpointing itself, or None."""
    for mod in model.modules():
        if module_attr(mod, "supports_gradient_checkpointing", False) and (
            has_module_attr(mod, "activation_checkpointing_enable") or has_module_attr(mod, "gradient_checkpointing_enable")):
            return mod
    return None


def running_stats_layers(module: nn.Module) -> list[nn.Module]:
    """The layers in ``module`` whose training forward updates running statistics in place: batch
    norm and instance norm with ``track_running_stats`` (buffers ``running_mean`` /
    ``running_var`` / ``num_batches_tracked``, by name, so third-party layers that follow the
    convention count too)."""
    return [m for m in module.modules()
            if module_attr(m, "running_mean") is not None and module_attr(m, "num_batches_tracked") is not None]


def _shared_inputs(fn: Callable, args: tuple, kwargs: dict) -> tuple[Callable, list[torch.Tensor]]:
    """``(run, unique)``: ``run(*unique)`` calls ``fn(*args, **kwargs)`` with each tensor passed
    directly replaced by its entry in ``unique``, which holds each distinct tensor once.

    ``torch.utils.checkpoint`` saves its inputs one by one, and under saved-tensor hooks (activation
    offload) each comes back from the hook as a new object: ``mha(x, x, x)`` was recomputed as
    ``mha(x1, x2, x3)``, which takes another path (``nn.MultiheadAttention`` projects ``q is k is
    v`` packed: a ``CheckpointError``), or, for a block whose forward tests ``a is b``, gave other
    gradients without a word (until 2026-11-28: a probe's finding). Passed once, the tensor comes
    back as one object in every slot it filled."""
    unique: list[torch.Tensor] = []
    index: dict[int, int] = {}
    slots = []
    for key, t in _tensor_args(args, kwargs):
        i = index.setdefault(id(t), len(unique))
        if i == len(unique):
            unique.append(t)
        slots.append((key, i))

    def run(*tensors):
        a, kw = list(args), dict(kwargs)
        for key, i in slots:
            if isinstance(key, int):
                a[key] = tensors[i]
            else:
                kw[key] = tensors[i]
        return fn(*a, **kw)

    return run, unique


def _tensor_args(args: tuple, kwargs: dict) -> list[tuple[object, torch.Tensor]]:
    """``(position or keyword, tensor)`` for the tensors passed directly (not inside containers)."""
    found = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    return found + [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]


class Replay:
    """What one checkpointed call's recomputation must see as its forward saw it.

    ``forward()`` / ``recompute()`` are the two contexts of ``torch.utils.checkpoint``'s
    ``context_fn``. Entering the forward one records, with ``track_rng``, the state of Python's
    ``random``, of NumPy's global generator (when NumPy is imported) and of ``generators`` (the
    ``torch.Generator`` objects the block holds), and a copy of each of ``buffers`` (the block's
    buffers its forward changes in place: running statistics, an EMA, a counter). The recompute one
    sets them to what was recorded, and puts back on exit what they held when it began. Tracking
    the generators costs about 70 microseconds per state (NumPy's ``get_state`` is most of it), so
    a block is tracked only if its first call drew from one of them (:meth:`drew`); buffers cost a
    copy each per call, only for those the block changes.

    Without the buffers, the recomputation updated them a second time and computed from the
    updated values: batch norm's ``num_batches_tracked`` counted every batch twice (fixed earlier
    the same day for running statistics alone), an EMA buffer read in the forward gave other
    gradients (a loss of 86.46 against 78.68 at step 2), until 2026-11-26.
    """

    def __init__(self, generators: list, buffers: list[torch.Tensor], track_rng: bool):
        self.generators = generators
        self.track_rng = track_rng
        self.saved: tuple | None = None
        self.buffers = buffers
        self.saved_buffers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add_generators(self, found: list[tuple[torch.Generator, torch.Tensor]]) -> None:
        """Track more generators from now on: ``found`` is ``[(generator, its state when this
        call's forward first drew from it), ...]`` (:class:`GeneratorSpy`), so this call's
        recomputation starts from there too."""
        if self.saved is None:
            return
        py, np_state, gens = self.saved
        for g, state in found:
            self.generators.append(g)
            gens.append(state)

    def keep_buffers(self, written: list[torch.Tensor]) -> None:
        """Drop the recorded copies of buffers not in ``written`` (after a first call that recorded
        them all to learn which the forward changes)."""
        ids = {id(b) for b in written}
        self.saved_buffers = [(b, c) for b, c in self.saved_buffers if id(b) in ids]

    def capture(self) -> tuple:
        numpy = sys.modules.get("numpy")
        return (random.getstate(), numpy.random.get_state() if numpy is not None else None,
                [g.get_state() for g in self.generators])

    def _set(self, state: tuple) -> None:
        py, np_state, gens = state
        random.setstate(py)
        if np_state is not None:
            sys.modules["numpy"].random.set_state(np_state)
        for g, st in zip(self.generators, gens):
            g.set_state(st)

    def drew(self) -> bool:
        """Whether any tracked generator moved since the forward began (call after it)."""
        if self.saved is None:
            return False
        (py0, np0, gens0), (py1, np1, gens1) = self.saved, self.capture()
        if py0 != py1 or any(not torch.equal(a, b) for a, b in zip(gens0, gens1)):
            return True
        if np0 is None or np1 is None:
            return np0 is not np1
        numpy = sys.modules["numpy"]
        return any(not numpy.array_equal(a, b) if isinstance(a, numpy.ndarray) else a != b for a, b in zip(np0, np1))

    @contextlib.contextmanager
    def forward(self):
        if self.track_rng:
            self.saved = self.capture()
        if self.buffers:
            with torch.no_grad():
                self.saved_buffers = [(b, b.clone()) for b in self.buffers]
        yield

    def recompute(self) -> "_EachEntry":
        """The recomputation's context: may be entered once per recomputation — a graph
        backpropagated twice (``retain_graph=True``, a gradient penalty, double backward) recomputes
        the block again with the same object, which a generator's one-shot context manager refused
        until 2026-11-26 (``AttributeError: '_GeneratorContextManager' object has no attribute 'args'``)."""
        return _EachEntry(self._recompute)

    @contextlib.contextmanager
    def _recompute(self):
        current = self.capture() if self.saved is not None else None
        if current is not None:
            self._set(self.saved)
        with torch.no_grad():
            now = [(b, b.clone()) for b, _ in self.saved_buffers]
            for b, c in self.saved_buffers:
                b.copy_(c)
        try:
            yield
        finally:
            if current is not None:
                self._set(current)
            with torch.no_grad():
                for b, c in now:
                    b.copy_(c)


class TrainingFlags:
    """The train/eval flags of a block's modules when its forward ran, for the recomputation.

    A script that switches the model to eval mode between a training forward and its backward (a
    teacher pass of the same network, a validation call before ``loss.backward()``, ``model.train()``
    only at the top of the next step) had the recomputation run in eval mode: dropout and noise
    off, batch norm on running statistics. That was ``CheckpointError`` (another number of tensors
    saved) or, for a block whose only train-mode difference is its values (noise injection),
    silently other gradients, where plain PyTorch trains (a probe's finding, 2026-11-28).

    Args:
        modules: the modules whose flags are recorded (a block's ``modules()``, made once).
    """

    __slots__ = ("modules", "flags")

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules
        self.flags = [m.training for m in modules]

    def restore(self) -> list[nn.Module]:
        """Set each module's ``training`` to what it was at the forward; returns the modules changed
        (the caller flips them back after the recomputation). ``training`` is set directly, not
        with ``train()``, which a model may override (freezing batch norm, say)."""
        changed = [m for m, t in zip(self.modules, self.flags) if m.training is not t]
        self.flip(changed)
        return changed

    @staticmethod
    def flip(modules: list[nn.Module]) -> None:
        """Turn each module's ``training`` over (:meth:`restore`, and back after the recomputation)."""
        for m in modules:
            m.training = not m.training


class ModeReplay:
    """A ``context_fn`` for ``torch.utils.checkpoint`` (non-reentrant) that runs each recomputation
    with the train/eval flags its forward had (:class:`TrainingFlags`): given to a Hugging Face
    model's own checkpointing, which the switch turns on, with all of the model's modules (the
    library's call does not say which layer it checkpoints).

    Args:
        model: the model (its ``modules()`` are listed once, here).
    """

    def __init__(self, model: nn.Module):
        self.modules = list(model.modules())

    def __call__(self):
        return contextlib.nullcontext(), _EachEntry(functools.partial(_modes_of, TrainingFlags(self.modules)))


@contextlib.contextmanager
def _modes_of(flags: TrainingFlags):
    flipped = flags.restore()
    try:
        yield
    finally:
        flags.flip(flipped)


def _in_modes(fn: Callable, flags: TrainingFlags) -> Callable:
    """``fn`` run with ``flags``' train/eval flags set (the forward: nothing to set; a
    recomputation after the script switched modes: the forward's), and the current ones back after."""
    def run(*args, **kwargs):
        with _modes_of(flags):
            return fn(*args, **kwargs)
    return run


class _EachEntry:
    """A context manager entered any number of times (also nested): each entry runs a fresh
    ``make()`` context manager, exited in the reverse order."""

    def __init__(self, make):
        self.make = make
        self.active: list = []

    def __enter__(self):
        cm = self.make()
        value = cm.__enter__()
        self.active.append(cm)
        return value

    def __exit__(self, *exc):
        return self.active.pop().__exit__(*exc)


def _generators(module: nn.Module) -> list:
    """The ``torch.Generator`` objects held as attributes by ``module`` or its submodules."""
    return [v for m in module.modules() for v in vars(m).values() if isinstance(v, torch.Generator)]


class GeneratorSpy(TorchFunctionMode):
    """Notes the ``torch.Generator`` objects a block's first checkpointed forward draws from that
    the block does not hold as attributes: a module-level ``GEN = torch.Generator()``, one in a list
    or a helper object, one passed as an argument. Each is recorded with its state just before its
    first use in that forward (nothing else drew from it in between on this thread), which is what
    the recomputation must start from. A probe found such draws recomputed from the generator's
    later state: noise injection trained silently wrong, noisy top-1 gating raised
    ``CheckpointError`` (different tokens routed in the recomputation), until 2026-11-28.

    Every ATen random op takes its generator as the keyword ``generator`` (``torch.randn``,
    ``randint``, ``randperm``, ``multinomial``, ``bernoulli``, ``Tensor.normal_`` / ``uniform_``...).
    torch's default CPU generator is left out: ``torch.utils.checkpoint`` restores it already.

    Args:
        known: generators tracked already (not recorded again).

    Attributes:
        found: ``[(generator, state before its first use), ...]`` in the order first used.
    """

    def __init__(self, known: list):
        super().__init__()
        self._known = {id(g) for g in known} | {id(torch.default_generator)}
        self.found: list[tuple[torch.Generator, torch.Tensor]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator) and id(gen) not in self._known:
            self._known.add(id(gen))
            self.found.append((gen, gen.get_state()))
        return func(*args, **kwargs)


class CheckpointedForward:
    """A block's forward run through ``torch.utils.checkpoint`` (non-reentrant) while training.

    It wraps the forward the block has (``module.forward``, as ``nn.Module.__call__`` looks it
    up): the class's, or one the script or a library set on the instance (accelerate's
    ``add_hook_to_module`` puts a ``functools.partial`` there). Until 2026-11-28 it wrapped the
    class's always, so such a block ran without its wrapper and trained wrongly, and a class
    whose ``forward`` is a ``staticmethod`` or a callable object raised (a probe's finding).

    Pickling it (``torch.save(model)``, ``copy.deepcopy``) yields the plain forward: the class's,
    looked up again on the restored module (``getattr(module, "forward")`` runs before the
    module's attributes are set, so it finds the class's), or the instance's own object: a saved
    or copied model is a plain model, and loading it needs no apt_model. (Reducing to
    ``types.MethodType`` failed: pickle cannot name that class, "Can't pickle <class 'method'>".)
    """

    def __init__(self, module: nn.Module, counts: dict | None = None):
        self.module = module
        self._own = "forward" in vars(module)  # the instance's own forward (else the class's)
        self.forward = module.forward
        #: training calls so far, shared by the model's wrapped blocks (the report shows them):
        #: ``checkpointed``, and ``inside another checkpoint`` (the script's or a library's own, or a
        #: backward's recomputation), which run as written
        self.counts = counts if counts is not None else {"checkpointed": 0, "inside another checkpoint": 0}
        #: set by disable(): a wrapper the script put around this one since (accelerate's
        #: add_hook_to_module) keeps it, and it then runs the block as written (a probe's finding)
        self.inert = False
        self.calls = 0
        self.generators = _generators(module)
        self._modules: list[nn.Module] | None = None  # the block's modules, listed at its first checkpointed call
        self.mutates_input: bool | None = None  # learned at the first checkpointed call
        self.draws_rng: bool | None = None  # from Python's, NumPy's or the block's own generators: learned too
        # the buffers its forward changes, learned too: (module, name), looked up at each call, since
        # model.to() / .half() put new tensors in a module's buffers
        self.written_buffers: list[tuple[nn.Module, str]] | None = None
        self._hook_sizes: tuple | None = None  # the hook dictionaries' sizes when last looked at
        #: the script's hooks inside the block (descriptions): while any, calls run uncheckpointed
        self.hooked: list[str] = []

    def hooks_inside(self) -> list[str]:
        """The script's hooks on the block's layers (and the global module hooks): looked up again
        only when a hook dictionary's size changed since the last call."""
        block = self.module
        sizes = tuple(len(getattr(m, attr)) for m in block.modules() if m is not block for attr in HOOK_DICTS) \
            + tuple(len(getattr(module_mod, name)) for name in GLOBAL_HOOK_DICTS)
        if sizes != self._hook_sizes:
            self._hook_sizes = sizes
            hooked = script_hooks(block)
            if hooked and not self.hooked:
                log.info("apt_model: %s runs uncheckpointed while the script's hooks sit inside it (%s): its "
                         "recomputation in backward would run them a second time", type(block).__name__,
                         ", ".join(hooked))
            self.hooked = hooked
        return self.hooked

    @property
    def __signature__(self) -> inspect.Signature:
        """The block's own forward's (code inspecting ``block.forward`` sees its parameters)."""
        return inspect.signature(self.forward)

    def _buffers(self) -> list[tuple[nn.Module, str]]:
        """The buffers to record for this call: all of them at the first call (to learn which the
        forward changes), then those it changed (by their version counter) and the running
        statistics of :func:`running_stats_layers` (updated by kernels that bump no version)."""
        if self.written_buffers is not None:
            return self.written_buffers
        return [(m, name) for m in self.module.modules() for name, b in m.named_buffers(recurse=False) if b.numel()]

    def __call__(self, *args, **kwargs):
        # inside functional_call (MAML's inner loop, hypernetworks) a recomputation in backward would
        # run after the call put the module's own parameters back, and use those: wrong gradients
        # (found 2026-11-27: up to 0.03 off). Such a call runs uncheckpointed.
        # inside a checkpoint of the script's own (around the model, say) the block runs as written,
        # in the forward and in its recomputation alike: the enclosing checkpoint frees its
        # activations already, and a recomputation must save what the forward saved - this call's
        # path changes after the first call (found 2026-11-27: CheckpointError at the first backward)
        # inside a backward pass (a re-entrant torch.utils.checkpoint of the script's or a library's
        # recomputing its forward with grad on: timm's set_grad_checkpointing with re-entrant
        # checkpoints) the block runs as written too: checkpointing it again there recomputed every
        # block a second extra time, 1.5x the step for no memory (a probe's finding)
        if self.inert or not (self.module.training and torch.is_grad_enabled() and not functional_call.in_function_transform()) \
                or functional_call.swapped(self.module):
            return self.forward(*args, **kwargs)
        if in_enclosing_checkpoint() or torch._C._current_graph_task_id() != -1:
            self.counts["inside another checkpoint"] += 1
            return self.forward(*args, **kwargs)
        if self.hooks_inside():
            return self.forward(*args, **kwargs)
        self.calls += 1
        self.counts["checkpointed"] += 1
        named = self._buffers()
        buffers = [getattr(m, name) for m, name in named]
        versions = None if self.written_buffers is not None else [b._version for b in buffers]
        if self._modules is None:
            self._modules = list(self.module.modules())
        flags = TrainingFlags(self._modules)  # the recomputation runs in the modes of this forward
        replay = Replay(self.generators, buffers, track_rng=self.draws_rng is not False)
        contexts = ({"context_fn": lambda: (replay.forward(), replay.recompute())}
                    if replay.track_rng or buffers else {})
        spy = GeneratorSpy(self.generators) if self.draws_rng is None and not torch.compiler.is_compiling() else None
        with spy if spy is not None else contextlib.nullcontext():
            if self.mutates_input is False:
                run, inputs = _shared_inputs(self.forward, args, kwargs)
                out = checkpoint(_in_modes(run, flags), *inputs, use_reentrant=False, preserve_rng_state=True,
                                 **contexts)
            else:
                out = self._from_copies(args, kwargs, contexts, flags)
        if spy is not None and spy.found:
            replay.add_generators(spy.found)  # self.generators too: the same list
            log.debug("apt_model: %s draws from %d generator(s) it does not hold: tracked from now on",
                      type(self.module).__name__, len(spy.found))
        if self.draws_rng is None:
            self.draws_rng = replay.drew()
        if versions is not None:
            stats = {id(b) for m in running_stats_layers(self.module)
                     for b in (m.running_mean, getattr(m, "running_var", None), m.num_batches_tracked)
                     if isinstance(b, torch.Tensor)}
            written = [i for i, (b, v) in enumerate(zip(buffers, versions)) if b._version != v or id(b) in stats]
            self.written_buffers = [named[i] for i in written]
            replay.keep_buffers([buffers[i] for i in written])
        return out

    def _from_copies(self, args: tuple, kwargs: dict, contexts: dict, flags: TrainingFlags):
        """A checkpointed call whose recomputation starts from copies of the tensor inputs taken
        before the forward: for a block that modifies its input in place (the recomputation would
        start from the modified values: wrong gradients; torch's own check raises where plain
        PyTorch does not), and at the first call, which learns whether the block does. The forward
        itself runs on the inputs as given, so the caller sees what it would without the switch."""
        recompute, tensors = _shared_inputs(self.forward, args, kwargs)  # each distinct tensor once
        versions = [t._version for t in tensors]
        with torch.no_grad():
            copies = [(t.detach().clone(), t.requires_grad) for t in tensors]
        calls = [0]

        def run():
            calls[0] += 1
            if calls[0] == 1 or not copies:
                return self.forward(*args, **kwargs)
            # a fresh copy each time: a second recomputation starts clean
            return recompute(*(c.detach().requires_grad_().clone() if grad else c.clone() for c, grad in copies))

        out = checkpoint(_in_modes(run, flags), use_reentrant=False, preserve_rng_state=True, **contexts)
        mutated = any(t._version != v for t, v in zip(tensors, versions))
        if self.mutates_input is None:
            self.mutates_input = mutated
        if not mutated:
            copies.clear()  # the inputs are as they were: recompute from them, free the copies
        return out

    def __reduce__(self):
        if self._own:
            return (operator.getitem, ((self.forward,), 0))  # that object itself, by the standard library
        return (getattr, (self.module, "forward"))


def choose_blocks(n: int, policy: str, k: int) -> list[int]:
    """Indices of the blocks a fixed policy checkpoints (``all`` or ``every:K``)."""
    if policy == "all":
        return list(range(n))
    return list(range(0, n, k))


def blocks_for_budget(per_block: list[int], inputs: list[int], outside: int, budget: int) -> list[int]:
    """The fewest blocks to checkpoint so that the bytes saved for backward fit ``budget``.

    Checkpointing block i saves ``per_block[i] - inputs[i]`` bytes (its input is kept for the
    recomputation). Blocks with the largest saving go first. Returns all blocks if even that
    does not fit.
    """
    total = outside + sum(per_block)
    order = sorted(range(len(per_block)), key=lambda i: per_block[i] - inputs[i], reverse=True)
    chosen = []
    for i in order:
        if total <= budget:
            break
        chosen.append(i)
        total -= per_block[i] - inputs[i]
    return sorted(chosen)


def checkpointed_by_script(blocks: Blocks) -> list[int]:
    """Indices of the blocks a Hugging Face model checkpoints already, by the script's own
    ``gradient_checkpointing_enable()`` / ``activation_checkpointing_enable()`` (their
    ``gradient_checkpointing`` flag is set); empty for any other model."""
    # read from the instance (Hugging Face sets it in __init__): a permissive __getattr__ answering
    # every name with True made every block look checkpointed by the script (a probe's finding)
    return [i for i, layer in enumerate(blocks.modules) if vars(layer).get("gradient_checkpointing") is True]


class _RecordingCall:
    """``fn`` that notes it was called (``flag[0] = True``); keeps ``fn``'s signature."""

    def __init__(self, fn, flag: list):
        self.fn, self.flag = fn, flag

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.fn)

    def __call__(self, *args, **kwargs):
        self.flag[0] = True
        return self.fn(*args, **kwargs)

    def __reduce__(self):
        # a pickled model (torch.save of the whole model, copy.deepcopy) gets the plain method: looked
        # up while the model's attributes are not restored yet, it is the class's (as CheckpointedForward)
        return (getattr, (self.fn.__self__, self.fn.__name__))


def apply_to_blocks(model: nn.Module, blocks: Blocks, indices: list[int], patches, counts: dict | None = None) -> str:
    """Checkpoint ``blocks.modules[i]`` for ``i`` in ``indices``; returns how: ``hf`` (Hugging Face's
    own checkpointing, switched on here and off again by ``disable()``), ``script`` (a Hugging Face
    model the script already checkpoints: left exactly as the script configured it, and still so
    after ``disable()``; see :func:`checkpointed_by_script`) or ``wrapped``."""
    hf = _hf_checkpointing(model)
    if hf is not None and checkpointed_by_script(blocks):
        return "script"
    GradientCheckpointingLayer = None
    if hf is not None:  # a Hugging Face model: transformers is imported already; never import it otherwise
        try:
            from transformers.modeling_layers import GradientCheckpointingLayer
        except Exception:  # noqa: BLE001 - an older transformers without per-layer checkpointing
            GradientCheckpointingLayer = None
    if hf is not None and GradientCheckpointingLayer is not None and isinstance(blocks.modules[0], GradientCheckpointingLayer):
        enable = getattr(hf, "activation_checkpointing_enable", None)
        # each recomputation with the train/eval flags of its forward (TrainingFlags)
        kwargs = {"use_reentrant": False, "context_fn": ModeReplay(hf)}
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
            disable = hf.activation_checkpointing_disable
        else:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            disable = hf.gradient_checkpointing_disable
        # the script may ask for it itself after adoption (the Trainer does, in train()): then
        # disable() leaves it on (until 2026-11-28 it turned it off: a probe's finding)
        asked = [False]
        for name in ("gradient_checkpointing_enable", "activation_checkpointing_enable"):
            orig = getattr(hf, name, None)
            if orig is not None:
                patches.set_attr(hf, name, _RecordingCall(orig, asked), label=f"hf {name}: the script's call noted")
        patches.add_undo(functools.partial(_hf_disable, weakref.WeakMethod(disable), asked),
                         "hf activation checkpointing", owner=hf)
        keep = set(indices)
        for i, layer in enumerate(blocks.modules):
            layer.gradient_checkpointing = i in keep
        # outside grad mode the flags go off for the call: GPT-2 drops its KV cache whenever
        # gradient_checkpointing and training, even under no_grad, so generate() in train mode
        # lost its context with the switch on (a probe's finding)
        flags = _FlagsOffWithoutGrad(asked)
        patches.add_handle(hf.register_forward_pre_hook(SessionHook(flags.pre)), "hf checkpointing flags: no-grad calls")
        patches.add_handle(hf.register_forward_hook(SessionHook(flags.post), always_call=True),
                           "hf checkpointing flags: back after the call")
        return "hf"
    for i in indices:
        block = blocks.modules[i]
        wrapper = CheckpointedForward(block, counts)
        patches.add_undo(functools.partial(_make_inert, weakref.ref(wrapper)), f"checkpoint {blocks.name}.{i} inert",
                         owner=wrapper)
        patches.set_attr(block, "forward", wrapper, label=f"checkpoint {blocks.name}.{i}")
    return "wrapped"


def _make_inert(ref: weakref.ref) -> None:
    wrapper = ref()
    if wrapper is not None:
        wrapper.inert = True


class BlockMeter:
    """Counts the bytes each block saves for backward during one forward (for the budget policy)."""

    def __init__(self, blocks: Blocks):
        self.blocks = blocks
        self.per_block = [0] * len(blocks.modules)
        self.inputs = [0] * len(blocks.modules)
        self.outside = 0
        self.current: int | None = None
        self.done = False

    def pre(self, i: int, args: tuple) -> None:
        self.current = i
        self.inputs[i] = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))

    def post(self) -> None:
        self.current = None

    def count(self, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size() if not isinstance(t, nn.Parameter) else 0
        if self.current is None:
            self.outside += n
        else:
            self.per_block[self.current] += n


class _FlagsOffWithoutGrad:
    """A Hugging Face model's ``gradient_checkpointing`` flags, set by the switch, turned off while
    a call made without grad (``generate()``, evaluation under ``no_grad``) runs, and back on when
    the last such call ends (counted across threads and nested calls: each call notes on its own
    thread whether it turned them off). Left alone once the script asked for checkpointing itself
    (``asked[0]``): then they are its own."""

    def __init__(self, asked: list):
        self.asked = asked
        self.off: list[nn.Module] = []
        self.depth = 0  # no-grad calls under way
        self._lock = threading.Lock()
        self._tls = threading.local()

    def pre(self, module: nn.Module, args: tuple) -> None:
        took = not (torch.is_grad_enabled() or self.asked[0] or torch.compiler.is_compiling())
        stack = self._tls.__dict__.setdefault("calls", [])
        stack.append(took)
        if took:
            with self._lock:
                if self.depth == 0:
                    self.off = [m for m in module.modules() if vars(m).get("gradient_checkpointing") is True]
                    for m in self.off:
                        vars(m)["gradient_checkpointing"] = False
                self.depth += 1
        return None

    def post(self, module: nn.Module, args: tuple, output) -> None:
        stack = self._tls.__dict__.get("calls")
        if not stack or not stack.pop():
            return None
        with self._lock:
            self.depth -= 1
            if self.depth == 0:
                off, self.off = self.off, []
                for m in off:
                    vars(m)["gradient_checkpointing"] = True
        return None


def _hf_disable(method: weakref.WeakMethod, asked: list) -> None:
    """Turn the library's checkpointing off again, unless the script asked for it itself; the model
    is held weakly (the undo stack kept a Hugging Face model the script dropped alive until
    2026-11-28: a probe's finding)."""
    disable = method()
    if disable is not None and not asked[0]:
        disable()
