#!/usr/bin/env python
"""Integration suite for the device layer on whatever accelerator this machine has: the guide's six checks.

1. device detection — every kind listed with status and reason, a usable one picked;
2. backend adapter — ``DeviceBackend`` round trip, a matmul, every figure (with ``index``);
3. device manager — ``get_all_devices()`` (``torch.device`` list), ``get_device_summary()``;
4. VGPU stack — the levels measured on this machine, and training paged through them gives the
   same result as training in memory;
5. the switch's optimizations on the device — attention routing and mixed precision decided by
   the probes, applied as decided, outputs unchanged within the precision's tolerance;
6. a simple training run with the switch on — the loss falls.

On an Ascend machine it exercises the NPU for real; on a GPU machine the GPU; elsewhere the CPU.
Run with pytest (it is part of the default test run) or as a script (exit status 0 when all pass):

    python training/test_npu_integration.py [-v]
"""
from __future__ import annotations

import re
import sys

import pytest
import torch
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from apt_model.core.system import get_device, get_device_info, set_seed
from apt_model.devices.backend import STATUSES
from apt_model.devices.detection import detect_devices
from apt_model.models.gpt import GPT, GPTConfig
from apt_model.optimization.npu_backend import DeviceBackend, get_accelerator_type, get_device_manager
from apt_model.optimization.vgpu_stack import create_vgpu_stack


@pytest.fixture(autouse=True)
def switch_off():
    vb.disable()
    yield
    vb.disable()


def test_1_device_detection_lists_every_kind_and_picks_a_usable_one():
    cands = detect_devices()
    assert {"cuda", "npu", "mlu", "xpu", "mps", "cpu"} <= {c.kind for c in cands}
    assert all(c.status in STATUSES and c.reason for c in cands)
    best = get_device()
    kind = get_accelerator_type()
    chosen = next(c for c in cands if c.kind == kind)
    assert chosen.available and best.type == chosen.device_type
    info = get_device_info()
    assert info["device_type"] == best.type and info["device_count"] == chosen.count
    assert isinstance(info["device_name"], str) and info["device_name"]
    assert info["cuda_available"] is any(c.available and c.device_type == "cuda" for c in cands)
    assert info["npu_available"] is any(c.available and c.device_type == "npu" for c in cands)


def test_2_backend_adapter_round_trip_and_matmul_on_the_best_device():
    backend = DeviceBackend()
    assert backend.is_available() and backend.device_count() >= 1
    assert backend.device_type == get_device().type
    x = torch.randn(64, 64)
    on_dev = backend.to_device(x)
    assert on_dev.device.type == backend.device.type
    assert torch.equal(on_dev.cpu(), x)
    prod = (on_dev @ on_dev).cpu()
    torch.testing.assert_close(prod, x @ x, atol=1e-3, rtol=1e-3)  # TF32-class tolerance on GPUs
    backend.synchronize(index=backend.index)
    for figure in ("total_memory", "free_memory", "memory_allocated", "memory_reserved", "max_memory_allocated"):
        value = getattr(backend, figure)(backend.index)
        assert value is None and backend.why(figure) or isinstance(value, int)
    assert isinstance(backend.get_device_name(index=backend.index), str)
    stats = backend.memory_stats()
    assert set(stats) == {"peak_bytes", "allocated_bytes", "reserved_bytes", "total_bytes", "free_bytes"}


def test_3_device_manager_lists_devices_and_summarizes_them():
    mgr = get_device_manager()
    devices = mgr.get_all_devices()
    assert all(isinstance(d, torch.device) for d in devices)
    assert devices[0].type == get_device().type and devices[-1] == torch.device("cpu")
    summary = mgr.get_device_summary()
    assert summary["selected"] == str(get_device())
    assert summary["total_devices"] == len(devices) and list(summary["devices"]) == [str(d) for d in devices]
    assert summary["cuda_devices"] == sum(d.type == "cuda" for d in devices)
    assert summary["npu_devices"] == sum(d.type == "npu" for d in devices)
    assert all("device_name" in v for v in summary["devices"].values())


def _train_tiny(device: torch.device, steps: int = 3) -> tuple[list[float], dict]:
    set_seed(0)
    model = GPT(GPTConfig(seq_len=16, d_model=64, n_layers=2, n_heads=2)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(3))
    inp, tgt = x[:, :-1].to(device), x[:, 1:].to(device)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(inp).reshape(-1, 256), tgt.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def test_4_vgpu_stack_levels_are_measured_and_paging_keeps_the_result():
    device = get_device()
    stack = create_vgpu_stack({"device_budget": "64MB"})
    try:
        lines = str(stack).splitlines()
        assert stack.levels[0].device == str(device) and stack.levels[-1].kind == "nvme"
        assert all(lv.capacity > 0 and lv.gbps is not None and lv.gbps > 0 for lv in stack.levels)
        assert re.fullmatch(rf"Level {len(lines) - 1}: nvme - \d+MB @ \d+\.\dGB/s \(.+; read .+ GB/s\)", lines[-1])
    finally:
        stack.close()
    ref_losses, ref_params = _train_tiny(device)
    vb.enable("balanced", paging="always", device_budget="64KB", attention="off", mixed_precision="off",
              tf32="off", banner=False)  # the reference's IEEE fp32 matmuls (balanced turns TF32 on from Ampere)
    losses, params = _train_tiny(device)
    moved = sum(lv.get("bytes_in", 0) + lv.get("bytes_out", 0) for lv in vb.get_stats()["levels"])
    vb.disable()
    assert moved > 0  # the training state really went down the stack and back
    exact = device.type == "cpu"
    for name, ref in ref_params.items():
        if exact:
            assert torch.equal(params[name], ref), name
        else:
            torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-7)
    if exact:
        assert losses == ref_losses
    else:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)


def test_5_switch_optimizations_follow_the_probes_on_the_device():
    device = get_device()
    set_seed(0)
    model = GPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=2)).to(device).eval()  # eager attention
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        ref = model(x).float()
    vb.enable("balanced", banner=False)
    model.to(device)  # adopted here: the probes run on this device and decide
    with torch.no_grad():
        out = model(x).float()
    rep = vb.get_report()
    feats = rep["models"][0]["features"]
    assert rep["models"][0]["device"] == str(device)
    speed = next(v for v in rep["capabilities"]["speed"].values() if v["device"] == str(device))
    settings = vb.get_config()["settings"]
    att_ratio = speed["attention"].get("speedup", 0)
    assert feats["attention"]["chosen"] == ("sdpa" if att_ratio >= settings["sdpa_min_speedup"]["value"] else "as written")
    routed = all(b.attn.attn_implementation == "sdpa" for b in model.blocks)
    assert routed is (feats["attention"]["chosen"] == "sdpa")
    bf16 = speed["autocast"]["bfloat16"].get("speedup", 0)
    assert feats["mixed_precision"]["chosen"] == ("bf16" if bf16 >= settings["autocast_min_speedup"]["value"] else "fp32")
    assert all(feats[f]["reason"] for f in ("attention", "mixed_precision"))
    tol = 5e-2 if feats["mixed_precision"]["chosen"] == "bf16" else 1e-3  # bf16 logits vs fp32; fp32 vs TF32-class
    assert (out - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


def test_6_short_real_training_run_with_the_switch_on():
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
