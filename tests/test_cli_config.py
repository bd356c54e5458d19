"""apt-vb config suggest|show|save|load: JSON from a subprocess, the save/load flow, errors that
name the file and the line."""
import json
import subprocess
import sys

import pytest

from apt_model.base.sizes import parse_size
from conftest import ROOT, best_device, clean_env


def apt_vb(*args, cwd=None, timeout=240, **env):
    return subprocess.run([sys.executable, "-m", "apt_model", *args], capture_output=True, text=True,
                          env=clean_env(**env), cwd=cwd or ROOT, timeout=timeout)




def suggest_json() -> dict:
    proc = apt_vb("config", "suggest", "--json", "--no-measure")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_config_suggest_json(cpu_device):
    """Planned for the CPU (VB_DEVICE=cpu, inherited by the subprocess): no accelerator, and the
    host budget is also the level-0 budget."""
    s = suggest_json()
    assert {"values", "reasons", "notes", "machine", "summary"} <= set(s)
    assert s["machine"]["device"] == "cpu" and s["machine"]["device_memory"] is None
    assert s["values"]["mode"] == "balanced" and "no accelerator" in s["reasons"]["mode"]
    assert 0 < parse_size(s["values"]["host_budget"]) <= s["machine"]["host_ram"]
    assert "also the level-0 budget" in s["reasons"]["host_budget"]
    assert set(s["reasons"]) == set(s["values"])
    assert s["summary"].startswith("host RAM ") and "no accelerator" in s["summary"]


@pytest.mark.gpu
def test_config_suggest_json_plans_for_the_accelerator():
    """With no device named, the suggestion is for the ranking's choice: on a GPU machine, the GPU,
    named with its memory; its budget is left to enable() (free memory follows other processes)."""
    dev = best_device()
    if dev == "cpu":
        pytest.skip("needs an accelerator: the ranking chose the CPU on this machine")
    s = suggest_json()
    assert s["machine"]["device"] == dev and s["machine"]["device_memory"] > 0
    assert s["values"]["mode"] in ("balanced", "memory") and s["reasons"]["mode"].startswith(f"{dev} ")
    assert "no accelerator" not in s["reasons"]["mode"] + s["summary"]
    assert "level-0 budget" not in s["reasons"]["host_budget"] and "device_budget" not in s["values"]
    assert any(n.startswith("device_budget left unset") for n in s["notes"])
    assert 0 < parse_size(s["values"]["host_budget"]) <= s["machine"]["host_ram"]


def test_config_show_json_in_a_subprocess(tmp_path):
    (tmp_path / ".vbrc").write_text('# TOML\nmode = "memory"\nattention = "off"\n')
    proc = apt_vb("config", "show", "--json", cwd=tmp_path, VB_CONFIG="", XDG_CONFIG_HOME=str(tmp_path / "x"),
                  VB_PAGING="off", VB_PAGNG="always")
    assert proc.returncode == 0, proc.stderr[-2000:]
    sj = json.loads(proc.stdout)
    # a misspelled variable name: named, with the closest real one, not silently ignored
    assert sj["config"]["unknown_variables"] == [{"name": "VB_PAGNG", "did_you_mean": "VB_PAGING"}]
    assert "VB_PAGNG is not a setting apt_model reads" in proc.stderr and "did you mean VB_PAGING?" in proc.stderr
    src = f"file:{tmp_path / '.vbrc'}"
    assert [f["scope"] for f in sj["files"]] == ["user", "project"] and sj["files"][1]["exists"]
    assert sj["config"]["mode"] == "memory" and sj["config"]["mode_source"] == src
    assert sj["config"]["features"]["attention"] == {"value": "off", "source": src}
    assert sj["config"]["features"]["paging"] == {"value": "off", "source": "environment:VB_PAGING"}
    assert sj["config"]["features"]["fp4"]["source"] == "mode:memory"
    assert sj["config"]["settings"]["host_budget"] == {"value": None, "source": "default"}


