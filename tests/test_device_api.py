"""The seed-era device API (npu_backend, core.system) and the backend registry contract."""
import textwrap

import pytest
import torch

from apt_model.core import system
from apt_model.devices.backend import AVAILABLE, ERROR, AcceleratorBackend, Detection
from apt_model.devices.detection import clear_detection_cache, detect_devices
from apt_model.devices.ranking import rank
from apt_model.devices.registry import register_backend, unregister_backend
from apt_model.errors import ConfigError
from apt_model.optimization import npu_backend as nb
from conftest import clean_env, run_python


def test_cpu_backend_gives_every_figure_and_never_raises():
    b = nb.DeviceBackend("cpu")
    assert b.is_available() and b.device_count() == 1 and b.kind == "cpu"
    assert isinstance(b.get_device_name(), str) and b.get_device_name()
    props = b.get_device_properties()
    assert props["total_memory"] > 0 and props["logical_cores"] >= 1
    free, total = b.free_memory(), b.total_memory()
    assert 0 < free <= total
    before = b.memory_allocated()
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    after = b.memory_allocated()
    assert after - before > 32 * 2**20  # RSS really moved
    del big
    # the kernel keeps RSS in per-CPU counters, read approximately: the high-water mark may trail the
    # RSS read before it by a batch of pages per CPU (1.3 MB on a 16-core machine); a peak figure
    # that forgot the 64 MiB would trail by all of it
    assert b.memory_reserved() > 0 and b.max_memory_allocated() >= after - 8 * 2**20
    b.empty_cache()
    b.synchronize()
    assert b.reset_peak_memory_stats() is False and "cannot be reset" in b.why("reset_peak_memory_stats")
    s = b.get_memory_summary()
    assert set(s) == {"device", "kind", "name", "total", "free", "allocated", "reserved", "peak", "unavailable"}


def test_to_device_moves_nested_structures_and_modules_in_place():
    b = nb.get_unified_backend()
    batch = {"x": torch.ones(2), "pair": (torch.zeros(1), [torch.ones(1)]), "n": 3}
    moved = b.to_device(batch)
    assert moved["x"].device == b.device and moved["pair"][1][0].device == b.device and moved["n"] == 3
    m = torch.nn.Linear(2, 2)
    w = m.weight
    assert b.to_device(m) is m and m.weight is w


def test_unavailable_kind_returns_none_with_the_reason():
    cands = {c.kind: c for c in detect_devices()}
    if cands["npu"].available:
        pytest.skip("an NPU is present")
    b = nb.DeviceBackend("npu")
    assert not b.is_available() and b.device_count() == 0
    assert b.total_memory() is None and b.memory_allocated() is None
    assert "torch_npu" in b.why("total_memory")


def test_bad_device_string_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown kind 'gpu0'"):
        nb.DeviceBackend("gpu0")


def test_manager_and_module_functions_on_this_machine():
    mgr = nb.get_device_manager()
    assert mgr is nb.get_device_manager()
    records = mgr.get_device_records()
    assert records[-1]["kind"] == "cpu" and records[-1]["dist_backend"] == "gloo"
    assert mgr.get_all_devices() == [torch.device(r["device"]) for r in records]
    summary = mgr.get_device_summary()
    assert {"selected", "reason", "ranking", "candidates", "devices"} <= set(summary)
    assert len(summary["candidates"]) >= 7
    mgr.cleanup_all()
    best = mgr.get_best_device()
    assert best == system.get_device()
    if best.type == "cpu":
        assert nb.get_accelerator_type() == "cpu"
        assert nb.is_cuda_available() is False and nb.is_npu_available() is False


def test_system_helpers():
    assert system.get_device(force_cpu=True) == torch.device("cpu")
    info = system.get_device_info()
    assert {"device", "kind", "name", "candidates", "torch", "dist_backend", "reason"} <= set(info)
    mem = system.get_memory_info()
    assert {"ram", "vram", "npu_memory", "mlu_memory", "xpu_memory", "mps_memory", "disk"} <= set(mem)
    assert mem["ram"]["total"] > mem["ram"]["available"] > 0 and mem["ram"]["process_rss"] > 0
    system.memory_cleanup()


def test_set_seed_reproduces_and_only_touches_determinism_when_asked():
    was = torch.are_deterministic_algorithms_enabled()
    system.set_seed(7)
    a = torch.randn(5)
    system.set_seed(7)
    assert torch.equal(a, torch.randn(5))
    assert torch.are_deterministic_algorithms_enabled() == was
    try:
        system.set_seed(7, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(was)
    for bad in ("7", -1, 2**40, True):
        with pytest.raises(ValueError, match="must be an int"):
            system.set_seed(bad)


class _LateAccelerator(AcceleratorBackend):
    kind = "testacc"
    device_type = "cpu"
    vendor = "test accelerator"
    priority = 150
    dist_backend = "gloo"

    def detect(self, allow_init=False):
        return Detection(AVAILABLE, "found 1 test device", 1, ("TestAcc",))


class _Broken(AcceleratorBackend):
    kind = "brokenacc"
    device_type = "cpu"
    priority = 160

    def detect(self, allow_init=False):
        raise OSError("driver exploded")


def test_registering_a_backend_with_the_decorator():
    register_backend(_LateAccelerator)
    register_backend(_Broken)
    try:
        clear_detection_cache()
        cands = {c.kind: c for c in detect_devices()}
        assert cands["testacc"].available and cands["testacc"].names == ("TestAcc",)
        assert cands["brokenacc"].status == ERROR and "OSError: driver exploded" in cands["brokenacc"].reason
        order = [c.kind for c in rank(list(cands.values()))]
        assert order.index("cpu") < order.index("testacc")  # priority 150 ranks after the CPU's 100
        assert [c.kind for c in rank(list(cands.values()), prefer=("testacc",))][0] == "testacc"
        with pytest.raises(ConfigError, match="already registered"):
            class Dup(_LateAccelerator):
                pass
            register_backend(Dup)
        with pytest.raises(ConfigError, match="not a subclass"):
            register_backend(int)
    finally:
        unregister_backend("testacc")
        unregister_backend("brokenacc")
        clear_detection_cache()
    assert "testacc" not in {c.kind for c in detect_devices()}


def test_registering_a_backend_through_an_entry_point(tmp_path):
    (tmp_path / "vendor_acc.py").write_text(textwrap.dedent("""
        from apt_model.devices.backend import AcceleratorBackend, Detection
        class VendorAcc(AcceleratorBackend):
            kind = "vendoracc"
            device_type = "cpu"
            priority = 120
            def detect(self, allow_init=False):
                return Detection("unavailable", "vendor driver not loaded")
    """))
    dist = tmp_path / "vendor_acc-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vendor_acc\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[apt_model.backends]\nvendoracc = vendor_acc:VendorAcc\n")
    code = ("from apt_model.devices.detection import detect_devices\n"
            "c = {c.kind: c for c in detect_devices()}['vendoracc']\nprint('RESULT', c.status, '|', c.reason)")
    proc = run_python(code, env=clean_env(PYTHONPATH=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "RESULT unavailable | vendor driver not loaded" in proc.stdout
