"""FP4 in the switch: the conversion policy, memory mode, use_fp4, the report, and exact undo."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from apt_model.errors import ConfigError
from apt_model.models.gpt import GPT, GPTConfig
from apt_model.quantization import FP4Linear, FP4Policy, add_lora, fake_quantize, plan_fp4


def frozen_gpt(seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(seq_len=32, d_model=128, n_layers=2, n_heads=4))
    model.requires_grad_(False)
    return model


def verdicts(model, policy=None):
    return {c.name: (c.convert, c.reason) for c in plan_fp4(model, policy)}


def test_policy_skips_embeddings_tied_head_small_and_trainable_layers():
    model = frozen_gpt()
    model.blocks[1].mlp[0].requires_grad_(True)
    v = verdicts(model)
    assert v["tok_emb"][0] is False and v["tok_emb"][1].startswith("embedding")
    assert v["head"][0] is False and "tied weight" in v["head"][1] and "tok_emb.weight" in v["head"][1]
    assert v["blocks.0.attn.qkv"] == (True, "frozen layer: 49152 weights")
    assert v["blocks.0.attn.proj"][0] is True  # 128 x 128 = 16384, the default minimum
    assert v["blocks.1.mlp.0"][0] is False and v["blocks.1.mlp.0"][1].startswith("trainable weight")
    small = verdicts(model, {"min_weights": 20000})
    assert small["blocks.0.attn.proj"] == (False, "small: 16384 weights, below min_weights=20000")


def test_policy_overrides_and_structural_skips():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(128, 4, batch_first=True)
            self.lm_head = nn.Linear(128, 512)
            self.hooked = nn.Linear(128, 512)
            self.hooked.register_forward_hook(lambda *a: None)
            self.wrapped = nn.Linear(128, 512)  # a forward set on the instance (accelerate's hooks)
            self.wrapped.forward = lambda x, layer=self.wrapped: nn.Linear.forward(layer, x) * 0.1
            self.a = nn.Linear(128, 512)
            self.b = nn.Linear(128, 512)

    m = M().requires_grad_(False)
    v = verdicts(m)
    assert v["mha.out_proj"][0] is False  # a subclass of nn.Linear that MHA reads directly
    assert v["lm_head"] == (False, "output head: its FP4 error goes straight into the logits")
    assert v["hooked"][0] is False and v["hooked"][1].startswith("hooks")
    assert v["wrapped"][0] is False and v["wrapped"][1].startswith("its own forward")  # it ran unwrapped in FP4
    assert v["a"][0] and v["b"][0]
    v = verdicts(m, {"include": ["lm_head", "hooked"], "skip": ["b"]})
    assert v["lm_head"] == (True, "included: policy pattern 'lm_head'")
    assert v["hooked"][0] is False  # include cannot override a structural reason
    assert v["b"] == (False, "skip pattern: 'b'")
    assert verdicts(m, {"skip_output_head": False})["lm_head"][0] is True


def test_policy_validation_names_the_valid_values():
    with pytest.raises(ConfigError, match="valid: format, scale_rule, min_weights"):
        FP4Policy.coerce({"fromat": "nvfp4"})
    with pytest.raises(ConfigError, match="valid: mxfp4, nvfp4"):
        FP4Policy(format="int4")
    with pytest.raises(ConfigError, match="min_weights=-1"):
        FP4Policy(min_weights=-1)
    with pytest.raises(ConfigError, match="fp4_policy"):
        vb.enable("memory", fp4_policy={"min_weight": 3}, banner=False)
    assert not vb.is_enabled()


def test_use_fp4_alias():
    assert vb.enable("balanced", use_fp4=True, banner=False).fp4 == "storage"
    assert vb.enable("performance", use_fp4=True, banner=False).fp4 == "native"
    assert vb.enable("memory", use_fp4=False, banner=False).fp4 == "off"
    assert vb.enable("full", use_fp4=True, banner=False).fp4 == "all"
    assert vb.get_config()["features"]["fp4"]["status"] == "requested"  # built in this version
    with pytest.raises(ConfigError, match="use_fp4=True means fp4='storage'"):
        vb.enable("balanced", use_fp4=True, fp4="off", banner=False)
    with pytest.raises(ConfigError, match="use_fp4='yes' must be True or False"):
        vb.enable("balanced", use_fp4="yes", banner=False)


def test_memory_mode_stores_frozen_linears_in_fp4_and_disable_restores_them(capsys):
    model = frozen_gpt()
    add_lora(model, targets=("*.attn.qkv", "*.mlp.0"), rank=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built before enabling: holds the frozen weights too
    originals = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    values = {n: m.weight.detach().clone() for n, m in originals.items()}
    vb.enable("memory", device="cpu", mixed_precision="off", attention="off", banner=False)
    model.to("cpu")
    assert isinstance(model.blocks[0].attn.qkv.base, FP4Linear)  # under the adapter
    assert isinstance(model.blocks[0].attn.proj, FP4Linear)
    assert model.head.weight is model.tok_emb.weight  # the tied head is untouched
    rec = vb.get_report()["models"][0]["features"]["fp4"]
    assert rec["chosen"] == "storage" and rec["format"] == "nvfp4" and rec["compute"] == "emulated"
    assert len(rec["converted"]) == 8 and rec["bytes_saved"] > 0.8 * rec["bytes_before"]
    assert "stored 8 frozen nn.Linear layer(s) in NVFP4" in rec["reason"]
    assert "cpu has no native FP4 matmul" in rec["compute_reason"]
    assert {s["name"] for s in rec["skipped"]} == {"tok_emb", "pos_emb", "head"}
    assert all(originals[n].weight.numel() == 0 for n in originals if n != "head")  # fp32 memory released
    # training goes on: only the adapters learn, through the FP4 base
    x = torch.randint(0, 256, (4, 32))
    lora = [p for p in model.parameters() if p.requires_grad]
    snap = [p.detach().clone() for p in lora]
    for _ in range(3):
        loss = F.cross_entropy(model(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(snap, lora))
    # the FP4Linear modules the conversion put in are part of this model, not models of their own
    assert [m["name"] for m in vb.get_report()["models"]] == [type(model).__name__]
    y_on = model(x)
    vb.disable()
    for n, m in model.named_modules():
        if n in originals:
            assert m is originals[n]  # the same nn.Linear objects are back
    for n, m in originals.items():
        expected = values[n] if n == "head" else fake_quantize(values[n], "nvfp4")  # FP4-rounded values
        assert torch.equal(m.weight, expected), n
    assert torch.equal(model(x), y_on)  # identical outputs before and after disable


def test_performance_mode_on_cpu_changes_nothing_and_never_tries_native(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("_scaled_mm must not be called on cpu")

    monkeypatch.setattr(torch, "_scaled_mm", boom)
    model = frozen_gpt()
    vb.enable("performance", device="cpu", mixed_precision="off", attention="off", banner=False)
    model.to("cpu")
    rec = vb.get_report()["models"][0]["features"]["fp4"]
    assert rec["requested"] == "native" and rec["chosen"] == "off"
    assert "native FP4 matmul is not available on cpu" in rec["reason"]
    assert not any(isinstance(m, FP4Linear) for m in model.modules())


def test_nothing_to_convert_is_reported_with_reasons():
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=32, d_model=64, n_layers=1, n_heads=2))  # everything trainable
    vb.enable("memory", device="cpu", mixed_precision="off", attention="off", banner=False)
    model.to("cpu")
    rec = vb.get_report()["models"][0]["features"]["fp4"]
    assert rec["chosen"] == "off" and rec["reason"].startswith("no layer to convert")
    assert "trainable weight" in rec["reason"]


def test_environment_and_policy_setting_reach_the_conversion(monkeypatch):
    monkeypatch.setenv("VB_FP4", "storage")
    model = frozen_gpt()
    cfg = vb.enable("balanced", device="cpu", mixed_precision="off", attention="off", banner=False,
                    fp4_policy={"format": "mxfp4", "scale_rule": "rceil", "skip": ["*.mlp.*"]})
    assert cfg.fp4 == "storage" and vb.get_config()["features"]["fp4"]["source"] == "environment:VB_FP4"
    assert vb.get_config()["settings"]["fp4_policy"]["value"]["format"] == "mxfp4"
    model.to("cpu")
    rec = vb.get_report()["models"][0]["features"]["fp4"]
    assert rec["format"] == "mxfp4" and rec["scale_rule"] == "rceil" and len(rec["converted"]) == 4
    assert isinstance(model.blocks[0].attn.qkv, FP4Linear) and model.blocks[0].attn.qkv.scale_rule == "rceil"
    assert type(model.blocks[0].mlp[0]) is nn.Linear
    assert "MXFP4 (RCEIL)" in rec["reason"]


def test_planning_reads_no_parametrized_weight(cpu_device):
    """Reading ``.weight`` of a ``spectral_norm`` layer in training mode runs a power iteration
    (its ``_u`` / ``_v`` change): the FP4 plan's summary of a skipped layer did that at adoption,
    so training then diverged from plain PyTorch. ``weight_norm`` (two stored tensors) too."""
    from torch.nn.utils.parametrizations import spectral_norm, weight_norm

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), spectral_norm(nn.Linear(8, 8)), weight_norm(nn.Linear(8, 8)))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    vb.enable("balanced", fp4="storage", paging="off", compile="off", mixed_precision="off", banner=False)
    try:
        m.to("cpu")
        skipped = vb.get_report()["models"][0]["features"]["fp4"]["skipped"]
    finally:
        vb.disable()
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    shapes = {s["name"]: s["shape"] for s in skipped}
    assert shapes["1"] == [8, 8] and shapes["2"] is None, shapes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_model_cast_after_adoption_is_restored_in_its_new_dtype(cpu_device, dtype):
    """``model.to(torch.bfloat16)`` after an FP4 layer took a frozen ``nn.Linear``'s place:
    ``disable()`` gave the restored layer its weight back in the old fp32 beside its bf16 bias,
    and the next forward raised ("self and mat2 must have the same dtype"). The weight follows
    the cast now, as an ``nn.Linear``'s would."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
    m[0].requires_grad_(False)
    vb.enable("balanced", fp4="storage", mixed_precision="off", attention="off", compile="off", banner=False)
    try:
        m.to("cpu")
        assert isinstance(m[0], FP4Linear)
        m.to(dtype)
        x = torch.randn(2, 128, dtype=dtype)
        y_on = m(x)
        assert m[0].weight.dtype == dtype
    finally:
        vb.disable()
    assert type(m[0]) is nn.Linear and m[0].weight.dtype == m[0].bias.dtype == dtype
    assert torch.equal(m(x), y_on)


