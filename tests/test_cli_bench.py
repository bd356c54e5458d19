"""apt-vb bench as users run it: in a subprocess, its JSON parsed; bad arguments."""
import json
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, best_device, clean_env


def apt_vb(*args, cwd=None, timeout=240, **env):
    return subprocess.run([sys.executable, "-m", "apt_model", *args], capture_output=True, text=True,
                          env=clean_env(**env), cwd=cwd or ROOT, timeout=timeout)


RATE_GROUPS = {"gemm", "elementwise", "norm", "transfer"}
TRANSFER_CASES = {"host->device pageable", "host->device pinned", "device->host pageable", "device->host pinned"}


def _stats_ok(s: dict) -> bool:
    return s["n"] >= 1 and 0 < s["p25"] <= s["median"] <= s["p75"]


def assert_result_shape(name: str, c: dict) -> bool:
    """One case's result has the documented shape (docs/cli.md) whatever the device; True when it
    has figures, False when it was skipped or failed (with the reason)."""
    assert c["group"] in RATE_GROUPS | {"attention"} and c["unit"], (name, c)
    if "skipped" in c or "error" in c:
        assert (c.get("skipped") or c.get("error")) and "median" not in c, (name, c)
        return False
    assert isinstance(c["noisy"], bool) and c["spread"] >= 0, (name, c)
    if c["group"] == "attention":
        assert c["unit"] == "ms" and _stats_ok(c["sdpa"]) and _stats_ok(c["plain"]), (name, c)
        assert c["speedup"] == pytest.approx(c["plain"]["median"] / c["sdpa"]["median"])
    else:
        assert c["unit"] == ("GFLOP/s" if c["group"] == "gemm" else "GB/s"), (name, c)
        assert _stats_ok(c) and c["warmup_ms"] >= 0, (name, c)
        assert set(c["time_ms"]) == {"median", "p25", "p75", "min", "max"}, (name, c)
    return True


def accelerator() -> str:
    dev = best_device()
    if dev == "cpu":
        pytest.skip("needs an accelerator: the ranking chose the CPU on this machine")
    return dev


