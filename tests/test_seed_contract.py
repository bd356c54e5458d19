"""The original guide's examples, run as written, and every documented key and type (issue 12).

Each example block below is the guide's code; the asserts after it check the documented
contract (see docs/seed-contract.md). Tests that mean CPU facts pin the CPU (``cpu_device``);
the others assert on the device that is there (``best_device()``), so they mean the same on a
CPU-only machine and on one with an accelerator. The multi-NPU example runs in a fresh
interpreter with a PrivateUse1 ``npu`` of two devices registered (as torch_npu does), and on a
machine whose accelerators are hidden.
"""
import json
import re
import textwrap

import pytest
import torch

from apt_model.devices.backend import AcceleratorBackend
from apt_model.errors import DeviceSelectionError
from conftest import best_device, clean_env, run_python

INFO_TYPES = {"cuda_available": bool, "npu_available": bool, "device_count": int, "device_name": str,
              "device_type": str, "cuda_version": (str, type(None)), "npu_version": (str, type(None))}
GB_KEYS = ("allocated_gb", "reserved_gb", "max_allocated_gb")
SUMMARY_KEYS = {"total_devices", "cuda_devices", "npu_devices", "devices"}
STATS_KEYS = {"peak_bytes", "allocated_bytes", "reserved_bytes", "total_bytes", "free_bytes"}


def _check_device_memory(entries: dict, device_type: str, count: int) -> None:
    """``get_memory_info()[key]``: ``{'<type>_<i>': {allocated_gb, reserved_gb, max_allocated_gb, ...}}``."""
    assert sorted(entries) == [f"{device_type}_{i}" for i in range(count)]
    for key, e in entries.items():
        assert e["device"] == key.replace("_", ":")
        for gb, raw in zip(GB_KEYS, ("allocated", "reserved", "peak")):
            if e[raw] is None:  # the device cannot report it: None, and the reason is given
                assert e[gb] is None and e["unavailable"][raw]
            else:
                assert isinstance(e[gb], float) and e[gb] == e[raw] / 2**30


# ---------------------------------------------------------------------------- quick start
def test_quick_start_on_the_device_that_is_there():
    # --- the guide's quick start ---
    from apt_model.core.system import get_device, get_device_info, get_memory_info, set_seed

    set_seed(42)
    device = get_device()
    print(f"Using device: {device}")
    info = get_device_info()
    print(f"CUDA available: {info['cuda_available']}")
    print(f"NPU available: {info['npu_available']}")
    print(f"Device type: {info['device_type']}, count: {info['device_count']}, name: {info['device_name']}")
    print(f"CUDA version: {info['cuda_version']}, NPU version: {info['npu_version']}")
    mem_info = get_memory_info()
    print(mem_info["ram"])
    # --- the contract ---
    assert isinstance(device, torch.device) and str(device) == best_device()
    for key, typ in INFO_TYPES.items():
        assert isinstance(info[key], typ), (key, info[key])
    from apt_model.optimization import npu_backend as nb

    assert info["cuda_available"] is nb.is_cuda_available() and info["npu_available"] is nb.is_npu_available()
    assert info["device_type"] == device.type and info["device"] == str(device)
    assert info["device_count"] >= 1 and info["device_name"]
    assert info["cuda_version"] == torch.version.cuda
    assert {"kind", "reason", "ranking", "candidates", "dist_backend"} <= set(info)  # the project's additions
    assert {"ram", "vram", "npu_memory", "disk"} <= set(mem_info)
    assert mem_info["ram"]["total"] > mem_info["ram"]["available"] > 0
    devices = nb.get_device_manager().get_all_devices()
    n_cuda = sum(d.type == "cuda" for d in devices)
    n_npu = sum(d.type == "npu" for d in devices)
    assert (mem_info["vram"] == {}) is (n_cuda == 0) and (mem_info["npu_memory"] == {}) is (n_npu == 0)
    _check_device_memory(mem_info["vram"], "cuda", n_cuda)
    _check_device_memory(mem_info["npu_memory"], "npu", n_npu)


