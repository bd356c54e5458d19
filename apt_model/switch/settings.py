"""The one settings table: every option of apt_model, composed from the packages that own them.

Each package declares its entries next to its code (``apt_model/<package>/settings.py``, see
:mod:`apt_model.base.settings`); this module adds the switch's own — the mode, the feature
toggles of :data:`~apt_model.switch.modes.FEATURES` (whose defaults are the mode's requests), the
adoption and output settings, ``ENABLE_VIRTUAL_BLACKWELL`` and ``VB_CONFIG`` — and composes
:data:`TABLE`. The table is what :func:`~apt_model.switch.config.build_config` resolves, what a
``.vbrc`` may hold (:mod:`apt_model.switch.vbrc`), what ``apt-vb config show`` lists and what
``docs/configuration.md`` documents (``tests/test_settings.py`` keeps the two in step).
"""
from __future__ import annotations

from functools import partial

from apt_model.base.errors import ConfigError
from apt_model.base.settings import KINDS, Setting, SettingsTable, boolean, choice, env_flag
from apt_model.switch.modes import DEFAULT_MODE, FEATURES, MODES, check_feature, validate_mode

#: ``VB_CONFIG`` values that turn configuration files off.
CONFIG_DISABLED = ("none",)


def _mode(value, label):
    return validate_mode(value, source=label)


def _config_file(value, label):
    """A file path, or ``none`` (lower-cased) for no file."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{label}={value!r} must be a file path or 'none'")
    return value.strip().lower() if value.strip().lower() in CONFIG_DISABLED else value


MODE = Setting(
    "mode", DEFAULT_MODE, "VB_MODE",
    "the mode: what each feature is asked to do (speed is performance's other name)", _mode, kind="mode",
    values=", ".join(MODES))

#: The feature toggles, one entry per :data:`~apt_model.switch.modes.FEATURES` spec (its variable
#: and valid values); the default is the mode's request.
FEATURE_SETTINGS = tuple(
    Setting(spec.name, None, spec.env, spec.description, partial(check_feature, spec), kind="feature",
            values=", ".join(str(v).lower() for v in sorted(spec.values, key=lambda v: v is False)))
    for spec in FEATURES.values()
)

REDIRECT_CUDA = Setting(
    "redirect_cuda", True, None, ".cuda() / .to('cuda') go to the selected device when CUDA is absent", boolean,
    values="True, False")
ADOPT = Setting(
    "adopt", "auto", None,
    "auto: models moved with .to()/.cuda() or first called are adopted; explicit: only vb.adopt()",
    choice(("auto", "explicit")), values="auto, explicit")
VERBOSE = Setting("verbose", False, None, "print the decisions as they are made, and the long banner", boolean,
                  values="True, False")
BANNER = Setting("banner", True, None, "print the one-line-per-feature banner at enable()", boolean,
                 values="True, False")
ENABLE = Setting(
    "enable", False, "ENABLE_VIRTUAL_BLACKWELL", "enable the switch when apt_model is imported", env_flag,
    kind="process", values="1/true/yes/on, 0/false/no/off")
CONFIG_FILE = Setting(
    "config_file", None, "VB_CONFIG",
    "read exactly this .vbrc file (it must exist); none: no file (default: ./.vbrc over the user's file)",
    _config_file, kind="process", values="a file path, or none")

#: The entries the switch owns.
SETTINGS = (MODE, *FEATURE_SETTINGS, REDIRECT_CUDA, ADOPT, VERBOSE, BANNER, ENABLE, CONFIG_FILE)

def _compose() -> tuple[dict, SettingsTable]:
    """Each package's entries (the switch's first, lower packages after) and the table. Imported
    on first use of :data:`PACKAGES` / :data:`TABLE`, not at ``import apt_model`` (which reads only
    :data:`ENABLE` and :data:`MODE`): the packages' ``__init__`` modules are not free to import."""
    from apt_model.activations import settings as activations
    from apt_model.attention import settings as attention
    from apt_model.base import settings as base
    from apt_model.compile import settings as compile_
    from apt_model.devices import settings as devices
    from apt_model.distributed import settings as distributed
    from apt_model.memory import settings as memory
    from apt_model.precision import settings as precision
    from apt_model.quantization import settings as quantization

    packages = {"switch": SETTINGS, "devices": devices.SETTINGS, "precision": precision.SETTINGS,
                "attention": attention.SETTINGS, "compile": compile_.SETTINGS, "memory": memory.SETTINGS, "activations": activations.SETTINGS,
                "quantization": quantization.SETTINGS, "distributed": distributed.SETTINGS, "base": base.SETTINGS}
    # by kind (KINDS: the mode, the feature toggles, the settings, then the variables read where
    # they are used), in package order within a kind
    table = SettingsTable(sorted((s for group in packages.values() for s in group), key=lambda s: KINDS.index(s.kind)))
    return packages, table


def __getattr__(name: str):
    """``PACKAGES`` (package -> its entries) and ``TABLE`` (every option of apt_model), composed
    on first access (PEP 562)."""
    if name in ("PACKAGES", "TABLE"):
        packages, table = _compose()
        globals().update(PACKAGES=packages, TABLE=table)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
