"""What enabling does to a model: adoption, parameter identity, routing, autocast, redirection."""
import collections
import copy
import io

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from apt_model.models.gpt import GPT, GPTConfig


def tiny_gpt(attn="eager", seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=2, dropout=0.1, attn_implementation=attn))


def train_steps(model, opt, steps=5, seed=1, fixed_batch=False):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout masks
    losses = []
    x = torch.randint(0, 256, (4, 32), generator=gen)
    for _ in range(steps):
        if not fixed_batch:
            x = torch.randint(0, 256, (4, 32), generator=gen)
        loss = F.cross_entropy(model(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def test_optimizer_built_before_enable_keeps_training_the_same_tensors():
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids_before = [id(p) for p in model.parameters()]
    vb.enable("balanced", attention="sdpa", mixed_precision="bf16", banner=False)
    model = model.to("cpu")
    assert [id(p) for p in model.parameters()] == ids_before
    assert [id(p) for g in opt.param_groups for p in g["params"]] == ids_before
    w0 = model.blocks[0].mlp[0].weight.detach().clone()
    losses = train_steps(model, opt, steps=8, fixed_batch=True)
    assert not torch.equal(model.blocks[0].mlp[0].weight, w0)  # the optimizer updated the live weight
    assert losses[-1] < losses[0]
    assert vb.get_stats()["autocast_calls"] == 8


def test_adopted_model_equals_plain_model_when_no_optimization_applies():
    """fp32, CPU, deterministic: a model with nothing to route and autocast off trains bit-identically."""
    plain = tiny_gpt(attn="sdpa")
    ref = train_steps(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3))
    adopted = tiny_gpt(attn="sdpa")
    vb.enable("balanced", mixed_precision="off", banner=False)
    adopted.to("cpu")
    got = train_steps(adopted, torch.optim.AdamW(adopted.parameters(), lr=1e-3))
    assert vb.get_report()["models"][0]["features"]["attention"]["reason"].startswith("already fused")
    assert got == ref
    for a, b in zip(plain.parameters(), adopted.parameters()):
        assert torch.equal(a, b)


def test_eager_attention_routed_to_sdpa_matches_eager():
    model = tiny_gpt().eval()
    x = torch.randint(0, 256, (2, 32))
    ref = model(x)
    vb.enable("balanced", attention="sdpa", mixed_precision="off", banner=False)
    model.to("cpu")
    out = model(x)
    assert all(b.attn.attn_implementation == "sdpa" for b in model.blocks)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    rec = vb.get_report()["models"][0]["features"]["attention"]
    assert rec["chosen"] == "sdpa" and "forced by attention=sdpa" in rec["reason"] and "blocks.1.attn" in rec["reason"]


def test_decisions_follow_the_probe_and_thresholds():
    model = tiny_gpt()
    vb.enable("balanced", autocast_min_speedup=99.0, sdpa_min_speedup=99.0, banner=False)
    model.to("cpu")
    feats = vb.get_report()["models"][0]["features"]
    assert feats["mixed_precision"]["chosen"] == "fp32" and "threshold 99.00x" in feats["mixed_precision"]["reason"]
    assert feats["attention"]["chosen"] == "as written" and "below the 99.00x threshold" in feats["attention"]["reason"]
    assert model.blocks[0].attn.attn_implementation == "eager" and not hasattr(model, "_vb_autocast")

    model2 = tiny_gpt()
    vb.enable("balanced", autocast_min_speedup=0.01, sdpa_min_speedup=0.01, banner=False)
    model2.to("cpu")
    feats = vb.get_report()["models"][0]["features"]
    assert feats["mixed_precision"]["chosen"] == "bf16"  # bf16 runs on every CPU torch supports
    assert feats["attention"]["chosen"] == "sdpa"
    speed = next(iter(vb.get_report()["capabilities"]["speed"].values()))
    assert speed["width"] == 64 and speed["autocast"]["bfloat16"]["speedup"] > 0


def test_auto_decision_is_consistent_with_the_measured_ratio():
    model = tiny_gpt()
    vb.enable("balanced", banner=False)
    model.to("cpu")
    rep = vb.get_report()
    speed = next(iter(rep["capabilities"]["speed"].values()))
    ratio = speed["autocast"]["bfloat16"].get("speedup", 0)
    chosen = rep["models"][0]["features"]["mixed_precision"]["chosen"]
    assert chosen == ("bf16" if ratio >= 1.10 else "fp32")
    att = rep["models"][0]["features"]["attention"]["chosen"]
    assert att == ("sdpa" if speed["attention"]["speedup"] >= 1.0 else "as written")


def _backward_calls(n: int) -> None:
    """``n`` backward calls of nothing in particular: the script's first backward calls, after
    which training calls of routed attention take SDPA (apt_model/base/graph_reuse.py)."""
    for _ in range(n):
        torch.ones(1, requires_grad=True).sum().backward()


def test_multihead_attention_takes_the_sdpa_path_unless_weights_are_asked_for():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True)
    q = torch.randn(2, 10, 32)
    ref_out, ref_w = mha(q, q, q)
    assert ref_w is not None
    vb.enable("balanced", attention="sdpa", mixed_precision="off", banner=False)
    mha.to("cpu")
    with torch.no_grad():
        assert mha(q, q, q)[1] is None  # no backward can follow: routed at once
    assert mha.eval()(q, q, q)[1] is None and mha.train() is mha  # nor in evaluation (eval mode)
    assert mha(q, q, q)[1] is not None  # a training call before the script's first backward calls
    _backward_calls(4)
    out, w = mha(q, q, q)
    assert w is None  # need_weights defaulted to False: the fused path
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-4)
    out2, w2 = mha(q, q, q, need_weights=True)
    assert w2 is not None and torch.allclose(w2, ref_w)
    # asking how the weights come back asks for them (a probe's finding: a loss on per-head maps)
    per_head = mha(q, q, q, average_attn_weights=False)[1]
    assert per_head is not None and per_head.shape == (2, 4, 10, 10)
    vb.disable()
    assert mha(q, q, q)[1] is not None


