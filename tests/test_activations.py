"""Activation checkpointing and offload: exact gradients, policies, faults, memory."""
import contextlib
import copy
import functools
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from apt_model.activations.checkpoint import blocks_for_budget, find_blocks, parse_policy
from conftest import clean_env, run_python
from apt_model.errors import ConfigError
from apt_model.memory.swap import SwapCorruptionError, SwapError
from apt_model.models.gpt import GPT, GPTConfig

PLAIN = dict(attention="off", mixed_precision="off", compile="off", paging="off", banner=False)


def gpt(seed=0, layers=4, d=64, seq=64, attn="eager"):
    torch.manual_seed(seed)
    return GPT(GPTConfig(seq_len=seq, d_model=d, n_layers=layers, n_heads=2, dropout=0.1, attn_implementation=attn))


def run(m, steps=4, seed=1, batch=4, seq=64):
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout masks
    losses, grads = [], []
    for _ in range(steps):
        x = torch.randint(0, 256, (batch, seq), generator=gen)
        loss = F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        grads.append([p.grad.clone() for p in m.parameters()])
        opt.step()
        losses.append(loss.item())
    return losses, grads


def same(a, b):
    assert a[0] == b[0]
    for ga, gb in zip(a[1], b[1]):
        for x, y in zip(ga, gb):
            assert torch.equal(x, y)


@pytest.fixture(scope="module")
def reference():
    return run(gpt())


@pytest.mark.parametrize("features", [
    dict(activation_offload=True, activation_checkpointing=False),
    dict(activation_offload=False, activation_checkpointing=True),
    dict(activation_offload=True, activation_checkpointing=True),
    dict(activation_offload=True, activation_checkpointing=True, checkpoint_policy="every:3"),
])
def test_gradients_and_losses_are_bitwise_identical(reference, features, tmp_path):
    m = gpt()
    vb.enable("memory", swap_dir=str(tmp_path), activation_budget="64KB", offload_min_bytes=4096, **PLAIN, **features)
    m.to("cpu")
    got = run(m)
    rep = vb.get_report()["activations"]
    vb.disable()
    same(got, reference)
    if features["activation_offload"]:
        off = rep["offload"]
        assert off["offloaded_bytes"] > 0 and off["to_disk_bytes"] > 0 and off["loaded_bytes"] > 0
    if features["activation_checkpointing"]:
        names = rep["models"][0]["checkpointed"]
        assert names == (["blocks.0", "blocks.3"] if features.get("checkpoint_policy") else
                         ["blocks.0", "blocks.1", "blocks.2", "blocks.3"])
        assert all(m.blocks[i].__dict__.get("forward") is None for i in range(4))  # disable() restored them


@pytest.mark.parametrize("how", ["no backward", "retain_graph"])
def test_a_graph_never_backpropagated_is_freed_with_offload_on(tmp_path, cpu_device, how):
    """A validation loss computed without ``no_grad``, or ``backward(retain_graph=True)`` then
    dropped: the graph and, once the script drops it, the model are freed, as in plain PyTorch.
    Activations offloaded (over 4 KiB) and kept (smaller) both: until 2026-11-28 a handle held a
    saved output tensor whose ``grad_fn`` held the handle, a cycle through C++ never collected."""
    import gc
    import weakref

    vb.enable("memory", swap_dir=str(tmp_path), activation_budget="64KB", offload_min_bytes=4096, **PLAIN,
              activation_offload=True, activation_checkpointing=False)
    try:
        m = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8), nn.Sigmoid()).to("cpu")
        x = torch.randn(64, 64)  # the ReLU's output, saved by ReLU: 64 KiB (offloaded); the Sigmoid's: 2 KiB
        m(x).sum().backward()
        saved = []  # the ReLU's and the Sigmoid's outputs, each saved by its own node
        handles = [m[i].register_forward_hook(lambda mod, args, out: saved.append(weakref.ref(out))) for i in (1, 3)]
        for _ in range(3):
            out = m(x).sum()
            if how == "retain_graph":
                out.backward(retain_graph=True)
            del out
        for h in handles:
            h.remove()
        gc.collect()
        assert len(saved) == 6 and [r() for r in saved] == [None] * 6
        assert vb.get_report()["activations"]["offload"]["offloaded_bytes"] > 0
        weight = weakref.ref(m[0].weight)
        del m
        gc.collect()
        assert weight() is None
    finally:
        vb.disable()


def test_checkpointing_really_recomputes(tmp_path):
    m = gpt()
    vb.enable("balanced", checkpointing=True, **PLAIN)
    m.to("cpu")
    run(m, steps=1)
    calls = [m.blocks[i].forward.calls for i in range(4)]
    feat = vb.get_report()["models"][0]["features"]["activation_checkpointing"]
    buf = io.BytesIO()
    torch.save(m, buf)  # a whole-model checkpoint while the blocks' forwards are the switch's
    copied = copy.deepcopy(m)
    vb.disable()
    assert calls == [1, 1, 1, 1] and feat["chosen"] == "4/4 blocks" and "non-reentrant" in feat["reason"]
    buf.seek(0)
    for plain in (torch.load(buf, weights_only=False), copied):  # plain models: the class's own forward
        assert all(b.forward.__func__ is type(b).forward for b in plain.blocks)
        x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(3))
        assert torch.equal(plain.eval()(x), m.eval()(x))


def test_budget_policy_measures_first_then_checkpoints_the_fewest(tmp_path):
    m = gpt(layers=6)
    vb.enable("balanced", checkpointing=True, checkpoint_policy="budget", activation_budget="1MB", **PLAIN)
    m.to("cpu")
    run(m, steps=1)
    rep = vb.get_report()
    measured = rep["activations"]["models"][0]["measured"]
    chosen = rep["activations"]["models"][0]["checkpointed"]
    assert measured["total"] > 1_000_000 and 0 < len(chosen) <= 6
    assert measured["after"] <= 1_000_000 or len(chosen) == 6
    # one block fewer would not have fitted
    if len(chosen) < 6:
        assert len(blocks_for_budget(measured["per_block"], measured["block_inputs"], measured["outside"],
                                     1_000_000)) == len(chosen)
    assert all(hasattr(m.blocks[int(n.split(".")[1])], "forward") for n in chosen)
    decisions = [d for d in rep["decisions"] if d["feature"] == "activation_checkpointing"]
    assert decisions[0]["chosen"] == "measuring" and decisions[-1]["chosen"].endswith("blocks")


def test_policies_and_bad_values():
    assert parse_policy("all") == ("all", 1) and parse_policy("every:2") == ("every", 2)
    assert parse_policy("budget") == ("budget", 0)
    for bad in ("every:0", "some", "every:x"):
        with pytest.raises(ConfigError, match="checkpoint_policy"):
            parse_policy(bad)
    with pytest.raises(ConfigError, match="checkpoint_policy='half'"):
        vb.enable(checkpoint_policy="half", banner=False)
    with pytest.raises(ConfigError, match="name the same option"):
        vb.enable(checkpointing=True, activation_checkpointing=True, banner=False)
    assert find_blocks(torch.nn.Linear(3, 3)) is None
    blocks = find_blocks(gpt())
    assert blocks.name == "blocks" and blocks.kind == "Block" and len(blocks.modules) == 4


def test_hugging_face_layers_use_the_library_checkpointing():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=3, n_head=2, bos_token_id=0,
                                  eos_token_id=0, use_cache=False)

    def hf_run(enabled):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
        if enabled:
            vb.enable("balanced", checkpointing=True, checkpoint_policy="every:2", **PLAIN)
            model.to("cpu")
        model.train()
        torch.manual_seed(1)
        x = torch.randint(0, 256, (2, 64))
        out = model(x, labels=x)
        out.loss.backward()
        flags = [layer.gradient_checkpointing for layer in model.transformer.h]
        grads = [p.grad.clone() for p in model.parameters()]
        vb.disable()
        return out.loss.item(), grads, flags, model

    ref_loss, ref_grads, _, _ = hf_run(False)
    loss, grads, flags, model = hf_run(True)
    assert flags == [True, False, True]
    assert loss == ref_loss and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert not any(layer.gradient_checkpointing for layer in model.transformer.h)  # restored


