"""The compile ladder through the switch: balanced mode's override rung on hand-written attention,
models it leaves alone, memory mode with checkpointing and offload, paging, disable(), and the
TF32 decision (with a CUDA device stood in at the boundary). A real TorchInductor run is `slow`."""
from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from apt_model.base.graph_reuse import READY_AFTER


class TextbookAttention(nn.Module):
    """Causal self-attention written by hand, nanoGPT style."""

    def __init__(self, d=64, heads=4, seq=32):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.register_buffer("bias", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        return self.proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.ln, self.attn, self.mlp = nn.LayerNorm(d), TextbookAttention(d), nn.Linear(d, d)

    def forward(self, x):
        x = x + self.attn(self.ln(x))
        return x + self.mlp(x)


class TinyLM(nn.Module):
    def __init__(self, d=64, layers=2):
        super().__init__()
        self.emb = nn.Embedding(256, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, 256)

    def forward(self, idx):
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def model(seed=0):
    torch.manual_seed(seed)
    return TinyLM()


def train(m, steps, seed=1):
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 256, (4, 32), generator=gen)
        loss = F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(autouse=True)
def fresh_dynamo(request):
    if request.node.get_closest_marker("gpu") is None:  # the accelerator tests must not be pinned to the CPU
        request.getfixturevalue("cpu_device")
    torch._dynamo.reset()
    yield
    vb.disable()
    torch._dynamo.reset()


FAST_TRIAL = dict(compile_trial_calls=8, mixed_precision="off", attention="off", banner=False)
# the script's first backward calls (the gate), warm-up, the trial's settle limit and calls, a
# margin: the verdict is in
STEPS = READY_AFTER + 2 + 48 + 16 + 8


def test_balanced_rewrites_hand_written_attention_and_judges_it_against_eager():
    """The override rung captures the model, rewrites both attention sites to SDPA (verified
    against the captured graph), and an A/B trial keeps or leaves it; every loss stays within
    1e-4 (relative) of plain eager training — the rewrite is an exact reformulation up to
    summation order."""
    reference = train(model(), STEPS)
    vb.enable("balanced", **FAST_TRIAL)
    m = model()
    m.to("cpu")
    first = vb.get_report()["models"][0]["features"]["compile"]
    assert first["chosen"] == "on trial" and "override → eager" in first["reason"]
    losses = train(m, STEPS)
    assert losses == pytest.approx(reference, rel=1e-4)
    rec = vb.get_report()["models"][0]
    compile_ = rec["features"]["compile"]
    assert compile_["chosen"] in ("override", "eager"), compile_
    (entry,) = rec["timeline"]
    assert entry["rung"] == "override" and entry["outcome"] in ("kept", "not faster")
    assert sum(int(r.split(" x ")[0]) for r in entry["rewrites"]) >= 2
    assert all("textbook_attention" in r for r in entry["rewrites"])
    assert entry["trial"]["calls"] >= 8 and entry["warmup_s"] is not None
    assert any(d["feature"] == "compile" and d["chosen"] == compile_["chosen"] for d in vb.get_report()["decisions"])
    assert gradient_hooks(m) == 0  # the trial's timing hooks went with its verdict (they piled up: 64 per weight)
    # the switch's own capture turned the forward fast path off: its reason says so, not that the
    # script called torch.compile (a probe's finding)
    fast_path = vb.get_stats()["forward_fast_path"]
    assert "the compile ladder's torch.compile() of TinyLM's forward" in fast_path["off_reason"], fast_path


def test_a_model_adopted_at_its_first_forward_climbs_the_ladder():
    """A model never moved with ``.to()`` is adopted inside its first forward, where the ladder's
    pre-hook, added during that call, does not run: the first optimizer step then concluded
    ``eager`` ("trained only inside code the script compiles itself") for a script that compiles
    nothing, and no rung was ever tried (a probe's finding). The adopting call counts now."""
    vb.enable("balanced", **FAST_TRIAL)
    m = model()
    train(m, 3)
    compile_ = vb.get_report()["models"][0]["features"]["compile"]
    assert compile_["chosen"] == "on trial", compile_
    assert "compiles itself" not in compile_["reason"]


def gradient_hooks(m):
    """Hooks on the parameters' gradients (the trial's timer puts its backward marks there)."""
    return sum(len(p._backward_hooks or {}) for p in m.parameters())


def test_a_model_without_softmax_is_left_alone_without_any_capture():
    vb.enable("balanced", **FAST_TRIAL)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    m.to("cpu")
    feature = vb.get_report()["models"][0]["features"]["compile"]
    assert feature["chosen"] == "eager" and "no module's forward calls softmax" in feature["reason"]
    assert "forward" not in vars(m) and len(m._forward_pre_hooks) == 0


@pytest.mark.slow  # the default suite's 15-minute budget on 2 cores
def test_memory_mode_composes_with_checkpointing_and_offload(tmp_path):
    """Memory mode: checkpointed blocks, offloaded activations and the override rung together;
    losses within 1e-4 of plain training and every feature did its work."""
    reference = train(model(), STEPS)
    vb.enable("memory", swap_dir=str(tmp_path), paging="off", activation_budget="16KB", offload_min_bytes=1024,
              **FAST_TRIAL)
    m = model()
    m.to("cpu")
    losses = train(m, STEPS)
    report = vb.get_report()
    assert losses == pytest.approx(reference, rel=1e-4)
    assert report["activations"]["models"][0]["checkpointed"] == ["blocks.0", "blocks.1"]
    assert report["activations"]["offload"]["offloaded_bytes"] > 0
    (entry,) = report["models"][0]["timeline"]
    assert entry["rung"] == "override" and entry["outcome"] in ("kept", "not faster")
    assert entry["rewrites"]  # the attention inside the checkpointed blocks' captured bodies was rewritten