def test_a_bare_multihead_attention_adopted_at_its_first_call_keeps_returning_weights():
    """Adopted inside its first call, a bare ``nn.MultiheadAttention`` returned weights from that
    call (the hook cannot change its arguments) and ``None`` from every later one: a script that
    used them broke at its second call. Such a model is left as written now, and said so."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True)
    q = torch.randn(2, 10, 32)
    ref_out, ref_w = mha(q, q, q)
    vb.enable("balanced", attention="sdpa", mixed_precision="off", compile="off", banner=False)
    for _ in range(2):
        out, w = mha(q, q, q)
        assert w is not None and torch.equal(w, ref_w) and torch.equal(out, ref_out)
    rec = vb.get_report()["models"][0]
    assert rec["trigger"] == "first forward"
    assert rec["features"]["attention"]["chosen"] == "as written"
    assert "first call" in rec["features"]["attention"]["reason"]


class SelfAttention(nn.MultiheadAttention):
    """A user's subclass with a forward of its own (its signature has no ``need_weights``)."""

    def forward(self, x):
        return super().forward(x, x, x, need_weights=False)[0]


def test_a_multihead_attention_subclass_with_its_own_forward_is_left_as_written():
    """The routing hook gave every ``nn.MultiheadAttention`` a ``need_weights`` keyword, so a
    subclass whose forward takes only ``x`` raised ``TypeError: forward() got an unexpected keyword
    argument 'need_weights'`` (a probe's finding). Such a site is left as written now, and said so."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), SelfAttention(32, 4, batch_first=True), nn.Linear(32, 1))
    x = torch.randn(2, 5, 16)
    want = model(x).square().mean()
    vb.enable("balanced", attention="sdpa", mixed_precision="off", banner=False)
    got = model(x).square().mean()
    assert torch.equal(got, want)
    att = vb.get_report()["models"][0]["features"]["attention"]
    assert att["chosen"] == "as written" and "own forward" in att["reason"], att


def test_the_attention_of_torch_transformer_layers_gets_no_hook_and_keeps_the_fast_path():
    """``nn.TransformerEncoderLayer`` calls its attention with ``need_weights=False`` already; the
    routing hook on it did nothing useful and turned off the layer's inference fast path (eval
    outputs differed from plain PyTorch by up to 4.8e-7: a probe's finding)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        want = model(x)
    vb.enable("balanced", attention="sdpa", mixed_precision="off", compile="off", banner=False)
    with torch.no_grad():
        got = model(x)
        assert torch.equal(got, want) and torch.equal(model(x), want)
    assert all(not m._forward_pre_hooks for m in model.modules() if isinstance(m, nn.MultiheadAttention))
    att = vb.get_report()["models"][0]["features"]["attention"]
    assert att["chosen"] == "as written" and "already fused: 2" in att["reason"], att


def test_copies_of_a_routed_multihead_attention_act_as_plain_pytorch():
    """A copy of a routed ``nn.MultiheadAttention`` (``copy.deepcopy``, ``torch.save`` of the whole
    module) carried the routing hook for good: after ``disable()`` it still returned ``None``
    weights (a probe's finding). The hook acts only for the module the switch routed itself."""
    import copy
    import io

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True)
    q = torch.randn(2, 10, 32)
    vb.enable("balanced", attention="sdpa", mixed_precision="off", banner=False)
    mha.to("cpu")
    _backward_calls(4)
    assert mha(q, q, q)[1] is None
    twin = copy.deepcopy(mha)
    buf = io.BytesIO()
    torch.save(mha, buf)
    vb.disable()
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for m in (mha, twin, loaded):
        out, w = m(q, q, q)
        assert w is not None and w.shape == (2, 10, 10)


@pytest.mark.skipif(torch.cuda.is_available(), reason="redirection applies only where CUDA is absent")
def test_cuda_calls_go_to_the_selected_device_and_stop_after_disable():
    vb.enable("balanced", banner=False)
    model = nn.Linear(4, 4).cuda()
    t = torch.ones(3).cuda()
    t2 = torch.ones(3).to("cuda:0")
    assert model.weight.device.type == "cpu" and t.device.type == "cpu" and t2.device.type == "cpu"
    assert vb.get_stats()["cuda_redirects"] >= 3
    placement = vb.get_report()["models"][0]["features"]["placement"]["reason"]
    assert "redirected from cuda" in placement
    vb.disable()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.ones(1).cuda()


