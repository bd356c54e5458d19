"""Paging and the script's threads: the page-fault handler is a torch-function mode, and torch
keeps one mode stack per thread (apt_model/memory/paging/threads.py)."""
import logging
import threading

import pytest
import torch
import torch.nn as nn

import apt_model.optimization.vb_global as vb
from conftest import run_python

# a model adopted on the main thread, trained by a thread started afterwards that logs the gradient
# norm and keeps an EMA of the weights (plain ops on paged tensors); run with ``on`` set
_WORKER = r'''
import threading
import torch, torch.nn as nn
if on:
    import apt_model.optimization.vb_global as vb
    vb.enable("balanced", swap_dir=swap, paging="always", device_budget="64KB", attention="off",
              mixed_precision="off", banner=False)
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]).to("cpu")  # adopted here, on the main thread
ema = [p.detach().clone() for p in model.parameters()]
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
out = {"loss": [], "grad_norm": []}

def train():
    for _ in range(3):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        out["grad_norm"].append(torch.stack([p.grad.norm() for p in model.parameters()]).norm().item())
        opt.step()
        with torch.no_grad():
            for e, p in zip(ema, model.parameters()):
                e.lerp_(p, 0.1)
        out["loss"].append(loss.item())

t = threading.Thread(target=train)  # started after paging began
t.start()
t.join()
out["ema"] = [float(e.double().sum()) for e in ema]
out["param_sum"] = float(sum(p.detach().double().sum() for p in model.parameters()))
if on:
    out["paged"] = vb.get_report()["memory"]["paging"]["models"][0]["paged_parameters"]
    vb.disable()
'''

# a thread pool started while one session pages, used by the next session's paged model
_POOL = r'''
import tempfile
from concurrent.futures import ThreadPoolExecutor
opts = dict(paging="always", device_budget="64KB", attention="off", mixed_precision="off", banner=False)
vb.enable("balanced", swap_dir=tempfile.mkdtemp(), **opts)
nn.Linear(64, 64).to("cpu")
pool = ThreadPoolExecutor(1)
pool.submit(lambda: None).result()  # its thread starts in this session
vb.disable()
vb.enable("balanced", swap_dir=tempfile.mkdtemp(), **opts)
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]).to("cpu")  # paged by the next session
model(torch.randn(2, 64)).sum().backward()
total = lambda: sum(float(p.detach().double().sum() + p.grad.double().sum()) for p in model.parameters())
got = pool.submit(total).result()
vb.disable()
out["pool_read_as_resident"] = got == total()
'''


def test_threads_started_while_paging_run_plain_ops_on_paged_tensors_as_plain_pytorch(tmp_path, cpu_device):
    """The handler was on the mode stack of the thread that started paging only:
    - a training thread's gradient-norm logging and EMA update read freed memory (a segmentation
      fault, found by a probe); threads started while paging is on get the handler, and the
      numbers are plain PyTorch's (run here with the switch off);
    - then a thread pool that outlived ``disable()`` kept the closed session's handler, and read
      the next session's pages freed (a segmentation fault, found by a review); its stand-in serves
      whichever session is open.
    In a subprocess, so that a crash fails this test rather than ending the session."""
    import json

    plain = {"on": False, "swap": None}
    torch_threads = torch.get_num_threads()
    exec(_WORKER, plain)  # noqa: S102 - the same code as the subprocess, the switch off
    torch.set_num_threads(torch_threads)
    code = f"on, swap = True, {str(tmp_path)!r}\n" + _WORKER + _POOL + "import json; print(json.dumps(out))\n"
    proc = run_python(code)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got.pop("paged") == 12  # paged, not resident: the worker's reads went through the handler
    assert got.pop("pool_read_as_resident") is True
    assert got == plain["out"]


def test_paging_started_on_a_worker_thread_says_which_threads_lack_the_handler(tmp_path, cpu_device, caplog):
    """A model first called on a worker thread starts paging there: the main thread, already
    running, cannot be given the handler, and a warning says so (and how to avoid it)."""
    vb.enable("balanced", swap_dir=str(tmp_path), paging="always", device_budget="64KB", attention="off",
              mixed_precision="off", banner=False)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        errors = []

        def first_call():
            try:
                model(torch.randn(2, 64)).sum().backward()
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)

        with caplog.at_level(logging.WARNING, logger="apt_model"):
            t = threading.Thread(target=first_call, name="trainer")
            t.start()
            t.join()
    finally:
        vb.disable()  # brings every page back: the model is whole again on this thread
    assert not errors, errors
    assert any("paging started on thread 'trainer', not the main thread" in r.getMessage() for r in caplog.records)
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("name", ["vb-swap-read_0", "apt-fp4_1"])
def test_the_projects_own_threads_start_without_the_handler(tmp_path, cpu_device, name):
    """Only the script's threads get the handler: the memory stack's own (swap I/O, probes) handle
    pages themselves, and a fault inside one would wait on the thread it serves."""
    vb.enable("balanced", swap_dir=str(tmp_path), paging="always", device_budget="64KB", attention="off",
              mixed_precision="off", banner=False)
    try:
        nn.Linear(64, 64).to("cpu")  # paging starts
        seen = {}

        def look():
            seen[threading.current_thread().name] = len(torch.overrides._get_current_function_mode_stack())

        for n in (name, "script-thread"):
            t = threading.Thread(target=look, name=n)
            t.start()
            t.join()
    finally:
        vb.disable()
    assert seen == {name: 0, "script-thread": 1}


def test_a_thread_that_outlives_paging_runs_plain_ops_after_disable(tmp_path, cpu_device):
    """A thread started while paging is on keeps the handler on its stack for its life; after
    ``disable()`` (every page back in memory) its ops on the model's tensors are plain."""
    vb.enable("balanced", swap_dir=str(tmp_path), paging="always", device_budget="64KB", attention="off",
              mixed_precision="off", banner=False)
    go, done, out = threading.Event(), threading.Event(), {}
    try:
        layer = nn.Linear(64, 64).to("cpu")

        def later():
            go.wait(60)
            out["sum"] = float(layer.weight.detach().double().sum())
            out["stack"] = len(torch.overrides._get_current_function_mode_stack())
            done.set()

        t = threading.Thread(target=later, name="long-lived")
        t.start()
    finally:
        vb.disable()
    go.set()
    t.join(60)
    assert done.is_set() and out["stack"] == 1  # the handler, inactive
    assert out["sum"] == float(layer.weight.detach().double().sum())