def test_quick_start_facts_on_the_cpu(cpu_device):
    from apt_model.core.system import get_device, get_device_info, get_memory_info
    from apt_model.devices.backends.cpu import cpu_model_name

    assert get_device() == torch.device("cpu")
    info = get_device_info()
    assert (info["device_type"], info["device_count"], info["device_name"]) == ("cpu", 1, cpu_model_name())
    assert info["npu_version"] is None  # no torch_npu here
    mem = get_memory_info()
    for key in ("vram", "npu_memory", "mlu_memory", "xpu_memory", "mps_memory"):
        assert isinstance(mem[key], dict)  # never None: {} where the kind has no device


def test_set_seed_makes_the_quick_start_reproducible():
    from apt_model.core.system import set_seed

    set_seed(42)
    a = torch.randn(4)
    set_seed(42)
    assert torch.equal(a, torch.randn(4))


# ---------------------------------------------------------------------------- device manager
def test_device_manager_example():
    # --- the guide's device manager ---
    from apt_model.optimization.npu_backend import get_device_manager

    manager = get_device_manager()
    all_devices = manager.get_all_devices()
    print(f"Available devices: {all_devices}")
    best = manager.get_best_device(prefer_npu=True)
    summary = manager.get_device_summary()
    print(f"Total: {summary['total_devices']}, CUDA: {summary['cuda_devices']}, NPU: {summary['npu_devices']}")
    for name, dev in summary["devices"].items():
        print(f"  {name}: {dev['device_name']}")
    manager.cleanup_all()
    # --- the contract ---
    assert all(isinstance(d, torch.device) for d in all_devices)
    assert all_devices[-1] == torch.device("cpu") and best in all_devices
    assert str(manager.get_best_device()) == best_device()
    assert SUMMARY_KEYS <= set(summary)
    assert summary["total_devices"] == len(all_devices)
    assert summary["cuda_devices"] == sum(d.type == "cuda" for d in all_devices)
    assert summary["npu_devices"] == sum(d.type == "npu" for d in all_devices)
    assert list(summary["devices"]) == [str(d) for d in all_devices]
    assert isinstance(summary["devices"]["cpu"]["device_name"], str) and summary["devices"]["cpu"]["device_name"]
    records = manager.get_device_records()  # the rich records, under their own name
    assert [r["device"] for r in records] == [str(d) for d in all_devices]
    assert records[-1]["kind"] == "cpu" and records[-1]["dist_backend"] == "gloo"


# ---------------------------------------------------------------------------- adapter
def test_adapter_snippet_with_index():
    from apt_model.core.system import get_device

    device = get_device()
    # --- the guide's adapter snippet ---
    from apt_model.optimization.npu_backend import DeviceBackend

    backend = DeviceBackend(device)
    print(f"Backend type: {backend.device_type}")
    if backend.is_available():
        print(f"Device count: {backend.device_count()}")
        print(f"Device name: {backend.get_device_name(index=0)}")
        props = backend.get_device_properties(index=0)
        allocated = backend.memory_allocated(index=0)
        reserved = backend.memory_reserved(index=0)
        peak = backend.max_memory_allocated(index=0)
        backend.synchronize(index=0)
        backend.empty_cache()
    # --- the contract ---
    assert backend.device_type == device.type
    assert backend.is_available() and isinstance(backend.get_device_name(0), str)
    assert isinstance(props, dict) and props
    for value in (allocated, reserved, peak):
        assert isinstance(value, int) and value >= 0
    backend.synchronize(0)  # positional too
    n = backend.device_count()
    with pytest.raises(DeviceSelectionError, match=rf"index={n} .*valid indices 0\.\.{n - 1}"):
        backend.memory_allocated(index=n)
    with pytest.raises(DeviceSelectionError, match=r"index=-1"):
        backend.synchronize(-1)
    with pytest.raises(TypeError, match="index='0' must be an int"):
        backend.get_device_name(index="0")
    stats = backend.memory_stats(index=0)
    assert set(stats) == STATS_KEYS and all(isinstance(v, int) for v in stats.values())


