"""Paging training state to NVMe through the switch: exactness, checkpoints, faults, stats."""
import copy
import io
import json
import shutil
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as module_mod
from torch.nn.modules.module import register_module_backward_hook as _deprecated_hook
from torch.nn.modules.module import register_module_full_backward_hook as _imported_full_hook
from torch.nn.modules.module import register_module_full_backward_pre_hook as _imported_pre_hook

import apt_model.optimization.vb_global as vb
from apt_model.errors import ConfigError
from apt_model.memory.swap import PagingRecoveryError, SwapCorruptionError, SwapFullError
from apt_model.models.gpt import GPT, GPTConfig
from conftest import clean_env

FORCE = dict(paging="always", device_budget="4KB", attention="off", mixed_precision="off", banner=False)


def model(seed=0, dropout=0.1):
    torch.manual_seed(seed)
    return GPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=2, dropout=dropout))


def make_opt(m, kind):
    if kind == "adamw":
        return torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)
    if kind == "adam":
        return torch.optim.Adam(m.parameters(), lr=1e-3, amsgrad=True)
    return torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, nesterov=True)


def _backward_on_another_thread(loss):
    """``loss.backward()`` run by a new thread (as autograd's device thread runs it on an
    accelerator: without the caller's torch-function modes); its error is raised here."""
    errors = []

    def run():
        try:
            loss.backward()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            errors.append(err)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]


def train(m, opt, steps, accum=1, clip=None, seed=1, sched=None, eval_every=0, zero_to_none=True, device="cpu",
          seq=32, backward_thread=False):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout
    losses = []
    for s in range(steps):
        opt.zero_grad(set_to_none=zero_to_none)
        for _ in range(accum):
            x = torch.randint(0, 256, (4, seq), generator=gen).to(device)
            loss = F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1)) / accum
            if backward_thread:
                _backward_on_another_thread(loss)
            else:
                loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()
        if sched:
            sched.step()
        losses.append(loss.item())
        if eval_every and s % eval_every == 0:
            m.eval()
            with torch.no_grad():
                losses.append(F.cross_entropy(m(x).reshape(-1, 256), x.reshape(-1)).item())
            m.train()
    return losses


def snapshot(m, opt):
    params = {k: v.detach().clone() for k, v in m.state_dict().items()}
    state = {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}
    return params, state


def assert_same(a, b):
    pa, sa = a
    pb, sb = b
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k].cpu(), pb[k].cpu()), k
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(torch.as_tensor(sa[i][k]).cpu(), torch.as_tensor(sb[i][k]).cpu()), (i, k)


@pytest.mark.parametrize("kind,accum,clip,zero_to_none,opt_after", [
    ("adamw", 1, None, True, False),
    pytest.param("adamw", 3, 0.5, True, False, marks=pytest.mark.slow),  # the suite's 15 minutes on 2 cores
    ("sgd", 2, 1.0, False, False),
    ("adam", 1, 0.5, True, True),
])
def test_every_tensor_through_nvme_is_bitwise_identical(kind, accum, clip, zero_to_none, opt_after, tmp_path):
    steps = 12  # past the scheduler's decay (step 7) and the evaluation at step 9
    ref_m = model()
    ref_opt = make_opt(ref_m, kind)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 7, 0.5)
    ref = train(ref_m, ref_opt, steps, accum, clip, sched=ref_sched, eval_every=9, zero_to_none=zero_to_none)
    ref_state = snapshot(ref_m, ref_opt)

    m = model()
    if not opt_after:
        opt = make_opt(m, kind)  # built before enabling, as most scripts do
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    m.to("cpu")
    if opt_after:
        opt = make_opt(m, kind)  # built after the model was adopted and paged out
    sched = torch.optim.lr_scheduler.StepLR(opt, 7, 0.5)
    got = train(m, opt, steps, accum, clip, sched=sched, eval_every=9, zero_to_none=zero_to_none)
    stats = vb.get_stats()["levels"]
    got_state = snapshot(m, opt)
    assert got == ref
    assert_same(got_state, ref_state)
    nvme = stats[-1]
    assert stats[0]["misses"] > 0 and nvme["writes"] > 0 and nvme["reads"] > 0  # data really moved
    plan = vb.get_report()["models"][0]["features"]["paging"]
    assert plan["chosen"] == "paged" and plan["plan"]["paged_categories"] == ["parameters", "gradients", "optimizer states"]


@pytest.mark.parametrize("room", ["all", "some"])
def test_written_pages_stay_in_memory_while_level_0_has_room(room, tmp_path):
    """Paged gradients, optimizer states and stepped parameters are written behind as they are
    produced but, while level 0 has room, kept in memory as clean copies: with room for all of
    them, a step after the first reads nothing back; with room for some, the kept gradients that
    clipping scaled in memory are dropped for room without a write and loaded again scaled by the
    lower copy's owed factor. Training stays bitwise either way."""
    ref_m = model()
    ref_opt = make_opt(ref_m, "adamw")
    ref = train(ref_m, ref_opt, 3, clip=0.5)
    m = model()
    opt = make_opt(m, "adamw")
    p_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, "device_budget": str((4 if room == "all" else 3) * p_bytes)})
    m.to("cpu")
    got = train(m, opt, 3, clip=0.5)
    before = vb.get_stats()["levels"]
    got += train(m, opt, 1, clip=0.5, seed=99)  # the step measured
    after = vb.get_stats()["levels"]
    state = snapshot(m, opt)
    vb.disable()
    ref += train(ref_m, ref_opt, 1, clip=0.5, seed=99)
    assert got == ref
    assert_same(state, snapshot(ref_m, ref_opt))
    assert after[-1]["writes"] > before[-1]["writes"]  # written behind all the same
    if room == "all":
        assert after[0]["misses"] == before[0]["misses"] and after[-1]["reads"] == before[-1]["reads"]
    else:
        assert after[-1]["reads"] > before[-1]["reads"]


def test_paged_tensors_are_in_files_not_in_memory(tmp_path):
    m = model()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    m.to("cpu")
    session = vb.get_report()["memory"]["paging"]
    assert session["pager"]["categories"]["param"]["resident"] == 0
    from apt_model.switch.controller import session as vb_session

    pager = vb_session().paging.pager
    for n, p in m.named_parameters():
        assert p.untyped_storage().nbytes() == 0  # no bytes in RAM
        page = vb_session().paging.param_pages[id(p)]
        path = pager.swap._records[page.key].path
        assert path.stat().st_size == p.numel() * p.element_size()
        out = torch.empty_like(before[n])
        pager.swap.read_into(page.key, memoryview(out.numpy()).cast("B"))
        assert torch.equal(out, before[n])
        assert p.shape == before[n].shape and p.device.type == "cpu"  # metadata intact
    vb.disable()
    for n, p in m.named_parameters():  # disable brings everything back
        assert torch.equal(p, before[n])
    assert not any(tmp_path.iterdir())  # and removes the swap folder


def _saved_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_state_dict_entries_alias_the_parameters_on_a_cpu_run(tmp_path, cpu_device):
    """In plain PyTorch ``model.state_dict()``'s tensors alias the parameters: an EMA kept by
    writing through them (timm's ``ModelEmaV2``: ``ema_v.copy_(...)`` over
    ``ema.state_dict().values()``) updates the EMA model, and a state dict taken earlier and loaded
    back without a copy loads the current weights. Paged, the entries were copies: the EMA never
    moved and the load went back in time, silently (found by a probe). Where host memory is the
    compute level they are aliases now, their pages pinned while they live: bitwise plain."""
    def run(on):
        torch.manual_seed(0)
        m, ema = model(dropout=0.0), model(dropout=0.0)
        opt = make_opt(m, "adamw")
        if on:
            vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
        try:
            m.to("cpu")
            ema.to("cpu")
            ema.load_state_dict(m.state_dict())
            ema.requires_grad_(False)
            early = m.state_dict()  # no copy: it follows the parameters
            gen = torch.Generator().manual_seed(1)
            for _ in range(3):
                opt.zero_grad()
                x = torch.randint(0, 256, (4, 32), generator=gen)
                F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1)).backward()
                opt.step()
                with torch.no_grad():
                    for e, v in zip(ema.state_dict().values(), m.state_dict().values()):
                        e.copy_(e * 0.9 + 0.1 * v)
            m.load_state_dict(early)
            del early
            return ({k: v.detach().clone() for k, v in m.state_dict().items()},
                    {k: v.detach().clone() for k, v in ema.state_dict().items()})
        finally:
            if on:
                vb.disable()

    (ref_m, ref_ema), (got_m, got_ema) = run(False), run(True)
    for ref, got in ((ref_m, got_m), (ref_ema, got_ema)):
        assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    assert not all(torch.equal(ref_ema[k], ref_m[k]) for k in ref_m)  # the EMA moved, and not onto the model


def test_checkpoint_saved_while_paged_resumes_bitwise(tmp_path):
    full_m = model()
    full_opt = make_opt(full_m, "adamw")
    train(full_m, full_opt, 6, seed=1)
    ref = train(full_m, full_opt, 6, seed=2)
    ref_state = snapshot(full_m, full_opt)

    m = model()
    opt = make_opt(m, "adamw")
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    m.to("cpu")
    train(m, opt, 6, seed=1)
    buf = io.BytesIO()
    sd = m.state_dict()
    # tied weights stay one tensor, as in plain PyTorch (paging materialized a copy per key:
    # torch.save wrote the weight twice, and safetensors would not have refused the shared tensor)
    assert sd["head.weight"].data_ptr() == sd["tok_emb.weight"].data_ptr()
    plain_size = len(_saved_bytes(full_m.state_dict()))
    assert abs(len(_saved_bytes(sd)) - plain_size) < 4096, (len(_saved_bytes(sd)), plain_size)
    torch.save({"model": sd, "opt": opt.state_dict()}, buf)
    vb.disable()

    m2 = model(seed=123)  # different init: everything must come from the checkpoint
    opt2 = make_opt(m2, "adamw")
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    m2.to("cpu")
    buf.seek(0)
    ck = torch.load(buf)
    m2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    got = train(m2, opt2, 6, seed=2)
    assert got == ref
    assert_same(snapshot(m2, opt2), ref_state)


RESUME = textwrap.dedent("""
    import json, sys, torch, torch.nn.functional as F
    sys.path.insert(0, {tests!r})
    import apt_model.optimization.vb_global as vb
    from test_paging import model, make_opt, train, FORCE
    phase, path, swap = sys.argv[1], sys.argv[2], sys.argv[3]
    m = model(seed=0 if phase == "first" else 99)
    opt = make_opt(m, "adamw")
    vb.enable("balanced", swap_dir=swap, **FORCE)
    m.to("cpu")
    if phase == "first":
        train(m, opt, 5, seed=1)
        torch.save({{"model": m.state_dict(), "opt": opt.state_dict()}}, path)
        losses = train(m, opt, 5, seed=2)
    else:
        ck = torch.load(path)
        m.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        losses = train(m, opt, 5, seed=2)
    print("RESULT" + json.dumps({{"losses": losses, "w": m.blocks[0].mlp[0].weight.sum().item()}}))
""")


@pytest.mark.slow  # 15 s (a second interpreter); test_checkpoint_saved_while_paged_resumes_bitwise covers it in-process
def test_checkpoint_resumes_bitwise_in_a_fresh_process(tmp_path):
    from conftest import ROOT

    script = tmp_path / "resume.py"
    script.write_text(RESUME.format(tests=str(ROOT / "tests")))
    out = {}
    for phase in ("first", "second"):
        proc = subprocess.run([sys.executable, str(script), phase, str(tmp_path / "ck.pt"), str(tmp_path)],
                              capture_output=True, text=True, env=clean_env(), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[phase] = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert out["first"] == out["second"]


def test_code_outside_the_hooks_sees_the_real_data(tmp_path):
    m = model(dropout=0.0)
    opt = make_opt(m, "adamw")
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    m.to("cpu")
    train(m, opt, 2)
    from apt_model.switch.controller import session as vb_session

    session = vb_session().paging
    pager = session.pager
    w = m.blocks[1].mlp[2].weight
    assert w.untyped_storage().nbytes() == 0 and w.grad.untyped_storage().nbytes() == 0
    norm = w.grad.norm()  # a paged gradient, read by user code: faulted in for the op
    assert norm > 0 and torch.equal(norm, pager.materialize(session.grad_pages[id(w)]).norm())
    assert pager.stats.faults > 0
    expected = w.detach().clone() * 0.5
    w.data.mul_(0.5)  # an in-place change through an alias, outside any hook
    page = session.param_pages[id(w)]
    pager.evict_now([page])
    pager.flush()
    assert w.untyped_storage().nbytes() == 0
    assert torch.equal(w.detach().clone(), expected)  # the change was written before freeing
    buf = io.BytesIO()
    torch.save(m, buf)  # whole-module pickling faults pages in
    clone = copy.deepcopy(m)
    vb.disable()
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for a, b, c in zip(m.parameters(), loaded.parameters(), clone.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_corrupted_swap_file_is_reported_not_loaded(tmp_path):
    m = model()
    opt = make_opt(m, "adamw")
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    m.to("cpu")
    train(m, opt, 1)
    from apt_model.switch.controller import session as vb_session

    session = vb_session().paging
    w = m.blocks[0].attn.qkv.weight
    page = session.param_pages[id(w)]
    path = session.pager.swap._records[page.key].path
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(SwapCorruptionError, match=str(path)):
        train(m, opt, 1)
    assert w.untyped_storage().nbytes() == 0  # nothing half-loaded
    with pytest.raises(PagingRecoveryError, match="blocks.0.attn.qkv.weight") as info:
        vb.disable()  # that page's bytes are lost: disable() names it (it is never logged and forgotten)
    assert set(info.value.lost) == {"blocks.0.attn.qkv.weight"} and w.untyped_storage().nbytes() > 0
    shutil.rmtree(info.value.folder)  # kept for inspection


def test_disk_full_while_evicting_keeps_the_state_in_memory(tmp_path, monkeypatch):
    m = model()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    from apt_model.memory import swap as swap_mod

    real_pwrite = swap_mod.os.pwrite
    calls = {"n": 0}

    def pwrite(fd, data, off):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(28, "No space left on device")
        return real_pwrite(fd, data, off)

    monkeypatch.setattr(swap_mod.os, "pwrite", pwrite)
    with pytest.raises(SwapFullError) as info:
        vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
        m.to("cpu")
        from apt_model.switch.controller import session as vb_session

        vb_session().paging.pager.flush()
    assert str(tmp_path) in str(info.value) and "needs" in str(info.value)
    monkeypatch.setattr(swap_mod.os, "pwrite", real_pwrite)
    vb.disable()
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n]), n  # nothing lost