@pytest.mark.skipif(torch.cuda.is_available(), reason="redirection applies only where CUDA is absent")
def test_the_redirect_of_tensor_to_costs_a_plain_call_one_function(cpu_device):
    """``.to()`` of a plain tensor to a dtype, a non-CUDA device or a tensor makes no further call
    into apt_model (a step of a small model calls it for every batch tensor); ``"cuda"`` in any
    spelling is still redirected, and so is a lazy parameter's call."""
    import sys

    vb.enable("balanced", banner=False)
    x, calls = torch.ones(3), []

    def profile(frame, event, arg):
        if event == "call" and "apt_model" in frame.f_code.co_filename:
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        outs = [x.to("cpu"), x.to(torch.device("cpu")), x.to(torch.float64), x.to(x), x.to("cpu", torch.float16),
                x.to(torch.float16, non_blocking=True)]
    finally:
        sys.setprofile(None)
    assert calls == ["tensor_to"] * 6, calls
    assert [o.dtype for o in outs] == [torch.float32] * 2 + [torch.float64, torch.float32] + [torch.float16] * 2
    before = vb.get_stats()["cuda_redirects"]
    for target in ("cuda", "cuda:0", torch.device("cuda")):
        assert x.to(target).device.type == "cpu"
    assert x.to(device="cuda").device.type == "cpu" and x.to("cuda", torch.float64).dtype == torch.float64
    assert vb.get_stats()["cuda_redirects"] == before + 5
    if not torch.accelerator.is_available():  # an index (.to(local_rank)) is torch's accelerator's: absent here
        assert x.to(0).device.type == "cpu" and nn.Linear(2, 2).to(1).weight.device.type == "cpu"
        assert x.to(np.int64(0)).device.type == "cpu"  # a NumPy index, which torch takes as one
        assert vb.get_stats()["cuda_redirects"] == before + 8
    lazy = nn.LazyLinear(2)
    lazy.to("cuda")  # an uninitialized parameter's .to() is handed the original Tensor.to
    assert lazy(torch.ones(1, 3)).shape == (1, 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="redirection applies only where CUDA is absent")
def test_a_checkpoint_loaded_to_cuda_and_a_meta_model_made_on_cuda_go_to_the_selected_device(tmp_path):
    """A script written for CUDA loads its checkpoint with ``map_location="cuda"`` and builds a
    model on meta then ``to_empty(device="cuda")``: both failed under the switch with torch's own
    CUDA error (a probe's finding); they go to the selected device now, and not after disable()."""
    path = tmp_path / "ck.pt"
    torch.save({"w": torch.arange(4.0)}, path)
    vb.enable("balanced", banner=False)
    where = vb.device().type
    for location in ("cuda", torch.device("cuda", 0), {"cpu": "cuda:0"}):
        loaded = torch.load(path, map_location=location)["w"]
        assert loaded.device.type == where and torch.equal(loaded.cpu(), torch.arange(4.0)), location
    assert torch.load(path, "cuda")["w"].device.type == where  # map_location given by position
    meta = nn.Linear(4, 4, device="meta").to_empty(device="cuda")
    assert meta.weight.device.type == where
    vb.disable()
    with pytest.raises(RuntimeError):
        torch.load(path, map_location="cuda")



@pytest.mark.skipif(torch.cuda.is_available(), reason="redirection applies only where CUDA is absent")
def test_cuda_default_device_contexts_go_to_the_selected_device_and_factories_keep_their_identity():
    """A script written for CUDA builds its model in ``with torch.device("cuda"):`` or after
    ``torch.set_default_device("cuda")``: the first tensor made raised torch's CUDA error under the
    switch while every ``.to("cuda")`` was redirected. Factory functions themselves are left as
    torch's own (PyTorch's compilers look them up by identity), and disable() ends the redirect."""
    originals = (torch.zeros, torch.arange, torch.empty, torch.tensor)
    vb.enable("balanced", banner=False)
    where = vb.device().type
    before = vb.get_stats()["cuda_redirects"]
    with torch.device("cuda"):
        made = [torch.ones(2), nn.Linear(2, 2).weight, torch.arange(3)]
    assert [t.device.type for t in made] == [where] * 3
    torch.set_default_device("cuda")
    try:
        assert torch.get_default_device().type == where and torch.zeros(1).device.type == where
    finally:
        torch.set_default_device(None)
    assert vb.get_stats()["cuda_redirects"] == before + 2
    with torch.device("meta"):  # other devices pass through
        assert torch.zeros(1).is_meta
    assert (torch.zeros, torch.arange, torch.empty, torch.tensor) == originals
    vb.disable()
    with pytest.raises((RuntimeError, AssertionError)):  # torch's "Torch not compiled with CUDA enabled"
        with torch.device("cuda"):
            torch.zeros(1)