def test_index_range_on_the_cpu(cpu_device):
    from apt_model.optimization.npu_backend import DeviceBackend

    b = DeviceBackend("cpu")
    assert b.device_type == "cpu" and b.get_device_name(0) == b.get_device_name()
    for method in ("get_device_name", "get_device_properties", "memory_allocated", "memory_reserved",
                   "max_memory_allocated", "synchronize"):
        with pytest.raises(DeviceSelectionError, match=r"index=1 names no cpu device here: cpu has 1 device\(s\), valid indices 0\.\.0"):
            getattr(b, method)(index=1)


class _Fixed(AcceleratorBackend):
    """Fixed figures, so memory_stats() can be compared exactly with the single-figure methods."""

    kind = device_type = "cpu"

    def memory_info(self, index=0):
        return 3 * 2**30 + index, 8 * 2**30

    def memory_allocated(self, index=0):
        return 2**30 + index

    def memory_reserved(self, index=0):
        return 2**31

    def max_memory_allocated(self, index=0):
        return 5 * 2**29


def test_memory_stats_equals_the_existing_figures():
    from apt_model.optimization.npu_backend import DeviceBackend

    b = DeviceBackend("cpu")
    b._impl = _Fixed()
    assert b.memory_stats() == {"peak_bytes": b.max_memory_allocated(), "allocated_bytes": b.memory_allocated(),
                                "reserved_bytes": b.memory_reserved(), "total_bytes": b.total_memory(),
                                "free_bytes": b.free_memory()}
    assert b.memory_stats(0) == {"peak_bytes": 5 * 2**29, "allocated_bytes": 2**30, "reserved_bytes": 2**31,
                                 "total_bytes": 8 * 2**30, "free_bytes": 3 * 2**30}


# ---------------------------------------------------------------------------- complete training example
def test_complete_training_example():
    # --- the guide's complete training example ---
    import torch.nn as nn

    from apt_model.core.system import get_device, get_memory_info, set_seed
    from apt_model.optimization.npu_backend import DeviceBackend

    set_seed(42)
    device = get_device()
    backend = DeviceBackend(device)
    model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    criterion = nn.MSELoss()
    x = torch.randn(256, 10).to(device)
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for epoch in range(50):
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if epoch % 10 == 0:
            allocated = backend.memory_allocated() / 1024**3
            print(f"Epoch {epoch}, Loss: {loss.item():.4f}, Memory: {allocated:.2f} GB")
    backend.synchronize()
    backend.empty_cache()
    mem = get_memory_info()
    # --- the contract ---
    assert losses[-1] < 0.1 * losses[0]
    assert next(model.parameters()).device.type == device.type
    if device.type != "cpu":
        key = {"cuda": "vram"}.get(device.type, f"{device.type}_memory")
        entry = mem[key][f"{device.type}_{device.index or 0}"]
        assert isinstance(entry["allocated_gb"], float) and entry["allocated_gb"] > 0