def test_swap_dir_problems_fail_at_enable(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        vb.enable("balanced", paging="always", swap_dir=str(tmp_path / "missing"), banner=False)
    with pytest.raises(ConfigError, match="not writable"):
        vb.enable("balanced", paging="always", swap_dir="/proc", banner=False)
    with pytest.raises(ConfigError, match="device_budget='lots' is not a size"):
        vb.enable("balanced", device_budget="lots", banner=False)
    assert not vb.is_enabled()


def test_a_model_that_fits_is_not_paged(tmp_path):
    m = model()
    vb.enable("balanced", swap_dir=str(tmp_path), device_budget="1GiB", banner=False)
    m.to("cpu")
    feat = vb.get_report()["models"][0]["features"]["paging"]
    assert feat["chosen"] == "resident" and "fits the level-0 budget" in feat["reason"]
    assert all(p.untyped_storage().nbytes() > 0 for p in m.parameters())


def test_stats_and_print_stats_per_level(tmp_path, capsys, cpu_device):
    """CPU semantics (pinned with VB_DEVICE=cpu): level 0 is host RAM, then the swap files. The
    accelerator's three levels are checked by the gpu-marked test below."""
    m = model()
    opt = make_opt(m, "adamw")
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    m.to("cpu")
    train(m, opt, 2)
    levels = vb.get_stats()["levels"]
    assert [lv["kind"] for lv in levels] == ["host", "nvme"]
    for key in ("resident_bytes", "bytes_in", "bytes_out", "hits", "misses", "stall_s"):
        assert key in levels[0]
    assert levels[1]["write_gbps"] > 0 and levels[1]["read_gbps"] > 0
    # zero_grad(set_to_none=True) removed the gradients' pages: their files are kept for the next
    # writes (stale), counted against the swap budget, and print_stats says so
    assert levels[1]["stale_bytes"] > 0
    vb.print_stats()
    text = capsys.readouterr().out
    assert "Level 0" in text and "Level 1" in text and "misses" in text
    assert "stale on disk" in text


def _closure_training(m, opt, steps, register_hook=False):
    """``steps`` steps of ``opt.step(closure)`` (positional, then by keyword): the losses the steps
    returned, the number of closure calls, and the order of events seen by an own step pre-hook."""
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    calls, events, returned = [0], [], []
    if register_hook:
        opt.register_step_pre_hook(lambda o, args, kwargs: events.append("pre-hook"))

        def wrap_closure(o, args, kwargs):  # a pre-hook whose result replaces the closure (torch's rule)
            if "closure" in kwargs:
                inner = kwargs["closure"]
                return args, {**kwargs, "closure": lambda: events.append("wrapped") or inner()}
            inner = args[1]
            return (args[0], lambda: events.append("wrapped") or inner(), *args[2:]), kwargs

        opt.register_step_pre_hook(wrap_closure)
    for s in range(steps):
        x = torch.randint(0, 256, (4, 32), generator=gen)

        def closure():
            calls[0] += 1
            events.append("closure")
            opt.zero_grad()
            loss = F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1))
            loss.backward()
            return loss

        out = opt.step(closure) if s % 2 == 0 else opt.step(closure=closure)
        returned.append(out.item())
    return returned, calls[0], events


@pytest.mark.parametrize("kind", ["adamw", pytest.param("sgd", marks=pytest.mark.slow)])  # the same path
def test_step_with_a_closure_trains_bitwise_and_returns_the_loss(kind, tmp_path):
    """``optimizer.step(closure)`` was refused while paging was on. It now calls the closure once,
    after the optimizer's own pre-hooks, streams the step, and returns the closure's loss: the
    same losses, parameters and states as plain PyTorch, bitwise."""
    ref_m = model()
    ref_opt = make_opt(ref_m, kind)
    ref, ref_calls, ref_events = _closure_training(ref_m, ref_opt, 4, register_hook=True)
    ref_state = snapshot(ref_m, ref_opt)
    m = model()
    opt = make_opt(m, kind)
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    try:
        m.to("cpu")
        got, calls, events = _closure_training(m, opt, 4, register_hook=True)
        state = snapshot(m, opt)
        levels = vb.get_stats()["levels"]
        assert levels[-1]["reads"] > 0 and levels[-1]["writes"] > 0  # the step really was paged
        step_in_backward = vb.get_report()["memory"]["paging"]["step_in_backward"]
    finally:
        vb.disable()
    assert got == ref
    assert calls == ref_calls == 4 and events == ref_events  # once per step, after the own pre-hooks
    assert events[:3] == ["pre-hook", "wrapped", "closure"]  # the second hook's closure was the one called
    assert_same(state, ref_state)
    assert step_in_backward["state"] == "off" and "passes a closure to optimizer.step()" in step_in_backward["reason"]


def _halve_gradients(opt, args, kwargs):
    """A global step pre-hook as a gradient-scaling library might register."""
    for g in opt.param_groups:
        for p in g["params"]:
            if p.grad is not None:
                p.grad.mul_(0.5)


def test_global_step_hooks_run_with_the_parameters_in_place_whenever_registered(tmp_path):
    """Torch runs global step hooks in registration order. A global pre-hook registered after paging
    started ran after the paged step had emptied the parameter groups for torch's own call, and a
    global post-hook registered before it ran before paging gave them back: both saw no parameter
    (a gradient scaling applied to nothing, an EMA updated nothing), silently (a probe's finding).
    The paged step runs them itself, in torch's order: training and what the hooks saw are plain
    PyTorch's, bitwise."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def run(paged):
        m = model()
        opt = make_opt(m, "adamw")
        seen = []
        post = register_optimizer_step_post_hook(lambda o, a, k: seen.append(
            [p.detach().clone() for g in o.param_groups for p in g["params"]]))
        if paged:
            vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
        try:
            m.to("cpu")
            pre = register_optimizer_step_pre_hook(_halve_gradients)  # after the model was paged
            try:
                losses = train(m, opt, 3)
            finally:
                pre.remove()
            return losses, seen, snapshot(m, opt)
        finally:
            post.remove()
            if paged:
                vb.disable()

    ref_losses, ref_seen, ref_state = run(False)
    losses, seen, state = run(True)
    assert losses == ref_losses
    assert len(seen) == len(ref_seen) == 3 and all(len(a) == len(b) > 0 for a, b in zip(seen, ref_seen))
    assert all(torch.equal(x, y) for a, b in zip(seen, ref_seen) for x, y in zip(a, b))
    assert_same(state, ref_state)


def test_unsupported_optimizers_are_refused(tmp_path):
    m = model()
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    m.to("cpu")
    x = torch.randint(0, 256, (2, 32))
    lbfgs = torch.optim.LBFGS(m.parameters())
    m(x).sum().backward()
    # the class by its module (timm has an Adafactor of its own), and what is paged in words
    with pytest.raises(RuntimeError, match=r"torch\.optim\.lbfgs\.LBFGS steps parameters of a paged model .* use one of torch\.optim\.SGD"):
        lbfgs.step(lambda: m(x).sum())


class _GlobalNormAdam(torch.optim.Adam):
    """Divides every gradient by the group's total norm: one parameter's update reads the others'."""

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            grads = [p.grad for p in g["params"] if p.grad is not None]
            total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in grads]))
            for x in grads:
                x.div_(total + 1e-6)
        return super().step(closure)


class _NamedAdamW(torch.optim.AdamW):
    """A subclass that keeps AdamW's step (adds an attribute only)."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.name = "mine"


def test_a_subclass_that_overrides_step_is_refused_one_that_keeps_it_trains_bitwise(tmp_path):
    """Stepped a chunk at a time, a subclass whose ``step`` couples the parameters (a global-norm
    scaling) gave other results, silently. It is refused now, naming why; a subclass that keeps
    its base's step, ASGD and Rprop (per-parameter updates) are stepped in chunks, bitwise."""
    m = model()
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    try:
        m.to("cpu")
        opt = _GlobalNormAdam(m.parameters(), lr=1e-3)
        m(torch.randint(0, 256, (2, 32))).sum().backward()
        with pytest.raises(RuntimeError, match="subclasses Adam and overrides step"):
            opt.step()
    finally:
        vb.disable()
    for make in (lambda m: _NamedAdamW(m.parameters(), lr=1e-3, weight_decay=0.1),
                 lambda m: torch.optim.ASGD(m.parameters(), lr=1e-2, t0=1),
                 lambda m: torch.optim.Rprop(m.parameters(), lr=1e-3)):
        ref_m = model()
        ref_opt = make(ref_m)
        ref = train(ref_m, ref_opt, 3, clip=0.5)
        m = model()
        opt = make(m)
        vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
        try:
            m.to("cpu")
            got = train(m, opt, 3, clip=0.5)
            moved = vb.get_stats()["levels"][0]["misses"]
            state = snapshot(m, opt)
        finally:
            vb.disable()
        assert got == ref and moved > 0, type(opt).__name__
        assert_same(state, snapshot(ref_m, ref_opt))


class _Lion(torch.optim.Optimizer):
    """A hand-written Lion (no built-in base): each parameter's update reads its own gradient and
    momentum only, which its author declares with ``vb_per_parameter``."""

    vb_per_parameter = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99)):
        super().__init__(params, dict(lr=lr, betas=betas))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["m"] = torch.zeros_like(p)
                p.add_(torch.sign(st["m"] * b1 + p.grad * (1 - b1)), alpha=-g["lr"])
                st["m"].mul_(b2).add_(p.grad, alpha=1 - b2)


def test_an_optimizer_of_its_own_that_declares_per_parameter_steps_trains_bitwise(tmp_path):
    """``vb_per_parameter = True`` was read only on subclasses of the built-in optimizers: a
    hand-written Lion declaring it, as the refusal's advice said, was still refused (a probe's
    finding). Declared, it is stepped in chunks, bitwise; undeclared, it is refused, naming the
    attribute."""
    ref_m = model()
    ref_opt = _Lion(ref_m.parameters())
    ref = train(ref_m, ref_opt, 3, clip=0.5)
    m = model()
    opt = _Lion(m.parameters())
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    try:
        m.to("cpu")
        got = train(m, opt, 3, clip=0.5)
        moved = vb.get_stats()["levels"][0]["misses"]
        state = snapshot(m, opt)
    finally:
        vb.disable()
    assert got == ref and moved > 0
    assert_same(state, snapshot(ref_m, ref_opt))

    class Undeclared(_Lion):
        vb_per_parameter = False

    m = model()
    opt = Undeclared(m.parameters())
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    try:
        m.to("cpu")
        m(torch.randint(0, 256, (2, 32))).sum().backward()
        with pytest.raises(RuntimeError, match="not known to update each parameter independently.*vb_per_parameter = True"):
            opt.step()
    finally:
        vb.disable()


@pytest.mark.parametrize("step_in_backward", ["on", "off"])
def test_the_optimizers_own_step_hooks_run_with_its_parameters(tmp_path, step_in_backward):
    """Hooks registered on the optimizer (``register_step_pre_hook`` / ``..._post_hook``) ran,
    under paging, after the streamed step and with every group emptied: a pre-hook scaling the
    gradients came too late, a post-hook EMA updated nothing. They run around the step now."""
    def build():
        m = model(dropout=0.0)
        opt = make_opt(m, "adamw")
        ema = [p.detach().clone() for p in m.parameters()]
        seen = []

        def pre(o, args, kwargs):
            seen.append(sum(1 for g in o.param_groups for p in g["params"] if p.grad is not None))
            for g in o.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.grad.mul_(0.5)

        def post(o, args, kwargs):
            with torch.no_grad():
                for e, p in zip(ema, [p for g in o.param_groups for p in g["params"]]):
                    e.mul_(0.9).add_(p, alpha=0.1)

        opt.register_step_pre_hook(pre)
        opt.register_step_post_hook(post)
        return m, opt, ema, seen

    ref_m, ref_opt, ref_ema, ref_seen = build()
    ref = train(ref_m, ref_opt, 3)
    m, opt, ema, seen = build()
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE, paging_step_in_backward=step_in_backward)
    try:
        m.to("cpu")
        got = train(m, opt, 3)
        state = snapshot(m, opt)
    finally:
        vb.disable()
    assert seen == ref_seen and seen[0] > 0
    assert got == ref
    assert_same(state, snapshot(ref_m, ref_opt))
    assert all(torch.equal(a, b) for a, b in zip(ema, ref_ema))
    assert len(opt._optimizer_step_pre_hooks) == len(opt._optimizer_step_post_hooks) == 1  # given back


def test_peak_rss_stays_within_the_host_budget(tmp_path):
    """Measured with psutil while training (not by arithmetic): the peak RSS above the process's
    RSS right after adoption (model paged out, probes done) stays under the host budget plus the
    largest module's working set (its weight, gradient and two Adam states) plus 64 MiB for
    activations and allocator slack — the documented constant."""
    import threading
    import time as _time

    import psutil

    from apt_model.memory.host import release_free_memory
    from apt_model.base.sizes import parse_size

    proc = psutil.Process()
    torch.manual_seed(0)
    m = GPT(GPTConfig(seq_len=64, d_model=512, n_layers=4, n_heads=8, attn_implementation="sdpa"))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    state_bytes = 4 * sum(p.numel() * 4 for p in m.parameters())
    budget = "32MB"
    vb.enable("balanced", paging="over_budget", device_budget=budget, swap_dir=str(tmp_path), mixed_precision="off",
              banner=False)
    m.to("cpu")
    release_free_memory()
    baseline = proc.memory_info().rss
    largest_unit = max(mod.weight.numel() * 4 * 4 for mod in m.modules() if isinstance(mod, torch.nn.Linear))
    peak, stop = [baseline], [False]

    def sample():
        while not stop[0]:
            peak[0] = max(peak[0], proc.memory_info().rss)
            _time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    x = torch.randint(0, 256, (2, 64))
    try:
        for _ in range(4):
            loss = F.cross_entropy(m(x).reshape(-1, 256), x.reshape(-1))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
    finally:
        stop[0] = True
        sampler.join()
    allowed = parse_size(budget) + largest_unit + 64 * 2**20
    assert state_bytes > 4 * parse_size(budget)  # the state really does not fit
    assert peak[0] - baseline <= allowed, (peak[0] - baseline) / 2**20
    assert vb.get_stats()["levels"][0]["misses"] > 0


@pytest.mark.parametrize("host_budget", [256 * 1024, 64 * 2**20])
def test_three_level_path_device_host_nvme_is_bitwise_identical(tmp_path, host_budget):
    """The accelerator path (device -> host pool -> NVMe), run with the CPU standing in for the
    device: pages leave "device" memory into the host pool; a small pool spills to the swap files."""
    from apt_model.memory.paging.session import PagingSession
    from apt_model.memory.swap import SwapSpace
    from apt_model.base.patches import PatchSet

    ref_m = model()
    ref_opt = make_opt(ref_m, "adamw")
    ref = train(ref_m, ref_opt, 8, accum=2, clip=0.5)

    m = model()
    opt = make_opt(m, "adamw")
    patches = PatchSet()
    session = PagingSession(4096, SwapSpace(tmp_path), patches, device="cpu", host_budget=host_budget, host_level=True)
    try:
        session.page_model(m, page_params=True, page_grads=True)
        got = train(m, opt, 8, accum=2, clip=0.5)
        host = session.report()["host_level"]
        state = snapshot(m, opt)
    finally:
        patches.restore_all()
    assert got == ref
    assert_same(state, snapshot(ref_m, ref_opt))
    assert host["bytes_in"] > 0 and host["hits"] > 0
    if host_budget < 2**20:  # level 2 really used, and counted as such
        assert host["spills_to_disk"] > 0 and host["disk"]["read"]["bytes"] > 0 and host["disk"]["written"]["bytes"] > 0
    else:
        assert host["spills_to_disk"] == 0 and host["disk"]["bytes_on_disk"] == 0  # it all fit on the host


def test_pinned_pool_reuses_and_coalesces():
    from apt_model.memory.stores import PinnedPool

    pool = PinnedPool(64 * 1024, pin=False, slab_bytes=32 * 1024)
    a, b, c = pool.alloc(5000), pool.alloc(4096), pool.alloc(10_000)
    assert (a.nbytes, b.nbytes, c.nbytes) == (8192, 4096, 12288) and len(pool.slabs) == 1
    pool.release(a)
    pool.release(b)
    d = pool.alloc(12_000)  # fits the coalesced hole where a and b were
    assert (d.slab, d.offset) == (a.slab, 0)
    big = pool.alloc(30_000)
    assert big is not None and len(pool.slabs) == 2
    assert pool.alloc(40_000) is None  # over the 64 KiB budget


