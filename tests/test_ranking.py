"""The one ranking policy: order, preferences, overrides, and errors that name what is wrong."""
import pytest
import torch

from apt_model.devices.backend import AVAILABLE, NOT_INSTALLED, STATUSES, UNAVAILABLE
from apt_model.devices.detection import Candidate, detect_devices
from apt_model.devices.ranking import parse_device_spec, rank, select_device
from apt_model.errors import ConfigError, DeviceSelectionError


def cand(kind, status=AVAILABLE, count=1, priority=0, device_type=None, dist=None, reason="r"):
    return Candidate(kind=kind, device_type=device_type or kind, vendor=kind, status=status, reason=reason,
                     count=count if status == AVAILABLE else 0, names=(), priority=priority, dist_backend=dist,
                     visible_devices_env=None)


@pytest.fixture
def machine():
    """2 CUDA GPUs, an NPU stack without devices, an MLU whose plugin failed, 4 XPUs, and the CPU.

    (Device types torch parses without a plugin are used here; the real NPU path, with a
    PrivateUse1 device named ``npu``, is tested in test_privateuse1_npu.py.)
    """
    return [
        cand("cuda", count=2, priority=0, dist="nccl"),
        cand("rocm", NOT_INSTALLED, priority=1, device_type="cuda"),
        cand("npu", UNAVAILABLE, priority=10, dist="hccl", reason="torch.npu reports 0 devices"),
        cand("mlu", "error", priority=20, reason="torch_mlu is installed but failed to load: libcnrt.so missing"),
        cand("xpu", count=4, priority=30, dist="xccl"),
        cand("cpu", count=1, priority=100, dist="gloo"),
    ]


def test_default_order_is_cuda_xpu_cpu(machine):
    assert [c.kind for c in rank(machine)] == ["cuda", "xpu", "cpu"]
    sel = select_device(candidates=machine)
    assert sel.device == torch.device("cuda", 0)
    assert sel.source == "ranking"
    assert sel.ranking == ("cuda", "xpu", "cpu")
    no_cuda = [c for c in machine if c.kind != "cuda"]
    sel = select_device(candidates=no_cuda)
    assert sel.kind == "xpu"
    assert "npu (unavailable)" in sel.reason and "mlu (error)" in sel.reason  # why they were passed over


def test_prefer_puts_a_kind_first(machine):
    sel = select_device(prefer="xpu", candidates=machine)
    assert sel.device == torch.device("xpu", 0)
    assert sel.candidate.dist_backend == "xccl"
    assert sel.ranking == ("xpu", "cuda", "cpu")
    # a preferred kind that is not usable does not win: no silent choice of a dead device
    assert select_device(prefer="npu", candidates=machine).kind == "cuda"
    # case folds, as every other choice does ("XPU" was refused as not a device kind)
    assert select_device(prefer=[" XPU"], candidates=machine).ranking == ("xpu", "cuda", "cpu")


def test_prefer_unknown_kind_is_an_error_listing_kinds(machine):
    with pytest.raises(ConfigError, match=r"prefer='tpu'.*valid: .*npu"):
        select_device(prefer="tpu", candidates=machine)


def test_force_cpu_wins_over_everything(machine, monkeypatch):
    monkeypatch.setenv("VB_DEVICE", "npu:1")
    sel = select_device(force_cpu=True, device="cuda:1", candidates=machine)
    assert sel.device == torch.device("cpu") and sel.source == "force_cpu"


def test_vb_device_env_override(machine, monkeypatch):
    monkeypatch.setenv("VB_DEVICE", "xpu:3")
    sel = select_device(candidates=machine)
    assert sel.device == torch.device("xpu", 3)
    assert sel.source == "VB_DEVICE"
    monkeypatch.setenv("VB_DEVICE", "cpu")
    assert select_device(candidates=machine).device == torch.device("cpu")


def test_auto_means_the_rankings_choice(machine, monkeypatch):
    monkeypatch.setenv("VB_DEVICE", "auto")
    sel = select_device(candidates=machine)
    assert sel.device == torch.device("cuda", 0) and sel.source == "ranking"
    monkeypatch.setenv("VB_DEVICE", "xpu:1")
    assert select_device(device="AUTO", candidates=machine).device == torch.device("xpu", 1)  # auto defers to env


def test_device_argument_beats_env(machine, monkeypatch):
    monkeypatch.setenv("VB_DEVICE", "xpu:1")
    sel = select_device(device="cuda:1", candidates=machine)
    assert sel.device == torch.device("cuda", 1) and sel.source == "argument"


