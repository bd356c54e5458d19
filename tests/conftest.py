"""Shared test fixtures: the real-data folder, a clean switch per test, subprocess helpers."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VB_ENV = ("ENABLE_VIRTUAL_BLACKWELL", "VB_MODE", "VB_DEVICE", "VB_ATTENTION", "VB_MIXED_PRECISION", "VB_FP4",
          "VB_CHECKPOINTING", "VB_ACTIVATION_OFFLOAD", "VB_PAGING", "VB_LOG_LEVEL", "VB_PROBE_CACHE",
          "VB_SWAP_TIMEOUT")


def data_dir() -> Path:
    """The shared real-data folder: ``APT_DATA_DIR`` or ``../shared/data`` beside the project."""
    return Path(os.environ.get("APT_DATA_DIR", ROOT.parent / "shared" / "data"))


@pytest.fixture
def shared_data() -> Path:
    d = data_dir()
    if not (d / "kjv.txt").exists():
        pytest.skip(f"real data not found at {d} (set APT_DATA_DIR to the folder with kjv.txt)")
    return d


@pytest.fixture(scope="session")
def probe_cache_dir(tmp_path_factory) -> Path:
    """One on-disk probe cache for the whole test session (never the user's ~/.cache): probes
    run once per device and width per session, as a user's second run would see them."""
    return tmp_path_factory.mktemp("vb-cache")


@pytest.fixture(autouse=True)
def clean_switch(monkeypatch, probe_cache_dir):
    """Every test starts and ends with the switch off and no VB_* variables set, reads no
    .vbrc file (VB_CONFIG=none; the configuration-file tests set their own), and keeps probe
    results in the session's cache folder (VB_CACHE_DIR, inherited by subprocesses)."""
    for name in VB_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VB_CONFIG", "none")
    monkeypatch.setenv("VB_CACHE_DIR", str(probe_cache_dir))
    import apt_model.optimization.vb_global as vb

    vb.disable()
    yield
    vb.disable()


@pytest.fixture
def cpu_device(monkeypatch):
    """Pin the switch to the CPU (``VB_DEVICE=cpu``) for a test that asserts CPU semantics
    (level names without a device level, ``cpu -> cpu`` round trips, gloo, CPU probe figures),
    so it means the same on a CPU-only machine and on one with an accelerator. Subprocesses
    started with :func:`clean_env` inherit it."""
    monkeypatch.setenv("VB_DEVICE", "cpu")
    return "cpu"


def best_device() -> str:
    """The device the switch picks on this machine (``cuda:0``, ``npu:0``, ``cpu``...): for tests
    that assert on the device that is there rather than pin one."""
    from apt_model.devices.ranking import select_device

    return str(select_device().device)


def accelerator():
    """The accelerator PyTorch sees here (``torch.device`` of its kind, index 0), or None on a
    CPU-only machine: for ``gpu`` tests. Use :data:`needs_accelerator` to skip without one, or
    :func:`require_accelerator` inside a test."""
    import torch

    acc = torch.accelerator.current_accelerator()
    return torch.device(acc.type, 0) if acc is not None and acc.type != "cpu" else None


#: ``@needs_accelerator`` skips a test cleanly on a machine without an accelerator.
needs_accelerator = pytest.mark.skipif(accelerator() is None, reason="needs an accelerator (CUDA/ROCm/NPU/XPU/MPS)")


def require_accelerator():
    """The device the switch's ranking picks here, skipping the test when that is the CPU."""
    import torch

    dev = torch.device(best_device())
    if dev.type == "cpu":
        pytest.skip("needs an accelerator (CUDA/ROCm/NPU/XPU/MPS); the ranking picked the CPU here")
    return dev


def clean_env(**extra: str) -> dict:
    """This environment without VB_* switch variables and with VB_CONFIG=none (no .vbrc), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in VB_ENV or k == "VB_DEVICE"}
    env["VB_CONFIG"] = "none"
    env.update(extra)
    return env


def run_python(code: str, env: dict | None = None, timeout: float = 300, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (import-time behaviour, PrivateUse1 registration)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=env if env is not None else clean_env(), cwd=cwd or ROOT)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project folder as the current directory, an empty user config dir, .vbrc files enabled
    (VB_CONFIG unset) and no budget variables: for the configuration-file tests."""
    proj = tmp_path / "proj"
    proj.mkdir()
    monkeypatch.chdir(proj)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("VB_CONFIG")
    for var in ("VB_HOST_BUDGET", "VB_DEVICE_BUDGET", "VB_SWAP_DIR", "VB_SWAP_BUDGET"):
        monkeypatch.delenv(var, raising=False)
    return proj