def test_a_pinned_pool_counts_the_power_of_two_its_slabs_really_pin(monkeypatch):
    """PyTorch's caching host allocator rounds each pinned allocation up to a power of two: a slab
    sized for a 70 MB page pins 128 MiB. A pinned pool's slabs are now powers of two, counted as
    such, where that fits the budget; where only the page's own size fits, it still gets a slab of
    that size (as before: the page is held, not refused) and ``pinned_bytes`` says what is really
    pinned. An unpinned pool's slabs are not rounded. (Pinning stood in: this CPU build cannot pin.)"""
    from apt_model.memory.stores import PinnedPool, pinned_bytes

    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    assert [pinned_bytes(n) for n in (1, 4096, 4097, 70 * 10**6, 2**26)] == [1, 4096, 8192, 2**27, 2**26]
    assert pinned_bytes(70 * 10**6, pin=False) == 70 * 10**6
    own = 70 * 10**6 // 4096 * 4096 + 4096  # the 70 MB page in 4 KiB units
    roomy = PinnedPool(300 * 2**20, pin=True)
    assert roomy.slab_bytes == 2**26 and roomy.slab_size_for(70 * 10**6) == 2**27
    big = roomy.alloc(70 * 10**6)
    assert big is not None and roomy.slabs[big.slab].numel() == 2**27 == roomy.pinned_bytes
    rest = roomy.alloc(50 * 2**20)  # the rounded slab's rest holds another page
    assert rest is not None and rest.slab == big.slab and len(roomy.slabs) == 1
    tight = PinnedPool(100 * 2**20, pin=True)  # 128 MiB would pass the budget: the page's own size
    seg = tight.alloc(70 * 10**6)
    assert seg is not None and tight.slabs[0].numel() == own and tight.pinned_bytes == 2**27
    assert tight.alloc(40 * 2**20) is None  # 70 MB + a 64 MiB slab > 100 MiB
    small = PinnedPool(48 * 2**20, pin=True)
    assert small.slab_bytes == 2**25  # a power of two within the budget, not the whole 48 MiB
    small.shrink(40 * 2**20)
    assert small.slab_bytes == 2**23 and small.budget == 8 * 2**20
    plain = PinnedPool(100 * 2**20, pin=False)
    assert plain.slab_size_for(70 * 10**6) == own
    assert plain.alloc(70 * 10**6) is not None and plain.slabs[0].numel() == own == plain.pinned_bytes


# ------------------------------------------------------------------ the level-0 budget is a promise
def wide_model(seed=0):
    """A GPT whose largest parameter (an MLP weight, 256 KiB) is small next to its state (1.7 MB)."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(seq_len=32, d_model=128, n_layers=2, n_heads=2, dropout=0.1))


class LevelMeter(torch.overrides.TorchFunctionMode):
    """Measures the training state on level 0 independently of the pager's books: the bytes of
    every parameter, gradient and optimizer state whose storage is allocated, before every torch
    call (forward, clipping, each op of the optimizer step) and right after every gradient
    accumulation (its hooks are registered before the paging session's, so they run first)."""

    def __init__(self, model, opt):
        super().__init__()
        self.model, self.opt = model, opt
        self.peak = self.samples = 0
        self.handles = [p.register_post_accumulate_grad_hook(lambda p: self.sample()) for p in model.parameters()]

    def sample(self) -> None:
        with torch._C.DisableTorchFunction():
            params = list(self.model.parameters())
            tensors = params + [p.grad for p in params if p.grad is not None]
            for st in self.opt.state.values():
                tensors += [v for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
            storages = {}
            for t in tensors:
                s = t.untyped_storage()
                if s.nbytes():
                    storages[s.data_ptr()] = s.nbytes()
        self.peak = max(self.peak, sum(storages.values()))
        self.samples += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.sample()
        return func(*args, **(kwargs or {}))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("host_level", [True, False], ids=["device-host-nvme", "host-nvme"])
@pytest.mark.parametrize("budget,kept", [(2_500_000, ["parameters"]), (1_200_000, [])],
                         ids=["parameters-kept", "all-paged"])
def test_level0_holds_its_budget_plus_the_largest_page(tmp_path, host_level, budget, kept):
    """The budget is a promise: measured independently (LevelMeter), the training state on level 0
    never exceeds the budget plus the largest page — through the first optimizer step, which
    creates Adam's states, through backward, which creates gradients, with clipping and gradient
    accumulation — on the accelerator path (the CPU standing in for the device: pages go to the
    host level) and on the CPU path; the pager's own peak says the same, parameters the plan keeps
    resident included; and training is bitwise the in-memory one."""
    from apt_model.memory.paging.session import PagingSession
    from apt_model.memory.placement import plan_placement
    from apt_model.memory.swap import SwapSpace
    from apt_model.base.patches import PatchSet

    ref_m = wide_model()
    ref_opt = make_opt(ref_m, "adamw")
    ref = train(ref_m, ref_opt, 3, accum=2, clip=0.5)

    m = wide_model()
    opt = make_opt(m, "adamw")
    plan = plan_placement(m, budget, None)
    assert plan.paged and plan.kept == kept
    largest = max(p.numel() * p.element_size() for p in m.parameters())
    meter = LevelMeter(m, opt)
    patches = PatchSet()
    session = PagingSession(budget, SwapSpace(tmp_path), patches, page_states=plan.page_states, device="cpu",
                            host_budget=8 * 2**20, host_level=host_level)
    try:
        session.page_model(m, plan.page_params, plan.page_grads)
        with meter:
            got = train(m, opt, 3, accum=2, clip=0.5)
        rep = session.pager.report()
        state = snapshot(m, opt)
    finally:
        meter.remove()
        patches.restore_all()
    assert got == ref
    assert_same(state, snapshot(ref_m, ref_opt))
    assert meter.samples > 100 and meter.peak > budget // 2  # it measured the real thing
    assert meter.peak <= budget + largest, (meter.peak, budget, largest)
    assert rep["peak_resident"] <= budget + largest, rep
    assert rep["budget"] == budget and rep["kept_bytes"] == (plan.params_bytes if kept else 0)
    assert rep["misses"] > 0 and rep["bytes_out"] > 0  # pages really moved


def test_the_plans_time_estimate_uses_the_levels_the_pages_move_to():
    """Below an accelerator the pages go to the host level over the link; the disk is only counted
    when the host level cannot hold them — the H100 report said "15.28 s at the measured disk
    bandwidth" while no byte reached the disk. A model the script keeps on the CPU pages to disk."""
    from apt_model.memory.levels import Level
    from apt_model.memory.placement import plan_placement

    m = model()
    disk = {"read": 0.002, "write": 0.001}  # GB/s: slow enough that the seconds do not round to 0
    link = {"h2d": 0.01, "d2h": 0.005}

    def levels(host_capacity):
        return [Level(0, "device", "cuda:0", 300_000, 2000.0),
                Level(1, "host", "host (pinned)", host_capacity, min(link.values()), dict(link)),
                Level(2, "nvme", "nvme:/swap", 10**12, min(disk.values()), dict(disk))]

    roomy = plan_placement(m, 300_000, disk, levels=levels(10**9), device="cuda:0")
    read, write = roomy.read_bytes_per_step, roomy.write_bytes_per_step
    link_s = round(read / (link["h2d"] * 1e9) + write / (link["d2h"] * 1e9), 3)
    disk_s = round(read / (disk["read"] * 1e9) + write / (disk["write"] * 1e9), 3)
    assert roomy.io_path == ["host"] and roomy.disk_seconds_per_step == 0.0
    assert roomy.io_seconds_per_step == link_s > 0
    assert "holds all" in roomy.reason and "no disk traffic" in roomy.reason and "disk bandwidth" not in roomy.reason

    small = plan_placement(m, 300_000, disk, levels=levels(100_000), device="cuda:0")
    assert small.io_path == ["host", "nvme"] and small.io_seconds_per_step == round(link_s + disk_s, 3)
    assert "spill to the swap files" in small.reason and f"{disk_s:.2f} s at the measured disk bandwidth" in small.reason

    on_cpu = plan_placement(m, 300_000, disk, levels=levels(10**9), device="cpu")
    assert on_cpu.io_path == ["nvme"] and on_cpu.io_seconds_per_step == disk_s
    assert f"{disk_s:.2f} s at the measured disk bandwidth" in on_cpu.reason


def test_the_io_estimate_of_a_model_of_small_tensors_is_called_a_floor():
    """A WaveNet of 1.3 KB tensors was told "0.00 s at the measured disk bandwidth" for a step that
    went from 33 to 371 ms, each page's file operations setting the pace (a probe's finding). The
    plan says its estimate is a floor where the parameters average under 256 KiB; not for large ones."""
    from apt_model.memory.placement import plan_placement

    disk = {"read": 0.002, "write": 0.002}  # GB/s: slow enough that the seconds do not round to 0
    small = nn.Sequential(*[nn.Conv1d(8, 8, 2) for _ in range(40)])
    plan = plan_placement(small, 20_000, disk)
    assert plan.paged and "at the measured disk bandwidth, a floor: its 80 parameters average" in plan.reason, plan.reason
    plan = plan_placement(small, 20_000, {"read": 2.0, "write": 2.0})  # no time shown: still said
    assert "its 80 parameters average 272B: pages that small" in plan.reason, plan.reason
    large = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))  # 1 MiB weights
    plan = plan_placement(large, 3 << 20, disk)
    assert plan.paged and "at the measured disk bandwidth" in plan.reason and "a floor" not in plan.reason, plan.reason


def test_a_budget_below_the_working_set_is_refused_with_the_reason():
    """Paging cannot hold a budget smaller than what must be resident at once (here AdamW's step
    of the 64 KiB embedding: weight, gradient, m and v): the plan is refused, naming it and the
    smallest budget that works; forced paging goes on and says by how much it will go over. A
    kept category that leaves the working set no room is paged too."""
    from apt_model.errors import ConfigError
    from apt_model.memory.placement import PagingBudgetError, plan_placement

    m = model()
    with pytest.raises(PagingBudgetError, match=r"tok_emb\.weight .*256\.0KiB.* at least 192KiB \(196608 bytes\)") as info:
        plan_placement(m, 150_000, None)
    assert isinstance(info.value, ConfigError) and "requires_grad_(False)" in str(info.value)  # inference-only
    forced = plan_placement(m, 4096, None, force=True)
    assert forced.paged and forced.over_budget_expected == 262144 - 4096 and "go over" in forced.reason
    ok = plan_placement(m, 200_000, None)
    assert ok.paged and ok.over_budget_expected == 0 and ok.working_set == 262144

    two = torch.nn.Sequential(torch.nn.Linear(512, 512, bias=False), torch.nn.Linear(512, 256, bias=False))
    plan = plan_placement(two, 3_200_000, None)  # the parameters fit the room, but then Adam's step of
    assert plan.kept == [] and plan.page_params  # the 1 MiB weight would not: they are paged too
    assert "parameters paged too" in plan.reason


@pytest.mark.parametrize("budgets,names", [({"device_budget": "150KB"}, "device_budget"),
                                           ({"device_budget": "90MB", "host_budget": "150KB"}, "host_budget")])
def test_paging_refuses_an_impossible_budget_at_adoption(budgets, names, tmp_path, cpu_device):
    """The error names the setting to raise: on a CPU-only run level 0 is the smaller of the device
    and host budgets (the same memory), so a too-small host budget is named as such (until
    2026-11-26 the error always asked for a larger device_budget)."""
    import re

    m = model()
    with pytest.raises(ConfigError, match=f"cannot be held while paging GPT.*set {names} \\(VB_{names.upper()}\\)") as err:
        vb.enable("balanced", swap_dir=str(tmp_path), paging="over_budget", attention="off",
                  mixed_precision="off", banner=False, **budgets)
        m.to("cpu")
    refused = vb.get_report()["models"][0]["features"]["paging"]  # the record says so too (it had no entry)
    assert refused["chosen"] == "refused" and refused["reason"].startswith("PagingBudgetError: ")
    vb.disable()
    # the size it suggests can be typed as written, and is enough (it was rounded to one decimal
    # of KiB: below the need, and "300.1KiB" is no whole number of bytes)
    suggested = re.search(r"to at least (\S+) \(", str(err.value)).group(1)
    vb.enable("balanced", swap_dir=str(tmp_path), paging="over_budget", attention="off",
              mixed_precision="off", banner=False, **{**budgets, names: suggested})
    try:
        m.to("cpu")
        assert vb.get_report()["models"][0]["features"]["paging"]["chosen"] == "paged"
    finally:
        vb.disable()


# ------------------------------------------------------------------ no wait blocks forever
@pytest.fixture
def short_waits():
    """Waits of the memory stack give up after 0.5 s in this test (VB_SWAP_TIMEOUT is 120 s by default)."""
    from apt_model.memory import waits

    waits.set_wait_timeout(0.5)
    yield 0.5
    waits.set_wait_timeout(None)


def two_layers(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))  # 16 KiB weights


def paged_session(tmp_path, m, host_level, readers=2):
    """A paging session over ``m`` with its parameters paged out; with ``host_level`` the
    accelerator's three levels, the CPU standing in for the device, and a host level (20 KiB)
    too small for the first layer's weight, which goes on to the swap files."""
    from apt_model.memory.io_engine import IOEngine
    from apt_model.memory.paging.session import PagingSession
    from apt_model.memory.swap import SwapSpace
    from apt_model.base.patches import PatchSet

    patches = PatchSet()
    session = PagingSession(4096, SwapSpace(tmp_path), patches, device="cpu", host_budget=20 * 1024,
                            host_level=host_level)
    if readers != 2:  # one reader thread: jobs run in the order they are queued
        io = IOEngine(readers=readers, writers=1)
        session.pager.io.close()
        session.pager.io = io
        store = session.pager.store
        (store.disk if host_level else store).io = io
    session.page_model(m, page_params=True, page_grads=False)
    page = session.param_pages[id(m[0].weight)]
    assert page.state.value == "lower" and session.swap.has(page.key)  # on the swap files
    return session, patches


@pytest.mark.parametrize("host_level", [False, True], ids=["host-nvme", "device-host-nvme"])
def test_a_stuck_read_becomes_a_swap_error_naming_what_it_waited_for(tmp_path, monkeypatch, short_waits, host_level):
    """A read that never finishes (a hung disk, a blocked I/O thread) is a SwapTimeoutError after
    the configured limit, naming the page, its bytes, the level and what each I/O thread is doing;
    nothing is freed under the running read, and once it lands the page is usable."""
    import threading
    import time

    from apt_model.memory.swap import SwapError, SwapSpace, SwapTimeoutError

    m = two_layers()
    x = torch.randn(2, 64)
    ref = m(x).detach()
    session, patches = paged_session(tmp_path, m, host_level)
    gate = threading.Event()
    real = SwapSpace.read_into

    def stuck(self, key, out):
        gate.wait(60)
        return real(self, key, out)

    monkeypatch.setattr(SwapSpace, "read_into", stuck)
    try:
        t0 = time.monotonic()
        with pytest.raises(SwapTimeoutError) as info:
            m(x)
        assert time.monotonic() - t0 < 10
        msg = str(info.value)
        assert isinstance(info.value, SwapError)
        for needle in ("waited 0.5 s for the read of page 0.weight", "16384 bytes",
                       f"the {'host' if host_level else 'nvme'} level", "vb-swap-read_", "VB_SWAP_TIMEOUT"):
            assert needle in msg, msg
        page = session.param_pages[id(m[0].weight)]
        assert page.state.value == "loading" and page.future is not None  # the read still owns its buffer
        gate.set()
        assert torch.equal(m(x), ref)  # the read landed: the page is used as it is
    finally:
        gate.set()
        patches.restore_all()


