"""The switch's FP4 step: frozen ``nn.Linear`` layers the policy accepts are stored in FP4.

Decision (per adopted model): ``fp4=off`` does nothing; a model with no trainable parameter is
left alone where FP4 comes from the mode's default rather than the script (an EMA copy updated in
place with ``p_ema.mul_(d).add_(p)`` crashed, or was silently misaligned, once its weights were
FP4: until 2026-11-26), and so is a frozen layer whose weight equals a trainable parameter of the
same model (the momentum encoder MoCo, BYOL or a mean teacher keeps inside the trained module, a
``deepcopy`` or a ``copy_`` of the online one: :func:`copies_of_trainable`); ``native`` needs native FP4 matmul on
the model's device (the probe's answer; without it FP4 weights would be dequantized on every
call, which is slower, so the layers are left alone); otherwise :func:`~apt_model.quantization.policy.plan_fp4`
under the session's :class:`~apt_model.quantization.policy.FP4Policy` lists the layers to
convert and the skipped ones with their reasons. Applying swaps each converted layer for an
:class:`~apt_model.quantization.linear.FP4Linear` (packed weights; the fp32 storage released even
if an optimizer holds the Parameter) and registers its undo: ``disable()`` puts the original
``nn.Linear`` back, holding the FP4-rounded weights. While the switch is on, a converted layer's
``state_dict`` entries are those of the ``nn.Linear`` it replaced (``weight``, dequantized; until
2026-11-26 the packed buffers, which the model's own class could not load). It runs before
paging: it shrinks frozen weights.
"""
from __future__ import annotations

import gc
import re
import sys
import weakref

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from apt_model.base.feature import AdoptionContext, Decision, FeatureStep, ModelRecord, StepSession
from apt_model.base.graph_reuse import is_script_file
from apt_model.base.log import get_logger
from apt_model.base.patches import PatchSet
from apt_model.base.sizes import format_size
from apt_model.memory.host import release_free_memory
from apt_model.quantization.footprint import release_parameter
from apt_model.quantization.linear import FP4Linear, FP4QATLinear, state_dict_as_linear
from apt_model.quantization.native import native_support
from apt_model.quantization.policy import Candidate, FP4Policy, plan_fp4

log = get_logger(__name__)


#: Leading elements compared before a whole weight is (a cheap screen: most pairs differ there).
_SCREEN = 16


def copies_of_trainable(model: nn.Module, candidates: list[Candidate]) -> dict[int, str]:
    """The candidates (frozen layers) whose weight equals a trainable parameter of ``model``, by
    ``id`` of the candidate's module, with that parameter's name: a copy of a trained layer, such
    as the momentum (EMA) encoder MoCo, BYOL or a mean teacher keeps inside the trained module
    (``deepcopy`` of the online encoder, or its weights ``copy_``-ed in), which the script updates
    in place from the online weights; in FP4 that layer left ``parameters()``, and the usual
    ``zip(online.parameters(), momentum.parameters())`` update skipped it without a word or paired
    tensors of other shapes (a probe's finding, 2026-11-29). Equal means same shape, dtype and
    device and ``torch.equal`` (the leading :data:`_SCREEN` elements compared first), or the layer
    sits in a structural copy of the parameter's subtree (:func:`_mirrors`: a resumed run's drifted
    copy). Never raises (a pair that cannot be compared is no copy)."""
    trainable: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad and p.layout is torch.strided and p.device.type != "meta":
            trainable.setdefault((tuple(p.shape), p.dtype, p.device), []).append((name, p))
    out: dict[int, str] = {}
    for c in candidates:
        w = getattr(c.module, "weight", None)
        if not isinstance(w, torch.Tensor) or not trainable:
            continue
        for name, p in trainable.get((tuple(w.shape), w.dtype, w.device), ()):
            try:
                a, b = w.detach().reshape(-1), p.detach().reshape(-1)
                if (torch.equal(a[:_SCREEN], b[:_SCREEN]) and torch.equal(a, b)) or _mirrors(model, c.name, name):
                    out[id(c.module)] = name
                    break
            except Exception as err:  # noqa: BLE001 - a pair that cannot be compared is no copy
                log.debug("fp4: comparing %s with %s: %s", c.name, name, err)
    return out


#: How a momentum (EMA) copy is commonly named: MoCo's ``encoder_k``, BYOL's ``target_encoder``,
#: a mean teacher's or DINO's ``teacher``, ``ema_model``, ``momentum_encoder``, ``shadow``.
_COPY_NAME = re.compile(r"(^|_)(k|key|momentum|ema|target|teacher|shadow|avg|averaged|average)($|_)", re.IGNORECASE)


