"""The settings mechanism, and the one reader of apt_model's environment variables.

Every option of apt_model is a :class:`Setting`: its name, default, environment variable (or
None), validator and a one-line doc. Each package declares its own entries next to the code they
configure, in ``<package>/settings.py`` (``apt_model.memory.settings.DEVICE_BUDGET``, ...);
:mod:`apt_model.switch.settings` composes them into the one :class:`SettingsTable`, ``TABLE``,
that ``enable()`` / :func:`~apt_model.switch.config.build_config`, the ``.vbrc`` files,
``apt-vb config show`` and ``docs/configuration.md`` use.

Kinds of entries (:data:`KINDS`):

* ``mode`` — the mode (``VB_MODE``, the ``mode`` argument and ``.vbrc`` key);
* ``feature`` — a feature toggle; its default is the mode's request;
* ``setting`` — an ``enable()`` keyword and ``.vbrc`` key, some with a variable (``VB_HOST_BUDGET``);
* ``process`` — a variable only, read where it is used (``VB_SWAP_TIMEOUT``, ``VB_LOG_LEVEL``...).

:func:`read_env` is the only function in apt_model that reads a ``VB_*``,
``ENABLE_VIRTUAL_BLACKWELL`` or ``APT_MODEL_CACHE`` variable (``tests/test_settings.py`` checks
this): the value is stripped, an empty one counts as unset, and it is validated with the variable
as the place it was written, so an error reads ``VB_DEVICE_BUDGET='abc' is not a size; ...``.
Lower packages call it with their own entry; the switch reads every entry through the table.

This module imports nothing above :mod:`apt_model.base`.
"""
from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

from apt_model.base.errors import ConfigError

__all__ = ["KINDS", "Setting", "SettingsTable", "read_env", "relabel", "choice", "boolean", "env_flag",
           "size_or_none", "size", "number_between", "whole_number", "positive_seconds", "folder_path", "any_text",
           "TRUE_VALUES", "FALSE_VALUES",
           "LOG_LEVEL", "LOG_LEVELS", "CACHE_ROOT", "SETTINGS"]

#: The kinds of entries, in the order a table lists them.
KINDS = ("mode", "feature", "setting", "process")

#: A validator: ``(value, label) -> canonical value``; raises ConfigError whose message starts
#: with ``label=<value>`` (see :meth:`Setting.label`) and names the valid values.
Check = Callable[[Any, str], Any]


@dataclass(frozen=True)
class Setting:
    """One option: what it is called, where it may come from, and how its value is checked.

    Attributes:
        name: the ``enable()`` keyword and ``.vbrc`` key (for ``process`` entries, a name for the
            table only).
        default: the value when nothing sets it (None: unset; features: the mode decides).
        env: the environment variable, or None when it cannot come from the environment.
        doc: one line: what it does (units included).
        check: the validator (see :data:`Check`); None accepts any value unchanged.
        kind: one of :data:`KINDS`.
        values: the valid values in words, for docs and messages (``"a size: 512MB, 4GiB"``).
        env_at_use: the variable is read where the value is used (the ranking reads
            ``VB_DEVICE``), not copied into the configuration; the configuration records its source.
    """

    name: str
    default: Any
    env: str | None
    doc: str
    check: Check | None = None
    kind: str = "setting"
    values: str = ""
    env_at_use: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Setting {self.name!r}: kind={self.kind!r} is not one of {', '.join(KINDS)}")

    def label(self, where: str) -> str:
        """How a message names the value written at ``where``: the variable alone when it came from
        the environment (``VB_DEVICE_BUDGET``), else ``<where>: <name>`` (``enable(): device_budget``,
        ``path/.vbrc:3: host_budget``). A feature toggle keeps its name after the variable
        (``VB_ATTENTION: attention``): the two names differ (``VB_CHECKPOINTING``)."""
        if where == self.env and self.kind != "feature":
            return where
        return f"{where}: {self.name}"

    def validate(self, value: Any, where: str) -> Any:
        """Check ``value`` written at ``where`` (the variable, ``enable()``, ``path:line``).

        Returns:
            The canonical value (``"Off"`` -> ``"off"``, ``"1MiB"`` -> 1048576 where the entry
            keeps bytes; most entries return the value as given).

        Raises:
            ConfigError: naming ``where``, the value and the valid values.
        """
        return value if self.check is None else self.check(value, self.label(where))


