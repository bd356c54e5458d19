"""Paging training state to NVMe through the switch: exactness, checkpoints, faults, stats."""
import copy
import io
import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from apt_model.errors import ConfigError
from apt_model.memory.swap import SwapCorruptionError, SwapFullError
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


def train(m, opt, steps, accum=1, clip=None, seed=1, sched=None, eval_every=0, zero_to_none=True):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout
    losses = []
    for s in range(steps):
        opt.zero_grad(set_to_none=zero_to_none)
        for _ in range(accum):
            x = torch.randint(0, 256, (4, 32), generator=gen)
            loss = F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1)) / accum
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
        assert torch.equal(pa[k], pb[k]), k
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k])), (i, k)


@pytest.mark.parametrize("kind,accum,clip,zero_to_none,opt_after", [
    ("adamw", 1, None, True, False),
    ("adamw", 3, 0.5, True, False),
    ("sgd", 2, 1.0, False, False),
    ("adam", 1, 0.5, True, True),
])
def test_every_tensor_through_nvme_is_bitwise_identical(kind, accum, clip, zero_to_none, opt_after, tmp_path):
    steps = 20
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


def test_paged_tensors_are_in_files_not_in_memory(tmp_path):
    m = model()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    m.to("cpu")
    session = vb.get_report()["memory"]["paging"]
    assert session["pager"]["categories"]["param"]["resident"] == 0
    from apt_model.switch.controller import _state

    pager = _state.adopter.session.pager
    for n, p in m.named_parameters():
        assert p.untyped_storage().nbytes() == 0  # no bytes in RAM
        page = _state.adopter.session.param_pages[id(p)]
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
    torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, buf)
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
    from apt_model.switch.controller import _state

    session = _state.adopter.session
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
    from apt_model.switch.controller import _state

    session = _state.adopter.session
    w = m.blocks[0].attn.qkv.weight
    page = session.param_pages[id(w)]
    path = session.pager.swap._records[page.key].path
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(SwapCorruptionError, match=str(path)):
        train(m, opt, 1)
    assert w.untyped_storage().nbytes() == 0  # nothing half-loaded


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
        from apt_model.switch.controller import _state

        _state.adopter.session.pager.flush()
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


def test_stats_and_print_stats_per_level(tmp_path, capsys):
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
    vb.print_stats()
    text = capsys.readouterr().out
    assert "Level 0" in text and "Level 1" in text and "misses" in text


def test_closure_and_unsupported_optimizers_are_refused(tmp_path):
    m = model()
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    m.to("cpu")
    opt = make_opt(m, "adamw")
    x = torch.randint(0, 256, (2, 32))

    def closure():
        loss = m(x).sum()
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match=r"step\(closure\)"):
        opt.step(closure)
    lbfgs = torch.optim.LBFGS(m.parameters())
    m(x).sum().backward()
    with pytest.raises(RuntimeError, match="LBFGS holds paged parameters"):
        lbfgs.step(lambda: m(x).sum())


def test_peak_rss_stays_within_the_host_budget(tmp_path):
    """Measured with psutil while training (not by arithmetic): the peak RSS above the process's
    RSS right after adoption (model paged out, probes done) stays under the host budget plus the
    largest module's working set (its weight, gradient and two Adam states) plus 64 MiB for
    activations and allocator slack — the documented constant."""
    import threading
    import time as _time

    import psutil

    from apt_model.memory.host import release_free_memory
    from apt_model.memory.sizes import parse_size

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
    from apt_model.switch.patches import PatchSet

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
    if host_budget < 2**20:
        assert host["spills_to_disk"] > 0 and host["disk"]["read"]["bytes"] > 0  # level 2 really used
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