def _mirrors(model: nn.Module, layer: str, param: str) -> bool:
    """Whether the frozen ``layer`` sits in a momentum copy of the subtree holding the trainable
    ``param``: their paths differ in one named (not numbered) step, ``encoder_k.2`` and
    ``encoder_q.2.weight``; the frozen side's name there is a copy's (:data:`_COPY_NAME`); the two
    subtrees are modules of one class holding submodules, with the same parameter names and shapes,
    the copy wholly frozen and the other wholly trainable. A copy whose weights have drifted from
    the online ones (a resumed MoCo: no longer equal) is found so (a review probe's finding). Not
    so: a layer of a partly frozen stack (``layers.0`` against ``layers.5``), frozen siblings
    (``q_proj`` against ``v_proj``, ``fc1`` against ``fc2``), a frozen tower of a dual encoder
    (``query_encoder`` against ``doc_encoder``): their frozen layers still go to FP4 (a second
    review's finding)."""
    a, b = layer.split("."), param.split(".")[:-1]
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if len(a) != len(b) or len(diff) != 1 or a[diff[0]].isdigit() or b[diff[0]].isdigit():
        return False
    i = diff[0]
    if not _COPY_NAME.search(a[i]):
        return False
    left, right = model.get_submodule(".".join(a[:i + 1])), model.get_submodule(".".join(b[:i + 1]))
    if type(left) is not type(right) or next(left.children(), None) is None:
        return False
    if any(p.requires_grad for p in left.parameters()) or not all(p.requires_grad for p in right.parameters()):
        return False
    shapes = lambda m: [(n, tuple(p.shape)) for n, p in m.named_parameters()]  # noqa: E731
    return shapes(left) == shapes(right)


def held_outside(model: nn.Module, candidates: list[Candidate]) -> dict[int, str]:
    """The candidates whose weight ``Parameter`` a module outside ``model`` also holds (in its
    parameters or as an attribute: a reference model sharing a LoRA policy's frozen base), by ``id``
    of the candidate's module, with that module's class name. FP4 storage empties the weight it
    releases, so that module's next call crashed ("mat2 must be a matrix, got 1-D tensor": a
    probe's finding, 2026-11-29). One pass over the garbage collector's objects (a fraction of a
    second in a large process, once per model adopted with FP4). Never raises."""
    weights = {id(c.module.weight): c for c in candidates if isinstance(getattr(c.module, "weight", None), torch.Tensor)}
    if not weights:
        return {}
    layers = {id(c.module): c for c in candidates}
    inside = {id(m) for m in model.modules()}
    out: dict[int, str] = {}
    try:
        for obj in gc.get_objects():
            # type(), not isinstance(): a lazy proxy (torch.distributed.reduce_op) warns when asked its class
            if not issubclass(type(obj), nn.Module) or id(obj) in inside:
                continue
            held = list((obj.__dict__.get("_parameters") or {}).values()) + list(vars(obj).values())
            for t in held:
                c = weights.get(id(t))
                if c is not None and id(c.module) not in out and t is c.module.weight:
                    out[id(c.module)] = type(obj).__name__
            # the layer itself in another model (two models built around one encoder: a probe's finding)
            for child in (obj.__dict__.get("_modules") or {}).values():
                c = layers.get(id(child))
                if c is not None and child is c.module and id(c.module) not in out:
                    out[id(c.module)] = type(obj).__name__
        _held_by_the_script(layers, out)
    except Exception as err:  # noqa: BLE001 - a look that fails leaves the plan as it is
        log.debug("fp4: looking for weights held outside the model: %s", err)
    return out


def _held_by_the_script(layers: dict[int, Candidate], out: dict[int, str]) -> None:
    """Candidate layers the script's own frames on the stack name (``enc = nn.Linear(...)`` before
    ``model = nn.Sequential(enc, ...)``, then ``enc(x)`` called directly: its emptied weight crashed,
    a probe's finding): noted in ``out`` as held by ``variable 'enc'``. Only the script's own
    frames (:func:`~apt_model.base.graph_reuse.is_script_file`) are read."""
    frame = sys._getframe(1)
    while frame is not None:
        if is_script_file(frame.f_code.co_filename):
            for name, value in list(frame.f_locals.items()):
                c = layers.get(id(value))
                if c is not None and value is c.module and id(c.module) not in out:
                    out[id(c.module)] = f"variable {name!r} of the script"
        frame = frame.f_back