class SettingsTable:
    """An ordered table of :class:`Setting` entries, looked up by name or by variable.

    Raises:
        ValueError: at construction, for two entries with one name or one variable.
    """

    def __init__(self, *groups: Iterable[Setting]):
        self._by_name: dict[str, Setting] = {}
        self._by_env: dict[str, Setting] = {}
        for group in groups:
            for s in group:
                if s.name in self._by_name:
                    raise ValueError(f"setting {s.name!r} is declared twice")
                if s.env is not None and s.env in self._by_env:
                    raise ValueError(f"variable {s.env} is declared by {self._by_env[s.env].name!r} and {s.name!r}")
                self._by_name[s.name] = s
                if s.env is not None:
                    self._by_env[s.env] = s

    def __iter__(self) -> Iterator[Setting]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> Setting:
        return self._by_name[name]

    def get(self, name: str) -> Setting | None:
        """The entry called ``name``, or None."""
        return self._by_name.get(name)

    def by_env(self, variable: str) -> Setting | None:
        """The entry read from ``variable``, or None."""
        return self._by_env.get(variable)

    def of_kind(self, *kinds: str) -> list[Setting]:
        """The entries of the given kinds, in table order."""
        return [s for s in self if s.kind in kinds]

    def names(self, *kinds: str) -> list[str]:
        """Entry names (of the given kinds; all when none is given), in table order."""
        return [s.name for s in self if not kinds or s.kind in kinds]

    def env_vars(self) -> list[str]:
        """Every variable the table reads, in table order."""
        return [s.env for s in self if s.env is not None]

    def validate(self, name: str, value: Any, where: str) -> Any:
        """``self[name].validate(value, where)``.

        Raises:
            ConfigError: an unknown name (listing the valid ones) or a bad value.
        """
        entry = self.get(name)
        if entry is None:
            raise ConfigError(f"{where}: unknown setting {name!r}; valid settings: {', '.join(self.names())}")
        return entry.validate(value, where)


def read_env(setting: Setting, environ: Mapping[str, str] | None = None) -> tuple[Any, str] | None:
    """The value of ``setting``'s variable, validated, and its source; None when unset or empty.

    The one place apt_model reads a ``VB_*`` / ``ENABLE_VIRTUAL_BLACKWELL`` / ``APT_MODEL_CACHE``
    variable. It is read at each call (a test or a launcher may change it between calls).

    Args:
        setting: the entry (its ``env`` names the variable).
        environ: the environment to read (default ``os.environ``).

    Returns:
        ``(canonical value, "environment:<VAR>")``, or None.

    Raises:
        ConfigError: the value is not valid; the message names the variable, the value and the
            valid values (``VB_SWAP_TIMEOUT='soon' is not a number of seconds > 0 ...``).
        ValueError: ``setting`` has no variable.
    """
    if setting.env is None:
        raise ValueError(f"setting {setting.name!r} has no environment variable")
    raw = (os.environ if environ is None else environ).get(setting.env)
    if raw is None or not raw.strip():
        return None
    return setting.validate(raw.strip(), setting.env), f"environment:{setting.env}"


#: The prefix of apt_model's variable names (``ENABLE_VIRTUAL_BLACKWELL`` and ``APT_MODEL_CACHE`` aside).
ENV_PREFIX = "VB_"