def test_generate_in_train_mode_keeps_its_cache_with_the_librarys_checkpointing_on(cpu_device):
    """GPT-2 drops its KV cache whenever ``gradient_checkpointing and training``, even under
    ``no_grad``: ``generate()`` called before ``model.eval()`` lost its context once the switch had
    turned the library's checkpointing on (scores off by 0.55: a probe's finding). The flags go
    off for calls without grad."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=3, n_head=2, resid_pdrop=0,
                                  embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0)

    def run(enabled):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg).train()
        if enabled:
            vb.enable("memory", activation_checkpointing=True, activation_offload=False, fp4="off", **PLAIN)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids).loss.backward()
        out = model.generate(ids[:1, :6], max_new_tokens=8, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
        flags = [layer.gradient_checkpointing for layer in model.transformer.h]
        return out.sequences, torch.stack(out.scores), flags

    ref_tokens, ref_scores, _ = run(False)
    tokens, scores, flags = run(True)
    assert vb.get_report()["models"][0]["features"]["activation_checkpointing"]["chosen"] != "off"
    assert all(flags)  # still on for training calls
    assert torch.equal(tokens, ref_tokens) and torch.equal(scores, ref_scores)


def test_the_librarys_flags_stay_off_until_the_outermost_call_without_grad_ends(cpu_device):
    """A no-grad call nested in another (a hook of the script calling the model) turned the flags
    back on when it ended, while the outer call still ran (a review probe's observation)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).train()
    vb.enable("memory", activation_checkpointing=True, activation_offload=False, fp4="off", **PLAIN)
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()  # adopted; the library's flags on
    seen, nested = [], [True]

    def hook(module, args, output):
        if nested[0]:
            nested[0] = False
            model(input_ids=ids)  # a nested no-grad call
            seen.append(model.transformer.gradient_checkpointing)

    handle = model.transformer.h[1].register_forward_hook(hook)
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    assert seen == [False] and model.transformer.gradient_checkpointing is True


def test_works_with_paging_and_autocast(tmp_path):
    ref_m = gpt()
    vb.enable("balanced", attention="off", mixed_precision="bf16", compile="off", paging="off", banner=False)
    ref_m.to("cpu")
    ref = run(ref_m, steps=3)
    vb.disable()
    m = gpt()
    vb.enable("memory", swap_dir=str(tmp_path), attention="off", mixed_precision="bf16", compile="off", paging="always",
              device_budget="4KB", activation_budget="64KB", offload_min_bytes=4096, banner=False)
    m.to("cpu")
    got = run(m, steps=3)
    stats = vb.get_stats()
    vb.disable()
    same(got, ref)
    assert stats["levels"][0]["misses"] > 0 and stats["autocast_calls"] >= 3


def test_a_full_disk_during_offload_is_an_error_not_a_wrong_gradient(tmp_path, monkeypatch):
    from apt_model.memory import swap as swap_mod

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    m = gpt()
    vb.enable("balanced", activation_offload=True, swap_dir=str(tmp_path), activation_budget="64KB",
              offload_min_bytes=4096, **PLAIN)
    m.to("cpu")
    monkeypatch.setattr(swap_mod.os, "pwrite", full)
    with pytest.raises(SwapError, match="is full"):
        run(m, steps=2)


def test_swap_folder_disappearing_mid_run_is_reported(tmp_path):
    import shutil

    m = gpt()
    vb.enable("balanced", activation_offload=True, swap_dir=str(tmp_path), activation_budget="64KB",
              offload_min_bytes=4096, **PLAIN)
    m.to("cpu")
    x = torch.randint(0, 256, (4, 64))
    loss = F.cross_entropy(m(x).reshape(-1, 256), x.reshape(-1))
    from apt_model.switch.controller import session as vb_session

    off = vb_session().activations.offloader
    off.io.submit_write(0, lambda: None).result()  # let queued writes land
    assert off.stats.to_disk_bytes > 0
    for child in tmp_path.iterdir():
        shutil.rmtree(child)
    with pytest.raises((SwapCorruptionError, SwapError)):
        loss.backward()


PEAK = """
import sys, threading, time, psutil, torch, torch.nn.functional as F
torch.set_num_threads(2)
import apt_model.optimization.vb_global as vb
from apt_model.models.gpt import GPT, GPTConfig
from apt_model.memory.host import release_free_memory
proc = psutil.Process()
torch.manual_seed(0)
m = GPT(GPTConfig(seq_len=1024, d_model=256, n_layers=4, n_heads=4, attn_implementation="eager"))
if sys.argv[1] == "memory":
    vb.enable("memory", mixed_precision="off", attention="off", banner=False)
m.to("cpu")
opt = torch.optim.SGD(m.parameters(), lr=1e-3)
x = torch.randint(0, 256, (2, 1024))
def step():
    loss = F.cross_entropy(m(x).reshape(-1, 256), x.reshape(-1)); opt.zero_grad(); loss.backward(); opt.step()
step(); release_free_memory()
base = proc.memory_info().rss; peak = [base]; stop = [False]
def sample():
    while not stop[0]:
        peak[0] = max(peak[0], proc.memory_info().rss); time.sleep(0.0005)
th = threading.Thread(target=sample); th.start(); step(); stop[0] = True; th.join()
print("PEAK", peak[0] - base)
"""


@pytest.mark.slow  # ~34 s on 2 cores (two fresh processes at seq 1024); the default suite keeps to its 15 minutes
def test_memory_mode_cuts_peak_rss_at_seq_1024(tmp_path):
    """Peak RSS above the pre-step level during one training step of a GPT at seq 1024, measured
    with psutil (sampled every 0.5 ms) in fresh processes: memory mode vs the switch off."""
    import subprocess
    import sys

    from conftest import clean_env

    script = tmp_path / "peak.py"
    script.write_text(PEAK)
    peaks = {}
    for mode in ("off", "memory"):
        proc = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True,
                              env=clean_env(VB_SWAP_DIR=str(tmp_path)), timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        peaks[mode] = int(proc.stdout.split("PEAK", 1)[1])
    assert peaks["off"] > 100 * 2**20  # the attention maps alone are ~250 MB at this size
    assert peaks["memory"] < 0.75 * peaks["off"], peaks


def test_offload_follows_the_models_device_not_the_selected_one(tmp_path):
    """On the H100 the switch selected cuda:0 while these tests keep their model on the CPU
    (``m.to("cpu")``): the offloader was built for cuda, the CPU activations were never eligible,
    and nothing was offloaded. A model's activations are offloaded for the device the model is
    on — a CPU model straight to the swap files, as on a CPU-only run — whatever was selected.
    The accelerator is only named here (no CUDA call is made), so this runs on any machine."""
    from types import SimpleNamespace

    from apt_model.activations.manager import ActivationManager
    from apt_model.memory.levels import VGPUStack
    from apt_model.base.patches import PatchSet

    reference = run(gpt(), steps=2)
    stack = VGPUStack("cuda:0", device_budget="1MB", host_budget="64MB", swap_dir=str(tmp_path), measure=False)
    config = SimpleNamespace(activation_checkpointing=False, activation_offload=True, activation_budget="64KB",
                             offload_min_bytes=4096, checkpoint_policy="all")
    patches = PatchSet()
    manager = ActivationManager(config, patches, stack, torch.device("cuda:0"))
    decisions = []
    m = gpt()
    rec = SimpleNamespace(scope="model 1", device="cpu")
    try:
        decision = manager.decide_offload(rec)
        assert decision.act
        decision = manager.apply_offload(m, rec, decision)
        decisions.append((decision.feature, decision.chosen, decision.reason))
        got = run(m, steps=2)
        rep = manager.report()
    finally:
        patches.restore_all()
        stack.close()
    same(got, reference)
    off = rep["offload"]
    assert list(off["devices"]) == ["cpu"] and rep["models"][0]["offload"]["device"] == "cpu"
    assert off["offloaded_bytes"] > 0 and off["to_disk_bytes"] > 0 and off["loaded_bytes"] > 0
    assert ("activation_offload", "on") in [(f, c) for f, c, _ in decisions]
    assert any("swap files" in why for f, _, why in decisions if f == "activation_offload")


def _accelerator() -> torch.device:
    from conftest import require_accelerator

    return require_accelerator()


@pytest.mark.gpu
def test_offload_on_the_accelerator_goes_to_pinned_host_memory_and_is_exact(tmp_path, monkeypatch):
    """A model on the accelerator: saved activations beyond the budget go to the pinned host level
    (device-to-host copies, not the swap files while the host level has room), come back for
    backward, and the gradients are bitwise those of plain training on the same device under
    deterministic algorithms."""
    dev = _accelerator()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        def run_on(m):
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
            gen = torch.Generator().manual_seed(1)
            torch.manual_seed(1)
            losses, grads = [], []
            for _ in range(3):
                x = torch.randint(0, 256, (4, 64), generator=gen).to(dev)
                loss = F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1))
                opt.zero_grad()
                loss.backward()
                grads.append([p.grad.cpu() for p in m.parameters()])
                opt.step()
                losses.append(loss.item())
            return losses, grads

        reference = run_on(gpt().to(dev))
        m = gpt()
        vb.enable("memory", swap_dir=str(tmp_path), activation_budget="64KB", offload_min_bytes=4096,
                  activation_offload=True, activation_checkpointing=False, **PLAIN)
        m.to(dev)
        got = run_on(m)
        from apt_model.switch.controller import session as vb_session

        off = vb_session().activations.offloader
        rep = vb.get_report()["activations"]["offload"]
        pinned = off.host is not None and all(s.is_pinned() for s in off.host.slabs)
        vb.disable()
    finally:
        torch.use_deterministic_algorithms(was)
    same(got, reference)
    assert str(off.device).startswith(dev.type) and off.host is not None and pinned
    assert rep["offloaded_bytes"] > 0 and rep["loaded_bytes"] > 0