def test_memory_mode_leaves_a_frozen_copy_such_as_an_ema_in_full_precision(cpu_device):
    """An EMA of the weights (``deepcopy(model).requires_grad_(False)``) was adopted by memory mode,
    whose default stores frozen ``nn.Linear`` layers in FP4: the usual in-place update then raised
    ("output with shape [128] doesn't match the broadcast shape"; ``parameters()`` had lost the FP4
    weights). A model with no trainable parameter is left alone by the mode's default, with the
    reason; asking for ``fp4="storage"`` still converts it. The EMA ends bitwise as without the switch."""
    def run(**enable):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
        ema = copy.deepcopy(model).requires_grad_(False)
        decision = None
        if enable:
            vb.enable(mixed_precision="off", attention="off", compile="off", banner=False, **enable)
        try:
            model, ema = model.to("cpu"), ema.to("cpu")
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            gen = torch.Generator().manual_seed(1)
            for _ in range(3):
                x = torch.randn(8, 16, generator=gen)
                loss = F.mse_loss(model(x), x.sum(-1, keepdim=True))
                opt.zero_grad()
                loss.backward()
                opt.step()
                with torch.no_grad():
                    for pe, p in zip(ema.parameters(), model.parameters()):
                        pe.mul_(0.9).add_(p, alpha=0.1)
            if enable:
                decision = vb.get_report()["models"][1]["features"]["fp4"]
        finally:
            if enable:
                vb.disable()
        return ema.state_dict(), decision

    ref, _ = run()
    got, decision = run(mode="memory")
    assert decision["chosen"] == "off" and "no parameter of the model is trainable" in decision["reason"], decision
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    vb.enable("memory", fp4="storage", banner=False)  # asked for by the script: converted
    try:
        frozen = nn.Sequential(nn.Linear(128, 128)).requires_grad_(False).to("cpu")
        assert isinstance(frozen[0], FP4Linear)
    finally:
        vb.disable()


