"""The ``.vbrc`` configuration file: where it is looked for, how it is read, checked and written.

A ``.vbrc`` holds the switch's mode, feature toggles and settings (the same names ``enable()``
takes), as JSON or TOML::

    {"mode": "balanced", "host_budget": "18GiB", "swap_dir": "/tmp/apt_model-swap"}

Discovery (:func:`config_paths`):

1. ``VB_CONFIG=<path>``: exactly that file (it must exist); ``VB_CONFIG=none`` turns files off.
2. Otherwise the user's file, ``$XDG_CONFIG_HOME/apt_model/vbrc`` (else
   ``~/.config/apt_model/vbrc``), then the project's file, ``./.vbrc`` in the current folder.
   Both apply when both exist; the project's values override the user's key by key.

Precedence of a value: ``enable()`` arguments > ``VB_*`` environment variables > the files >
the mode's defaults (see :func:`apt_model.switch.config.build_config`).

Format: a file whose name ends in ``.json`` or ``.toml`` is read as such; otherwise a file whose
first non-blank character is ``{`` is JSON, anything else TOML (TOML allows ``#`` comments).
Keys starting with ``_`` are comments and ignored; a JSON ``null`` means "not set here".
Every error is a :class:`ConfigFileError` naming the path, the line (and column where the parser
gives one) and what was wrong; unknown keys and bad values are checked by the switch's own
validators, so messages read the same as for ``enable()`` arguments.
"""
from __future__ import annotations

import difflib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from apt_model.base.errors import ConfigError
from apt_model.base.settings import read_env
from apt_model.switch.settings import CONFIG_DISABLED, CONFIG_FILE, TABLE

PROJECT_FILE = ".vbrc"
ENV_VAR = CONFIG_FILE.env
#: ``VB_CONFIG`` values that turn configuration files off.
DISABLED = CONFIG_DISABLED


class ConfigFileError(ConfigError):
    """A ``.vbrc`` that cannot be used: unreadable, malformed, an unknown key or a bad value.

    Attributes:
        path: the file.
        line, column: 1-based position of the problem, or None where it is not known.
    """

    def __init__(self, path: str | os.PathLike, line: int | None, column: int | None, what: str):
        self.path, self.line, self.column = str(path), line, column
        where = self.path + (f":{line}" if line else "") + (f":{column}" if line and column else "")
        super().__init__(f"{where}: {what}")


@dataclass
class ConfigFile:
    """One read and validated configuration file.

    Attributes:
        path: absolute path of the file.
        format: ``json`` or ``toml``.
        scope: ``user``, ``project`` or ``VB_CONFIG`` (how it was found), or ``explicit``.
        values: validated values by key (``mode``, feature and setting names); keys set to null
            and comment keys (``_...``) are left out.
        lines: the 1-based line of each key in the file.
    """

    path: Path
    format: str
    scope: str = "explicit"
    values: dict = field(default_factory=dict)
    lines: dict = field(default_factory=dict)

    @property
    def source(self) -> str:
        """The ``source`` string ``get_config()`` shows for values from this file."""
        return f"file:{self.path}"


# ----------------------------------------------------------------------------- where


def user_config_path() -> Path:
    """``$XDG_CONFIG_HOME/apt_model/vbrc``, else ``~/.config/apt_model/vbrc`` (the file need not exist)."""
    base = os.environ.get("XDG_CONFIG_HOME", "").strip()
    root = Path(base) if base else Path.home() / ".config"
    return root / "apt_model" / "vbrc"


def project_config_path(folder: str | os.PathLike | None = None) -> Path:
    """``<folder>/.vbrc``; ``folder`` defaults to the current working directory."""
    return Path(folder or os.getcwd()) / PROJECT_FILE


def config_paths() -> list[tuple[str, Path, bool]]:
    """The places a configuration file is looked for, lowest precedence first.

    Returns:
        ``[(scope, path, exists), ...]``: ``[("VB_CONFIG", path, exists)]`` when ``VB_CONFIG`` names
        a file, ``[]`` when it is ``none``, else the user's then the project's file.
    """
    found = read_env(CONFIG_FILE)
    if found is not None and found[0] in DISABLED:
        return []
    if found is not None:
        p = Path(found[0]).expanduser().absolute()
        return [(ENV_VAR, p, p.is_file())]
    user, project = user_config_path().absolute(), project_config_path().absolute()
    out = [("user", user, user.is_file())]
    if project != user:
        out.append(("project", project, project.is_file()))
    return out


def load_config_files() -> list[ConfigFile]:
    """Read and validate every configuration file that applies, lowest precedence first.

    Raises:
        ConfigFileError: a file is malformed or holds an unknown key or a bad value; or
            ``VB_CONFIG`` names a file that does not exist.
    """
    files = []
    for scope, path, exists in config_paths():
        if not exists:
            if scope == ENV_VAR:
                raise ConfigFileError(path, None, None, f"{ENV_VAR} names this file, which does not exist "
                                                        f"(set {ENV_VAR}=none to use no configuration file)")
            continue
        cf = read_config_file(path)
        cf.scope = scope
        files.append(cf)
    return files