def test_a_stuck_activation_write_and_a_held_lock_become_swap_errors(tmp_path, monkeypatch, short_waits):
    """The activation offloader's waits are bounded too (a write that never lands while memory is
    far over its budget), and so is every lock of the memory stack (the error names the holder)."""
    import threading
    import warnings

    from apt_model.activations.offload import ActivationOffloader
    from apt_model.memory.swap import SwapSpace, SwapTimeoutError

    gate = threading.Event()
    real = SwapSpace.write

    def stuck(self, key, data):
        gate.wait(60)
        return real(self, key, data)

    monkeypatch.setattr(SwapSpace, "write", stuck)
    off = ActivationOffloader(4096, SwapSpace(tmp_path), "cpu", min_bytes=1024)
    handles = []
    try:
        with pytest.raises(SwapTimeoutError, match=r"write of saved activation act\d+ \(8192 bytes.*write queue: "):
            for _ in range(4):
                handles.append(off.pack(torch.randn(2048)))
    finally:
        gate.set()
        off.close()

    m = two_layers()
    (tmp_path / "s").mkdir()
    session, patches = paged_session(tmp_path / "s", m, host_level=False)
    held, done = threading.Event(), threading.Event()

    def holder():
        with session.pager._lock:
            held.set()
            done.wait(60)

    th = threading.Thread(target=holder, name="lock-holder")
    th.start()
    try:
        held.wait(10)
        with pytest.raises(SwapTimeoutError, match=r"pager \(cpu level\) lock, held by thread 'lock-holder'"), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch notes that the always_call forward hook failed too
            m(torch.randn(2, 64))
    finally:
        done.set()
        th.join()
        patches.restore_all()


def test_io_engine_close_is_bounded(short_waits):
    import threading

    from apt_model.memory.io_engine import IOEngine
    from apt_model.memory.swap import SwapTimeoutError

    io = IOEngine(readers=1, writers=1)
    gate = threading.Event()
    io.submit_write(1, lambda: gate.wait(60), "write of page stuck (1 bytes)")
    try:
        with pytest.raises(SwapTimeoutError, match=r"vb-swap-write_0.*write of page stuck"):
            io.close()
    finally:
        gate.set()


@pytest.mark.parametrize("host_level", [False, True], ids=["host-nvme", "device-host-nvme"])
def test_an_alias_dropped_on_an_io_thread_does_not_deadlock_the_pager(tmp_path, host_level):
    """The deadlock shape, built on purpose: the training thread holds the pager lock while it
    waits for a read on the (single) reader thread; that thread first drops the last reference to
    an alias of a page (``w.data`` taken by user code), so the alias's finalizer runs there. The
    finalizer used to release the page under the pager lock — waiting for the training thread,
    which waited for it: neither moved again. Now it only queues the release."""
    import threading

    m = two_layers()
    session, patches = paged_session(tmp_path, m, host_level, readers=1)
    pager = session.pager
    try:
        alias_page = session.param_pages[id(m[1].weight)]
        alias = m[1].weight.data  # user code outside the hooks: faulted in, pinned while the alias lives
        assert alias_page.pins == 1
        gate = threading.Event()
        pager.io.submit_read(0, lambda a=alias: gate.wait(30), "a job holding the last reference to the alias")
        del alias  # the reader thread now holds the last reference
        target = session.param_pages[id(m[0].weight)]
        errors = []

        def acquire():
            try:
                pager.acquire([target])  # holds the pager lock while it waits for the reader thread
            except BaseException as err:  # noqa: BLE001
                errors.append(err)

        th = threading.Thread(target=acquire, daemon=True)
        th.start()
        threading.Timer(0.3, gate.set).start()  # lets the reader thread drop the alias while the lock is held
        th.join(20)
        deadlocked = th.is_alive()
        assert not deadlocked, "deadlock: the pager waits for the reader thread, which waits for the pager lock"
        assert not errors, errors
        assert target.state.value == "resident" and target.pins == 1
        pager.release([target])
        pager.reap()  # applies the queued release of the alias's pin
        assert alias_page.pins == 0
    finally:
        if not locals().get("deadlocked"):  # a deadlocked pager cannot be closed: leave it to the daemon threads
            patches.restore_all()


def test_a_failed_backward_does_not_keep_the_next_ones_pages_pinned(tmp_path):
    """A backward that raised (an out-of-memory on a GPU, a hook's error) never runs its end-of-backward
    callback. The next backward must queue its own: its pages are released when it ends, not kept
    pinned through the optimizer step (level 0 over budget). A frozen parameter in a trained module
    gets no gradient, so only that callback releases its page."""
    m = model(dropout=0.0)
    m.blocks[1].ln1.bias.requires_grad_(False)
    opt = make_opt(m, "adamw")
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    m.to("cpu")
    from apt_model.switch.controller import session as vb_session

    session = vb_session().paging
    train(m, opt, 1)  # the execution order is recorded
    x = torch.randint(0, 256, (4, 32))

    def boom(mod, inp, out):
        def fail(grad):
            raise RuntimeError("boom in backward")

        out.register_hook(fail)

    handle = m.blocks[0].register_forward_hook(boom)
    loss = F.cross_entropy(m(x).reshape(-1, 256), x.reshape(-1))
    with pytest.raises(RuntimeError, match="boom in backward"):
        loss.backward()
    handle.remove()
    assert session._bw_pinned  # units after blocks.0 had started their backward
    opt.zero_grad()
    loss = F.cross_entropy(m(x).reshape(-1, 256), x.reshape(-1))
    loss.backward()
    assert not session._bw_pinned
    assert all(p.pins == 0 for p in session.pager.pages.values())
    opt.step()


# ------------------------------------------------------------------ on the accelerator (-m gpu)
def _accelerator() -> torch.device:
    from conftest import require_accelerator

    return require_accelerator()


@pytest.mark.gpu
@pytest.mark.parametrize("clip,host_budget", [(None, None), (0.5, "256KB")], ids=["host-holds-all", "host-spills"])
def test_paging_on_the_accelerator_is_exact_pinned_and_within_budget(tmp_path, monkeypatch, clip, host_budget):
    """The model on the accelerator, paged through device -> pinned host -> NVMe: bitwise the
    in-memory training on the same device under ``torch.use_deterministic_algorithms(True)``;
    host copies live in pinned slabs; level 0 (measured by the pager, device bytes of training
    state) stays within the budget plus the largest page; with a roomy host level no byte reaches
    the disk (and the plan says so), with a small one pages spill to the swap files."""
    dev = _accelerator()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        ref_m = model().to(dev)
        ref_opt = make_opt(ref_m, "adamw")
        ref = train(ref_m, ref_opt, 6, accum=2, clip=clip, device=dev)
        ref_state = snapshot(ref_m, ref_opt)

        m = model()
        budget = 300_000  # the state is ~1.9 MB; AdamW's step of the 64 KiB embedding needs 256 KiB at once
        extra = {"host_budget": host_budget} if host_budget else {}
        vb.enable("balanced", swap_dir=str(tmp_path), paging="over_budget", device_budget=budget, attention="off",
                  mixed_precision="off", tf32="off", banner=False, **extra)  # TF32: balanced's, not paging's rounding
        m.to(dev)
        opt = make_opt(m, "adamw")
        got = train(m, opt, 6, accum=2, clip=clip, device=dev)
        from apt_model.switch.controller import session as vb_session

        pool = vb_session().paging.pager.store.pool
        pinned = pool.pin and bool(pool.slabs) and all(s.is_pinned() for s in pool.slabs)
        levels = vb.get_stats()["levels"]
        rep = vb.get_report()
        state = snapshot(m, opt)
        vb.disable()
    finally:
        torch.use_deterministic_algorithms(was)
    assert got == ref
    assert_same(state, ref_state)
    assert all(p.device.type == dev.type for p in m.parameters())
    assert [lv["kind"] for lv in levels] == ["device", "host", "nvme"]
    assert pinned and rep["memory"]["paging"]["host_level"]["pinned"] is True
    assert levels[0]["misses"] > 0 and levels[1]["bytes_in"] > 0
    assert levels[0]["peak_resident"] <= budget + 65536, levels[0]
    # a parameter is written to the host once per step that changes it (and once when first paged
    # out): an eviction of one whose host copy is current writes nothing (on the H200 every eviction
    # wrote, with a device-to-device copy first, as if each storage were in shared memory)
    p_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    assert levels[1]["bytes_in_by_kind"].get("param", 0) <= 7 * p_bytes, (levels[1]["bytes_in_by_kind"], p_bytes)
    plan = rep["models"][0]["features"]["paging"]
    if host_budget is None:
        assert levels[1]["spills_to_disk"] == 0 and levels[2]["writes"] == 0
        assert plan["plan"]["io_path"] == ["host"] and "disk bandwidth" not in plan["reason"]
    else:
        assert levels[1]["spills_to_disk"] > 0 and levels[2]["resident_bytes"] > 0 and levels[2]["writes"] > 0
        assert plan["plan"]["io_path"] == ["host", "nvme"]


def test_a_host_level_full_of_prefetches_is_freed_by_finishing_them(tmp_path):
    """Below an accelerator, a page read from disk holds its host slab until the training thread
    copies it to the device. With a small host level full of such prefetches, the next load used
    to fail ("cannot hold ... next to the page(s) in flight") although the room was the waiting
    thread's own to free: the pager now finishes its prefetches and loads (CPU standing in for the
    device); the prefetch nobody used is then let go to hold level 0's budget."""
    m = two_layers()
    x = torch.randn(2, 64)
    ref = m(x).detach()
    session, patches = paged_session(tmp_path, m, host_level=True)
    pager, store = session.pager, session.pager.store
    try:
        first, second = session.param_pages[id(m[0].weight)], session.param_pages[id(m[1].weight)]
        pager.prefetch([first])  # 16 KiB read into the 20 KiB host level, not yet copied to the device
        assert first.state.value == "loading" and first.key in store._inflight
        assert second.key not in store.entries  # spilled to make that room: it needs the host level too
        pager.acquire([second])
        # the 4 KiB level 0 holds one 16 KiB page: the unused prefetch is finished (its host slab
        # freed) and let go, clean, rather than kept over the budget beside the acquired page
        assert first.state.value == "lower" and second.state.value == "resident"
        assert pager.resident_bytes <= pager.budget + pager.largest_page
        pager.release([second])
        assert torch.equal(m(x), ref)
    finally:
        patches.restore_all()


def test_the_report_puts_the_plans_estimate_beside_what_was_measured(tmp_path):
    """After the first steps the report holds the plan's bytes per step next to the measured ones
    (the steps after the first, averaged): for a model paged whole, the pager moves exactly what
    the plan counted — a plan that miscounted would show here."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(seq_len=64, d_model=128, n_layers=4, n_heads=4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    vb.enable("balanced", paging="always", device_budget="256KB", swap_dir=str(tmp_path), banner=False,
              mixed_precision="off", compile="off")
    m.to("cpu")
    for i in range(4):
        x = torch.randint(0, 256, (2, 64))
        loss = F.cross_entropy(m(x).reshape(-1, 256), x.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i == 0:
            assert vb.get_report()["memory"]["paging"]["plan_vs_measured"]["measured"] is None  # one step: no average
    pvm = vb.get_report()["memory"]["paging"]["plan_vs_measured"]
    vb.disable()
    assert pvm["measured"]["steps"] == 3 and pvm["planned"]["read_bytes_per_step"] > 0
    assert pvm["measured_over_planned"]["read_bytes_per_step"] == pytest.approx(1.0, abs=0.05)
    assert pvm["measured_over_planned"]["write_bytes_per_step"] == pytest.approx(1.0, abs=0.05)
    assert pvm["measured"]["stall_s_per_step"] >= 0 and pvm["measured_over_planned"]["stall_over_io_floor"] is not None
    by_phase = pvm["measured"]["stall_s_per_step_by_phase"]
    assert set(by_phase) == {"forward", "backward", "optimizer", "other"}
    assert sum(by_phase.values()) == pytest.approx(pvm["measured"]["stall_s_per_step"], abs=5e-4)


def test_the_stall_is_told_by_phase(tmp_path, monkeypatch, capsys):
    """With reads slowed down (10 ms each), the training thread waits in each phase that loads
    pages — the forward, the backward and the optimizer's chunks — and the report says where."""
    import time as _time

    from apt_model.memory.swap import SwapSpace

    real = SwapSpace.read_into

    def slow(self, key, out):
        _time.sleep(0.01)
        return real(self, key, out)

    monkeypatch.setattr(SwapSpace, "read_into", slow)
    m = model(dropout=0.0)
    vb.enable("balanced", swap_dir=str(tmp_path), compile="off", **FORCE)
    try:
        m.to("cpu")
        train(m, make_opt(m, "adamw"), 3)
        by_phase = vb.get_stats()["levels"][0]["stall_s_by_phase"]
        vb.print_stats()
        text = capsys.readouterr().out
    finally:
        vb.disable()
    assert by_phase["forward"] > 0 and by_phase["backward"] > 0 and by_phase["optimizer"] > 0, by_phase
    assert "level 0 stalled in: forward" in text