def test_a_module_put_into_an_adopted_model_is_that_models_own(cpu_device):
    """A head swapped in after the model's first call was adopted as a model of its own at its
    first call (inside the model's): a second entry in the report, and features run nested in the
    model's (its own mixed-precision trial). It is the model's part now, and the model's recorded
    parameter count follows; one moved with ``.to()`` before it was put in stays a model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(4, 8)
    vb.enable("balanced", mixed_precision="bf16", banner=False)
    model(x)
    model[2] = nn.Linear(16, 3)
    model.append(nn.Sequential(nn.Tanh(), nn.Linear(3, 2)))
    for _ in range(3):
        model(x).sum().backward()
    records = vb.get_report()["models"]
    assert [r["name"] for r in records] == ["Sequential"], records
    assert records[0]["parameters"] == sum(p.numel() for p in model.parameters()) == 8 * 16 + 16 + 16 * 3 + 3 + 3 * 2 + 2
    assert not hasattr(model[2], "_vb_autocast") and hasattr(model, "_vb_autocast")
    model._modules["2"] = nn.Linear(16, 3)  # no registration hook sees this (torch.ao's swaps, HF's replacements)
    for _ in range(3):
        model(x).sum().backward()
    assert [r["name"] for r in vb.get_report()["models"]] == ["Sequential"]
    moved = nn.Linear(2, 2).to("cpu")  # adopted by .to(), before it is put in
    model.append(moved)
    model(x)
    assert [r["name"] for r in vb.get_report()["models"]] == ["Sequential", "Linear"]


def test_a_model_that_is_never_moved_is_adopted_at_its_first_call():
    model = tiny_gpt().eval()
    x = torch.randint(0, 256, (2, 32))
    ref = model(x)
    vb.enable("balanced", mixed_precision="bf16", attention="off", banner=False)
    out = model(x)
    rec = vb.get_report()["models"][0]
    assert rec["trigger"] == "first forward" and rec["features"]["mixed_precision"]["chosen"] == "bf16"
    # the adopting call runs as written: had it raised under autocast, nothing could run it again
    # (the call wrapper is installed during it); autocast starts at the next call
    assert model._vb_autocast.calls == 0 and torch.equal(out, ref)
    out = model(x)
    assert out.dtype == torch.float32  # outputs converted back for the user's loss
    assert model._vb_autocast.calls == 1 and not torch.equal(out, ref)
    vb.disable()
    assert torch.equal(model(x), ref)  # plain fp32 again after disable


@pytest.mark.parametrize("move", [False, True])
def test_a_lazy_model_is_adopted_once_its_parameters_exist(move, tmp_path, cpu_device):
    """``nn.LazyLinear`` gets its parameters in its first forward. Adoption counted them there and
    raised "Attempted to use an uninitialized parameter" in every mode, and ``.to()`` of a lazy
    module raised it through the switch's ``Tensor.to`` (a probe's finding). The model is adopted
    at a later call now, as one model, and pages bitwise like plain training."""
    def run(switch: bool):
        torch.manual_seed(0)
        if switch:
            vb.enable("memory", swap_dir=str(tmp_path), paging="always", device_budget="16KB", mixed_precision="off",
                      compile="off", attention="off", banner=False)
        model = nn.Sequential(nn.LazyLinear(32), nn.ReLU(), nn.Linear(32, 2))
        if move:
            model = model.to("cpu")
        opt = None
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(4):
            x = torch.randn(8, 5, generator=gen)
            loss = model(x).square().mean()
            if opt is None:  # the parameters exist after the first call
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        models = [(m["name"], m["trigger"]) for m in vb.get_report()["models"]] if switch else None
        params = [p.detach().clone() for p in model.parameters()]
        vb.disable()
        return losses, params, models

    want, want_params, _ = run(False)
    got, got_params, models = run(True)
    assert got == want and all(torch.equal(a, b) for a, b in zip(got_params, want_params))
    assert models == [("Sequential", "first forward")], models


def test_torchscript_modules_run_and_a_trace_is_not_adopted_inside(tmp_path):
    """A ScriptModule (``torch.jit.load`` of a saved model, ``torch.jit.script``) refuses Python
    hooks: adopting it at its first call raised "register_forward_hook is not supported on
    ScriptModules". ``torch.jit.trace`` of a model never called before adopted it inside the
    trace: "Graphs differed across invocations" (both found by a probe). Script modules are left
    alone now; a trace adopts nothing, the model's first ordinary call does."""
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    torch.jit.save(torch.jit.script(net), str(tmp_path / "net.pt"))
    want = net(x)
    vb.enable("balanced", mixed_precision="off", compile="off", banner=False)
    loaded = torch.jit.load(str(tmp_path / "net.pt"))
    assert torch.equal(loaded(x), want)
    fresh = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    fresh.load_state_dict(net.state_dict())
    traced = torch.jit.trace(fresh.eval(), (x,))  # its check calls the model plainly too: adopted there
    assert torch.equal(traced(x), want) and torch.equal(fresh(x), want)
    assert [(m["name"], m["trigger"]) for m in vb.get_report()["models"]] == [("Sequential", "first forward")]


def test_explicit_adoption_mode():
    model = tiny_gpt()
    vb.enable("balanced", adopt="explicit", mixed_precision="bf16", banner=False)
    model.to("cpu")
    model(torch.randint(0, 256, (1, 8)))
    assert vb.get_stats()["adopted_models"] == 0
    assert vb.adopt(model) is model
    assert vb.get_stats()["adopted_models"] == 1 and hasattr(model, "_vb_autocast")


