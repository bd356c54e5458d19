"""apt-vb as users run it: in a subprocess, parsing its JSON."""
import json
import os
import subprocess
import sys

import pytest

from apt_model.devices.backend import STATUSES
from conftest import clean_env


def apt_vb(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "apt_model", *args], capture_output=True, text=True,
                          env=clean_env(), timeout=timeout)


def test_info_json_lists_every_candidate_with_status_and_reason():
    proc = apt_vb("info", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout)
    kinds = {c["kind"]: c for c in info["candidates"]}
    for k in ("cuda", "npu", "mlu", "xpu", "mps", "cpu"):
        assert k in kinds
        assert kinds[k]["status"] in STATUSES and kinds[k]["reason"]
    assert kinds["npu"]["dist_backend"] == "hccl" and kinds["mlu"]["dist_backend"] == "cncl"
    sel = info["selected"]
    assert {"device", "kind", "reason", "ranking", "dist_backend"} <= set(sel)
    assert {"device", "host", "disk"} <= set(info["memory"])
    assert info["memory"]["host"]["total"] > 0
    caps = info["capabilities"]
    assert caps["support"]["dtypes"]["float32"]["matmul"] is True
    assert "speedup" in caps["speed"]["attention"]


def test_info_text_and_version():
    proc = apt_vb("info", "--no-probe")
    assert proc.returncode == 0 and "Device candidates" in proc.stdout and "Memory tiers" in proc.stdout
    assert "Capabilities" not in proc.stdout
    ver = apt_vb("--version")
    assert ver.returncode == 0 and ver.stdout.startswith("apt_model ")