class MomentumEncoders(nn.Module):
    """MoCo's / BYOL's layout: the online encoder and its momentum copy in one trained module."""

    def __init__(self):
        super().__init__()
        self.online = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 128, bias=False))
        self.momentum = copy.deepcopy(self.online).requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            for pm, p in zip(self.momentum.parameters(), self.online.parameters()):
                pm.mul_(0.9).add_(p, alpha=0.1)
        return (self.online(x) * self.momentum(x)).sum(-1)


def test_memory_mode_leaves_a_momentum_copy_inside_the_trained_module_in_full_precision(cpu_device):
    """The frozen-model rule above did not cover a momentum copy kept inside the trained module
    (MoCo's key encoder, BYOL's target, a mean teacher): memory mode stored its frozen 128x128
    layer in FP4, ``parameters()`` lost it, and the usual ``zip`` update paired it with nothing,
    silently (or paired tensors of other shapes and raised; a probe's finding). A frozen layer
    equal to a trainable weight of the model is left alone by the mode's default, with the reason;
    ``fp4="storage"`` converts it anyway. Training ends bitwise as without the switch."""
    def run(resumed=False, **enable):
        torch.manual_seed(0)
        model = MomentumEncoders()
        if resumed:  # a resumed run: the checkpoint's momentum copy has drifted from the online weights
            with torch.no_grad():
                model.momentum[2].weight.mul_(0.5)
        if enable:
            vb.enable(mixed_precision="off", attention="off", compile="off", banner=False, **enable)
        try:
            model = model.to("cpu")
            converted = [n for n, m in model.named_modules() if isinstance(m, FP4Linear)]
            opt = torch.optim.SGD(model.online.parameters(), lr=0.05)
            gen = torch.Generator().manual_seed(1)
            for _ in range(3):
                loss = model(torch.randn(8, 16, generator=gen)).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            decision = vb.get_report()["models"][0]["features"]["fp4"] if enable else None
        finally:
            if enable:
                vb.disable()
        return model.state_dict(), converted, decision

    ref, _, _ = run()
    got, converted, decision = run(mode="memory")
    assert converted == [] and decision["chosen"] == "off", decision
    assert any("momentum copy: equal to, or a copy's layer of, the trainable online.2.weight" in c["reason"]
               for c in decision["skipped"]), decision
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    vb.enable("memory", fp4="storage", mixed_precision="off", attention="off", compile="off", banner=False)
    try:  # asked for by the script: converted; the zip update then meets the held, empty weight: loud
        model = MomentumEncoders().to("cpu")
        assert [n for n, m in model.named_modules() if isinstance(m, FP4Linear)] == ["momentum.2"]
        with pytest.raises(RuntimeError, match="size of tensor"):
            model(torch.randn(8, 16))
    finally:
        vb.disable()
    # resumed: no longer equal, but a structural copy of the online encoder (a review probe's finding)
    ref, _, _ = run(resumed=True)
    got, converted, decision = run(resumed=True, mode="memory")
    assert converted == [] and all(torch.equal(ref[k], got[k]) for k in ref), decision
    # no momentum copies, their frozen layers converted (a second review's finding): a partly frozen
    # stack (a numbered step away), frozen named siblings, a frozen tower of a dual encoder
    def tower():
        return nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))

    vb.enable("memory", mixed_precision="off", attention="off", compile="off", banner=False)
    try:
        stack = tower()
        stack[0].requires_grad_(False)
        stack.to("cpu")
        assert isinstance(stack[0], FP4Linear)
        attn = nn.ModuleDict({"q_proj": nn.Linear(128, 128), "v_proj": nn.Linear(128, 128)})
        attn.q_proj.requires_grad_(False)
        attn.to("cpu")
        assert isinstance(attn.q_proj, FP4Linear)
        dual = nn.ModuleDict({"query_encoder": tower().requires_grad_(False), "doc_encoder": tower()})
        dual.to("cpu")
        assert isinstance(dual.query_encoder[0], FP4Linear)
    finally:
        vb.disable()


