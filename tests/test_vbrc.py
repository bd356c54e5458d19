"""The .vbrc configuration file: discovery, precedence (argument > environment > file > mode
default), sources in get_config(), and errors that name the path, the line and what is wrong."""
import json

import pytest

import apt_model.optimization.vb_global as vb
from apt_model.errors import ConfigError
from apt_model.switch import vbrc
from apt_model.switch.config import build_config
from apt_model.switch.vbrc import ConfigFileError, read_config_file, write_config_file
from conftest import clean_env, run_python




def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_precedence_argument_over_environment_over_file_over_mode(project, monkeypatch):
    f = write(project / ".vbrc", json.dumps({"mode": "memory", "attention": "sdpa", "mixed_precision": "bf16",
                                             "host_budget": "1GiB", "banner": False}))
    monkeypatch.setenv("VB_MIXED_PRECISION", "off")
    cfg = build_config(None, {"attention": "off"})
    src = f"file:{f}"
    assert (cfg.mode, cfg.sources["mode"]) == ("memory", src)  # file > default
    assert (cfg.attention, cfg.sources["attention"]) == ("off", "argument")  # argument > file
    assert (cfg.mixed_precision, cfg.sources["mixed_precision"]) == ("off", "environment:VB_MIXED_PRECISION")  # env > file
    assert (cfg.host_budget, cfg.sources["host_budget"]) == ("1GiB", src)
    assert (cfg.paging, cfg.sources["paging"]) == ("tight", "mode:memory")  # the file's mode supplies the rest
    assert (cfg.swap_dir, cfg.sources["swap_dir"]) == (None, "default")
    assert build_config("balanced").sources["mode"] == "argument"
    monkeypatch.setenv("VB_MODE", "full")
    assert (build_config(None).mode, build_config(None).sources["mode"]) == ("full", "environment:VB_MODE")


def test_get_config_names_the_file_and_enable_uses_it(project):
    f = write(project / ".vbrc", json.dumps({"mode": "performance", "attention": "off", "banner": False}))
    vb.enable(device="cpu")
    c = vb.get_config()
    assert c["mode"] == "performance" and c["mode_source"] == f"file:{f}"
    assert c["features"]["attention"] == {**c["features"]["attention"], "value": "off", "source": f"file:{f}"}
    assert c["settings"]["banner"]["source"] == f"file:{f}"
    assert c["config_files"] == [str(f)]


def test_project_file_overrides_user_file_key_by_key(project, tmp_path):
    user = write(tmp_path / "xdg" / "apt_model" / "vbrc", '# the user file, in TOML\nmode = "memory"\nswap_budget = "2GiB"\n')
    proj = write(project / ".vbrc", '{"mode": "balanced"}')
    assert [(s, p) for s, p, _ in vbrc.config_paths()] == [("user", user), ("project", proj)]
    cfg = build_config(None)
    assert (cfg.mode, cfg.sources["mode"]) == ("balanced", f"file:{proj}")
    assert (cfg.swap_budget, cfg.sources["swap_budget"]) == ("2GiB", f"file:{user}")


def test_vb_config_names_one_file_or_none(project, tmp_path, monkeypatch):
    write(project / ".vbrc", '{"mode": "memory"}')
    other = write(tmp_path / "ci.json", '{"mode": "full"}')
    monkeypatch.setenv("VB_CONFIG", str(other))
    assert build_config(None).mode == "full"
    monkeypatch.setenv("VB_CONFIG", "none")
    assert build_config(None).mode == "balanced" and build_config(None).sources["mode"] == "default"
    monkeypatch.setenv("VB_CONFIG", str(tmp_path / "missing.json"))
    with pytest.raises(ConfigFileError, match="missing.json: VB_CONFIG names this file, which does not exist"):
        build_config(None)


def test_vb_device_overrides_the_files_device(project, monkeypatch):
    write(project / ".vbrc", '{"device": "cpu"}')
    assert build_config(None).sources["device"].startswith("file:")
    monkeypatch.setenv("VB_DEVICE", "cpu")
    cfg = build_config(None)
    assert cfg.device is None and cfg.sources["device"] == "environment:VB_DEVICE"


