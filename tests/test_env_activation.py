"""Environment activation at import, its validation, and the absence of other import side effects."""
import json
import subprocess
import sys
import textwrap

import pytest

import apt_model.optimization.vb_global as vb
from apt_model.errors import USER_ERRORS
from apt_model.switch.env import activate_from_environment
from conftest import clean_env, run_python

PROBE = textwrap.dedent("""
    import json, torch, torch.nn as nn
    before = (nn.Module.to, torch.Tensor.to)
    import apt_model
    import apt_model.optimization.vb_global as vb
    from torch.nn.modules import module as M
    print("RESULT" + json.dumps({
        "enabled": vb.is_enabled(),
        "mode": vb.get_config()["mode"],
        "untouched": before == (nn.Module.to, torch.Tensor.to),
        "global_hooks": len(M._global_forward_pre_hooks),
    }))
""")


def _result(proc):
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


def test_import_without_env_has_no_side_effects():
    r = _result(run_python(PROBE, env=clean_env()))
    assert r == {"enabled": False, "mode": None, "untouched": True, "global_hooks": 0}


def test_env_enables_at_import():
    r = _result(run_python(PROBE, env=clean_env(ENABLE_VIRTUAL_BLACKWELL="1", VB_MODE="memory")))
    assert r["enabled"] is True and r["mode"] == "memory"
    assert r["untouched"] is False and r["global_hooks"] == 1


# The import runs activate_from_environment() (tests/test_entry_errors.py runs the import itself:
# one line, status 2); the values are checked here in this process, a fresh interpreter each costs
# seconds of the suite's budget.
@pytest.mark.parametrize("mode,expected", [("memory", "memory"), ("speed", "performance"), ("", "balanced"),
                                           ("Balanced", "balanced")])
def test_env_modes(mode, expected, monkeypatch, cpu_device):
    monkeypatch.setenv("ENABLE_VIRTUAL_BLACKWELL", "1")
    monkeypatch.setenv("VB_MODE", mode)
    assert activate_from_environment() is True
    assert vb.is_enabled() and vb.get_config()["mode"] == expected


@pytest.mark.parametrize("env,needle", [
    ({"ENABLE_VIRTUAL_BLACKWELL": "maybe"}, "ENABLE_VIRTUAL_BLACKWELL='maybe' is not valid; use one of 1, true, yes, on"),
    ({"ENABLE_VIRTUAL_BLACKWELL": "1", "VB_MODE": "fast"}, "VB_MODE='fast' is not a mode; valid modes: performance, speed, balanced, memory, full"),
    ({"VB_MODE": "fast"}, "VB_MODE='fast' is not a mode"),  # validated even while the switch stays off
    ({"ENABLE_VIRTUAL_BLACKWELL": "1", "VB_ATTENTION": "flash3"}, "VB_ATTENTION: attention='flash3' is not valid; valid values: auto, sdpa, off"),
    ({"VB_LOG_LEVEL": "LOUD"}, "VB_LOG_LEVEL='LOUD' is not valid; use one of DEBUG"),
    ({"ENABLE_VIRTUAL_BLACKWELL": "1", "VB_DEVICE": "npu:1"}, "VB_DEVICE='npu:1' asks for npu, which is not usable here (npu: not_installed - package torch_npu not installed"),
    ({"ENABLE_VIRTUAL_BLACKWELL": "1", "VB_DEVICE": "gpu"}, "unknown kind 'gpu'; valid kinds:"),
    ({"ENABLE_VIRTUAL_BLACKWELL": "1", "VB_CHECKPOINT_POLICY": "half"},
     "VB_CHECKPOINT_POLICY='half' is not valid; use 'all', 'every:K' (K >= 1) or 'budget'"),
])
def test_invalid_env_values_fail_clearly(env, needle, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(USER_ERRORS) as err:
        activate_from_environment()
    assert needle in str(err.value)
    assert not vb.is_enabled()


@pytest.mark.parametrize("value", ["off", "0", "false", "no", ""])
def test_false_values_keep_it_off(value, monkeypatch):
    monkeypatch.setenv("ENABLE_VIRTUAL_BLACKWELL", value)
    monkeypatch.setenv("VB_MODE", "memory")
    assert activate_from_environment() is False
    assert not vb.is_enabled()


@pytest.mark.slow  # apt-vb run of a script in a subprocess, as test_readme's launcher example; the suite's 15 minutes on 2 cores
def test_launcher_enables_for_an_unmodified_script(tmp_path):
    script = tmp_path / "train_like.py"
    script.write_text(textwrap.dedent("""
        import sys, json, torch
        import apt_model.optimization.vb_global as vb
        model = torch.nn.Linear(4, 4).cuda()   # a CUDA-only script on a machine without CUDA
        print("RESULT" + json.dumps({"argv": sys.argv[1:], "enabled": vb.is_enabled(),
                                      "mode": vb.get_config()["mode"], "device": str(model.weight.device)}))
        sys.exit(3)
    """))
    report = tmp_path / "vb.json"
    # "a machine without CUDA" for real on any machine: CUDA/ROCm hidden, the switch pinned to the CPU
    # (an NPU/XPU machine would otherwise redirect .cuda() to its own accelerator)
    env = clean_env(VB_DEVICE="cpu", CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "apt_model", "run", "--mode", "memory", "--quiet",
                           "--report", str(report), str(script), "--lr", "1"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    r = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert r == {"argv": ["--lr", "1"], "enabled": True, "mode": "memory", "device": "cpu"}
    rep = json.loads(report.read_text())
    assert rep["stats"]["cuda_redirects"] >= 1 and rep["models"][0]["name"] == "Linear"


@pytest.mark.slow  # 7 s of subprocesses; the suite's budget is 15 minutes
def test_the_command_line_is_not_switched_on_by_the_environment(tmp_path):
    """``ENABLE_VIRTUAL_BLACKWELL=1`` in the shell (as the README suggests) must not turn the
    switch on when the process is apt_model's own CLI: its banner went to stdout ahead of every
    ``--json`` document, and ``apt-vb run --quiet --mode balanced`` printed a banner for the
    environment's mode. ``apt-vb run`` enables the switch itself, with its own flags."""
    env = clean_env(ENABLE_VIRTUAL_BLACKWELL="1", VB_MODE="memory", VB_DEVICE="cpu")
    proc = subprocess.run([sys.executable, "-m", "apt_model", "config", "show", "--json"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["config"]["mode"] == "memory"  # the environment still configures
    script = tmp_path / "s.py"
    script.write_text("import apt_model.optimization.vb_global as vb\nprint('MODE', vb.get_config()['mode'])\n")
    proc = subprocess.run([sys.executable, "-m", "apt_model", "run", "--quiet", "--mode", "balanced", str(script)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "MODE balanced" and "enabled" not in proc.stderr, (proc.stdout, proc.stderr)