def _skip_summary(skipped: list[Candidate]) -> str:
    counts: dict[str, list[str]] = {}
    for c in skipped:
        counts.setdefault(c.reason.split(":")[0], []).append(c.name)
    parts = []
    for why, names in counts.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        parts.append(f"{len(names)} ({why}: {shown})")
    return "; ".join(parts)


class FP4Step(FeatureStep):
    """Feature ``fp4`` (``off``, ``native``, ``storage``, ``all``); see the module docstring.

    Adoption decides once, from the weights frozen at that moment. A fine-tuning script often
    moves the model first and freezes the base after (``model.to(device)``, then
    ``requires_grad_(False)``): those layers stay dense. Until 2026-11-29 nothing said so: the
    report read "no layer to convert: trainable weight". Layers that were trainable at adoption
    are now looked at again at the next optimizer step (:meth:`_at_step`, a global step pre-hook
    registered when the first such model is adopted, kept until ``disable()``); those the policy
    would store in FP4 now are named in a warning and in the report (``frozen_after_adoption``),
    with the fix. They
    are not converted then: the features adopted after FP4 (paging's plan, a captured graph of the
    compile ladder) were made over their dense weights.
    """

    name = "fp4"

    def __init__(self, session: StepSession):
        super().__init__(session)
        self._watched: list[tuple[weakref.ref, ModelRecord, object, frozenset, FP4Policy, bool]] = []
        self._hook = None

    def decide(self, model: nn.Module, ctx: AdoptionContext) -> Decision:
        req = ctx.config.fp4
        if req == "off":
            return Decision(self.name, req, "off", "fp4=off")
        policy = FP4Policy.coerce(ctx.config.settings.get("fp4_policy"))
        dev = torch.device(ctx.record.device)
        support = ctx.support() if dev.type == "cuda" else None
        if support is not None:
            native_ok = bool(support.fp4_matmul.get("supported"))
            native_why = str(support.fp4_matmul.get("reason", ""))
        else:
            native_ok, native_why = native_support(dev)
        tried = [f"native FP4 matmul on {dev}: {'yes' if native_ok else 'no'} ({native_why})"]
        if req == "native" and not native_ok:
            return Decision(self.name, req, "off", f"native FP4 matmul is not available on {dev} ({native_why}); "
                            "without it FP4 weights would be dequantized on every call, which is slower, so "
                            "performance mode leaves the layers as they are", tried)
        by_mode = str(ctx.config.sources.get("fp4", "")).startswith("mode:")
        if by_mode and not any(p.requires_grad for p in model.parameters()):
            return Decision(self.name, req, "off", (
                "no parameter of the model is trainable: a frozen copy (an EMA of the weights, a teacher, a "
                "reference model) is often updated in place or compared exactly, which FP4 storage would break; "
                f"the {ctx.config.mode} mode's default leaves it as it is (fp4='storage' stores it in FP4 anyway)"), tried)
        wrapped = sorted({type(p.data).__name__ for p in model.parameters() if type(p.data) is not torch.Tensor})
        if wrapped:  # FSDP2's fully_shard before the switch saw the model (its meta-device recipe), tensor parallel
            return Decision(self.name, req, "off", (
                f"the model's parameters are {', '.join(wrapped)} (sharded by FSDP2's fully_shard or another "
                "tensor-subclass wrapper before the switch adopted it): FP4 storage converts plain tensors only"), tried)
        plan = plan_fp4(model, policy, "storage")
        self._watch(model, ctx, plan, policy, by_mode)
        outside = held_outside(model, [c for c in plan if c.convert])
        for c in plan:
            if id(c.module) in outside:
                c.convert = False
                c.reason = (f"held outside the model too: by a {outside[id(c.module)]} (a reference model sharing it, "
                            "a variable the script calls it by), which FP4 storage would leave with an emptied weight")
        if by_mode:
            copies = copies_of_trainable(model, [c for c in plan if c.convert])
            for c in plan:
                if id(c.module) in copies:
                    c.convert = False
                    c.reason = (f"momentum copy: equal to, or a copy's layer of, the trainable "
                                f"{copies[id(c.module)]} (a momentum or EMA copy, which scripts update in place); "
                                f"the {ctx.config.mode} mode's default leaves it (fp4='storage' stores it in FP4 anyway)")
        convert = [c for c in plan if c.convert]
        skipped = [c for c in plan if not c.convert]
        if not convert:
            fp4_layers = sorted({type(m).__name__ for m in model.modules() if isinstance(m, (FP4Linear, FP4QATLinear))})
            why = "no layer to convert: " + (_skip_summary(skipped) if skipped else
                                             f"its linear layers are {', '.join(fp4_layers)} already" if fp4_layers
                                             else "the model has no nn.Linear layers")
            return Decision(self.name, req, "off", why, tried, details={"skipped": [c.summary() for c in skipped]})
        compute = "auto" if native_ok and req in ("native", "all") else "emulated"
        chosen = "storage+native" if compute == "auto" else "storage"
        return Decision(self.name, req, chosen, f"{len(convert)} layer(s) to store in {policy.format.upper()}", tried,
                        act=True, plan=(policy, convert, skipped, compute, native_why))

    def _watch(self, model: nn.Module, ctx: AdoptionContext, plan: list[Candidate], policy: FP4Policy,
               by_mode: bool) -> None:
        """Look at ``model``'s layers that are trainable now again at the next optimizer step (the
        class docstring). Bookkeeping only: the model is not changed."""
        trainable = frozenset(id(c.module) for c in plan if not c.convert and c.reason.startswith("trainable weight"))
        if not trainable:
            return
        self._watched.append((weakref.ref(model), ctx.record, ctx.record_later, trainable, policy, by_mode))
        if self._hook is None:  # stays until disable(): see _at_step
            self._hook = register_optimizer_step_pre_hook(self._at_step)
            self.session.patches.add_handle(self._hook, "fp4: layers frozen after adoption, looked at the next step")

    def _at_step(self, opt, args, kwargs) -> None:
        """The optimizer step pre-hook of :meth:`_watch`: name the watched models' layers frozen
        since their adoption that FP4 storage would take now; with none watched it returns at once.
        It is not removed before ``disable()``: torch iterates over its global pre-hooks while it
        runs, and so does paging's step, which runs the optimizer's own hooks from inside its
        global one: a removal from inside a step raised "OrderedDict mutated during iteration"
        wherever a global hook registered later followed (the review of 2026-11-29). Never raises."""
        if not self._watched or torch.compiler.is_compiling():  # the cheap test first: it runs every step
            return
        watched, self._watched = self._watched, []
        for ref, rec, record_later, ids, policy, by_mode in watched:
            try:
                model = ref()
                if model is not None:
                    self._note_frozen_after(model, rec, record_later, ids, policy, by_mode)
            except Exception as err:  # noqa: BLE001 - a diagnostic must never break training
                log.debug("fp4: looking at layers frozen after adoption: %s", err)

    def _note_frozen_after(self, model: nn.Module, rec: ModelRecord, record_later, ids: frozenset,
                           policy: FP4Policy, by_mode: bool) -> None:
        # a paged layer is refused by the planner now (paging holds its weight), yet was frozen late
        # all the same: named too (the same fix applies: freeze before the model is moved)
        now = [c for c in plan_fp4(model, policy, "storage") if id(c.module) in ids
               and (c.convert or c.reason.startswith("paged by the switch"))]
        outside = held_outside(model, now)
        now = [c for c in now if id(c.module) not in outside]
        if by_mode:
            copies = copies_of_trainable(model, now)
            now = [c for c in now if id(c.module) not in copies]
        if not now:
            return
        names = [c.name for c in now]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        note = (f"{len(names)} nn.Linear layer(s) frozen after the model was adopted ({rec.trigger}) stay dense: "
                f"{shown}; FP4 storage is decided at adoption. Freeze them before the model is moved with .to() "
                "or first called")
        log.warning("fp4: %s: %s", rec.name, note)
        entry = rec.features.get(self.name, {})
        details = {k: v for k, v in entry.items() if k not in ("requested", "chosen", "reason")}
        record_later(Decision(self.name, entry.get("requested", "off"), entry.get("chosen", "off"),
                              f"{entry.get('reason', '')}; {note}", details={**details, "frozen_after_adoption": names}))

    def apply(self, model: nn.Module, ctx: AdoptionContext, patches: PatchSet, decision: Decision) -> Decision:
        # a model adopted at a call under inference_mode (a zero-shot evaluation first): the codes,
        # and the released weights, made there were inference tensors, which can never be unfrozen
        # ("Setting requires_grad=True on inference tensor outside InferenceMode": a probe's finding)
        with torch.inference_mode(False):
            return self._apply(model, ctx, patches, decision)

    def _apply(self, model: nn.Module, ctx: AdoptionContext, patches: PatchSet, decision: Decision) -> Decision:
        policy, convert, skipped, compute, native_why = decision.plan
        layers, before, after, not_freed = [], 0, 0, []
        # in three passes, so that a failure before the last leaves every original weight as it
        # was: the undo stack puts the nn.Linear layers back untouched (until 2026-11-28 each weight
        # was released as its layer was converted: an error later in the loop, contained by the
        # adopter, left the converted layers with FP4-rounded weights: a review probe's finding)
        built = [(c, FP4Linear.from_linear(c.module, policy.format, policy.scale_rule, compute=compute))
                 for c in convert]
        for c, new in built:
            setattr(c.parent, c.attr, new)
            patches.add_undo(_undo(c.parent, c.attr, c.module, new), f"fp4: {c.name} back to nn.Linear", owner=new)
            # checkpoints saved meanwhile load into the model's own class without the switch
            patches.add_handle(new.register_state_dict_post_hook(state_dict_as_linear),
                               f"fp4: {c.name} state_dict as nn.Linear")
        summaries = {id(c): c.summary() for c, _ in built}  # before the release: the weight's shape
        for c, new in built:
            released = release_parameter(c.module.weight)
            new.hold_released(c.module.weight)  # listed in parameters() as before; unfrozen, it trains again
            before += released["bytes"]
            after += new.weight_nbytes()
            if released["freed"] is False:
                not_freed.append(c.name)
            layers.append({**summaries[id(c)], "format": policy.format, "bytes_before": released["bytes"],
                           "bytes_after": new.weight_nbytes(), "freed": released["freed"]})
        try:
            release_free_memory()
        except Exception as err:  # noqa: BLE001 - giving freed memory back to the system is best effort
            log.debug("fp4: release_free_memory: %s", err)
        fmt = policy.format.upper() + (f" ({policy.scale_rule.upper()})" if policy.format == "mxfp4" else "")
        path = ("native FP4 matmul where the layer's sizes fit the kernel" if compute == "auto"
                else "emulated: dequantized to the compute dtype on every call")
        reason = (f"stored {len(convert)} frozen nn.Linear layer(s) in {fmt}: {format_size(before)} -> "
                  f"{format_size(after)} (saved {format_size(before - after)}); compute: {path}")
        if not_freed:
            reason += (f"; {len(not_freed)} weight(s) still referenced elsewhere, so their memory is not freed yet: "
                       f"{', '.join(not_freed[:3])}")
        if skipped:
            reason += f"; skipped {len(skipped)}: {_skip_summary(skipped)}"
        reason += "; disable() restores nn.Linear with the FP4-rounded weights"
        log.info("fp4: %s", reason)
        return decision.amend(reason=reason, details={
            "format": policy.format, "scale_rule": policy.scale_rule if policy.format == "mxfp4" else None,
            "compute": "native where it fits" if compute == "auto" else "emulated", "compute_reason": native_why,
            "converted": layers, "skipped": [c.summary() for c in skipped],
            "bytes_before": before, "bytes_after": after, "bytes_saved": before - after,
        })


