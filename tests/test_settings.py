"""One settings table, one reader of the VB_* variables (apt_model.base.settings, apt_model.switch.settings).

* no module but ``apt_model/base/settings.py`` reads a ``VB_*`` / ``ENABLE_VIRTUAL_BLACKWELL`` /
  ``APT_MODEL_CACHE`` variable; the modules that touch ``os.environ`` at all are listed, with why;
* ``docs/configuration.md`` and the table name the same variables, one row per entry;
* precedence (argument > environment > file > mode), errors that name the variable and the valid
  values, and every entry's validator with a good and a bad value.
"""
from __future__ import annotations

import ast
import json
import re

import pytest

from apt_model.base.errors import ConfigError
from apt_model.base.settings import KINDS, Setting, SettingsTable, read_env
from apt_model.switch.config import SETTING_ENV, SETTINGS, build_config, validate_setting
from apt_model.switch.settings import PACKAGES, TABLE
from conftest import ROOT

PKG = ROOT / "apt_model"
READER = "apt_model/base/settings.py"
#: A string that names one of apt_model's own variables.
OWN_VARIABLE = re.compile(r"^(VB_|ENABLE_VIRTUAL_BLACKWELL|APT_MODEL_CACHE)")
_ENV_ATTRS = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}

#: Modules that touch ``os.environ`` for variables that are not settings, and why. They must not
#: name a ``VB_*`` variable at all (their settings go through ``read_env``).
ENV_ALLOWLIST = {
    "apt_model/base/launch.py": "the launcher's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR...) "
                                "that torchrun / SLURM set",
    "apt_model/base/user_cache.py": "XDG_CACHE_HOME (the XDG base-directory convention) after APT_MODEL_CACHE",
    "apt_model/switch/vbrc.py": "XDG_CONFIG_HOME: where the user's .vbrc lives",
    "apt_model/memory/host.py": "glibc's MALLOC_MMAP_THRESHOLD_ / GLIBC_TUNABLES and torch's THP_MEM_ALLOC_ENABLE: "
                                "allocator tuning, set for paging unless the user chose a value (kept)",
    "apt_model/devices/backend.py": "a backend's visible-devices variable (CUDA_VISIBLE_DEVICES, "
                                    "ASCEND_RT_VISIBLE_DEVICES...), reported and respected",
    "apt_model/devices/plugins.py": "TORCH_DEVICE_BACKEND_AUTOLOAD, off while torch is imported so a broken "
                                    "vendor plugin cannot make the import fail",
    "apt_model/devices/backends/out_of_tree.py": "a vendor plugin's own variables, set while it is imported "
                                                 "and restored after",
    "apt_model/quantization/ckernel.py": "CC, the C compiler for the FP4 codec",
    "apt_model/core/system.py": "sets CUBLAS_WORKSPACE_CONFIG for deterministic cuBLAS (set_seed(deterministic=True))",
}


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(encoding="utf-8"), str(path))