def test_a_paged_model_is_not_compiled(tmp_path):
    vb.enable("balanced", paging="always", device_budget="64KB", swap_dir=str(tmp_path), **FAST_TRIAL)
    m = model()
    m.to("cpu")
    feature = vb.get_report()["models"][0]["features"]["compile"]
    assert feature["chosen"] == "eager" and "the model is paged" in feature["reason"]


class _Backbone(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.e = nn.Embedding(64, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(2))

    def forward(self, x):
        h = self.e(x)
        for b in self.blocks:
            h = h + b(h)
        return h


class _Classifier(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.bb, self.head = backbone, nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.bb(x).mean(1))


@pytest.mark.parametrize("how", ["model.compile()", "torch.compile(wrapper of an adopted model)"])
def test_a_model_under_autocast_compiled_by_the_script_trains(how):
    """Dynamo traced the autocast hooks with the forward: the autocast entered by hand in the
    pre-hook was only simulated, and the forward hook, run for real after a graph break, raised
    ``AttributeError: 'autocast' object has no attribute 'prev'`` at the first call (a probe's
    finding on a CPU where balanced mode keeps bf16). The hooks run eagerly now: the compiled
    forward runs under the real autocast, with the losses of the same model not compiled."""
    def run(compiled: bool):
        torch.manual_seed(0)
        vb.enable("balanced", mixed_precision="bf16", compile="off", attention="off", banner=False)
        if how == "model.compile()":
            model = _Classifier(_Backbone()).to("cpu")
            if compiled:
                model.compile(backend="eager")
            call = model
        else:
            model = _Classifier(_Backbone().to("cpu"))  # the backbone is adopted, the wrapper compiled
            call = torch.compile(model, backend="eager") if compiled else model
        opt = torch.optim.Adam(model.parameters(), 1e-3)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            x = torch.randint(0, 64, (4, 16), generator=gen)
            out = call(x)
            assert out.dtype == torch.float32
            loss = F.cross_entropy(out, x[:, 0] % 10)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        calls = vb.get_stats()["autocast_calls"]
        vb.disable()
        return losses, calls

    eager_losses, eager_calls = run(False)
    losses, calls = run(True)
    assert calls == eager_calls == 3  # autocast really ran around every compiled call
    assert losses == pytest.approx(eager_losses, rel=1e-3, abs=1e-4)


@pytest.mark.parametrize("how", [pytest.param("model.compile()", marks=pytest.mark.slow),  # the suite's 15 minutes
                                 "torch.compile(model)", "block.compile()"])
def test_a_model_the_script_compiles_itself_gets_no_rung(how):
    """The ladder leaves a model the script compiles itself, whole or block by block, alone
    (reason recorded): no rung on trial above or beneath the script's compiled calls, no timeline,
    and training matches plain training compiled the same way (``aot_eager``: Dynamo's capture
    without Inductor's code generation)."""
    def compiled(m):
        if how == "model.compile()":
            m.compile(backend="aot_eager")
        elif how == "block.compile()":
            for block in m.blocks:
                block.compile(backend="aot_eager")
        else:
            return torch.compile(m, backend="aot_eager")
        return m

    reference = train(compiled(model()), 12)
    torch._dynamo.reset()
    vb.enable("balanced", **FAST_TRIAL)
    m = compiled(model())
    losses = train(m, 12)
    (rec,) = vb.get_report()["models"]
    feature = rec["features"]["compile"]
    assert feature["chosen"] == "eager" and "the script compiles this model (or modules in it) itself" in feature["reason"], feature
    assert rec["timeline"] == []
    assert losses == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("what", ["model", "blocks"])
def test_exporting_a_model_compiled_after_enable_adopts_nothing_during_the_trace(what):
    """``torch.export`` (non-strict: no Dynamo) of a model compiled with ``model.compile()`` after
    ``enable()``, before any eager call: the switch does not adopt the model (nor its blocks, one
    by one) while export traces it — that failed with "Cannot access data pointer of Tensor"
    where paging adopted it, and adopted each block as a model of its own. The exported graph
    computes what the eager model does, and the first eager call adopts the model once."""
    ref = model()
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(x)
    vb.enable("balanced", **FAST_TRIAL)
    m = model()
    for mod in (m.blocks if what == "blocks" else [m]):
        mod.compile(backend="eager")
    exported = torch.export.export(m, (x,))
    assert vb.get_report()["models"] == []
    m(x)
    assert [(r["name"], r["trigger"]) for r in vb.get_report()["models"]] == [
        ("TinyLM", "compile()" if what == "model" else "first forward")]
    assert torch.allclose(exported.module()(x), want, rtol=1e-5, atol=1e-6)


def test_disable_during_the_trial_restores_the_model_and_training_goes_on():
    vb.enable("balanced", **FAST_TRIAL)
    m = model()
    params = [id(p) for p in m.parameters()]
    m.to("cpu")
    train(m, 6)  # warm-up done, trial under way
    assert "forward" in vars(m)
    assert gradient_hooks(m) == 0  # a timed call's hooks go once its backward has been through
    m(torch.randint(0, 256, (4, 32)))  # a timed call awaiting its backward (its hooks are on the parameters)
    vb.disable()
    assert "forward" not in vars(m) and not m._forward_pre_hooks
    assert gradient_hooks(m) == 0
    assert [id(p) for p in m.parameters()] == params
    assert all(math.isfinite(x) for x in train(m, 2))
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None  # nothing of the switch keeps the model (a hook cycle through the ladder did)


# ---------------------------------------------------------------------------- TF32


class FakeCuda:
    """``torch.cuda`` answers for a CUDA device of a chosen capability (nothing else is called)."""

    def __init__(self, monkeypatch, capability):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.version, "hip", None)


