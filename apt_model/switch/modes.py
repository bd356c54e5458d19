"""The modes and the feature toggles they request (DESIGN.md section 3).

Every cell is a *request*: the device's probed capabilities decide, and the decision with its
reason goes into the report. Features not built in this version are carried in the config and
shown as "not built" in the banner and report — never pretended.
"""
from __future__ import annotations

from dataclasses import dataclass

from apt_model.base.errors import ConfigError

MODES = ("performance", "speed", "balanced", "memory", "full")
MODE_ALIASES = {"speed": "performance"}
DEFAULT_MODE = "balanced"


@dataclass(frozen=True)
class FeatureSpec:
    """One toggle: its valid values, whether this version implements it, and what it does."""

    name: str
    values: tuple
    built: bool
    description: str
    env: str


FEATURES: dict[str, FeatureSpec] = {
    f.name: f
    for f in (
        FeatureSpec("attention", ("auto", "sdpa", "off"), True,
                    "route attention through fused SDPA where it runs and is not slower", "VB_ATTENTION"),
        FeatureSpec("mixed_precision", ("auto", "bf16", "fp16", "off"), True,
                    "autocast where the probe says the device is faster (auto picks bf16 only)", "VB_MIXED_PRECISION"),
        FeatureSpec("compile", ("auto", "override", "off"), True,
                    "the compile ladder per model: auto = torch.compile, else a registered override "
                    "(hand-written attention -> SDPA), else eager, each kept only if the on-line trial shows it "
                    "faster; override = the override rung only (no compiler)", "VB_COMPILE"),
        FeatureSpec("tf32", ("auto", "off"), True,
                    "fp32 matmuls and convolutions in TF32 where the device has TF32 units (numerics change "
                    "within TF32's 10-bit mantissa; never in memory mode, which keeps the script's fp32)", "VB_TF32"),
        FeatureSpec("fp4", ("off", "native", "storage", "all"), True,
                    "FP4 weights: storage = frozen nn.Linear weights kept in FP4 (dequantized per call); "
                    "native = FP4 matmul where the probe finds FP4 units (else unchanged); all = both", "VB_FP4"),
        FeatureSpec("activation_checkpointing", (False, True), True,
                    "recompute the activations of the model's repeated blocks in backward (checkpoint_policy "
                    "picks which: all, every:K, budget)", "VB_CHECKPOINTING"),
        FeatureSpec("activation_offload", (False, True), True,
                    "saved activations beyond activation_budget leave fast memory between forward and backward "
                    "(host level, then NVMe) and come back ahead of use", "VB_ACTIVATION_OFFLOAD"),
        FeatureSpec("paging", ("off", "over_budget", "tight", "always"), True,
                    "page parameters, gradients and optimizer states to the levels below when the training "
                    "state exceeds the level-0 budget (tight: budget 50% of free memory; always: page even "
                    "if it fits)", "VB_PAGING"),
    )
}

#: What each mode requests, feature by feature.
MODE_TABLE: dict[str, dict[str, object]] = {
    "performance": {"attention": "auto", "mixed_precision": "auto", "compile": "auto", "tf32": "auto", "fp4": "native",
                    "activation_checkpointing": False, "activation_offload": False, "paging": "over_budget"},
    "balanced": {"attention": "auto", "mixed_precision": "auto", "compile": "override", "tf32": "auto", "fp4": "off",
                 "activation_checkpointing": False, "activation_offload": False, "paging": "over_budget"},
    "memory": {"attention": "auto", "mixed_precision": "auto", "compile": "override", "tf32": "off", "fp4": "storage",
               "activation_checkpointing": True, "activation_offload": True, "paging": "tight"},
    "full": {"attention": "auto", "mixed_precision": "auto", "compile": "auto", "tf32": "auto", "fp4": "all",
             "activation_checkpointing": True, "activation_offload": True, "paging": "tight"},
}


def validate_mode(mode: str, source: str = "mode") -> str:
    """Return the canonical mode name (``speed`` -> ``performance``).

    Raises:
        ConfigError: for anything not in :data:`MODES`, naming the valid values.
    """
    if not isinstance(mode, str) or mode.strip().lower() not in MODES:
        raise ConfigError(f"{source}={mode!r} is not a mode; valid modes: {', '.join(MODES)}")
    m = mode.strip().lower()
    return MODE_ALIASES.get(m, m)


def validate_feature_value(name: str, value, source: str):
    """Check one toggle value (strings are accepted for booleans: 1/0/true/false/on/off).

    Raises:
        ConfigError: for an unknown feature or a value outside its valid set.
    """
    if name not in FEATURES:
        raise ConfigError(f"{source}: unknown feature {name!r}; valid features: {', '.join(FEATURES)}")
    return check_feature(FEATURES[name], value, f"{source}: {name}")


def check_feature(spec: FeatureSpec, value, label: str):
    """Check one value of the toggle ``spec``; ``label`` names it in messages (``enable(): paging``,
    ``VB_PAGING: paging``). Returns the canonical value (booleans from 1/0/true/false/on/off;
    other values lower-cased).

    Raises:
        ConfigError: ``<label>=<value> is not valid`` and the valid values.
    """
    if spec.values == (False, True):
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{label}={value!r} is not valid; use true or false")
    text = str(value).strip().lower() if isinstance(value, str) else value
    if text not in spec.values:
        raise ConfigError(f"{label}={value!r} is not valid; valid values: {', '.join(map(str, spec.values))}")
    return text
