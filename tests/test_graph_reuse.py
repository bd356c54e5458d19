"""Scripts that differentiate a graph twice or keep it for a second backward
(apt_model/base/graph_reuse.py): a gradient penalty (``create_graph=True``), two losses over one
graph (``retain_graph=True``). Features whose graphs cannot take them stand aside."""
import subprocess
import sys
import textwrap

import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import clean_env

import apt_model.optimization.vb_global as vb
from apt_model.base.graph_reuse import READY_AFTER, GraphReuseWatch
from apt_model.base.patches import PatchSet
from apt_model.compile.backends import CountingBackend


class Critic(nn.Module):
    """A WGAN-GP critic over sequences, with ``nn.MultiheadAttention`` or hand-written attention."""

    def __init__(self, mha: bool, d: int = 32):
        super().__init__()
        self.mha = mha
        if mha:
            self.attn = nn.ModuleList([nn.MultiheadAttention(d, 4, batch_first=True) for _ in range(2)])
        else:
            self.qkv = nn.Linear(d, 3 * d)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        if self.mha:
            for a in self.attn:
                x = x + a(x, x, x)[0]
        else:
            q, k, v = self.qkv(x).chunk(3, -1)
            x = x + torch.softmax(q @ k.transpose(-1, -2) / 32 ** 0.5, -1) @ v
        return self.head(x).mean(1)


