"""The optimizer step on the host (paging/host_step.py) and the cost model that places it
(paging/step_placement.py).

The accelerator path is run with the CPU standing in for the device (``host_level=True``): the
parameters stay on the "device", gradients go down to the host level as they are produced, the
states live only on the host. With the same kernels the result must be bitwise the in-memory
training's; the traffic must be what the scheme promises.
"""
import copy

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import apt_model.optimization.vb_global as vb
from apt_model.base.patches import PatchSet
from apt_model.memory.pages import Category
from apt_model.memory.paging.session import PagingSession
import apt_model.memory.paging.host_step as host_step_mod
from apt_model.memory.paging.step_placement import STEP_CHOICES, StepPlacement, plan_optimizer_step
from apt_model.memory.swap import SwapSpace
from test_paging import assert_same, make_opt, model, snapshot, train


def _session(tmp_path, host_budget=64 * 2**20, level_budget=2 * 2**20):
    tmp_path.mkdir(parents=True, exist_ok=True)
    patches = PatchSet()
    session = PagingSession(level_budget, SwapSpace(tmp_path), patches, device="cpu", host_budget=host_budget,
                            host_level=True)
    return session, patches


def _state_pages(session):
    return [pg for pg in session.pager.pages.values() if pg.category is Category.STATE]


def _host_stepped(tmp_path, m, opt, run, exact=True, state=True):
    """``run(m, opt) -> losses`` with the host step (the CPU standing in for the device): (losses,
    the state snapshot taken before the session closes or None, the host step's report)."""
    session, patches = _session(tmp_path)
    try:
        session.page_model(m, page_params=False, page_grads=True)
        session.step_on_host(m, exact=exact)
        got = run(m, opt)
        snap = snapshot(m, opt) if state else None
        rep = session.report()["host_step"]
    finally:
        patches.restore_all()
    return got, snap, rep


def _against_plain(tmp_path, run, kind="adamw"):
    """``run(model, optimizer) -> losses`` in plain training and with the host step (exact
    kernels): (plain losses, plain state, host losses, host state, the host step's report)."""
    ref_m = model()
    ref_opt = make_opt(ref_m, kind)
    ref = run(ref_m, ref_opt)
    m = model()
    got, state, rep = _host_stepped(tmp_path, m, make_opt(m, kind), run)
    return ref, snapshot(ref_m, ref_opt), got, state, rep


@pytest.mark.parametrize("kind,accum,clip,zero_to_none,sched", [
    ("adamw", 2, 0.5, True, False),
    ("sgd", 1, None, False, False),
    ("adam", 1, 1.0, True, True),
])
def test_the_host_step_is_bitwise_the_in_memory_step_on_the_same_kernels(tmp_path, kind, accum, clip, zero_to_none,
                                                                         sched):
    ref_m = model()
    ref_opt = make_opt(ref_m, kind)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 2, 0.5) if sched else None
    ref = train(ref_m, ref_opt, 6, accum=accum, clip=clip, zero_to_none=zero_to_none, sched=ref_sched)

    m = model()
    opt = make_opt(m, kind)
    sch = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if sched else None
    session, patches = _session(tmp_path)
    try:
        session.page_model(m, page_params=False, page_grads=True)
        session.step_on_host(m, exact=True)
        got = train(m, opt, 6, accum=accum, clip=clip, zero_to_none=zero_to_none, sched=sch)
        state = snapshot(m, opt)
        rep = session.report()["host_step"]
        traffic = session.traffic()
        states_paged = _state_pages(session)
        grad_pages = [pg for pg in session.pager.pages.values() if pg.category is Category.GRAD]
        assert not opt.state  # the user's optimizer holds nothing: the states live on the host
    finally:
        patches.restore_all()
    assert got == ref
    assert_same(state, snapshot(ref_m, ref_opt))
    p_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    assert rep["steps"] == 6 and not rep["fused"]
    assert rep["param_bytes_up_per_step"] == p_bytes  # each parameter goes up once per step
    assert rep["grad_bytes_down_per_step"] == p_bytes  # each gradient is read into a host buffer once
    assert not states_paged  # no optimizer state ever became a page of the device level
    assert grad_pages  # the gradients did go down as they were produced
    assert traffic["steps"] == 5 and traffic["write_bytes_per_step"] == accum * p_bytes  # each backward's gradients
    if accum == 1:
        assert traffic["read_bytes_per_step"] == 0  # nothing comes back up through the pager: no state, no gradient