def test_index_out_of_range_names_valid_indices(machine, monkeypatch):
    monkeypatch.setenv("VB_DEVICE", "xpu:7")
    with pytest.raises(DeviceSelectionError, match=r"xpu has 4 device\(s\), valid indices 0..3"):
        select_device(candidates=machine)


def test_a_cpu_index_is_the_one_cpu_as_torch_takes_it_and_the_reason_says_so(machine, monkeypatch):
    """torch runs ``cpu:3`` on the one CPU (a script may write ``f"{kind}:{local_rank}"`` for every
    kind under torchrun): the switch does too, and says so where it explains its choice."""
    monkeypatch.setenv("VB_DEVICE", "cpu:3")
    sel = select_device(candidates=machine)
    assert sel.device == torch.device("cpu") and "'cpu:3': the CPU is one device, as torch takes it" in sel.reason
    monkeypatch.setenv("VB_DEVICE", "cpu:0")
    assert select_device(candidates=machine).reason == "VB_DEVICE asked for the CPU"


def test_unusable_kind_is_an_error_with_the_detection_reason(machine, monkeypatch):
    monkeypatch.setenv("VB_DEVICE", "mlu")
    with pytest.raises(DeviceSelectionError, match="libcnrt.so missing"):
        select_device(candidates=machine)
    monkeypatch.setenv("VB_DEVICE", "npu:0")  # never a silent fall-back to the CPU
    with pytest.raises(DeviceSelectionError, match="npu: unavailable - torch.npu reports 0 devices"):
        select_device(candidates=machine)


def test_unknown_and_malformed_specs(machine):
    with pytest.raises(ConfigError, match=r"unknown kind 'tpu'; valid kinds: .*cpu.*npu"):
        parse_device_spec("tpu:0", machine)
    with pytest.raises(ConfigError, match="malformed"):
        parse_device_spec("npu:one", machine)
    assert parse_device_spec("NPU:2", machine) == ("npu", 2)
    assert parse_device_spec(" xpu ", machine) == ("xpu", None)
    assert parse_device_spec(torch.device("cuda", 1), machine) == ("cuda", 1)


def test_rocm_is_addressed_as_cuda():
    machine = [cand("cuda", NOT_INSTALLED, priority=0), cand("dcu", count=2, priority=1, device_type="cuda"),
               cand("cpu", priority=100)]
    sel = select_device(candidates=machine)
    assert sel.kind == "dcu" and sel.device == torch.device("cuda", 0)
    assert select_device(device="dcu:1", candidates=machine).device == torch.device("cuda", 1)
    assert select_device(device="cuda:1", candidates=machine).kind == "dcu"


def test_real_detection_lists_every_kind_with_a_reason():
    cands = detect_devices(refresh=True)
    kinds = [c.kind for c in cands]
    for k in ("cuda", "rocm", "npu", "mlu", "xpu", "mps", "cpu"):
        assert k in kinds
    for c in cands:
        assert c.status in STATUSES
        assert c.reason.strip()
    cpu = next(c for c in cands if c.kind == "cpu")
    assert cpu.available and cpu.count == 1 and cpu.dist_backend == "gloo"
    if not torch.backends.cuda.is_built():
        cuda = next(c for c in cands if c.kind == "cuda")
        assert cuda.status == NOT_INSTALLED and "no CUDA support" in cuda.reason


def test_every_name_of_a_kind_is_known_whatever_was_detected():
    """``dcu`` is a documented ``VB_DEVICE`` value: on a machine without one it is "not usable
    here", with the ROCm detection's reason, never "unknown kind" (it was known only where a DCU
    had been detected); and a detected DCU still answers to ``rocm``."""
    from apt_model.devices.backends.cuda import RocmBackend

    real = [c for c in detect_devices() if c.kind in ("rocm", "dcu")]
    assert real, "the ROCm backend is always a candidate"
    if not real[0].available:
        for name in ("dcu", "rocm"):
            with pytest.raises(DeviceSelectionError, match=f"asks for {name}, which is not usable here .*rocm"):
                select_device(device=name)
    dcu = Candidate(kind="dcu", device_type="cuda", vendor="Hygon", status=AVAILABLE, reason="r", count=2, names=(),
                    priority=1, dist_backend="nccl", visible_devices_env=None, backend=RocmBackend())
    machine = [dcu, cand("cpu", priority=100)]
    assert select_device(device="rocm:1", candidates=machine).device == torch.device("cuda", 1)
    assert rank(machine, prefer=("rocm",))[0] is dcu