def test_user_autocast_is_respected():
    model = tiny_gpt()
    vb.enable("balanced", mixed_precision="bf16", banner=False)
    model.to("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randint(0, 256, (1, 8)))
    assert out.dtype == torch.bfloat16  # untouched: the script manages precision here
    assert model._vb_autocast.calls == 0


def test_an_amp_flag_off_in_the_script_leaves_the_switch_its_autocast():
    """``torch.autocast(device, enabled=args.amp)`` with the flag off is how scripts (and this
    project's own benchmark loop) say "no AMP": the switch's bf16 still applies there. Autocast
    keeps no record that would tell it from a section kept fp32 on purpose; a change that honoured
    it (2026-11-28) made the switch's bf16 unreachable for such scripts and was undone. An inner
    enabled context is the script's own."""
    model = tiny_gpt().eval()
    x = torch.randint(0, 256, (1, 8))
    ref = model(x)
    vb.enable("balanced", mixed_precision="bf16", attention="off", compile="off", banner=False)
    model.to("cpu")
    with torch.autocast("cpu", enabled=False):
        out = model(x)
        assert out.dtype == torch.float32 and not torch.equal(out, ref) and model._vb_autocast.calls == 1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inner = model(x)
    assert inner.dtype == torch.bfloat16 and model._vb_autocast.calls == 1


def test_evaluation_and_generation_without_grad_run_as_written():
    """The autocast trial times training calls; bf16 it kept was applied to every call, and at
    decoding shapes (a token at a time) it made generation 1.7-2x slower than plain fp32 (a
    probe's finding). A model in eval mode called without grad runs as written now: plain
    PyTorch's fp32 outputs. (In train mode a no_grad call may be a reentrant checkpoint's forward,
    whose recomputation must match it: it keeps the switch's setting.)"""
    model = tiny_gpt().eval()
    x = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        ref = model(x)
    vb.enable("balanced", mixed_precision="bf16", attention="off", compile="off", banner=False)
    model.to("cpu")
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    with torch.inference_mode():
        assert torch.equal(model(x), ref)
    assert model._vb_autocast.calls == 0
    assert not torch.equal(model(x), ref) and model._vb_autocast.calls == 1  # a call that builds a graph: bf16
    model.train()
    with torch.no_grad():  # as a reentrant checkpoint's forward runs: the switch's setting
        model(x)
    assert model._vb_autocast.calls == 2


def test_adopted_model_pickles_and_deepcopies():
    model = tiny_gpt()
    vb.enable("balanced", attention="sdpa", mixed_precision="bf16", banner=False)
    model.to("cpu")
    x = torch.randint(0, 256, (1, 8))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    clone = copy.deepcopy(model)
    model.eval(), loaded.eval(), clone.eval()
    for copied in (loaded, clone):  # each copy is adopted at its first call, which runs as written
        copied(x)
        assert vb.get_report()["models"][-1]["trigger"] == "first forward"
    assert torch.equal(loaded(x), model(x)) and torch.equal(clone(x), model(x))


def test_print_stats_and_report(capsys):
    model = tiny_gpt()
    vb.enable("balanced", banner=False)
    model.to("cpu")
    vb.print_stats()
    text = capsys.readouterr().out
    assert "model GPT#1" in text and "attention" in text and "mixed_precision" in text
    rep = vb.get_report()
    assert {"version", "config", "device", "capabilities", "models", "decisions", "stats"} <= set(rep)
    from conftest import best_device

    assert rep["device"]["selection"]["device"] == best_device()  # the switch's choice, also with a GPU
    assert [d["feature"] for d in rep["decisions"]][:2] == ["mode", "device"]


def test_probing_directly_while_enabled_does_not_adopt_the_probe_block(monkeypatch):
    from apt_model.devices.capabilities import clear_capability_cache, get_speed

    monkeypatch.setenv("VB_PROBE_CACHE", "0")  # the probe block must really be built and run
    clear_capability_cache()
    vb.enable("balanced", banner=False)
    assert get_speed("cpu", 96).to_dict().get("cached") is not True
    get_speed("cpu", 96)  # runs a transformer block under the switch's global hook
    assert vb.get_stats()["adopted_models"] == 0


@pytest.mark.parametrize("paging", ["off", "always"])
def test_adopting_a_parametrized_model_leaves_its_state_alone(tmp_path, paging):
    """``spectral_norm`` updates its power-iteration buffers whenever its weight is read: adoption
    used to read ``m.weight`` (to infer the width) and so changed the model before training."""
    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        nn.utils.parametrizations.spectral_norm(m[0])
        return m

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    ref = build()
    m = build()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    vb.enable("balanced", swap_dir=str(tmp_path), paging=paging, device_budget="4KB", attention="off",
              mixed_precision="off", banner=False)
    try:
        m.to("cpu")
        after = m.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), [k for k in before if not torch.equal(before[k], after[k])]
        assert torch.equal(m(x), ref(x))
    finally:
        vb.disable()