def tf32_decision(config, capability, monkeypatch, step=None):
    from types import SimpleNamespace

    from apt_model.base.feature import AdoptionContext, ModelRecord, StepSession
    from apt_model.base.patches import PatchSet
    from apt_model.precision.tf32 import TF32Step

    FakeCuda(monkeypatch, capability)
    patches = PatchSet()
    step = step or TF32Step(StepSession(SimpleNamespace(tf32=config), torch.device("cuda:0"), patches))
    rec = ModelRecord(1, "M", "adopt()", "cuda:0", 0, None)
    ctx = AdoptionContext(step.session, rec, torch.device("cuda:0"), "adopt()", lambda r, d: None)
    decision = step.decide(nn.Linear(2, 2), ctx)
    if decision.act:
        decision = step.apply(nn.Linear(2, 2), ctx, patches, decision)
    return decision, patches, step


def test_tf32_is_turned_on_for_ampere_and_restored(monkeypatch):
    before = torch.backends.cuda.matmul.fp32_precision
    assert before in ("none", "ieee")
    decision, patches, step = tf32_decision("auto", (8, 0), monkeypatch)
    assert decision.chosen == "tf32" and torch.backends.cuda.matmul.fp32_precision == "tf32"
    # both of PyTorch's settings agree: reading the legacy ones (Lightning, Inductor, the script)
    # raised "mix of the legacy and new APIs" when only the new one was written
    assert torch.backends.cuda.matmul.allow_tf32 is True and torch.get_float32_matmul_precision() == "high"
    again, _, _ = tf32_decision("auto", (8, 0), monkeypatch, step=step)  # a second model: the session's decision
    assert again.chosen == "tf32" and not again.act and "decided for this session" in again.reason
    patches.restore_all()
    assert torch.backends.cuda.matmul.fp32_precision == before
    assert torch.backends.cuda.matmul.allow_tf32 is False and torch.get_float32_matmul_precision() == "highest"


def test_tf32_is_not_used_before_ampere_nor_when_off_nor_over_the_scripts_choice(monkeypatch):
    decision, _, _ = tf32_decision("auto", (7, 5), monkeypatch)
    assert decision.chosen == "ieee fp32" and "7.5" in decision.reason
    decision, _, _ = tf32_decision("off", (9, 0), monkeypatch)
    assert decision.chosen == "ieee fp32" and not decision.act
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # the script chose
    try:
        decision, _, _ = tf32_decision("auto", (9, 0), monkeypatch)
        assert not decision.act and "the script chose" in decision.reason
    finally:
        torch.backends.cuda.matmul.fp32_precision = "none"


def test_tf32_is_off_on_the_cpu_and_in_memory_mode():
    vb.enable("balanced", banner=False)
    nn.Linear(4, 4).to("cpu")
    feature = vb.get_report()["models"][0]["features"]["tf32"]
    assert feature["chosen"] == "ieee fp32" and "cpu has none" in feature["reason"]
    vb.disable()
    assert vb.enable("memory", banner=False).tf32 == "off"


# ---------------------------------------------------------------------------- a real compiler


@pytest.mark.slow
def test_performance_mode_climbs_the_real_ladder_with_inductor():
    """TorchInductor on this CPU: the compile rung warms up (tens of seconds on 2 cores), its
    compilations are counted, and a verdict is reached; losses stay within 1e-3 of eager."""
    from apt_model.compile.backends import compiler_for

    if compiler_for("cpu")[0] is None:
        pytest.skip(compiler_for("cpu")[1])
    reference = train(model(), STEPS)
    vb.enable("performance", **FAST_TRIAL)
    m = model()
    m.to("cpu")
    losses = train(m, STEPS)
    assert losses == pytest.approx(reference, rel=1e-3)
    timeline = vb.get_report()["models"][0]["timeline"]
    assert timeline[0]["rung"] == "compile" and timeline[0]["compiles"] >= 1, timeline
    assert vb.get_report()["models"][0]["features"]["compile"]["chosen"] in ("compile", "override", "eager")


# ---------------------------------------------------------------------------- on an accelerator