@pytest.mark.parametrize("host_level", [False, True], ids=["host-nvme", "device-host-nvme"])
def test_no_device_synchronize_on_the_paging_hot_path(tmp_path, monkeypatch, host_level):
    """Training steps of a paged model (the accelerator's three levels with the CPU standing in
    for the device, and the CPU's two) issue no device-wide synchronize: pages move on their own
    completions, never by stalling the whole device (counted at every entry point the project and
    PyTorch offer)."""
    from apt_model.devices import timing

    calls = []

    def counting(fn, name):
        def wrapper(*a, **k):
            calls.append(name)
            return fn(*a, **k)
        return wrapper

    from apt_model.base.patches import PatchSet
    from apt_model.memory.paging.session import PagingSession
    from apt_model.memory.swap import SwapSpace

    m = two_layers()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    patches = PatchSet()
    session = PagingSession(4096, SwapSpace(tmp_path), patches, device="cpu", host_budget=256 * 1024,
                            host_level=host_level)
    session.page_model(m, page_params=True, page_grads=True)
    monkeypatch.setattr(timing, "synchronize", counting(timing.synchronize, "devices.timing.synchronize"))
    monkeypatch.setattr(torch.accelerator, "synchronize", counting(torch.accelerator.synchronize, "torch.accelerator"))
    monkeypatch.setattr(torch.cpu, "synchronize", counting(torch.cpu.synchronize, "torch.cpu"))
    try:
        for _ in range(3):
            loss = m(torch.randn(2, 64)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert session.pager.stats.loads > 0  # pages really moved
    finally:
        patches.restore_all()
    assert calls == []


def test_an_optimizer_step_through_a_host_level_smaller_than_its_chunk_loses_nothing(tmp_path):
    """The accelerator's levels with the CPU standing in, a 20 KiB host level and 16 KiB pages:
    the optimizer's chunk (a weight and its two AdamW states) cannot sit in the host level at
    once. A page read into the host level is held there until it is copied up (it was spilled in
    flight before: a KeyError, then the weights lost as NaN at disable()); now the step either
    streams through or fails with the clear HostLevelFullError naming VB_HOST_BUDGET, and either
    way every parameter comes back finite."""
    from apt_model.memory.stores import HostLevelFullError

    m = two_layers()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    session, patches = paged_session(tmp_path, m, host_level=True)
    raised = None
    try:
        for _ in range(3):  # the second step is the first with AdamW states to page in
            loss = m(torch.randn(2, 64)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    except Exception as err:  # noqa: BLE001 - the kind of error is asserted below
        raised = err
    finally:
        patches.restore_all()
    if raised is not None:
        chain = [raised, raised.__cause__, raised.__context__]
        assert any(isinstance(e, HostLevelFullError) for e in chain), repr(raised)
        assert "VB_HOST_BUDGET" in str(raised)
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_zero_grad_without_set_to_none_reads_nothing_and_pins_nothing(tmp_path):
    """``zero_grad(set_to_none=False)`` zeroes each gradient in place (``grad.zero_()``, returning
    the gradient itself). A paged-out gradient is marked to load as zeros — no read, no fault — and
    the in-place op's result (the page's own tensor, not an alias) pins nothing: before, every
    gradient was read back to be zeroed and stayed pinned for good, so level 0 could never evict it."""
    ref_m = model()
    ref = train(ref_m, make_opt(ref_m, "sgd"), 4, zero_to_none=False)
    vb.enable("balanced", swap_dir=str(tmp_path), compile="off", **FORCE)
    try:
        m = model().to("cpu")
        opt = make_opt(m, "sgd")
        got = train(m, opt, 4, zero_to_none=False)
        from apt_model.switch.controller import session as vb_session

        pages = list(vb_session().paging.grad_pages.values())
        pins = [pg.pins for pg in pages]
        faults = vb.get_stats()["levels"][0]["faults"]
    finally:
        vb.disable()
    assert got == ref
    assert pages and pins == [0] * len(pages)
    assert faults == 0


def _assert_paged_like_plain(tmp_path, loop):
    """``loop(model, optimizer)`` gives the same results and final state paged (everything, the
    step after backward) as in plain PyTorch; ``vb.disable()`` raises nothing."""
    ref_m, m = model(dropout=0.0), model(dropout=0.0)
    ref_opt, opt = make_opt(ref_m, "adamw"), make_opt(m, "adamw")
    ref = loop(ref_m, ref_opt)
    vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, "paging_step_in_backward": "off"})
    try:
        m.to("cpu")
        got = loop(m, opt)
        got_state = snapshot(m, opt)
    finally:
        vb.disable()
    assert got == ref
    assert_same(snapshot(ref_m, ref_opt), got_state)


def _to_f64_and_back(m):
    m.to(torch.float64)
    m.to(torch.float32)


def _vector_to_parameters(m):
    v = torch.nn.utils.parameters_to_vector(m.parameters())
    torch.nn.utils.vector_to_parameters(v * 0.99, m.parameters())


@pytest.mark.parametrize("change", [_to_f64_and_back, _vector_to_parameters])
def test_parameters_given_new_storage_mid_training_stay_bitwise(tmp_path, change):
    """``p.data = x`` gives a paged parameter new storage under the same object — of another size
    (``model.to(float64)``), or a view into one shared vector (``vector_to_parameters``). The page
    follows the new storage; before, the old swap file was read into it (an error, then every
    tensor NaN at ``disable()``: data lost), or evicting one parameter freed the shared vector."""
    def loop(m, opt):
        losses = train(m, opt, 1)
        change(m)
        return losses + train(m, opt, 2, seed=2)

    _assert_paged_like_plain(tmp_path, loop)  # disable() raised PagingRecoveryError before


def test_logging_through_numpy_stays_bitwise(tmp_path):
    """``p.detach().numpy()`` (TensorBoard and wandb histograms) fixes the storage's size for good;
    evicting it raised "Trying to resize storage that is not resizable" at the next step."""
    def loop(m, opt):
        gen = torch.Generator().manual_seed(1)
        out = []
        w = m.blocks[0].mlp[0].weight
        for _ in range(3):
            opt.zero_grad()
            x = torch.randint(0, 256, (4, 32), generator=gen)
            loss = F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1))
            loss.backward()
            out.append(float(w.grad.detach().cpu().numpy().sum()))
            opt.step()
            out.append(float(w.detach().cpu().numpy().sum()))
            out.append(loss.item())
        return out

    _assert_paged_like_plain(tmp_path, loop)


@pytest.mark.parametrize("step_in_backward", ["off", "on"])
def test_two_optimizers_holding_one_parameter_keep_their_own_states(tmp_path, step_in_backward):
    """The paged states were keyed by parameter alone: a second optimizer over a shared parameter
    (an auxiliary head's optimizer over the shared embedding) stepped with the first one's states,
    silently."""
    def build():
        m = model(dropout=0.0)
        return m, make_opt(m, "adamw"), torch.optim.Adam([m.tok_emb.weight], lr=1e-3)

    def loop(m, opt1, opt2):
        gen = torch.Generator().manual_seed(1)
        out = []
        for _ in range(4):
            x = torch.randint(0, 256, (4, 32), generator=gen)
            opt1.zero_grad()
            loss = F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1))
            loss.backward()
            opt1.step()
            opt2.zero_grad()
            aux = m.tok_emb(x).pow(2).mean()
            aux.backward()
            opt2.step()
            out += [loss.item(), aux.item()]
        return out

    ref, got = build(), build()
    ref_out = loop(*ref)
    vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, "paging_step_in_backward": step_in_backward})
    try:
        got[0].to("cpu")
        got_out = loop(*got)
        states = snapshot(got[0], got[1]), snapshot(got[0], got[2])
    finally:
        vb.disable()
    assert got_out == ref_out
    assert_same(snapshot(ref[0], ref[1]), states[0])
    assert_same(snapshot(ref[0], ref[2]), states[1])


class _LoRA(torch.nn.Module):
    """A low-rank adapter around an existing linear layer (PEFT-style injection)."""

    def __init__(self, base):
        super().__init__()
        self.base = base
        self.A = torch.nn.Parameter(torch.randn(4, base.in_features) * 0.01)
        self.B = torch.nn.Parameter(torch.randn(base.out_features, 4) * 0.01)

    def forward(self, x):
        return self.base(x) + x @ self.A.t() @ self.B.t()


def test_a_module_wrapping_a_paged_model_is_adopted_without_paging_its_parameters_twice(tmp_path):
    """An adapter injected after adoption, and a container around the whole model, are adopted at
    their first forward as models of their own; parameters already paged stay with the model that
    pages them (registered twice, they broke the new model and the original one)."""
    def loop(m):
        torch.manual_seed(5)
        m.blocks[0].mlp[0] = _LoRA(m.blocks[0].mlp[0])
        wrapped = torch.nn.Sequential(m, torch.nn.Identity())
        opt = make_opt(m, "adamw")
        gen = torch.Generator().manual_seed(1)
        losses = []
        for s in range(3):
            opt.zero_grad()
            x = torch.randint(0, 256, (4, 32), generator=gen)
            out = wrapped(x) if s % 2 else m(x)
            loss = F.cross_entropy(out.reshape(-1, 256), x.roll(-1, 1).reshape(-1))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, snapshot(m, opt)

    ref_losses, ref_state = loop(model(dropout=0.0))
    m = model(dropout=0.0)
    vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, "paging_step_in_backward": "off"})
    try:
        m.to("cpu")
        losses, state = loop(m)
    finally:
        vb.disable()
    assert losses == ref_losses
    assert_same(ref_state, state)


def test_hooks_reading_paged_weights_inside_backward(tmp_path):
    """Autograd runs backward without the caller's torch-function modes: a full backward hook
    reading its module's weight, or a gradient hook reading another module's weight, read a page
    backward had let go (a segfault). Hooks registered before paging (wrapped at adoption) and
    after (wrapped at registration) run under the fault handler now."""
    def run(paged):
        m = model(dropout=0.0)
        opt = make_opt(m, "adamw")
        before, after = [], []
        m.blocks[0].mlp[0].register_full_backward_hook(lambda mod, gi, go: before.append(mod.weight.norm().item()))
        if paged:
            vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, "paging_step_in_backward": "off"})
        try:
            m.to("cpu")
            m.blocks[1].mlp[0].register_full_backward_hook(lambda mod, gi, go: after.append(mod.weight.norm().item()))
            m.blocks[1].ln1.weight.register_hook(lambda g: after.append(m.blocks[0].mlp[2].weight.sum().item()))
            losses = train(m, opt, 3)
            return losses, before, after, snapshot(m, opt)
        finally:
            if paged:
                vb.disable()

    ref, got = run(False), run(True)
    assert got[:3] == ref[:3] and len(got[1]) == 3 and len(got[2]) == 6
    assert_same(ref[3], got[3])


def test_hooks_wrapped_in_one_session_serve_the_next(tmp_path):
    """A hook wrapped while paging was on runs under the handler of whichever session is open
    when it runs (it kept the first, closed one's before: no protection after a new enable());
    registering a hook on a paged-out parameter reads nothing."""
    m = model(dropout=0.0)
    opt = make_opt(m, "adamw")
    seen = []
    vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, "paging_step_in_backward": "off"})
    try:
        m.to("cpu")
        from apt_model.switch.controller import session as vb_session

        pager = vb_session().paging.pager
        faults = pager.stats.faults
        m.blocks[1].mlp[0].register_full_backward_hook(lambda mod, gi, go: seen.append(mod.weight.norm().item()))
        m.blocks[1].mlp[0].weight.register_hook(lambda g: None)
        assert pager.stats.faults == faults
        train(m, opt, 1)
    finally:
        vb.disable()
    vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, "paging_step_in_backward": "off"})
    try:
        m.to("cpu")
        train(m, opt, 2, seed=2)
    finally:
        vb.disable()
    assert len(seen) == 3 and all(v == v and v > 0 for v in seen)


def test_storage_given_by_user_code_is_never_freed_under_the_user(tmp_path):
    """``p.data = x``: the page takes its own copy, so paging ``p`` out never frees ``x``'s bytes
    (a segfault on ``x`` before); ``a.data = b.data`` between two paged parameters is refused
    (two pages cannot manage one storage)."""
    m = model(dropout=0.0)
    opt = make_opt(m, "adamw")
    vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, "paging_step_in_backward": "off"})
    try:
        m.to("cpu")
        x = torch.randn(m.blocks[0].mlp[0].weight.shape)
        keep = x.clone()
        m.blocks[0].mlp[0].weight.data = x
        train(m, opt, 1)
        assert x.untyped_storage().nbytes() == keep.numel() * 4 and torch.equal(x, keep)
        with pytest.raises(ValueError, match="another paged tensor"):
            m.blocks[1].mlp[0].weight.data = m.blocks[0].mlp[0].weight.data
    finally:
        vb.disable()


def test_a_dropped_optimizer_takes_its_state_pages_with_it(tmp_path):
    """States are paged per optimizer: a loop that makes a new optimizer per phase must not keep
    the old one's pages (and swap space) for good."""
    m = model(dropout=0.0)
    vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, "paging_step_in_backward": "off"})
    try:
        m.to("cpu")
        from apt_model.switch.controller import session as vb_session

        pager = vb_session().paging.pager
        counts = []
        for phase in range(3):
            opt = make_opt(m, "adamw")
            train(m, opt, 1, seed=phase)
            del opt
            counts.append(sum(1 for pg in pager.pages.values() if pg.category.value == "state"))
        assert counts[0] > 0 and counts == [counts[0]] * 3, counts
    finally:
        vb.disable()