class _CoupledAdamW(torch.optim.AdamW):
    """A subclass: it may couple its parameters, so the host steps it whole."""


@pytest.mark.parametrize("host_budget,interleaved", [(64 * 2**20, True), (2 * 2**20 + 192 * 2**10, False)],
                         ids=["grads-in-host-memory", "grads-spilled-to-disk"])
def test_the_host_step_in_chunks_is_bitwise_the_whole_step(tmp_path, monkeypatch, host_budget, interleaved):
    """Chunks of a few KiB (tens per step), in the order the gradients landed: bitwise plain
    training. Each chunk reads its own gradients where all host copies are in memory; where some
    were spilled to disk every gradient is read first (a read error then modifies nothing)."""
    monkeypatch.setattr(host_step_mod, "CHUNK_BYTES", 4096)
    ref_m = model()
    ref_opt = make_opt(ref_m, "adamw")
    ref = train(ref_m, ref_opt, 4, clip=0.5)
    m = model()
    opt = make_opt(m, "adamw")
    p_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    # level 0 with room for the kept parameters and a few gradients: the others are evicted (their
    # host copies, or where those spilled, their files, are what the step reads)
    session, patches = _session(tmp_path, host_budget=host_budget, level_budget=p_bytes + 160 * 2**10)
    try:
        session.page_model(m, page_params=False, page_grads=True)
        session.step_on_host(m, exact=True)
        got = train(m, opt, 4, clip=0.5)
        state = snapshot(m, opt)
        rep = session.report()["host_step"]
        spilled = session.pager.store.stats()["disk"]["written"]["bytes"] if interleaved is False else None
    finally:
        patches.restore_all()
    assert got == ref
    assert_same(state, snapshot(ref_m, ref_opt))
    n_params = len(list(m.parameters()))
    assert 4 < rep["chunks_per_step"] <= n_params, rep
    assert rep["interleaved_steps"] == (4 if interleaved else 0), rep
    assert rep["grad_bytes_shared_per_step"] == 0  # clipping's deferred scaling: read into buffers
    if spilled is not None:
        assert spilled > 0  # the small host level did spill


@pytest.mark.parametrize("kind", ["adamw", "sgd", "adam"])
def test_the_host_step_reads_gradients_where_they_lie_and_leaves_them_unchanged(tmp_path, kind):
    """No clipping, every gradient's host copy in memory: Adam and AdamW read the copies themselves
    (no host-to-host copy), SGD reads buffers — bitwise plain training either way, and the
    gradients after the last step are still plain training's."""
    grads = []

    def run(m, opt):
        losses = train(m, opt, 4)
        grads.append({n: p.grad.detach().clone() for n, p in m.named_parameters()})  # paged: read back
        return losses

    ref, ref_state, got, state, rep = _against_plain(tmp_path, run, kind)
    assert got == ref
    assert_same(state, ref_state)
    plain, paged = grads
    assert plain.keys() == paged.keys() and all(torch.equal(paged[n], plain[n]) for n in plain)
    p_bytes = sum(p.numel() * p.element_size() for p in model().parameters())
    assert rep["grad_bytes_down_per_step"] == p_bytes, rep
    # Adam/AdamW only read gradients: read in place; SGD's foreach Nesterov path adds into them: buffers
    assert rep["grad_bytes_shared_per_step"] == (0 if kind == "sgd" else p_bytes), rep


def test_an_optimizer_subclass_is_stepped_whole_on_the_host(tmp_path, monkeypatch):
    monkeypatch.setattr(host_step_mod, "CHUNK_BYTES", 4096)

    def run(m, opt):
        return train(m, opt, 3)

    m_ref = model()
    ref = run(m_ref, _CoupledAdamW(m_ref.parameters(), lr=1e-3, weight_decay=0.1))
    m = model()
    opt = _CoupledAdamW(m.parameters(), lr=1e-3, weight_decay=0.1)
    session, patches = _session(tmp_path)
    try:
        session.page_model(m, page_params=False, page_grads=True)
        session.step_on_host(m, exact=True)
        got = run(m, opt)
        rep = session.report()["host_step"]
    finally:
        patches.restore_all()
    assert got == ref
    assert rep["chunks_per_step"] == 1 and rep["interleaved_steps"] == 0, rep