def test_a_frozen_weight_another_module_holds_is_not_stored_in_fp4(cpu_device):
    """A LoRA policy's frozen base shared with a reference model outside it (``ref.weight =
    policy.base.weight``): memory mode stored the base in FP4 and emptied the shared weight, so the
    reference's next call raised "mat2 must be a matrix, got 1-D tensor" (a probe's finding). A
    weight a module outside the model holds is a tied weight: left as it is, with the reason."""
    class Policy(nn.Module):
        def __init__(self):
            super().__init__()
            self.base, self.adapter = nn.Linear(128, 128), nn.Linear(128, 128)

        def forward(self, x):
            return self.base(x) + self.adapter(x)

    torch.manual_seed(0)
    policy = Policy()
    policy.base.requires_grad_(False)
    reference = nn.Linear(128, 128)
    reference.weight, reference.bias = policy.base.weight, policy.base.bias
    x = torch.randn(4, 128)
    want = reference(x)
    vb.enable("memory", mixed_precision="off", attention="off", compile="off", banner=False)
    try:
        policy(x).square().mean().backward()
        fp4 = vb.get_report()["models"][0]["features"]["fp4"]
        got = reference(x)
    finally:
        vb.disable()
    assert torch.equal(got, want)
    assert not isinstance(policy.base, FP4Linear) and policy.base.weight is reference.weight
    assert any("held outside the model too: by a Linear" in c["reason"] for c in fp4["skipped"]), fp4


def test_a_checkpoint_saved_with_fp4_layers_loads_into_the_plain_model(cpu_device):
    """Memory mode's FP4 layers listed their packed buffers in ``state_dict()``: a checkpoint saved
    during training could not be loaded into the model's own class without the switch ("Missing
    key(s) 0.weight; Unexpected key(s) 0.weight_data ..."). A converted layer now presents the
    ``nn.Linear`` it replaced (its dequantized weight), the plain model computes exactly what the
    FP4 one did, and loading the checkpoint back under the switch keeps the FP4 codes."""
    import io

    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
        m[0].requires_grad_(False)
        return m

    x = torch.randn(3, 128)
    vb.enable("memory", mixed_precision="off", attention="off", compile="off", banner=False)
    try:
        m = build().to("cpu")
        assert isinstance(m[0], FP4Linear)
        codes = m[0].weight_data.clone()
        sd = m.state_dict()
        assert list(sd) == list(build().state_dict())  # the plain model's keys, in its order
        buf = io.BytesIO()
        torch.save(sd, buf)
        y_on = m(x)
        again = build().to("cpu")  # converted too; loading the checkpoint keeps the codes
        again.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
        assert torch.equal(again[0].weight_data, codes)
    finally:
        vb.disable()
    plain = build()
    plain.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert torch.equal(plain(x), y_on)