def test_config_save_and_load(project, tmp_path, capsys):
    from apt_model.cli.main import main

    swap = tmp_path / "swap"
    assert main(["config", "save", "--no-measure", "--mode", "memory", "--set", "attention=off",
                 "--set", f"swap_dir={swap}"]) == 0
    assert swap.is_dir()  # created: the switch needs an existing swap dir
    data = json.loads((project / ".vbrc").read_text())
    assert data["mode"] == "memory" and data["attention"] == "off" and "_comment" in data and "_why" in data
    # the header's summary is the suggestion's; what was set by hand is said after it (it read as if kept)
    assert f"; then set by hand: mode=memory, attention=off, swap_dir={swap}." in data["_comment"]
    assert main(["config", "save", "--no-measure"]) == 2
    assert "exists; pass overwrite=True" in capsys.readouterr().err
    assert main(["config", "save", "--no-measure", "--path", str(tmp_path / "t.toml"), "--all-features"]) == 0
    text = (tmp_path / "t.toml").read_text()
    assert text.startswith("# Written by apt-vb config save") and "\nactivation_offload = false\n" in text
    # load: a TOML template checked and installed as the user's file
    tmpl = tmp_path / "team.toml"
    tmpl.write_text('# team defaults\nmode = "balanced"\nautocast_min_speedup = 1.2\n')
    assert main(["config", "load", str(tmpl), "--user"]) == 0
    user = tmp_path / "xdg" / "apt_model" / "vbrc"
    assert user.read_text().startswith("# team defaults")
    capsys.readouterr()
    assert main(["config", "show", "--json"]) == 0
    cfg = json.loads(capsys.readouterr().out)["config"]
    assert cfg["mode_source"] == f"file:{project / '.vbrc'}"  # the project's file wins over the user's
    assert cfg["settings"]["autocast_min_speedup"] == {"value": 1.2, "source": f"file:{user}"}
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "mode": "balanced",\n  "paging": "sometimes"\n}\n')
    assert main(["config", "load", str(bad), "--check"]) == 2
    assert (f"{bad}:3: paging='sometimes' is not valid; valid values: off, over_budget, tight, always"
            in capsys.readouterr().err)
    (project / ".vbrc").write_text('{\n  "mode": "balanced",\n}\n')
    assert main(["config", "show"]) == 2
    assert f"{project / '.vbrc'}:3:1: not valid JSON" in capsys.readouterr().err



def test_config_load_check_refuses_a_missing_swap_dir(project, tmp_path, capsys):
    from apt_model.cli.main import main

    f = tmp_path / "team.vbrc"
    f.write_text(json.dumps({"mode": "memory", "swap_dir": str(tmp_path / "absent")}))
    assert main(["config", "load", str(f), "--check"]) == 2
    err = capsys.readouterr().err
    assert "swap_dir=" in err and "is not an existing folder" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "absent").mkdir()
    assert main(["config", "load", str(f), "--check"]) == 0
    assert not (project / ".vbrc").exists()  # --check installs nothing


@pytest.mark.parametrize("src_name, text, dest_name", [
    ("in.toml", 'mode = "memory"\npaging = "tight"\n', "out.json"),
    ("in.json", '{"mode": "memory"}\n', "out.toml"),
])
def test_config_load_refuses_a_destination_named_for_the_other_format(tmp_path, capsys, src_name, text, dest_name):
    """``config load in.toml --path out.json`` installed the TOML text (verbatim) in a file then
    read as JSON, which failed at every later command. As ``config save --format`` does for a
    mismatched name, it is refused now (exit status 2, nothing written); a matching name works."""
    from apt_model.cli.main import main

    src = tmp_path / src_name
    src.write_text(text)
    dest = tmp_path / dest_name
    assert main(["config", "load", str(src), "--path", str(dest)]) == 2
    err = capsys.readouterr().err
    suffix = dest.suffix
    assert f"{dest}: format={src.suffix[1:]!r} does not match the file name's {suffix} suffix" in err
    assert f"give --path a {src.suffix} name" in err and len(err.strip().splitlines()) == 1
    assert not dest.exists()
    good = tmp_path / f"out{src.suffix}"
    assert main(["config", "load", str(src), "--path", str(good)]) == 0
    assert good.read_text() == text


def test_config_load_check_refuses_an_unknown_prefer_kind_naming_the_file_and_line(tmp_path, capsys):
    """``{"prefer": "gpu"}`` passed ``config load --check`` and then failed at enable(), with a
    message naming neither the file nor the line."""
    from apt_model.cli.main import main

    f = tmp_path / "vbrc.json"
    f.write_text('{\n "prefer": "gpu"\n}\n')
    assert main(["config", "load", str(f), "--check"]) == 2
    err = capsys.readouterr().err
    assert f"{f}:2: prefer='gpu' is not a device kind; valid: " in err and "cpu" in err


def test_enable_warns_about_a_misspelled_variable_name(monkeypatch, caplog, cpu_device):
    """``VB_MDOE=memory`` was ignored without a word: the script ran in balanced mode, not paging
    (a probe's finding). A typo in a name is a warning (another tool may use the prefix), once."""
    import apt_model.optimization.vb_global as vb

    monkeypatch.setenv("VB_MDOE", "memory")
    monkeypatch.setenv("VB_ZZZ_UNRELATED", "1")
    for _ in range(2):
        vb.enable("balanced", banner=False)
        vb.disable()
    said = [r.getMessage() for r in caplog.records if "is not a setting apt_model reads" in r.getMessage()]
    assert len([m for m in said if "VB_MDOE" in m]) <= 1 and len(said) <= 2  # once per process
    from apt_model.switch.config import describe_unknown_env, unknown_env_names

    assert ("VB_MDOE", "VB_MODE") in unknown_env_names() and ("VB_ZZZ_UNRELATED", None) in unknown_env_names()
    assert "did you mean VB_MODE?" in describe_unknown_env("VB_MDOE", "VB_MODE")