class _TwoOptimizers:
    """Two AdamW optimizers over disjoint halves of a model's parameters, stepped one after the
    other as one (``zero_grad``/``step`` for :func:`test_paging.train`)."""

    def __init__(self, m):
        params = list(m.parameters())
        half = len(params) // 2
        self.opts = [torch.optim.AdamW(params[:half], lr=1e-3, weight_decay=0.1),
                     torch.optim.AdamW(params[half:], lr=2e-3)]

    def zero_grad(self, set_to_none=True):
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self):
        for o in self.opts:
            o.step()


def test_chunked_host_steps_are_invisible_to_global_hooks_and_every_optimizer_follows_the_landing_order(
        tmp_path, monkeypatch):
    """A global optimizer step hook sees each user ``step()`` once (plain PyTorch), never the
    shadow's chunks; with two host-stepped optimizers both step their chunks in the order the
    gradients landed, and the result is bitwise plain training's."""
    monkeypatch.setattr(host_step_mod, "CHUNK_BYTES", 4096)
    seen = []
    handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: seen.append(opt))
    try:
        ref_m = model()
        ref_opt = _TwoOptimizers(ref_m)
        ref = train(ref_m, ref_opt, 3, clip=0.5)
        ref_seen, seen[:] = list(seen), []
        m = model()
        opt = _TwoOptimizers(m)
        got, _, rep = _host_stepped(tmp_path, m, opt, lambda m, o: train(m, o, 3, clip=0.5), state=False)
    finally:
        handle.remove()
    assert got == ref
    for a, b in zip(m.parameters(), ref_m.parameters()):
        assert torch.equal(a, b)
    assert len(ref_seen) == 6
    assert seen == [o for _ in range(3) for o in opt.opts]  # the user's steps only, once each
    assert rep["steps"] == 6 and rep["chunks_per_step"] > 2, rep
    assert rep["landing_ordered_steps"] == 6, rep  # the second optimizer too


def test_the_host_steps_state_dict_round_trips_with_plain_training(tmp_path):
    """Saved mid-run from the host step, loaded into plain training (and the other way round), the
    run continues bitwise as if never interrupted."""
    ref_m = model()
    ref_opt = make_opt(ref_m, "adamw")
    ref = train(ref_m, ref_opt, 3, clip=0.5) + train(ref_m, ref_opt, 3, clip=0.5, seed=2)
    ref_state = snapshot(ref_m, ref_opt)

    m = model()
    opt = make_opt(m, "adamw")
    session, patches = _session(tmp_path / "a")
    try:
        session.page_model(m, page_params=False, page_grads=True)
        session.step_on_host(m, exact=True)
        first = train(m, opt, 3, clip=0.5)
        saved_model = {k: v.clone() for k, v in m.state_dict().items()}
        saved_opt = opt.state_dict()
    finally:
        patches.restore_all()
    assert saved_opt["state"] and all("exp_avg" in st for st in saved_opt["state"].values())
    plain_m = model()
    plain_m.load_state_dict(saved_model)
    plain_opt = make_opt(plain_m, "adamw")
    plain_opt.load_state_dict(copy.deepcopy(saved_opt))  # load_state_dict keeps the tensors it is given
    second = train(plain_m, plain_opt, 3, clip=0.5, seed=2)
    assert first + second == ref
    assert_same(snapshot(plain_m, plain_opt), ref_state)

    # plain -> host step: the states loaded before the first host step are taken over
    m2 = model()
    m2.load_state_dict(saved_model)
    opt2 = make_opt(m2, "adamw")
    opt2.load_state_dict(copy.deepcopy(saved_opt))
    session, patches = _session(tmp_path / "b")
    try:
        session.page_model(m2, page_params=False, page_grads=True)
        session.step_on_host(m2, exact=True)
        again = train(m2, opt2, 3, clip=0.5, seed=2)
        state2 = snapshot(m2, opt2)
    finally:
        patches.restore_all()
    assert again == second
    assert_same(state2, ref_state)