def test_a_frozen_layer_holding_nan_is_skipped_not_a_failed_adoption(cpu_device):
    """NVFP4 cannot encode NaN/Inf: memory mode's ``model.to()`` raised ValueError for a frozen
    layer holding one, where plain PyTorch runs (NaN out). The layer is skipped with the reason;
    MXFP4 plans are unchanged."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128), nn.Linear(128, 2)).requires_grad_(False)
    m[2].requires_grad_(True)  # a trainable head: the model is trained
    with torch.no_grad():
        m[0].weight[3, 5] = float("nan")
    v = verdicts(m)
    assert v["0"] == (False, "non-finite weights: NVFP4 needs finite values; the layer keeps its NaN/Inf as they are")
    assert v["1"][0] is True
    assert verdicts(m, {"format": "mxfp4"})["0"][0] is True
    x = torch.randn(2, 128)
    ref = m(x)
    vb.enable("memory", mixed_precision="off", attention="off", compile="off", banner=False)
    try:
        m.to("cpu")
        assert type(m[0]) is nn.Linear and isinstance(m[1], FP4Linear)
        assert torch.isnan(m(x)).all() and torch.isnan(ref).all()
    finally:
        vb.disable()


def _fp4_rounded(linear: nn.Linear) -> None:
    """Give ``linear`` the values its weight has once stored in NVFP4 (the plain reference)."""
    from apt_model.quantization import quantize

    with torch.no_grad():
        linear.weight.copy_(quantize(linear.weight, "nvfp4").dequantize(linear.weight.dtype))


def test_progressive_unfreezing_trains_a_layer_stored_in_fp4(cpu_device, caplog):
    """A frozen layer the switch stored in FP4, unfrozen later (train the head, then the base: the
    usual fine-tuning schedule), trained only its bias, with a warning (until 2026-11-29: a probe
    found default memory mode diverging from step 12). The released weight Parameter is listed in
    ``parameters()`` as before; made trainable, it gets the FP4-rounded values back at the layer's
    next call and trains like ``nn.Linear``. Bitwise as plain PyTorch started from those values,
    with the optimizer built over ``model.parameters()`` after adoption (the same parameter count)."""
    import logging

    def run(on: bool):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))
        m[0].requires_grad_(False)
        if not on:
            _fp4_rounded(m[0])
        else:
            vb.enable("memory", mixed_precision="off", attention="off", compile="off", banner=False)
        try:
            m.to("cpu")
            converted = isinstance(m[0], FP4Linear)
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            assert len(opt.param_groups[0]["params"]) == 4
            gen = torch.Generator().manual_seed(1)
            losses = []
            for step in range(6):
                if step == 3:
                    for p in m[0].parameters():
                        p.requires_grad_(True)
                x, y = torch.randn(16, 128, generator=gen), torch.randint(0, 2, (16,), generator=gen)
                loss = F.cross_entropy(m(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            state = {k: v.clone() for k, v in m.state_dict().items()}
        finally:
            if on:
                vb.disable()
        return losses, state, converted

    want, ref, _ = run(False)
    with caplog.at_level(logging.WARNING, logger="apt_model"):
        got, state, converted = run(True)
    assert converted and "stays frozen" not in caplog.text
    assert got == want
    assert ref.keys() == state.keys() and all(torch.equal(ref[k], state[k]) for k in ref)


def test_writes_into_a_layer_stored_in_fp4_reach_it(cpu_device):
    """``layer.weight`` of a layer stored in FP4 was a fresh copy, so in-place edits (``copy_`` of
    pretrained values, ``nn.init``, ``.data =``) went nowhere, silently; ``reset_parameters``
    raised AttributeError and assigning a Parameter raised KeyError (a probe's finding). Writes now
    re-quantize the layer; an assigned Parameter makes it compute like ``nn.Linear``."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))
    m[0].requires_grad_(False)
    pretrained = torch.randn(128, 128) * 0.05
    vb.enable("memory", mixed_precision="off", attention="off", compile="off", banner=False)
    try:
        m.to("cpu")
        layer = m[0]
        assert isinstance(layer, FP4Linear)
        with torch.no_grad():
            layer.weight.copy_(pretrained)
        rounded = nn.Linear(128, 128)
        with torch.no_grad():
            rounded.weight.copy_(pretrained)
        _fp4_rounded(rounded)
        assert torch.equal(layer.weight, rounded.weight)
        nn.init.zeros_(layer.weight)
        assert layer.weight.abs().max() == 0 and layer(torch.randn(2, 128)).sub(layer.bias).abs().max() == 0
        layer.weight.data = pretrained
        assert torch.equal(layer.weight, rounded.weight)
        torch.manual_seed(3)
        layer.reset_parameters()
        torch.manual_seed(3)
        fresh = nn.Linear(128, 128)
        _fp4_rounded(fresh)
        assert torch.equal(layer.weight, fresh.weight) and torch.equal(layer.bias, fresh.bias)
        layer.weight = nn.Parameter(pretrained.clone(), requires_grad=False)
        assert layer.dense and torch.equal(layer(torch.ones(1, 128)), F.linear(torch.ones(1, 128), pretrained, layer.bias))
    finally:
        vb.disable()


def _frozen_base(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 5))
    m[0].requires_grad_(False)
    return m


def test_unfreezing_fills_the_weight_at_once_for_an_optimizer_built_right_after(cpu_device):
    """The held weight got its values only at the layer's next call: an optimizer built right
    after the unfreezing read an empty tensor, so nanoGPT's ``p.dim() >= 2`` weight-decay rule put
    it in the no-decay group (silently other training), and Adagrad's state, made at construction,
    raised at its first step (a probe's finding). Made trainable, it is filled at once."""
    vb.enable("memory", mixed_precision="off", attention="off", compile="off", banner=False)
    try:
        m = _frozen_base().to("cpu")
        assert isinstance(m[0], FP4Linear) and m[0]._parameters["weight"].numel() == 0
        m.requires_grad_(True)
        decay = [tuple(p.shape) for p in m.parameters() if p.dim() >= 2]
        assert decay == [(128, 128), (5, 128)], decay
        opt = torch.optim.Adagrad(m.parameters(), lr=0.1)
        F.cross_entropy(m(torch.randn(4, 128)), torch.tensor([0, 1, 2, 3])).backward()
        opt.step()
        assert type(m[0]._parameters["weight"]) is nn.Parameter
    finally:
        vb.disable()