@pytest.mark.gpu
def test_the_ladder_on_the_accelerator_times_with_events_and_reaches_a_verdict(monkeypatch):
    """On the accelerator: the ladder's trial is timed with device events (no synchronize per
    call), a verdict is reached within the trial's call budget, losses stay within 1e-3 of eager,
    and after the verdict the model's forward is the chosen callable with no ladder hooks."""
    from conftest import require_accelerator

    from apt_model.devices import timing

    dev = require_accelerator()
    vb.disable()
    vb.enable("performance", device=str(dev), **FAST_TRIAL)
    torch.manual_seed(0)
    m = TinyLM().to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    step = next(s for s in vb.session().steps if s.name == "compile")
    steps = 0
    while vb.get_report()["models"][0]["features"]["compile"]["chosen"] == "on trial" and steps < 300:
        x = torch.randint(0, 256, (4, 32), device=dev)
        loss = F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    ladder = step.ladders[0]()  # held weakly by the step
    assert ladder.state == "done", ladder.describe()
    trials = [e for e in ladder.timeline if "trial" in e]
    assert all(e["trial"]["calls"] >= 8 for e in trials)
    assert not m._forward_pre_hooks or all("CompileLadder" not in repr(h) for h in m._forward_pre_hooks.values())
    calls = []

    def counting(fn):
        return lambda *a, **k: (calls.append(fn), fn(*a, **k))[1]

    monkeypatch.setattr(timing, "synchronize", counting(timing.synchronize))
    monkeypatch.setattr(torch.accelerator, "synchronize", counting(torch.accelerator.synchronize))
    if dev.type == "cuda":
        monkeypatch.setattr(torch.cuda, "synchronize", counting(torch.cuda.synchronize))
    for _ in range(3):
        x = torch.randint(0, 256, (4, 32), device=dev)
        F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1)).backward()
    assert not calls  # nothing of the ladder synchronizes after its verdict


@pytest.mark.gpu
def test_tf32_on_a_real_ampere_gpu():
    from conftest import require_accelerator

    dev = require_accelerator()
    if dev.type != "cuda" or torch.version.hip is not None or torch.cuda.get_device_capability(dev)[0] < 8:
        pytest.skip(f"{dev}: not an NVIDIA GPU of compute capability >= 8.0")
    before = torch.backends.cuda.matmul.fp32_precision
    vb.disable()
    vb.enable("balanced", device=str(dev), banner=False)
    nn.Linear(4, 4).to(dev)
    assert vb.get_report()["models"][0]["features"]["tf32"]["chosen"] == "tf32"
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    vb.disable()
    assert torch.backends.cuda.matmul.fp32_precision == before


def test_the_softmax_screen_skips_modules_with_an_sdpa_implementation_of_their_own():
    """The project's GPT has an eager branch that calls softmax, but it declares an SDPA
    implementation (the attention step routes it): the override rung is not attempted."""
    from apt_model.compile.step import softmax_callers
    from apt_model.models.gpt import GPT, GPTConfig

    assert softmax_callers(GPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=2))) == []
    assert softmax_callers(TinyLM()) == ["TextbookAttention"]


class CTCHead(nn.Module):
    """A CTC/NLL classifier's forward: ``log_softmax``, no attention."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 8)

    def forward(self, x):
        return F.log_softmax(self.proj(x), dim=-1).transpose(0, 1)


def test_a_log_softmax_is_no_softmax_for_the_screen():
    """The screen matched "softmax" inside ``log_softmax``: balanced mode captured every CTC or NLL
    classifier with Dynamo (seconds, a page of Dynamo's warnings, the forward fast path off for
    the session) for a rewrite that never applied (a probe's finding)."""
    from apt_model.compile.step import softmax_callers

    assert softmax_callers(CTCHead()) == []

    def masked_softmax(s, m):
        return s.masked_fill(~m, float("-inf")).softmax(-1)

    class Masked(nn.Module):  # attention through a helper whose name holds "softmax" (a review probe's case)
        def forward(self, s, m):
            return masked_softmax(s, m)

    assert softmax_callers(Masked()) == ["Masked"]

    class Commented(nn.Module):
        def forward(self, x):
            """Log-softmax scores for CTC."""
            return F.log_softmax(x, -1)  # CrossEntropyLoss applies the softmax: no attention here

    assert softmax_callers(Commented()) == []  # comments and docstrings are no calls
    vb.enable("balanced", mixed_precision="off", banner=False)
    CTCHead().to("cpu")
    feature = vb.get_report()["models"][0]["features"]["compile"]
    assert feature["chosen"] == "eager" and "no module's forward calls softmax" in feature["reason"], feature


@pytest.mark.parametrize("mode", ["balanced", "performance"])
def test_a_model_trained_through_the_scripts_compiled_step_is_traced_without_the_ladder(mode, cpu_device):
    """The script moves its model (adopted, ladder on trial) and trains it only through a function it
    compiles itself. Traced there, the ladder's hooks used to break the script's graph (on
    ``time.perf_counter`` and on the rung's own ``torch.compile``) and compile a rung inside the
    trace; now the model's own forward is traced, in one graph, and no rung starts. The first eager
    optimizer step over its parameters concludes ``eager`` (it was ``on trial`` for ever)."""
    import torch._dynamo.testing

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    m = model()
    counts = torch._dynamo.testing.CompileCounter()
    vb.enable(mode, paging="off", mixed_precision="off", banner=False)
    try:
        m.to("cpu")
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)

        @torch.compile(backend=counts)
        def loss_of(x):
            return F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1))

        gen = torch.Generator().manual_seed(0)
        for _ in range(8):
            x = torch.randint(0, 256, (4, 32), generator=gen)
            opt.zero_grad()
            loss = loss_of(x)
            loss.backward()
            opt.step()
        rec = vb.get_report()["models"][0]
    finally:
        vb.disable()
        torch._dynamo.reset()
    assert rec["trigger"] == "to()" and rec["features"]["compile"]["chosen"] == "eager", rec["features"]["compile"]
    assert "only inside code the script compiles" in rec["features"]["compile"]["reason"]
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    assert counts.frame_count == 1 and torch.isfinite(loss)
    assert rec["timeline"] == [], rec["timeline"]  # no rung was built, warmed up or timed
    # one frame: concluding left the (now inert) hooks, which the compiled code guards on, in place