class _ScaleByCtx(torch.autograd.Function):
    """``x * w`` that keeps ``w`` as a ctx attribute (not saved): its backward reads ``w`` itself."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.w = w
        return x * w

    @staticmethod
    def backward(ctx, g):
        return g * ctx.w, None


class _Reuse(torch.nn.Module):
    """Runs ``block`` under reentrant checkpointing, then multiplies by another module's weight
    (``other.weight``, used outside its module) — inside the checkpoint or through a custom
    autograd Function that reads it in its backward."""

    def __init__(self, block, other, how):
        super().__init__()
        self.block, self.how = block, how
        self.other = [other]  # not a submodule: its weight is reached from outside

    def forward(self, x):
        w = self.other[0].weight
        if self.how == "reentrant checkpoint":
            return torch.utils.checkpoint.checkpoint(lambda h: self.block(h) * w, x, use_reentrant=True)
        return _ScaleByCtx.apply(self.block(x), w)


@pytest.mark.parametrize("thread", ["main", "other"])
@pytest.mark.parametrize("how", ["reentrant checkpoint", "custom Function"])
def test_custom_backward_reading_a_parameter_outside_its_module(tmp_path, how, thread):
    """Autograd calls a custom Function's backward — reentrant checkpointing's recomputation among
    them — without the fault handler: a parameter it reads that its own module had let go was
    freed storage ("storage of size 0" or a segfault). It runs under the handler now, also when
    backward runs on another thread than the forward (as on an accelerator's autograd thread,
    whose mode stack is empty)."""
    def build():
        m = model(dropout=0.0)
        m.blocks[1] = _Reuse(m.blocks[1], m.blocks[0].ln2, how)  # block 0 is not in its backward yet
        return m

    ref_m, m = build(), build()
    ref_opt, opt = make_opt(ref_m, "adamw"), make_opt(m, "adamw")
    ref = train(ref_m, ref_opt, 3)
    vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, "paging_step_in_backward": "off"})
    try:
        m.to("cpu")
        got = train(m, opt, 3, backward_thread=thread == "other")
        got_state = snapshot(m, opt)
    finally:
        vb.disable()
    assert got == ref
    assert_same(snapshot(ref_m, ref_opt), got_state)


@pytest.mark.parametrize("how", ["module attribute", "imported name", "deprecated"])
def test_global_backward_hooks_reading_paged_weights(tmp_path, how):
    """Global backward hooks (every module) read a freed page before: a segfault. They run under
    the fault handler now however they were registered — through ``torch.nn.modules.module``'s
    attribute, a name imported before ``enable()``, the deprecated ``register_module_backward_hook``
    — and whether before paging starts or while it is on (they are wrapped as modules read them)."""
    register, register_pre = {
        "module attribute": (lambda h: module_mod.register_module_full_backward_hook(h),
                             lambda h: module_mod.register_module_full_backward_pre_hook(h)),
        "imported name": (_imported_full_hook, _imported_pre_hook),
        "deprecated": (_deprecated_hook, _imported_pre_hook),
    }[how]

    def run(paged):
        m = model(dropout=0.0)
        opt = make_opt(m, "adamw")
        seen = []

        def hook(mod, *_):
            if mod is m.blocks[1].mlp[0]:
                seen.append(m.blocks[0].mlp[2].weight.sum().item())

        handles = [register(hook)]
        if paged:
            vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, "paging_step_in_backward": "off"})
        try:
            m.to("cpu")
            handles.append(register_pre(hook))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the deprecated hook's warning on modules with several inputs
                losses = train(m, opt, 3)
            return losses, seen, snapshot(m, opt)
        finally:
            for h in handles:
                h.remove()
            module_mod._global_is_full_backward_hook = None  # torch never clears it (deprecated vs full)
            if paged:
                vb.disable()

    ref, got = run(False), run(True)
    assert got[:2] == ref[:2] and len(got[1]) == 6
    assert_same(ref[2], got[2])
    assert not module_mod._global_backward_hooks and not module_mod._global_backward_pre_hooks


def test_torch_func_transforms_over_a_paged_model(tmp_path):
    """``torch.func.vmap`` over a paged model's forward raised "Cannot access storage of
    BatchedTensorImpl" (the fault handler looked for aliases of its pages in the batched output);
    per-sample gradients (``vmap(grad(functional_call))``, as differential-privacy training takes
    them) and the forward under ``vmap`` are bitwise those of plain PyTorch now. And
    ``functional_call``'s swap of the tensors it is given into the parameter slots, for one call,
    was taken for model surgery: every parameter was unpaged for good, with a warning each (until
    2026-11-27)."""
    from torch.func import functional_call, grad, vmap

    def run(paged):
        m = model(dropout=0.0)
        opt = make_opt(m, "adamw")
        if paged:
            vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, "paging_step_in_backward": "off"})
        try:
            m.to("cpu")
            train(m, opt, 1)  # pages exist and are out
            x = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(5))
            logits = vmap(lambda xi: m(xi[None])[0])(x)
            params = {k: v.detach() for k, v in m.named_parameters()}

            def loss(p, xi):
                out = functional_call(m, p, (xi[None],))
                return F.cross_entropy(out.reshape(-1, 256), xi.roll(-1, 0))

            per_sample = vmap(grad(loss), in_dims=(None, 0))(params, x)
            functional_call(m, {k: v.clone() for k, v in params.items()}, (x,))
            if paged:  # the calls' swaps are no surgery: every parameter is still paged (none were after them)
                report = vb.get_report()["memory"]["paging"]["models"][0]
                assert report["paged_parameters"] == len(params), report
            return logits, {k: v.clone() for k, v in per_sample.items()}
        finally:
            if paged:
                vb.disable()

    (ref_logits, ref_grads), (logits, grads) = run(False), run(True)
    assert torch.equal(logits, ref_logits)
    assert ref_grads.keys() == grads.keys() and all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)


def test_a_model_first_called_through_functional_call_is_adopted_at_its_first_own_call(tmp_path, cpu_device):
    """A MAML-style outer step calls the model first through ``functional_call`` with computed
    (non-leaf) weights. Adoption ran inside that call and planned from the caller's tensors: with
    paging forced it raised "post accumulate grad hooks cannot be registered on non-leaf tensors",
    and detached weights (no gradients, no states) hid most of the training state from the plan.
    The model is adopted at its first call with its own parameters now: bitwise plain PyTorch, and
    the plan counts gradients and optimizer states."""
    from torch.func import functional_call

    def run(on):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(8, 16, generator=gen)
        if on:
            vb.enable("memory", swap_dir=str(tmp_path), device_budget="16KB", paging="always", attention="off",
                      mixed_precision="off", banner=False)
        try:
            fast = {k: p - 0.1 * torch.ones_like(p) for k, p in m.named_parameters()}  # inner-loop weights
            functional_call(m, fast, (x,)).pow(2).mean().backward()
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
            opt.step()
            losses = []
            for _ in range(3):
                opt.zero_grad()
                loss = m(torch.randn(8, 16, generator=gen)).pow(2).mean()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            plan = vb.get_report()["models"][0]["features"]["paging"]["plan"] if on else None
            return losses, snapshot(m, opt), plan
        finally:
            if on:
                vb.disable()

    ref_losses, ref_state, _ = run(False)
    losses, state, plan = run(True)
    assert losses == ref_losses
    assert_same(state, ref_state)
    assert plan["page_params"] and plan["grads_bytes"] == plan["params_bytes"] > 0 and plan["states_bytes"] > 0, plan


def test_a_parameter_listed_twice_in_the_optimizer_is_refused(tmp_path):
    """Plain PyTorch warns about a parameter listed twice in a group and steps it twice; the
    streamed step gave other results, silently. It is refused now, naming the parameter."""
    m = model()
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    try:
        m.to("cpu")
        with pytest.warns(UserWarning, match="duplicate parameters"):
            opt = torch.optim.SGD(list(m.parameters()) + [m.head.weight], lr=0.1)
        m(torch.randint(0, 256, (2, 32))).sum().backward()
        with pytest.raises(RuntimeError, match=r"tok_emb\.weight appears more than once in SGD"):
            opt.step()
    finally:
        vb.disable()


_SHARED_SCRIPT = '''
import sys, time, torch, torch.nn as nn, torch.nn.functional as F
torch.set_num_threads(1)
import apt_model.optimization.vb_global as vb
how = sys.argv[2]  # "data": as torch.multiprocessing shares a parameter; "empty": a paged-out one's storage
def run(on):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    if on:
        vb.enable("balanced", swap_dir=sys.argv[1], paging="always", device_budget="16KB", banner=False,
                  compile="off", mixed_precision="off")  # bitwise: no bf16 where this CPU is faster with it
    m.to("cpu")
    gen = torch.Generator().manual_seed(1)
    losses, shared = [], 0
    for s in range(4):
        if s == 1 and how == "data":
            for p in m.parameters():  # what torch.multiprocessing does to a parameter it sends to spawn
                p.data.untyped_storage().share_memory_()  # workers: its .data's storage (p.share_memory_() is refused)
                shared += 1
        if s == 2 and how == "empty" and on:
            time.sleep(0.5)  # the writes of the evicted pages are over
            for p in m.parameters():
                if p.untyped_storage().nbytes() == 0:  # paged out: share its empty storage
                    p.untyped_storage().share_memory_()
                    shared += 1
        x = torch.randn(8, 64, generator=gen)
        loss = F.mse_loss(m(x), x[:, :1])
        opt.zero_grad(); loss.backward(); opt.step(); losses.append(loss.item())
    if on:
        vb.disable()
    return losses, [p.detach().clone() for p in m.parameters()], shared
a, b = run(False), run(True)
print("SHARED", b[2])
print("SAME" if a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1])) else "DIFFERENT")
'''


def test_a_parameter_moved_to_shared_memory_is_paged_through_a_copy(tmp_path, cpu_device):
    """Sending a model to a DataLoader's spawn workers moves its tensors' storages to shared memory
    (``share_memory_()``). Paging then resized that memory to free and reload the page, and the
    process died (SIGSEGV, at the latest in ``disable()``). Such a parameter gets a private copy to
    page, as one exported to NumPy does; training stays bitwise. In a subprocess: a crash must fail
    this test, not end the test session."""
    from conftest import clean_env

    proc = subprocess.run([sys.executable, "-c", _SHARED_SCRIPT, str(tmp_path), "data"], capture_output=True,
                          text=True, env=clean_env(), timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip().endswith("SAME"), proc.stdout


def test_only_a_cpu_storage_can_be_in_shared_memory_for_paging():
    """Paging gives a tensor a private copy before freeing a page whose storage resizing would not
    free in place: exported to NumPy, or in the CPU's shared memory. ``UntypedStorage.is_shared()``
    answers True for every storage off the CPU, so on the H200 every eviction copied the page on the
    device and wrote it to the host again, clean or not (7.9x the parameter bytes written per step
    where 4x was planned). A storage standing in for a CUDA one (device ``cuda``, resizable, and
    ``is_shared()`` True, as torch answers there) frees in place."""
    from types import SimpleNamespace

    from apt_model.memory.pages import frees_in_place

    t = torch.ones(8)
    assert frees_in_place(t.untyped_storage())
    shared = torch.ones(8).share_memory_()
    assert not frees_in_place(shared.untyped_storage())
    exported = torch.ones(8)
    exported.numpy()
    assert not frees_in_place(exported.untyped_storage())
    cuda_like = SimpleNamespace(device=torch.device("cuda", 0), resizable=lambda: True, is_shared=lambda: True)
    assert frees_in_place(cuda_like)
    assert not frees_in_place(SimpleNamespace(device=torch.device("cuda", 0), resizable=lambda: False,
                                              is_shared=lambda: True))


def test_torch_save_of_the_optimizer_object_writes_its_paged_states(tmp_path):
    """``torch.save(optimizer)`` (or its ``state``, or a checkpoint dict holding it) pickles each
    state tensor through a fast path no torch function sees: paged-out states were written as
    0-byte records and ``torch.load`` failed ("record size (0 bytes) does not match"). They load
    now, equal to plain PyTorch's, and nothing stays pinned after the save."""
    import gc

    def trained(on):
        m = model(dropout=0.0)
        opt = make_opt(m, "adamw")
        if on:
            vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
        m.to("cpu")
        train(m, opt, 2)
        buf = io.BytesIO()
        torch.save({"opt": opt, "state": opt.state}, buf)
        pinned = None
        if on:
            gc.collect()
            from apt_model.switch.controller import session as vb_session

            pager = vb_session().paging.pager
            pager.flush()
            pinned = [pg.label for pg in pager.pages.values() if pg.pins]
            vb.disable()
        loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        return [v for st in loaded["opt"].state.values() for v in st.values()], pinned

    ref, _ = trained(False)
    got, pinned = trained(True)
    assert pinned == []
    assert len(got) == len(ref) > 0 and all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(ref, got))


@pytest.mark.parametrize("keep_optimizer,in_backward", [
    (False, "off"),
    pytest.param(True, "off", marks=pytest.mark.slow),  # 5 s each; all_dropped covers the mechanism
    pytest.param(False, "auto", marks=pytest.mark.slow),
], ids=["all_dropped", "optimizer_kept_a_while", "step_in_backward"])
def test_a_dropped_model_is_freed_and_the_next_one_trains_like_plain(tmp_path, keep_optimizer, in_backward):
    """A sweep trains models in turn with the switch on: a model the script dropped (with its
    optimizer, at once or one model later) is freed — its parameters, pages, swap files and the
    bytes its plan kept resident — and each new model is paged and trains bit-identically to
    plain training (a dead parameter's id, reused by a new one, must not pass for adopted)."""
    import collections
    import gc
    import weakref

    plain = []
    for phase in range(3):
        m = model(seed=phase, dropout=0.0)
        plain.append(train(m, make_opt(m, "adamw"), 2, seed=phase))
    vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, "paging_step_in_backward": in_backward})
    try:
        from apt_model.switch.controller import session as vb_session

        refs, pages, old_opt = [], [], None
        for phase in range(3):
            m = model(seed=phase, dropout=0.0).to("cpu")
            opt = make_opt(m, "adamw")
            assert train(m, opt, 2, seed=phase) == plain[phase], phase
            s = vb_session().paging
            report = s.report()
            assert report["models"][-1]["paged_parameters"] == len(list(m.parameters()))
            assert report["models_released"] == phase
            pages.append(collections.Counter(pg.category.value for pg in s.pager.pages.values()))
            refs.append((weakref.ref(m), weakref.ref(next(m.parameters()))))
            if keep_optimizer:
                old_opt, opt = opt, None  # dropped one model later
            del m, opt
            gc.collect()
            assert refs[-1][0]() is None, "the paged model outlived the script's last reference"
        del old_opt
        gc.collect()
        assert all(r() is None for _, r in refs), "a dropped model's parameters are still alive"
        # a kept optimizer keeps its parameters (and their pages) until it goes too
        twice = collections.Counter({k: 2 * v for k, v in pages[0].items()})
        assert pages == [pages[0]] + [twice if keep_optimizer else pages[0]] * 2 and pages[0]["state"] > 0, pages
        report = s.report()
        assert report["models_released"] == 3 and report["models"] == [] and not s.pager.pages
        # the hooks the switch put on them left its undo stack too (it grew by every model's hooks)
        assert not [label for label in s.patches.labels() if label.startswith(("paging pre-hook", "paging load", "grad pre-hook"))]
        assert not list(s.swap.folder.glob("*.bin")), "a dropped model's swap files were left"
        assert s.pager.budget == s.level_budget  # no dropped plan's kept bytes still count
    finally:
        vb.disable()


def test_a_model_kept_whole_counts_against_the_budget_of_the_models_after_it(tmp_path, cpu_device):
    """Several models share the one level-0 budget: a model that fits and is not paged still
    occupies level 0, so the model adopted after it is planned against what it leaves, and the pages
    get that much less room — until the script drops it. (Each of these two fits the budget alone;
    both were kept whole, twice the budget on level 0.)"""
    import gc

    def state_bytes(m):
        n = sum(p.numel() * p.element_size() for p in m.parameters())
        return n + n + 2 * n  # parameters, gradients, AdamW's m and v

    a, b = model(seed=0, dropout=0.0), model(seed=1, dropout=0.0)
    budget = int(1.5 * state_bytes(a))
    ref = model(seed=1, dropout=0.0)
    expected = train(ref, make_opt(ref, "adamw"), 2)
    vb.enable("balanced", swap_dir=str(tmp_path), paging="over_budget", device_budget=str(budget), attention="off",
              mixed_precision="off", banner=False)
    from apt_model.switch.controller import session as vb_session

    a.to("cpu")
    b.to("cpu")
    chosen = [r["features"]["paging"]["chosen"] for r in vb.get_report()["models"]]
    assert chosen == ["resident", "paged"]
    opt_a = make_opt(a, "adamw")
    train(a, opt_a, 1)
    assert train(b, make_opt(b, "adamw"), 2) == expected
    s = vb_session().paging
    assert s.pager.budget == budget - s.kept_total() - state_bytes(a)
    del a, opt_a
    gc.collect()
    b(torch.zeros(1, 8, dtype=torch.long))  # the next paged forward gives the room back
    assert s.pager.budget == budget - s.kept_total()


