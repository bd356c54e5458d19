"""The switch's mixed-precision step: autocast where the device is measurably faster with it.

Decision (per adopted model):

* ``mixed_precision=off``, parameters not fp32 (the script manages precision; complex-valued
  parameters only: autocast casts none), or autocast not available for the device type: ``fp32``
  (or the parameters' dtype), nothing attached;
* the low-precision dtype must compute on the device (support probe) and its speed probe must
  have run;
* ``auto``: bf16 only (fp16 needs loss scaling in the loop), and only where the probe at the
  model's width measured autocast at least ``autocast_min_speedup`` times as fast as fp32; then
  the on-line trial on the model itself (:class:`~apt_model.devices.trial.SpeedTrial`) keeps it
  only if it clearly wins, recording its verdict later;
* ``bf16`` / ``fp16``: forced, with the probe's ratio recorded.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn

from apt_model.base.feature import AdoptionContext, Decision, FeatureStep
from apt_model.base.patches import PatchSet
from apt_model.precision.autocast import attach_autocast
from apt_model.devices.rank_agreement import agreement_note, ranks_suffix
from apt_model.devices.trial import SpeedTrial

_AMP_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def _param_dtype(model: nn.Module) -> torch.dtype | None:
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return Counter(floats).most_common(1)[0][0] if floats else None


class PrecisionStep(FeatureStep):
    """Feature ``mixed_precision`` (``auto``, ``bf16``, ``fp16``, ``off``); see the module docstring."""

    name = "mixed_precision"

    def __init__(self, session):
        super().__init__(session)
        self.hooks: list = []  # the AutocastHooks attached this session (for the call counter)

    def decide(self, model: nn.Module, ctx: AdoptionContext) -> Decision:
        cfg, dev = ctx.config, ctx.device
        req = cfg.mixed_precision
        if req == "off":
            return Decision(self.name, req, "fp32", "mixed_precision=off")
        pdt = _param_dtype(model)
        if pdt is not None and pdt != torch.float32:
            name = str(pdt).replace("torch.", "")
            return Decision(self.name, req, name, f"parameters are {name}: the script manages precision")
        if pdt is None:
            kinds = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
            if kinds:  # complex-valued (or integer) parameters only: the report read bf16 (a probe's finding)
                return Decision(self.name, req, kinds[0] if len(kinds) == 1 else "as written",
                                f"parameters are {', '.join(kinds)}, none real floating point: autocast would "
                                "cast none of them; the script's precision is kept")
        if not torch.amp.is_autocast_available(dev.type):
            return Decision(self.name, req, "fp32", f"autocast is not available for device type {dev.type}")
        want = "bf16" if req == "auto" else req
        dname = _AMP_DTYPES[want]
        support, speed = ctx.support(), ctx.speed()
        probe = (speed.autocast.get(dname, {}) if speed else {}) or {"error": "not probed"}
        computes = support.dtype_computes(dname) if support else False
        tried = [f"{dname} matmul/add on {dev}: {'run' if computes else 'fail'}"]
        if "speedup" in probe:
            tried.append(f"probe width {speed.width}: fp32 {probe['fp32_ms']} ms vs {want} autocast {probe['autocast_ms']} ms"
                         + (" (stopped early: over 3x slower)" if probe.get("aborted") else "")
                         + (f" ({probe['stopped']})" if probe.get("stopped") else ""))
        if not computes or "error" in probe:
            err = probe.get("error") or support.dtypes.get(dname, {}).get("errors")
            return Decision(self.name, req, "fp32", f"{want} autocast does not run on {dev}: {err}", tried)
        ratio = probe["speedup"]
        if req != "auto":
            why = f"forced by mixed_precision={req} (probe: {ratio:.2f}x vs fp32)"
            if req == "fp16":
                why += "; use torch.amp.GradScaler in the training loop to avoid gradient underflow"
            return Decision(self.name, req, want, why, tried, act=True, plan=(dname, None))
        note = "; fp16 is never chosen automatically (it needs loss scaling in the training loop)"
        if torch.are_deterministic_algorithms_enabled() and cfg.autocast_trial_calls:
            # the trial alternates bf16 and fp32 calls and its verdict depends on timing: two runs of
            # one script computed differently (a probe: three runs, three results, bf16 kept once)
            return Decision(self.name, req, "fp32", "torch.use_deterministic_algorithms(True) is on: the on-line "
                            "trial's verdict depends on timing, so runs of the script would differ; the script's "
                            "precision is kept (mixed_precision='bf16' forces bf16, the same in every run)", tried)
        if ratio < cfg.autocast_min_speedup:
            # two decimals below 10x: a 0.97x probe read "1.0x slower" (a probe's finding)
            slower = (f"{1 / ratio:.2f}x slower than" if 1 / ratio < 10 else f"{1 / ratio:.1f}x slower than") \
                if ratio < 1 else f"only {ratio:.2f}x the speed of"
            if "pilot_speedup" in probe:  # a small pilot looked faster; too small to rule bf16 in
                slower = (f"not shown faster than (a {probe['pilot_speedup']:.2f}x pilot on a small shape "
                          f"cannot rule it in; the full-size run did not fit the probe's time budget)")
            return Decision(self.name, req, "fp32", f"bf16 autocast off: probe {slower} fp32 on {dev} "
                            f"(threshold {cfg.autocast_min_speedup:.2f}x){note}", tried)
        why = (f"bf16 autocast {ratio:.2f}x faster than fp32 on {dev}{note}" if ratio >= 1 else
               f"bf16 autocast {1 / ratio:.2f}x slower than fp32 on {dev}, within the autocast_min_speedup "
               f"threshold {cfg.autocast_min_speedup:.2f}x{note}")
        trial = SpeedTrial(cfg.autocast_trial_calls, cfg.autocast_trial_min_speedup)
        if trial.running:
            why += (f"; on trial: the model's first training calls alternate autocast on/off; once step "
                    f"times settle, {trial.calls} timed calls decide, and it stays on only if clearly faster")
        return Decision(self.name, req, want, why, tried, act=True, plan=(dname, trial),
                        facts={"autocast_trial": trial} if trial.running else {})

    def apply(self, model: nn.Module, ctx: AdoptionContext, patches: PatchSet, decision: Decision) -> Decision:
        dname, trial = decision.plan
        want = decision.chosen
        req = ctx.config.mixed_precision
        def on_verdict(keep: bool, summary: dict) -> None:  # called after the trial: ``hooks`` is made by then
            verdict = self._verdict(req, want, keep, summary, script_calls=hooks.counts["script"])
            ctx.record_later(verdict.amend(details={**verdict.details, "calls": hooks.counts}))

        agreement = ctx.session.services.get("agreement")
        channel = agreement.channel(model, self.name) if agreement is not None and trial else None
        hooks = attach_autocast(model, ctx.device.type, getattr(torch, dname), patches, trial, on_verdict,
                                device=ctx.device, channel=channel, screen=True)
        self.hooks.append(hooks)
        ctx.on_first_call(lambda module, args, kwargs: hooks.adopting_call(module, args))
        # the hooks' live call counts, in every decision about this model (the report shows them)
        decision = decision.amend(details={**decision.details, "calls": hooks.counts})
        if hooks.timer is not None:  # the compile ladder waits for the verdict, rank 0's included
            return decision.amend(facts={"autocast_trial": hooks.timer})
        return decision

    def _verdict(self, req: str, want: str, keep: bool, summary: dict, script_calls: int = 0) -> Decision:
        if summary.get("failed"):  # a forward raised under autocast and ran again without it
            return Decision(self.name, req, "fp32", f"turned off: {summary['failed']}; the model's calls run as "
                            "written from then on", details={"trial": summary} if "calls" in summary else {})
        if summary.get("gave_up"):
            # the script's own autocast (Lightning's bf16-mixed, accelerate's) ran its calls: "fp32"
            # would misreport them (a probe's finding)
            chosen = "as written" if script_calls else "fp32"
            return Decision(self.name, "auto", chosen, f"turned off: the trial on this model gave up ({summary['gave_up']}), "
                            "so the script's own precision is kept", details={"trial": summary})
        timing = (f"{want} {summary['on_ms']} ms vs fp32 {summary['off_ms']} ms per forward+backward, median of "
                  f"{summary['calls'] // 2} calls each after {summary['settle_calls']} settling calls: "
                  f"{summary['speedup']:.2f}x")
        followed = agreement_note(keep, summary, timing)
        if followed is not None:
            return Decision(self.name, "auto", want if keep else "fp32", followed, details={"trial": summary})
        suffix = ranks_suffix(summary)
        if keep:
            why = f"kept after the trial on this model: {timing} (>= {summary['min_speedup']:.2f}x, clear win)"
        elif summary["speedup"] >= summary["min_speedup"]:
            overlap = ("the timings overlap" if summary["min_speedup"] >= 1 else
                       f"its slower calls overlap the {summary['min_speedup']:.2f}x allowance")
            why = (f"turned off after the trial on this model: {timing}, but {overlap} "
                   "(no clear win even after extending the trial), so the script's own precision is kept")
        else:
            why = f"turned off after the trial on this model: {timing}, below {summary['min_speedup']:.2f}x"
            if summary.get("stopped_early"):
                why += " (stopped while settling: clearly slower)"
        return Decision(self.name, "auto", want if keep else "fp32", why + suffix, details={"trial": summary})

    def stats(self) -> dict:
        return {"autocast_calls": sum(getattr(h, "calls", 0) for h in self.hooks)}
