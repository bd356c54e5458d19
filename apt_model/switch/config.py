"""The switch's configuration: a mode's requests plus overrides, each value with its source.

Precedence, highest first: arguments to ``enable()`` > environment variables (``VB_MODE``,
``VB_ATTENTION``, ``VB_MIXED_PRECISION``, ...) > the ``.vbrc`` files (:mod:`apt_model.switch.vbrc`)
> the mode's defaults. ``get_config()`` reports where each value came from.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from apt_model.errors import ConfigError
from apt_model.switch.modes import DEFAULT_MODE, FEATURES, MODE_TABLE, validate_feature_value, validate_mode

#: Settings that are not features: name -> (default, validator description).
SETTINGS = {
    "device": None,  # "npu:1", "cpu", ... (VB_DEVICE is read by the ranking policy)
    "prefer": None,  # kind or tuple of kinds ranked first
    "redirect_cuda": True,  # .cuda()/.to("cuda") go to the selected device when CUDA is absent
    "adopt": "auto",  # "auto": models moved with .to()/.cuda() or first called are adopted; "explicit": only vb.adopt()
    "autocast_min_speedup": 1.10,  # autocast only where the probe measured at least this speed-up
    "sdpa_min_speedup": 1.0,  # SDPA routing only where it is at least this fast vs hand-written
    "autocast_trial_calls": 16,  # timed training calls on the model itself confirming autocast (0: no trial)
    "autocast_trial_min_speedup": 1.05,  # keep autocast after the trial only if this much faster
    "device_budget": None,  # level-0 bytes for training state (VB_DEVICE_BUDGET); CPU: the host level
    "host_budget": None,  # host-level bytes (VB_HOST_BUDGET)
    "swap_dir": None,  # where swap folders go (VB_SWAP_DIR; default: the system temp folder)
    "swap_budget": None,  # bytes the swap level may hold (VB_SWAP_BUDGET)
    "checkpoint_policy": "all",  # which repeated blocks are checkpointed: all, every:K, budget
    "activation_budget": None,  # bytes of saved activations kept in memory (VB_ACTIVATION_BUDGET); default 1/4 of level 0
    "offload_min_bytes": 1 << 20,  # saved tensors smaller than this are never offloaded
    "verbose": False,  # print the decisions as they are made
    "banner": True,  # print the one-line-per-feature banner at enable()
    "fp4_policy": None,  # which layers FP4 converts: None (defaults) or a dict of FP4Policy fields
    "distributed": "auto",  # "auto": under a launcher, process group + rank's device + DDP; "off": leave torch.distributed alone
    "ddp_options": None,  # DDP keyword arguments for the switch's DDP (find_unused_parameters, bucket_cap_mb, ...)
}


@dataclass
class VBConfig:
    """A resolved configuration. ``features`` and ``settings`` hold values; ``sources`` says where
    each came from (``mode:<name>``, ``environment:<VAR>``, ``file:<path>``, ``argument``, ``default``)."""

    mode: str
    features: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)

    def __getattr__(self, name):
        d = self.__dict__
        if name in d.get("features", {}):
            return d["features"][name]
        if name in d.get("settings", {}):
            return d["settings"][name]
        raise AttributeError(name)

    def to_dict(self) -> dict:
        return {"mode": self.mode, "features": dict(self.features), "settings": dict(self.settings),
                "sources": dict(self.sources)}

    def config_files(self) -> list[str]:
        """The ``.vbrc`` files that supplied at least one value, sorted."""
        return sorted({s[len("file:"):] for s in self.sources.values() if s and s.startswith("file:")})


#: Settings that can also come from the environment.
SETTING_ENV = {"device_budget": "VB_DEVICE_BUDGET", "host_budget": "VB_HOST_BUDGET", "swap_dir": "VB_SWAP_DIR",
               "swap_budget": "VB_SWAP_BUDGET", "activation_budget": "VB_ACTIVATION_BUDGET",
               "checkpoint_policy": "VB_CHECKPOINT_POLICY", "distributed": "VB_DISTRIBUTED"}

#: Short names accepted by enable() for longer option names.
ALIASES = {"checkpointing": "activation_checkpointing", "offload": "activation_offload"}


def _what(name: str, source: str) -> str:
    """How a message names the value the user wrote: the variable (``VB_DEVICE_BUDGET``) for the
    environment, else ``<source>: <name>`` (``enable(): device_budget``, ``path:3: host_budget``)."""
    if source.startswith("environment "):
        return source[len("environment "):]
    return f"{source}: {name}"


def _validate_setting(name: str, value, source: str):
    if name == "adopt" and value not in ("auto", "explicit"):
        raise ConfigError(f"{source}: adopt={value!r} is not valid; valid values: auto, explicit")
    if name == "checkpoint_policy":
        from apt_model.activations.checkpoint import parse_policy

        try:
            parse_policy(value)
        except ConfigError as err:  # name what the user wrote (the variable, the file line)
            text = str(err)
            if text.startswith("checkpoint_policy="):
                text = text[len("checkpoint_policy"):]
            raise ConfigError(f"{_what(name, source)}{text}") from None
    if name == "offload_min_bytes":
        from apt_model.memory.sizes import parse_size

        value = parse_size(value, _what("offload_min_bytes", source))
    if name in ("device_budget", "host_budget", "swap_budget", "activation_budget") and value is not None:
        from apt_model.memory.sizes import parse_size

        parse_size(value, _what(name, source))
    if name == "swap_dir" and value is not None and not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{source}: swap_dir={value!r} must be a folder path")
    if name == "autocast_trial_calls":
        if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value % 4:
            raise ConfigError(f"{source}: autocast_trial_calls={value!r} must be a multiple of 4, >= 0")
    if name in ("autocast_min_speedup", "sdpa_min_speedup", "autocast_trial_min_speedup"):
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{source}: {name}={value!r} is not a number") from None
        if not 0 < value < 100:
            raise ConfigError(f"{source}: {name}={value!r} must be between 0 and 100")
    if name in ("redirect_cuda", "verbose", "banner") and not isinstance(value, bool):
        raise ConfigError(f"{source}: {name}={value!r} must be True or False")
    if name == "prefer" and value is not None and not isinstance(value, (str, tuple, list)):
        raise ConfigError(f"{source}: prefer={value!r} must be a device kind or a sequence of kinds")
    if name == "distributed":
        text = value.strip().lower() if isinstance(value, str) else value
        if text not in ("auto", "off"):
            raise ConfigError(f"{source}: distributed={value!r} is not valid; valid values: auto, off")
        value = text
    if name == "ddp_options" and value is not None:
        from apt_model.distributed.ddp import DDP_OPTIONS

        if not isinstance(value, dict):
            raise ConfigError(f"{source}: ddp_options={value!r} must be a dict of DDP keyword arguments "
                              f"({', '.join(DDP_OPTIONS)})")
        for key, v in value.items():
            if key not in DDP_OPTIONS:
                raise ConfigError(f"{source}: ddp_options has unknown key {key!r}; valid keys: {', '.join(DDP_OPTIONS)}")
            want_bool = DDP_OPTIONS[key] is bool
            if want_bool != isinstance(v, bool) or not isinstance(v, DDP_OPTIONS[key]) or (not want_bool and v <= 0):
                raise ConfigError(f"{source}: ddp_options[{key!r}]={v!r} must be "
                                  f"{'True or False' if want_bool else 'a positive number'}")
        value = dict(value)
    if name == "fp4_policy" and value is not None:
        from apt_model.quantization.policy import FP4Policy

        value = FP4Policy.coerce(value).to_dict()  # validated now, kept JSON-safe for the report
    return value


def _resolve_use_fp4(mode: str, overrides: dict) -> dict:
    """``use_fp4=True`` -> ``fp4`` = the mode's request (``storage`` where the mode has ``off``);
    ``use_fp4=False`` -> ``fp4="off"``. Raises ConfigError when it contradicts an explicit ``fp4``."""
    if "use_fp4" not in overrides:
        return overrides
    overrides = dict(overrides)
    flag = overrides.pop("use_fp4")
    if not isinstance(flag, bool):
        raise ConfigError(f"enable(): use_fp4={flag!r} must be True or False")
    mode_value = MODE_TABLE[mode]["fp4"]
    value = (mode_value if mode_value != "off" else "storage") if flag else "off"
    if "fp4" in overrides and validate_feature_value("fp4", overrides["fp4"], "enable()") != value:
        raise ConfigError(f"enable(): use_fp4={flag} means fp4={value!r} in mode {mode!r}, "
                          f"but fp4={overrides['fp4']!r} was also given")
    overrides["fp4"] = value
    return overrides


def validate_setting(name: str, value, source: str):
    """Check one setting's value (see :data:`SETTINGS`); returns it in canonical form.

    Raises:
        ConfigError: naming ``source``, the value and what is valid.
    """
    return _validate_setting(name, value, source)


def build_config(mode: str | None, overrides: dict | None = None) -> VBConfig:
    """Resolve ``mode`` + configuration files + environment + ``overrides`` into a :class:`VBConfig`.

    Args:
        mode: the mode, or None for ``VB_MODE``, else the files' ``mode``, else ``balanced``.
        overrides: ``enable()`` keyword arguments.

    Raises:
        ConfigError: unknown mode, unknown override name (the message lists the valid names),
            or an invalid value; :class:`~apt_model.switch.vbrc.ConfigFileError` (a ConfigError)
            for a malformed ``.vbrc``, naming the path and line.
    """
    from apt_model.switch import vbrc

    from_files = vbrc.merged_values(vbrc.load_config_files())
    mode, mode_source = _resolve_mode(mode, from_files)
    overrides = _resolve_use_fp4(mode, overrides or {})
    for short, full in ALIASES.items():
        if short in overrides:
            if full in overrides:
                raise ConfigError(f"enable(): {short}= and {full}= name the same option; give one")
            overrides = {(full if k == short else k): v for k, v in overrides.items()}
    cfg = VBConfig(mode=mode)
    cfg.sources["mode"] = mode_source
    for name, value in MODE_TABLE[mode].items():
        cfg.features[name] = value
        cfg.sources[name] = f"mode:{mode}"
    for name, value in SETTINGS.items():
        cfg.settings[name] = value
        cfg.sources[name] = "default"
    for name, (value, cf) in from_files.items():  # the environment, applied next, overrides these
        if name == "mode":
            continue
        if name == "device" and os.environ.get("VB_DEVICE", "").strip():
            cfg.sources[name] = "environment:VB_DEVICE"  # read by the ranking policy itself
            continue
        (cfg.features if name in FEATURES else cfg.settings)[name] = value
        cfg.sources[name] = cf.source
    for name, spec in FEATURES.items():
        raw = os.environ.get(spec.env)
        if raw is not None and raw.strip():
            cfg.features[name] = validate_feature_value(name, raw, f"environment {spec.env}")
            cfg.sources[name] = f"environment:{spec.env}"
    for name, env in SETTING_ENV.items():
        raw = os.environ.get(env)
        if raw is not None and raw.strip():
            cfg.settings[name] = _validate_setting(name, raw.strip(), f"environment {env}")
            cfg.sources[name] = f"environment:{env}"
    for name, value in (overrides or {}).items():
        if name in FEATURES:
            cfg.features[name] = validate_feature_value(name, value, "enable()")
        elif name in SETTINGS:
            cfg.settings[name] = _validate_setting(name, value, "enable()")
        else:
            valid = ", ".join(list(FEATURES) + list(SETTINGS))
            raise ConfigError(f"enable() got an unknown option {name!r}; valid options: {valid}")
        cfg.sources[name] = "argument"
    return cfg


def _resolve_mode(mode: str | None, from_files: dict) -> tuple[str, str]:
    """(canonical mode, its source): the argument, else ``VB_MODE``, else the files, else the default."""
    if mode is not None:
        return validate_mode(mode), "argument"
    raw = os.environ.get("VB_MODE")
    if raw is not None and raw.strip():
        return validate_mode(raw, source="VB_MODE"), "environment:VB_MODE"
    if "mode" in from_files:
        value, cf = from_files["mode"]
        return value, cf.source
    return DEFAULT_MODE, "default"
