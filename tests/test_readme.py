"""The README's examples run as written."""
import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT, clean_env, run_python

README = (ROOT / "README.md").read_text(encoding="utf-8")
PY_BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
BASH_LINES = [line for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S)
              for line in block.splitlines() if line.startswith("apt-vb ")]


def test_readme_has_examples():
    assert len(PY_BLOCKS) >= 2 and any("apt-vb run" in line for line in BASH_LINES)


@pytest.mark.parametrize("code", PY_BLOCKS, ids=[f"python-{i}" for i in range(len(PY_BLOCKS))])
def test_python_example_runs(code):
    proc = run_python(code, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("line", [l for l in BASH_LINES if l.startswith("apt-vb run") and "[" not in l])
def test_launcher_example_runs(line, tmp_path):
    cmd = shlex.split(line.split("#")[0])
    cmd = [sys.executable, "-m", "apt_model", *cmd[1:]]
    cmd = [c if c != "runs/vb-report.json" else str(tmp_path / "vb-report.json") for c in cmd]
    if "training/train.py" in cmd:
        cmd += ["--out", str(tmp_path / "train")]  # keep the checkout clean
    proc = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "vb-report.json").exists()