@pytest.mark.parametrize("name, text, line, col, what", [
    (".vbrc", '{\n  "mode": "memory",\n  "paging": "tight",\n}\n', 4, 1,
     "not valid JSON: Expecting property name enclosed in double quotes (a trailing comma before '}'?)"),
    (".vbrc", '{\n  "mode": "memory"\n  "paging": "tight"\n}\n', 3, 3, "not valid JSON: Expecting ',' delimiter"),
    (".vbrc", 'mode = "memory"\npaging = tight\n', 2, 10,
     "not valid TOML (read as TOML because it does not start with '{'): Invalid value"),
    ("ci.json", '[1, 2]', 1, 1, "the top level must be an object"),
    ("ci.toml", 'mode = "memory"\n[fp4_policy\n', 2, 12, "not valid TOML: Expected ']'"),
])
def test_malformed_files_name_path_line_and_column(project, monkeypatch, name, text, line, col, what):
    f = write(project / name, text)
    if name != ".vbrc":
        monkeypatch.setenv("VB_CONFIG", str(f))
    with pytest.raises(ConfigFileError) as exc:
        build_config(None)
    assert (exc.value.path, exc.value.line, exc.value.column) == (str(f), line, col)
    assert str(exc.value).startswith(f"{f}:{line}:{col}: {what}")


@pytest.mark.parametrize("text, line, what", [
    ('{\n  "mode": "balanced",\n  "host_budget": "1GB",\n  "mode": "memory"\n}\n', 4,
     "the key 'mode' is given twice (lines 2, 4): give each key once"),
    ('{"mode": "memory",\n "fp4_policy": {"min_weights": 1,\n  "min_weights": 2}}\n', 3,
     "the key 'min_weights' is given twice (lines 2, 3)"),
])
def test_a_json_file_that_names_a_key_twice_is_an_error_at_the_second(project, text, line, what):
    """Python's JSON reader keeps the last of two values silently (the first was ignored, and an
    error about the second named the first one's line); TOML refuses duplicates itself."""
    f = write(project / ".vbrc", text)
    with pytest.raises(ConfigFileError) as exc:
        build_config(None)
    assert exc.value.line == line and str(exc.value).startswith(f"{f}:{line}: {what}")


def test_unknown_keys_and_bad_values_reuse_the_switch_validation(project):
    f = write(project / ".vbrc", '{\n  "mode": "balanced",\n  "atention": "off"\n}\n')
    with pytest.raises(ConfigFileError, match=rf"^{f}:3: unknown key 'atention' \(did you mean 'attention'\?\); valid keys: mode, attention"):
        build_config(None)
    f.write_text('{\n  "mode": "balanced",\n\n  "attention": "fast"\n}\n')
    with pytest.raises(ConfigError) as exc:
        build_config(None)
    with pytest.raises(ConfigError) as same:  # the same words enable() uses for the same mistake
        build_config("balanced", {"attention": "fast"})
    assert str(exc.value) == f"{f}:4: attention='fast' is not valid; valid values: auto, sdpa, off"
    assert str(same.value).endswith("attention='fast' is not valid; valid values: auto, sdpa, off")
    for text, expected in [('{"host_budget": "lots"}', "host_budget='lots' is not a size"),
                           ('{"mode": "fastest"}', "mode='fastest' is not a mode; valid modes"),
                           ('{"device": "gpu:0"}', "unknown kind 'gpu'"),
                           ('{"banner": "yes"}', "banner='yes' must be True or False"),
                           ('{"autocast_trial_calls": 7}', "must be a multiple of 4")]:
        f.write_text(text)
        with pytest.raises(ConfigFileError, match=f"^{f}:1: .*{expected}"):
            build_config(None)