def test_an_optimizer_stepping_no_adopted_model_is_told_once(caplog, cpu_device):
    """A model first called inside a compiled function that reaches it where the switch does not
    look (an attribute of an argument's attribute), never moved with ``.to()``, is not adopted: the switch does
    nothing for it. The optimizer's first step says so, once (a warning and a report decision
    naming the workaround); an optimizer over an adopted model's parameters gets no such entry."""
    from types import SimpleNamespace

    torch._dynamo.reset()
    lonely, moved = tiny_gpt(), tiny_gpt(seed=1)
    vb.enable("balanced", attention="off", mixed_precision="off", compile="off", banner=False)
    try:
        moved.to("cpu")
        opt_lonely = torch.optim.SGD(lonely.parameters(), lr=0.1)
        opt_moved = torch.optim.SGD(moved.parameters(), lr=0.1)

        @torch.compile(backend="eager")
        def loss_of(holder, x):
            return F.cross_entropy(holder.inner.model(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1))

        x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        with caplog.at_level("WARNING", logger="apt_model.switch.controller"):
            for _ in range(3):
                for m, opt in ((lonely, opt_lonely), (moved, opt_moved)):
                    opt.zero_grad()
                    loss_of(SimpleNamespace(inner=SimpleNamespace(model=m)), x).backward()
                    opt.step()
        report = vb.get_report()
    finally:
        vb.disable()
        torch._dynamo.reset()
    told = [d for d in report["decisions"] if d["feature"] == "adoption"]
    assert [m["name"] for m in report["models"]] == ["GPT"]  # the moved one only
    assert len(told) == 1 and told[0]["chosen"] == "no model for this optimizer", told
    n = len(list(lonely.parameters()))
    assert f"SGD steps {n} parameter tensors of no adopted model" in told[0]["reason"]
    assert "model.to(device) after enable()" in told[0]["reason"]
    warned = [r for r in caplog.records if "of no adopted model" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelname == "WARNING"


def test_an_optimizer_of_bare_tensors_is_noted_without_a_warning(caplog, cpu_device):
    """SAC's learnable temperature (``log_alpha = torch.zeros(1, requires_grad=True)``) has an
    optimizer of its own; the switch warned that it "steps parameter tensors of no adopted model"
    and told the user to adopt a model there is none of (a probe's finding). Tensors that are no
    ``nn.Parameter`` are noted in the report only."""
    log_alpha = torch.zeros(1, requires_grad=True)
    vb.enable("balanced", attention="off", mixed_precision="off", compile="off", banner=False)
    try:
        opt = torch.optim.Adam([log_alpha], lr=0.1)
        with caplog.at_level("WARNING", logger="apt_model.switch.controller"):
            for _ in range(3):
                opt.zero_grad()
                (log_alpha * 2.0).sum().backward()
                opt.step()
        told = [d for d in vb.get_report()["decisions"] if d["feature"] == "adoption"]
    finally:
        vb.disable()
    assert not [r for r in caplog.records if "no adopted model" in r.getMessage()]
    assert len(told) == 1 and "no nn.Parameter of a module" in told[0]["reason"], told


def test_enable_between_a_forward_and_its_step_warns_of_nothing(caplog, cpu_device):
    """``enable()`` called after a forward, before its step: the model is adopted at its next
    forward, so the first step over its parameters is no sign of a model the switch misses (it
    warned "no adopted model" there)."""
    m = tiny_gpt()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1))
    with caplog.at_level("WARNING", logger="apt_model.switch.controller"):
        vb.enable("balanced", attention="off", mixed_precision="off", compile="off", banner=False)
        loss.backward()
        opt.step()
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1)).backward()
            opt.step()
    report = vb.get_report()
    assert [r["name"] for r in report["models"]] == ["GPT"]
    assert not [d for d in report["decisions"] if d["feature"] == "adoption"]
    assert not [r for r in caplog.records if "of no adopted model" in r.getMessage()]


def test_parametrizations_are_never_adopted_as_models_of_their_own(cpu_device):
    """``spectral_norm`` calls its parametrization while the layer is built, and every read of a
    parametrized weight calls a ``ParametrizationList``: with the switch on first, each was
    adopted as a model of its own (report entries, features applied to torch's internals)."""
    from torch.nn.utils.parametrizations import spectral_norm, weight_norm

    vb.enable("balanced", compile="off", mixed_precision="off", banner=False)
    try:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), spectral_norm(torch.nn.Linear(8, 8)),
                                weight_norm(torch.nn.Linear(8, 8)))
        m.to("cpu")
        m(torch.randn(2, 8)).sum().backward()
        models = [(r["name"], r["trigger"]) for r in vb.get_report()["models"]]
    finally:
        vb.disable()
    assert models == [("Sequential", "to()")]


def test_adopt_names_what_it_was_given_when_it_is_no_module(cpu_device):
    vb.enable("balanced", banner=False)
    try:
        with pytest.raises(TypeError, match="takes a torch.nn.Module, got torch.Tensor"):
            vb.adopt(torch.ones(2))
    finally:
        vb.disable()


def test_a_compiled_wrapper_of_an_adopted_model_is_not_a_second_model(cpu_device):
    """``torch.compile(model)`` after the model was adopted: its ``OptimizedModule`` was adopted
    again at its first call, the same parameters reported and counted twice."""
    vb.enable("balanced", compile="off", mixed_precision="off", banner=False)
    try:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to("cpu")
        compiled = torch.compile(m, backend="eager")
        compiled(torch.randn(2, 8)).sum().backward()
        models = [(r["name"], r["trigger"]) for r in vb.get_report()["models"]]
    finally:
        vb.disable()
    assert models == [("Sequential", "to()")]


def test_a_model_compiled_before_enable_is_reported_by_its_own_class(cpu_device):
    """``torch.compile(model)`` before ``enable()``: the report named the model
    ``OptimizedModule`` (torch's wrapper), not the class the script wrote."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    compiled = torch.compile(m, backend="eager")
    vb.enable("balanced", compile="off", mixed_precision="off", banner=False)
    try:
        compiled(torch.randn(2, 8)).sum().backward()
        names = [r["name"] for r in vb.get_report()["models"]]
    finally:
        vb.disable()
        torch._dynamo.reset()
    assert names == ["Sequential (compiled)"], names


class _Sliced(nn.Module):
    """Runs its layers as two slices of one nn.Sequential (a new Sequential at every call)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
        self.head = nn.ModuleList([nn.Linear(8, 8)])

    def forward(self, x):
        # slices; a Sequential of slices; a new parameterless layer among the model's own
        x = self.layers[2:](self.layers[:2](x))
        x = nn.Sequential(nn.Sequential(*self.layers[:1]), nn.Sequential(*self.layers[1:2]))(x)
        return nn.Sequential(self.head[0], nn.Identity())(x)


