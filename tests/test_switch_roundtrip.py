"""enable()/disable() round trip: every patch restored, configuration validated and explained."""
import pytest
import torch
import torch.nn as nn
from torch.nn.modules import module as M

import apt_model.optimization.vb_global as vb
from apt_model.errors import ConfigError
from apt_model.models.gpt import GPT, GPTConfig


def _snapshot():
    return {
        "Module.to": nn.Module.__dict__["to"],
        "Module.cuda": nn.Module.__dict__["cuda"],
        "Tensor.to": torch.Tensor.__dict__.get("to"),
        "Tensor.cuda": torch.Tensor.__dict__.get("cuda"),
        "global_pre_hooks": dict(M._global_forward_pre_hooks),
        "global_hooks": dict(M._global_forward_hooks),
    }


def test_enable_disable_restores_every_patch():
    before = _snapshot()
    vb.enable("balanced", banner=False)
    during = _snapshot()
    assert during["Module.to"] is not before["Module.to"]
    assert during["Module.cuda"] is not before["Module.cuda"]
    assert len(during["global_pre_hooks"]) == len(before["global_pre_hooks"]) + 1
    if not torch.cuda.is_available():  # the tensor redirection exists only where CUDA is absent
        assert during["Tensor.to"] is not before["Tensor.to"]
    vb.disable()
    assert _snapshot() == before
    assert not vb.is_enabled()


def test_adopted_model_is_unpatched_by_disable_and_keeps_working():
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=2))
    x = torch.randint(0, 256, (2, 32))
    ref = model(x)
    vb.enable("balanced", attention="sdpa", mixed_precision="bf16", compile="off", banner=False)
    model.to("cpu")
    assert all(b.attn.attn_implementation == "sdpa" for b in model.blocks)
    from apt_model.base.patches import SessionHook
    import apt_model.switch.placement as placement
    from apt_model.switch.placement import DeviceMismatchHint

    from apt_model.switch.fast_path import ForwardFastPath

    # autocast's pre-hook; autocast's post-hook, the fast path's exit hook, and the mismatch hint
    # where an accelerator is present (switch/placement.py: hint_useful)
    hint = int(placement.accelerator_present())
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 2 + hint
    assert sum(isinstance(h, SessionHook) and isinstance(h.fn, DeviceMismatchHint)
               for h in model._forward_hooks.values()) == hint
    assert sum(isinstance(h, SessionHook) and isinstance(getattr(h.fn, "__self__", None), ForwardFastPath)
               for h in model._forward_hooks.values()) == 1
    during = model(x)
    assert not torch.equal(during, ref)  # bf16 autocast really ran
    vb.disable()
    assert all(b.attn.attn_implementation == "eager" for b in model.blocks)
    assert len(model._forward_pre_hooks) == 0 and len(model._forward_hooks) == 0
    assert not hasattr(model, "_vb_autocast")
    assert torch.equal(model(x), ref)  # bit-identical to before enabling


def test_context_manager_restores_previous_state():
    assert not vb.is_enabled()
    with vb.enabled("memory", banner=False) as cfg:
        assert vb.is_enabled() and cfg.mode == "memory"
    assert not vb.is_enabled()
    vb.enable("performance", attention="off", banner=False)
    with vb.enabled("memory", banner=False):
        assert vb.get_config()["mode"] == "memory"
    assert vb.is_enabled() and vb.get_config()["mode"] == "performance"
    assert vb.get_config()["features"]["attention"]["value"] == "off"  # the override survives


def test_enable_twice_reconfigures_without_stacking_patches():
    before = _snapshot()
    vb.enable("balanced", banner=False)
    vb.enable("memory", banner=False)
    assert vb.get_config()["mode"] == "memory"
    assert len(M._global_forward_pre_hooks) == len(before["global_pre_hooks"]) + 1
    vb.disable()
    assert _snapshot() == before


@pytest.mark.parametrize("call,needle", [
    (lambda: vb.enable("fast"), "mode='fast' is not a mode; valid modes: performance, speed, balanced, memory, full"),
    (lambda: vb.enable(turbo=True), "unknown option 'turbo'; valid options: attention, mixed_precision"),
    (lambda: vb.enable(mixed_precision="fp8"), "mixed_precision='fp8' is not valid; valid values: auto, bf16, fp16, off"),
    (lambda: vb.enable(adopt="always"), "adopt='always' is not valid"),
    (lambda: vb.enable(device="tpu"), "unknown kind 'tpu'"),
    (lambda: vb.enable(autocast_min_speedup="fast"), "autocast_min_speedup='fast' is not a number"),
])
def test_invalid_enable_arguments(call, needle):
    with pytest.raises(ConfigError) as info:
        call()
    assert needle in str(info.value)
    assert not vb.is_enabled()


def test_config_reports_sources_and_unbuilt_features(monkeypatch, capsys):
    monkeypatch.setenv("VB_MIXED_PRECISION", "off")
    vb.enable("memory", attention="sdpa")
    banner = capsys.readouterr().out
    cfg = vb.get_config()
    assert cfg["features"]["attention"] == {**cfg["features"]["attention"], "value": "sdpa", "source": "argument"}
    assert cfg["features"]["mixed_precision"]["source"] == "environment:VB_MIXED_PRECISION"
    assert cfg["features"]["mixed_precision"]["value"] == "off"
    assert cfg["features"]["paging"]["source"] == "mode:memory"
    assert cfg["features"]["paging"]["status"] == "requested"
    assert "NOT BUILT" not in banner


