"""Adopting a model: deciding, per feature, what the switch does to it — and recording why.

A model is adopted once: when the script moves it (``model.to(...)``, ``model.cuda()``), when it
is first called, or by ``vb.adopt(model)``. Adoption never replaces parameters (an optimizer built
before or after keeps training the same tensors); it only attaches hooks and flips attention
implementations, all undone by ``disable()``.
"""
from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from apt_model.attention.routing import find_attention_targets, route_to_sdpa
from apt_model.devices.capabilities import Speed, Support, get_speed, get_support
from apt_model.precision.autocast import attach_autocast
from apt_model.precision.trial import SpeedTrial
from apt_model.quantization.policy import apply_fp4_policy
from apt_model.switch.config import VBConfig
from apt_model.switch.modes import FEATURES
from apt_model.switch.patches import PatchSet
from apt_model.switch.placement import attach_mismatch_hint
from apt_model.switch.report import DecisionLog

_AMP_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


@dataclass
class ModelRecord:
    """What adoption did to one model. ``features[name]`` is ``{"chosen": ..., "reason": ...}``."""

    id: int
    name: str
    trigger: str
    device: str
    parameters: int
    width: int | None
    features: dict = field(default_factory=dict)
    ref: weakref.ref | None = field(default=None, repr=False)

    @property
    def scope(self) -> str:
        return f"model:{self.name}#{self.id}"

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "name": self.name,
            "trigger": self.trigger,
            "device": self.device,
            "parameters": self.parameters,
            "width": self.width,
            "alive": self.ref is not None and self.ref() is not None,
            "features": self.features,
        }


def infer_width(model: nn.Module) -> int | None:
    """The model's hidden size: the ``in_features`` / ``embedding_dim`` carrying the most weights."""
    weight: Counter = Counter()
    for m in model.modules():
        if isinstance(m, nn.Linear):
            weight[m.in_features] += m.weight.numel()
        elif isinstance(m, nn.Embedding):
            weight[m.embedding_dim] += m.weight.numel()
    return weight.most_common(1)[0][0] if weight else None