# ---------------------------------------------------------------------------- multi-NPU example
MULTI = textwrap.dedent(r'''
    import json, sys
    import torch
    import torch.nn as nn
    if FAKE:
        import torch.utils.backend_registration as br

        class FakeModule(br._DummyBackendModule):
            def device_count(self):
                return 2
            def get_device_name(self, index=0):
                return f"FakeAscend-910B#{index}"

        br._setup_privateuseone_for_python_backend("npu", backend_module=FakeModule())

    # --- the guide's multi-NPU example ---
    from apt_model.optimization.npu_backend import get_device_manager

    manager = get_device_manager()
    npu_devices = [d for d in manager.get_all_devices() if d.type == 'npu']
    print(f"Found {len(npu_devices)} NPU devices")
    model = nn.Linear(8, 4)
    if len(npu_devices) > 1:
        model = nn.DataParallel(model, device_ids=[0, 1])
    # --- what the test reads ---
    from apt_model.core.system import get_device_info, get_memory_info
    from apt_model.errors import DeviceSelectionError
    from apt_model.optimization.npu_backend import DeviceBackend

    out = {"npu_devices": [str(d) for d in npu_devices],
           "types": sorted({type(d).__name__ for d in manager.get_all_devices()}),
           "is_dp": isinstance(model, nn.DataParallel)}
    if out["is_dp"]:
        out["dp"] = [model.device_ids, str(model.src_device_obj)]
    dp = nn.DataParallel(nn.Linear(8, 4), device_ids=[0, 1])  # as written, whatever the machine has
    out["dp_ids"] = dp.device_ids
    if not dp.device_ids:  # no accelerator: DataParallel runs the module as is
        x = torch.randn(3, 8)
        out["dp_forward_equal"] = torch.equal(dp(x), dp.module(x))
    info = get_device_info()
    out["info"] = {k: info[k] for k in ("cuda_available", "npu_available", "device_count", "device_name",
                                         "device_type", "cuda_version", "npu_version")}
    mem = get_memory_info()
    out["vram"], out["npu_memory"] = mem["vram"], mem["npu_memory"]
    s = manager.get_device_summary()
    out["summary"] = {k: s[k] for k in ("total_devices", "cuda_devices", "npu_devices")}
    out["summary_devices"] = {k: v["device_name"] for k, v in s["devices"].items()}
    if npu_devices:
        b = DeviceBackend("npu:0")
        out["backend"] = {"device_type": b.device_type, "name1": b.get_device_name(index=1),
                          "name0": b.get_device_name(0), "alloc": b.memory_allocated(index=0),
                          "alloc_why": b.why("memory_allocated"), "stats": b.memory_stats(index=1)}
        b.synchronize(index=1)
        try:
            b.get_device_name(index=2)
            out["bad_index"] = None
        except DeviceSelectionError as err:
            out["bad_index"] = str(err)
    print("RESULT" + json.dumps(out, default=str))
''')