def _docstrings(tree) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _env_uses(tree) -> list[tuple[int, str]]:
    """(line, what) for every touch of the process environment: ``os.environ``, ``os.getenv``...
    (under any name ``os`` is imported as) and ``from os import environ``."""
    os_names = {"os"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            os_names |= {a.asname or a.name for a in node.names if a.name == "os"}
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _ENV_ATTRS and isinstance(node.value, ast.Name) \
                and node.value.id in os_names:
            uses.append((node.lineno, f"{node.value.id}.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            uses += [(node.lineno, f"from os import {a.name}") for a in node.names if a.name in _ENV_ATTRS]
    return uses


def _own_variable_literals(tree) -> list[tuple[int, str]]:
    skip = _docstrings(tree)
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip
            and OWN_VARIABLE.match(n.value)]


def _env_key_literals(tree) -> list[tuple[int, str]]:
    """``os.environ.get("VB_X")``, ``os.getenv("VB_X")``, ``os.environ["VB_X"]``, ``"VB_X" in os.environ``."""
    out = []

    def is_environ(node):
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    for node in ast.walk(tree):
        keys = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                is_environ(node.func.value) or node.func.attr == "getenv") and node.args:
            keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            keys.append(node.slice)
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            keys.append(node.left)
        out += [(k.lineno, k.value) for k in keys
                if isinstance(k, ast.Constant) and isinstance(k.value, str) and OWN_VARIABLE.match(k.value)]
    return out


# ----------------------------------------------------------------------------- one reader


def test_only_base_settings_reads_apt_models_variables():
    """No ``os.environ.get("VB_...")`` anywhere but the one reader; a module that touches the
    environment at all is on the allowlist (with its reason) and names no ``VB_*`` variable, so a
    variable cannot be read through a constant either."""
    problems = []
    for rel, tree in _modules():
        if rel == READER:
            continue
        problems += [f"{rel}:{line}: reads {key} from the environment; read its Setting with "
                     f"apt_model.base.settings.read_env" for line, key in _env_key_literals(tree)]
        uses = _env_uses(tree)
        if uses and rel not in ENV_ALLOWLIST:
            problems += [f"{rel}:{line}: {what}: only {READER} reads the environment (or add the module to "
                         f"ENV_ALLOWLIST with the reason, for a variable that is not a setting)" for line, what in uses]
        if uses:
            problems += [f"{rel}:{line}: {text!r} in a module that touches the environment; declare the "
                         f"variable as a Setting and read it with read_env" for line, text in _own_variable_literals(tree)]
    assert not problems, "\n".join(problems)


def test_the_allowlist_is_current():
    touching = {rel for rel, tree in _modules() if _env_uses(tree)}
    assert READER in touching
    assert not set(ENV_ALLOWLIST) - touching, f"allowlisted but no longer touching the environment: {set(ENV_ALLOWLIST) - touching}"


def test_the_rule_catches_the_usual_forms():
    code = ('import os\nimport os as o\nfrom os import getenv\nENV = "VB_X"\n'
            'a = os.environ.get("VB_A")\nb = o.getenv("VB_B")\nc = os.environ["VB_C"]\nd = "VB_D" in os.environ\n'
            'e = os.environ.get(ENV)\n')
    tree = ast.parse(code)
    assert [k for _, k in _env_key_literals(tree)] == ["VB_A", "VB_B", "VB_C", "VB_D"]
    assert {w for _, w in _env_uses(tree)} == {"os.environ", "o.getenv", "from os import getenv"}
    assert [t for _, t in _own_variable_literals(tree)] == ["VB_X", "VB_A", "VB_B", "VB_C", "VB_D"]


def test_settings_modules_import_only_the_ground_floor():
    """Each package's settings.py imports apt_model.base at the top (validators of its own package
    are imported inside the validator), so composing the table imports no package above another."""
    for rel, tree in _modules():
        if not rel.endswith("/settings.py") or rel in (READER, "apt_model/switch/settings.py"):
            continue
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("apt_model"):
                assert node.module.startswith("apt_model.base"), f"{rel}:{node.lineno}: imports {node.module}"


# ----------------------------------------------------------------------------- the table


def test_the_table_holds_every_packages_entries_once():
    names = [s.name for group in PACKAGES.values() for s in group]
    assert len(names) == len(set(names)) == len(TABLE)
    assert [s.kind for s in TABLE] == sorted((s.kind for s in TABLE), key=KINDS.index)
    for s in TABLE:
        assert s.doc and "\n" not in s.doc, s.name
        assert s.env is None or TABLE.by_env(s.env) is s
        assert s.kind != "process" or s.env, f"{s.name}: a process entry is a variable"
    assert SETTINGS == {s.name: s.default for s in TABLE.of_kind("setting")}
    assert SETTING_ENV == {"device_budget": "VB_DEVICE_BUDGET", "host_budget": "VB_HOST_BUDGET",
                           "swap_dir": "VB_SWAP_DIR", "swap_budget": "VB_SWAP_BUDGET",
                           "activation_budget": "VB_ACTIVATION_BUDGET", "checkpoint_policy": "VB_CHECKPOINT_POLICY",
                           "distributed": "VB_DISTRIBUTED", "compile_warmup_budget": "VB_COMPILE_WARMUP_BUDGET",
                           "paging_step": "VB_PAGING_STEP", "paging_exact": "VB_PAGING_EXACT",
                           "paging_step_in_backward": "VB_PAGING_STEP_IN_BACKWARD",
                           "paging_reuse_memory": "VB_PAGING_REUSE_MEMORY"}
    from apt_model.switch import vbrc
    from apt_model.switch.modes import FEATURES

    assert vbrc.valid_keys() == ["mode", *TABLE.names("feature"), *SETTINGS]
    for name, spec in FEATURES.items():  # each toggle of the modes is an entry, with its variable
        assert (TABLE[name].kind, TABLE[name].env) == ("feature", spec.env)


def test_a_table_refuses_a_name_or_variable_twice():
    a = Setting("a", 1, "VB_A", "a")
    with pytest.raises(ValueError, match="declared twice"):
        SettingsTable((a,), (Setting("a", 2, None, "b"),))
    with pytest.raises(ValueError, match="VB_A"):
        SettingsTable((a,), (Setting("b", 2, "VB_A", "b"),))
    with pytest.raises(ValueError, match="kind"):
        Setting("c", 1, None, "c", kind="feeling")


def _doc_rows() -> dict[str, tuple[str | None, str]]:
    """docs/configuration.md's "Every option" table: row label -> (variable or None, name cell)."""
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    section = text.split("## Every option", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 5 or cells[0] in ("variable", "---"):
            continue
        var = cells[0].strip("`") if cells[0] != "—" else None
        rows[var or cells[1].strip("`")] = (var, cells[1].strip("`"))
    return rows


def test_docs_configuration_names_exactly_the_tables_variables():
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    in_doc = set(re.findall(r"\b(VB_[A-Z0-9_]*[A-Z0-9]|ENABLE_VIRTUAL_BLACKWELL|APT_MODEL_CACHE)\b", text))
    assert in_doc == set(TABLE.env_vars()), (f"in the doc, not in the table: {in_doc - set(TABLE.env_vars())}; "
                                             f"in the table, not in the doc: {set(TABLE.env_vars()) - in_doc}")
    rows = _doc_rows()
    expected = {}
    for s in TABLE:
        name = "*read where used*" if s.kind == "process" else s.name
        expected[s.env or s.name] = (s.env, name)
    assert rows == expected


# ----------------------------------------------------------------------------- reading


def test_read_env_strips_treats_empty_as_unset_and_names_the_variable():
    from apt_model.memory.settings import HOST_BUDGET, SWAP_TIMEOUT

    assert read_env(HOST_BUDGET, {}) is None
    assert read_env(HOST_BUDGET, {"VB_HOST_BUDGET": "  "}) is None
    assert read_env(HOST_BUDGET, {"VB_HOST_BUDGET": " 4GiB\n"}) == ("4GiB", "environment:VB_HOST_BUDGET")
    assert read_env(SWAP_TIMEOUT, {"VB_SWAP_TIMEOUT": "2.5"}) == (2.5, "environment:VB_SWAP_TIMEOUT")
    with pytest.raises(ConfigError, match=r"^VB_SWAP_TIMEOUT='soon' is not a number of seconds > 0"):
        read_env(SWAP_TIMEOUT, {"VB_SWAP_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="no environment variable"):
        read_env(TABLE["adopt"], {})


def test_read_env_reads_the_process_environment_at_each_call(monkeypatch):
    from apt_model.devices import probe_cache

    assert probe_cache.mode() == "on"
    monkeypatch.setenv("VB_PROBE_CACHE", "Refresh")
    assert probe_cache.mode() == "refresh"


def test_env_beats_file_beats_mode_and_arguments_beat_all(project, monkeypatch):
    (project / ".vbrc").write_text(json.dumps({"paging": "tight", "host_budget": "1GiB", "distributed": "off"}))
    cfg = build_config(None)
    assert (cfg.mode, cfg.sources["mode"]) == ("balanced", "default")
    assert (cfg.attention, cfg.sources["attention"]) == ("auto", "mode:balanced")
    assert (cfg.paging, cfg.sources["paging"]) == ("tight", f"file:{project / '.vbrc'}")
    assert (cfg.adopt, cfg.sources["adopt"]) == ("auto", "default")
    monkeypatch.setenv("VB_PAGING", "Off")
    monkeypatch.setenv("VB_DISTRIBUTED", "AUTO")
    cfg = build_config(None)
    assert (cfg.paging, cfg.sources["paging"]) == ("off", "environment:VB_PAGING")
    assert (cfg.distributed, cfg.sources["distributed"]) == ("auto", "environment:VB_DISTRIBUTED")
    assert (cfg.host_budget, cfg.sources["host_budget"]) == ("1GiB", f"file:{project / '.vbrc'}")
    cfg = build_config(None, {"paging": "always", "host_budget": "2GiB"})
    assert (cfg.paging, cfg.sources["paging"]) == ("always", "argument")
    assert (cfg.host_budget, cfg.sources["host_budget"]) == ("2GiB", "argument")


@pytest.mark.parametrize("var, value, message", [
    ("VB_DISTRIBUTED", "on", "VB_DISTRIBUTED='on' is not valid; valid values: auto, off"),
    ("VB_HOST_BUDGET", "lots", "VB_HOST_BUDGET='lots' is not a size"),
    ("VB_PAGING", "sometimes", "VB_PAGING: paging='sometimes' is not valid; valid values: off, over_budget, tight, always"),
    ("VB_SWAP_TIMEOUT", "-1", "VB_SWAP_TIMEOUT='-1' is not a number of seconds > 0"),
    ("VB_PROBE_CACHE", "sometimes", "VB_PROBE_CACHE='sometimes' is not valid; use 1/on, 0/off or refresh"),
    ("VB_FP4_KERNEL", "cuda", "VB_FP4_KERNEL='cuda' is not valid; valid values: auto, torch"),
    ("VB_LOG_LEVEL", "LOUD", "VB_LOG_LEVEL='LOUD' is not valid; use one of DEBUG, INFO"),
    ("VB_MODE", "fast", "VB_MODE='fast' is not a mode; valid modes: performance"),
])
def test_a_bad_variable_fails_at_enable_naming_it_and_the_valid_values(monkeypatch, var, value, message):
    """Variables read only where they are used (VB_SWAP_TIMEOUT, VB_PROBE_CACHE...) are checked
    at enable() too, so a typo does not wait for the first swap or probe."""
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as exc:
        build_config(None)
    assert str(exc.value).startswith(message), str(exc.value)


# ----------------------------------------------------------------------------- every validator

#: setting -> (good value, its canonical form, bad value, words of the error)
SETTING_CASES = {
    "redirect_cuda": (False, False, "yes", "must be True or False"),
    "adopt": ("Explicit", "explicit", "always", "is not valid; valid values: auto, explicit"),  # any case, like the rest
    "verbose": (True, True, 1, "must be True or False"),
    "banner": (False, False, "no", "must be True or False"),
    "device": ("cpu", "cpu", "gpu", ": unknown kind 'gpu'; valid kinds:"),
    "prefer": (["cpu"], ("cpu",), 3, "must be a device kind or a sequence of kinds"),
    "autocast_min_speedup": ("1.5", 1.5, True, "is not a number"),  # a flag is no number (was 1.0)
    "autocast_trial_calls": (8, 8, 6, "must be a multiple of 4, >= 0"),
    "autocast_trial_min_speedup": (1.2, 1.2, 200, "must be between 0 and 100, both excluded"),
    "sdpa_min_speedup": (1, 1.0, 0, "must be between 0 and 100, both excluded"),
    "compile_trial_calls": (8, 8, 2, "must be a multiple of 4, >= 4"),
    "compile_min_speedup": ("1.1", 1.1, -1, "must be between 0 and 100, both excluded"),
    "compile_warmup_budget": (60, 60.0, "soon", "is not a number"),
    "compile_recompile_limit": (4, 4, 0, "must be a whole number >= 1"),
    "paging_step": ("Host", "host", "gpu", "valid values: auto, device, host"),
    "paging_exact": ("off", False, "maybe", "is not valid; use one of"),
    "paging_step_in_backward": ("OFF", "off", "always", "valid values: auto, on, off"),
    "paging_reuse_memory": ("off", False, "sometimes", "is not valid; use one of"),
    "device_budget": ("4GiB", "4GiB", "lots", "is not a size"),
    "host_budget": (1 << 30, 1 << 30, 0, "must be a positive size"),
    "swap_dir": ("/tmp", "/tmp", 3, "must be a folder path"),
    "swap_budget": ("2GB", "2GB", "1.5B", "not a whole number of bytes"),
    "checkpoint_policy": ("every:2", "every:2", "half", "is not valid; use 'all', 'every:K' (K >= 1) or 'budget'"),
    "activation_budget": ("256MB", "256MB", "-1MB", "is not a size"),
    "offload_min_bytes": ("1MiB", 1 << 20, "0.5B", "not a whole number of bytes"),
    "fp4_policy": ({}, "defaults", {"bogus": 1}, ": unknown field(s) 'bogus'"),
    "distributed": ("OFF", "off", "on", "is not valid; valid values: auto, off"),
    "ddp_options": ({"bucket_cap_mb": 25}, {"bucket_cap_mb": 25}, {"bucket_size": 25}, "has unknown key 'bucket_size'"),
}


def test_every_setting_has_a_case():
    assert set(SETTING_CASES) == set(SETTINGS)


@pytest.mark.parametrize("name", list(SETTING_CASES))
def test_validate_setting_round_trip(name):
    good, canonical, bad, words = SETTING_CASES[name]
    value = validate_setting(name, good, "enable()")
    if canonical == "defaults":
        from apt_model.quantization.policy import FP4Policy

        canonical = FP4Policy().to_dict()
    assert value == canonical
    assert validate_setting(name, value, "enable()") == value  # canonical values validate to themselves
    with pytest.raises(ConfigError) as exc:
        validate_setting(name, bad, "p/.vbrc:3")
    text = str(exc.value)
    assert text.startswith(f"p/.vbrc:3: {name}") and words in text, text


def test_validate_setting_refuses_an_unknown_name():
    with pytest.raises(ConfigError, match=r"enable\(\): unknown setting 'paging'; valid settings: redirect_cuda"):
        validate_setting("paging", "off", "enable()")  # a feature, not a setting


#: variable -> (good text, its canonical value, bad text or None where any text is valid)
ENV_CASES = {
    "VB_MODE": ("Speed", "performance", "fast"),
    "VB_ATTENTION": ("SDPA", "sdpa", "flash3"),
    "VB_MIXED_PRECISION": ("bf16", "bf16", "fp8"),
    "VB_FP4": ("storage", "storage", "fp2"),
    "VB_COMPILE": ("Override", "override", "inductor"),
    "VB_TF32": ("off", "off", "on"),
    "VB_COMPILE_WARMUP_BUDGET": ("30", 30.0, "-1"),
    "VB_PAGING_STEP": ("device", "device", "cpu"),
    "VB_PAGING_EXACT": ("0", False, "maybe"),
    "VB_PAGING_STEP_IN_BACKWARD": ("off", "off", "later"),
    "VB_PAGING_REUSE_MEMORY": ("0", False, "maybe"),
    "VB_CHECKPOINTING": ("on", True, "maybe"),
    "VB_ACTIVATION_OFFLOAD": ("0", False, "sometimes"),
    "VB_PAGING": ("tight", "tight", "never"),
    "VB_DEVICE": ("cpu", "cpu", "cpu:x"),
    "VB_DEVICE_BUDGET": ("512MB", "512MB", "abc"),
    "VB_HOST_BUDGET": ("4GiB", "4GiB", "lots"),
    "VB_SWAP_DIR": ("/tmp", "/tmp", None),
    "VB_SWAP_BUDGET": ("1048576", "1048576", "0"),
    "VB_CHECKPOINT_POLICY": ("budget", "budget", "half"),
    "VB_ACTIVATION_BUDGET": ("1GB", "1GB", "1.1KiB"),
    "VB_DISTRIBUTED": ("off", "off", "on"),
    "ENABLE_VIRTUAL_BLACKWELL": ("Yes", True, "sure"),
    "VB_CONFIG": ("None", "none", None),
    "VB_PROBE_CACHE": ("0", "off", "sometimes"),
    "VB_CACHE_DIR": ("/tmp/vb", "/tmp/vb", None),
    "VB_SWAP_TIMEOUT": ("0.5", 0.5, "inf"),
    "VB_FP4_KERNEL": ("TORCH", "torch", "c"),
    "VB_LOG_LEVEL": ("info", "INFO", "LOUD"),
    "APT_MODEL_CACHE": ("/tmp/apt", "/tmp/apt", None),
}


def test_every_variable_has_a_case():
    assert set(ENV_CASES) == set(TABLE.env_vars())


@pytest.mark.parametrize("var", list(ENV_CASES))
def test_each_variable_reads_and_fails_naming_itself(var):
    entry = TABLE.by_env(var)
    good, canonical, bad = ENV_CASES[var]
    assert read_env(entry, {var: good}) == (canonical, f"environment:{var}")
    if bad is None:
        return
    with pytest.raises(ConfigError) as exc:
        read_env(entry, {var: bad})
    prefix = f"{var}: {entry.name}=" if entry.kind == "feature" else f"{var}="
    assert str(exc.value).startswith(f"{prefix}{bad!r}"), str(exc.value)


@pytest.mark.parametrize("need", [1, 9, 10 * 1024, 307_277, 5 * 2**20 + 300_000, 3 * 2**30 + 1])
def test_a_suggested_size_parses_and_is_enough(need):
    """Messages that tell the user what to set use ``format_size_at_least``: typed back, it parses
    and covers the need. ``format_size`` does not: 307277 bytes print as '300.1KiB', which is no
    whole number of bytes (refused), and one decimal may round below the need."""
    from apt_model.base.sizes import format_size, format_size_at_least, parse_size

    assert parse_size(format_size_at_least(need)) >= need
    if need == 307_277:
        with pytest.raises(ConfigError, match="not a whole number of bytes"):
            parse_size(format_size(need))


def test_a_setting_read_where_it_is_used_shows_its_value_in_the_configuration(monkeypatch):
    """``VB_DEVICE`` is read by the ranking, so the configuration keeps the default for it:
    ``get_config()`` and ``apt-vb config show`` showed ``None`` from ``environment:VB_DEVICE``."""
    import apt_model.optimization.vb_global as vb

    monkeypatch.setenv("VB_DEVICE", "cpu")
    assert build_config(None, {}).shown_settings()["device"] == {"value": "cpu", "source": "environment:VB_DEVICE"}
    vb.enable("balanced", banner=False)
    try:
        assert vb.get_config()["settings"]["device"]["value"] == "cpu"
    finally:
        vb.disable()