def merged_values(files: list[ConfigFile]) -> dict[str, tuple[object, ConfigFile]]:
    """``{key: (value, file)}`` with later (higher-precedence) files overriding earlier ones."""
    out: dict[str, tuple[object, ConfigFile]] = {}
    for cf in files:
        for key, value in cf.values.items():
            out[key] = (value, cf)
    return out


# ----------------------------------------------------------------------------- reading


def valid_keys() -> list[str]:
    """Every key a ``.vbrc`` may hold: ``mode``, then the feature toggles, then the settings (the
    entries of :data:`~apt_model.switch.settings.TABLE` other than process variables)."""
    return TABLE.names("mode", "feature", "setting")


def _file_format(path: Path, text: str) -> str:
    suffix = path.suffix.lower()
    if suffix in (".json", ".toml"):
        return suffix[1:]
    return "json" if text.lstrip().startswith("{") else "toml"


def _key_line(text: str, key: str, fmt: str) -> int | None:
    """1-based line where ``key`` is written as a key (first occurrence), or None."""
    k = re.escape(key)
    if fmt == "json":
        pattern = rf'"{k}"\s*:'
    else:
        pattern = rf'^\s*(?:{k}|"{k}"|\'{k}\')\s*=|^\s*\[\s*(?:{k}|"{k}")\s*\]'
    m = re.search(pattern, text, flags=re.M)
    return text.count("\n", 0, m.start()) + 1 if m else None


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_pairs(pairs: list) -> dict:
    """``json.loads``'s object hook: an object that names a key twice is an error (Python's JSON
    reader keeps the last silently, so a file's first value was ignored and an error about the
    second named the first one's line; TOML refuses duplicates itself)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _parse(path: Path, text: str, fmt: str) -> dict:
    if not text.strip():
        return {}
    if fmt == "json":
        try:
            data = json.loads(text, object_pairs_hook=_unique_pairs)
        except _DuplicateKey as dup:
            lines = [text.count("\n", 0, m.start()) + 1 for m in re.finditer(rf'"{re.escape(dup.key)}"\s*:', text)]
            where = f" (lines {', '.join(map(str, lines))})" if len(lines) > 1 else ""
            raise ConfigFileError(path, lines[-1] if lines else None, None,
                                  f"the key {dup.key!r} is given twice{where}: give each key once") from None
        except json.JSONDecodeError as err:
            hint = ""
            if err.msg.startswith("Expecting property name") and text[: err.pos].rstrip().endswith(","):
                hint = " (a trailing comma before '}'?)"
            raise ConfigFileError(path, err.lineno, err.colno, f"not valid JSON: {err.msg}{hint}") from None
        if not isinstance(data, dict):
            raise ConfigFileError(path, 1, 1, f"the top level must be an object ({{\"key\": value, ...}}), "
                                              f"not a JSON {type(data).__name__}")
        return data
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigFileError(path, None, None, "reading TOML needs Python 3.11+ (or the tomli package); "
                                                    "write the file as JSON instead") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        line, col = getattr(err, "lineno", None), getattr(err, "colno", None)
        msg = getattr(err, "msg", None) or str(err)
        m = re.search(r"\s*\(at line (\d+), column (\d+)\)", msg)
        if m:
            line, col = int(m.group(1)), int(m.group(2))
            msg = msg[: m.start()] + msg[m.end():]
        hint = "" if path.suffix.lower() == ".toml" else " (read as TOML because it does not start with '{')"
        raise ConfigFileError(path, line, col, f"not valid TOML{hint}: {msg.strip()}") from None


def _check_prefer(value) -> None:
    """The kinds of ``prefer``, checked as ``enable()`` checks them (the ranking's validator,
    against the registered kinds): the table's entry checks only the form."""
    from apt_model.devices.detection import detect_devices
    from apt_model.devices.ranking import normalize_prefer

    normalize_prefer(value, detect_devices())


#: Keys whose table entry checks only the form, with the check ``enable()`` adds (the same
#: function), so a file passes ``apt-vb config load --check`` only if ``enable()`` accepts it.
#: (``swap_dir``'s existence is checked where the folder is used, and by ``config load``.)
CHECKED_AT_ENABLE = {"prefer": _check_prefer}


