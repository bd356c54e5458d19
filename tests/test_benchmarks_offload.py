"""benchmarks/offload.py: the GPU mode's refusal without CUDA, its skip decisions, its comparison
with the issue's targets, and (slow) its whole run on the CPU with --gpu-code-on-cpu."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "offload.py"


def _load():
    spec = importlib.util.spec_from_file_location("offload_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # puts benchmarks/ on sys.path, imports offload_gpu
    return mod, sys.modules["offload_gpu"]


def _run(*args, timeout=300):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # never a GPU, even on a machine that has one
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


def test_device_cuda_without_cuda_exits_2_with_one_line(monkeypatch, capsys):
    offload, gpu = _load()
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        offload.main(["--device", "cuda"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "CUDA" in err and "--device cuda" in err


def test_device_cuda_without_cuda_from_the_command_line_has_no_traceback():
    res = _run("--device", "cuda", timeout=120)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "CUDA" in res.stderr
    assert res.stdout == ""


def _importer(missing=(), modules=None):
    """An importer that raises ImportError for ``missing`` and returns ``modules[name]`` where given."""
    modules = modules or {}

    def imp(name):
        if name in missing:
            raise ImportError(f"No module named {name!r}")
        if name in modules:
            return modules[name]
        return types.SimpleNamespace()

    return imp


def _fsdp_modules(nccl=True, policy=True, dist_ok=True):
    dist = types.SimpleNamespace(is_available=lambda: dist_ok, is_nccl_available=lambda: nccl,
                                 is_gloo_available=lambda: True)
    fsdp = types.SimpleNamespace(fully_shard=object())
    if policy:
        fsdp.CPUOffloadPolicy = object()
    return {"torch.distributed": dist, "torch.distributed.fsdp": fsdp}


def test_skip_reasons_follow_what_is_importable():
    _, gpu = _load()
    present = {"torchao.optim": types.SimpleNamespace(CPUOffloadOptimizer=object()), **_fsdp_modules()}
    for name in gpu.VARIANTS:
        assert gpu.skip_reason(name, "cuda", _importer(modules=present)) is None, name

    no_torchao = _importer(missing=("torchao", "torchao.optim"), modules=present)
    for name in gpu.TORCHAO:
        assert "torchao is not installed" in gpu.skip_reason(name, "cuda", no_torchao)
    assert gpu.skip_reason("in_memory", "cuda", no_torchao) is None
    assert gpu.skip_reason("vb_all_paged", "cuda", no_torchao) is None

    old_torchao = _importer(modules={**present, "torchao.optim": types.SimpleNamespace(),
                                     "torchao": types.SimpleNamespace(__version__="0.1")})
    assert "torchao 0.1 has no torchao.optim.CPUOffloadOptimizer" in gpu.skip_reason("torchao_offload", "cuda",
                                                                                      old_torchao)
    assert "CUDA or XPU" in gpu.skip_reason("torchao_offload_grads", "cpu", _importer(modules=present))

    no_policy = _importer(modules={**present, **_fsdp_modules(policy=False)})
    assert "CPUOffloadPolicy" in gpu.skip_reason("fsdp2_cpu_offload", "cuda", no_policy)
    no_nccl = _importer(modules={**present, **_fsdp_modules(nccl=False)})
    assert "NCCL" in gpu.skip_reason("fsdp2_cpu_offload", "cuda", no_nccl)
    assert gpu.skip_reason("fsdp2_cpu_offload", "cpu", no_nccl) is None  # gloo on the CPU
    no_dist = _importer(modules={**present, **_fsdp_modules(dist_ok=False)})
    assert "torch.distributed is not available" in gpu.skip_reason("fsdp2_cpu_offload", "cuda", no_dist)

    def broken(name):
        if name.startswith("torchao"):
            raise RuntimeError("built for another torch")
        return _importer(modules=present)(name)

    assert "RuntimeError: built for another torch" in gpu.skip_reason("torchao_offload", "cuda", broken)
    assert "unknown variant" in gpu.skip_reason("deepspeed", "cuda", _importer(modules=present))


def test_skip_reason_with_the_real_imports_never_raises():
    _, gpu = _load()
    for name in gpu.VARIANTS:
        for dev in ("cuda", "cpu"):
            r = gpu.skip_reason(name, dev)
            assert r is None or isinstance(r, str)


def _row(median, peak=None, **kw):
    return {"status": "ok", "step": {"median": median}, "peak_hbm_bytes": peak, **kw}


def test_compare_applies_each_target_where_it_holds():
    _, gpu = _load()
    rows = {
        "in_memory": _row(1.0, 10e9),
        "torchao_offload": _row(1.5, 6e9),
        "torchao_offload_grads": _row(1.2, 5e9),
        "fsdp2_cpu_offload": _row(4.0, 3e9),
        "vb_params_kept": _row(1.25, 4e9, link_floor_s=0.6),  # compute (1.0 s) dominates its floor
        "vb_all_paged": _row(1.6, 2e9, link_floor_s=1.5),  # the link dominates
    }
    by = {c["what"].split(" (")[0]: c for c in gpu.compare(rows)}
    kept = by["vb_params_kept vs torchao_offload_grads"]  # the faster torchao variant
    assert kept["value"] == pytest.approx(1.2 / 1.25) and kept["met"] is True
    paged_mem = by["vb_all_paged vs in_memory"]
    assert paged_mem["applicable"] is False and paged_mem["met"] is None
    assert by["vb_all_paged vs fsdp2_cpu_offload"]["value"] == pytest.approx(2.5)
    assert by["vb_all_paged vs fsdp2_cpu_offload"]["met"] is True
    assert by["vb_all_paged vs the link floor"]["applicable"] is True
    assert by["vb_all_paged vs the link floor"]["met"] is True  # 1.6 / 1.5 <= 1.2
    assert by["vb_params_kept vs the link floor"]["applicable"] is False

    rows["vb_params_kept"]["peak_hbm_bytes"] = 6e9  # faster but more HBM than torchao: not met
    rows["vb_all_paged"]["link_floor_s"] = 0.5  # now compute dominates: 1.0 / 1.6 < 0.8
    by = {c["what"].split(" (")[0]: c for c in gpu.compare(rows)}
    assert by["vb_params_kept vs torchao_offload_grads"]["met"] is False
    assert by["vb_all_paged vs in_memory"]["applicable"] is True and by["vb_all_paged vs in_memory"]["met"] is False

    rows["vb_host_step"] = _row(1.1, 4.5e9, link_floor_s=0.6)  # faster with the parameters kept: it is compared
    by = {c["what"].split(" (")[0]: c for c in gpu.compare(rows)}
    assert by["vb_host_step vs torchao_offload_grads"]["value"] == pytest.approx(1.2 / 1.1)
    assert by["vb_host_step vs torchao_offload_grads"]["met"] is True and "vb_host_step vs the link floor" in by
    del rows["vb_host_step"]

    rows["vb_all_paged_one_stream"] = _row(2.0, 2e9, link_floor_s=1.5)  # the A/B, reported when run
    ab = {c["what"]: c for c in gpu.compare(rows)}["vb_all_paged vs vb_all_paged_one_stream"]
    assert ab["value"] == pytest.approx(2.0 / 1.6) and ab["met"] is None
    del rows["vb_all_paged_one_stream"]

    skipped = {"status": "skipped", "reason": "torchao is not installed"}
    rows["torchao_offload"] = rows["torchao_offload_grads"] = skipped
    rows["fsdp2_cpu_offload"] = {"status": "failed", "reason": "OutOfMemoryError: ..."}
    out = gpu.compare(rows)
    missing = [c for c in out if c["value"] is None]
    assert len(missing) == 2 and all(c["met"] is None for c in missing)
    assert "torchao_offload skipped" in missing[0]["note"] and "fsdp2_cpu_offload failed" in missing[1]["note"]


def test_the_timeline_summary_counts_overlap_once_per_kind():
    """A profiled step's device events (microseconds): two kernels, a copy up partly under the
    first, two overlapping copies down (counted once), one under the second kernel and one alone."""
    _, gpu = _load()
    events = [("kernel", 0, 1000), ("kernel", 2000, 3000), ("h2d", 500, 1500),
              ("d2h", 1200, 1800), ("d2h", 1700, 2500), ("memset", 0, 9000)]
    got = gpu.timeline_overlap(events)
    want = {"span": 3.0, "kernel": 2.0, "h2d": 1.0, "d2h": 1.3, "h2d_under_kernel": 0.5, "d2h_under_kernel": 0.5,
            "h2d_with_d2h": 0.3, "copy_exposed": 1.0, "idle": 0.0}
    assert got == pytest.approx(want)
    assert gpu.timeline_overlap([("kernel", 0, 100), ("kernel", 300, 400)])["idle"] == pytest.approx(0.2)
    assert set(gpu.timeline_overlap([]).values()) == {0.0}


@pytest.mark.slow
def test_gpu_mode_runs_on_the_cpu_and_records_skips_and_failures(tmp_path):
    out = tmp_path / "gpu.json"
    res = _run("--device", "cuda", "--gpu-code-on-cpu", "--threads", "1", "--d-model", "32", "--layers", "1",
               "--heads", "2", "--seq-len", "16", "--batch-size", "2", "--rounds", "2", "--steps-per-round", "1",
               "--warmup", "1", "--variants",
               "in_memory,torchao_offload,fsdp2_cpu_offload,vb_all_paged,vb_params_kept,vb_all_paged_one_stream",
               "--budget-kept", "1KB", "--swap-dir", str(tmp_path), "--json", str(out), "--profile", str(tmp_path),
               timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(out.read_text())
    v = r["variants"]
    assert r["benchmark"] == "offload_gpu" and r["machine"]["cpu"]
    assert v["torchao_offload"]["status"] == "skipped" and "torchao_offload" in r["skipped"]
    assert v["vb_params_kept"]["status"] == "failed" and "vb_params_kept" in r["failed"]  # 1KB: no plan holds it
    for name in ("in_memory", "fsdp2_cpu_offload", "vb_all_paged", "vb_all_paged_one_stream"):
        assert v[name]["status"] == "ok" and v[name]["step"]["n"] == 2, name
    assert v["in_memory"]["ratio_vs_in_memory"] == pytest.approx(1.0)
    assert v["vb_all_paged"]["up_bytes_per_step"] > 0 and v["vb_all_paged"]["down_bytes_per_step"] > 0
    assert v["vb_all_paged"]["info"]["plan"]["plan"]["page_params"] is True
    # timed only once the step inside backward was decided (learned, then its trial), and said so
    assert v["vb_all_paged"]["info"]["step_in_backward"]["state"] in ("armed", "off"), v["vb_all_paged"]["info"]
    assert "vb_all_paged: optimizer step on the device; step inside backward" in res.stdout
    assert len(r["comparison"]) == 6  # the five targets and the one-stream A/B
    assert "vb_all_paged vs vb_all_paged_one_stream" in res.stdout
    assert "SKIPPED: torchao" in res.stdout and "FAILED" in res.stdout and "against the issue's targets" in res.stdout
    for name in ("in_memory", "vb_all_paged"):  # --profile: one more step per worker, its op table
        prof = Path(v[name]["final"]["profile"])
        assert prof == tmp_path / f"profile-{name}.txt" and "Self CPU" in prof.read_text(), name
        assert "aten::" in prof.read_text()


@pytest.mark.slow  # ~35 s on 2 cores: three worker processes; the default suite keeps to its 15 minutes
def test_cpu_mode_without_clipping_measures_the_step_inside_backward_against_after(tmp_path):
    """--clip 0: a third worker keeps the step after backward; the paged worker steps inside
    backward (armed), reads fewer bytes (no gradient comes back) and says so in the JSON."""
    out = tmp_path / "offload.json"
    res = _run("--d-model", "64", "--layers", "2", "--heads", "2", "--seq-len", "32", "--batch-size", "2",
               "--budget", "600KB", "--rounds", "2", "--steps-per-round", "1", "--warmup", "2", "--clip", "0",
               "--swap-dir", str(tmp_path), "--json", str(out))
    assert res.returncode == 0, res.stderr
    got = json.loads(out.read_text())
    assert got["step_in_backward"]["state"] == "armed"
    assert got["paged_after_backward"]["n"] == 2 and got["in_backward_over_after_backward"] > 0
    assert got["read_bytes_per_step"] < got["paged_after_backward_read_bytes_per_step"]
    assert "step after backward" in res.stdout


@pytest.mark.slow  # 9 s: a full benchmark start-up whose worker is killed
def test_cpu_mode_reports_a_worker_that_dies_instead_of_waiting_for_it(tmp_path):
    """A worker that fails at start (here: a swap folder that does not exist) used to leave the
    parent waiting on the pipe forever; now the run ends with status 1 and a line naming the worker."""
    res = _run("--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "16", "--batch-size", "1",
               "--budget", "600KB", "--rounds", "1", "--steps-per-round", "1", "--warmup", "1",
               "--swap-dir", str(tmp_path / "missing"), timeout=120)
    assert res.returncode == 1, (res.returncode, res.stderr[-2000:])
    assert "offload.py: the worker died while paged: starting and warming up" in res.stderr
    assert "does not exist" in res.stderr  # the worker's own error is shown too