def test_weights_edited_between_steps_are_followed(tmp_path):
    """Code that changes a weight in place between steps (``p.mul_()``, ``p.data = ...``): the
    host copy is refreshed from the device before the next step, exactly as plain training sees it."""
    def run(m, opt, session=None):
        losses = train(m, opt, 2)
        with torch.no_grad():
            m.lm_head.weight.mul_(0.5) if hasattr(m, "lm_head") else next(m.parameters()).mul_(0.5)
            p = list(m.parameters())[-1]
            p.data = p.data * 0.25
        return losses + train(m, opt, 2, seed=3)

    ref, ref_state, got, state, rep = _against_plain(tmp_path, run)
    assert got == ref
    assert_same(state, ref_state)
    assert rep["copies_refreshed"] >= 1


def test_the_fused_host_kernel_trains_the_same_model_within_rounding(tmp_path):
    """``paging_exact=False`` on an accelerator: the host uses the CPU's fused AdamW. Not bitwise
    (other kernels), but the same training: close after a few steps, and it says it is fused."""
    ref_m = model(dropout=0.0)
    ref_opt = make_opt(ref_m, "adamw")
    ref = train(ref_m, ref_opt, 4, clip=0.5)
    m = model(dropout=0.0)
    got, _, rep = _host_stepped(tmp_path, m, make_opt(m, "adamw"), lambda m, o: train(m, o, 4, clip=0.5),
                                exact=False, state=False)
    assert rep["fused"] is True
    assert got == pytest.approx(ref, rel=1e-4)
    for a, b in zip(m.parameters(), ref_m.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------- the cost model

GB = 10**9
_SIZES = dict(params_bytes=1 * GB, grads_bytes=1 * GB, states_bytes=2 * GB, page_params=False, page_states=True)


def _plan(request="auto", exact=False, device="cuda", link=50.0, dev=3000.0, host_rate=5 * GB, room=None, **kw):
    sizes = {**_SIZES, **kw}
    return plan_optimizer_step(request, exact, device, link_gbps=link, device_gbps=dev, host_rate=host_rate,
                               host_room=room, **sizes)


def test_the_cost_model_moves_the_step_to_the_host_only_where_it_is_predicted_faster():
    fast_host = _plan(host_rate=20 * GB)  # link: (1+1)/50 = 0.04 s + host 0.05 s vs (4+2)/50 + ~0 = 0.12 s
    assert fast_host.where == "host" and fast_host.predicted_s["host"] < fast_host.predicted_s["device"]
    assert not fast_host.exact
    slow_host = _plan(host_rate=0.5 * GB)  # host step 2 s
    assert slow_host.where == "device" and slow_host.predicted_s["device"] < slow_host.predicted_s["host"]
    assert "predicted" in slow_host.reason


def test_the_cost_model_keeps_the_step_on_the_device_for_the_documented_reasons():
    called = []

    def rate():
        called.append(1)
        return 100 * GB

    assert "paging_exact=True" in _plan(exact=True, host_rate=rate).reason  # other rounding on cuda
    assert not called  # the host was not probed for a decision that did not need it
    assert _plan(page_params=True).where == "device"
    assert _plan(page_states=False).where == "device"
    small_host = _plan(room=2 * GB)
    assert small_host.where == "device" and "host memory" in small_host.reason
    assert _plan(link=None).where == "device"  # nothing measured: no basis
    assert _plan(request="device", host_rate=100 * GB).where == "device"
    forced = _plan(request="host", host_rate=0.1 * GB)
    assert forced.where == "host" and forced.reason == "paging_step=host"
    # on the CPU standing in for the device the host runs the same kernels: exact, allowed when exact
    same = _plan(request="host", exact=True, device="cpu")
    assert same.where == "host" and same.exact
    with pytest.raises(ValueError, match="valid values: auto, device, host"):
        _plan(request="gpu")
    with pytest.raises(ValueError, match="where='disk'"):
        StepPlacement("disk", "no")
    assert STEP_CHOICES == ("auto", "device", "host")


def test_every_placement_is_plain_data_when_the_host_rate_was_never_probed():
    """The decision travels in the report (JSON, and pickled across processes by the GPU benchmark's
    workers): a host-rate probe the decision did not need stays ``None``, not the callable (seen on
    an H200: "Can't pickle local object ... <lambda>")."""
    import json
    import pickle

    def rate():
        return 100 * GB

    cases = [_plan(exact=True, host_rate=rate), _plan(page_params=True, host_rate=rate),
             _plan(page_states=False, host_rate=rate), _plan(room=2 * GB, host_rate=rate),
             _plan(request="device", host_rate=rate)]
    for placement in cases:
        d = placement.to_dict()
        assert d["where"] == "device" and d["inputs"]["host_step_bytes_per_s"] is None, d
        assert json.loads(json.dumps(d)) == d
        pickle.dumps(d)
    probed = _plan(host_rate=rate).to_dict()  # needed: probed, and the measured rate is reported
    assert probed["inputs"]["host_step_bytes_per_s"] == 100 * GB


def test_the_switch_reports_where_the_step_runs_and_validates_the_settings(tmp_path, monkeypatch):
    from apt_model.errors import ConfigError

    with pytest.raises(ConfigError, match="valid values: auto, device, host"):
        vb.enable("balanced", paging_step="gpu", banner=False)
    monkeypatch.setenv("VB_PAGING_EXACT", "maybe")
    with pytest.raises(ConfigError, match="VB_PAGING_EXACT"):
        vb.enable("balanced", banner=False)
    monkeypatch.delenv("VB_PAGING_EXACT")
    vb.enable("balanced", paging="always", device_budget="4KB", swap_dir=str(tmp_path), attention="off",
              mixed_precision="off", compile="off", banner=False, paging_step="host", device="cpu")
    try:
        m = model().to("cpu")
        opt = make_opt(m, "adamw")
        train(m, opt, 2)
        rep = vb.get_report()
    finally:
        vb.disable()
    step = rep["models"][0]["features"]["paging"]["optimizer_step"]
    assert step["where"] == "device" and "CPU-only run" in step["reason"]
    assert rep["memory"]["paging"]["host_step"] is None


@pytest.mark.gpu
def test_the_host_step_on_an_accelerator_trains_within_rounding_and_keeps_states_off_the_device(tmp_path):
    """On the accelerator itself: parameters resident on the device, gradients through pinned host
    slabs, states only on the host (fused CPU kernel, ``paging_exact=False``): the same training as
    in memory on the device within rounding, no state page on the device, pinned host copies."""
    from conftest import require_accelerator

    dev = require_accelerator()
    ref_m = model(dropout=0.0).to(dev)
    ref_opt = make_opt(ref_m, "adamw")
    ref = train(ref_m, ref_opt, 4, clip=0.5, device=dev)
    m = model(dropout=0.0).to(dev)
    opt = make_opt(m, "adamw")
    patches = PatchSet()
    session = PagingSession(2 * 2**20, SwapSpace(tmp_path), patches, device=dev, host_budget=64 * 2**20)
    try:
        session.page_model(m, page_params=False, page_grads=True)
        session.step_on_host(m, exact=False)
        got = train(m, opt, 4, clip=0.5, device=dev)
        rep = session.report()["host_step"]
        states_paged = _state_pages(session)
        pinned = all(t.is_pinned() for sh in session.host_step.shadows.values() for t in sh.masters.values())
    finally:
        patches.restore_all()
    assert got == pytest.approx(ref, rel=1e-4)
    for a, b in zip(m.parameters(), ref_m.parameters()):
        assert a.device.type == dev.type
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert not states_paged and pinned and rep["steps"] == 4


def test_loading_a_state_dict_replaces_the_host_states_as_plain_pytorch_does(tmp_path):
    """An optimizer reset mid-run (``load_state_dict`` of a fresh optimizer's empty state): plain
    PyTorch starts every parameter's state afresh; so does the host step (found by review: the old
    host states were kept)."""
    def run(m, opt):
        losses = train(m, opt, 2, clip=0.5)
        opt.load_state_dict(copy.deepcopy(make_opt(model(), "adamw").state_dict()))
        return losses + train(m, opt, 2, clip=0.5, seed=2)

    ref, ref_state, got, state, _ = _against_plain(tmp_path, run)
    assert got == ref
    assert_same(state, ref_state)


def test_a_chunk_raising_mid_step_names_the_parameters_already_updated(tmp_path, monkeypatch):
    """Chunks are stepped one after another: if the optimizer raises in the third (the host out of
    memory for the states a first step creates), the first two chunks are updated and the rest are
    not — plain PyTorch would have raised before any update — so the exception carries a note
    naming the parameters already updated. Nothing else of the step changed."""
    monkeypatch.setattr(host_step_mod, "CHUNK_BYTES", 4096)
    plain_step = torch.optim.Adam.step
    calls = []

    def failing_third_chunk(self, *args, **kwargs):
        if self is opt:  # the user's step: through torch's hook wrapper, into the host step
            return plain_step(self, *args, **kwargs)
        calls.append(len(self.param_groups[0]["params"]))
        if len(calls) == 3:
            raise RuntimeError("simulated: no host memory for the optimizer states")
        return plain_step.__wrapped__(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", failing_third_chunk)
    m = model()
    opt = make_opt(m, "adam")
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    session, patches = _session(tmp_path)
    try:
        session.page_model(m, page_params=False, page_grads=True)
        session.step_on_host(m, exact=True)
        with pytest.raises(RuntimeError, match="simulated") as info:
            train(m, opt, 1)
        changed = [n for n, p in m.named_parameters() if not torch.equal(p.detach(), before[n])]
    finally:
        patches.restore_all()
    notes = getattr(info.value, "__notes__", [])
    assert len(calls) == 3 and changed, (calls, changed)
    assert len(notes) == 1 and f"{len(changed)} of {len(before)} parameters" in notes[0], notes
    assert all(n in notes[0] for n in changed[:8]), (changed, notes)
    assert len(changed) < len(before)  # the third chunk and those after it were not updated



@pytest.mark.slow  # an accelerator path stood in by the CPU; the default suite is at its time budget
def test_a_dropped_model_and_optimizer_leave_the_host_step(tmp_path):
    """Models trained in turn in one session: the host side of a dropped optimizer (a copy of its
    model's parameters, gradient buffers and states in host memory) goes, and the next model
    still trains bitwise like plain training."""
    import gc

    ref_m = model(seed=1)
    ref = train(ref_m, make_opt(ref_m, "adamw"), 2)
    session, patches = _session(tmp_path)
    try:
        sizes = []
        for seed in (0, 1):
            m = model(seed=seed)
            opt = make_opt(m, "adamw")
            session.page_model(m, page_params=False, page_grads=True)
            session.step_on_host(m, exact=True)
            got = train(m, opt, 2)
            sizes.append(session.report()["host_step"]["host_bytes"])
            del m, opt
            gc.collect()
        assert got == ref
        assert sizes[1] == sizes[0] > 0, sizes  # the first model's host copies went with it
        assert session.report()["host_step"]["host_bytes"] == 0
        assert session.report()["models_released"] == 2
    finally:
        patches.restore_all()


def test_the_host_step_speed_probe_is_no_step_of_the_users(caplog, cpu_device):
    """The cost model probes the host's step speed with an optimizer of its own (on an accelerator,
    when it weighs the host step). Its steps went through torch's hook wrapper: on the H200 the
    switch warned "AdamW steps 1 parameter tensors of no adopted model" at the probe's second step,
    and the report's step recorder counted the probe's steps as the user's. Now no global optimizer
    hook sees them, and the rate is still a positive measurement."""
    from apt_model.memory.paging.step_placement import probe_host_step_rate

    seen = []
    handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: seen.append(type(opt).__name__))
    vb.enable("balanced", attention="off", mixed_precision="off", compile="off", banner=False)
    try:
        with caplog.at_level("WARNING"):
            rate = probe_host_step_rate(torch.optim.Adamax, nbytes=4096)  # a class no other test probes
        report = vb.get_report()
    finally:
        vb.disable()
        handle.remove()
    assert rate > 0 and seen == []
    assert not [r for r in caplog.records if "of no adopted model" in r.getMessage()]
    assert not [d for d in report["decisions"] if d["feature"] == "adoption"]
