"""apt-vb test: it passes here, and fails (status 1, with the reason) when a device function, an
SDPA kernel or the switch itself is broken."""
import json
import subprocess
import sys

import pytest
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook

from apt_model.cli.selftest import CHECKS, run_checks
from conftest import ROOT, best_device, clean_env


def selftest_json(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "apt_model", "test", "--json", *args], capture_output=True, text=True,
                          env=clean_env(), cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_selftest_passes_on_the_cpu_as_json(cpu_device):
    """CPU semantics (VB_DEVICE=cpu, inherited by the subprocess): training is bit-identical."""
    r = selftest_json()
    assert r["passed"] is True
    (dev,) = r["devices"]
    assert dev["device"] == "cpu" and [c["name"] for c in dev["checks"]] == list(CHECKS)
    assert all(c["passed"] and c["reason"] for c in dev["checks"])
    assert "cpu -> cpu -> cpu" in dev["checks"][0]["reason"]
    assert "bit-identical" in dev["checks"][3]["reason"] and "moved between levels" in dev["checks"][4]["reason"]


def accelerator() -> str:
    dev = best_device()
    if dev == "cpu":
        pytest.skip("needs an accelerator: the ranking chose the CPU on this machine")
    return dev


@pytest.mark.gpu
def test_selftest_passes_on_the_accelerator_as_json():
    """``apt-vb test`` with no device tests the ranking's choice: on a GPU machine, the GPU."""
    want = accelerator()
    r = selftest_json()
    assert r["passed"] is True
    (dev,) = r["devices"]
    assert dev["device"] == want and dev["name"] and [c["name"] for c in dev["checks"]] == list(CHECKS)
    checks = {c["name"]: c for c in dev["checks"]}
    assert all(c["passed"] and c["reason"] for c in checks.values())
    assert f"cpu -> {want} -> cpu" in checks["round_trip"]["reason"]
    assert "equal within 1e-5 relative" in checks["training"]["reason"]  # device kernels: close, not bitwise
    assert "moved between levels" in checks["training_paged"]["reason"]


BROKEN_TO_DEVICE = """
import sys, torch
import apt_model.devices.device_backend as db
orig = db.DeviceBackend.to_device
def broken(self, obj, non_blocking=False):  # a device copy that changes one element
    out = orig(self, obj, non_blocking)
    if torch.is_tensor(out) and out.is_floating_point() and out.numel():
        out = out.clone()
        out.view(-1)[0] += 1
    return out
db.DeviceBackend.to_device = broken
from apt_model.cli.main import main
sys.exit(main(["test", "--json", "--check", "round_trip", "--check", "matmul"]))
"""


def test_selftest_fails_with_status_1_and_the_reason_when_a_device_function_is_broken():
    proc = subprocess.run([sys.executable, "-c", BROKEN_TO_DEVICE], capture_output=True, text=True,
                          env=clean_env(), cwd=ROOT, timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    checks = {c["name"]: c for c in r["devices"][0]["checks"]}
    assert r["passed"] is False and checks["round_trip"]["passed"] is False and checks["matmul"]["passed"] is False
    # the check copies to the device that is there (the ranking's choice): cpu, cuda:0, npu:0...
    assert f"1 of 1000 elements differ after cpu -> {best_device()} -> cpu" in checks["round_trip"]["reason"]
    assert "relative error" in checks["matmul"]["reason"] and "float64 CPU reference" in checks["matmul"]["reason"]


def test_selftest_sdpa_check_catches_a_wrong_kernel(monkeypatch):
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: real(*a, **k) * 1.01)
    (res,) = run_checks("cpu", ["sdpa"])
    assert not res.passed and "max abs error" in res.reason and "vs float64 math on the CPU" in res.reason
    monkeypatch.setattr(F, "scaled_dot_product_attention", real)
    assert run_checks("cpu", ["sdpa"])[0].passed


def test_selftest_training_check_catches_a_switch_that_changes_numerics(monkeypatch):
    from apt_model.base.feature import Decision, FeatureStep
    from apt_model.switch import adoption

    def bigger_steps(opt, args, kwargs):
        for g in opt.param_groups:
            g["lr"] *= 1.5

    class BadStep(FeatureStep):  # a feature that quietly changes every optimizer step
        name = "bad"

        def decide(self, model, ctx):
            return Decision(self.name, "on", "on", "a broken feature", act=True)

        def apply(self, model, ctx, patches, decision):
            patches.add_handle(register_optimizer_step_pre_hook(bigger_steps), "bad")
            return decision

    monkeypatch.setattr(adoption, "FEATURE_STEPS", (*adoption.FEATURE_STEPS, BadStep))
    (res,) = run_checks("cpu", ["training"])
    assert not res.passed and "loss at step 2" in res.reason and "with the switch vs" in res.reason


def test_selftest_unknown_check_is_a_usage_error(capsys):
    from apt_model.cli.main import main

    assert main(["test", "--check", "nonsense"]) == 2
    assert "unknown check(s) 'nonsense'; valid checks: round_trip" in capsys.readouterr().err
