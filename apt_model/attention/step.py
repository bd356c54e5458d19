"""The switch's attention step: route eager attention sites to SDPA where it runs and is not slower.

Decision (per adopted model, from :func:`~apt_model.attention.routing.find_attention_targets`
and the device's probes):

* ``attention=off``, or no eager site (none found, or already on SDPA): ``as written``;
* the model is itself an ``nn.MultiheadAttention`` adopted inside its first call: ``as written``
  (that call returned attention weights; routing would make the later ones return ``None``);
* SDPA runs on no backend for fp32 on the model's device: ``as written``, with the probe's errors;
* ``auto``: the probe at the model's width must measure SDPA at least ``sdpa_min_speedup`` times
  as fast as hand-written attention; ``sdpa`` forces it. Then every eager site is routed
  (:func:`~apt_model.attention.routing.route_to_sdpa`, undone by ``disable()``).
"""
from __future__ import annotations

import torch.nn as nn

from apt_model.attention.routing import find_attention_targets, route_to_sdpa
from apt_model.base import graph_reuse
from apt_model.base.feature import AdoptionContext, Decision, FeatureStep
from apt_model.base.patches import PatchSet


class AttentionStep(FeatureStep):
    """Feature ``attention`` (values ``auto``, ``sdpa``, ``off``); see the module docstring."""

    name = "attention"

    def decide(self, model: nn.Module, ctx: AdoptionContext) -> Decision:
        cfg = ctx.config
        req = cfg.attention
        targets = find_attention_targets(model)
        if req == "off":
            return Decision(self.name, req, "as written", "attention=off")
        if ctx.trigger == "first forward" and any(t.name == "" and t.kind == "mha" for t in targets):
            # a bare nn.MultiheadAttention adopted inside its first call: that call returns weights
            # (the hook cannot change its arguments), so routing the later calls would change what
            # the same call returns, weights then None (a probe's finding, 2026-11-27)
            return Decision(self.name, req, "as written",
                            "the model is an nn.MultiheadAttention adopted inside its first call, which returned "
                            "attention weights: its later calls are left to return them too (move it with .to() "
                            "or vb.adopt() it before calling it to have it routed)")
        eager = [t for t in targets if t.state == "eager"]
        if not eager:
            fused = [t for t in targets if t.state == "sdpa"]
            why = (f"already fused: {len(fused)} attention site(s) use SDPA" if fused else
                   "nothing to route: no nn.MultiheadAttention or "
                   "module declaring supported_attn_implementations")
            stuck = [t for t in targets if t.state not in ("eager", "sdpa")]
            if stuck:
                why += f"; {len(stuck)} site(s) left as they are ({', '.join(sorted({t.state for t in stuck}))})"
            return Decision(self.name, req, "as written", why)
        support = ctx.support()
        dev = ctx.record.device
        runs = support.sdpa_backends_for("float32") if support else []
        if not runs:
            return Decision(self.name, req, "as written",
                            f"SDPA does not run on {dev}: {support.sdpa_backends if support else 'not probed'}")
        tried = [f"SDPA backends that run: {', '.join(runs)}"]
        if req == "auto":
            speed = ctx.speed()
            att = speed.attention if speed else {}
            if "error" in att or "speedup" not in att:
                return Decision(self.name, req, "as written", f"speed probe failed: {att.get('error', 'not run')}", tried)
            tried.append(f"probe width {speed.width}: hand-written {att['eager_ms']} ms vs SDPA {att['sdpa_ms']} ms")
            if att["speedup"] < cfg.sdpa_min_speedup:
                return Decision(self.name, req, "as written",
                                f"SDPA measured {att['speedup']:.2f}x vs hand-written attention on {dev}, "
                                f"below the {cfg.sdpa_min_speedup:.2f}x threshold", tried)
            why = f"SDPA {att['speedup']:.2f}x faster than hand-written attention on {dev}"
        else:
            why = "forced by attention=sdpa"
        return Decision(self.name, req, "sdpa", why, tried, act=True, plan=eager)

    def apply(self, model: nn.Module, ctx: AdoptionContext, patches: PatchSet, decision: Decision) -> Decision:
        reuse = graph_reuse.watch_for(self.session.services, self.session.patches)
        routed = route_to_sdpa(decision.plan, patches, reuse)
        return decision.amend(reason=f"{decision.reason}; routed {len(routed)} site(s): {', '.join(routed)}")