def validate_values(data: dict, path: str | os.PathLike, lines: dict | None = None) -> dict:
    """Check every key and value of a parsed file with the switch's validators.

    Args:
        data: the parsed file (key -> value).
        path: the file, for messages.
        lines: key -> line, for messages.

    Returns:
        The validated values (canonical forms, e.g. ``speed`` -> ``performance``), comment keys
        (``_...``) and nulls left out.

    Raises:
        ConfigFileError: an unknown key (with close matches and the valid keys) or a bad value
            (the entry's validator's message: the value and the valid ones).
    """
    lines = lines or {}
    keys = valid_keys()
    out = {}
    for key, value in data.items():
        line = lines.get(key)
        where = f"{path}:{line}" if line else str(path)
        if key.startswith("_") or value is None:
            continue
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigFileError(path, line, None, f"unknown key {key!r}{hint}; valid keys: {', '.join(keys)}")
        try:
            value = TABLE[key].validate(value, where)
            if key in CHECKED_AT_ENABLE:
                CHECKED_AT_ENABLE[key](value)
        except ConfigFileError:
            raise
        except ConfigError as err:
            text = str(err)
            if text.startswith(where + ": "):
                text = text[len(where) + 2:]
            raise ConfigFileError(path, line, None, text) from None
        out[key] = value
    return out


def read_config_file(path: str | os.PathLike) -> ConfigFile:
    """Read, parse and validate one configuration file.

    Raises:
        ConfigFileError: the file cannot be read, is not valid JSON/TOML, its top level is not a
            table/object, or it holds an unknown key or a bad value.
    """
    p = Path(path).expanduser().absolute()
    try:
        text = p.read_text(encoding="utf-8-sig")  # a BOM (Windows editors) was read as TOML: "not valid TOML"
    except UnicodeDecodeError as err:
        raise ConfigFileError(p, None, None, f"not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise ConfigFileError(p, None, None, f"cannot be read: {err.strerror or err}") from None
    fmt = _file_format(p, text)
    data = _parse(p, text, fmt)
    lines = {k: _key_line(text, k, fmt) for k in data}
    return ConfigFile(p, fmt, "explicit", validate_values(data, p, lines), lines)


# ----------------------------------------------------------------------------- writing


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON string escapes are valid TOML basic strings
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = [f"{k} = {_toml_value(v)}" for k, v in value.items() if v is not None]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    raise ConfigError(f"cannot write {value!r} ({type(value).__name__}) to TOML")


def format_config(values: dict, fmt: str = "json", header: str | None = None,
                  comments: dict[str, str] | None = None) -> str:
    """The text of a configuration file holding ``values``.

    Args:
        values: key -> value (None values are left out).
        fmt: ``json`` or ``toml``.
        header: a note on what wrote the file (JSON: a ``_comment`` key; TOML: ``#`` lines).
        comments: key -> why (JSON: a ``_why`` object; TOML: a ``#`` line above the key).

    Raises:
        ConfigError: for a format other than json/toml.
    """
    values = {k: (list(v) if isinstance(v, tuple) else v) for k, v in values.items() if v is not None}
    comments = {k: v for k, v in (comments or {}).items() if k in values}
    if fmt == "json":
        doc = {}
        if header:
            doc["_comment"] = header
        doc.update(values)
        if comments:
            doc["_why"] = comments
        return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
    if fmt == "toml":
        out = [f"# {line}" for line in (header or "").splitlines()]
        for k, v in values.items():
            if k in comments:
                out.append(f"# {comments[k]}")
            out.append(f"{k} = {_toml_value(v)}")
        return "\n".join(out) + "\n"
    raise ConfigError(f"format={fmt!r} is not valid; valid formats: json, toml")


def check_suffix(path: str | os.PathLike, fmt: str) -> None:
    """Check that a file of format ``fmt`` (``json`` or ``toml``) may be written at ``path``: a
    name ending in ``.json`` or ``.toml`` is read as that format, whatever the text holds, so the
    other format there would be unreadable (any other name is fine: its text decides).

    Raises:
        ConfigFileError: the suffix names the other format.
    """
    p = Path(path)
    suffix = p.suffix.lower()[1:]
    if suffix in ("json", "toml") and fmt != suffix:
        raise ConfigFileError(p, None, None, f"format={fmt!r} does not match the file name's .{suffix} suffix "
                                             "(files are read by their suffix)")


def write_config_file(path: str | os.PathLike, values: dict, fmt: str | None = None, header: str | None = None,
                      comments: dict[str, str] | None = None, overwrite: bool = False) -> Path:
    """Validate ``values`` and write them to ``path`` (atomically: a temporary file renamed into place).

    Args:
        path: the file; its folder is created.
        values: key -> value, checked as a file's values would be.
        fmt: ``json`` or ``toml``; None: from the name's suffix, else JSON.
        header, comments: see :func:`format_config`.
        overwrite: replace an existing file.

    Returns:
        The absolute path written.

    Raises:
        ConfigFileError: a bad key or value (nothing is written).
        FileExistsError: ``path`` exists and ``overwrite`` is False.
    """
    p = Path(path).expanduser().absolute()
    if fmt is None:
        fmt = "toml" if p.suffix.lower() == ".toml" else "json"
    check_suffix(p, fmt)
    validate_values(values, p)
    text = format_config(values, fmt, header, comments)
    if p.exists() and not overwrite:
        raise FileExistsError(f"{p} exists; pass overwrite=True (apt-vb config save --force) to replace it")
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".vbrc-", dir=p.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p
