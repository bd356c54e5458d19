"""Multi-device and multi-process training under the switch (apt_model.distributed).

Pure rules (launcher variables, device binding, backend mapping, DataParallel ids) are tested
directly; the switch's behaviour in one process in-process; the multi-process paths for real with
``python -m torch.distributed.run`` (torchrun) on the CPU with gloo, two ranks, small models and a
timeout — including an Ascend-like machine made of a PrivateUse1 ``npu`` device (see
tests/dist_worker.py).
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from apt_model.distributed.backend_mapping import map_backend, own_backend
from apt_model.devices.binding import local_device_index
from apt_model.distributed.data_parallel import check_device_ids
from apt_model.base.launch import read_launch_env
from apt_model.errors import ConfigError, DeviceSelectionError, DistributedError
from conftest import ROOT, clean_env

sys.path.insert(0, str(ROOT / "tests"))
import dist_worker  # noqa: E402

TORCHRUN_TIMEOUT = 240  # seconds; a hung rendezvous fails the test instead of hanging it
#: Parameters after DDP/FSDP2 training vs one process on the global batch: fp32 all-reduce sums two
#: partial gradients and divides by 2 where the single process averages 16 samples at once, so
#: the last bits differ; 4 SGD steps with momentum keep the difference near 1e-8 (measured 1.5e-8).
PARAM_ATOL = 1e-6

LAUNCH = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}
#: Hides a real CUDA/ROCm accelerator from a subprocess, so a test of another machine (CPU-only, the
#: fake NPU machine) means the same on a GPU machine.
NO_CUDA = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
#: Tests that mean "CPU processes with gloo": the switch pinned to the CPU and CUDA hidden (a script's
#: "nccl" must find no CUDA to serve, as on a CPU-only machine).
CPU_ONLY = {"VB_DEVICE": "cpu", **NO_CUDA}


def cand(kind, device_type, dist_backend, count=1):
    """A stand-in for a detected candidate (the fields the distributed rules read)."""
    return SimpleNamespace(kind=kind, device_type=device_type, dist_backend=dist_backend, count=count,
                           visible_devices_env=None, backend=None)


# ---------------------------------------------------------------------------- launcher variables


def test_launch_env_is_read_and_validated():
    env = read_launch_env(LAUNCH)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (1, 1, 2, 2)
    assert env.complete and env.multi_process and env.launcher == "torchrun"
    assert env.master == "127.0.0.1:29500" and "rank 1 of 2" in env.describe()
    assert read_launch_env({}) is None  # no launcher: a single process
    partial = read_launch_env({"WORLD_SIZE": "2", "RANK": "0"})
    assert not partial.complete and partial.missing == ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    for bad, needle in (({**LAUNCH, "RANK": "one"}, "RANK='one' is not an integer"),
                        ({**LAUNCH, "RANK": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
                        ({**LAUNCH, "WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be >= 1"),
                        ({**LAUNCH, "LOCAL_RANK": "3"}, "LOCAL_RANK=3 is not below LOCAL_WORLD_SIZE=2"),
                        ({**LAUNCH, "MASTER_PORT": "70000"}, "not a port number")):
        with pytest.raises(ConfigError, match=needle):
            read_launch_env(bad)


def test_malformed_launcher_variables_fail_at_enable(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="WORLD_SIZE='two' is not an integer"):
        vb.enable("balanced", banner=False)
    assert not vb.is_enabled()


# ---------------------------------------------------------------------------- device binding


def test_each_local_rank_gets_its_own_visible_device():
    assert local_device_index("cuda", 4, 2, "CUDA_VISIBLE_DEVICES", None)[0] == 2
    index, why = local_device_index("npu", 2, 1, "ASCEND_RT_VISIBLE_DEVICES", "4,5")
    assert index == 1 and "ASCEND_RT_VISIBLE_DEVICES='4,5'" in why  # visible index 1 = physical device 5
    # per-process visibility (SLURM --gpus-per-task=1): the variable is set for each process, each sees its own 0
    index, why = local_device_index("cuda", 1, 3, "CUDA_VISIBLE_DEVICES", "3", local_world_size=4, launcher="slurm")
    assert index == 0 and "set per process" in why and "NCCL/HCCL refuse" in why
    with pytest.raises(DeviceSelectionError, match=r"LOCAL_RANK=2: 3 processes.*but only 2 mlu device\(s\) visible.*"
                                                   r"MLU_VISIBLE_DEVICES unset.*local rank 2 would have no mlu device"):
        local_device_index("mlu", 2, 2, "MLU_VISIBLE_DEVICES", None)
    with pytest.raises(DeviceSelectionError, match="no xpu device is visible"):
        local_device_index("xpu", 0, 0, "ZE_AFFINITY_MASK", "")


@pytest.mark.parametrize("local_rank", [0, 1])
def test_more_local_ranks_than_visible_devices_is_an_error_on_every_rank(local_rank):
    """torchrun --nproc_per_node=2 on a 1-GPU machine: both ranks would bind cuda:0 and NCCL would fail
    with "invalid usage" at the first collective. Every rank, rank 0 included, refuses at selection."""
    with pytest.raises(DeviceSelectionError) as info:
        local_device_index("cuda", 1, local_rank, "CUDA_VISIBLE_DEVICES", None, local_world_size=2,
                           launcher="torchrun", dist_backend="nccl", names=("NVIDIA H100 80GB HBM3",))
    msg = str(info.value)
    for needle in (f"LOCAL_RANK={local_rank}: 2 processes on this node (LOCAL_WORLD_SIZE=2, local ranks 0..1)",
                   "only 1 cuda device(s) visible to them: cuda:0 (NVIDIA H100 80GB HBM3) (CUDA_VISIBLE_DEVICES unset)",
                   "local rank 1 would have no cuda device of its own", "nccl refuses",
                   "torchrun --nproc_per_node=1", "VB_DEVICE=cpu", "make 2 cuda devices visible (CUDA_VISIBLE_DEVICES)"):
        assert needle in msg, msg
    # under torchrun every local rank inherits the same variable: set or not, they share the device
    with pytest.raises(DeviceSelectionError, match=r"CUDA_VISIBLE_DEVICES='0'"):
        local_device_index("cuda", 1, local_rank, "CUDA_VISIBLE_DEVICES", "0", local_world_size=2, launcher="torchrun")
    # two devices, three ranks: ranks 0 and 1 have devices but refuse too, so no rank waits for one that failed
    with pytest.raises(DeviceSelectionError, match=r"local rank 2 would have no npu device.*--nproc_per_node=2"):
        local_device_index("npu", 2, local_rank, "ASCEND_RT_VISIBLE_DEVICES", None, local_world_size=3,
                           launcher="torchrun", dist_backend="hccl")
    assert local_device_index("cuda", 2, local_rank, "CUDA_VISIBLE_DEVICES", None, local_world_size=2,
                              launcher="torchrun")[0] == local_rank


def _fake_cuda_machine(monkeypatch, count: int = 1):
    """The candidate list of a machine with ``count`` visible NVIDIA GPUs (built, not detected: the
    boundary the ranking policy reads), plus this machine's real CPU candidate."""
    from apt_model.devices import ranking
    from apt_model.devices.detection import Candidate, detect_devices

    cpu = next(c for c in detect_devices() if c.device_type == "cpu")
    cuda = Candidate(kind="cuda", device_type="cuda", vendor="NVIDIA CUDA", status="available",
                     reason=f"found {count} device(s)", count=count, names=("NVIDIA H100 80GB HBM3",) * count,
                     priority=0, dist_backend="nccl", visible_devices_env="CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(ranking, "detect_devices", lambda *a, **k: [cuda, cpu])
    return [cuda, cpu]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_two_ranks_on_one_gpu_fail_at_enable_before_any_collective(monkeypatch, rank):
    import torch.distributed as dist
    from apt_model.devices.ranking import select_device

    _fake_cuda_machine(monkeypatch)
    for k, v in {**LAUNCH, "RANK": rank, "LOCAL_RANK": rank}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(DeviceSelectionError, match=r"2 processes on this node.*cuda:0 .*--nproc_per_node=1.*VB_DEVICE=cpu"):
        vb.enable("balanced", banner=False)
    assert not vb.is_enabled() and not dist.is_initialized()
    with pytest.raises(DeviceSelectionError, match="local rank 1 would have no cuda device"):
        select_device(device="cuda")  # a kind without an index is bound the same way
    # the fixes the message names: VB_DEVICE=cpu trains on the CPU (gloo); one process per GPU binds cuda:0
    monkeypatch.setenv("VB_DEVICE", "cpu")
    assert select_device().device == torch.device("cpu")
    monkeypatch.delenv("VB_DEVICE")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", rank)  # e.g. two nodes with one GPU each
    assert select_device().device == torch.device("cuda", 0)


def test_the_cpu_is_shared_and_the_selection_says_so(monkeypatch):
    for k, v in LAUNCH.items():
        monkeypatch.setenv(k, v)
    from apt_model.devices.ranking import select_device

    sel = select_device(device="cpu")
    assert sel.device == torch.device("cpu")
    assert "LOCAL_RANK" not in sel.reason


# ---------------------------------------------------------------------------- backend mapping


def test_backend_of_the_selected_kind_and_the_mapping_of_a_scripts_backend():
    cpu, npu, mlu, mps = (cand("cpu", "cpu", "gloo"), cand("npu", "npu", "hccl", 2), cand("mlu", "mlu", "cncl"),
                          cand("mps", "mps", None))
    on_npu = {"cpu", "npu"}
    c = map_backend("nccl", npu, on_npu)
    assert (c.chosen, c.mapped) == ("hccl", True) and "nccl needs cuda" in c.reason
    assert map_backend("nccl", mlu, {"cpu", "mlu"}).chosen == "cncl"
    assert map_backend("nccl", cpu, {"cpu"}).chosen == "gloo"
    assert map_backend(torch.distributed.Backend.NCCL, cpu, {"cpu"}).chosen == "gloo"
    assert map_backend("nccl", npu, {"cpu", "npu", "cuda"}).chosen == "nccl"  # CUDA present: the script may mean it
    assert map_backend("hccl", npu, on_npu).mapped is False
    assert map_backend("gloo", npu, on_npu).chosen == "gloo"  # CPU tensors: always as written
    assert map_backend("mpi", npu, on_npu).chosen == "mpi"  # no kind claims it: as written
    assert map_backend(None, npu, on_npu).chosen is None  # torch's default per device type
    assert map_backend("cpu:gloo,cuda:nccl", npu, on_npu).chosen == "cpu:gloo,npu:hccl"
    assert map_backend("cpu:gloo,cuda:nccl", cpu, {"cpu"}).chosen == "cpu:gloo"
    assert own_backend(npu)[0] == "hccl" and own_backend(mps)[0] is None
    with pytest.raises(DistributedError, match="mps has no collective communication library"):
        map_backend("nccl", mps, {"cpu", "mps"})
    with pytest.raises(ConfigError, match="not a backend name"):
        map_backend(3, cpu, {"cpu"})


# ---------------------------------------------------------------------------- DataParallel ids


def test_data_parallel_device_ids_are_fitted_to_the_visible_devices():
    assert "runs the module as is" in check_device_ids([0, 1], None, None, 0).reason
    plan = check_device_ids([0, 1], None, "npu", 2, "ASCEND_RT_VISIBLE_DEVICES", "0,1")
    assert plan.device_ids == [0, 1] and not plan.narrowed and "split over 2 devices" in plan.reason
    assert "npu" in check_device_ids(["cuda:0", torch.device("cuda", 1)], 1, "npu", 2).reason
    # the seed's example with one visible GPU: narrowed to the device that exists, and the reason says so
    plan = check_device_ids([0, 1], None, "cuda", 1, "CUDA_VISIBLE_DEVICES", None)
    assert (plan.device_ids, plan.dropped, plan.narrowed) == ([0], (1,), True)
    assert ("device_ids=[0, 1] narrowed to [0]: 1 is not a visible cuda device; this process sees 1 "
            "(CUDA_VISIBLE_DEVICES unset), valid indices 0..0") in plan.reason
    plan = check_device_ids(["cuda:0", "cuda:2"], "cuda:2", "cuda", 2, "CUDA_VISIBLE_DEVICES", "1,3")
    assert plan.device_ids == ["cuda:0"] and plan.output_device == "cuda:0"  # a dropped output device follows
    assert "CUDA_VISIBLE_DEVICES='1,3'" in plan.reason and "output_device='cuda:2' (dropped too)" in plan.reason
    with pytest.raises(DeviceSelectionError, match=r"device_ids=\[2, 3\]: none is a visible cuda device.*"
                                                   r"sees 2 \(CUDA_VISIBLE_DEVICES='1,3'\), valid indices 0..1"):
        check_device_ids([2, 3], None, "cuda", 2, "CUDA_VISIBLE_DEVICES", "1,3")
    with pytest.raises(DeviceSelectionError, match="repeats a device"):
        check_device_ids([1, 1], None, "cuda", 2)
    with pytest.raises(DeviceSelectionError, match="is negative"):
        check_device_ids([0, -1], None, "cuda", 2)
    with pytest.raises(DeviceSelectionError, match="is the CPU"):
        check_device_ids(["cpu"], None, "cuda", 2)
    with pytest.raises(DeviceSelectionError, match="output_device=5"):
        check_device_ids([0, 1], 5, "cuda", 2)


def _dp_ids_here() -> tuple[str | None, int]:
    from apt_model.distributed.data_parallel import visible_data_parallel_devices

    dtype, count, _, _ = visible_data_parallel_devices()
    return dtype, count


def _train_data_parallel(switch: bool, device_ids, steps: int = 3):
    """The seed's DataParallel example: ``steps`` SGD steps of a small MLP wrapped in
    ``nn.DataParallel(model, device_ids)``, on the switch's device (the ranking's choice when off)."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    torch.manual_seed(0)
    if switch:  # TF32 off: balanced turns it on where the device has it (a mode's numerics, not DataParallel's)
        vb.enable("balanced", mixed_precision="off", tf32="off", banner=False)
    device = vb.device()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    dp = nn.DataParallel(model, device_ids=device_ids)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    for _ in range(steps):
        loss = F.mse_loss(dp(x), y.to(device))  # DataParallel scatters x; its output is on device_ids[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
    rep = vb.get_report() if switch else None
    vb.disable()
    return [p.detach().cpu().clone() for p in model.parameters()], rep


def test_data_parallel_seed_example_trains_like_plain_pytorch_with_the_switch_on():
    """``nn.DataParallel(model, device_ids=[0, 1])`` with the switch on trains exactly like plain
    PyTorch given the ids that exist here: on a CPU (DataParallel ignores the ids), on one GPU
    (narrowed to [0]: plain PyTorch fails there with "Invalid device id") and on two or more."""
    dtype, count = _dp_ids_here()
    valid = [i for i in (0, 1) if dtype is None or i < count]
    plain, _ = _train_data_parallel(False, valid)
    switched, rep = _train_data_parallel(True, [0, 1])  # the seed's example, as written
    assert all(torch.equal(a, b) for a, b in zip(plain, switched))
    dp_rows = [w for w in rep["distributed"]["wrappers"] if w["wrapper"] == "DataParallel"]
    assert len(dp_rows) == 1 and dp_rows[0]["requested_device_ids"] == ["0", "1"]
    if dtype is None:
        assert "runs the module as is" in dp_rows[0]["reason"] and not dp_rows[0]["narrowed"]
    else:
        assert dp_rows[0]["device_ids"] == [str(i) for i in valid] and dp_rows[0]["narrowed"] == (count < 2)
    assert [m["name"] for m in rep["models"]] == ["Sequential"]  # the wrapper of an adopted model is not adopted again
    assert any(d["feature"] == "DataParallel" for d in rep["decisions"])


def test_data_parallel_ids_are_narrowed_to_one_visible_gpu_logged_and_trained(monkeypatch, caplog, cpu_device):
    """By construction, on any machine: the switch sees one visible cuda device
    (``visible_data_parallel_devices`` returns it; CUDA_VISIBLE_DEVICES unset), and below the switch
    DataParallel's constructor is a stand-in that records the ids it is given and then behaves as
    torch's does without an accelerator (the module as is), so the model trains on the CPU here and
    on a GPU machine alike."""
    import apt_model.distributed.session as session_mod

    passed = []

    def recording_init(self, module, device_ids=None, output_device=None, dim=0):
        passed.append((device_ids, output_device))
        nn.Module.__init__(self)
        self.module, self.device_ids, self.dim = module, [], dim  # torch's DataParallel with no accelerator

    monkeypatch.setattr(nn.DataParallel, "__init__", recording_init)
    monkeypatch.setattr(session_mod, "visible_data_parallel_devices", lambda: ("cuda", 1, "CUDA_VISIBLE_DEVICES", None))
    plain, _ = _train_data_parallel(False, [0])  # plain PyTorch, given the one id that exists
    with caplog.at_level("WARNING", logger="apt_model.distributed.session"):
        switched, rep = _train_data_parallel(True, [0, 1])  # the seed's example, as written
    assert passed == [([0], None), ([0], None)]  # with the switch, DataParallel was built on the device that exists
    assert all(torch.equal(a, b) for a, b in zip(plain, switched))
    row = next(w for w in rep["distributed"]["wrappers"] if w["wrapper"] == "DataParallel")
    assert row["requested_device_ids"] == ["0", "1"] and row["device_ids"] == ["0"] and row["narrowed"] is True
    assert "device_ids=[0, 1] narrowed to [0]: 1 is not a visible cuda device" in row["reason"]
    assert "CUDA_VISIBLE_DEVICES unset" in row["reason"]
    decision = next(d for d in rep["decisions"] if d["feature"] == "DataParallel")
    assert (decision["requested"], decision["chosen"]) == ("[0, 1]", "[0]")
    assert any("narrowed to [0]" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    # ids of which none exists are still an error naming the valid ones, before DataParallel is built
    vb.enable("balanced", banner=False)
    with pytest.raises(DeviceSelectionError, match=r"none is a visible cuda device.*valid indices 0..0"):
        nn.DataParallel(nn.Linear(2, 2), device_ids=[1, 2])
    assert len(passed) == 2


# ---------------------------------------------------------------------------- in one process


def test_single_process_report_and_disable_restores_every_patch(cpu_device):
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.nn.parallel import DistributedDataParallel

    before = (dist.init_process_group, c10d.init_process_group, dist.new_group, DistributedDataParallel.__init__,
              nn.DataParallel.__init__)
    vb.enable("balanced", banner=False)
    assert dist.init_process_group is not before[0]
    model = nn.Linear(4, 4).to("cpu")
    rep = vb.get_report()
    d = rep["distributed"]
    assert d["setting"] == "auto" and d["launcher"] is None and d["world_size"] == 1 and d["rank"] == 0
    assert d["backend"] == "gloo" and d["process_group"] == "not initialized"
    feat = rep["models"][0]["features"]["distributed"]
    assert feat["chosen"] == "single process" and "WORLD_SIZE unset" in feat["reason"]
    assert rep["models"][0]["features"]["paging"]["chosen"] != "off" or rep["config"]["features"]["paging"]["value"] == "off"
    assert not hasattr(model, "_vb_distributed")  # no hooks on a single-process model
    vb.disable()
    after = (dist.init_process_group, c10d.init_process_group, dist.new_group, DistributedDataParallel.__init__,
             nn.DataParallel.__init__)
    assert all(a is b for a, b in zip(before, after))


def test_distributed_settings_are_validated(monkeypatch):
    with pytest.raises(ConfigError, match="distributed='on' is not valid; valid values: auto, off"):
        vb.enable("balanced", distributed="on", banner=False)
    with pytest.raises(ConfigError, match="unknown key 'bucket_size'; valid keys: broadcast_buffers"):
        vb.enable("balanced", ddp_options={"bucket_size": 25}, banner=False)
    with pytest.raises(ConfigError, match="must be True or False"):
        vb.enable("balanced", ddp_options={"find_unused_parameters": 1}, banner=False)
    with pytest.raises(ConfigError, match="must be a positive number"):
        vb.enable("balanced", ddp_options={"bucket_cap_mb": 0}, banner=False)
    monkeypatch.setenv("VB_DISTRIBUTED", "off")
    cfg = vb.enable("balanced", banner=False)
    assert cfg.distributed == "off" and vb.get_config()["settings"]["distributed"]["source"] == "environment:VB_DISTRIBUTED"
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    assert dist.init_process_group is c10d.init_process_group  # off: the functions are not patched
    assert vb.get_report()["distributed"]["setting"] == "off"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def world_of_one():
    """A one-rank gloo process group initialized by the script (TCP store on a free port)."""
    import torch.distributed as dist

    yield lambda: dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_paged_model_is_never_handed_to_ddp_dataparallel_or_fsdp2(world_of_one, tmp_path):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    vb.enable("balanced", paging="always", swap_dir=str(tmp_path), mixed_precision="off", banner=False)
    world_of_one()
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).to("cpu")
    rep = vb.get_report()["models"][0]["features"]
    assert rep["paging"]["chosen"] == "paged" and rep["distributed"]["chosen"] == "single process"
    for wrap, what in ((DistributedDataParallel, "DistributedDataParallel"), (nn.DataParallel, "DataParallel"),
                       (fully_shard, r"fully_shard \(FSDP2\)")):
        with pytest.raises(DistributedError, match=f"{what}: .*paged by the switch.*paging='off'"):
            wrap(model)
    x = torch.randn(2, 16)
    assert model(x).shape == (2, 4)  # still a working, paged model


def test_fsdp2_meta_device_recipe_in_memory_mode_trains_like_plain(world_of_one, tmp_path, cpu_device):
    """FSDP2's recipe (build on ``meta``, ``fully_shard``, ``to_empty``, ``reset_parameters``): the
    model is first seen at its first call, already sharded. Memory mode's FP4 planning read the
    storage of FSDP2's DTensor shards ("Attempted to access the data pointer on an invalid python
    storage") on every rank (a probe's finding); FP4 now leaves such a model alone, saying why."""
    from torch.distributed.fsdp import fully_shard

    def run(switch: bool):
        if switch:
            vb.enable("memory", swap_dir=str(tmp_path), mixed_precision="off", compile="off", attention="off",
                      banner=False)
        try:
            torch.manual_seed(0)
            with torch.device("meta"):
                model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
            fully_shard(model)
            model.to_empty(device="cpu")
            torch.manual_seed(0)
            for m in model.modules():
                if isinstance(m, nn.Linear):
                    m.reset_parameters()
            opt = torch.optim.AdamW(model.parameters())
            gen = torch.Generator().manual_seed(1)
            losses = []
            for _ in range(3):
                loss = model(torch.randn(8, 16, generator=gen)).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            feats = vb.get_report()["models"][0]["features"] if switch else None
            return losses, [p.full_tensor().detach().clone() for p in model.parameters()], feats
        finally:
            if switch:
                vb.disable()

    world_of_one()
    plain_losses, plain_params, _ = run(False)
    losses, params, feats = run(True)
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))
    assert feats["fp4"]["chosen"] == "off" and "DTensor" in feats["fp4"]["reason"], feats["fp4"]


