"""Every entry point reports a mistake in what the user typed as one line naming it (the flag, the
variable or the .vbrc line) with the valid forms, and exit status 2; the traceback only with
VB_LOG_LEVEL=DEBUG. Entry points: the main job (training/train.py), the apt-vb verbs, and the
environment activation at ``import apt_model``."""
import subprocess
import sys

import pytest

from apt_model.cli import main as cli
from conftest import ROOT, clean_env, run_python

TRAIN = str(ROOT / "training" / "train.py")
SIZE_FORMS = "512MB"  # the message shows the valid forms by example
MODES = "valid modes: performance, speed, balanced, memory, full"


def one_error_line(err: str, prefix: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(prefix + ": error: "), lines[0]
    assert "Traceback" not in err
    return lines[0]


def load_train():
    sys.path.insert(0, str(ROOT / "training"))
    try:
        import train
    finally:
        sys.path.pop(0)
    return train


# ---------------------------------------------------------------------------- training/train.py


def test_main_job_bad_flag_is_one_line_naming_the_flag(tmp_path):
    proc = subprocess.run([sys.executable, TRAIN, "--device-budget", "abc", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    line = one_error_line(proc.stderr, "train.py")
    assert "--device-budget='abc' is not a size" in line and SIZE_FORMS in line and "enable()" not in line
    assert proc.stdout == ""  # nothing ran: no banner


@pytest.mark.parametrize("argv,needle", [
    (["--device", "gpu"], "--device='gpu': unknown kind 'gpu'; valid kinds: cpu"),
    (["--host-budget", "lots"], "--host-budget='lots' is not a size"),
    (["--steps", "0"], "--steps 0 must be a positive integer"),
    (["--swap-dir", "/does/not/exist"], "--swap-dir '/does/not/exist' is not an existing folder"),
    (["--vb-mode", "fast"], "argument --vb-mode: invalid choice: 'fast'"),
    # a negative clip norm scaled every gradient by a negative factor: the job trained the model
    # backwards, loss 5.4 -> 18.1, and exited 0 (a probe's finding); --lr -1 / nan was a traceback
    (["--grad-clip", "-1"], "--grad-clip -1.0 must be a finite number >= 0 (0: no clipping)"),
    (["--lr", "nan"], "--lr nan must be a finite number > 0"),
    (["--lr", "0"], "--lr 0.0 must be a finite number > 0"),
    (["--weight-decay", "-0.1"], "--weight-decay -0.1 must be a finite number >= 0"),
    (["--warmup", "-1"], "--warmup -1 must be 0 or more"),
])
def test_main_job_flags_in_process(argv, needle, capsys, tmp_path):
    train = load_train()
    with pytest.raises(SystemExit) as exc:
        train.main([*argv, "--out", str(tmp_path)])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert needle in one_error_line(captured.err, "train.py") and captured.out == ""


def test_main_job_out_folder_is_checked_before_training(capsys, tmp_path):
    """An --out folder that cannot be created failed after the whole run, losing it (a probe's finding)."""
    train = load_train()
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for out, needle in ((blocker, "is a file"), (blocker / "sub", "cannot be created")):
        with pytest.raises(SystemExit) as exc:
            train.main(["--out", str(out), "--steps", "1"])
        assert exc.value.code == 2
        captured = capsys.readouterr()
        assert needle in one_error_line(captured.err, "train.py") and captured.out == ""


def test_main_job_bad_variable_names_the_variable(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("VB_DEVICE_BUDGET", "abc")
    with pytest.raises(SystemExit) as exc:
        load_train().main(["--out", str(tmp_path)])
    assert exc.value.code == 2
    line = one_error_line(capsys.readouterr().err, "train.py")
    assert "VB_DEVICE_BUDGET='abc' is not a size" in line and SIZE_FORMS in line


def test_main_job_bad_vbrc_names_the_file_and_line(project, capsys, tmp_path):
    (project / ".vbrc").write_text('{\n  "mode": "fast"\n}\n')
    with pytest.raises(SystemExit) as exc:
        load_train().main(["--out", str(tmp_path)])
    assert exc.value.code == 2
    line = one_error_line(capsys.readouterr().err, "train.py")
    assert f"{project / '.vbrc'}:2: mode='fast' is not a mode; {MODES}" in line


# ---------------------------------------------------------------------------- apt-vb


@pytest.mark.parametrize("argv,needle", [
    (["info", "--device", "gpu"], "--device='gpu': unknown kind 'gpu'; valid kinds: cpu"),
    (["bench", "--device", "cpu,tpu", "--duration", "1"], "--device='tpu': unknown kind 'tpu'"),
    (["run", "--mode", "fast", "x.py"], f"--mode='fast' is not a mode; {MODES}"),
    (["bench", "--duration", "abc"], "argument --duration: invalid float value: 'abc' (see apt-vb bench --help)"),
])
def test_apt_vb_bad_flag(argv, needle, capsys):
    try:
        status = cli.main(argv)
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    assert status == 2
    captured = capsys.readouterr()
    line = one_error_line(captured.err, f"apt-vb {argv[0]}")
    assert needle in line and captured.out == ""


def test_apt_vb_bad_vbrc(project, capsys):
    (project / ".vbrc").write_text('mode = "fast"\n')
    assert cli.main(["config", "show"]) == 2
    line = one_error_line(capsys.readouterr().err, "apt-vb config")
    assert f"{project / '.vbrc'}:1: mode='fast' is not a mode; {MODES}" in line


def test_apt_vb_bad_variable_at_import_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "apt_model", "info", "--no-probe"], capture_output=True, text=True,
                          env=clean_env(VB_MODE="fast"), cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    line = one_error_line(proc.stderr, "python -m apt_model")
    assert f"VB_MODE='fast' is not a mode; {MODES}" in line


# ---------------------------------------------------------------------------- import apt_model


@pytest.mark.parametrize("env,needle", [
    ({"ENABLE_VIRTUAL_BLACKWELL": "1", "VB_HOST_BUDGET": "lots"}, "VB_HOST_BUDGET='lots' is not a size"),
])  # the other values are checked in this process: test_env_activation.py
def test_import_with_a_bad_variable_is_one_line_and_status_2(env, needle):
    proc = run_python("import apt_model\nprint('not reached')", env=clean_env(**env))
    assert proc.returncode == 2 and proc.stdout == ""
    assert needle in one_error_line(proc.stderr, "python")


def test_import_with_a_bad_vbrc_is_one_line_and_status_2(tmp_path):
    rc = tmp_path / "my.vbrc"
    rc.write_text('{"paging": "sometimes"}\n')
    proc = run_python("import apt_model", env=clean_env(ENABLE_VIRTUAL_BLACKWELL="1", VB_CONFIG=str(rc)))
    assert proc.returncode == 2
    line = one_error_line(proc.stderr, "python")
    assert f"{rc}:1: paging='sometimes' is not valid; valid values: off, over_budget, tight, always" in line


def test_traceback_only_with_debug_logging():
    proc = run_python("import apt_model", env=clean_env(VB_MODE="fast", VB_LOG_LEVEL="DEBUG"))
    assert proc.returncode == 2
    assert "Traceback (most recent call last)" in proc.stderr and "validate_mode" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("python: error: VB_MODE='fast' is not a mode")
