#!/usr/bin/env python
"""Integration suite for the device layer on whatever accelerator this machine has.

On an Ascend machine it exercises the NPU for real; on a GPU machine the GPU; elsewhere the CPU.
Run with pytest (it is part of the default test run) or as a script:

    python training/test_npu_integration.py [-v]
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from apt_model.core.system import get_device, set_seed
from apt_model.devices.backend import STATUSES
from apt_model.devices.detection import detect_devices
from apt_model.models.gpt import GPT, GPTConfig
from apt_model.optimization.npu_backend import DeviceBackend, get_accelerator_type, get_device_manager


@pytest.fixture(autouse=True)
def switch_off():
    vb.disable()
    yield
    vb.disable()


def test_device_detection_lists_every_kind_and_picks_a_usable_one():
    cands = detect_devices()
    assert {"cuda", "npu", "mlu", "xpu", "mps", "cpu"} <= {c.kind for c in cands}
    assert all(c.status in STATUSES and c.reason for c in cands)
    best = get_device()
    kind = get_accelerator_type()
    chosen = next(c for c in cands if c.kind == kind)
    assert chosen.available and best.type == chosen.device_type


def test_backend_adapter_round_trip_and_matmul_on_the_best_device():
    backend = DeviceBackend()
    assert backend.is_available() and backend.device_count() >= 1
    x = torch.randn(64, 64)
    on_dev = backend.to_device(x)
    assert on_dev.device.type == backend.device.type
    assert torch.equal(on_dev.cpu(), x)
    prod = (on_dev @ on_dev).cpu()
    torch.testing.assert_close(prod, x @ x, atol=1e-3, rtol=1e-3)  # TF32-class tolerance on GPUs
    backend.synchronize()
    for figure in ("total_memory", "free_memory", "memory_allocated", "memory_reserved", "max_memory_allocated"):
        value = getattr(backend, figure)()
        assert value is None and backend.why(figure) or isinstance(value, int)


def test_device_manager_summary():
    mgr = get_device_manager()
    devices = mgr.get_all_devices()
    assert devices and devices[0]["kind"] == get_accelerator_type()
    summary = mgr.get_device_summary()
    assert summary["selected"] == str(get_device())
    assert len(summary["devices"]) == len(devices)


def test_short_real_training_run_with_the_switch_on():
    set_seed(0)
    vb.enable("balanced", banner=False)
    device = vb.device()
    model = GPT(GPTConfig(seq_len=64, d_model=64, n_layers=2, n_heads=2)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    text = torch.tensor(list(b"In the beginning God created the heaven and the earth. " * 4), dtype=torch.long)
    x, y = text[:64][None].to(device), text[1:65][None].to(device)
    losses = []
    for _ in range(25):
        loss = F.cross_entropy(model(x).reshape(-1, 256).float(), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    rep = vb.get_report()
    assert rep["models"][0]["device"].split(":")[0] == device.type


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