def bn_blocks():
    """Three ``Linear`` + ``BatchNorm1d`` blocks, seeded: the blocks checkpointing finds."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))
                                 for _ in range(3)])


def checkpointed_and_plain(build, train):
    """``train(build())`` in plain PyTorch, then again with the switch checkpointing the blocks:
    (the plain model, the checkpointed one, the checkpointed calls its blocks made, the model's
    ``activation_checkpointing`` decision)."""
    ref = train(build())
    m = build()
    vb.enable("balanced", checkpointing=True, **PLAIN)
    try:
        m.to("cpu")
        train(m)
        feat = vb.get_report()["models"][0]["features"]["activation_checkpointing"]
        calls = sum(b.forward.calls for b in m if "forward" in vars(b))
    finally:
        vb.disable()
    return ref, m, calls, feat


def _sgd_losses(model, shape, steps=3, total=False):
    """``steps`` SGD steps (lr 0.1) of ``model`` on seeded random inputs of ``shape``, the loss the
    mean (``total``: the sum) of its squared outputs; returns the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(*shape, generator=gen)).square()
        loss = loss.sum() if total else loss.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_checkpointed_batch_norm_updates_its_running_statistics_once(cpu_device):
    """The recomputation in backward re-runs the block's batch norm in training mode: its running
    statistics were updated twice per step (``num_batches_tracked`` 6 for 3 steps). They are put
    back after the recomputation, so the model evaluates exactly as after plain training."""
    def train(m):
        _sgd_losses(m, (8, 16))
        return m

    ref, m, calls, feat = checkpointed_and_plain(bn_blocks, train)
    assert feat["chosen"] != "off" and calls > 0, feat
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), m.state_dict().values()))
    assert m[0][1].num_batches_tracked.item() == 3


def test_a_graph_backpropagated_twice_recomputes_its_checkpointed_blocks_twice(cpu_device):
    """``backward(retain_graph=True)`` then a second backward through the same graph (a penalty on
    the output): each backward recomputes every checkpointed block, with the RNG state and buffers
    its forward saw. Until 2026-11-26 the second recomputation raised ``AttributeError:
    '_GeneratorContextManager' object has no attribute 'args'`` at the first step."""
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16),
                                                         torch.nn.Dropout(0.2)) for _ in range(3)])

    def train(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        torch.manual_seed(2)  # dropout
        for _ in range(3):
            out = m(torch.randn(8, 16, generator=gen))
            opt.zero_grad()
            out.square().mean().backward(retain_graph=True)
            out.abs().mean().backward()
            opt.step()
        return m

    ref, m, calls, _ = checkpointed_and_plain(build, train)
    assert calls > 0
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), m.state_dict().values()))


@pytest.mark.parametrize("moved", [True, False], ids=["adopted_before", "first_call_in_the_transform"])
def test_torch_func_grad_runs_through_checkpointed_and_offloaded_blocks(tmp_path, cpu_device, moved):
    """``torch.func.grad`` refuses saved-tensor hooks, which non-reentrant checkpointing and
    activation offload are built on: it raised "torch.func.{grad, vjp, jacrev, hessian} don't yet
    support saved tensor hooks" in memory mode. Inside a ``torch.func`` transform both stand aside.
    A model whose first call runs inside the transform (per-sample gradients, DP-SGD style) is
    adopted at its first ordinary call: adopting it there crashed on the transform's tensor
    wrappers ("Cannot access storage of TensorWrapper")."""
    from torch.func import functional_call, grad

    def build():
        torch.manual_seed(0)
        return GPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=2, dropout=0.0))

    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))

    def grads(m):
        params = {k: v.detach() for k, v in m.named_parameters()}
        return grad(lambda p: F.cross_entropy(functional_call(m, p, (x,)).reshape(-1, 256), x.reshape(-1)))(params)

    ref = grads(build())
    m = build()
    vb.enable("memory", swap_dir=str(tmp_path), activation_budget="64KB", offload_min_bytes=4096, **PLAIN)
    try:
        if moved:
            m.to("cpu")
        got = grads(m)
        assert len(vb.get_report()["models"]) == (1 if moved else 0)
        m(x).sum().backward()  # outside a transform the features still work
        feats = vb.get_report()["models"][0]["features"]
        calls = [b.forward.calls for b in m.blocks]
    finally:
        vb.disable()
    assert feats["activation_checkpointing"]["chosen"] != "off" and feats["activation_offload"]["chosen"] == "on"
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    assert calls == [1, 1]  # only the plain call was checkpointed


def test_per_sample_gradients_with_the_models_buffers_run_under_activation_offload(tmp_path, cpu_device):
    """PyTorch's per-sample-gradients recipe passes the buffers too: ``vmap(grad(loss))`` over
    ``functional_call(model, (params, buffers), x)``. The offload's pre-hook asked each buffer for
    its storage before standing aside, and the transform's wrappers have none: "Cannot access
    storage of TensorWrapper" at the first step (a probe's finding). Bitwise as plain PyTorch."""
    from torch.func import functional_call, grad, vmap

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mu", torch.full((16,), 0.25))
            self.l1, self.l2 = nn.Linear(16, 64), nn.Linear(64, 1)

        def forward(self, x):
            return self.l2(torch.tanh(self.l1(x - self.mu)))

    gen = torch.Generator().manual_seed(1)
    X, Y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)

    def train(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)

        def loss(params, buffers, x, y):
            return F.mse_loss(functional_call(m, (params, buffers), (x.unsqueeze(0),)), y.unsqueeze(0))

        for _ in range(3):
            params = {k: v.detach() for k, v in m.named_parameters()}
            buffers = {k: v.detach() for k, v in m.named_buffers()}
            g = vmap(grad(loss), in_dims=(None, None, 0, 0))(params, buffers, X, Y)
            for k, p in m.named_parameters():
                p.grad = g[k].mean(0)
            opt.step()
            F.mse_loss(m(X), Y).backward()  # an ordinary call too: the features act there
            opt.zero_grad()
        return m

    torch.manual_seed(0)
    ref = train(Net())
    torch.manual_seed(0)
    m = Net()
    vb.enable("memory", swap_dir=str(tmp_path), activation_budget="4KB", offload_min_bytes=256, **PLAIN)
    try:
        m.to("cpu")
        train(m)
        feats = vb.get_report()["models"][0]["features"]
    finally:
        vb.disable()
    assert feats["activation_offload"]["chosen"] == "on"
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), m.state_dict().values()))


def test_an_interrupted_forward_leaves_no_offload_hooks_behind(tmp_path, cpu_device):
    """A ``KeyboardInterrupt`` skips the forward hook that leaves the offload's saved-tensor hooks:
    they stayed pushed on the thread (every later graph offloaded), after ``disable()`` too. The
    next call of the model leaves them first; ``disable()`` leaves any still pushed."""
    class Interrupted(GPT):
        interrupt = False

        def forward(self, x):
            y = super().forward(x)
            if self.interrupt:
                raise KeyboardInterrupt
            return y

    def top():
        return torch._C._autograd._top_saved_tensors_default_hooks(False)

    torch.manual_seed(0)
    m = Interrupted(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=2, dropout=0.0))
    x = torch.randint(0, 256, (2, 32))
    vb.enable("memory", swap_dir=str(tmp_path), activation_budget="64KB", offload_min_bytes=4096, **PLAIN)
    try:
        m.to("cpu")
        for then in ("call again", "disable"):
            m.interrupt = True
            try:
                m(x)
            except KeyboardInterrupt:
                pass
            assert top() is not None  # until the next call or disable()
            m.interrupt = False
            if then == "call again":
                m(x).sum().backward()
                assert top() is None
    finally:
        vb.disable()
    assert top() is None


def test_the_scripts_own_saved_tensor_hooks_still_see_the_models_tensors(tmp_path, cpu_device):
    """Activation offload pushed its hooks inside the model's forward, so the script's own
    ``saved_tensors_hooks`` around the call (its offload or compression) no longer saw the tensors
    the model saved. Offload now stands aside while outer hooks are active."""
    def run(m):
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t, lambda t: t):
            loss = m(torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))).sum()
        loss.backward()
        return len(packed)

    def build():
        torch.manual_seed(0)
        return GPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=2, dropout=0.0))

    plain = run(build())
    m = build()
    vb.enable("memory", swap_dir=str(tmp_path), activation_budget="64KB", offload_min_bytes=4096,
              **{**PLAIN, "activation_checkpointing": False})
    try:
        m.to("cpu")
        seen = run(m)
        offloaded = vb.get_report()["activations"]["offload"]["offloaded_bytes"]
    finally:
        vb.disable()
    assert plain > 10 and seen == plain and offloaded == 0