def test_a_feature_that_is_not_built_is_shown_as_such(monkeypatch, capsys):
    """The switch never pretends: a requested feature without an implementation is NOT BUILT in the
    banner, in get_config() and in the report (every feature is built today, so one is unbuilt here)."""
    import dataclasses

    from apt_model.switch import modes

    monkeypatch.setitem(modes.FEATURES, "activation_offload",
                        dataclasses.replace(modes.FEATURES["activation_offload"], built=False))
    vb.enable("memory", paging="off")
    banner = capsys.readouterr().out
    assert vb.get_config()["features"]["activation_offload"]["status"] == "not built"
    assert "NOT BUILT" in banner and "activation_offload" in banner
    decisions = vb.get_report()["decisions"]
    assert any(d["feature"] == "activation_offload" and d["reason"] == "not built in this version" for d in decisions)


def test_speed_alias_and_mode_functions():
    for fn, mode in [(vb.enable_speed_mode, "performance"), (vb.enable_performance_mode, "performance"),
                     (vb.enable_balanced_mode, "balanced"), (vb.enable_memory_mode, "memory"),
                     (vb.enable_full_optimization, "full")]:
        cfg = fn(banner=False)
        assert cfg.mode == mode and vb.get_config()["mode"] == mode
    vb.disable()


class _SoftmaxBlock(nn.Module):
    """Calls ``F.softmax`` itself: balanced mode puts its compile ladder (override rung) on such a model."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(64, 64))

    def forward(self, x):
        return x + torch.nn.functional.softmax(self.mlp(x), dim=-1)


class _SoftmaxModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_SoftmaxBlock() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("mode,make,patched,precision", [
    # compile ladder (override rung) and autocast: bf16 forced, so autocast's hooks are attached
    # whatever the probe measures (with "auto" they were only when bf16 probed faster, and the test
    # failed now and then)
    ("balanced", _SoftmaxModel, lambda m: type(vars(m).get("forward")).__name__ == "LadderForward", "bf16"),
    ("memory", lambda: GPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=2)),
     lambda m: "forward" in vars(m.blocks[0]), None),  # checkpointed blocks
])
def test_a_model_the_script_drops_is_freed_while_the_switch_stays_on(mode, make, patched, precision, capsys,
                                                                    cpu_device):
    """A sweep (k-fold, a grid) trains model after model with the switch on: each one the script
    drops is freed, though the switch patched it (the undo stack, the compile ladder and the
    global optimizer hook hold it weakly). Until 2026-11-28 the adoption context kept the steps'
    first-call hooks, the compile ladder's among them, and autocast's verdict callback kept the
    context: in balanced mode a dropped model stayed alive."""
    import gc
    import weakref

    vb.enable(mode, banner=False, paging="off", **({"mixed_precision": precision} if precision else {}))
    try:
        refs = []
        for seed in range(2):
            torch.manual_seed(seed)
            model = make().to("cpu")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            x = torch.randint(0, 256, (2, 32)) if isinstance(model, GPT) else torch.randn(2, 8, 64)
            for _ in range(2):
                model(x).float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            assert patched(model), f"{mode}: the switch did not patch the model, so this test proves nothing"
            refs.append((weakref.ref(model), weakref.ref(model.blocks[0].mlp[0].weight)))
            del model, opt
            gc.collect()
        assert [(m() is None, p() is None) for m, p in refs] == [(True, True)] * 2
        capsys.readouterr()
        vb.print_stats()  # a sweep's finished models: one line, not a block of decisions each
        out = capsys.readouterr().out
        assert "models the script dropped (freed): 2" in out and "\n  model " not in out, out
    finally:
        vb.disable()


def test_a_reconfiguration_refused_for_its_swap_folder_leaves_the_running_session_on(tmp_path):
    """Like any other bad value, a missing swap folder in a second ``enable()`` is refused with
    nothing half-applied: the swap folder was checked after the running session was let go, so
    the switch ended off while ``get_config()`` still showed the old session."""
    vb.enable("memory", banner=False, swap_dir=str(tmp_path))
    try:
        with pytest.raises(ConfigError, match="does not exist"):
            vb.enable("memory", banner=False, swap_dir=str(tmp_path / "missing"))
        assert vb.is_enabled() and vb.get_config()["mode"] == "memory"
        model = GPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=2)).to("cpu")
        assert len(vb.get_report()["models"]) == 1, "the session still on adopts models"
        del model
    finally:
        vb.disable()


def test_hooks_a_library_registered_again_do_not_outlive_the_session(tmp_path, cpu_device):
    """``torch.ao.quantization``'s ``swap_module`` (``prepare_qat`` after adoption) registers a
    module's hooks again on its replacement under new handles; ``disable()`` removed only its own
    handles, and paging's copies called a closed session at every forward (a probe's finding).
    They are taken out at disable(), and any copy kept elsewhere does nothing."""
    from apt_model.base.patches import SessionHook

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    vb.enable("memory", paging="always", swap_dir=str(tmp_path), mixed_precision="off", fp4="off", banner=False)
    model(torch.randn(2, 16)).sum().backward()
    layer = model[0]
    copies = [h for h in layer._forward_pre_hooks.values() if isinstance(h, SessionHook)]
    assert copies
    for hook in copies:  # what swap_module does with a replaced layer's hooks
        layer.register_forward_pre_hook(hook)
    vb.disable()
    assert not [h for m in model.modules() for d in (m._forward_pre_hooks, m._forward_hooks)
                for h in d.values() if isinstance(h, SessionHook)]
    calls = []
    kept = SessionHook(lambda *a: calls.append(1))
    vb.enable("balanced", banner=False)
    vb.disable()
    assert copies[0](layer, (torch.ones(1),)) is None and kept(layer, ()) is None and calls == []
    x = torch.randn(2, 16)
    assert model(x).shape == (2, 4)