@pytest.mark.parametrize("where", ["unfrozen, then an inference_mode evaluation", "adopted under inference_mode"])
def test_inference_mode_never_makes_a_converted_layer_untrainable(cpu_device, where):
    """The values an unfreezing filled in during an ``inference_mode`` evaluation were inference
    tensors: the layer never trained; and a model first called (adopted) under ``inference_mode``
    (a zero-shot evaluation before fine-tuning) had inference codes and weights, which raised when
    unfrozen (a probe's findings). Both train now, bitwise as plain PyTorch from FP4-rounded values."""
    def run(on):
        m = _frozen_base()
        if not on:
            _fp4_rounded(m[0])
        else:
            vb.enable("memory", mixed_precision="off", attention="off", compile="off", banner=False)
        try:
            x, y = torch.randn(8, 128, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 5
            if where == "adopted under inference_mode":
                with torch.inference_mode():
                    m(x)  # the model's first call: adopted (converted) here
            else:
                m.to("cpu")  # adopted (converted) frozen
            if on:
                assert isinstance(m[0], FP4Linear)
            m.requires_grad_(True)
            if where != "adopted under inference_mode":
                with torch.inference_mode():
                    m(x)
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            for _ in range(3):
                opt.zero_grad()
                F.cross_entropy(m(x), y).backward()
                opt.step()
            return [p.detach().clone() for p in m.parameters()]
        finally:
            if on:
                vb.disable()

    want, got = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_a_forward_that_reads_the_weight_of_an_unfrozen_layer_trains_it(cpu_device):
    """A merged-LoRA style forward, ``F.linear(x, base.weight + B @ A, base.bias)``, read the
    packed layer's gradient-free view after unfreezing: the base never trained (a probe's finding)."""
    class Merged(nn.Module):
        def __init__(self):
            super().__init__()
            self.base = nn.Linear(128, 128)
            self.a, self.b = nn.Parameter(torch.randn(4, 128) * 0.01), nn.Parameter(torch.zeros(128, 4))

        def forward(self, x):
            return F.linear(x, self.base.weight + self.b @ self.a, self.base.bias)

    def run(on):
        torch.manual_seed(0)
        m = Merged()
        m.base.requires_grad_(False)
        if not on:
            _fp4_rounded(m.base)
        else:
            vb.enable("memory", mixed_precision="off", attention="off", compile="off", banner=False)
        try:
            m.to("cpu")
            if on:
                assert isinstance(m.base, FP4Linear)
            m.base.weight.requires_grad_(False)  # reading it frozen is fine
            m.requires_grad_(True)
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            x = torch.randn(8, 128, generator=torch.Generator().manual_seed(1))
            for _ in range(3):
                opt.zero_grad()
                m(x).square().mean().backward()
                opt.step()
            return [p.detach().clone() for p in m.parameters()]
        finally:
            if on:
                vb.disable()

    want, got = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_a_frozen_layer_another_model_or_the_script_calls_is_not_stored_in_fp4(cpu_device):
    """FP4 storage empties the original layer's weight: a frozen encoder shared by two models, or
    called by the script through its own variable, crashed with "mat2 must be a matrix" (a probe's
    finding). Such a layer is held outside the model, and left alone."""
    torch.manual_seed(0)
    enc = nn.Linear(128, 128).requires_grad_(False)
    a = nn.Sequential(enc, nn.ReLU(), nn.Linear(128, 2))
    b = nn.Sequential(enc, nn.Tanh(), nn.Linear(128, 3))
    x = torch.randn(4, 128)
    vb.enable("memory", mixed_precision="off", attention="off", compile="off", banner=False)
    try:
        a.to("cpu")
        b.to("cpu")
        assert a[0] is enc and b[0] is enc
        assert enc(x).shape == (4, 128) and b(x).shape == (4, 3)
        fp4 = vb.get_report()["models"][0]["features"]["fp4"]
        assert any("held outside the model too" in c["reason"] for c in fp4["skipped"]), fp4
    finally:
        vb.disable()


class _LoRA(nn.Module):
    """A hand-written LoRA wrapper around a base layer."""

    def __init__(self, base):
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(4, base.in_features) * 0.01)
        self.b = nn.Parameter(torch.zeros(base.out_features, 4))

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


def test_disable_puts_back_a_converted_layer_that_the_script_wrapped_after_adoption(cpu_device):
    """A LoRA wrapper put around a converted layer after adoption kept an FP4Linear after
    ``disable()``: the undo put the nn.Linear back only where the FP4 layer had been put (a probe's
    finding). It is put back wherever the layer is now, and the report gives the converted
    layers' real shapes (it read [0], taken after the release)."""
    m = _frozen_base()
    vb.enable("memory", mixed_precision="off", attention="off", compile="off", banner=False)
    try:
        m.to("cpu")
        fp4 = vb.get_report()["models"][0]["features"]["fp4"]
        m[0] = _LoRA(m[0])
        x = torch.randn(2, 128)
        before = m(x)
    finally:
        vb.disable()
    assert [c["shape"] for c in fp4["converted"]] == [[128, 128]], fp4["converted"]
    assert type(m[0].base) is nn.Linear and m[0].base.weight.shape == (128, 128)
    assert torch.equal(m(x), before)


def test_values_written_into_a_converted_layer_are_rounded_and_said_so_unless_it_was_unfrozen_first(cpu_device, caplog):
    """A fine-tuned checkpoint loaded into a model whose layers were converted frozen was rounded to
    FP4 without a word (a probe's finding: a resumed run differed from the uninterrupted one). It
    is said once now; unfrozen before the load, the layer keeps the values exactly."""
    import logging

    tuned = _frozen_base(seed=5).state_dict()
    vb.enable("memory", mixed_precision="off", attention="off", compile="off", banner=False)
    try:
        m = _frozen_base().to("cpu")
        with caplog.at_level(logging.WARNING, logger="apt_model"):
            m.load_state_dict(tuned)
        assert "were rounded to FP4" in caplog.text
        assert not torch.equal(m[0].weight, tuned["0.weight"])
        exact = _frozen_base().to("cpu")
        exact.requires_grad_(True)
        exact.load_state_dict(tuned)
        assert torch.equal(exact[0].weight, tuned["0.weight"])
    finally:
        vb.disable()