@pytest.mark.slow  # two subprocesses (run -m in process: test_run_m_finds_a_module...); the default suite's 15-minute budget on 2 cores
def test_run_module_and_missing_script(tmp_path):
    pkg = tmp_path / "mymod.py"
    pkg.write_text("import sys\nimport apt_model.optimization.vb_global as vb\nprint('MOD', vb.is_enabled(), sys.argv[1:])\n")
    proc = subprocess.run([sys.executable, "-m", "apt_model", "run", "--quiet", "-m", "mymod", "x", "--flag"],
                          capture_output=True, text=True, env=clean_env(PYTHONPATH=str(tmp_path)), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "MOD True ['x', '--flag']" in proc.stdout
    bad = apt_vb("run", str(tmp_path / "nope.py"))
    assert bad.returncode != 0 and "not found" in bad.stderr


def test_run_refuses_a_missing_module_and_an_unwritable_report_before_the_script_runs(tmp_path):
    """``run -m missing`` printed the banner and a runpy traceback; ``--report`` into a folder that
    cannot be created was found only after the whole script had run (traceback, report lost).
    Both are one-line errors with exit status 2 now, and the script does not run."""
    script = tmp_path / "s.py"
    script.write_text("print('SCRIPT RAN')\n")
    missing = apt_vb("run", "--quiet", "-m", "no_such_module_xyz")
    assert missing.returncode == 2 and "module 'no_such_module_xyz' not found" in missing.stderr
    assert "Traceback" not in missing.stderr
    blocked = tmp_path / "file"
    blocked.write_text("")
    bad = apt_vb("run", "--quiet", "--report", str(blocked / "sub" / "r.json"), str(script))
    assert bad.returncode == 2 and "--report" in bad.stderr and "SCRIPT RAN" not in bad.stdout, bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_the_output_path_check_tries_the_file_and_leaves_nothing(tmp_path):
    """Root may write to every folder by the permission bits, so ``os.access`` said yes for
    ``/proc`` and the run failed at its end; the check now opens the file, and removes it again
    when it made it (an existing file keeps its bytes)."""
    from apt_model.cli.launcher import check_output_path
    from apt_model.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--report '/proc/vb-report.json': not a writable file path"):
        check_output_path("/proc/vb-report.json", "--report")
    check_output_path(str(tmp_path / "sub" / "r.json"), "--report")
    assert (tmp_path / "sub").is_dir() and not (tmp_path / "sub" / "r.json").exists()
    kept = tmp_path / "old.json"
    kept.write_text("{}")
    check_output_path(str(kept), "--json")
    assert kept.read_text() == "{}"


def test_run_m_finds_a_module_in_the_current_folder_as_python_m_does(tmp_path, monkeypatch, capsys):
    """``python -m pkg.mod`` puts the current folder first on sys.path; the ``apt-vb`` console
    script does not have it there, so ``apt-vb run -m pkg.mod`` said the module was not found.
    It now runs it, with sys.argv[0] the module's file (as python -m sets it), and sys.path is
    restored afterwards."""
    import sys

    from apt_model.cli.main import main

    pkg = tmp_path / "vb_cwd_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mymod.py").write_text("import sys\nprint('RAN', sys.argv, sys.path[0])\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    path_before = list(sys.path)
    try:
        assert main(["run", "--quiet", "-m", "vb_cwd_pkg.mymod", "a"]) == 0
    finally:
        for name in ("vb_cwd_pkg", "vb_cwd_pkg.mymod"):
            sys.modules.pop(name, None)
    assert f"RAN [{str(pkg / 'mymod.py')!r}, 'a'] {tmp_path}" in capsys.readouterr().out
    assert sys.path == path_before


def test_output_into_a_closed_pipe_stops_quietly(monkeypatch, capsys):
    """``apt-vb config show | head -1`` ended in a BrokenPipeError traceback. The entry point now
    stops quietly with 128 + SIGPIPE, stdout pointed at the null device (so the final flush at
    exit does not fail again)."""
    import os
    import sys

    from apt_model.cli.main import main

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone, as head has after its first line
    closed = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdout", closed)
    try:
        assert main(["config", "show"]) == 141
        closed.write("more\n")
        closed.flush()  # the descriptor now leads to the null device
    finally:
        closed.close()
    assert capsys.readouterr().err == ""


def test_run_passes_the_scripts_arguments_verbatim_with_their_double_dash(tmp_path, capsys):
    """``python script.py -- --x`` gives the script ``['--', '--x']``; ``apt-vb run script.py -- --x``
    dropped the ``--`` (argparse takes the first one as its own). The launcher's options before the
    script (``--mode VALUE`` too) are still its own, and a ``--`` before the script separates them."""
    from apt_model.cli.main import main

    script = tmp_path / "argv_script.py"
    script.write_text("import sys\nprint('ARGV', sys.argv[1:])\n")
    cases = [(["--quiet", str(script), "--", "--x"], ["--", "--x"]),
             (["--quiet", "--mode", "balanced", str(script), "a", "--mode", "x"], ["a", "--mode", "x"]),
             (["--quiet", "--", str(script), "--", "b"], ["--", "b"])]
    for launcher_args, expected in cases:
        assert main(["run", *launcher_args]) == 0
        assert f"ARGV {expected!r}" in capsys.readouterr().out, launcher_args


def test_run_quiet_silences_a_vbrc_that_asks_for_verbose(project, capsys, monkeypatch):
    """``apt-vb run --quiet`` printed every decision when the project's .vbrc said
    ``verbose: true`` (a probe's minor): quiet means no banner and no decision echo."""
    from apt_model.cli.main import main
    import apt_model.optimization.vb_global as vb

    monkeypatch.setenv("VB_DEVICE", "cpu")
    (project / ".vbrc").write_text('{"mode": "balanced", "verbose": true, "mixed_precision": "off"}\n')
    script = project / "train_tiny.py"
    script.write_text("import torch\nm = torch.nn.Linear(4, 4).to('cpu')\nm(torch.ones(2, 4)).sum().backward()\nprint('TRAINED')\n")
    try:
        assert main(["run", "--quiet", str(script)]) == 0
        assert vb.get_config()["settings"]["verbose"]["value"] is False
    finally:
        vb.disable()
    out = capsys.readouterr()
    assert "TRAINED" in out.out
    assert "mixed_precision" not in out.out + out.err and "Virtual Blackwell" not in out.out + out.err