def test_a_model_kept_whole_then_paged_through_a_wrapper_is_counted_once(tmp_path, caplog, cpu_device):
    """A resident model later paged by a module that wraps it: its bytes are the pages' now, not
    still counted as kept whole too (the room was fitted before the wrapper's parameters were
    paged: no room for pages at all, and a false warning that level 0 was full)."""
    a = model(seed=0, dropout=0.0)
    n = sum(p.numel() * p.element_size() for p in a.parameters())
    budget = 6 * n  # a's training state (4 n) fits; the wrapper's (about 8 n) does not
    vb.enable("balanced", swap_dir=str(tmp_path), paging="over_budget", device_budget=str(budget), attention="off",
              mixed_precision="off", banner=False)
    a.to("cpu")
    wrapper = torch.nn.Sequential(a, torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    with caplog.at_level("WARNING", logger="apt_model.memory.paging.session"):
        wrapper.to("cpu")
    from apt_model.switch.controller import session as vb_session

    assert [r["features"]["paging"]["chosen"] for r in vb.get_report()["models"]] == ["resident", "paged"]
    s = vb_session().paging
    assert s.pager.budget == budget - s.kept_total() > 0
    assert not [r for r in caplog.records if "fills the level-0 budget" in r.getMessage()]
    before = vb.get_report()["memory"]["paging"]
    vb.disable()
    report = vb.get_report()["memory"]["paging"]  # the closed session's: each caller gets its own
    report["models"].clear()
    assert vb.get_report()["memory"]["paging"]["models"] == before["models"] != []


def test_a_model_dropped_after_disable_is_freed_and_the_report_stays(tmp_path, cpu_device):
    """After ``disable()`` the switch's report still reads the closed paging session (until the
    next ``enable()``): the session kept every parameter and gradient of its models alive with it,
    so a notebook that disables, then drops its model, kept all of it."""
    import gc
    import weakref

    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    m = model(dropout=0.0).to("cpu")
    opt = make_opt(m, "adamw")
    train(m, opt, 2)
    before = vb.get_report()["memory"]["paging"]
    vb.disable()
    refs = [weakref.ref(t) for p in m.parameters() for t in (p, p.grad)] + [weakref.ref(m)]
    del m, opt
    gc.collect()
    assert [r for r in refs if r() is not None] == []
    after = vb.get_report()["memory"]["paging"]
    assert after["models"] == before["models"] and after["models"][0]["paged_parameters"] > 0
    assert after["optimizer_steps"] == before["optimizer_steps"] == 2
    # the swap folder is gone, and so are the bytes the report and the stats said were in it
    assert before["swap"]["bytes_on_disk"] > 0 and after["swap"]["bytes_on_disk"] == after["swap"]["stale_bytes"] == 0
    assert [(lv["resident_bytes"], lv["stale_bytes"]) for lv in vb.get_stats()["levels"] if lv["kind"] == "nvme"] == [(0, 0)]


def test_pre_step_copies_leave_no_swap_files_behind(tmp_path):
    """Where the plan keeps the parameters resident, each step writes a pre-step copy of every
    parameter it updates (for a roll-back). A copy's key is never written again, yet dropping it
    left its file "for the next write": one file per parameter per step, and a parameter-sized
    pile of stale bytes per step (73.6 MB after 20 steps of training/train.py)."""
    m = model(dropout=0.0)
    vb.enable("balanced", swap_dir=str(tmp_path), paging="over_budget", device_budget="650KiB",
              attention="off", mixed_precision="off", banner=False, paging_step_in_backward="off")
    try:
        m.to("cpu")
        assert vb.get_report()["models"][0]["features"]["paging"]["chosen"] == "paged"
        from apt_model.switch.controller import session as vb_session

        s = vb_session().paging
        assert s.report()["models"][0]["paged_parameters"] == 0  # kept resident: the case with copies
        opt = make_opt(m, "adamw")
        counts = []
        for step in range(5):
            train(m, opt, 1, seed=step)
            s.pager.flush()  # counted with no write in flight (a file still being written was counted a step late)
            counts.append((sum(1 for _ in s.swap.folder.glob("*.bin")), s.swap.stale_bytes))
        # which page is first written behind at step 1 or 2 varies (likely the write-behind's timing;
        # seen: 133 files at step 1 and 134 from step 2 on, in 2 of ~12 full runs): after step 1
        # at most 2 more files and 2 more 64 KiB pages of stale bytes in three steps; a file per
        # parameter per step (the bug) is ~30 files and ~440 KB per step
        assert counts[4][0] - counts[1][0] <= 2 and counts[4][1] - counts[1][1] <= 2 * 65536, counts
    finally:
        vb.disable()


def test_models_adopted_later_are_planned_with_the_budget_the_earlier_ones_leave(tmp_path, cpu_device):
    """Each model adopted in one session (a GAN's two nets, teacher and student, blocks a growing
    network adds) was planned against the whole level-0 budget, ignoring what the plans before it
    keep resident: four small models under 48 KB held 103 KB at the peak, and over_budget_bytes
    said 24 KB of the 55 KB excess. Each plan now gets what the earlier ones leave: the peak keeps
    the bound (budget plus the largest page), the excess is counted against the level's whole
    budget, and training is bitwise plain PyTorch's."""
    def mlp(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32),
                             nn.Linear(32, 4))

    def train_all(ms, opts):
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            for m, opt in zip(ms, opts):
                x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
                opt.zero_grad()
                F.cross_entropy(m(x), y).backward()
                opt.step()

    ref = [mlp(k) for k in range(4)]
    ref_opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in ref]
    train_all(ref, ref_opts)
    vb.enable("memory", swap_dir=str(tmp_path), device_budget="48KB", attention="off", mixed_precision="off",
              banner=False)
    try:
        ms = [mlp(k).to("cpu") for k in range(4)]
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in ms]
        train_all(ms, opts)
        rep = vb.get_report()
        pager = rep["memory"]["paging"]["pager"]
        reasons = [m["features"]["paging"]["reason"] for m in rep["models"]]
        for m, r in zip(ms, ref):
            for a, b in zip(m.parameters(), r.parameters()):
                assert torch.equal(a, b)
    finally:
        vb.disable()
    assert any("the models adopted before keep resident" in r for r in reasons[1:]), reasons
    assert pager["budget"] == 48000
    assert pager["peak_resident"] <= pager["budget"] + pager["largest_page"], pager
    assert pager["over_budget_bytes"] == max(0, pager["peak_resident"] - pager["budget"]), pager


def test_a_model_adopted_later_that_does_not_fit_what_is_left_is_paged_anyway_with_a_warning(tmp_path, cpu_device,
                                                                                            caplog):
    """A later model too big for the budget the earlier ones leave (a layer a growing network adds
    mid-training) is not refused in the middle of training, as the first model would be: all of it
    is paged, a warning names the budget that would hold it, and training is bitwise plain."""
    def nets():
        torch.manual_seed(0)
        a = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32),
                          nn.Linear(32, 4))
        b = nn.Sequential(nn.Linear(4, 64), nn.GELU(), nn.Linear(64, 64), nn.Linear(64, 4))
        return a, b

    def train(a, b, opts):
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
            for opt in opts:
                opt.zero_grad()
            F.cross_entropy(b(a(x)), y).backward()
            for opt in opts:
                opt.step()

    ra, rb = nets()
    train(ra, rb, [torch.optim.AdamW(ra.parameters(), lr=1e-2), torch.optim.AdamW(rb.parameters(), lr=1e-2)])
    vb.enable("memory", swap_dir=str(tmp_path), device_budget="48KB", attention="off", mixed_precision="off",
              banner=False)
    try:
        a, b = nets()
        a.to("cpu")
        with caplog.at_level("WARNING", logger="apt_model"):
            b.to("cpu")
        train(a, b, [torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)])
        reasons = [m["features"]["paging"]["reason"] for m in vb.get_report()["models"]]
        for m, r in ((a, ra), (b, rb)):
            for p, q in zip(m.parameters(), r.parameters()):
                assert torch.equal(p, q)
    finally:
        vb.disable()
    assert "does not fit what they keep resident" in reasons[1] and "set device_budget" in reasons[1], reasons
    assert any("paging Sequential anyway" in r.getMessage() for r in caplog.records)


def test_a_model_adopted_after_one_that_keeps_nothing_resident_is_paged_anyway(tmp_path, cpu_device, caplog):
    """The later model's rule must not read "nothing kept resident before" as "the first model": a
    decoder first called in the middle of a step, after an encoder paged keeping nothing resident,
    was refused with ``PagingBudgetError`` there, where a smaller encoder (some bytes kept) let it
    be paged anyway (a probe's finding). The warning no longer suggests ``paging='always'``, which
    it is doing already."""
    def nets():
        torch.manual_seed(0)
        return (nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]),
                nn.Sequential(nn.Linear(64, 160), nn.Linear(160, 64)))

    def train(enc, dec):
        opt = torch.optim.Adam(list(enc.parameters()) + list(dec.parameters()))
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            opt.zero_grad()
            dec(enc(torch.randn(4, 64, generator=gen))).square().mean().backward()
            opt.step()

    ref = nets()
    train(*ref)
    vb.enable("memory", swap_dir=str(tmp_path), device_budget="100KB", mixed_precision="off", banner=False)
    try:
        enc, dec = nets()
        with caplog.at_level("WARNING", logger="apt_model"):
            train(enc, dec)  # the decoder is adopted at its first call, inside the first step's forward
        models = vb.get_report()["models"]
    finally:
        vb.disable()
    first, second = (m["features"]["paging"] for m in models)
    assert first["chosen"] == second["chosen"] == "paged", (first, second)
    assert first["plan"]["kept_bytes"] == 0, first["plan"]
    assert "adopted after other models, it does not fit the budget" in second["reason"], second["reason"]
    for m, r in zip((enc, dec), ref):
        for p, q in zip(m.parameters(), r.parameters()):
            assert torch.equal(p, q)
    (warning,) = [r.getMessage() for r in caplog.records if "paging Sequential anyway" in r.getMessage()]
    assert "set device_budget" in warning and "paging='always'" not in warning, warning


class _LowRankUpdate(nn.Module):
    """A low-rank update of a weight, as a parametrization (minLoRA-style)."""

    def __init__(self, fan_out, fan_in, r=4):
        super().__init__()
        self.A = nn.Parameter(torch.randn(r, fan_in) * 0.1)
        self.B = nn.Parameter(torch.randn(fan_out, r) * 0.1)

    def forward(self, w):
        return w + self.B @ self.A


@pytest.mark.parametrize("surgery", ["rewrapped", "weight_norm", "reassigned", "module-rebuilt", "grown",
                                     "lora-parametrization", "sparse-layout"])
def test_model_surgery_after_paging_lets_the_old_parameters_go_and_pages_the_new(tmp_path, cpu_device, surgery,
                                                                                caplog):
    """A paged parameter taken out of the model after paging started: re-wrapped over the same
    storage (``nn.Parameter(w)``), replaced by ``weight_norm`` (whose ``original1`` shares the
    weight's storage), reassigned, or its layer rebuilt around its tensors; or the model grown (a
    new head, a block appended). The old parameter was still paged: its eviction freed the storage
    under the new parameter (a segfault at the next optimizer step), it stayed alive for the
    model's life and was loaded at every forward. It is now brought back and no longer paged, and
    the parameters put in (which stayed resident, unpaged, until 2026-11-27) are paged at the
    model's next forward, except where other tensors share their memory (a warning names them).
    Bitwise plain PyTorch."""
    import gc
    import weakref

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))

    def operate(m):
        fc = m[2]
        if surgery == "rewrapped":
            w = fc.weight
            del fc.weight
            fc.weight = nn.Parameter(w)
        elif surgery == "weight_norm":
            torch.nn.utils.parametrizations.weight_norm(fc)
        elif surgery == "reassigned":
            with torch.no_grad():
                fc.weight = nn.Parameter(fc.weight * 0.5)
        elif surgery == "module-rebuilt":  # a layer rebuilt around the old one's tensors (as structured pruning does)
            new = nn.Linear(64, 64)
            new.weight, new.bias = nn.Parameter(fc.weight.data), nn.Parameter(fc.bias.data)
            m[2] = new
        elif surgery == "grown":
            m[4] = nn.Linear(64, 64)
            m.append(nn.GELU())
            m.append(nn.Linear(64, 4))
        elif surgery == "lora-parametrization":  # the weight object moves to parametrizations.weight.original
            torch.manual_seed(3)
            torch.nn.utils.parametrize.register_parametrization(fc, "weight", _LowRankUpdate(64, 64))
        else:  # a tensor paging cannot page: left resident (it raised in the forward, found by a review)
            fc.extra = nn.Parameter(torch.randn(4, 16).to_sparse(), requires_grad=False)

    def train(m, opt, steps, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()

    ref = build()
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), 2, 1)
    operate(ref)
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), 3, 2)
    vb.enable("memory", swap_dir=str(tmp_path), device_budget="40KB", paging="always", attention="off",
              mixed_precision="off", banner=False)
    try:
        m = build().to("cpu")
        train(m, torch.optim.AdamW(m.parameters(), lr=1e-2), 2, 1)
        old = weakref.ref(m[2] if surgery == "module-rebuilt" else m[4] if surgery == "grown" else m[2].weight)
        operate(m)
        with caplog.at_level("WARNING", logger="apt_model"):
            train(m, torch.optim.AdamW(m.parameters(), lr=1e-2), 3, 2)
        got = {k: v.detach().clone() for k, v in m.state_dict().items()}
        gc.collect()
        if surgery in ("reassigned", "module-rebuilt", "grown"):
            assert old() is None  # nothing of the switch keeps the replaced parameter or module alive
        paged = vb.get_report()["memory"]["paging"]["models"][0]["paged_parameters"]
    finally:
        vb.disable()
    kept = sum(int(r.getMessage().split("paging keeps ")[1].split()[0]) for r in caplog.records
               if r.getMessage().startswith("paging keeps "))
    declined = sum("stays resident, not paged" in r.getMessage() for r in caplog.records)
    assert paged + kept + declined == len(list(m.parameters())), (paged, kept, declined)
    if surgery in ("reassigned", "grown", "lora-parametrization"):
        assert kept == declined == 0  # new storage (or the same parameter moved): every parameter is paged
    assert declined == (surgery == "sparse-layout")
    for k, v in ref.state_dict().items():
        assert torch.equal(*(t.to_dense() if t.is_sparse else t for t in (got[k], v))), k


def test_parameters_added_where_the_plan_keeps_parameters_resident_count_against_the_budget(tmp_path, cpu_device):
    """A plan that keeps the parameters resident (paging gradients and states) counts what it
    keeps against level 0: a head the script replaces and a layer it appends after adoption change
    that count (the old head's bytes out, the new ones in), and their gradients are paged like the
    rest. Bitwise plain PyTorch."""
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))

    def grow(m):
        m[4] = nn.Linear(64, 64)
        m.append(nn.GELU())
        m.append(nn.Linear(64, 4))
        return list(m[4].parameters()) + list(m[6].parameters())

    def train(m, opt, steps, gen):
        for _ in range(steps):
            x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()

    def run(m):
        gen = torch.Generator().manual_seed(1)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        train(m, opt, 2, gen)
        opt.add_param_group({"params": grow(m)})
        train(m, opt, 2, gen)
        return opt

    ref = build()
    ref_opt = run(ref)
    vb.enable("memory", swap_dir=str(tmp_path), device_budget="60KB", attention="off", mixed_precision="off",
              banner=False)
    try:
        m = build().to("cpu")
        before = m[4].weight.numel() + m[4].bias.numel()
        opt = run(m)
        paging = vb.get_report()["memory"]["paging"]
        grads = paging["pager"]["categories"]["grad"]["pages"]
        state = snapshot(m, opt)
    finally:
        vb.disable()
    n = sum(p.numel() for p in m.parameters())
    assert paging["kept_resident"] == [{"parameters": 4 * n}], (paging["kept_resident"], 4 * n, 4 * before)
    assert grads == len(list(m.parameters())) + 2, grads  # the old head's too: the optimizer still holds it
    assert_same(state, snapshot(ref, ref_opt))


def test_adafactor_pages_and_stays_bitwise(tmp_path, cpu_device):
    """``torch.optim.Adafactor`` (its factored second moments are per parameter, like Adam's
    moments) was refused on a paged model as "not known to update each parameter independently"."""
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.Linear(64, 4))

    def train(m, opt):
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()

    ref = build()
    ref_opt = torch.optim.Adafactor(ref.parameters(), lr=1e-2)
    train(ref, ref_opt)
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    try:
        m = build().to("cpu")
        opt = torch.optim.Adafactor(m.parameters(), lr=1e-2)
        train(m, opt)
        assert_same(snapshot(m, opt), snapshot(ref, ref_opt))
        assert vb.get_report()["memory"]["paging"]["pager"]["categories"]["state"]["pages"] > 0
    finally:
        vb.disable()


class _FlatMLP(nn.Module):
    """Two linear layers whose four parameters are views of one flat buffer (as flat-parameter
    code builds them); the buffer itself is dropped, or kept and read by the script."""

    def __init__(self, keep_flat: bool):
        super().__init__()
        torch.manual_seed(0)
        flat = torch.randn(16 * 16 + 16 + 16 * 16 + 16) * 0.1
        shapes = [(16, 16), (16,), (16, 16), (16,)]
        views, at = [], 0
        for shape in shapes:
            n = torch.Size(shape).numel()
            views.append(nn.Parameter(flat[at:at + n].view(shape)))
            at += n
        self.w1, self.b1, self.w2, self.b2 = views
        self.flat = flat if keep_flat else None

    def forward(self, x):
        return F.linear(torch.tanh(F.linear(x, self.w1, self.b1)), self.w2, self.b2)