def test_toml_with_comments_tables_nulls_and_comment_keys(project):
    f = write(project / ".vbrc", '# my settings\nmode = "speed"\nprefer = ["cpu"]\n_note = "ignored"\n'
                                 '[fp4_policy]\nformat = "mxfp4"\n')
    cf = read_config_file(f)
    assert cf.format == "toml" and cf.values["mode"] == "performance" and cf.values["prefer"] == ("cpu",)
    assert cf.values["fp4_policy"]["format"] == "mxfp4" and "_note" not in cf.values
    assert cf.lines["fp4_policy"] == 5
    f.write_text('{"_comment": "x", "host_budget": null, "mode": "memory"}')
    assert read_config_file(f).values == {"mode": "memory"}
    f.write_text('{"mode": "memory"}', encoding="utf-8-sig")  # a BOM (Windows editors): was "not valid TOML"
    assert read_config_file(f).values == {"mode": "memory"} and read_config_file(f).format == "json"


@pytest.mark.parametrize("fmt", ["json", "toml"])
def test_write_then_read_round_trips(tmp_path, fmt):
    values = {"mode": "memory", "host_budget": "18GiB", "swap_dir": str(tmp_path), "banner": False,
              "autocast_min_speedup": 1.2, "prefer": ("cpu",), "fp4_policy": {"format": "mxfp4"}}
    path = tmp_path / ".vbrc"
    write_config_file(path, values, fmt, header="made by a test", comments={"mode": "why: a test"})
    text = path.read_text()
    assert ("# why: a test" in text) if fmt == "toml" else ('"_why"' in text)
    cf = read_config_file(path)
    assert cf.format == fmt
    assert {k: v for k, v in cf.values.items() if k != "fp4_policy"} == {k: v for k, v in values.items() if k != "fp4_policy"}
    assert cf.values["fp4_policy"]["format"] == "mxfp4"
    with pytest.raises(FileExistsError):
        write_config_file(path, values, fmt)
    with pytest.raises(ConfigFileError, match="unknown key 'colour'"):
        write_config_file(tmp_path / "bad", {"colour": "blue"})
    assert not (tmp_path / "bad").exists()


def test_environment_activation_reads_the_file(tmp_path):
    (tmp_path / ".vbrc").write_text('{"mode": "memory", "banner": false}')
    code = ("import json, apt_model.optimization.vb_global as vb\n"
            "c = vb.get_config(); print(json.dumps([vb.is_enabled(), c['mode'], c['mode_source']]))")
    proc = run_python(code, env=clean_env(ENABLE_VIRTUAL_BLACKWELL="1", VB_CONFIG="", XDG_CONFIG_HOME=str(tmp_path / "x")),
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [True, "memory", f"file:{tmp_path / '.vbrc'}"]
    bad = run_python("import apt_model", env=clean_env(ENABLE_VIRTUAL_BLACKWELL="1", VB_CONFIG=str(tmp_path / "nope")))
    assert bad.returncode != 0 and "VB_CONFIG names this file, which does not exist" in bad.stderr


def test_prefer_is_checked_with_the_ranking_validator_enable_uses(project):
    """A ``.vbrc`` ``prefer`` naming no device kind passed the file check (the table's entry checks
    only the form), and enable() then refused it without naming the file or the line."""
    f = write(project / ".vbrc", '{\n  "mode": "balanced",\n  "prefer": "gpu"\n}\n')
    with pytest.raises(ConfigFileError, match=rf"^{f}:3: prefer='gpu' is not a device kind; valid: .*cpu"):
        read_config_file(f)
    with pytest.raises(ConfigFileError, match=rf"^{f}:3: prefer='gpu' is not a device kind"):
        vb.enable(banner=False)
    assert not vb.is_enabled()
    f.write_text('prefer = ["cpu", "tpu"]\n')
    with pytest.raises(ConfigFileError, match=rf"^{f}:1: prefer='tpu' is not a device kind"):
        read_config_file(f)
    f.write_text('prefer = ["cpu"]\n')
    assert read_config_file(f).values == {"prefer": ("cpu",)}