def test_a_saved_activation_modified_in_place_raises_as_without_the_switch(tmp_path, cpu_device):
    """A sigmoid's output (saved for its backward) changed in place afterwards: plain PyTorch
    raises at backward. Activation offload's pack hook returned tensors too small to offload
    bare, and autograd leaves the version check to the hook once there is one: backward used
    the modified value, silently (wrong gradients)."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

        def forward(self, x):
            h = torch.sigmoid(self.a(x))
            out = self.b(h)
            h.add_(1.0)
            return out.sum()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        M()(torch.randn(4, 8)).backward()
    vb.enable("memory", swap_dir=str(tmp_path), **PLAIN)
    try:
        m = M().to("cpu")
        assert vb.get_report()["models"][0]["features"]["activation_offload"]["chosen"] != "off"
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            m(torch.randn(4, 8)).backward()
    finally:
        vb.disable()


@contextlib.contextmanager
def offloading(tmp_path, budget: int, host_budget: int | None):
    """An :class:`ActivationOffloader` on the CPU (keeping ``budget`` bytes of activations, with a
    host level of ``host_budget`` bytes or none) as the saved-tensor hooks of the block; closed
    after it."""
    from apt_model.activations.offload import ActivationOffloader
    from apt_model.memory.swap import SwapSpace

    off = ActivationOffloader(budget, SwapSpace(tmp_path), "cpu", min_bytes=16, host_budget=host_budget,
                              host_pin=False)
    try:
        with torch.autograd.graph.saved_tensors_hooks(off.pack, off.unpack):
            yield off
    finally:
        off.close()


@pytest.mark.parametrize("host_budget", [None, 1 << 20], ids=["disk", "host-level"])
@pytest.mark.parametrize("when", ["before-offload", "after-offload"])
def test_an_offloaded_activation_modified_in_place_raises_at_backward(tmp_path, host_budget, when):
    """A sigmoid's saved output changed in place while the offloader holds it: plain PyTorch raises
    at backward. Below an accelerator (a host level, the CPU standing in) the offloader copied the
    changed bytes to the host (changed before its offload) and backward used them: wrong gradients,
    silently. Changed after its bytes went below, backward used the old bytes where plain PyTorch
    raises. Both now raise, on the disk path too — the second only while the caller still holds
    the tensor object (here ``a``; see the module docstring of activations/offload.py)."""
    with offloading(tmp_path, 1 if when == "after-offload" else 5000, host_budget) as off:
        x = torch.randn(1024, requires_grad=True)
        a = torch.sigmoid(x * 1.0)  # saves its output (4 KiB)
        if when == "before-offload":
            with torch.no_grad():
                a.mul_(2)  # still held in memory
        b = torch.exp(x * 1.0)  # this pack sends ``a`` below
        if when == "after-offload":
            with torch.no_grad():
                a.mul_(2)
        assert off.stats.packed == 2
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (a.sum() + b.sum()).backward()


@pytest.mark.parametrize("host_budget", [None, 1 << 20], ids=["disk", "host-level"])
def test_a_second_backward_reads_an_offloaded_activation_saved_after_an_in_place_op(tmp_path, host_budget):
    """``F.relu(h, inplace=True)`` saves ``h`` at version 1. Read back from the host level its copy
    is a new tensor at version 0, and the second backward of ``retain_graph=True`` compared that
    with the saved version 1: a false "modified by an inplace operation" error where plain
    PyTorch (and the disk path) trains on. Both paths now give plain PyTorch's gradients."""
    def forward():
        torch.manual_seed(0)
        x = torch.randn(2048, requires_grad=True)
        h = x * 2.0
        F.relu(h, inplace=True)  # relu_ saves its output: h at version 1
        return x, h.exp().sum()  # exp saves its output: the next pack sends h below

    def grads(x, loss):
        loss.backward(retain_graph=True)
        loss.backward()
        return x.grad

    with offloading(tmp_path, 1, host_budget) as off:
        got = grads(*forward())
        assert off.stats.offloaded >= 1
    assert torch.equal(got, grads(*forward()))


def test_an_activation_larger_than_the_host_level_stays_in_memory(tmp_path):
    """With the offloader's host pool a quarter of the host level, an activation larger than that
    pool raised MemoryError from the pack hook (forward crashed). It now stays in memory
    (``kept_too_big``), and backward gives plain PyTorch's gradients."""
    def forward():
        torch.manual_seed(0)
        x = torch.randn(64 * 1024, requires_grad=True)  # 256 KiB activations
        return x, (x * 1.0).sigmoid().exp().sum()

    def grads(x, loss):
        loss.backward()
        return x.grad

    with offloading(tmp_path, 1, 128 * 1024) as off:
        got = grads(*forward())
        assert off.stats.kept_too_big >= 1 and off.stats.offloaded == 0
    assert torch.equal(got, grads(*forward()))


def test_a_graph_dropped_without_backward_gives_its_host_segments_back(tmp_path):
    """Forwards whose graphs are dropped without a backward (an evaluation run with grad enabled):
    the offloader's host level held every offloaded handle, so their segments stayed in use until
    the pool was full, and then each new offload wrote a dead activation to the swap files. The
    host level now holds its handles weakly: a dropped graph's segments go back to the pool."""
    torch.manual_seed(0)
    w = torch.randn(256, 256, requires_grad=True)
    with offloading(tmp_path, 1 << 10, 16 << 20) as off:
        used = []
        for _ in range(6):
            h = torch.randn(128, 256)
            for _ in range(8):
                h = torch.tanh(h @ w)  # saves h and its output: 128 KiB each
            del h  # the graph goes, never backpropagated
            used.append(off.host.used)
        assert off.stats.offloaded > 40
    assert off.stats.to_disk_bytes == 0  # nothing dead was spilled
    assert max(used) <= 2 * used[0] < off.host.budget  # one or two graphs' worth, not the whole pool


def test_the_activation_offloader_takes_a_quarter_of_the_host_level_on_an_accelerator():
    """On an accelerator the paging level and the activation offloader each keep a pinned pool.
    Both were sized to the whole host level, so pinned memory could reach twice the host budget;
    the offloader's is now a quarter of it. A model on the CPU, or a host that is level 0, has no
    host pool for activations (straight to disk)."""
    from types import SimpleNamespace

    from apt_model.activations.manager import ActivationManager

    stack = SimpleNamespace(shared_host=False, levels=[None, SimpleNamespace(capacity=8 * 2**30)])
    manager = ActivationManager(SimpleNamespace(), None, stack, torch.device("cuda", 0))
    assert manager.host_budget("cuda:0") == 2 * 2**30
    assert manager.host_budget("cpu") is None
    assert ActivationManager(SimpleNamespace(), None, SimpleNamespace(shared_host=True), "cpu").host_budget("cuda") is None


def _three_blocks(make_block, outputs: int) -> torch.nn.Sequential:
    """Linear(8, 16), three blocks of width 16 made by ``make_block``, Linear(16, ``outputs``); seeded."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), *[make_block() for _ in range(3)],
                               torch.nn.Linear(16, outputs))


def _checkpointed_run(m, train, mode: str, tmp_path, **settings):
    """``train(m)`` with the switch on (``mode``, :data:`PLAIN` and ``settings``); returns its result
    and the number of calls the switch checkpointed in ``m``'s blocks."""
    vb.enable(mode, swap_dir=str(tmp_path), **PLAIN, **settings)
    try:
        m.to("cpu")
        got = train(m)
        calls = sum(b.forward.calls for b in m if "forward" in vars(b))
    finally:
        vb.disable()
    return got, calls


#: a generator kept at module level, as scripts do (``GEN = torch.Generator()``)
_MODULE_GENERATOR = torch.Generator()


class _InPlaceBlock(torch.nn.Module):
    def __init__(self, source=None):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.source = source
        self.gen = torch.Generator().manual_seed(5) if source == "generator" else None
        if source == "module-generator":  # reseeded for each model built: the reference and the switch's
            _MODULE_GENERATOR.manual_seed(5)
        self.gens = [torch.Generator().manual_seed(5)] if source == "listed-generator" else []
        if source == "buffer":
            self.register_buffer("ema", torch.zeros(16))
            self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.source is None:
            x.mul_(0.5)  # in place on the block's input: allowed by autograd here
            return self.lin(x) + x
        if self.source == "buffer":  # state the forward updates in place and reads
            self.ema.mul_(0.9).add_(x.detach().mean(0), alpha=0.1)
            self.count += 1
            return x + torch.tanh(self.lin(x)) * self.ema
        import random

        import numpy as np

        if self.source == "python":  # LayerDrop-style: skip the layer now and then
            return x if random.random() < 0.3 else x + torch.tanh(self.lin(x))
        if self.source == "numpy":
            mask = torch.from_numpy((np.random.rand(*x.shape) > 0.5).astype("float32"))
        elif self.source == "module-generator":
            mask = (torch.rand(x.shape, generator=_MODULE_GENERATOR) > 0.5).float()
        elif self.source == "listed-generator":
            mask = (torch.rand(x.shape, generator=self.gens[0]) > 0.5).float()
        else:
            mask = (torch.rand(x.shape, generator=self.gen) > 0.5).float()
        return x + torch.tanh(self.lin(x)) * mask