@pytest.mark.parametrize("moved", [True, False])
def test_slices_of_an_adopted_models_sequential_are_not_models_of_their_own(moved, cpu_device):
    """``self.layers[:2](x)`` makes a new nn.Sequential at every call: each was adopted as a model,
    so every step adopted two more and the step time grew without bound (a probe: 0.5 ms plain,
    7.3 ms after 1600 steps, 3201 models in the report). Modules adopted on their own (an encoder
    and a decoder moved in ``__init__``) still make their container a model when it is called."""
    vb.enable("balanced", mixed_precision="off", compile="off", banner=False)
    torch.manual_seed(0)
    m = _Sliced()
    if moved:
        m.to("cpu")
    ref = _Sliced()
    ref.load_state_dict(m.state_dict())
    for net in (m, ref):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        torch.manual_seed(1)
        for _ in range(5):
            net(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert [r["name"] for r in vb.get_report()["models"]] == ["_Sliced", "_Sliced"]  # m and ref, no slice
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters()))

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.dec = nn.Linear(8, 8).to("cpu"), nn.Linear(8, 8).to("cpu")

        def forward(self, x):
            return self.dec(self.enc(x))

    Pair()(torch.randn(2, 8))
    assert [r["name"] for r in vb.get_report()["models"]][-3:] == ["Linear", "Linear", "Pair"]


class _ConfigLookup(nn.Module):
    """A model whose ``__getattr__`` looks missing names up in a dictionary and raises KeyError,
    as some configurable model classes do: plain PyTorch never asks it for a name it lacks."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.settings = {"scale": 1.0}

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):
                raise
        return self.settings[name]  # KeyError for anything else

    def forward(self, x):
        return self.net(x) * self.scale


@pytest.mark.parametrize("mode", ["balanced", "memory", "full"])
def test_a_model_whose_getattr_raises_key_error_trains_and_gets_every_feature(mode, cpu_device):
    """Until 2026-11-28 adoption read optional attributes (``module``, ``config``,
    ``running_mean``...) with getattr, and the model's KeyError crashed its first call."""
    def run():
        torch.manual_seed(0)
        model = _ConfigLookup()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return model

    ref = run()
    vb.enable(mode, mixed_precision="off", banner=False)
    try:
        got = run()
    finally:
        torch._dynamo.reset()  # full mode's compile ladder: a later session's fast path starts off otherwise
    (rec,) = vb.get_report()["models"]
    assert rec["name"] == "_ConfigLookup"
    assert not [name for name, f in rec["features"].items() if "error" in f], rec["features"]
    for a, b in zip(ref.parameters(), got.parameters()):
        assert torch.equal(a, b)


def test_a_feature_step_that_fails_is_undone_and_turned_off_for_that_model(monkeypatch, caplog, cpu_device):
    """A step raising something unforeseen must not reach the script: what it did so far is
    undone, the feature is off for that model with the error as its reason, the other features
    apply, and the log says so with the traceback."""
    from apt_model.quantization.step import FP4Step

    def failing_apply(self, model, ctx, patches, decision):
        patches.set_attr(model, "touched_by_fp4", True, label="test: a change before the failure")
        ctx.on_first_call(lambda *a: pytest.fail("a failed step's first-call hook ran"))
        raise RuntimeError("boom in the fp4 step")

    monkeypatch.setattr(FP4Step, "apply", failing_apply)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    model[0].requires_grad_(False)  # a frozen layer, big enough: FP4 storage acts on it in memory mode
    ref = copy.deepcopy(model)
    vb.enable("memory", mixed_precision="off", paging="off", banner=False)
    x = torch.randn(8, 256)
    with caplog.at_level("WARNING", logger="apt_model"):
        out = model(x)
    assert torch.equal(out, ref(x))
    assert "touched_by_fp4" not in model.__dict__
    assert type(model[0]) is nn.Linear
    fp4 = vb.get_report()["models"][0]["features"]["fp4"]
    assert fp4["chosen"] == "off" and fp4["error"] == "RuntimeError: boom in the fp4 step"
    assert "failed" in fp4["reason"]
    assert vb.get_report()["models"][0]["features"]["activation_offload"]["chosen"] != "off"
    warned = [r for r in caplog.records if "the fp4 step failed" in r.getMessage()]
    assert warned and warned[0].exc_info is not None
    vb.disable()
    assert "touched_by_fp4" not in model.__dict__