def unknown_env_names(known: Iterable[str], environ: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """The ``VB_*`` variables set in ``environ`` (default ``os.environ``) that are not in ``known``,
    sorted, each with the name of ``known`` closest to it (``difflib``, None when nothing is close):
    ``VB_MDOE`` -> ``VB_MODE``. A typo in a variable's *name* is otherwise ignored without a
    word, where a typo in its value fails."""
    env = os.environ if environ is None else environ
    known = sorted(k for k in known if k)
    out = []
    for name in sorted(env):
        if name.startswith(ENV_PREFIX) and name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
            out.append((name, close[0] if close else None))
    return out


def relabel(err: ConfigError, name: str, label: str) -> ConfigError:
    """``err`` reworded to name ``label`` instead of ``name``: an owner's validator that says
    ``checkpoint_policy='half' is not valid; ...`` becomes ``VB_CHECKPOINT_POLICY='half' is not
    valid; ...``; a message that does not start with ``name`` gets ``<label>: `` in front."""
    text = str(err)
    if text.startswith(name):
        return ConfigError(label + text[len(name):])
    return ConfigError(f"{label}: {text}")


# ----------------------------------------------------------------------------- validators
# Each returns a Check: (value, label) -> canonical value, raising ConfigError("<label>=<value> ...").


def any_text(what: str = "a value") -> Check:
    """A non-empty string, returned as given."""

    def check(value, label):
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{label}={value!r} must be {what}")
        return value

    return check


def choice(values: Iterable, fold_case: bool = True) -> Check:
    """One of ``values``; strings are stripped (and lower-cased with ``fold_case``) first."""
    valid = tuple(values)

    def check(value, label):
        v = value.strip() if isinstance(value, str) else value
        if fold_case and isinstance(v, str):
            v = v.lower()
        if v not in valid:
            raise ConfigError(f"{label}={value!r} is not valid; valid values: {', '.join(map(str, valid))}")
        return v

    return check


def boolean(value, label):
    """True or False (a Python bool: ``"yes"`` in a file is refused)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{label}={value!r} must be True or False")
    return value


#: Words :func:`env_flag` reads as on / off.
TRUE_VALUES = ("1", "true", "yes", "on")
FALSE_VALUES = ("0", "false", "no", "off")


def env_flag(value, label):
    """A boolean as a variable writes it: 1/true/yes/on or 0/false/no/off (any case); bools pass."""
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in TRUE_VALUES:
        return True
    if v in FALSE_VALUES:
        return False
    raise ConfigError(f"{label}={value!r} is not valid; use one of {', '.join(TRUE_VALUES)} to enable "
                      f"or {', '.join(FALSE_VALUES)} to disable")


def size_or_none(value, label):
    """None, or a byte size (``512MB``, ``4GiB``, ``1048576``: see :mod:`apt_model.base.sizes`),
    returned as written (a report shows ``17GiB``, not its bytes)."""
    if value is not None:
        from apt_model.base.sizes import parse_size

        parse_size(value, label)
    return value


def size(value, label):
    """A byte size, returned as a whole number of bytes."""
    from apt_model.base.sizes import parse_size

    return parse_size(value, label)


def number_between(low: float, high: float) -> Check:
    """A number strictly between ``low`` and ``high`` (strings are parsed), as a float."""

    def check(value, label):
        if isinstance(value, bool):  # float(True) is 1.0: a flag given where a number belongs
            raise ConfigError(f"{label}={value!r} is not a number")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{label}={value!r} is not a number") from None
        if not low < number < high:
            raise ConfigError(f"{label}={value!r} must be between {low:g} and {high:g}, both excluded")
        return number

    return check


def whole_number(minimum: int, multiple: int = 1) -> Check:
    """A whole number (not a bool) >= ``minimum`` and, with ``multiple`` > 1, a multiple of it."""
    rule = f"a multiple of {multiple}, >= {minimum}" if multiple > 1 else f"a whole number >= {minimum}"

    def check(value, label):
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum or value % multiple:
            raise ConfigError(f"{label}={value!r} must be {rule}")
        return value

    return check


def positive_seconds(value, label):
    """A positive, finite number of seconds (strings are parsed), as a float."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not number > 0 or number == math.inf:
        raise ConfigError(f"{label}={value!r} is not a number of seconds > 0 (e.g. 120 or 0.5)")
    return number


def folder_path(value, label):
    """None or a folder path (a string or ``os.PathLike``), returned as given; whether it exists
    is checked where it is used."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{label}={value!r} must be a folder path")
    return value


# ----------------------------------------------------------------------------- base's own entries

#: The levels ``VB_LOG_LEVEL`` accepts.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(value, label):
    level = str(value).strip().upper()
    if level not in LOG_LEVELS:
        raise ConfigError(f"{label}={value!r} is not valid; use one of {', '.join(LOG_LEVELS)}")
    return level


LOG_LEVEL = Setting(
    "log_level", None, "VB_LOG_LEVEL",
    "level of the apt_model logger (a stderr handler is added if it has none); DEBUG also prints "
    "the traceback of a user error", _log_level, kind="process", values=", ".join(LOG_LEVELS))

CACHE_ROOT = Setting(
    "cache_root", None, "APT_MODEL_CACHE",
    "the user's cache folder (compiled FP4 kernels, device probe results); default "
    "$XDG_CACHE_HOME/apt_model, else ~/.cache/apt_model", any_text("a folder path"), kind="process",
    values="a folder")

#: The entries :mod:`apt_model.base` owns.
SETTINGS = (LOG_LEVEL, CACHE_ROOT)