@pytest.mark.parametrize("source", [None, "python", "numpy", "generator", "module-generator", "listed-generator",
                                    "buffer"],
                         ids=["input-modified-in-place", "python-random", "numpy-random", "own-generator",
                              "module-level-generator", "generator-in-a-list", "buffer-updated-in-place"])
@pytest.mark.parametrize("mode", ["memory", "checkpointing"])
def test_a_checkpointed_block_is_recomputed_from_what_its_forward_saw(tmp_path, cpu_device, source, mode):
    """The recomputation in backward must start where the forward did. A block that modified its
    input in place was recomputed from the modified input (memory mode: wrong gradients, silently;
    checkpointing alone: torch's check raised where plain PyTorch does not). A block drawing from
    Python's ``random``, NumPy's global generator or a ``torch.Generator`` of its own drew again:
    different masks (wrong gradients) or a different number of saved tensors (CheckpointError).
    A block updating a buffer in place (an EMA it reads, a step counter) updated it again and read
    the updated value (wrong gradients, counters at twice the steps). The recomputation now starts
    from a copy of the input, from those generators' states and from the buffers' values. A
    generator the block does not hold as an attribute (module level, in a list) was not tracked:
    other masks, silently (a probe's finding); the first call notes every generator it draws from."""
    import random

    import numpy as np

    def build():
        return _three_blocks(lambda: _InPlaceBlock(source), 1)

    def train(m):
        random.seed(3)
        np.random.seed(3)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        grads = []
        for _ in range(3):
            loss = (m(torch.randn(4, 8, generator=gen)) * 1.0).square().mean()
            opt.zero_grad()
            loss.backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in m.parameters()])
            opt.step()
        grads.append(list(m.state_dict().values()))  # the buffers too
        return grads, (random.random(), np.random.rand())

    ref = train(build())
    got, calls = _checkpointed_run(build(), train, "memory" if mode == "memory" else "balanced", tmp_path,
                                   **({"checkpointing": True} if mode == "checkpointing" else {}))
    assert calls > 0  # the blocks were checkpointed
    assert got[1] == ref[1]  # the generators end where they would have
    for ga, gb in zip(ref[0], got[0]):
        for a, b in zip(ga, gb):
            assert (a is None and b is None) or torch.equal(a, b)


def test_module_buffers_saved_for_backward_are_never_offloaded(tmp_path, cpu_device):
    """Batch norm saves its running statistics for backward and then updates them in place
    without bumping their version: offloading them raced that update (the write's checksum no
    longer matched the file: an intermittent SwapCorruptionError at backward). A module's buffer
    stays alive anyway, so offloading it freed nothing. Tensors on a buffer's storage are kept."""
    torch.manual_seed(0)
    c = 256
    m = torch.nn.Sequential(torch.nn.Conv2d(c, c, 1), torch.nn.BatchNorm2d(c), torch.nn.Conv2d(c, c, 1))
    x = torch.randn(2, c, 1, 1)
    min_bytes = c * 4  # one channel vector: the running statistics qualify by size
    buffers = {b.untyped_storage().data_ptr() for b in m.buffers()}
    sizes = {"all": 0, "buffers": 0}

    def pack(t):
        if t.numel() * t.element_size() >= min_bytes and not isinstance(t, torch.nn.Parameter) \
                and not isinstance(t._base, torch.nn.Parameter):
            sizes["all"] += 1
            sizes["buffers"] += t.untyped_storage().data_ptr() in buffers
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x).sum()
    assert sizes["buffers"] == 2  # running_mean and running_var are saved for backward
    vb.enable("memory", swap_dir=str(tmp_path), activation_budget="1KB", offload_min_bytes=min_bytes,
              activation_checkpointing=False, **PLAIN)
    try:
        m.to("cpu")
        m(x).sum().backward()
        packed = vb.get_report()["activations"]["offload"]["packed"]
    finally:
        vb.disable()
    assert packed == sizes["all"] - sizes["buffers"] > 0


def test_buffers_replayed_after_the_model_is_cast_are_its_new_ones(cpu_device):
    """A block's changed buffers are learned at its first call. ``model.double()`` afterwards puts
    new tensors in the modules' buffers: the replay held the old ones, so the recomputation updated
    the running statistics a second time again (``num_batches_tracked`` 5 for 3 steps)."""
    def train(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        for step in range(3):
            if step == 1:
                m.double()
            loss = m(torch.randn(8, 16, generator=gen, dtype=next(m.parameters()).dtype)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return m

    ref, m, calls, _ = checkpointed_and_plain(bn_blocks, train)
    assert calls > 3
    assert m[0][1].num_batches_tracked.item() == 3
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), m.state_dict().values()))


def test_functional_call_with_computed_weights_is_not_recomputed_with_the_modules_own(tmp_path, cpu_device):
    """``torch.func.functional_call(model, fast_weights, x)`` then ``torch.autograd.grad`` (MAML's
    inner loop): a checkpointed block recomputed in backward after the call had put the module's
    own parameters back, and used them: gradients off by up to 0.03, silently. Such a call now runs
    uncheckpointed; gradients are bitwise those of plain PyTorch, and ordinary calls stay
    checkpointed."""
    from torch.func import functional_call

    def build():
        torch.manual_seed(0)
        return GPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=2, dropout=0.0))

    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))

    def grads(m):
        fast = {k: (v * 0.5).detach().requires_grad_() for k, v in m.named_parameters()}
        loss = F.cross_entropy(functional_call(m, fast, (x,)).reshape(-1, 256), x.reshape(-1))
        return torch.autograd.grad(loss, list(fast.values()))

    ref = grads(build())
    m = build()
    vb.enable("memory", swap_dir=str(tmp_path), activation_checkpointing=True, **PLAIN)
    try:
        m.to("cpu")
        got = grads(m)
        swapped_calls = [b.forward.calls for b in m.blocks]
        m(x).sum().backward()
        calls = [b.forward.calls for b in m.blocks]
    finally:
        vb.disable()
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert swapped_calls == [0, 0] and calls == [1, 1]


def test_a_deep_copy_of_a_checkpointed_model_is_freed_once_dropped(tmp_path, cpu_device):
    """``copy.deepcopy`` of a model whose blocks are checkpointed (an EMA or frozen reference copy
    in memory mode) leaves each copied block's forward bound in its own ``__dict__``; the undo stack
    kept that bound method when the copy was adopted, and with it the block, until ``disable()``.
    A dropped copy is freed now, and ``disable()`` still restores the original's forwards."""
    import gc
    import weakref

    torch.manual_seed(0)
    m = GPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=2, dropout=0.0))
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    vb.enable("memory", swap_dir=str(tmp_path), activation_checkpointing=True, **PLAIN)
    try:
        m.to("cpu")
        m(x).sum().backward()
        c = copy.deepcopy(m)
        c(x).sum().backward()
        assert c.blocks[0].forward.calls == 1  # the copy was adopted: its blocks are checkpointed
        block = weakref.ref(c.blocks[0])
        del c
        gc.collect()
        assert block() is None
    finally:
        vb.disable()
    assert "forward" not in vars(m.blocks[0])  # the class's forward again


def test_a_model_adopted_at_its_first_forward_is_measured_and_offloaded_from_that_forward(tmp_path):
    """Adopted inside its first forward (never moved with ``.to()``), the hooks the activation
    steps add were not run for that call: the budget policy measured 0 bytes and checkpointed
    nothing, and the first step - often the peak - offloaded nothing (a probe's findings)."""
    m = gpt(layers=6)
    vb.enable("memory", swap_dir=str(tmp_path), checkpoint_policy="budget", activation_budget="1MB",
              activation_offload=False, **PLAIN)
    run(m, steps=1)
    rep = vb.get_report()["activations"]
    assert rep["models"][0]["measured"]["total"] > 1_000_000 and rep["models"][0]["checkpointed"]
    vb.disable()
    m = gpt(layers=6)
    vb.enable("memory", swap_dir=str(tmp_path), activation_budget="16KB", offload_min_bytes=1024, **PLAIN)
    run(m, steps=1)
    offload = vb.get_report()["activations"]["offload"]
    assert offload["packed"] > 0 and offload["offloaded_bytes"] > 0


def test_the_scripts_own_checkpoint_around_the_model_recomputes_the_first_call_exactly(tmp_path):
    """``torch.utils.checkpoint(model, x, use_reentrant=False)`` around a model whose blocks the
    switch checkpoints: the recomputation of the first call took the later calls' path, which saves
    other tensors (``CheckpointError: ... different metadata``: a probe's finding). Bitwise now."""
    from torch.utils.checkpoint import checkpoint

    def train(switch):
        m = gpt(layers=2, seq=32)
        if switch:
            vb.enable("memory", swap_dir=str(tmp_path), activation_budget="16KB", offload_min_bytes=1024, **PLAIN)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        torch.manual_seed(1)
        out = []
        try:
            for _ in range(2):
                x = torch.randint(0, 256, (2, 32), generator=gen)
                loss = F.cross_entropy(checkpoint(m, x, use_reentrant=False).reshape(-1, 256), x.roll(-1, 1).reshape(-1))
                opt.zero_grad()
                loss.backward()
                out.append((loss.item(), [p.grad.clone() for p in m.parameters()]))
                opt.step()
            if switch:
                assert vb.get_report()["activations"]["models"][0]["checkpointed"]
        finally:
            if switch:
                vb.disable()
        return out

    for (la, ga), (lb, gb) in zip(train(False), train(True)):
        assert la == lb and all(torch.equal(a, b) for a, b in zip(ga, gb))