def test_bench_json_has_every_group_with_medians_and_spread(tmp_path):
    """The default devices (the CPU and, on a machine with one, the accelerator): every result
    has the documented shape, and the first case ran on every device."""
    out = tmp_path / "bench.json"
    proc = apt_vb("bench", "--duration", "3", "--threads", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gemm 256 float32" in proc.stdout and "medians over timed calls" in proc.stdout  # the table
    r = json.loads(out.read_text())
    assert {"kind", "machine", "settings", "noise", "devices", "disk", "elapsed_s"} <= set(r)
    assert r["settings"]["threads"] == 1 and r["machine"]["torch_threads"] == 1
    assert {"load_before", "load_after", "noisy_results", "note"} <= set(r["noise"])
    devices = list(r["devices"])  # the ranking's order: the best device first; the CPU always
    assert devices == r["settings"]["devices"] and devices[0] == best_device() and "cpu" in devices
    for dev, d in r["devices"].items():
        cases = d["cases"]
        accel = dev != "cpu"
        assert d["setup_s"] >= 0 and d["name"]
        assert {c["group"] for c in cases.values()} == {"gemm", "elementwise", "norm", "attention"} | (
            {"transfer"} if accel else set())
        measured = {name: assert_result_shape(name, c) for name, c in cases.items()}
        assert measured["gemm 256 float32"], (dev, cases["gemm 256 float32"])  # the first row ran everywhere
        g = cases["gemm 256 float32"]
        assert g["unit"] == "GFLOP/s" and g["n"] >= 1 and g["p25"] <= g["median"] <= g["p75"] and "time_ms" in g
        if accel:
            assert {n for n, c in cases.items() if c["group"] == "transfer"} == TRANSFER_CASES
    assert r["disk"]["unit"] == "GB/s" and ("write" in r["disk"] or "skipped" in r["disk"])


def test_bench_runs_each_case_on_every_device_before_the_next():
    """A short --duration then cuts the same rows on every device, never a whole device."""
    from apt_model.bench.suite import GROUPS, Case, device_cases, interleave

    cpu, accel = torch.device("cpu"), torch.device("cuda", 0)  # interleave only orders devices
    cpu_cases = [c for c in device_cases(cpu) if "float16" not in c.name]  # fewer dtypes on the CPU
    accel_cases = device_cases(cpu) + [Case("transfer", f"{d} pinned", "GB/s", 1.0, lambda: None)
                                       for d in ("host->device", "device->host")]
    plan = interleave([accel, cpu], [accel_cases, cpu_cases])
    assert len(plan) == len(accel_cases) + len(cpu_cases)
    assert [(str(d), c.name) for d, c in plan[:3]] == [("cuda:0", "gemm 256 float32"), ("cpu", "gemm 256 float32"),
                                                       ("cuda:0", "gemm 1024 float32")]
    groups = [c.group for _, c in plan]
    assert groups == sorted(groups, key=GROUPS.index) and groups[-2:] == ["transfer", "transfer"]
    for name in {c.name for c in cpu_cases}:  # each case shared by both: the accelerator's turn, then the CPU's
        assert [str(d) for d, c in plan if c.name == name] == ["cuda:0", "cpu"], name
    positions = {name: [i for i, (_, c) in enumerate(plan) if c.name == name] for name in {c.name for _, c in plan}}
    assert all(p == list(range(p[0], p[0] + len(p))) for p in positions.values())  # a case's turns are adjacent


def test_bench_device_setup_is_outside_duration(monkeypatch):
    """A device whose setup (probes, context creation) outlasts --duration still gets measured."""
    from apt_model.bench import suite

    prepared = []

    def slow_prepare(device):
        prepared.append(str(device))
        time.sleep(1.0)
        return 1.0

    monkeypatch.setattr(suite, "prepare_device", slow_prepare)
    r = suite.run_suite(["cpu"], duration=0.8, disk=False, groups=("norm",))
    assert prepared == ["cpu"] and r["devices"]["cpu"]["setup_s"] == 1.0 and r["elapsed_s"] >= 1.0
    cases = r["devices"]["cpu"]["cases"]
    measured = [assert_result_shape(n, c) for n, c in cases.items()]
    assert len(measured) == 3 and measured[0], cases  # charged to the clock, the setup would have skipped all


@pytest.mark.gpu
def test_bench_on_the_accelerator_has_the_transfer_group_with_medians(tmp_path):
    dev = accelerator()
    out = tmp_path / "bench.json"
    proc = apt_vb("bench", "--device", dev, "--group", "gemm", "--group", "transfer", "--no-disk",
                  "--duration", "10", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert list(r["devices"]) == [dev] and r["disk"] is None
    cases = r["devices"][dev]["cases"]
    transfer = {n: c for n, c in cases.items() if c["group"] == "transfer"}
    assert set(transfer) == TRANSFER_CASES
    assert all(assert_result_shape(n, c) and c["unit"] == "GB/s" for n, c in transfer.items())
    assert assert_result_shape("gemm 256 float32", cases["gemm 256 float32"])
    assert "host->device pinned" in proc.stdout


def test_bench_rejects_bad_arguments(capsys):
    from apt_model.cli.main import main

    assert main(["bench", "--duration", "0"]) == 2
    assert "duration=0.0 must be > 0" in capsys.readouterr().err
    assert main(["bench", "--device", "gpu:0", "--duration", "1"]) == 2
    assert "unknown kind 'gpu'" in capsys.readouterr().err
    assert main(["bench", "--group", "fft", "--duration", "1"]) == 2
    assert "unknown group(s) ['fft']; valid groups: gemm" in capsys.readouterr().err


@pytest.fixture
def suite_must_not_run(monkeypatch):
    """``run_suite`` replaced by one that fails the test: the argument checks come before it."""
    from apt_model.bench import suite

    def ran(*args, **kwargs):
        raise AssertionError("the suite ran before its arguments were checked")

    monkeypatch.setattr(suite, "run_suite", ran)


def test_bench_refuses_an_unwritable_json_path_before_running(tmp_path, capsys, suite_must_not_run):
    """``--json`` into a folder that cannot be created was found after the whole suite had run
    (a FileNotFoundError traceback, exit status 1): now one line naming the flag, exit status 2."""
    from apt_model.cli.main import main

    blocked = tmp_path / "file"
    blocked.write_text("")
    path = str(blocked / "sub" / "r.json")
    assert main(["bench", "--json", path, "--group", "norm", "--no-disk", "--duration", "0.1"]) == 2
    err = capsys.readouterr().err
    assert f"--json {path!r}: its folder cannot be created" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_bench_refuses_a_duration_that_is_not_finite(value, capsys, suite_must_not_run):
    """``--duration nan`` / ``inf`` passed the ``> 0`` check: every case then failed, exit status 0."""
    from apt_model.cli.main import main

    assert main(["bench", f"--duration={value}", "--group", "norm", "--no-disk"]) == 2
    err = capsys.readouterr().err
    assert f"--duration={float(value)!r} must be > 0 seconds (a finite number)" in err, err


def test_bench_argument_errors_name_the_flag_and_the_library_names_the_parameter(capsys, suite_must_not_run):
    from apt_model.cli.main import main
    from apt_model.errors import ConfigError

    assert main(["bench", "--threads", "0", "--duration", "1"]) == 2
    assert "--threads=0 must be a whole number >= 1" in capsys.readouterr().err
    from apt_model.bench.suite import check_arguments

    with pytest.raises(ConfigError, match=r"^duration=inf must be > 0 seconds"):
        check_arguments(float("inf"))
    with pytest.raises(ConfigError, match=r"^threads=0 must be"):
        check_arguments(1.0, threads=0)


def test_bench_refuses_a_missing_swap_dir_before_running(tmp_path, capsys, suite_must_not_run):
    """A missing ``--swap-dir`` was measured anyway: the ConfigError shown as the disk row's cell,
    exit status 0. Now one line naming the folder, exit status 2; without the disk it is unused."""
    from apt_model.cli.main import main

    missing = str(tmp_path / "absent")
    assert main(["bench", "--swap-dir", missing, "--group", "disk", "--duration", "1"]) == 2
    err = capsys.readouterr().err
    assert f"--swap-dir={missing!r} is not an existing folder" in err and len(err.strip().splitlines()) == 1
    from apt_model.bench.suite import check_arguments

    check_arguments(1.0, swap_dir=missing, disk=False)  # not measured: not checked
    check_arguments(1.0, swap_dir=missing, groups=("norm",))
    check_arguments(1.0, swap_dir=str(tmp_path))