def test_the_step_recorder_adds_no_graph_break_to_a_compiled_optimizer_step(cpu_device):
    """The report's step recorder times each optimizer step from global step hooks. Traced inside
    a step the script compiles, its clock read broke the graph, and Dynamo ran the optimizer's
    whole step wrapper eagerly. Now it stays out of traced code: the script's compiled step breaks
    exactly where it breaks without the switch."""
    def breaks_of_a_compiled_step() -> dict:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch.manual_seed(0)
        m = nn.Linear(8, 8)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        step = torch.compile(opt.step, backend="eager")
        for _ in range(2):
            m(torch.ones(2, 8)).sum().backward()
            step()
        return {str(k): v for k, v in torch._dynamo.utils.counters["graph_break"].items()}

    plain = breaks_of_a_compiled_step()
    vb.enable("balanced", paging="off", mixed_precision="off", banner=False)
    try:
        on = breaks_of_a_compiled_step()
    finally:
        vb.disable()
        torch._dynamo.reset()
    assert on == plain, (on, plain)


_TO_IN_COMPILED = """
import torch
import apt_model.optimization.vb_global as vb
vb.enable("balanced", mixed_precision="off", compile="off", banner=False)
def f(x):
    return x.to(torch.float64).to("cuda") * 2  # 'cuda' goes to the selected device here
y = torch.compile(f, fullgraph=True, backend="eager")(torch.ones(2))
print(y.dtype, y.device.type, y.tolist())
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="Tensor.to is replaced only where CUDA is absent")
def test_tensor_to_inside_a_scripts_compiled_code_is_no_graph_break(cpu_device):
    """Where CUDA is absent the switch replaces ``Tensor.to`` (``.to('cuda')`` goes to the selected
    device). Dynamo, imported after that, knew the original by neither name: every ``.to()`` in a
    script's compiled forward was a graph break (2.3x its step time; ``fullgraph=True`` raised). In
    a fresh interpreter, so that Dynamo is imported after ``enable()`` as in a script."""
    from conftest import clean_env, run_python

    proc = run_python(_TO_IN_COMPILED, env=clean_env(VB_DEVICE="cpu"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[-2] == "torch.float64 cpu [2.0, 2.0]", proc.stdout


class _SoftmaxAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x).chunk(3, -1)
        return torch.softmax(q @ k.transpose(-2, -1) / 4.0, -1) @ v


def test_the_forward_the_ladder_puts_on_a_model_has_the_models_signature():
    """The ladder replaces ``model.forward`` with its dispatcher, whose signature was
    ``(*args, **kwargs)``: Hugging Face's Trainer, which reads ``inspect.signature(model.forward)``,
    then passed ``num_items_in_batch`` to a custom model without it (TypeError) or dropped every
    input column as unused (a probe's finding, default balanced mode)."""
    import inspect

    vb.enable("balanced", mixed_precision="off", banner=False)
    model = _SoftmaxAttention().to("cpu")
    assert type(model.forward).__name__ == "LadderForward"  # the override rung is offered: softmax
    assert str(inspect.signature(model.forward)) == "(x, mask=None)"


def _halved(module, x, mask=None):
    return type(module).forward(module, x, mask) * 0.5


def test_a_copy_of_a_model_with_its_own_instance_forward_runs_that_forward():
    """A copy (``copy.deepcopy``) of a model the ladder climbs gets an eager forward: it was the
    class's, so a model whose forward the script set on the instance (a wrapper, accelerate's
    hook) ran another function in its copy (a probe's finding, full mode)."""
    import copy
    import functools

    vb.enable("balanced", mixed_precision="off", banner=False)
    torch.manual_seed(0)
    model = _SoftmaxAttention()
    model.forward = functools.partial(_halved, model)
    model.to("cpu")
    assert type(model.forward).__name__ == "LadderForward"
    x = torch.randn(2, 4, 16)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(twin(x), _halved(model, x)) and torch.equal(model(x), _halved(model, x))
    vb.disable()
    assert isinstance(model.forward, functools.partial)  # the script's own, back


def test_a_script_that_compiles_two_models_itself_steps_in_full_mode():
    """Each model's ladder concluded eager at the first optimizer step and removed its own step
    hook while torch iterated over the step hooks: "OrderedDict mutated during iteration" when a
    second ladder's hook followed (a probe's finding)."""
    import torch.optim.optimizer as optimizer_mod

    vb.enable("full", mixed_precision="off", banner=False)
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(32, 64), nn.ReLU()).to("cpu")
    head = nn.Linear(64, 4).to("cpu")
    cenc, chead = torch.compile(enc, backend="eager"), torch.compile(head, backend="eager")
    opt = torch.optim.SGD(list(enc.parameters()) + list(head.parameters()), lr=0.05)
    x, y = torch.randn(8, 32), torch.randn(8, 4)
    for _ in range(3):
        loss = F.mse_loss(chead(cenc(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    chosen = [m["features"]["compile"]["chosen"] for m in vb.get_report()["models"]]
    assert chosen == ["eager", "eager"], chosen
    hooks = len(optimizer_mod._global_optimizer_post_hooks)
    enc(x)  # the next call removes the spent step hook
    assert len(optimizer_mod._global_optimizer_post_hooks) == hooks - 1


def test_a_model_with_the_scripts_hooks_inside_gets_no_rung_and_its_hooks_all_run():
    """A probe's script (a forward hook recording an activation, a full backward hook, and at step
    30 a new forward hook and a pre-hook halving an input) trained differently once balanced mode
    kept the override rung: torch.compile traces submodule hooks once and never sees later ones.
    With hooks inside at adoption the ladder is not climbed; a hook added later on a model whose
    rung is on trial sends it back to eager, and every hook runs at every call."""
    vb.enable("balanced", **FAST_TRIAL)
    m = model()
    seen = []
    m.blocks[0].mlp.register_forward_hook(lambda mod, i, o: seen.append(1))
    m.to("cpu")
    train(m, 1 + READY_AFTER)  # looked at when the rung would start: after the script's first backward calls
    feature = vb.get_report()["models"][0]["features"]["compile"]
    assert feature["chosen"] == "eager" and "forward hook on blocks.0.mlp" in feature["reason"], feature
    assert len(seen) == 1 + READY_AFTER

    m2 = model()
    m2.to("cpu")
    train(m2, 4 + READY_AFTER)  # after the script's first backward calls the rung warms up, its trial starts
    assert vb.get_report()["models"][1]["features"]["compile"]["chosen"] == "on trial"
    late = []
    m2.blocks[1].attn.register_forward_pre_hook(lambda mod, a: late.append(1))
    feature = vb.get_report()["models"][1]["features"]["compile"]
    assert feature["chosen"] == "eager" and "the script registered a forward pre-hook on TextbookAttention" in feature["reason"], feature
    train(m2, 3)
    assert len(late) == 3


class SoftmaxNet(nn.Module):
    """Hand-written attention (the override rung's case) in a class a sweep makes many of."""

    def __init__(self):
        super().__init__()
        self.qkv, self.head = nn.Linear(32, 96), nn.Linear(32, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.head(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)


def test_a_sweep_of_one_class_leaves_dynamo_room_for_the_scripts_own_compile(caplog):
    """Each model's rung compiles the class's one forward with a backend of its own: in a region
    of its own (``isolate_recompiles``), so a sweep of more models than ``recompile_limit`` (8)
    neither runs out of room for its later models' rungs nor leaves the script's own
    ``torch.compile`` of that class running eagerly (until 2026-11-28 it did, after ``disable()``
    too: a probe's finding)."""
    import logging

    limit = torch._dynamo.config.recompile_limit
    vb.enable("balanced", paging="off", mixed_precision="off", banner=False)
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        for seed in range(limit + 1):
            torch.manual_seed(seed)
            m = SoftmaxNet()
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            for _ in range(3):
                m(torch.randn(2, 4, 32)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            del m, opt
            gc.collect()
        rungs = [r["features"]["compile"]["chosen"] for r in vb.get_report()["models"]]
        vb.disable()
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(len(gm.graph.nodes))
            return gm.forward

        torch.manual_seed(0)
        m = torch.compile(SoftmaxNet(), backend=backend)
        m(torch.randn(2, 4, 32)).sum().backward()
    assert len(rungs) == limit + 1 and len(set(rungs)) == 1, rungs  # the last model's ladder as the first's
    assert graphs, "the script's own torch.compile ran eagerly"
    assert not any("recompile_limit" in r.getMessage() for r in caplog.records)


def test_models_evaluated_and_dropped_leave_no_optimizer_step_hooks():
    """A ladder watches optimizer steps (through a global hook that holds it weakly) until its
    model's first step; models only evaluated and dropped left one dead hook each, called at every
    later step of the session (until 2026-11-28: a probe's finding)."""
    from torch.optim.optimizer import _global_optimizer_post_hooks as post

    vb.enable("balanced", paging="off", mixed_precision="off", banner=False)
    for _ in range(5):
        m = SoftmaxNet().eval()
        with torch.no_grad():
            m(torch.randn(2, 4, 32))
        del m
        gc.collect()
    ladders = [r["features"]["compile"]["chosen"] for r in vb.get_report()["models"]]
    hooks = sum(1 for h in post.values() if type(h).__module__ == "apt_model.compile.ladder")
    assert ladders == ["on trial"] * 5, ladders  # each got a ladder (its trial never ran: no training)
    assert hooks <= 1, hooks  # the last model's, removed when the next ladder is made


class _Profiled(SoftmaxNet):
    """Hand-written attention whose forward marks a profiler range."""

    def forward(self, x):
        with torch.profiler.record_function("attention"):
            return super().forward(x)


def _softmax_steps(m, steps, seed=0):
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = m(torch.randn(4, 8, 32, generator=gen)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_a_model_that_marks_profiler_ranges_gets_no_rung_and_the_profiler_pauses_the_ladder():
    """Dynamo drops ``record_function`` from a captured graph: a model's own profiler ranges
    vanished from the script's profiles once the override rung captured it. And a rung started
    under ``torch.profiler`` captured code there (with ``with_stack=True`` the profile could not be
    read: UnicodeDecodeError) and was timed with the profiler's cost: the ladder waits while one
    records (probes' findings)."""
    vb.enable("balanced", mixed_precision="off", attention="off", banner=False)
    torch.manual_seed(0)
    marked = _Profiled().to("cpu")
    feature = vb.get_report()["models"][0]["features"]["compile"]
    assert feature["chosen"] == "eager" and "record_function" in feature["reason"], feature
    torch.manual_seed(0)
    plain = SoftmaxNet().to("cpu")
    with torch.profiler.profile() as prof:
        _softmax_steps(plain, 4 + READY_AFTER)
    ladder = plain.forward.ladder
    assert ladder.state == "waiting" and ladder.timeline == [] and len(prof.events()) > 0
    _softmax_steps(plain, 4 + READY_AFTER)  # no profiler: the rung warms up and is tried
    assert ladder.state in ("warmup", "trial", "done")
    _softmax_steps(marked, 4 + READY_AFTER)
    with torch.profiler.profile() as prof:
        _softmax_steps(marked, 2)
    assert [e.name for e in prof.events()].count("attention") >= 2  # its ranges are in the profile
    torch._dynamo.reset()


def test_hooks_a_summary_tool_removes_before_training_do_not_keep_the_model_eager():
    """torchinfo's ``summary`` calls the model first, with a hook on every module, then removes
    them: the model was decided eager at that adoption, for good, its reason naming hooks long
    gone (a probe's finding). Hooks are looked at when a rung would start."""
    vb.enable("balanced", **FAST_TRIAL)
    m = model()
    handles = [mod.register_forward_hook(lambda *a: None) for mod in m.modules()]
    with torch.no_grad():
        m(torch.randint(0, 256, (1, 32)))  # the summary's call: adopts the model
    for h in handles:
        h.remove()
    train(m, 4 + READY_AFTER)
    feature = vb.get_report()["models"][0]["features"]["compile"]
    assert feature["chosen"] == "on trial" and "hook" not in feature["reason"], feature
    assert m.forward.ladder.state in ("warmup", "trial", "done")
    vb.disable()
    torch._dynamo.reset()


class AttentionPair(nn.Module):
    """Hand-written attention (the override rung's rewrite) beside an ``nn.MultiheadAttention``
    (routed to SDPA by the attention step, through a forward pre-hook Dynamo inlines)."""

    def __init__(self, d=64):
        super().__init__()
        self.qkv, self.mha, self.out = nn.Linear(d, 3 * d), nn.MultiheadAttention(d, 2, batch_first=True), nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        x = x + torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v
        o, _ = self.mha(x, x, x)
        return self.out(x + o)


def test_the_routed_attention_hook_does_not_make_the_rung_recompile_at_every_step():
    """The routed ``nn.MultiheadAttention``'s pre-hook read the graph-reuse watch's backward count,
    which changes at every backward: Dynamo, inlining the hook, guarded on it and recaptured the
    override rung at every step up to its recompile limit (8 captures, then eager calls judged
    against eager: a 1.9x rewrite reported "not faster"; a probe's finding). It reads a flag that
    flips once now: one capture."""
    vb.enable("balanced", compile_trial_calls=8, mixed_precision="off", banner=False)
    torch.manual_seed(0)
    m = AttentionPair().to("cpu")
    opt = torch.optim.AdamW(m.parameters(), 1e-3)
    x = torch.randn(8, 16, 64)
    for _ in range(STEPS):
        loss = m(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    rec = vb.get_report()["models"][0]
    assert rec["features"]["attention"]["chosen"] != "as written", rec["features"]["attention"]
    (entry,) = rec["timeline"]
    assert entry["rung"] == "override" and entry["compiles"] == 1, entry


def test_a_kept_override_rung_takes_another_batch_size_in_training_and_evaluation():
    """Once the override rung was kept, a call with another batch size (an evaluation batch, an
    epoch's last short batch) made Dynamo recapture the model with a symbolic batch size, and the
    rewrite's check ran the captured graph eagerly with that symbol: "SymIntArrayRef expected to
    contain only concrete integers" raised into the script's call (a probe's finding). The check
    runs with the sizes of the call now; outputs are plain PyTorch's within SDPA's rounding."""
    vb.enable("balanced", compile_trial_calls=8, compile_min_speedup=0.01, mixed_precision="off",
              attention="off", banner=False)
    torch.manual_seed(0)
    m = TinyLM().to("cpu")
    train(m, STEPS)
    reference = TinyLM()
    reference.load_state_dict(m.state_dict())  # the trained weights, run eagerly without the switch's rung
    gen = torch.Generator().manual_seed(2)
    rec = vb.get_report()["models"][0]
    assert rec["features"]["compile"]["chosen"] == "override", rec["features"]["compile"]
    compiles = rec["timeline"][-1]["compiles"]
    short = torch.randint(0, 256, (3, 32), generator=gen)
    out = m(short)  # a training call with another batch size
    out.sum().backward()
    assert torch.allclose(out, reference(short), rtol=1e-4, atol=1e-5)
    # the report counts that recapture in the kept rung's entry (it kept the verdict's counts before)
    kept = vb.get_report()["models"][0]["timeline"][-1]
    assert kept["outcome"] == "kept" and kept["compiles"] == compiles + 1, (compiles, kept)
    m.eval()
    reference.eval()
    with torch.no_grad():
        x = torch.randint(0, 256, (2, 32), generator=gen)
        assert torch.allclose(m(x), reference(x), rtol=1e-4, atol=1e-5)
    # the recaptured graph was checked and used: the rung was not given up (a compiled call that
    # fails runs as written and gives its rung up, which would hide a check that raises)
    assert vb.get_report()["models"][0]["features"]["compile"]["chosen"] == "override"


def test_after_a_rung_is_kept_evaluation_runs_as_written_and_a_bad_input_raises_eagers_error():
    """A kept rung served every later call. Evaluation and generation (no grad, eval mode: the
    trial timed training calls only) were compiled afresh for each grad mode and decoding shape:
    nanoGPT's ``generate`` took 1-5 s against 0.02 s plain (a probe's finding). And a too-long
    sequence made Dynamo re-trace and raise its ``TorchRuntimeError`` from the fake-tensor trace,
    which a script's ``except`` for the error plain PyTorch raises did not catch. Evaluation runs
    as written now, and a compiled call that fails runs as written: its error is the model's."""
    vb.enable("balanced", compile_trial_calls=8, compile_min_speedup=0.01, mixed_precision="off",
              attention="off", banner=False)
    torch.manual_seed(0)
    m = TinyLM().to("cpu")
    train(m, STEPS)
    assert vb.get_report()["models"][0]["features"]["compile"]["chosen"] == "override"
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    m.eval()
    with torch.no_grad():
        idx = torch.randint(0, 256, (1, 4))
        for _ in range(6):  # decoding: a token at a time, a new length at each call
            idx = torch.cat([idx, m(idx)[:, -1:].argmax(-1)], 1)
    with torch.inference_mode():
        m(idx)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # nothing compiled for them
    m.train()
    too_long = torch.randint(0, 256, (2, 40))  # the causal mask buffer holds 32 positions
    with pytest.raises(RuntimeError) as raised:
        m(too_long)
    assert type(raised.value) is RuntimeError, raised.value  # eager's error, not Dynamo's subclass
    loss = train(m, 2)[-1]  # the rung is kept: the model trains on
    assert math.isfinite(loss) and vb.get_report()["models"][0]["features"]["compile"]["chosen"] == "override"


class CountingLM(TinyLM):
    """TinyLM that counts its calls in a ``Parameter`` (``requires_grad=False``) updated in forward."""

    def __init__(self):
        super().__init__()
        self.calls = nn.Parameter(torch.zeros(()), requires_grad=False)

    def forward(self, idx):
        self.calls.add_(1)
        return super().forward(idx)


def test_the_override_check_does_not_run_a_parameters_in_place_update_again():
    """The override rung checks a rewrite by running the captured graph and the rewritten one on
    the call's inputs, parameters shared. A count kept in a ``Parameter`` and updated in forward
    was updated twice more at every capture (106 for 100 calls with three captures; a running mean
    drifted: a probe's finding). Inputs the graph changes in place are cloned for the check."""
    from apt_model.compile.overrides import changed_in_place

    vb.enable("balanced", compile_trial_calls=8, compile_min_speedup=0.01, mixed_precision="off",
              attention="off", banner=False)
    torch.manual_seed(0)
    m = CountingLM().to("cpu")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    calls = 0
    for step in range(STEPS + 4):
        batch = 4 if step < STEPS else 3 + step % 2  # new batch sizes after the verdict: captures again
        x = torch.randint(0, 256, (batch, 32), generator=gen)
        loss = F.cross_entropy(m(x).reshape(-1, 256), x.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        calls += 1
    assert vb.get_report()["models"][0]["features"]["compile"]["chosen"] == "override"
    assert m.calls.item() == calls

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def fn(p, x, y):
        p.view(-1).add_(1)  # through a view
        y[0] = 2.0  # setitem
        h = torch.relu(x * 2)
        h.relu_()  # on an intermediate: no input changed
        return h + p.sum() + y.sum()

    torch._dynamo.reset()
    torch.compile(fn, backend=capture)(torch.zeros(2), torch.ones(3), torch.zeros(2))
    (gm,) = graphs
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert {names[i] for i in changed_in_place(gm)} == {"l_p_", "l_y_"}, (names, gm.code)  # not x


class NoisyLM(TinyLM):
    """TinyLM that injects noise into its embeddings while training (a random draw in forward)."""

    def forward(self, idx):
        h = self.emb(idx)
        if self.training:
            h = h + 0.01 * torch.randn_like(h)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_a_forward_that_draws_random_numbers_passes_the_override_check():
    """The check runs the captured and the rewritten graph one after the other: a forward that
    draws random numbers drew other ones in each, so every such model failed it ("output 0 differs
    by up to 0.0459", blaming the rewrite; a probe's finding). Both runs start from one random
    state now; the script's own stream is as without the switch."""
    vb.enable("balanced", compile_trial_calls=8, compile_min_speedup=0.01, mixed_precision="off",
              attention="off", banner=False)
    torch.manual_seed(0)
    m = NoisyLM().to("cpu")
    train(m, STEPS)
    rec = vb.get_report()["models"][0]
    assert rec["features"]["compile"]["chosen"] == "override", rec["timeline"]


class SplitLM(TinyLM):
    """A model the script trains through its parts, as timm's ``forward_features`` / ``forward_head``."""

    def forward_features(self, idx):
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return h

    def forward_head(self, h):
        return self.head(h)


def test_a_model_trained_through_its_parts_is_reported_as_such():
    """A script calling ``model.forward_features`` then ``model.forward_head`` never calls the model:
    the report said "trained only inside code the script compiles itself" for a script that compiles
    nothing, and bf16 for a model whose calls never ran under it (a probe's finding with timm). The
    reason names both possibilities now, and the call counts show no call under autocast."""
    vb.enable("balanced", mixed_precision="bf16", attention="off", banner=False)
    torch.manual_seed(0)
    m = SplitLM().to("cpu")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, 256, (4, 32), generator=gen)
        loss = F.cross_entropy(m.forward_head(m.forward_features(x)).reshape(-1, 256), x.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    features = vb.get_report()["models"][0]["features"]
    assert "through its parts called by the script" in features["compile"]["reason"], features["compile"]
    assert features["mixed_precision"]["calls"]["autocast"] == 0, features["mixed_precision"]