def test_a_converted_layer_is_an_nn_linear_for_the_scripts_grouping_and_unfreezes_through_its_weight(cpu_device):
    """minGPT's ``configure_optimizers`` sorts ``weight``s by ``isinstance(m, nn.Linear)`` and
    asserts every parameter landed in a group: the converted layer's held weight, on a module that
    was no ``nn.Linear``, failed it; and ``layer.weight.requires_grad = True``, the usual way to
    unfreeze one layer, set the flag on a temporary copy and did nothing, silently (a review
    probe's findings). A converted layer is an ``nn.Linear`` subclass now, and the flag set
    through its ``weight`` unfreezes it."""
    vb.enable("memory", mixed_precision="off", attention="off", compile="off", banner=False)
    try:
        m = _frozen_base().to("cpu")
        assert isinstance(m[0], FP4Linear) and isinstance(m[0], nn.Linear)
        decay, no_decay = set(), set()
        for mn, mod in m.named_modules():
            for pn, _ in mod.named_parameters(recurse=False):
                full = f"{mn}.{pn}" if mn else pn
                if pn.endswith("bias"):
                    no_decay.add(full)
                elif pn.endswith("weight") and isinstance(mod, nn.Linear):
                    decay.add(full)
        assert decay | no_decay == {n for n, _ in m.named_parameters()}
        m[0].weight.requires_grad = True
        assert m[0].dense and m[0].weight.requires_grad and m[0].weight.shape == (128, 128)
        m[0].weight.requires_grad_(False)  # the Parameter's own flag now: frozen again, dense
        assert not m[0].weight.requires_grad
    finally:
        vb.disable()


def test_disable_gives_the_restored_nn_linear_the_parameter_the_fp4_layer_holds(cpu_device):
    """A Parameter the script assigned to a converted layer (or loaded with ``assign=True`` into an
    unfrozen one) was dropped by ``disable()``: the restored ``nn.Linear`` kept the original, and an
    optimizer holding the new one no longer trained the model (a review probe's finding)."""
    vb.enable("memory", mixed_precision="off", attention="off", compile="off", banner=False)
    try:
        m = _frozen_base().to("cpu")
        new = nn.Parameter(torch.randn(128, 128))
        m[0].weight = new
        assert m[0].dense
        assert "PackedWeightView" not in repr(_frozen_base().to("cpu")[0].weight)  # printed as a tensor
    finally:
        vb.disable()
    assert type(m[0]) is nn.Linear and m[0].weight is new


def test_a_paged_model_with_fp4_layers_saves_their_weights(cpu_device, tmp_path):
    """With paging and FP4 storage both on, the empty held weight was paged like any parameter,
    and the paging's state_dict hook put that empty page in the layer's ``weight`` entry: the
    checkpoint did not load into the plain model (a probe's finding). Empty parameters are not
    paged; the entry is the dequantized weight."""
    vb.enable("memory", swap_dir=str(tmp_path), paging="always", device_budget="4KB", mixed_precision="off",
              attention="off", compile="off", banner=False)
    try:
        m = _frozen_base().to("cpu")
        assert isinstance(m[0], FP4Linear)
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(m(torch.randn(4, 128)), torch.arange(4)).backward()
            opt.step()
        assert vb.get_stats()["levels"][0]["misses"] > 0  # paging really ran
        sd = m.state_dict()
        weight = m[0].weight.clone()
    finally:
        vb.disable()
    assert sd["0.weight"].shape == (128, 128) and torch.equal(sd["0.weight"], weight)
    _frozen_base().load_state_dict(sd)


def test_nn_init_through_a_converted_layers_weight_reaches_it(cpu_device):
    """``nn.init.normal_(layer.weight)`` reached the view's ``__torch_function__`` with no positional
    argument (``handle_torch_function(f, (), tensor=...)``): IndexError (a probe's finding)."""
    vb.enable("memory", mixed_precision="off", attention="off", compile="off", banner=False)
    try:
        m = _frozen_base().to("cpu")
        for init in (nn.init.normal_, nn.init.uniform_, nn.init.kaiming_uniform_):
            before = m[0].weight.clone()
            init(m[0].weight)
            assert not torch.equal(m[0].weight, before), init
        nn.init.constant_(m[0].weight, 0.5)
        assert torch.all(m[0].weight == 0.5)
    finally:
        vb.disable()