def test_a_one_rank_group_of_the_script_is_reported_and_leaves_the_model_alone(world_of_one):
    import torch.distributed as dist

    world_of_one()
    vb.enable("balanced", mixed_precision="off", banner=False)
    model = nn.Linear(4, 4).to("cpu")
    loss = model(torch.randn(3, 4)).sum()
    loss.backward()
    d = vb.get_report()["distributed"]
    assert d["process_group"] == "initialized by the script" and d["world_size"] == 1
    assert "initialized by the script before enable()" in d["reason"]
    vb.disable()
    assert dist.is_initialized()  # the script's group is the script's: disable() leaves it


def test_the_scripts_ddp_model_is_named_after_its_class_and_stats_name_the_rank(world_of_one, cpu_device):
    """A DDP wrapper the script made was reported as ``model:DistributedDataParallel#1``, and every
    rank printed the same ``print_stats`` header (a probe's findings). ``uptime_s`` stops at
    ``disable()``."""
    import time

    from apt_model.switch.banner import format_stats

    world_of_one()
    vb.enable("balanced", mixed_precision="off", compile="off", banner=False)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
        ddp(torch.randn(3, 4)).sum().backward()
        rep = vb.get_report()
        assert rep["models"][0]["name"] == "Sequential (DistributedDataParallel)", rep["models"][0]["name"]
        assert ", rank " not in format_stats(rep).splitlines()[0]  # one process: nothing to tell apart
        rep["distributed"].update(rank=1, world_size=2)
        assert format_stats(rep).splitlines()[0].endswith(", rank 1 of 2")
    finally:
        vb.disable()
    up = vb.get_stats()["uptime_s"]
    time.sleep(0.05)
    assert vb.get_stats()["uptime_s"] == up


