"""apt-vb bench as users run it: in a subprocess, its JSON parsed; bad arguments."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, clean_env


def apt_vb(*args, cwd=None, timeout=240, **env):
    return subprocess.run([sys.executable, "-m", "apt_model", *args], capture_output=True, text=True,
                          env=clean_env(**env), cwd=cwd or ROOT, timeout=timeout)


def test_bench_json_has_every_group_with_medians_and_spread(tmp_path):
    out = tmp_path / "bench.json"
    proc = apt_vb("bench", "--duration", "3", "--threads", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gemm 256 float32" in proc.stdout and "medians over timed calls" in proc.stdout  # the table
    r = json.loads(out.read_text())
    assert {"kind", "machine", "settings", "noise", "devices", "disk", "elapsed_s"} <= set(r)
    assert r["settings"]["threads"] == 1 and r["machine"]["torch_threads"] == 1
    assert {"load_before", "load_after", "noisy_results", "note"} <= set(r["noise"])
    cases = r["devices"]["cpu"]["cases"]
    assert {c["group"] for c in cases.values()} == {"gemm", "elementwise", "norm", "attention"}
    g = cases["gemm 256 float32"]
    assert g["unit"] == "GFLOP/s" and g["n"] >= 1 and g["p25"] <= g["median"] <= g["p75"] and "time_ms" in g
    att = next(c for c in cases.values() if c["group"] == "attention")
    assert "speedup" in att or "skipped" in att
    if "speedup" in att:
        assert att["speedup"] == pytest.approx(att["plain"]["median"] / att["sdpa"]["median"])
    assert r["disk"]["unit"] == "GB/s" and ("write" in r["disk"] or "skipped" in r["disk"])


def test_bench_rejects_bad_arguments(capsys):
    from apt_model.cli.main import main

    assert main(["bench", "--duration", "0"]) == 2
    assert "duration=0.0 must be > 0" in capsys.readouterr().err
    assert main(["bench", "--device", "gpu:0", "--duration", "1"]) == 2
    assert "unknown kind 'gpu'" in capsys.readouterr().err
    assert main(["bench", "--group", "fft", "--duration", "1"]) == 2
    assert "unknown group(s) ['fft']; valid groups: gemm" in capsys.readouterr().err