@pytest.mark.parametrize("paged", [False, True])
def test_a_backward_after_disable_reads_its_offloaded_activations_back(tmp_path, paged, cpu_device):
    """``with vb.enabled(...): loss = model(x)`` then ``loss.backward()`` outside: the offloader
    had shut its I/O threads and the swap files were gone ("cannot schedule new futures after
    shutdown": a probe's finding). ``disable()`` brings a live graph's activations back first.
    With paging on too, the paging session (closed first) deleted the swap folder the offloader
    shares before it could ("act0.bin is missing"), and the swap level's counters went negative
    (-64 KiB resident in the report): a later probe's findings. The folder is the stack's now."""
    m, ref = gpt(layers=2), gpt(layers=2)
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(5)
    F.cross_entropy(ref(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1)).backward()
    paging = dict(paging="always", device_budget="128KB") if paged else {}
    with vb.enabled("memory", swap_dir=str(tmp_path), activation_budget="16KB", offload_min_bytes=1024,
                    activation_checkpointing=False, **{**PLAIN, **paging}):
        m.to("cpu")
        torch.manual_seed(5)
        loss = F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1))
        rep = vb.get_report()
        assert rep["activations"]["offload"]["offloaded_bytes"] > 0
        assert rep["models"][0]["features"]["paging"]["chosen"] == ("paged" if paged else "off")
    loss.backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(m.parameters(), ref.parameters()))
    if paged:
        swap_level = vb.get_report()["stats"]["levels"][-1]
        assert swap_level["resident_bytes"] == 0 and swap_level["stale_bytes"] == 0, swap_level
    assert not list(tmp_path.glob("vb-*"))  # the swap folder went with the session


def test_a_layer_instance_shared_across_depth_is_reported_as_such(tmp_path):
    """``nn.ModuleList([block] * 4)`` (ALBERT-style sharing) is not checkpointed; the reason said
    "no repeated blocks found", which misled (a probe's observation)."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ModuleList([block] * 4))
    vb.enable("balanced", checkpointing=True, **PLAIN)
    model.to("cpu")
    feature = vb.get_report()["models"][0]["features"]["activation_checkpointing"]
    assert feature["chosen"] == "off" and "1 repeats one layer instance" in feature["reason"], feature


def test_repeated_blocks_that_are_single_linear_layers_are_not_checkpointed(cpu_device):
    """A linear layer keeps only its input for backward, which a checkpoint keeps too: recomputing
    saves nothing. Until 2026-11-28 such blocks were checkpointed, and where FP4 storage then
    replaced the frozen ones the report still counted them ("6/6 blocks", 2 really wrapped)."""
    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(256, 256) for _ in range(6)])
            self.head = torch.nn.Linear(256, 4)

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return self.head(x)

    torch.manual_seed(0)
    model = Stack()
    for layer in model.layers[:4]:
        layer.requires_grad_(False)
    vb.enable("memory", activation_checkpointing=True, **PLAIN)
    model(torch.randn(2, 256)).sum().backward()
    features = vb.get_report()["models"][0]["features"]
    ckpt = features["activation_checkpointing"]
    assert ckpt["chosen"] == "off" and "single Linear layers" in ckpt["reason"], ckpt
    assert features["fp4"]["chosen"] == "storage"
    assert not any("forward" in m.__dict__ for m in model.modules())  # no block wrapped


class _Scaled(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
        if kind == "instance":  # a wrapper set on the instance, as accelerate's add_hook_to_module does
            self.forward = functools.partial(_scaled_forward, self)

    def forward(self, x):
        return self.body(x)


def _scaled_forward(block, x):
    return type(block).forward(block, x) * 0.5


class _StaticForward(torch.nn.Module):
    """A block with a parameter whose class forward is a staticmethod (checkpointing called it
    with the block as its first argument: TypeError)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(16))

    @staticmethod
    def forward(x):
        return torch.tanh(x) + x


class _Chain(torch.nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.inp, self.blocks, self.head = torch.nn.Linear(8, 16), torch.nn.ModuleList(blocks), torch.nn.Linear(16, 2)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x) * block.scale if hasattr(block, "scale") else block(x)
        return self.head(x)


@pytest.mark.parametrize("kind", ["instance", "staticmethod"])
def test_a_checkpointed_block_runs_the_forward_its_instance_has(kind, cpu_device):
    """Checkpointing wrapped the class's forward always: a block whose forward was set on the
    instance (accelerate's hooks) trained without it and a copy lost it, and a class forward that
    is a staticmethod raised TypeError (a probe's findings)."""
    def build():
        torch.manual_seed(0)
        return _Chain([(_Scaled("instance") if kind == "instance" else _StaticForward()) for _ in range(3)])

    def train(model):
        return _sgd_losses(model, (4, 8), total=True)[-1]

    ref_model = build()
    ref = train(ref_model)
    vb.enable("memory", activation_checkpointing=True, activation_offload=False, fp4="off", **PLAIN)
    model = build()
    assert train(model) == ref
    assert vb.get_report()["models"][0]["features"]["activation_checkpointing"]["chosen"] == "3/3 blocks"
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    twin = copy.deepcopy(model)
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert torch.equal(twin(x), ref_model(x))


class _Recorded(torch.nn.Module):
    """A block whose ``__setattr__`` records its plain attributes into a config it saves as JSON,
    and refuses new ones once built."""

    def __init__(self):
        super().__init__()
        self.width = 16
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
        self.built = True

    def __setattr__(self, name, value):
        if self.__dict__.get("built"):
            raise AttributeError(f"{type(self).__name__} is built: cannot set {name!r}")
        if not name.startswith("_") and not isinstance(value, (torch.nn.Module, torch.Tensor)):
            self.__dict__.setdefault("config", {})[name] = value
        super().__setattr__(name, value)

    def forward(self, x):
        return self.body(x)


def test_the_switch_writes_its_wrappers_without_the_blocks_own_setattr(cpu_device):
    """A class's ``__setattr__`` saw the switch's ``forward`` (its saved config held a
    ``CheckpointedForward``: ``json.dumps`` raised), or refused it (the step failed and was
    turned off): a probe's findings. The wrappers are written as nn.Module.__setattr__ would."""
    import json

    torch.manual_seed(0)
    model = _Chain([_Recorded() for _ in range(3)])
    vb.enable("memory", activation_checkpointing=True, activation_offload=False, fp4="off", **PLAIN)
    model(torch.randn(4, 8)).sum().backward()
    feature = vb.get_report()["models"][0]["features"]["activation_checkpointing"]
    assert feature["chosen"] == "3/3 blocks" and "error" not in feature, feature
    assert all(type(vars(b).get("forward")).__name__ == "CheckpointedForward" for b in model.blocks)
    assert json.dumps([b.config for b in model.blocks]) == json.dumps([{"width": 16, "built": True}] * 3)
    vb.disable()
    assert not any("forward" in vars(b) for b in model.blocks)


class _PropertyForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())

    @property
    def forward(self):
        return self.body


def test_blocks_whose_forward_is_a_class_property_are_not_checkpointed(cpu_device):
    """Wrapping them failed (no setter: the step failed and checkpointing went off for the session,
    asking the user to report a defect) or went through a setter disable() cannot undo."""
    torch.manual_seed(0)
    model = _Chain([_PropertyForward() for _ in range(3)])
    vb.enable("memory", activation_checkpointing=True, activation_offload=False, fp4="off", **PLAIN)
    model(torch.randn(4, 8)).sum().backward()
    feature = vb.get_report()["models"][0]["features"]["activation_checkpointing"]
    assert feature["chosen"] == "off" and "property" in feature["reason"] and "error" not in feature, feature


def _doubled(block, x):
    return block._old_forward(x) * 2  # accelerate's add_hook_to_module keeps the forward it wraps


def test_a_checkpoint_wrapper_the_script_wrapped_after_adoption_stops_checkpointing_at_disable(cpu_device):
    """A hook the script adds after adoption wraps the switch's wrapper; disable() leaves the
    script's hook (and so the wrapper inside it), which kept recomputing in backward (a probe's
    finding): it runs the block as written from then on."""
    torch.manual_seed(0)
    model = _Chain([_Scaled("class") for _ in range(3)])
    vb.enable("memory", activation_checkpointing=True, activation_offload=False, fp4="off", **PLAIN)
    model(torch.randn(4, 8)).sum().backward()
    wrappers = [vars(b)["forward"] for b in model.blocks]
    assert all(type(w).__name__ == "CheckpointedForward" for w in wrappers)
    for block in model.blocks:
        block._old_forward = block.forward
        block.forward = functools.partial(_doubled, block)
    vb.disable()
    before = [w.calls for w in wrappers]
    model(torch.randn(4, 8)).sum().backward()
    assert [w.calls for w in wrappers] == before  # the script's hooks run, nothing is recomputed
    assert all(isinstance(vars(b)["forward"], functools.partial) for b in model.blocks)