def _train_flat(keep_flat: bool, switch: bool, tmp_path, caplog=None):
    m = _FlatMLP(keep_flat)
    alias = m.w2.detach()  # taken before adoption: reads the trained weight, as without paging
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    if switch:
        vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    try:
        m.to("cpu")
        gen = torch.Generator().manual_seed(2)
        out = []
        for _ in range(3):
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
            opt.zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            out.append((loss.item(), alias.sum().item(), None if m.flat is None else m.flat.sum().item()))
        params = [p.detach().clone() for p in m.parameters()]
    finally:
        if switch:
            vb.disable()
    return out, params


@pytest.mark.parametrize("keep_flat", [False, True], ids=["flat-dropped", "flat-kept"])
def test_parameters_sharing_one_storage_stay_resident_and_train_like_plain(tmp_path, keep_flat, caplog, cpu_device):
    """Parameters that are views of one flat buffer, and a ``.detach()`` alias of one taken before
    the model was adopted: a page frees its storage in place, so each page freed the memory under
    the others and under the alias — a segfault in the optimizer step, or a swap file "altered"
    (found by a probe). Such parameters now stay resident, with a warning naming them."""
    plain = _train_flat(keep_flat, False, tmp_path)
    with caplog.at_level("WARNING"):
        got = _train_flat(keep_flat, True, tmp_path)
    assert got[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], plain[1]))
    assert "w1 (" in caplog.text and "other tensors share their memory" in caplog.text, caplog.text


def test_classic_spectral_norm_weights_are_paged(tmp_path, caplog, cpu_device):
    """``torch.nn.utils.spectral_norm`` leaves ``module.weight`` an alias of ``weight_orig`` until
    its pre-hook first replaces it (from ``weight_orig`` alone): counted as another holder, every
    spectrally normalized weight stayed resident (a reviewer's SNGAN discriminator was not paged).
    It is paged, and trains bitwise like plain PyTorch."""
    from torch.nn.utils import spectral_norm

    def run(switch):
        torch.manual_seed(0)
        m = nn.Sequential(spectral_norm(nn.Linear(16, 32)), nn.LeakyReLU(), spectral_norm(nn.Linear(32, 1)))
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        if switch:
            vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
        try:
            m.to("cpu")
            gen = torch.Generator().manual_seed(3)
            losses = []
            for _ in range(3):
                opt.zero_grad()
                loss = m(torch.randn(8, 16, generator=gen)).mean()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            paged = vb.get_report()["memory"]["paging"]["pager"]["bytes_in"] if switch else None
            return losses, [p.detach().clone() for p in m.parameters()], paged
        finally:
            if switch:
                vb.disable()

    plain = run(False)
    with caplog.at_level("WARNING"):
        got = run(True)
    assert "share their memory" not in caplog.text, caplog.text
    assert got[2] > 0
    assert got[0] == plain[0] and all(torch.equal(a, b) for a, b in zip(got[1], plain[1]))


_SHARED_GRADS_SCRIPT = '''
import sys, torch, torch.nn as nn
torch.set_num_threads(1)
import apt_model.optimization.vb_global as vb
class Joined(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(64, 16) * 0.1)
        self.b = nn.Parameter(torch.randn(64, 16) * 0.1)
        self.rows = nn.ParameterList(nn.Parameter(torch.randn(16) * 0.1) for _ in range(8))
    def forward(self, x):
        return (x @ torch.cat([self.a, self.b], 0)) @ torch.stack(list(self.rows), 0).t()
def run(on, kind):
    torch.manual_seed(0)
    m = Joined() if kind == "joined" else nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    if kind == "flat":  # the gradients are views of one flat buffer the script keeps (apex style)
        flat, o = torch.zeros(sum(p.numel() for p in m.parameters())), 0
        for p in m.parameters():
            p.grad = flat[o:o + p.numel()].view_as(p); o += p.numel()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    if on:
        vb.enable("balanced", swap_dir=sys.argv[1], paging="always", device_budget="16KB", mixed_precision="off",
                  compile="off", attention="off", banner=False)
    m.to("cpu")
    gen, losses = torch.Generator().manual_seed(1), []
    for _ in range(3):
        x = torch.randn(8, 128 if kind == "joined" else 16, generator=gen)
        opt.zero_grad(set_to_none=kind != "flat"); loss = (m(x) ** 2).mean(); loss.backward(); opt.step()
        losses.append(loss.item())
    kept = vb.get_report()["memory"]["paging"]["shared_gradients"] if on else None
    out = losses, [p.detach().clone() for p in m.parameters()], kept
    if on:
        vb.disable()
    return out
for kind in ("joined", "flat"):
    a, b = run(False, kind), run(True, kind)
    same = a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    print(kind, "SAME" if same else "DIFFERENT", len(b[2]))
'''


def test_gradients_that_share_memory_are_kept_resident_and_train_bitwise(tmp_path, cpu_device):
    """Parameters joined by ``torch.cat``/``torch.stack`` in forward get gradients that are views
    of one tensor, and a script may set ``.grad`` to views of one flat buffer (apex style). Paging
    such a gradient freed the memory the others read: a segfault, or a ``SwapError`` (a probe's
    finding). They are kept resident now; training is bitwise. In a subprocess: a crash must fail
    this test, not end the session."""
    from conftest import clean_env

    proc = subprocess.run([sys.executable, "-c", _SHARED_GRADS_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          env=clean_env(), timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.split() == ["joined", "SAME", "10", "flat", "SAME", "4"], proc.stdout


_VIEW_OF_VIEW_SCRIPT = '''
import sys, torch, torch.nn as nn, torch.nn.functional as F
torch.set_num_threads(1)
import apt_model.optimization.vb_global as vb
def run(on):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    if on:
        vb.enable("memory", swap_dir=sys.argv[1], paging="always", device_budget="16KB", mixed_precision="off",
                  compile="off", attention="off", banner=False)
    m.to("cpu")
    gen, kept = torch.Generator().manual_seed(1), []
    for s in range(4):
        opt.zero_grad(set_to_none=False)
        F.mse_loss(m(torch.randn(16, 32, generator=gen)), torch.randn(16, 8, generator=gen)).backward()
        opt.step()
        if s == 1:  # a logger keeping a few numbers of each state and gradient: views of views
            kept = [opt.state[p]["exp_avg"].view(-1)[:4] for p in m.parameters()]
            kept += [p.grad.view(-1)[1:3] for p in m.parameters()]
    out = [v.clone() for v in kept], [p.detach().clone() for p in m.parameters()]
    if on:
        vb.disable()
    return out
a, b = run(False), run(True)
print("SAME" if all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1])) else "DIFFERENT")
'''


def test_a_view_of_a_view_of_a_paged_state_or_gradient_stays_valid(tmp_path, cpu_device):
    """A script keeping ``state["exp_avg"].view(-1)[:4]`` (or a gradient's) across steps: the fault
    handler pinned the page for the first view only; once that temporary died, the page was
    evicted under the second — a segfault or "setStorage: ... out of bounds for storage of size 0"
    (a probe's finding). An op on a pinned alias now counts as one on its page. In a subprocess:
    a crash must fail this test, not end the session."""
    from conftest import clean_env

    proc = subprocess.run([sys.executable, "-c", _VIEW_OF_VIEW_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          env=clean_env(), timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip().endswith("SAME"), proc.stdout


def test_a_capturable_flag_the_script_changes_between_steps_is_kept(tmp_path, cpu_device):
    """``Adam(capturable=True)`` refuses a CPU step; a script that then sets ``capturable=False``
    trains on in plain PyTorch. The paging step put the flag it first saw back before every step
    (a guard against Dynamo's write-back), so every later step raised too (a probe's finding)."""
    def run(switch: bool):
        torch.manual_seed(0)
        m = nn.Linear(32, 64)
        opt = torch.optim.Adam(m.parameters(), lr=0.01, capturable=True)
        if switch:
            vb.enable("memory", swap_dir=str(tmp_path), paging="always", device_budget="16KB", mixed_precision="off",
                      compile="off", attention="off", banner=False)
            m.to("cpu")
        gen, outcome = torch.Generator().manual_seed(1), []
        for _ in range(3):
            opt.zero_grad()
            m(torch.randn(8, 32, generator=gen)).square().mean().backward()
            try:
                opt.step()
                outcome.append("ok")
            except AssertionError:
                outcome.append("refused")
                opt.param_groups[0]["capturable"] = False
        weights = m.weight.detach().clone()
        vb.disable()
        return outcome, weights

    (want, want_w), (got, got_w) = run(False), run(True)
    assert want == ["refused", "ok", "ok"] and got == want and torch.equal(got_w, want_w)


def test_moves_that_change_nothing_move_no_page(tmp_path, cpu_device):
    """``model.to(device)`` on a model already there (scripts call it every epoch), ``model.cpu()``,
    ``model.float()`` of an fp32 model, and ``.cuda()`` redirected to the CPU: each read and wrote
    back every paged parameter and gradient (a probe: 33 MB each way and a third of a paged step
    for a 2M-parameter model). They touch no byte now; training stays bitwise plain PyTorch's."""
    plain = model()
    popt = make_opt(plain, "adamw")
    ref = train(plain, popt, 2) + train(plain, popt, 1, seed=2)
    vb.enable("memory", swap_dir=str(tmp_path), **FORCE)
    m = model().to("cpu")
    opt = make_opt(m, "adamw")
    losses = train(m, opt, 2)

    def moved():
        level = vb.get_stats()["levels"][0]
        return level["bytes_in"], level["bytes_out"], level["faults"]

    before = moved()
    moves = [lambda: m.to("cpu"), m.cpu, m.float, lambda: m.to(torch.device("cpu"), torch.float32)]
    if not torch.cuda.is_available():  # "cuda" is redirected to the selected CPU only where CUDA is absent
        moves += [lambda: m.to("cuda"), m.cuda]
    for move in moves:
        move()
        assert moved() == before, move
    losses += train(m, opt, 1, seed=2)
    assert losses == ref
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), plain.parameters()))
    m.double()  # a real conversion still converts
    assert all(p.dtype == torch.float64 for p in m.parameters())
    assert all(torch.equal(a, b.double()) for a, b in zip(m.parameters(), plain.parameters()))


def test_share_memory_of_a_paged_model_is_refused_and_the_swap_flag_keeps_a_model_unpaged(tmp_path, cpu_device):
    """Hogwild-style ``model.share_memory()`` of a paged model went through, and spawned workers'
    updates never reached it (a silently untrained model); with
    ``torch.__future__.set_swap_module_params_on_conversion(True)`` a paged model's ``.float()`` and
    ``load_state_dict()`` raised "Couldn't swap" (swap_tensors refuses weakly referenced tensors).
    Both found by a probe."""
    from apt_model.errors import DistributedError

    vb.enable("memory", swap_dir=str(tmp_path), **FORCE)
    m = model().to("cpu")
    with pytest.raises(DistributedError, match=r"share_memory_\(\) of a paged tensor.*paging='off'"):
        m.share_memory()
    vb.disable()

    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        vb.enable("memory", swap_dir=str(tmp_path), **FORCE)
        m = model().to("cpu")
        paging = vb.get_report()["models"][0]["features"]["paging"]
        assert paging["chosen"] == "off" and "set_swap_module_params_on_conversion(True)" in paging["reason"]
        m.double()
        m.load_state_dict(model().double().state_dict())
        assert all(p.dtype == torch.float64 for p in m.parameters())
    finally:
        vb.disable()
        torch.__future__.set_swap_module_params_on_conversion(before)


def test_a_paged_out_parameter_whose_empty_storage_was_shared_loads_into_a_private_one(tmp_path, cpu_device):
    """A paged-out parameter's storage (0 bytes) put in shared memory directly: resizing it to
    load the page crashed the process (SIGSEGV, found 2026-11-28). The tensor gets a private
    storage to load into; training stays bitwise. In a subprocess: a crash fails this test only."""
    from conftest import clean_env

    proc = subprocess.run([sys.executable, "-c", _SHARED_SCRIPT, str(tmp_path), "empty"], capture_output=True,
                          text=True, env=clean_env(), timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stdout.split()
    assert int(lines[lines.index("SHARED") + 1]) > 0 and proc.stdout.strip().endswith("SAME"), proc.stdout


def test_print_stats_says_why_level_0_holds_more_than_its_capacity(tmp_path, cpu_device, capsys):
    """A state dict the script keeps holds its paged parameters resident (aliases, as in plain
    PyTorch): the table showed level 0 above its capacity with no word why (a probe's finding)."""
    m = model()
    opt = make_opt(m, "adamw")
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    m.to("cpu")
    train(m, opt, 2)
    vb.print_stats()
    assert "above its capacity" not in capsys.readouterr().out
    kept = m.state_dict()
    vb.print_stats()
    out = capsys.readouterr().out
    level0 = vb.get_stats()["levels"][0]
    assert level0["resident_bytes"] > level0["capacity"]
    assert "level 0 holds" in out and "above its capacity now" in out and "state_dict()" in out
    del kept


def test_the_plan_of_a_frozen_model_counts_its_forward_reads_only():
    """A frozen teacher paged beside a trained student was planned as if it trained: its
    parameters read three times a step (forward, backward, optimizer step), not once."""
    from apt_model.memory.placement import plan_placement

    trained, frozen = model(), model().requires_grad_(False)
    p_bytes = sum(p.numel() * p.element_size() for p in frozen.parameters())
    a, b = plan_placement(trained, 4096, None, force=True), plan_placement(frozen, 4096, None, force=True)
    assert a.read_bytes_per_step >= 3 * p_bytes and "forward only" not in a.reason
    assert (b.read_bytes_per_step, b.write_bytes_per_step) == (p_bytes, 0) and "forward only" in b.reason



def test_parameters_unfrozen_after_the_plan_are_counted_against_the_budget(tmp_path, caplog):
    """The plan counts the gradients and optimizer states of the parameters trainable at adoption:
    progressive unfreezing later grew them about 100x, resident, counted nowhere, the report
    unchanged (a probe's finding). What the plan keeps resident of the unfrozen parameters is
    counted from their first gradient on (the report's kept bytes), said once; training stays
    bitwise as plain PyTorch."""
    import logging

    def run(paged: bool):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 4))
        for layer in list(m)[:-1]:
            layer.requires_grad_(False)
        if paged:
            vb.enable("memory", swap_dir=str(tmp_path), device_budget="64KB", fp4="off", mixed_precision="off",
                      attention="off", compile="off", activation_checkpointing=False, activation_offload=False,
                      banner=False)
        try:
            m.to("cpu")
            opt = torch.optim.AdamW(m[-1].parameters(), lr=1e-2)
            gen = torch.Generator().manual_seed(1)
            kept = []
            for step in range(6):
                if step == 3:
                    m.requires_grad_(True)
                    opt.add_param_group({"params": [p for layer in list(m)[:-1] for p in layer.parameters()]})
                x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
                loss = F.cross_entropy(m(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if paged:
                    kept.append(vb.get_report()["memory"]["paging"]["pager"]["kept_bytes"])
            return {k: v.clone() for k, v in m.state_dict().items()}, kept
        finally:
            if paged:
                vb.disable()

    ref, _ = run(False)
    with caplog.at_level(logging.WARNING, logger="apt_model"):
        got, kept = run(True)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    trainable = sum(p.numel() * 4 for p in got.values())
    assert kept[2] < 0.1 * trainable <= 3 * trainable <= kept[-1], kept  # gradients and Adam's two states
    assert caplog.text.count("frozen when its paging plan was made have become trainable") == 1