def _multi(fake: bool, **env) -> dict:
    # accelerators hidden: the fake NPU machine, or a machine with no accelerator at all
    env = clean_env(CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="", ASCEND_RT_VISIBLE_DEVICES="", **env)
    proc = run_python(MULTI.replace("FAKE", repr(fake)), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


def test_multi_npu_example_on_a_privateuse1_npu_with_two_devices():
    r = _multi(True)
    assert r["npu_devices"] == ["npu:0", "npu:1"] and r["types"] == ["device"]
    assert r["is_dp"] and r["dp"] == [[0, 1], "npu:0"]
    assert r["info"] == {"cuda_available": False, "npu_available": True, "device_count": 2,
                         "device_name": "FakeAscend-910B#0", "device_type": "npu",
                         "cuda_version": torch.version.cuda, "npu_version": None}
    assert r["vram"] == {} and sorted(r["npu_memory"]) == ["npu_0", "npu_1"]
    for key, e in r["npu_memory"].items():
        assert set(GB_KEYS) <= set(e) and e["device"] == key.replace("_", ":")
        assert e["allocated_gb"] is None and e["unavailable"]["allocated"]  # the fake has no memory API
    assert r["summary"] == {"total_devices": 3, "cuda_devices": 0, "npu_devices": 2}
    assert r["summary_devices"]["npu:1"] == "FakeAscend-910B#1" and list(r["summary_devices"]) == ["npu:0", "npu:1", "cpu"]
    b = r["backend"]
    assert b["device_type"] == "npu" and b["name1"] == "FakeAscend-910B#1" and b["name0"] == "FakeAscend-910B#0"
    assert b["alloc"] is None and b["alloc_why"]
    assert set(b["stats"]) == STATS_KEYS
    assert "index=2 names no npu device here: npu has 2 device(s), valid indices 0..1" in r["bad_index"]


def test_multi_npu_example_on_the_cpu(cpu_device):
    r = _multi(False)
    assert r["npu_devices"] == [] and not r["is_dp"]
    assert r["dp_ids"] == [] and r["dp_forward_equal"] is True  # DataParallel without accelerators: the module as is
    assert r["info"]["device_type"] == "cpu" and r["info"]["npu_available"] is False and r["info"]["cuda_available"] is False
    assert r["vram"] == {} and r["npu_memory"] == {}
    assert r["summary"] == {"total_devices": 1, "cuda_devices": 0, "npu_devices": 0}


# ---------------------------------------------------------------------------- VGPU stack, config, CLI
def test_vgpu_stack_prints_like_the_guide_with_measured_figures(cpu_device, tmp_path):
    from apt_model.optimization.vgpu_stack import create_vgpu_stack

    stack = create_vgpu_stack({"device_budget": "256MB", "swap_dir": str(tmp_path)})
    try:
        lines = str(stack).splitlines()
        assert re.fullmatch(r"Level 0: cpu - 256MB @ \d+\.\dGB/s \[host RAM.*\]", lines[0]), lines[0]
        m = re.fullmatch(r"Level 1: nvme - (\d+)MB @ (\d+\.\d)GB/s \((.+); read (\d+\.\d\d), write (\d+\.\d\d) GB/s\)",
                         lines[1])
        assert m, lines[1]
        nvme = stack.levels[1]
        assert m.group(3) == str(stack.swap.folder) and m.group(3).startswith(str(tmp_path))
        assert float(m.group(2)) == round(nvme.gbps, 1) and nvme.gbps == min(nvme.detail.values()) > 0
        assert int(m.group(1)) == round(nvme.capacity / 1e6)
    finally:
        stack.close()


def test_environment_activation_reports_the_mode_source(cpu_device):
    code = ("import json, apt_model.optimization.vb_global as vb\n"
            "c = vb.get_config(); print('RESULT' + json.dumps([vb.is_enabled(), c['mode'], c['mode_source']]))")
    proc = run_python(code, env=clean_env(ENABLE_VIRTUAL_BLACKWELL="1", VB_MODE="memory"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.split("RESULT", 1)[1]) == [True, "memory", "environment:VB_MODE"]


def test_vb_device_auto_means_the_rankings_choice(monkeypatch):
    from apt_model.core.system import get_device
    from apt_model.devices.ranking import select_device

    expected = select_device()  # no VB_DEVICE (the clean_switch fixture removed it)
    monkeypatch.setenv("VB_DEVICE", "auto")
    sel = select_device()
    assert sel.device == expected.device and sel.source == "ranking"
    assert get_device() == expected.device
    monkeypatch.setenv("VB_DEVICE", "AUTO")
    assert select_device().device == expected.device


def test_cli_verbs_users_of_the_backend_manager_expect(monkeypatch, capsys, cpu_device):
    from apt_model.cli import main as cli

    parser = cli.build_parser()
    assert parser.parse_args(["benchmark", "--duration", "1"]).command == "benchmark"
    calls = []
    import apt_model.cli.bench as bench

    monkeypatch.setattr(bench, "run_bench", lambda args: calls.append(("bench", args.duration)) or 0)
    assert cli.main(["benchmark", "--duration", "1", "--no-disk"]) == 0 and calls == [("bench", 1.0)]

    import apt_model.cli.selftest as selftest

    seen = []
    monkeypatch.setattr(selftest, "run_checks", lambda dev, checks, step: seen.append(str(dev)) or [])
    assert cli.main(["test", "cpu", "--check", "matmul"]) == 0
    assert cli.main(["test", "--device", "cpu", "--check", "matmul"]) == 0
    assert seen == ["cpu", "cpu"]
    assert cli.main(["test", "gpu0"]) == 2 and "unknown kind 'gpu0'" in capsys.readouterr().err

    import apt_model.cli.config as config

    actions = []
    monkeypatch.setattr(config, "run_config", lambda args: actions.append(args.config_command) or 0)
    assert cli.main(["optimize", "--no-measure"]) == 0
    assert cli.main(["optimize", "--apply", "--no-measure", "--force"]) == 0
    assert actions == ["suggest", "save"]
    assert cli.main(["optimize", "--set", "paging=tight"]) == 2
    assert "--set only applies when writing the .vbrc; add --apply" in capsys.readouterr().err


def test_optimize_apply_writes_what_config_suggest_suggests(project):
    from apt_model.cli import main as cli

    assert cli.main(["optimize", "--no-measure", "--json"]) == 0
    assert cli.main(["optimize", "--apply", "--no-measure", "--set", "paging=tight"]) == 0
    written = json.loads((project / ".vbrc").read_text())
    assert written["paging"] == "tight" and written["mode"] in ("performance", "balanced", "memory")
