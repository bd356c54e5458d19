"""A sweep (k-fold, a hyper-parameter grid) trains model after model with the switch on: each
model the script drops is freed, whatever the switch did to it. The holders a leak probe found
(2026-11-28) were undo actions that closed over the model, its layers or its parameters' hook
dictionaries: the undo stack lives until ``disable()``."""
import gc
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb


def sweep(make, steps: int = 2, n: int = 2, batch=lambda: (torch.randn(8, 32), torch.randint(0, 4, (8,)))):
    """Train ``n`` models made by ``make()`` for ``steps`` steps each, dropping each one; returns
    per model (whether it was freed, whether all its parameters were)."""
    refs = []
    for seed in range(n):
        torch.manual_seed(seed)
        model = make()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        for _ in range(steps):
            x, y = batch()
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        refs.append((weakref.ref(model), [weakref.ref(p) for p in model.parameters()]))
        del model, opt, loss
        gc.collect()
    gc.collect()  # a dropped layer in a cycle with its wrapper may need a second collection
    return [(m() is None, all(p() is None for p in ps)) for m, ps in refs]


def fine_tune() -> nn.Module:
    """A frozen base (layers of 32768 weights: above FP4 storage's minimum) and a trainable head."""
    base = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU()).requires_grad_(False)
    return nn.Sequential(base, nn.Linear(128, 4)).to("cpu")


def wide_batch():
    return torch.randn(8, 128), torch.randint(0, 4, (8,))


def test_fp4_storage_of_a_frozen_base_does_not_keep_the_model(cpu_device):
    """The FP4 step's undo held the layer's parent, the original ``nn.Linear`` and the FP4 layer."""
    vb.enable("memory", banner=False, fp4="storage", paging="off", activation_offload=False)
    try:
        freed = sweep(fine_tune, batch=wide_batch)
        converted = [m for m in vb.get_report()["models"] if m["features"]["fp4"]["chosen"].startswith("storage")]
    finally:
        vb.disable()
    assert len(converted) == 2, "no layer was stored in FP4: the test proves nothing"
    assert freed == [(True, True)] * 2


def test_fp4_storage_is_still_undone_for_a_model_kept(cpu_device):
    """Held weakly, the undo still gives a live model its ``nn.Linear`` layers back."""
    vb.enable("memory", banner=False, fp4="storage", paging="off", activation_offload=False)
    try:
        model = fine_tune()
        model(torch.randn(2, 128))
        assert type(model[0][0]).__name__ == "FP4Linear"
    finally:
        vb.disable()
    assert type(model[0][0]) is nn.Linear and model[0][0].weight.shape == (256, 128)


def test_paging_does_not_keep_a_model_through_the_scripts_parameter_hooks(cpu_device):
    """Paging wraps hooks registered before it started; its undo held their dictionary (and so
    whatever the script's hooks close over: a logging dictionary, here)."""
    norms = {}

    def make():
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        for name, p in model.named_parameters():  # before adoption (at .to()): wrapped by the paging
            p.register_hook(lambda g, name=name: norms.__setitem__(name, float(g.norm())))
        return model.to("cpu")

    vb.enable("balanced", banner=False, paging="always", mixed_precision="off")
    try:
        freed = sweep(make)
        paged = vb.get_report()["models"][0]["features"]["paging"]["chosen"]
    finally:
        vb.disable()
    assert paged != "off", "paging did not act: the test proves nothing"
    assert set(norms) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # the hooks ran under paging
    assert freed == [(True, True)] * 2


def test_hugging_face_checkpointing_does_not_keep_the_model(cpu_device):
    """Memory mode turns on the library's own checkpointing; its undo held the model's bound
    ``gradient_checkpointing_disable``."""
    transformers = pytest.importorskip("transformers")

    def make():
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
        return transformers.GPT2LMHeadModel(cfg).train()

    class Wrapped(nn.Module):  # the sweep's loop calls model(x): logits of the last position
        def __init__(self):
            super().__init__()
            self.hf = make()

        def forward(self, x):
            return self.hf(input_ids=x).logits[:, -1, :4]

    vb.enable("memory", banner=False, paging="off", activation_offload=False)
    try:
        freed = sweep(Wrapped, batch=lambda: (torch.randint(0, 64, (2, 16)), torch.randint(0, 4, (2,))))
        how = [m["features"]["activation_checkpointing"]["chosen"] for m in vb.get_report()["models"]]
    finally:
        vb.disable()
    assert all("checkpoint" in h or "blocks" in h or h == "hf" for h in how), how
    assert freed == [(True, True)] * 2