def _penalty_training(critic: nn.Module, steps: int) -> list[float]:
    opt = torch.optim.Adam(critic.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        real = torch.randn(4, 8, 32, generator=gen).requires_grad_(True)
        score = critic(real)
        g, = torch.autograd.grad(score.sum(), real, create_graph=True)
        loss = -score.mean() + 10 * ((g.flatten(1).norm(dim=1) - 1) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _critic(mha: bool) -> Critic:
    torch.manual_seed(0)
    return Critic(mha)


def test_a_gradient_penalty_through_routed_multihead_attention_trains_as_plain_pytorch(cpu_device):
    """Balanced mode routes ``nn.MultiheadAttention`` to SDPA, whose fused CPU kernel has no second
    derivative: a WGAN-GP critic crashed at its first step ("derivative for
    aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented"; a probe's
    finding). Its training calls keep torch's own path once the script differentiated twice."""
    ref = _penalty_training(_critic(True), 5)
    vb.enable("balanced", attention="sdpa", mixed_precision="off", compile="off", banner=False)
    critic = _critic(True).to("cpu")
    assert _penalty_training(critic, 5) == ref
    q = torch.randn(2, 8, 32)
    assert critic.attn[0](q, q, q)[1] is not None  # a training call: torch's own path, weights returned
    with torch.no_grad():
        assert critic.attn[0](q, q, q)[1] is None  # no backward can follow: routed


def test_a_gradient_penalty_over_hand_written_attention_gives_the_compile_ladder_up(cpu_device):
    """The override rung rewrites hand-written attention to SDPA in a captured graph, and a compile
    rung's AOTAutograd graph cannot be differentiated again: the ladder concludes eager, with the
    script's line in the reason, and training equals plain PyTorch."""
    ref = _penalty_training(_critic(False), 8)
    vb.enable("balanced", attention="off", mixed_precision="off", compile_trial_calls=8, banner=False)
    critic = _critic(False).to("cpu")
    assert _penalty_training(critic, 8) == ref
    feature = vb.get_report()["models"][0]["features"]["compile"]
    assert feature["chosen"] == "eager" and "create_graph=True" in feature["reason"]
    assert "test_graph_reuse.py" in feature["reason"], feature
    vb.disable()
    torch._dynamo.reset()


def test_a_model_adopted_after_a_penalty_gets_no_ladder(cpu_device):
    vb.enable("balanced", attention="off", mixed_precision="off", banner=False)
    _penalty_training(_critic(False).to("cpu"), 1)
    later = _critic(False).to("cpu")
    feature = vb.get_report()["models"][1]["features"]["compile"]
    assert later is not None and feature["chosen"] == "eager" and "create_graph=True" in feature["reason"]


def test_the_watch_counts_backward_calls_and_tells_each_kind_once():
    # this file mentions create_graph: the calls alone are watched here (the source is read below)
    watch, patches, told = GraphReuseWatch(read_source=False), PatchSet(), []
    real = (torch.autograd.backward, torch.autograd.grad)
    watch.install(patches)

    class Subscriber:
        def __call__(self, kind, where):
            told.append((kind, where))

        def react(self, kind, where):
            told.append((kind, where))

    sub = Subscriber()
    watch.subscribe(sub.react)
    try:
        x = torch.ones(2, requires_grad=True)
        for _ in range(READY_AFTER - 1):
            (x * 2).sum().backward()
        assert not watch.ready and watch.backwards == READY_AFTER - 1
        (x * 2).sum().backward()
        assert watch.ready and watch.ready_without(("create_graph",)) and told == []
        y = (x ** 3).sum()
        g, = torch.autograd.grad(y, x, create_graph=True)
        g.sum().backward(retain_graph=True)
        g.sum().backward()
        assert [k for k, _ in told] == ["create_graph", "retain_graph"]
        assert all("test_graph_reuse.py" in where for _, where in told), told
        assert not watch.ready and not watch.ready_without(("create_graph",))
        del sub  # held weakly: a dead subscriber is not called
        torch.autograd.grad((x ** 2).sum(), x, create_graph=True)
    finally:
        patches.restore_all()
    assert (torch.autograd.backward, torch.autograd.grad) == real
    assert len(told) == 2


def test_compile_rungs_are_compiled_without_donated_buffers():
    """AOTAutograd's donated buffers refuse ``retain_graph=True`` ("compiled with non-empty donated
    buffers"): a ladder rung's backend compiles with them off; the setting is back after."""
    import torch._functorch.config as functorch_config

    seen = []

    def backend(gm, example_inputs):
        seen.append(functorch_config.donated_buffer)
        return gm.forward

    before = functorch_config.donated_buffer
    fn = torch.compile(lambda t: F.gelu(t) * 2, backend=CountingBackend(backend))
    fn(torch.randn(3))
    assert seen == [False] and functorch_config.donated_buffer == before
    torch._dynamo.reset()


_LATE_PENALTY = textwrap.dedent("""
    import sys
    import torch
    import torch.nn as nn
    import apt_model.optimization.vb_global as vb

    vb.enable("balanced", attention="off", mixed_precision="off", banner=False)


    class Critic(nn.Module):
        def __init__(self, d=32):
            super().__init__()
            self.qkv = nn.Linear(d, 3 * d)
            self.head = nn.Linear(d, 1)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, -1)
            x = x + torch.softmax(q @ k.transpose(-1, -2) / 32 ** 0.5, -1) @ v
            return self.head(x).mean(1)


    def penalty(critic, real):
        real = real.requires_grad_(True)
        g, = torch.autograd.grad(critic(real).sum(), real, PENALTY_ARGUMENT)
        return ((g.flatten(1).norm(dim=1) - 1) ** 2).mean()


    torch.manual_seed(0)
    critic = Critic()
    opt = torch.optim.Adam(critic.parameters(), lr=1e-3)
    for i in range(12):
        real = torch.randn(4, 8, 32)
        loss = -critic(real).mean()
        if i >= 1000:  # the penalty starts later than this run goes
            loss = loss + 10 * penalty(critic, real)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(vb.get_report()["models"][0]["features"]["compile"]["reason"])
""")


def test_a_penalty_the_script_has_not_run_yet_is_read_in_its_source(tmp_path, cpu_device):
    """A script that first differentiates twice after a compiled rung has run a step's forward
    crashed at that call (a probe: a WGAN-GP penalty from step 70 on, in performance mode: "torch.compile
    with aot_autograd does not currently support double backward"). The watch reads the script's
    source when it becomes ready and when a rung would start: a ``create_graph=`` not False (here in
    a penalty the run never reaches) gives the ladder up before any rung runs, with the line. A
    mention in a comment, or ``create_graph=False``, does not."""
    reasons = {}
    for name, argument in (("penalty", "create_graph=True"), ("comment", "retain_graph=False)  # create_graph=True later\n    _ = (0"),
                           ("false", "create_graph=False")):
        script = tmp_path / f"{name}.py"
        script.write_text(_LATE_PENALTY.replace("PENALTY_ARGUMENT", argument))
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                             env=clean_env(VB_DEVICE="cpu"))
        assert run.returncode == 0, run.stderr[-3000:]
        reasons[name] = run.stdout.strip().splitlines()[-1]
    line = _LATE_PENALTY.splitlines().index("    g, = torch.autograd.grad(critic(real).sum(), real, PENALTY_ARGUMENT)") + 1
    assert reasons["penalty"].startswith("the model runs as written: the script calls a backward with "
                                         "create_graph=True"), reasons
    assert f"penalty.py:{line}, in the script's source: not called yet" in reasons["penalty"], reasons
    for name in ("comment", "false"):
        assert "create_graph" not in reasons[name], reasons


def test_the_source_read_skips_installed_and_library_files_and_reads_each_once(tmp_path):
    """Only the script's own files are read (not torch's, an installed package's or the standard
    library's, whose code passes ``create_graph`` through), each once; ``hessian(`` counts."""
    import sysconfig

    site = tmp_path / "site-packages" / "lib.py"
    site.parent.mkdir()
    site.write_text("def f(y, x):\n    return torch.autograd.grad(y, x, create_graph=create_graph)\n")
    watch, told = GraphReuseWatch(), []

    class Subscriber:
        def react(self, kind, where):
            told.append((kind, where))

    sub = Subscriber()
    watch.subscribe(sub.react)
    watch.scan_source((str(site), sysconfig.get_paths()["stdlib"] + "/os.py"), stack=False)
    assert told == []
    mine = tmp_path / "mine.py"
    mine.write_text("import torch\n")
    watch.scan_source((str(mine),), stack=False)
    mine.write_text("import torch\n\nh = torch.autograd.functional.hessian(f, x)\n")
    watch.scan_source((str(mine),), stack=False)  # read once: not again
    assert told == []
    mine2 = tmp_path / "mine2.py"
    mine2.write_text("import torch\n\nh = torch.autograd.functional.hessian(f, x)\n")
    watch.scan_source((str(mine2),), stack=False)
    assert told == [("create_graph", f"{mine2}:3, in the script's source: not called yet")], told
    assert "create_graph" in watch.seen
