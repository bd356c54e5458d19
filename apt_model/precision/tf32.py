"""The switch's TF32 step: fp32 matmuls on TF32 tensor cores where the device has them.

TF32 keeps fp32's range and rounds matmul inputs to a 10-bit mantissa (NVIDIA Ampere and later,
compute capability >= 8.0; PyTorch docs, "TensorFloat-32 (TF32) on Ampere (and later) devices").
It changes numerics, so it is a mode's decision: ``tf32=auto`` in performance, balanced and full;
``off`` in memory mode, whose promise is the script's own fp32. It is process-wide state
(``torch.backends.cuda.matmul.fp32_precision``), decided once per switch session at the first
adopted model on a CUDA device and restored by ``disable()``. It is written through the legacy
``torch.backends.cuda.matmul.allow_tf32`` flag, which sets both of PyTorch's settings (the new
``fp32_precision`` and the legacy ``float32_matmul_precision``). Writing only the new one leaves
the two disagreeing: PyTorch then raises "mix of the legacy and new APIs" from every read of the
legacy one (``torch.get_float32_matmul_precision()``, ``allow_tf32``), as Lightning, Inductor's
autotuning and many scripts do. A script that already chose a matmul precision keeps its choice.
cuDNN convolutions already default to TF32 in PyTorch and are left alone.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from apt_model.base.feature import AdoptionContext, Decision, FeatureStep
from apt_model.base.patches import PatchSet


def _matmul_precision() -> str | None:
    """``torch.backends.cuda.matmul.fp32_precision`` (``none``, ``ieee``, ``tf32``), or None when it
    cannot be read (the script set TF32 through the legacy flags)."""
    try:
        return str(torch.backends.cuda.matmul.fp32_precision)
    except Exception:  # noqa: BLE001 - torch raises on a mix of the legacy and new APIs
        return None


class TF32Step(FeatureStep):
    """Feature ``tf32`` (``auto``, ``off``); see the module docstring."""

    name = "tf32"

    def __init__(self, session):
        super().__init__(session)
        self.decided: Decision | None = None  # the session's decision (process-wide state)

    def decide(self, model: nn.Module, ctx: AdoptionContext) -> Decision:
        req, dev = ctx.config.tf32, ctx.device
        if req == "off":
            return Decision(self.name, req, "ieee fp32", "tf32=off: fp32 matmuls stay IEEE fp32")
        if dev.type != "cuda" or torch.version.hip is not None:
            return Decision(self.name, req, "ieee fp32", f"TF32 is an NVIDIA tensor-core format; {dev} has none "
                            "(fp32 matmuls stay IEEE fp32)")
        if self.decided is not None:
            return self.decided.amend(reason=f"decided for this session at the first model: {self.decided.reason}",
                                      act=False)
        major, minor = torch.cuda.get_device_capability(dev)
        if major < 8:
            self.decided = Decision(self.name, req, "ieee fp32", f"{dev} is compute capability {major}.{minor}; TF32 "
                                    "tensor cores start at 8.0 (Ampere)")
            return self.decided
        current = _matmul_precision()
        if current not in ("none", "ieee"):
            self.decided = Decision(self.name, req, current or "set by the script",
                                    "the script chose its fp32 matmul precision itself: left as it is")
            return self.decided
        self.decided = Decision(self.name, req, "tf32", f"{dev} (compute capability {major}.{minor}) has TF32 tensor "
                                "cores: fp32 matmuls use them (10-bit mantissa inputs, fp32 accumulation)", act=True,
                                plan=current)
        return self.decided

    def apply(self, model: nn.Module, ctx: AdoptionContext, patches: PatchSet, decision: Decision) -> Decision:
        previous = decision.plan

        def undo():
            torch.backends.cuda.matmul.allow_tf32 = False  # both settings back to IEEE fp32, in agreement
            torch.backends.cuda.matmul.fp32_precision = previous  # "none" (inherit) or "ieee", as it was

        torch.backends.cuda.matmul.allow_tf32 = True  # both settings: fp32_precision "tf32", precision "high"
        patches.add_undo(undo, f"fp32 matmul precision back to {previous}")
        return decision
