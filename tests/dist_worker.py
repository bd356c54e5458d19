"""One rank of the multi-process tests (started by ``python -m torch.distributed.run`` from
tests/test_distributed.py). Runs the scenarios named on the command line in order, each with the
switch on, and writes ``<out>/<scenario>-rank<R>.json`` (losses, final parameters, the
``distributed`` section of the report).

Every scenario trains the same MLP from the same seed on the same data: step k of rank r uses
rows ``[k*GLOBAL + r*LOCAL, k*GLOBAL + (r+1)*LOCAL)``, so a single process training on rows
``[k*GLOBAL, (k+1)*GLOBAL)`` is the reference (see ``reference_run``).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS, LOCAL, WORLD = 4, 8, 2
GLOBAL = LOCAL * WORLD
LR, MOMENTUM = 0.05, 0.9


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * GLOBAL, 8, generator=g)
    y = torch.randn(STEPS * GLOBAL, 4, generator=g)
    return x, y


def reference_run() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch, one process, the global batch at every step."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    x, y = make_data()
    losses = []
    for k in range(STEPS):
        sl = slice(k * GLOBAL, (k + 1) * GLOBAL)
        loss = F.mse_loss(model(x[sl]), y[sl])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def reference_unfreeze() -> dict[str, torch.Tensor]:
    """Plain PyTorch, one process, the global batch: the model frozen but its head, and its first
    layer unfrozen from step 2 (``scenario_unfreeze``'s schedule)."""
    model = make_model().requires_grad_(False)
    _unfreeze_train(model, lambda k: slice(k * GLOBAL, (k + 1) * GLOBAL))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference_alone(rank: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch, one process, training on rank ``rank``'s shard only (a model per rank)."""
    model = make_model()
    _train(model, model, rank)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _unfreeze_train(model: nn.Module, rows) -> list[float]:
    model[4].requires_grad_(True)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    x, y = make_data()
    losses = []
    for k in range(STEPS):
        if k == 2:
            model[0].requires_grad_(True)
        sl = rows(k)
        loss = F.mse_loss(model(x[sl]), y[sl])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _shard(k: int, rank: int):
    x, y = make_data()
    sl = slice(k * GLOBAL + rank * LOCAL, k * GLOBAL + (rank + 1) * LOCAL)
    return x[sl], y[sl]


def _train(forward_model, params_model, rank: int, opt=None) -> list[float]:
    opt = opt or torch.optim.SGD(params_model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for k in range(STEPS):
        xb, yb = _shard(k, rank)
        loss = F.mse_loss(forward_model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _full_params(model: nn.Module) -> dict[str, list]:
    out = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n] = t.detach().cpu().tolist()
    return out


def scenario_switch_ddp(vb, rank):
    """The switch initializes the process group and attaches DDP; the script is single-process code."""
    import torch.distributed as dist

    vb.enable("balanced", mixed_precision="off", banner=False)
    model = make_model().to(vb.device())
    with torch.no_grad():  # an evaluation before training: local, no collective, no wrapping yet
        model(torch.zeros(2, 8))
    before = dist.is_initialized()
    if rank == 0:  # rank-0-only evaluation must not hang
        with torch.no_grad():
            model(torch.zeros(2, 8))
    losses = _train(model, model, rank)
    rep = vb.get_report()
    out = {"losses": losses, "params": _full_params(model), "initialized_before_training": before,
           "distributed": rep["distributed"], "model_features": rep["models"][0]["features"],
           "state_dict_keys": list(model.state_dict()), "class": type(model).__name__}
    vb.disable()
    out["initialized_after_disable"] = dist.is_initialized()
    return out


def scenario_nested(vb, rank):
    """A submodule adopted on its own before the whole model: one DDP, over the whole model."""
    vb.enable("balanced", mixed_precision="off", banner=False)
    model = make_model()
    model[0].to(vb.device())  # adopted first, as a model of its own
    model.to(vb.device())
    losses = _train(model, model, rank)
    rep = vb.get_report()
    out = {"losses": losses, "params": _full_params(model), "models": rep["distributed"]["models"]}
    vb.disable()
    return out


def scenario_unfreeze(vb, rank):
    """Fine-tuning: the model frozen when moved (its head unfrozen after), its first layer unfrozen
    at step 2. The switch's DDP is attached at the first training forward with a trainable
    parameter and rebuilt when the trainable set grows."""
    vb.enable("balanced", mixed_precision="off", banner=False)
    model = make_model().requires_grad_(False).to(vb.device())
    losses = _unfreeze_train(model, lambda k: slice(k * GLOBAL + rank * LOCAL, k * GLOBAL + (rank + 1) * LOCAL))
    rep = vb.get_report()
    out = {"losses": losses, "params": _full_params(model), "model_features": rep["models"][0]["features"],
           "models": rep["distributed"]["models"]}
    vb.disable()
    return out


def scenario_script_group(vb, rank):
    """The script initializes the process group itself (a script that runs a model per rank: an
    ensemble, a sweep) and never wraps its model: left as written, each rank trains on its own."""
    import torch.distributed as dist

    vb.enable("balanced", mixed_precision="off", banner=False)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model = make_model().to(vb.device())
    losses = _train(model, model, rank)
    rep = vb.get_report()
    out = {"losses": losses, "params": _full_params(model), "model_features": rep["models"][0]["features"]}
    vb.disable()
    return out


class _Branchy(nn.Module):
    """A model whose forward never uses one of its submodules (``b``)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.a(x)


def scenario_unused(vb, rank):
    """A single-process script whose model has a submodule the forward skips, under torchrun: the
    switch's DDP refuses at the second step; the error says which setting fixes it."""
    vb.enable("balanced", mixed_precision="off", banner=False)
    torch.manual_seed(0)
    model = _Branchy().to(vb.device())
    error = None
    try:
        _train(model, model, rank)
    except Exception as err:  # noqa: BLE001 - reported to the test
        error = f"{type(err).__name__}: {err}"
    vb.disable()
    return {"error": error}


def scenario_script_ddp(vb, rank):
    """The script initializes with "nccl" (mapped to the CPU's gloo) and wraps DDP itself."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    vb.enable("balanced", mixed_precision="off", banner=False)
    dist.init_process_group("nccl")
    model = make_model().to(vb.device())
    ddp = DDP(model)
    losses = _train(ddp, model, rank)
    rep = vb.get_report()
    out = {"losses": losses, "params": _full_params(model), "backend": dist.get_backend(),
           "distributed": rep["distributed"], "models": rep["models"],
           "hook_state": getattr(getattr(model, "_vb_distributed", None), "state", None)}
    vb.disable()
    return out


def scenario_fsdp2(vb, rank):
    """FSDP2 applied by the script to an adopted model, under the script's process group."""
    from torch.distributed.fsdp import fully_shard

    vb.enable("balanced", mixed_precision="off", banner=False)
    model = make_model().to(vb.device())
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    losses = _train(model, model, rank)
    rep = vb.get_report()
    out = {"losses": losses, "params": _full_params(model), "distributed": rep["distributed"],
           "model_features": rep["models"][0]["features"],
           "hook_state": getattr(getattr(model, "_vb_distributed", None), "state", None)}
    vb.disable()
    return out


def scenario_accelerate(vb, rank):
    """Accelerate's prepare() under the switch: it wraps DDP itself; the switch agrees on the device."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    vb.enable("balanced", mixed_precision="off", banner=False)
    acc = Accelerator(cpu=vb.device().type == "cpu")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    x, y = make_data()
    loader = DataLoader(TensorDataset(x, y), batch_size=LOCAL, shuffle=False)
    pmodel, popt, ploader = acc.prepare(model, opt, loader)
    losses = []
    for xb, yb in ploader:
        loss = F.mse_loss(pmodel(xb), yb)
        popt.zero_grad()
        acc.backward(loss)
        popt.step()
        losses.append(loss.item())
    rep = vb.get_report()
    out = {"losses": losses, "params": _full_params(model), "accelerate_device": str(acc.device),
           "vb_device": str(vb.device()), "param_device": str(next(model.parameters()).device),
           "prepared_class": type(pmodel).__name__, "distributed": rep["distributed"], "models": rep["models"]}
    vb.disable()
    return out


def register_fake_npu(count: int = 2) -> None:
    """``count`` Ascend-like devices through PrivateUse1 (as tests/test_privateuse1_npu.py does), and
    an ``hccl`` backend registered for them (gloo underneath: the fake devices hold no tensors, so the
    models stay on the CPU while the device layer, ranking and backend mapping see an NPU machine)."""
    import torch.distributed as dist
    import torch.utils.backend_registration as br

    class FakeModule(br._DummyBackendModule):
        def device_count(self):
            return count

        def get_device_name(self, index=0):
            return f"FakeAscend-910B#{index}"

    br._setup_privateuseone_for_python_backend("npu", backend_module=FakeModule())
    dist.Backend.register_backend("hccl", lambda store, rank, size, timeout: dist.ProcessGroupGloo(store, rank, size, timeout),
                                  devices=["npu"])


def scenario_npu(vb, rank):
    """On the fake NPU machine: the rank's device is npu:<local rank>; the switch initializes with
    hccl; a script's init_process_group("nccl") gets hccl; DataParallel ids are fitted to the
    visible devices (narrowed where some exist, an error where none does)."""
    import torch.distributed as dist

    from apt_model.errors import DeviceSelectionError

    out = {}
    vb.enable("balanced", mixed_precision="off", banner=False)
    out["vb_device"] = str(vb.device())
    model = make_model().to("cpu")  # the fake devices cannot hold tensors
    out["losses"] = _train(model, model, rank)
    out["params"] = _full_params(model)
    out["switch_backend"] = dist.get_backend()
    out["switch_report"] = vb.get_report()["distributed"]
    vb.disable()
    vb.enable("balanced", mixed_precision="off", banner=False)
    dist.init_process_group("nccl")
    out["script_backend"] = dist.get_backend()
    dp = nn.DataParallel(nn.Linear(4, 4), device_ids=[0, 1])
    out["dp"] = [dp.device_ids, str(dp.src_device_obj)]
    # one id more than there are devices: narrowed to the visible ones (two here: the fake devices hold no
    # tensors, and DataParallel moves the module to its device only when it has exactly one)
    dp = nn.DataParallel(nn.Linear(4, 4), device_ids=[0, 1, 2])
    out["dp_narrowed"] = dp.device_ids
    try:
        nn.DataParallel(nn.Linear(4, 4), device_ids=[2, 3])
        out["dp_error"] = None
    except DeviceSelectionError as err:
        out["dp_error"] = str(err)
    out["dp_wrappers"] = [w for w in vb.get_report()["distributed"]["wrappers"] if w["wrapper"] == "DataParallel"]
    out["script_report"] = vb.get_report()["distributed"]
    out["decisions"] = [d for d in vb.get_report()["decisions"] if d["scope"] == "distributed"]
    vb.disable()
    return out


def scenario_accel_ddp1(vb, rank):
    """One rank on the accelerator: plain training on it, then the same under the switch with the
    script's own ``init_process_group("nccl")`` (mapped where the accelerator is not CUDA) and
    ``DDP(model, device_ids=[index])``. With one rank DDP's all-reduce is the identity, so both
    must give the same parameters."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.use_deterministic_algorithms(True, warn_only=True)  # with CUBLAS_WORKSPACE_CONFIG set by the test
    acc = torch.accelerator.current_accelerator()
    dev = torch.device(acc.type, 0) if acc is not None else torch.device("cpu")  # the CPU: a dry run of the scenario

    def run(switch: bool):
        model = make_model().to(dev)
        forward = model
        if switch:
            forward = DDP(model, device_ids=None if dev.type == "cpu" else [dev.index])
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        x, y = make_data()
        losses = []
        for k in range(STEPS):
            sl = slice(k * GLOBAL, (k + 1) * GLOBAL)
            loss = F.mse_loss(forward(x[sl].to(dev)), y[sl].to(dev))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, _full_params(model)

    plain_losses, plain_params = run(False)
    vb.enable("balanced", mixed_precision="off", tf32="off", banner=False)  # plain training's IEEE fp32 matmuls
    dist.init_process_group("nccl")
    out = {"vb_device": str(vb.device()), "backend": str(dist.get_backend()), "world_size": dist.get_world_size()}
    losses, params = run(True)
    rep = vb.get_report()
    out.update(plain_losses=plain_losses, plain_params=plain_params, losses=losses, params=params,
               distributed=rep["distributed"], models=rep["models"])
    vb.disable()
    return out


def _fake_npu_count(flag: str) -> int:
    """``--fake-npu`` (2 devices) or ``--fake-npu=N``."""
    return int(flag.partition("=")[2] or 2)


class _RankSkewed(nn.Module):
    """A model whose training calls sleep 15 ms with autocast on for rank 1 and off for rank 0:
    rank 0's trial keeps bf16, rank 1's alone would turn it off."""

    def __init__(self, rank: int, width: int = 16):
        super().__init__()
        self.rank = rank
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        import time

        if torch.is_grad_enabled() and torch.is_autocast_enabled("cpu") == (self.rank == 1):
            time.sleep(0.015)
        return self.lin(x)


def _train_until_decided(vb, model, index: int, width: int, fixed: int | None = None) -> tuple[dict, int]:
    """Train until the model's mixed_precision decision leaves the trial (at most 400 steps), or
    exactly ``fixed`` steps: under DDP every rank must run the same steps (a rank that stopped at its
    own verdict left the other, still waiting for rank 0's, in an all-reduce no one joined)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, width)
    feature, steps = None, 0
    for steps in range(1, (fixed or 399) + 1):
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        feature = vb.get_report()["models"][index]["features"]["mixed_precision"]
        if fixed is None and "on trial" not in feature["reason"]:
            break
    return feature, steps


def scenario_agree(vb, rank):
    """Replicas of a :class:`_RankSkewed` per rank (no DDP: the ranks' timings stay their own),
    each trained until its ``mixed_precision`` decision leaves the trial: first the same model on
    both ranks (rank 0's verdict, bf16 kept, must hold on rank 1 too), then different models
    (widths 16 and 24: each rank keeps its own verdict, without waiting)."""
    import torch.distributed as dist

    vb.enable("balanced", mixed_precision="auto", autocast_min_speedup=0.01, autocast_trial_calls=8,
              compile="off", banner=False)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    same, same_steps = _train_until_decided(vb, _RankSkewed(rank, 16).to(vb.device()), 0, 16)
    dist.barrier()
    width = 16 if rank == 0 else 24
    other, other_steps = _train_until_decided(vb, _RankSkewed(rank, width).to(vb.device()), 1, width)
    dist.barrier()
    vb.disable()
    dist.destroy_process_group()
    return {"same": same, "same_steps": same_steps, "other": other, "other_steps": other_steps}


def scenario_agree_auto(vb, rank):
    """The switch creates the process group and attaches DDP at the first training forward (the
    script is single-process code): rank 0 says it runs the trial once the group exists, so rank 1
    follows its verdict (before, rank 0's first timed call came before the group, and rank 1 kept
    its own verdict as if rank 0 trained another model). Rank 1 first adopts a small net of its
    own: models are matched by fingerprint, not by adoption order."""
    vb.enable("balanced", mixed_precision="auto", autocast_min_speedup=0.01, autocast_trial_calls=8,
              compile="off", banner=False)
    torch.manual_seed(0)
    if rank == 1:
        nn.Linear(3, 3).to(vb.device())  # a model only this rank has, adopted first
    model = _RankSkewed(rank, 16).to(vb.device())
    index = 1 if rank == 1 else 0
    feature, steps = _train_until_decided(vb, model, index, 16, fixed=160)  # DDP: the same steps on every rank
    out = {"feature": feature, "steps": steps, "process_group": vb.get_report()["distributed"]["process_group"]}
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()  # the script ends its distributed part; then rank 0 alone trains a probe
    if rank == 0:  # the switch created the group again and waited forever for rank 1 (a probe's finding)
        probe = nn.Linear(16, 2).to(vb.device())
        opt = torch.optim.SGD(probe.parameters(), lr=0.1)
        for _ in range(2):
            probe(torch.ones(4, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        out["after_destroy"] = vb.get_report()["models"][-1]["features"]["distributed"]
    vb.disable()
    return out


def main(argv: list[str]) -> None:
    """``[--fake-npu[=N]] OUT_DIR SCENARIO...`` runs scenarios; ``[--fake-npu[=N]] --script PATH ARGS...``
    runs a script unchanged as ``__main__`` (on the fake NPU machine when asked)."""
    if argv and argv[0].startswith("--fake-npu"):
        register_fake_npu(_fake_npu_count(argv[0]))
        argv = argv[1:]
    if argv and argv[0] == "--script":
        import runpy

        sys.argv = argv[1:]
        sys.path.insert(0, str(Path(argv[1]).resolve().parent))
        runpy.run_path(argv[1], run_name="__main__")
        return
    out_dir, names = Path(argv[0]), argv[1:]
    torch.set_num_threads(1)
    import apt_model.optimization.vb_global as vb
    from apt_model.distributed import process_rank

    rank = process_rank()[0]
    for name in names:
        result = globals()[f"scenario_{name}"](vb, rank)
        (out_dir / f"{name}-rank{rank}.json").write_text(json.dumps(result, default=str), encoding="utf-8")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