@pytest.mark.parametrize("paged", [False, True], ids=["in-memory", "paged-with-a-later-global-hook"])
def test_layers_frozen_after_adoption_are_named_at_the_next_step(cpu_device, caplog, tmp_path, paged):
    """The common fine-tuning order moves the model first and freezes the base after: adoption (at
    ``.to()``) saw every layer trainable, so memory mode stored none in FP4, and the report said
    only "trainable weight" (a gap named in the 2026-11-29 note). At the next optimizer step the
    layers frozen since are named, in a warning and in the report, with the fix; once. Training is
    unchanged (nothing is converted then). Paged, with a global step pre-hook of the script's
    registered after adoption: the check's hook once removed itself mid-step there, and the step
    raised "OrderedDict mutated during iteration" (the review of 2026-11-29)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def run(enable: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
        if enable:
            extra = {"paging": "always", "device_budget": "64KB", "swap_dir": str(tmp_path)} if paged else {}
            vb.enable("memory", mixed_precision="off", attention="off", compile="off", banner=False, **extra)
        handle = None
        try:
            model = model.to("cpu")
            model[0].requires_grad_(False)  # frozen after adoption
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
            handle = register_optimizer_step_pre_hook(lambda o, a, k: None)  # the script's, after adoption
            gen = torch.Generator().manual_seed(1)
            for _ in range(3):
                loss = model(torch.randn(8, 128, generator=gen)).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            fp4 = vb.get_report()["models"][0]["features"]["fp4"] if enable else None
        finally:
            handle.remove() if handle is not None else None
            if enable:
                vb.disable()
        return model.state_dict(), fp4

    ref, _ = run(False)
    with caplog.at_level("WARNING", logger="apt_model"):
        got, fp4 = run(True)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert fp4["chosen"] == "off" and fp4["frozen_after_adoption"] == ["0"], fp4
    assert "frozen after the model was adopted (to()) stay dense: 0" in fp4["reason"], fp4["reason"]
    assert caplog.text.count("Freeze them before the model is moved with .to()") == 1


def test_qat_conversion_after_a_paged_model_was_moved_converts_and_trains_as_without_the_switch(cpu_device, tmp_path):
    """Paging's own hooks on each ``nn.Linear`` read as the script's to the FP4 planner, so
    ``convert_to_fp4(model, use="qat")`` after ``.to()`` converted no layer, silently, and the
    script trained in plain fp32 (a probe's finding, 2026-11-29). The switch's hooks no longer
    count for QAT (the layer keeps its Parameter objects, and paging follows the new module);
    FP4 storage of a paged layer is still refused, with that reason."""
    from apt_model.quantization import FP4QATLinear, convert_to_fp4

    def run(enabled: bool):
        if enabled:
            vb.enable("balanced", device_budget="200KB", host_budget="200KB", swap_dir=str(tmp_path),
                      mixed_precision="off", attention="off", compile="off", banner=False)
        try:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                                  nn.Linear(128, 10)).to("cpu")
            policy = {"min_weights": 0, "skip_output_head": False}
            model.requires_grad_(False)  # frozen for a moment: what FP4 storage would say of the paged layers
            storage = plan_fp4(model, policy, "storage") if enabled else []
            model.requires_grad_(True)
            plan = convert_to_fp4(model, use="qat", policy=policy)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            gen = torch.Generator().manual_seed(1)
            target = torch.randn(64, 10, generator=torch.Generator().manual_seed(5))
            losses = []
            for _ in range(6):
                x = torch.randn(32, 64, generator=gen)
                loss = F.cross_entropy(model(x), (x @ target).argmax(1))
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            paged = vb.get_report()["models"][0]["features"]["paging"]["chosen"] if enabled else None
            return sum(isinstance(m, FP4QATLinear) for m in model.modules()), losses, paged, storage, plan
        finally:
            if enabled:
                vb.disable()

    n_ref, ref, _, _, _ = run(False)
    n, got, paged, storage, plan = run(True)
    assert paged == "paged", paged
    assert n == n_ref == 3, [c.reason for c in plan]
    assert got == ref
    assert storage and all(not c.convert and c.reason.startswith("paged by the switch") for c in storage), \
        [c.reason for c in storage]


def test_add_lora_wraps_qat_layers_and_refuses_to_match_nothing():
    """``add_lora`` matched ``nn.Linear`` and ``FP4Linear`` only: on a QAT model it wrapped no layer
    and still froze every parameter, so an optimizer over ``model.parameters()`` trained nothing
    (a probe's finding, 2026-11-29). QAT layers are wrapped now; targets that match no layer raise,
    naming the layers there are, and nothing is frozen."""
    from apt_model.quantization import FP4QATLinear, lora_parameters

    model = nn.Sequential(FP4QATLinear(32, 64), nn.ReLU(), FP4QATLinear(64, 8))
    assert add_lora(model, rank=4) == ["0", "2"]
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["0.lora_a", "0.lora_b", "2.lora_a", "2.lora_b"]
    assert len(lora_parameters(model)) == 4
    model(torch.randn(3, 32)).sum().backward()
    assert model[0].lora_b.grad is not None
    plain = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"no layer matched targets=\['\*\.q_proj'\].* are: 0, 2"):
        add_lora(plain, targets="*.q_proj")
    assert all(p.requires_grad for p in plain.parameters())


def test_a_qat_model_is_reported_as_fp4_already(cpu_device):
    """Memory mode on a model made of ``FP4QATLinear`` layers reported "the model has no nn.Linear
    layers", though they are ``nn.Linear`` subclasses (a QAT probe's finding, 2026-11-29)."""
    from apt_model.quantization import FP4QATLinear

    vb.enable("memory", mixed_precision="off", attention="off", compile="off", banner=False)
    try:
        nn.Sequential(FP4QATLinear(128, 128), nn.ReLU(), FP4QATLinear(128, 4)).to("cpu")
        fp4 = vb.get_report()["models"][0]["features"]["fp4"]
    finally:
        vb.disable()
    assert fp4["chosen"] == "off" and fp4["reason"] == "no layer to convert: its linear layers are FP4QATLinear already"