def _fail_once_after(cls, name, monkeypatch):
    """Make ``cls.name`` run as before and then raise RuntimeError, the first time only."""
    original, armed = getattr(cls, name), [True]

    def failing(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if armed[0]:
            armed[0] = False
            raise RuntimeError(f"injected after {cls.__name__}.{name}")
        return out

    monkeypatch.setattr(cls, name, failing)


def _train_small(model, steps=2, dim=64):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        loss = model(torch.randn(4, dim, generator=gen)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def test_a_feature_whose_apply_failed_is_off_for_the_rest_of_the_session(monkeypatch, caplog, tmp_path, cpu_device):
    """The undo closes what the failed apply made for the session (here the activation
    offloader); a later model must not be handed it (its first forward raised "cannot schedule new
    futures after shutdown": a review probe's finding). The feature is off for the session."""
    from apt_model.activations.step import OffloadStep

    _fail_once_after(OffloadStep, "apply", monkeypatch)
    vb.enable("memory", activation_offload=True, activation_budget="1KB", offload_min_bytes="1KB",
              swap_dir=str(tmp_path), paging="off", fp4="off", banner=False, mixed_precision="off")
    first = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    second = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    with caplog.at_level("WARNING", logger="apt_model"):
        _train_small(first)
        _train_small(second)
    a, b = (m["features"]["activation_offload"] for m in vb.get_report()["models"])
    assert a["chosen"] == "off" and "rest of the session" in a["reason"] and "injected" in a["error"]
    assert b["chosen"] == "off" and b["reason"].startswith("off for the rest of the session: applying it to Sequential")
    assert any("while applying it" in r.getMessage() for r in caplog.records)


def test_a_paging_apply_failure_reaches_the_script(monkeypatch, tmp_path, cpu_device):
    """Paging's session tables are not all on the undo stack: a failure halfway is not contained."""
    from apt_model.memory.paging.step import PagingStep

    _fail_once_after(PagingStep, "apply", monkeypatch)
    vb.enable("memory", paging="always", swap_dir=str(tmp_path), mixed_precision="off", banner=False)
    with pytest.raises(RuntimeError, match="injected after PagingStep.apply"):
        _train_small(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)))


def test_an_fp4_apply_that_fails_halfway_gives_every_weight_back_untouched(monkeypatch, cpu_device):
    """A failure after the first layer was converted: each weight was released as its layer was
    converted, so the rolled-back layer came back with FP4-rounded weights (a review probe's
    finding)."""
    from apt_model.quantization.linear import FP4Linear

    calls = []
    original = FP4Linear.register_state_dict_post_hook

    def failing(self, hook):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected at the second layer")
        return original(self, hook)

    monkeypatch.setattr(FP4Linear, "register_state_dict_post_hook", failing)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    x = torch.randn(8, 256)
    with torch.no_grad():
        expected = model(x)
    weights = [p.detach().clone() for p in model.parameters()]
    vb.enable("memory", paging="off", mixed_precision="off", activation_checkpointing=False, banner=False)
    assert torch.equal(model(x), expected)
    assert vb.get_report()["models"][0]["features"]["fp4"]["chosen"] == "off"
    assert all(type(m) in (nn.Linear, nn.ReLU) for m in model)
    for a, b in zip(model.parameters(), weights):
        assert torch.equal(a, b)


class _BareLinear(nn.Linear):
    """An nn.Linear subclass that skips nn.Linear.__init__ (no in_features / out_features)."""

    def __init__(self, n_in, n_out):
        nn.Module.__init__(self)
        self.weight = nn.Parameter(torch.randn(n_out, n_in) * 0.1)
        self.bias = nn.Parameter(torch.zeros(n_out))


@pytest.mark.parametrize("mode", ["balanced", "memory"])
def test_a_linear_subclass_without_in_features_is_adopted(mode, cpu_device):
    """Adoption read ``in_features`` of every nn.Linear for the model's width: AttributeError at
    the first forward of a model plain PyTorch trains (a probe's finding)."""
    torch.manual_seed(0)
    model = nn.Sequential(_BareLinear(8, 16), nn.ReLU(), _BareLinear(16, 2))
    x = torch.randn(4, 8)
    expected = model(x)
    vb.enable(mode, mixed_precision="off", banner=False)
    assert torch.equal(model(x), expected)
    assert vb.get_report()["models"][0]["name"] == "Sequential"


class _Permissive(_ConfigLookup):
    """A block whose ``__getattr__`` answers every public name it lacks with True (a config
    object's default)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.settings = collections.defaultdict(lambda: True, scale=1.0)


def test_blocks_that_answer_every_name_get_every_feature(cpu_device):
    """A permissive ``__getattr__`` made every block look checkpointed by the script already
    (Hugging Face's flag read as True) and the attention step fail ("argument of type 'bool' is
    not iterable"): a probe's findings."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), *[_Permissive() for _ in range(3)], nn.Linear(16, 2))
    vb.enable("memory", mixed_precision="off", activation_checkpointing=True, activation_offload=False, banner=False)
    model(torch.randn(4, 8)).sum().backward()
    features = vb.get_report()["models"][0]["features"]
    assert not [name for name, f in features.items() if "error" in f], features
    assert features["activation_checkpointing"]["chosen"] == "3/3 blocks", features["activation_checkpointing"]


def test_adoption_imports_nothing_of_the_switch_inside_the_script_s_steps():
    """torch.profiler's stack tracer (``with_stack=True``) kept pointers to the names of code
    objects freed while it recorded, such as an imported module's body: a model adopted inside a
    profiled step imported the probe cache's modules there, and ``key_averages()`` then raised
    UnicodeDecodeError (a probe's finding). ``enable()`` imports them."""
    import subprocess
    import sys

    from conftest import clean_env

    script = """
import sys, torch, torch.nn as nn
import apt_model.optimization.vb_global as vb
vb.enable("balanced", banner=False)  # its probes at adoption read and write the probe cache
before = set(sys.modules)
m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.AdamW(m.parameters())
for _ in range(3):
    loss = m(torch.randn(4, 16)).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
print("NEW", sorted(n for n in set(sys.modules) - before if n.startswith("apt_model")))
print("ADOPTED", len(vb.get_report()["models"]))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240,
                         env=clean_env(VB_DEVICE="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "NEW []" in out.stdout and "ADOPTED 1" in out.stdout, out.stdout