def model_device(model: nn.Module) -> torch.device | None:
    """Device of the model's first parameter (or buffer); None for a model with neither."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return None


def _param_dtype(model: nn.Module) -> torch.dtype | None:
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return Counter(floats).most_common(1)[0][0] if floats else None


class Adopter:
    """Applies a :class:`VBConfig` to models, recording every decision in a :class:`DecisionLog`."""

    def __init__(self, config: VBConfig, selected: torch.device, log: DecisionLog, patches: PatchSet, stack=None):
        self.config = config
        self.selected = selected
        self.log = log
        self.patches = patches
        self.stack = stack
        self.session = None  # the paging session, created when a model first needs paging
        from apt_model.activations.manager import ActivationManager

        self.activations = ActivationManager(config, patches, stack, selected)
        self.distributed = None  # the DistributedSession (set by the switch): DDP/FSDP/DataParallel policy
        self.records: list[ModelRecord] = []
        self.speeds: dict[str, dict] = {}
        self.supports: dict[str, dict] = {}

    # ------------------------------------------------------------------ entry point
    def adopt(self, model: nn.Module, trigger: str, moved_note: str = "") -> ModelRecord:
        """Decide every feature for ``model`` (placement, attention, precision, activations, FP4,
        distributed, paging), apply what was chosen, and return the record with each reason.
        ``trigger`` says what caused adoption (``to()``, ``first forward``, ``adopt()``)."""
        dev = model_device(model) or torch.device("cpu")
        rec = ModelRecord(
            id=len(self.records) + 1,
            name=type(model).__name__,
            trigger=trigger,
            device=str(dev),
            parameters=sum(p.numel() for p in model.parameters()),
            width=infer_width(model),
            ref=weakref.ref(model),
        )
        self.records.append(rec)
        self._placement(rec, dev, trigger, moved_note)
        attach_mismatch_hint(model, self.patches)
        need_probe = self.config.attention != "off" or self.config.mixed_precision != "off"
        support = self._support(dev) if need_probe else None
        speed = self._speed(dev, rec.width) if need_probe and self._wants_speed() else None
        self._attention(model, rec, support, speed)
        self._precision(model, rec, dev, support, speed)
        self.activations.adopt(model, rec, self._decide)
        apply_fp4_policy(model, rec, self.config, support, self.patches, self._decide)  # before paging: it shrinks frozen weights
        no_paging = self.distributed.adopt(model, rec, self._decide) if self.distributed is not None else None
        self._paging(model, rec, dev, no_paging)
        self._not_built(rec)
        return rec

    # ------------------------------------------------------------------ probes
    def _support(self, dev: torch.device) -> Support:
        sup = get_support(dev)
        self.supports[sup.device] = sup.to_dict()
        return sup

    def _wants_speed(self) -> bool:
        return self.config.attention == "auto" or self.config.mixed_precision in ("auto", "bf16", "fp16")

    def _speed(self, dev: torch.device, width: int | None) -> Speed:
        dtypes = ("bfloat16",) if self.config.mixed_precision != "fp16" else ("bfloat16", "float16")
        sp = get_speed(dev, width, dtypes)
        self.speeds[f"{sp.device}/w{sp.width}"] = sp.to_dict()
        return sp

    # ------------------------------------------------------------------ decisions
    def _decide(self, rec: ModelRecord, feature: str, requested, chosen, reason: str, tried=None) -> None:
        rec.features[feature] = {"requested": requested, "chosen": chosen, "reason": reason}
        self.log.record(rec.scope, feature, requested, chosen, reason, tried)

    def _placement(self, rec: ModelRecord, dev: torch.device, trigger: str, moved_note: str) -> None:
        sel = self.selected
        same = dev.type == sel.type and (dev.index or 0) == (sel.index or 0)
        if trigger == "to()":
            why = f"moved by the script to {dev}{moved_note}"
            if not same:
                why += f"; the selected device is {sel}, but an explicit placement is kept"
        elif same:
            why = f"already on the selected device {sel}"
        else:
            why = (f"left on {dev}: the script never moved it (inputs it builds are on {dev} too); "
                   f"move it with model.to(vb.device()) to use {sel}")
        self._decide(rec, "placement", str(sel), str(dev), why)

    def _attention(self, model: nn.Module, rec: ModelRecord, support: Support | None, speed: Speed | None) -> None:
        req = self.config.attention
        targets = find_attention_targets(model)
        eager = [t for t in targets if t.state == "eager"]
        if req == "off":
            self._decide(rec, "attention", req, "as written", "attention=off")
            return
        if not eager:
            fused = [t for t in targets if t.state == "sdpa"]
            why = (f"already fused: {len(fused)} attention site(s) use SDPA" if fused else
                   "nothing to route: no nn.MultiheadAttention, Hugging Face eager attention, or "
                   "module declaring supported_attn_implementations")
            stuck = [t for t in targets if t.state not in ("eager", "sdpa")]
            if stuck:
                why += f"; {len(stuck)} site(s) cannot use SDPA ({', '.join(sorted({t.state for t in stuck}))})"
            self._decide(rec, "attention", req, "as written", why)
            return
        runs = support.sdpa_backends_for("float32") if support else []
        if not runs:
            self._decide(rec, "attention", req, "as written",
                         f"SDPA does not run on {rec.device}: {support.sdpa_backends if support else 'not probed'}")
            return
        tried = [f"SDPA backends that run: {', '.join(runs)}"]
        if req == "auto":
            att = speed.attention if speed else {}
            if "error" in att or "speedup" not in att:
                self._decide(rec, "attention", req, "as written", f"speed probe failed: {att.get('error', 'not run')}", tried)
                return
            tried.append(f"probe width {speed.width}: hand-written {att['eager_ms']} ms vs SDPA {att['sdpa_ms']} ms")
            if att["speedup"] < self.config.sdpa_min_speedup:
                self._decide(rec, "attention", req, "as written",
                             f"SDPA measured {att['speedup']:.2f}x vs hand-written attention on {rec.device}, "
                             f"below the {self.config.sdpa_min_speedup:.2f}x threshold", tried)
                return
            why = f"SDPA {att['speedup']:.2f}x faster than hand-written attention on {rec.device}"
        else:
            why = "forced by attention=sdpa"
        routed = route_to_sdpa(eager, self.patches)
        self._decide(rec, "attention", req, "sdpa", f"{why}; routed {len(routed)} site(s): {', '.join(routed)}", tried)

    def _precision(self, model: nn.Module, rec: ModelRecord, dev: torch.device,
                   support: Support | None, speed: Speed | None) -> None:
        req = self.config.mixed_precision
        if req == "off":
            self._decide(rec, "mixed_precision", req, "fp32", "mixed_precision=off")
            return
        pdt = _param_dtype(model)
        if pdt is not None and pdt != torch.float32:
            self._decide(rec, "mixed_precision", req, str(pdt).replace("torch.", ""),
                         f"parameters are {str(pdt).replace('torch.', '')}: the script manages precision")
            return
        if not torch.amp.is_autocast_available(dev.type):
            self._decide(rec, "mixed_precision", req, "fp32", f"autocast is not available for device type {dev.type}")
            return
        want = "bf16" if req == "auto" else req
        dname = _AMP_DTYPES[want]
        probe = (speed.autocast.get(dname, {}) if speed else {}) or {"error": "not probed"}
        computes = support.dtype_computes(dname) if support else False
        tried = [f"{dname} matmul/add on {dev}: {'run' if computes else 'fail'}"]
        if "speedup" in probe:
            tried.append(f"probe width {speed.width}: fp32 {probe['fp32_ms']} ms vs {want} autocast {probe['autocast_ms']} ms"
                         + (" (stopped early: over 3x slower)" if probe.get("aborted") else "")
                         + (f" ({probe['stopped']})" if probe.get("stopped") else ""))
        if not computes or "error" in probe:
            err = probe.get("error") or support.dtypes.get(dname, {}).get("errors")
            self._decide(rec, "mixed_precision", req, "fp32", f"{want} autocast does not run on {dev}: {err}", tried)
            return
        ratio = probe["speedup"]
        if req == "auto":
            note = "; fp16 is never chosen automatically (it needs loss scaling in the training loop)"
            if ratio < self.config.autocast_min_speedup:
                slower = f"{1 / ratio:.1f}x slower than" if ratio < 1 else f"only {ratio:.2f}x the speed of"
                if "pilot_speedup" in probe:  # a small pilot looked faster; too small to rule bf16 in
                    slower = (f"not shown faster than (a {probe['pilot_speedup']:.2f}x pilot on a small shape "
                              f"cannot rule it in; the full-size run did not fit the probe's time budget)")
                self._decide(rec, "mixed_precision", req, "fp32",
                             f"bf16 autocast off: probe {slower} fp32 on {dev} "
                             f"(threshold {self.config.autocast_min_speedup:.2f}x){note}", tried)
                return
            why = f"bf16 autocast {ratio:.2f}x faster than fp32 on {dev}{note}"
            trial = SpeedTrial(self.config.autocast_trial_calls, self.config.autocast_trial_min_speedup)
            if trial.running:
                why += (f"; on trial: the model's first training calls alternate autocast on/off; once step "
                        f"times settle, {trial.calls} timed calls decide, and it stays on only if clearly faster")
            attach_autocast(model, dev.type, getattr(torch, dname), self.patches, trial,
                            lambda keep, summary: self._trial_verdict(rec, want, keep, summary), device=dev)
            self._decide(rec, "mixed_precision", req, want, why, tried)
            return
        why = f"forced by mixed_precision={req} (probe: {ratio:.2f}x vs fp32)"
        if req == "fp16":
            why += "; use torch.amp.GradScaler in the training loop to avoid gradient underflow"
        attach_autocast(model, dev.type, getattr(torch, dname), self.patches, device=dev)
        self._decide(rec, "mixed_precision", req, want, why, tried)

    def _trial_verdict(self, rec: ModelRecord, want: str, keep: bool, summary: dict) -> None:
        timing = (f"{want} {summary['on_ms']} ms vs fp32 {summary['off_ms']} ms per forward+backward, median of "
                  f"{summary['calls'] // 2} calls each after {summary['settle_calls']} settling calls: "
                  f"{summary['speedup']:.2f}x")
        if keep:
            why = f"kept after the trial on this model: {timing} (>= {summary['min_speedup']:.2f}x, clear win)"
        elif summary["speedup"] >= summary["min_speedup"]:
            why = (f"turned off after the trial on this model: {timing}, but the timings overlap "
                   "(no clear win even after extending the trial), so the script's own precision is kept")
        else:
            why = f"turned off after the trial on this model: {timing}, below {summary['min_speedup']:.2f}x"
        self._decide(rec, "mixed_precision", "auto", want if keep else "fp32", why)
        rec.features["mixed_precision"]["trial"] = summary

    def _paging(self, model: nn.Module, rec: ModelRecord, dev: torch.device, blocked: str | None = None) -> None:
        from apt_model.memory.placement import plan_placement

        req = self.config.paging
        if req == "off" or self.stack is None:
            self._decide(rec, "paging", req, "off", "paging=off")
            return
        if blocked:  # data parallelism (DDP, FSDP, DataParallel) reads the storage paging frees
            self._decide(rec, "paging", req, "off", blocked)
            return
        budget = self.stack.compute_budget
        plan = plan_placement(model, budget, None, force=req == "always")
        if not plan.paged:
            self._decide(rec, "paging", req, "resident", plan.reason)
            rec.features["paging"]["plan"] = plan.to_dict()
            return
        bw = self.stack.measure()
        plan = plan_placement(model, budget, bw["disk"], force=req == "always", levels=self.stack.levels, device=dev)
        if self.session is None:
            from apt_model.memory.paging.session import PagingSession

            host = None if self.stack.shared_host else self.stack.levels[1].capacity
            self.session = PagingSession(budget, self.stack.swap, self.patches, page_states=plan.page_states,
                                         device=dev, host_budget=host)
        self.session.optimizers.page_states |= plan.page_states
        self.session.page_model(model, plan.page_params, plan.page_grads)
        self._decide(rec, "paging", req, "paged", plan.reason,
                     [str(level) for level in self.stack.levels])
        rec.features["paging"]["plan"] = plan.to_dict()

    def _not_built(self, rec: ModelRecord) -> None:
        for name, spec in FEATURES.items():
            if spec.built:
                continue
            value = self.config.features[name]
            if value in (False, "off"):
                continue
            rec.features[name] = {"requested": value, "chosen": "off", "reason": "not built in this version"}