def test_the_switch_initializes_nothing_without_a_complete_launcher(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    vb.enable("balanced", mixed_precision="off", banner=False)
    model = nn.Linear(4, 4).to("cpu")
    model(torch.randn(2, 4)).sum().backward()  # the first training forward: it would initialize here
    assert not dist.is_initialized()
    rep = vb.get_report()
    assert rep["distributed"]["process_group"] == "refused"
    assert "missing LOCAL_RANK, MASTER_ADDR, MASTER_PORT" in rep["distributed"]["reason"]
    assert rep["models"][0]["features"]["distributed"]["chosen"] == "single process"


def test_each_rank_pages_into_its_own_swap_folder(monkeypatch, tmp_path):
    for k, v in LAUNCH.items():
        monkeypatch.setenv(k, v)
    # the CPU rank of a two-rank launch (on a one-GPU machine the accelerator would refuse rank 1)
    vb.enable("balanced", paging="always", swap_dir=str(tmp_path), banner=False, device="cpu")
    folder = vb.get_report()["memory"]["stack"]["swap_folder"]
    assert folder.startswith(str(tmp_path / "rank1-"))
    vb.disable()


def test_ranks_on_one_host_share_its_free_memory_and_swap_disk(monkeypatch, tmp_path):
    """Levels sized by default from the host's free RAM and the swap disk's free space: each of N
    ranks on a host takes 1/N (each took 90% of what it saw, so 8 ranks could pin and swap 8x the
    host: a probe's finding). An explicit budget is the rank's own, as given."""
    from apt_model.memory.levels import VGPUStack

    for k, v in {**LAUNCH, "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    vb.enable("balanced", paging="always", swap_dir=str(tmp_path), banner=False, device="cpu")
    stack = vb.get_report()["memory"]["stack"]
    vb.disable()
    alone = VGPUStack("cpu", swap_dir=str(tmp_path), measure=False).describe()
    assert stack["sharing"] == 4 and alone["sharing"] == 1
    for level in (0, 1):  # host RAM (level 0 on a CPU-only run), the swap disk
        ratio = stack["levels"][level]["capacity"] / alone["levels"][level]["capacity"]
        assert 0.2 < ratio < 0.3, (level, ratio)  # a quarter (free memory moves a little between the two)

    for k, v in {**LAUNCH, "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    vb.enable("balanced", paging="always", swap_dir=str(tmp_path), host_budget="64MB", swap_budget="1GB",
              banner=False, device="cpu")
    given = vb.get_report()["memory"]["stack"]["levels"]
    vb.disable()
    assert given[0]["capacity"] == 64_000_000 and given[1]["capacity"] == 1_000_000_000


# ---------------------------------------------------------------------------- multi-process (torchrun)


def torchrun(args: list[str], tmp_path, nproc: int = 2, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone`` (a free rendezvous port) with a timeout.

    Args:
        env: variables added to the clean environment (``CPU_ONLY``, ``NO_CUDA``...).
        check: fail the test when torchrun exits with a non-zero status.
    """
    env = clean_env(OMP_NUM_THREADS="1", **(env or {}))
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=TORCHRUN_TIMEOUT)
    if check and proc.returncode != 0:
        pytest.fail(f"torchrun exited with {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}",
                    pytrace=False)
    return proc


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    """All CPU scenarios of tests/dist_worker.py in one torchrun job (two ranks, gloo; the switch pinned
    to the CPU and CUDA hidden, so they mean the same on a machine with a GPU)."""
    out = tmp_path_factory.mktemp("ddp")
    torchrun([str(ROOT / "tests" / "dist_worker.py"), str(out), "switch_ddp", "nested", "unfreeze", "unused",
              "script_ddp", "script_group", "fsdp2", "accelerate"], out, env=CPU_ONLY)
    ref_losses, ref_params = dist_worker.reference_run()

    def load(name, rank):
        return json.loads((out / f"{name}-rank{rank}.json").read_text())

    return SimpleNamespace(load=load, ref_losses=ref_losses, ref_params=ref_params)


def _assert_matches_reference(s, name):
    r0, r1 = s.load(name, 0), s.load(name, 1)
    for n, ref in s.ref_params.items():
        p0, p1 = torch.tensor(r0["params"][n]), torch.tensor(r1["params"][n])
        assert torch.equal(p0, p1), f"{name}: {n} differs between ranks"
        torch.testing.assert_close(p0, ref, rtol=0, atol=PARAM_ATOL, msg=f"{name}: {n} vs one process")
    # losses are logged per rank: each is its own half of the batch, and they average to the global loss
    assert r0["losses"] != r1["losses"]
    for a, b, ref in zip(r0["losses"], r1["losses"], s.ref_losses):
        assert abs((a + b) / 2 - ref) < 1e-5
    return r0, r1


def test_ddp_by_the_switch_equals_one_process_on_the_global_batch(scenarios):
    r0, r1 = _assert_matches_reference(scenarios, "switch_ddp")
    for rank, r in ((0, r0), (1, r1)):
        d = r["distributed"]
        assert (d["rank"], d["world_size"], d["backend"]) == (rank, 2, "gloo")
        assert d["process_group"] == "initialized by the switch" and "first training forward" in d["reason"]
        assert d["launcher"]["launcher"] == "torchrun" and d["launcher"]["local_rank"] == rank
        assert r["model_features"]["distributed"]["chosen"] == "DDP"
        assert "paging is off under data parallelism (2 ranks)" in r["model_features"]["paging"]["reason"]
        compile_ = r["model_features"]["compile"]  # not "the switch attaches DDP" where the script wraps it
        assert compile_["chosen"] == "eager" and "by the switch, or by the script's own" in compile_["reason"]
        assert r["initialized_before_training"] is False  # lazily: evaluation under no_grad did not need it
        assert r["class"] == "Sequential" and r["state_dict_keys"][0] == "0.weight"  # same object, same keys
        assert r["initialized_after_disable"] is False  # disable() destroyed the group the switch created


def test_a_submodule_adopted_first_is_reduced_once_by_the_whole_models_ddp(scenarios):
    r0, _ = _assert_matches_reference(scenarios, "nested")
    rows = {m["model"]: m for m in r0["models"]}
    assert rows["model:Linear#1"]["wrapper"] == "part of a DDP model"
    assert "reduced by the DDP of model:Sequential#2" in rows["model:Linear#1"]["reason"]
    assert rows["model:Sequential#2"]["wrapper"] == "DDP"


def test_a_model_frozen_when_moved_and_unfrozen_later_is_reduced_over_what_trains(scenarios):
    """Until 2026-11-26 a model with no trainable parameter when moved was never wrapped, and a
    layer unfrozen after the first step was never reduced: the ranks trained apart, silently."""
    r0, r1 = scenarios.load("unfreeze", 0), scenarios.load("unfreeze", 1)
    for n, ref in dist_worker.reference_unfreeze().items():
        p0, p1 = torch.tensor(r0["params"][n]), torch.tensor(r1["params"][n])
        assert torch.equal(p0, p1), f"{n} differs between ranks"
        torch.testing.assert_close(p0, ref, rtol=0, atol=PARAM_ATOL, msg=f"{n} vs one process")
    feat = r0["model_features"]["distributed"]
    assert feat["chosen"] == "DDP" and "rebuilt (2 builds)" in feat["reason"], feat


def test_a_scripts_own_group_with_an_unwrapped_model_is_left_as_written(scenarios):
    """A script that initializes the group itself and trains a model per rank (an ensemble): the
    switch attaches no DDP (until 2026-11-26 it did: the members came out identical, and a
    pipeline-parallel script hung in DDP's constructor); each rank trains exactly as alone."""
    for rank in (0, 1):
        r = scenarios.load("script_group", rank)
        for n, ref in dist_worker.reference_alone(rank).items():
            assert torch.equal(torch.tensor(r["params"][n]), ref), (rank, n)
        feat = r["model_features"]["distributed"]
        assert feat["chosen"] == "as written" and "initialized the process group itself" in feat["reason"], feat


def test_a_submodule_the_forward_skips_is_an_error_that_names_the_switchs_setting(scenarios):
    err = scenarios.load("unused", 0)["error"]
    assert err.startswith("DistributedError: the DDP the switch attached") and "find_unused_parameters': True" in err


def test_a_scripts_nccl_becomes_gloo_on_cpu_and_its_own_ddp_is_not_doubled(scenarios):
    r0, _ = _assert_matches_reference(scenarios, "script_ddp")
    assert r0["backend"] == "gloo"
    call = r0["distributed"]["backend_calls"][0]
    assert (call["requested"], call["chosen"], call["mapped"]) == ("nccl", "gloo", True)
    assert r0["hook_state"] == "left"
    assert [m["name"] for m in r0["models"]] == ["Sequential"]  # the script's DDP wrapper is not adopted again
    assert r0["models"][0]["features"]["distributed"]["chosen"] == "DDP"
    assert "not wrapped twice" in r0["models"][0]["features"]["distributed"]["reason"]


def test_fsdp2_on_an_adopted_model_is_left_to_fsdp(scenarios):
    r0, _ = _assert_matches_reference(scenarios, "fsdp2")
    assert r0["model_features"]["distributed"]["chosen"] == "FSDP2" and r0["hook_state"] == "left"
    assert r0["model_features"]["paging"]["chosen"] == "off"


def test_accelerate_prepare_under_the_switch_trains_on_the_switchs_device(scenarios):
    r0, r1 = _assert_matches_reference(scenarios, "accelerate")
    for r in (r0, r1):
        assert r["param_device"] == r["vb_device"] == "cpu"
        assert torch.device(r["accelerate_device"]).type == torch.device(r["vb_device"]).type
        assert r["prepared_class"] == "DistributedDataParallel"  # Accelerate wrapped it; the switch left it
        assert r["models"][0]["features"]["distributed"]["chosen"] == "DDP"


def test_rank_0s_trial_verdict_holds_for_every_rank_of_a_job(tmp_path):
    """Each rank times its own trial; near a threshold two ranks kept different settings (bf16 on
    one, fp32 on the other: a probe's finding). Rank 0's verdict now holds for every rank running
    the same model, and a rank training another model keeps its own after a short grace
    (``START_GRACE_S``) rather than waiting for rank 0. The model sleeps under autocast on rank 1
    only, so rank 1's own trial would turn bf16 off."""
    torchrun([str(ROOT / "tests" / "dist_worker.py"), str(tmp_path), "agree"], tmp_path, env=CPU_ONLY)
    out = [json.loads((tmp_path / f"agree-rank{rank}.json").read_text()) for rank in (0, 1)]

    r0, r1 = out[0]["same"], out[1]["same"]
    assert r0["chosen"] == "bf16" and "rank 0 decides for all 2 ranks" in r0["reason"], r0
    assert r1["chosen"] == "bf16", r1
    assert "kept as rank 0 decided for all 2 ranks" in r1["reason"] and "alone would have turned it off" in r1["reason"], r1
    assert r1["trial"]["ranks"]["by"] == "rank 0" and r1["trial"]["ranks"]["own_keep"] is False

    o0, o1 = out[0]["other"], out[1]["other"]
    assert o0["chosen"] == "bf16" and o1["chosen"] == "fp32", (o0, o1)
    assert "keeps its own verdict (rank 0 runs no such trial" in o1["reason"], o1
    assert "waited_calls" not in o1["trial"]["ranks"]

    # the switch's own group and DDP (created at the first training forward), and an extra model on rank 1
    auto = tmp_path / "auto"
    auto.mkdir()
    torchrun([str(ROOT / "tests" / "dist_worker.py"), str(auto), "agree_auto"], auto, env=CPU_ONLY)
    a0, a1 = [json.loads((auto / f"agree_auto-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert a0["process_group"] == a1["process_group"] == "initialized by the switch"
    assert "rank 0 decides for all 2 ranks" in a0["feature"]["reason"], a0
    assert "as rank 0 decided for all 2 ranks" in a1["feature"]["reason"], a1
    assert a1["feature"]["chosen"] == a0["feature"]["chosen"]
    # after the script destroyed the group, a model rank 0 trains alone runs as written (no new group, no hang)
    assert "destroyed the process group" in a0["after_destroy"]["reason"], a0["after_destroy"]


@pytest.mark.slow  # a torchrun of two ranks (detection: test_privateuse1_npu.py); the default suite's 15-minute budget on 2 cores
def test_npu_machine_backend_mapping_and_rank_devices(tmp_path):
    """Two ranks on an Ascend-like machine (PrivateUse1 ``npu``, two devices, ``hccl`` registered;
    a real CUDA device hidden): each rank is bound to its own npu; the switch initializes with hccl;
    a script's init_process_group("nccl") gets hccl and the report says so; DataParallel ids are
    fitted to the visible devices."""
    torchrun([str(ROOT / "tests" / "dist_worker.py"), "--fake-npu", str(tmp_path), "npu"], tmp_path, env=NO_CUDA)
    ref_losses, ref_params = dist_worker.reference_run()
    for rank in (0, 1):
        r = json.loads((tmp_path / f"npu-rank{rank}.json").read_text())
        assert r["vb_device"] == f"npu:{rank}"
        assert r["switch_backend"] == "cpu:gloo,npu:hccl"
        assert r["switch_report"]["process_group"] == "initialized by the switch"
        assert f"LOCAL_RANK={rank}: npu:{rank} of 2 visible (ASCEND_RT_VISIBLE_DEVICES unset)" in r["switch_report"]["device_reason"]
        for n, ref in ref_params.items():
            torch.testing.assert_close(torch.tensor(r["params"][n]), ref, rtol=0, atol=PARAM_ATOL)
        assert r["script_backend"] == "hccl"
        call = r["script_report"]["backend_calls"][0]
        assert (call["requested"], call["chosen"]) == ("nccl", "hccl") and "mapped to hccl" in call["reason"]
        assert any(d["feature"] == "backend" and d["chosen"] == "hccl" for d in r["decisions"])
        assert r["dp"] == [[0, 1], "npu:0"]
        assert r["dp_narrowed"] == [0, 1]
        narrowed = [w for w in r["dp_wrappers"] if w["narrowed"]]
        assert len(narrowed) == 1 and "narrowed to [0, 1]: 2 is not a visible npu device" in narrowed[0]["reason"]
        assert "none is a visible npu device" in r["dp_error"]
        assert "ASCEND_RT_VISIBLE_DEVICES unset" in r["dp_error"] and "valid indices 0..1" in r["dp_error"]


@pytest.mark.slow  # a torchrun of the main job; the default suite's 15-minute budget on 2 cores
def test_main_job_with_more_ranks_than_devices_is_a_clear_error(tmp_path):
    """``torchrun --nproc_per_node=2 training/train.py`` on a machine with one accelerator (made of a
    PrivateUse1 ``npu`` with one device; a real CUDA device hidden): every rank stops at
    ``vb.enable()`` with a DeviceSelectionError that names the ranks, the device, the visible-devices
    variable and the fixes — before any process group exists, so no collective can fail or hang.
    The main job reports it as one line per rank and exits with status 2 (torchrun may stop the
    second rank before it prints); VB_LOG_LEVEL=DEBUG (set here) adds the traceback, which shows
    where it was raised."""
    out = tmp_path / "train"
    proc = torchrun([str(ROOT / "tests" / "dist_worker.py"), "--fake-npu=1", "--script", str(ROOT / "training" / "train.py"),
                     "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--max-bytes", "20000", "--quiet",
                     "--out", str(out)], tmp_path, env={**NO_CUDA, "VB_LOG_LEVEL": "DEBUG"}, check=False)
    assert proc.returncode != 0
    err = proc.stderr
    assert "apt_model.errors.DeviceSelectionError: LOCAL_RANK=" in err, err[-4000:]
    # one line per rank that got to print it: torchrun stops the other rank (SIGTERM) as soon as the
    # first one exits, which can be before that rank printed its own line
    assert 1 <= err.count("train.py: error: LOCAL_RANK=") <= 2 and re.search(r"exitcode\s*:\s*2", err), err[-4000:]
    for needle in ("2 processes on this node (LOCAL_WORLD_SIZE=2, local ranks 0..1)",
                   "only 1 npu device(s) visible to them: npu:0 (FakeAscend-910B#0) (ASCEND_RT_VISIBLE_DEVICES unset)",
                   "local rank 1 would have no npu device of its own", "hccl refuses",
                   "torchrun --nproc_per_node=1", "VB_DEVICE=cpu"):
        assert needle in err, err[-4000:]
    assert "in enable\n" in err  # raised by vb.enable(), the script's first switch call
    assert "init_process_group" not in err and "ProcessGroup" not in err
    assert not (out / "report.json").exists()


@pytest.mark.slow  # a two-rank torchrun of the main job, as test_output_contract's two-rank test; the suite's 15 minutes on 2 cores
def test_main_job_runs_unchanged_under_torchrun(tmp_path):
    """Two CPU ranks with gloo. VB_DEVICE=cpu pins it (and is the fix the error above suggests on a
    machine with fewer accelerators than ranks); CUDA is not hidden: on a GPU machine this checks that
    the pinned CPU really trains with gloo there."""
    out = tmp_path / "train"
    torchrun([str(ROOT / "training" / "train.py"), "--steps", "6", "--eval-every", "3", "--eval-batches", "2",
              "--batch-size", "4", "--seq-len", "32", "--max-bytes", "200000", "--quiet", "--out", str(out)], tmp_path,
             env={"VB_DEVICE": "cpu"})
    rep0 = json.loads((out / "report.json").read_text())
    rep1 = json.loads((out / "report.rank1.json").read_text())
    assert (rep0["rank"], rep0["world_size"], rep1["rank"]) == (0, 2, 1)
    assert rep0["device"]["device"] == rep1["device"]["device"] == "cpu"
    d = rep0["vb"]["distributed"]
    assert (d["world_size"], d["backend"], d["process_group"]) == (2, "gloo", "initialized by the switch")
    assert rep0["vb"]["models"][0]["features"]["distributed"]["chosen"] == "DDP"
    assert rep0["losses"] != rep1["losses"]  # each rank trains on its own batches
    assert rep0["eval"] == rep1["eval"]  # ... of one model: the ranks evaluate identical parameters
    assert rep0["eval"][-1][1] < rep0["eval"][0][1]
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert not any(k.startswith("module.") for k in ckpt["model"])  # the bare model's keys


# ---------------------------------------------------------------------------- on an accelerator (-m gpu)


def _accelerator_selection():
    """The ranking's choice when it is an accelerator, else skip (a CPU-only machine)."""
    from apt_model.devices.ranking import select_device

    sel = select_device()
    if sel.device.type == "cpu":
        pytest.skip("needs an accelerator (CUDA/ROCm/NPU/MLU/XPU); the ranking picked the CPU here")
    return sel


@pytest.mark.gpu
def test_ddp_with_one_rank_on_the_accelerator_equals_plain_training(tmp_path):
    """One rank under torchrun on the accelerator: the script's ``init_process_group("nccl")`` (the
    kind's own backend where it is not CUDA) and ``DDP(model, device_ids=[0])`` with the switch on
    give the parameters of plain training on the same device (one rank: the all-reduce is the identity)."""
    sel = _accelerator_selection()
    if not sel.candidate.dist_backend:
        pytest.skip(f"{sel.kind} has no collective library")
    torchrun([str(ROOT / "tests" / "dist_worker.py"), str(tmp_path), "accel_ddp1"], tmp_path, nproc=1,
             env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    r = json.loads((tmp_path / "accel_ddp1-rank0.json").read_text())
    assert r["vb_device"] == f"{sel.device.type}:0" and r["world_size"] == 1
    assert sel.candidate.dist_backend in r["backend"]
    for n, plain in r["plain_params"].items():
        torch.testing.assert_close(torch.tensor(r["params"][n]), torch.tensor(plain), rtol=0, atol=PARAM_ATOL)
    assert r["losses"] == pytest.approx(r["plain_losses"], abs=1e-6)
    assert [w["wrapper"] for w in r["distributed"]["wrappers"]] == ["DDP"]  # the script's DDP, seen and left to it
    assert [m["name"] for m in r["models"]] == ["Sequential"]


@pytest.mark.gpu
def test_more_ranks_than_accelerators_under_torchrun_is_a_clear_error(tmp_path):
    """``torchrun --nproc_per_node=<devices + 1> training/train.py`` on this machine's accelerators
    (two ranks on a one-GPU machine, the failure seen on the H100): a DeviceSelectionError at enable()
    naming the visible-devices variable and the fixes, not an NCCL "invalid usage"."""
    sel = _accelerator_selection()
    count = sel.candidate.count
    out = tmp_path / "train"
    proc = torchrun([str(ROOT / "training" / "train.py"), "--steps", "2", "--batch-size", "2", "--seq-len", "16",
                     "--max-bytes", "20000", "--quiet", "--out", str(out)], tmp_path, nproc=count + 1, check=False)
    assert proc.returncode != 0
    err = proc.stderr
    # train.py reports the DeviceSelectionError raised at enable() as one line per rank, exit status 2
    assert f"train.py: error: LOCAL_RANK=0: {count + 1} processes on this node" in err, err[-4000:]
    for needle in (f"LOCAL_WORLD_SIZE={count + 1}", f"local rank {count} would have no", str(sel.candidate.visible_devices_env),
                   f"torchrun --nproc_per_node={count}", "VB_DEVICE=cpu"):
        assert needle in err, err[-4000:]
    # the ranks stopped at enable() with the usage status, before NCCL's own failure (which the message quotes)
    assert re.search(r"exitcode\s*:\s*2\b", err), err[-4000:]
    assert "ncclInvalidUsage" not in err and "DistBackendError" not in err


@pytest.mark.gpu
def test_data_parallel_on_the_accelerator_is_narrowed_to_the_devices_that_exist():
    """DataParallel asking for one device more than are visible trains on those that exist, exactly
    like plain DataParallel over them, and the report says which id was dropped and why."""
    _accelerator_selection()
    dtype, count = _dp_ids_here()
    if dtype is None:
        pytest.skip("DataParallel runs the module as is on this accelerator (MPS)")
    plain, _ = _train_data_parallel(False, list(range(count)))
    switched, rep = _train_data_parallel(True, list(range(count + 1)))
    assert all(torch.equal(a, b) for a, b in zip(plain, switched))
    row = next(w for w in rep["distributed"]["wrappers"] if w["wrapper"] == "DataParallel")
    assert row["narrowed"] and row["device_ids"] == [str(i) for i in range(count)]
    assert f"{count} is not a visible {dtype} device" in row["reason"]