def test_quantization_aware_blocks_are_not_recomputed(cpu_device):
    """Fake-quantize observers update scale and min/max in place without bumping versions: a
    checkpoint's recomputation updated them twice and trained on the new scale (memory mode's QAT
    losses 0.96081 vs 0.96094: a probe's finding). Such blocks are not checkpointed."""
    from torch.ao.quantization import get_default_qat_qconfig, prepare_qat

    def run(enabled):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                    torch.nn.ReLU(), torch.nn.Linear(32, 4))
        model.qconfig = get_default_qat_qconfig("x86")
        prepare_qat(model, inplace=True)
        if enabled:
            vb.enable("memory", activation_checkpointing=True, activation_offload=False, fp4="off", **PLAIN)
        return _sgd_losses(model, (8, 16))

    ref = run(False)
    assert run(True) == ref
    decisions = [m["features"]["activation_checkpointing"] for m in vb.get_report()["models"]]
    assert any("quantization-aware" in d["reason"] for d in decisions), decisions
    assert all(d["chosen"] == "off" for d in decisions)


def test_torchs_early_stop_of_a_recomputation_is_not_a_compiler_failure():
    """torch's non-reentrant checkpoint stops a recomputation by raising through the forward; a
    compile ladder inside the block took it for its compiled rung's failure and ran the call again
    eagerly (AssertionError "target_frame.early_stop is set": a probe's finding, full mode)."""
    from apt_model.compile.ladder import raised_by_compiled_code

    stop = getattr(torch.utils.checkpoint, "_StopRecomputationError", None)
    if stop is None:
        pytest.skip("this torch has no early stop")
    assert raised_by_compiled_code(stop()) is False


def test_print_stats_shows_the_activation_offload_figures(tmp_path, capsys):
    """``print_stats`` had no offload line (the report had the figures: a probe's observation)."""
    m = gpt(layers=2)
    vb.enable("memory", swap_dir=str(tmp_path), activation_budget="16KB", offload_min_bytes=1024, **PLAIN)
    m.to("cpu")
    run(m, steps=1)
    off = vb.get_report()["activations"]["offload"]
    vb.print_stats()
    line = next(x for x in capsys.readouterr().out.splitlines() if "activation offload:" in x)
    assert off["packed"] > 0 and f"{off['packed']} saved tensors" in line and f"{off['offloaded']} offloaded" in line


PRUNED_BLOCKS = """
import torch, torch.nn as nn, torch.nn.functional as F
from torch.nn.utils import prune
import apt_model  # the switch, from the environment
torch.set_num_threads(1); torch.manual_seed(0)
class Block(nn.Module):
    def __init__(s):
        super().__init__(); s.a = nn.Linear(64, 64); s.b = nn.Linear(64, 64)
        prune.l1_unstructured(s.a, "weight", amount=0.4)  # weight_orig + weight_mask + a forward pre-hook
    def forward(s, x): return x + s.b(torch.tanh(s.a(x)))
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.blocks = nn.ModuleList([Block() for _ in range(4)]); s.out = nn.Linear(64, 4)
    def forward(s, x):
        for b in s.blocks: x = b(x)
        return s.out(x)
m = M().to("cpu")
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)); y = torch.zeros(16, 4)
for s in range(4):
    loss = F.mse_loss(m(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    print(loss.item().hex(), sum(p.detach().double().sum().item() for p in m.parameters()).hex())
"""


def test_a_pruned_model_in_memory_mode_trains_like_plain_pytorch(tmp_path):
    """torch.nn.utils.prune computes ``weight`` from ``weight_orig`` in a forward pre-hook made
    before adoption; paging's own pre-hook came after it, so when memory mode's checkpointing
    recomputed a block inside backward (no fault handler there) the prune hook read freed storage:
    a segfault, or silently different losses (a probe's finding). Paging's pre-hook runs first."""
    plain = run_python(PRUNED_BLOCKS, env=clean_env(VB_DEVICE="cpu"))
    assert plain.returncode == 0, plain.stderr[-2000:]
    switched = run_python(PRUNED_BLOCKS, env=clean_env(
        ENABLE_VIRTUAL_BLACKWELL="1", VB_MODE="memory", VB_DEVICE="cpu", VB_DEVICE_BUDGET="96KB",
        VB_MIXED_PRECISION="off", VB_SWAP_DIR=str(tmp_path)))
    assert switched.returncode == 0, switched.stderr[-2000:]
    numbers = [[line for line in out.stdout.splitlines() if line.startswith("0x")] for out in (plain, switched)]
    assert numbers[1] == numbers[0] and len(numbers[0]) == 4  # (the switch's banner goes to stdout too)


def test_a_block_holding_the_scripts_hooks_runs_uncheckpointed_while_it_does(tmp_path):
    """A forward hook on a layer inside a checkpointed block ran again in the recomputation: two
    activations recorded per step, and the one kept with ``retain_grad()`` never got its gradient
    (a probe's finding; the Grad-CAM pattern). Such a block runs as written while it holds the
    hook (said at adoption), and is checkpointed again once the hook is removed."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return x + torch.tanh(self.fc(x))

    def build():
        torch.manual_seed(0)
        return nn.Sequential(*[Block() for _ in range(3)], nn.Linear(16, 1))

    def run(model, steps=2):
        feats = []

        def hook(m, i, o):
            o.retain_grad()
            feats.append(o)

        handle = model[1].fc.register_forward_hook(hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(steps):
            model(torch.ones(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
        handle.remove()
        return feats

    plain = run(build())
    vb.enable("memory", swap_dir=str(tmp_path), **PLAIN)
    model = build()
    model[0].fc.register_forward_pre_hook(lambda m, a: None)  # there at adoption
    model.to("cpu")
    reason = vb.get_report()["models"][0]["features"]["activation_checkpointing"]["reason"]
    assert "1 of them hold the script's hooks (forward pre-hook on fc in block 0) and run uncheckpointed" in reason, reason
    feats = run(model)
    assert len(feats) == len(plain) == 2
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(feats, plain))
    wrapped = [vars(b)["forward"] for b in model[:3]]
    assert [w.calls for w in wrapped] == [0, 0, 2]  # the hooked blocks ran as written; the third was checkpointed
    model(torch.ones(4, 16)).sum().backward()  # the hook on block 1 is gone: checkpointed again
    assert [w.calls for w in wrapped] == [0, 1, 3]


class _SameTwice(nn.Module):
    """A block called ``blk(x, x)``: its forward takes one path when both arguments are one tensor
    (as ``nn.MultiheadAttention`` projects ``q is k is v`` packed), and may scale one in place."""

    def __init__(self, kind: str, d: int = 32):
        super().__init__()
        self.kind = kind
        self.f, self.g = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, a, b):
        if self.kind == "mut":
            b.mul_(2.0)
        h = self.f(a)
        return torch.tanh(h) if a is b else torch.sigmoid(h) + self.g(b)


class _SameTwiceNet(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        if kind == "mha":
            self.blocks = nn.ModuleList([nn.MultiheadAttention(32, 4, batch_first=True) for _ in range(2)])
        else:
            self.blocks = nn.ModuleList([_SameTwice(kind) for _ in range(2)])
        self.kind, self.head = kind, nn.Linear(32, 1)

    def forward(self, x):
        x = x * 1.0
        for blk in self.blocks:
            x = x + (blk(x, x, x)[0] if self.kind == "mha" else blk(x, x))
        return self.head(x).mean()


def _same_twice_grads(kind: str, steps: int = 3) -> list:
    torch.manual_seed(0)
    m = _SameTwiceNet(kind)
    if vb.is_enabled():
        m.to("cpu")
    out = []
    for step in range(steps):
        torch.manual_seed(step)
        inp = torch.randn(8, 16, 32) if kind == "mha" else torch.randn(8, 32)
        m.zero_grad()
        loss = m(inp)
        loss.backward()
        out.append((loss.detach(), [None if p.grad is None else p.grad.clone() for p in m.parameters()]))
    return out


@pytest.mark.parametrize("kind", ["mha", "ident", "mut"])
def test_a_block_given_one_tensor_twice_is_recomputed_with_one_tensor(kind, cpu_device):
    """``blk(x, x)``: the checkpoint saved each argument on its own, and under activation offload's
    saved-tensor hooks each came back a new object, so the recomputation ran ``blk(x1, x2)``:
    ``nn.MultiheadAttention(x, x, x)`` raised a CheckpointError at the second step, and a forward
    that tests ``a is b`` gave other gradients without a word; a block that scales its input in
    place was recomputed from two copies, wrong from the first step (a probe's findings)."""
    ref = _same_twice_grads(kind)
    vb.enable("memory", mixed_precision="off", attention="off", compile="off", banner=False)
    got = _same_twice_grads(kind)
    rec = vb.get_report()["models"][0]["features"]["activation_checkpointing"]
    assert rec["chosen"] == "2/2 blocks", rec  # both blocks recompute: the path under test
    for (l0, g0), (l1, g1) in zip(ref, got):
        assert torch.equal(l0, l1)
        assert all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                   for a, b in zip(g0, g1))


