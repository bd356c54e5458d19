"""The switch's configuration: a mode's requests plus overrides, each value with its source.

Precedence, highest first: arguments to ``enable()`` > environment variables (``VB_MODE``,
``VB_ATTENTION``, ``VB_MIXED_PRECISION``, ...) > the ``.vbrc`` files (:mod:`apt_model.switch.vbrc`)
> the mode's defaults. ``get_config()`` reports where each value came from.

The names, defaults, variables and validators are the entries of the one settings table,
:data:`apt_model.switch.settings.TABLE`; :func:`build_config` reads every variable of it (through
:func:`apt_model.base.settings.read_env`), so a bad one fails at ``enable()`` even where the
variable is only read later, where it is used (``VB_SWAP_TIMEOUT``, ``VB_PROBE_CACHE``...).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from apt_model.base.errors import ConfigError
from apt_model.base.log import get_logger
from apt_model.base.settings import read_env
from apt_model.base.settings import unknown_env_names as _unknown_env_names
from apt_model.switch.modes import DEFAULT_MODE, MODE_TABLE, validate_feature_value, validate_mode
from apt_model.switch.settings import MODE, TABLE

log = get_logger(__name__)

_warned_unknown: set[str] = set()  # unknown variable names already warned about (once per process)


def unknown_env_names(environ=None) -> list[tuple[str, str | None]]:
    """The ``VB_*`` variables set that no setting of :data:`TABLE` reads, each with the closest
    known name (see :func:`apt_model.base.settings.unknown_env_names`; a probe's finding,
    2026-11-28: ``VB_MDOE=memory`` ran balanced mode without a word)."""
    return _unknown_env_names((e.env for e in TABLE), environ)


def describe_unknown_env(name: str, close: str | None) -> str:
    """One line about an unknown ``VB_*`` variable (see :func:`unknown_env_names`)."""
    hint = f"did you mean {close}? " if close else ""
    return (f"environment variable {name} is not a setting apt_model reads: ignored ({hint}the variables are "
            "listed in docs/configuration.md and by `apt-vb config show`)")

#: Settings that are not features: name -> default (from :data:`~apt_model.switch.settings.TABLE`).
SETTINGS = {s.name: s.default for s in TABLE.of_kind("setting")}


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

    def shown_settings(self) -> dict:
        """Each setting as ``{"value", "source"}`` for reports (``get_config()``, ``apt-vb config
        show``). A variable read where it is used (``VB_DEVICE``: the ranking reads it) shows the
        value it holds: the configuration keeps the default for it, so it showed ``None`` next to
        ``environment:VB_DEVICE``."""
        out = {}
        for name, value in self.settings.items():
            source = self.sources.get(name)
            entry = TABLE.get(name)
            if entry is not None and entry.env_at_use and source and source.startswith("environment:"):
                found = read_env(entry)
                value = found[0] if found is not None else value
            out[name] = {"value": value, "source": source}
        return out

    def config_files(self) -> list[str]:
        """The ``.vbrc`` files that supplied at least one value, sorted."""
        return sorted({s[len("file:"):] for s in self.sources.values() if s and s.startswith("file:")})


#: Settings that can also come from the environment, copied into the configuration: name -> variable.
#: (``VB_DEVICE`` is read by the ranking policy itself; the configuration records its source.)
SETTING_ENV = {s.name: s.env for s in TABLE.of_kind("setting") if s.env and not s.env_at_use}

#: Short names accepted by enable() for longer option names.
ALIASES = {"checkpointing": "activation_checkpointing", "offload": "activation_offload"}


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
    """Check one setting's value (see :data:`SETTINGS`) with its entry of the settings table;
    returns it in canonical form.

    Args:
        name: the setting.
        value: its value.
        source: where it was written: ``enable()``, ``path:line``, or the variable
            (``VB_DEVICE_BUDGET``; ``environment VB_DEVICE_BUDGET`` is read the same way).

    Raises:
        ConfigError: naming ``source``, the value and what is valid; or an unknown setting
            (the valid ones listed).
    """
    entry = TABLE.get(name)
    if entry is None or entry.kind != "setting":
        raise ConfigError(f"{source}: unknown setting {name!r}; valid settings: {', '.join(SETTINGS)}")
    if source.startswith("environment "):
        source = source[len("environment "):]
    return entry.validate(value, source)


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
    for entry in TABLE.of_kind("feature"):
        cfg.features[entry.name] = MODE_TABLE[mode].get(entry.name, entry.default)
        cfg.sources[entry.name] = f"mode:{mode}"
    for entry in TABLE.of_kind("setting"):
        cfg.settings[entry.name] = entry.default
        cfg.sources[entry.name] = "default"
    for name, (value, cf) in from_files.items():  # the environment, applied next, overrides these
        if name == "mode":
            continue
        (cfg.features if TABLE[name].kind == "feature" else cfg.settings)[name] = value
        cfg.sources[name] = cf.source
    for entry in TABLE:  # every variable is validated here, so a typo fails at enable()
        found = read_env(entry) if entry.env is not None and entry.kind != "mode" else None
        if found is None or entry.kind == "process":  # process variables are read where they are used
            continue
        value, source = found
        target = cfg.features if entry.kind == "feature" else cfg.settings
        target[entry.name] = entry.default if entry.env_at_use else value  # VB_DEVICE: the ranking reads it
        cfg.sources[entry.name] = source
    for name, close in unknown_env_names():
        if name not in _warned_unknown:
            _warned_unknown.add(name)
            log.warning(describe_unknown_env(name, close))
    valid = TABLE.names("feature", "setting")
    for name, value in (overrides or {}).items():
        if name not in valid:
            raise ConfigError(f"enable() got an unknown option {name!r}; valid options: {', '.join(valid)}")
        (cfg.features if TABLE[name].kind == "feature" else cfg.settings)[name] = TABLE[name].validate(value, "enable()")
        cfg.sources[name] = "argument"
    return cfg


def _resolve_mode(mode: str | None, from_files: dict) -> tuple[str, str]:
    """(canonical mode, its source): the argument, else ``VB_MODE``, else the files, else the default."""
    if mode is not None:
        return validate_mode(mode), "argument"
    found = read_env(MODE)
    if found is not None:
        return found
    if "mode" in from_files:
        value, cf = from_files["mode"]
        return value, cf.source
    return DEFAULT_MODE, "default"