def _undo(parent: nn.Module, attr: str, old: nn.Linear, new: FP4Linear):
    """Put ``old`` back in ``parent.attr`` in place of ``new``. Holds ``parent`` and ``new`` weakly,
    and ``old`` only while ``new`` lives (until 2026-11-28 it held all three, so the undo stack kept
    every model whose layers were stored in FP4 alive until ``disable()``: a probe's finding)."""
    parent_ref, new_ref = weakref.ref(parent), weakref.ref(new)
    original = weakref.WeakKeyDictionary({new: old})

    def undo():
        p, n = parent_ref(), new_ref()
        if p is None or n is None:
            return  # the model was dropped: nothing to give back
        o = original[n]
        if getattr(p, attr, None) is n:
            setattr(p, attr, o)
        else:  # wrapped after adoption (a LoRA wrapper holding it as its base): put back where it is now
            for mod in p.modules():
                for name, child in list(mod._modules.items()):
                    if child is n:
                        mod._modules[name] = o
        if n.dense:  # unfrozen, or given a Parameter of the script's: the nn.Linear gets the one it holds
            w = n._parameters["weight"]
            if o.weight is not w:
                o.weight = w
        elif o.weight.numel() == 0:  # give the original Parameter object its (FP4-rounded) values back,
            o.weight.data = n.dense_weight()  # in the dtype and on the device the layer has now (model.to())
        if n.bias is not o.bias:  # a bias the script assigned to the FP4 layer
            o.bias = n.bias
    return undo