class _TrainOnlyBlock(torch.nn.Module):
    """A block whose train mode differs from its eval mode: noise injected while training (values
    only), dropout (a mask saved), batch norm (batch statistics)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.lin = torch.nn.Linear(16, 16)
        self.drop = torch.nn.Dropout(0.3)
        self.norm = torch.nn.BatchNorm1d(16)

    def forward(self, x):
        if self.kind == "noise":
            if self.training:
                x = x + 0.1 * torch.randn_like(x)
            return x + torch.tanh(self.lin(x))
        if self.kind == "dropout":
            return x + self.drop(torch.tanh(self.lin(x)))
        return x + torch.tanh(self.norm(self.lin(x)))


@pytest.mark.parametrize("kind", ["noise", "dropout", "batchnorm"])
def test_a_model_switched_to_eval_before_backward_is_recomputed_in_train_mode(tmp_path, cpu_device, kind):
    """A teacher pass of the same network in eval mode between the training forward and its
    backward (self-distillation), with ``model.train()`` at the top of the next step: the switch's
    checkpoint recomputed the blocks in eval mode — ``CheckpointError`` for dropout and batch norm,
    silently other gradients for noise injection (a probe's finding). The recomputation runs with
    the flags its forward had, and training is bitwise plain PyTorch's."""

    def build():
        return _three_blocks(lambda: _TrainOnlyBlock(kind), 4)

    def train(m):
        torch.manual_seed(1)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        out = []
        for _ in range(3):
            m.train()
            x = torch.randn(6, 8)
            logits = m(x)
            m.eval()
            with torch.no_grad():
                teacher = m(x).softmax(-1)
            loss = F.cross_entropy(logits, teacher)
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach())
        return out + [t.clone() for t in m.state_dict().values()]

    ref = train(build())
    got, calls = _checkpointed_run(build(), train, "memory", tmp_path)
    assert calls > 0  # the blocks were checkpointed
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))


class _CountedBlock(torch.nn.Module):
    calls = 0

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        _CountedBlock.calls += 1
        return x + self.b(torch.relu(self.a(x)))


class _ReentrantCheckpointed(torch.nn.Module):
    """Blocks the script checkpoints itself with re-entrant ``torch.utils.checkpoint`` (timm's
    ``set_grad_checkpointing`` with re-entrant checkpoints)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(_CountedBlock() for _ in range(3))
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True)
        return self.out(h)


def test_blocks_a_reentrant_checkpoint_recomputes_are_not_checkpointed_again(tmp_path, cpu_device, capsys):
    """A re-entrant checkpoint runs its forward under no grad, then again with grad inside
    backward: the switch checkpointed the blocks in that recomputation, which recomputed each a
    second extra time (9 calls for 3 blocks where plain PyTorch makes 6: 1.5x timm's step; a
    probe's finding). Inside a backward pass a block runs as written; training is bitwise."""
    def run(switch):
        torch.manual_seed(0)
        m = _ReentrantCheckpointed()
        if switch:
            vb.enable("memory", swap_dir=str(tmp_path), **PLAIN)
            m.to("cpu")
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        calls, losses = [], []
        try:
            for _ in range(3):
                _CountedBlock.calls = 0
                loss = m(torch.randn(4, 8, generator=gen).requires_grad_()).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                calls.append(_CountedBlock.calls)
                losses.append(loss.item())
            feature = vb.get_report()["models"][0]["features"]["activation_checkpointing"] if switch else None
            if switch:
                capsys.readouterr()
                vb.print_stats()
                assert "[calls so far: 0 checkpointed by the switch, 9 inside another checkpoint, run as written]" \
                    in capsys.readouterr().out
        finally:
            vb.disable()
        return calls, losses, [p.detach().clone() for p in m.parameters()], feature

    ref, got = run(False), run(True)
    assert got[0] == ref[0] == [6, 6, 6], (got[0], ref[0])
    assert got[1] == ref[1] and all(torch.equal(a, b) for a, b in zip(got[2], ref[2]))
    # the report counts the calls that stood aside (it said the switch recomputed the blocks)
    assert got[3]["calls"] == {"checkpointed": 0, "inside another checkpoint": 9}, got[3]


def test_activation_offload_enters_no_hooks_for_a_call_without_grad(tmp_path, cpu_device):
    """A forward without grad saves nothing for a backward, yet offload entered its saved-tensor
    hooks around it: a batch-1 policy forward of an RL loop (acting under ``no_grad``) took 1.5x
    its plain time in memory mode (a probe's finding). Such a call runs with no hooks of the
    switch's; a training call still gets them."""
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
            return x

    vb.enable("memory", swap_dir=str(tmp_path), activation_budget="64KB", offload_min_bytes=4096, **PLAIN,
              activation_offload=True, activation_checkpointing=False)
    try:
        m = nn.Sequential(nn.Linear(8, 8), Probe(), nn.Linear(8, 1)).to("cpu")
        m(torch.randn(2, 8)).sum().backward()
        with torch.no_grad():
            m(torch.randn(2, 8))
        with torch.inference_mode():
            m(torch.randn(2, 8))
        m(torch.randn(2, 8)).sum().backward()
    finally:
        vb.disable()
    assert seen == [True, False, False, True], seen


def test_the_report_names_the_block_lists_that_are_not_checkpointed(cpu_device):
    """An encoder-decoder has two lists of repeated blocks; only the one with the most parameters
    is checkpointed, and the report said "2 of 2 TransformerDecoderLayer blocks" as if that were
    all (a probe's finding). It names the others now; a list of single layers (a head) is no block
    list worth naming."""
    vb.enable("memory", mixed_precision="off", banner=False)
    try:
        nn.Sequential(nn.Transformer(d_model=32, nhead=2, num_encoder_layers=2, num_decoder_layers=2,
                                     dim_feedforward=64, batch_first=True),
                      nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4))).to("cpu")
        reason = vb.get_report()["models"][0]["features"]["activation_checkpointing"]["reason"]
    finally:
        vb.disable()
    assert "2 of 2 TransformerDecoderLayer blocks in 0.decoder.layers" in reason, reason
    assert "not checkpointed" in reason and "0.encoder.layers (2 TransformerEncoderLayer)" in reason, reason
    assert "1 (2 Linear)" not in reason, reason


def test_recurrent_cells_are_not_checkpointed(cpu_device):
    """Two ``GRUCell`` layers in a ``ModuleList``, run once per time step of the script's loop:
    memory mode checkpointed every call, 50 per step, for the little a cell saves (a forecaster
    ran 2.5-3x slower: a probe's finding). Recurrent cells are no blocks to checkpoint."""
    class Forecaster(nn.Module):
        def __init__(self):
            super().__init__()
            self.cells = nn.ModuleList([nn.GRUCell(4, 16), nn.GRUCell(16, 16)])
            self.head = nn.Linear(16, 1)

        def forward(self, x):
            h = [torch.zeros(x.shape[0], 16) for _ in self.cells]
            for t in range(x.shape[1]):
                inp = x[:, t]
                for i, cell in enumerate(self.cells):
                    h[i] = cell(inp, h[i])
                    inp = h[i]
            return self.head(inp)

    vb.enable("memory", mixed_precision="off", banner=False)
    try:
        m = Forecaster().to("cpu")
        m(torch.randn(3, 5, 4)).sum().backward()
        feature = vb.get_report()["models"][0]["features"]["activation_checkpointing"]
    finally:
        vb.disable()
    assert feature["chosen"] == "off" and "recurrent cells (GRUCell)" in feature["reason"], feature


def test_repeated_blocks_that_are_single_convolutions_are_not_checkpointed(cpu_device):
    """A detection backbone's ``Sequential`` of ``Conv2d`` layers was checkpointed layer by layer
    ("4 of 4 Conv2d blocks"): a convolution keeps only its input for backward, as a checkpoint
    does, so recomputing saved nothing and cost time (a probe's finding)."""
    body = nn.Sequential(*[nn.Conv2d(8, 8, 3, padding=1) for _ in range(4)])
    vb.enable("memory", activation_checkpointing=True, **PLAIN)
    try:
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), body, nn.Flatten(), nn.Linear(512, 2))(
            torch.randn(2, 3, 8, 8)).sum().backward()
        ckpt = vb.get_report()["models"][0]["features"]["activation_checkpointing"]
    finally:
        vb.disable()
    assert ckpt["chosen"] == "off" and "single Conv2d layers" in ckpt["reason"], ckpt

