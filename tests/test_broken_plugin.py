"""A broken vendor plugin (torch_npu installed without CANN) must not kill the user's program.

A fake ``torch_npu`` distribution is put on the path: it declares the ``torch.backends`` entry
point that torch auto-loads at ``import torch``, and its import fails the way torch_npu does
on a machine without Ascend's libraries.
"""
import json
import sys
import textwrap

import pytest

from conftest import best_device, clean_env, run_python

ERROR_TEXT = "libhccl.so: cannot open shared object file: No such file or directory"


@pytest.fixture
def broken_npu(tmp_path):
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(f"""
        raise ImportError({ERROR_TEXT!r})
        def _autoload():
            pass
    """))
    dist = tmp_path / "torch_npu-2.6.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.6.0\n")
    (dist / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")
    return clean_env(PYTHONPATH=str(tmp_path))


def test_plain_import_torch_really_fails(broken_npu):
    """The simulation is faithful: without apt_model, ``import torch`` dies."""
    proc = run_python("import torch", env=broken_npu)
    assert proc.returncode != 0
    assert "Failed to load the backend extension: torch_npu" in proc.stderr


def test_importing_apt_model_first_survives_and_reports_the_error(broken_npu):
    """The broken NPU plugin neither kills the program nor changes the device choice: the run gets
    the device this machine would pick anyway (the CPU, or a GPU where there is one)."""
    expected = best_device()  # in this process, where the fake torch_npu is not on the path
    if expected.startswith("npu"):
        pytest.skip("a real torch_npu is installed here: the fake one on the path would shadow it")
    code = textwrap.dedent("""
        import json
        import apt_model
        import torch
        from apt_model.devices.detection import detect_devices
        from apt_model.devices.ranking import select_device
        c = {c.kind: c for c in detect_devices()}["npu"]
        x = torch.ones(3) * 2  # torch works
        print("RESULT" + json.dumps({"status": c.status, "reason": c.reason, "sum": float(x.sum()),
                                      "device": str(select_device().device)}))
    """)
    proc = run_python(code, env=broken_npu)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert r["status"] == "error"
    assert "torch_npu is installed but failed to load" in r["reason"] and ERROR_TEXT in r["reason"]
    assert r["sum"] == 6.0 and r["device"] == expected
    assert "torch_npu" in proc.stderr  # logged as a warning, not swallowed


def test_cli_info_survives_and_reports_the_error(broken_npu):
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "apt_model", "info", "--json", "--no-probe"],
                          capture_output=True, text=True, env=broken_npu, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    npu = next(c for c in json.loads(proc.stdout)["candidates"] if c["kind"] == "npu")
    assert npu["status"] == "error" and ERROR_TEXT in npu["reason"]


def test_launcher_runs_an_unmodified_script(broken_npu, tmp_path):
    import subprocess

    script = tmp_path / "user_script.py"
    script.write_text("import torch\nprint('trained', float(torch.ones(2).sum()))\n")
    proc = subprocess.run([sys.executable, "-m", "apt_model", "run", "--quiet", str(script)],
                          capture_output=True, text=True, env=broken_npu, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "trained 2.0" in proc.stdout
