"""The optimizer step inside backward (memory/paging/backward_step.py).

Every test compares with plain PyTorch running the same loop: the step taken inside backward
must give bitwise the same parameters and optimizer states, and so must a loop that changes after
the first step (the speculative step is rolled back and the usual step runs).
"""
import copy
import threading

import pytest
import torch
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from apt_model.errors import ConfigError
from apt_model.memory.pages import Category
from apt_model.memory.paging.backward_step import TRIAL, BackwardStep, trial_verdict
from apt_model.switch.controller import session as vb_session
from test_paging import FORCE, assert_same, make_opt, model, snapshot, train


def _enable(tmp_path, **kw):
    """Paging everything; the step inside backward armed after the first step (``on``: no timed
    trial, whose verdict depends on the machine; the trial has its own tests)."""
    vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, "paging_step_in_backward": "on", **kw})


def _report():
    return vb.get_report()["memory"]["paging"]["step_in_backward"]


def _loop(m, opt, steps, change_at=None, change=None, seed=1, threaded=False):
    """One backward per step, no clipping; at step ``change_at`` (and after) ``change`` runs
    between backward and step (``change(m, opt, x)``; it may run its own forward/backward)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout
    losses = []
    for s in range(steps):
        opt.zero_grad()
        x = torch.randint(0, 256, (4, 32), generator=gen)
        loss = F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1))
        if threaded:  # autograd on its own thread, as on an accelerator
            err = []
            t = threading.Thread(target=lambda: _run(loss.backward, err))
            t.start()
            t.join()
            if err:
                raise err[0]
        else:
            loss.backward()
        if change_at is not None and s >= change_at:
            change(m, opt, x)
        opt.step()
        losses.append(loss.item())
    return losses


def _run(fn, err):
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - handed to the main thread
        err.append(e)


def _both(tmp_path, loop, kind="adamw", **enable):
    """``loop(m, opt)`` in plain training and paged; returns (plain, paged) (losses, state) and
    the step-in-backward report."""
    ref_m = model()
    ref_opt = make_opt(ref_m, kind)
    ref = loop(ref_m, ref_opt)
    ref_state = snapshot(ref_m, ref_opt)
    m = model()
    opt = make_opt(m, kind)
    _enable(tmp_path, **enable)
    m.to("cpu")
    got = loop(m, opt)
    got_state = snapshot(m, opt)
    rep = _report()
    vb.disable()
    return (ref, ref_state), (got, got_state), rep


@pytest.mark.parametrize("kind,sched,threaded", [("adamw", False, False), ("sgd", False, True), ("adam", True, False)],
                         ids=["adamw", "sgd-backward-on-another-thread", "adam-amsgrad-scheduler"])
def test_the_step_inside_backward_is_bitwise_the_in_memory_step(tmp_path, kind, sched, threaded):
    def loop(m, opt):
        sch = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if sched else None
        if sch is None:
            return _loop(m, opt, 7, threaded=threaded)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(7):
            opt.zero_grad()
            x = torch.randint(0, 256, (4, 32), generator=gen)
            loss = F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1))
            loss.backward()
            opt.step()
            sch.step()  # the next step's learning rate is set before its backward
            losses.append(loss.item())
        return losses

    (ref, ref_state), (got, got_state), rep = _both(tmp_path, loop, kind)
    assert got == ref
    assert_same(got_state, ref_state)
    assert rep["state"] == "armed" and rep["steps_in_backward"] == 6 and rep["rolled_back"] == 0, rep


@pytest.mark.parametrize("mode", ["on", "off"])
def test_armed_no_gradient_is_read_back_for_the_step(tmp_path, mode, capsys):
    """In backward, each parameter is stepped while its gradient is still in memory; after
    backward the step reads every gradient back from the swap files."""
    m = model(dropout=0.0)
    opt = make_opt(m, "adamw")
    _enable(tmp_path, paging_step_in_backward=mode)
    m.to("cpu")
    pager = vb_session().paging.pager
    loads = []
    start = pager._start_load

    def spy(page, *a, **k):
        loads.append((page.category, pager.phase))
        return start(page, *a, **k)

    pager._start_load = spy
    _loop(m, opt, 1)  # the first step runs after backward (it learns the loop)
    loads.clear()
    _loop(m, opt, 3, seed=2)
    grad_loads = [ph for cat, ph in loads if cat is Category.GRAD]
    stall = vb.get_stats()["levels"][0]["stall_s_by_phase"]
    rep = _report()
    capsys.readouterr()
    vb.print_stats()
    printed = capsys.readouterr().out
    vb.disable()
    if mode == "on":
        assert rep["state"] == "armed" and rep["steps_in_backward"] == 3
        assert "paged optimizer step: inside backward (3 in backward, 0 rolled back)" in printed
        assert grad_loads == []
        assert any(cat is Category.STATE and ph == "backward" for cat, ph in loads)  # states come up in backward
    else:
        assert rep == {"state": "off", "reason": "paging_step_in_backward=off", "steps_in_backward": 0,
                       "rolled_back": 0, "relearned": 0, "trial": {"in": [], "after": []}}
        assert "paged optimizer step: after backward (0 in backward, 0 rolled back): paging_step_in_backward=off" \
            in printed
        assert grad_loads and set(grad_loads) == {"optimizer"}
        assert "optimizer" in stall


def _clip(m, opt, x):
    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)


def _accumulate(m, opt, x):
    F.cross_entropy(m(x).reshape(-1, 256), x.reshape(-1)).backward()


def _lr(m, opt, x):
    for g in opt.param_groups:
        g["lr"] = g["lr"] * 0.5


def _scale_one_grad(m, opt, x):
    next(m.parameters()).grad.mul_(0.5)


def _divide_grads_through_data(m, opt, x):
    for p in m.parameters():
        p.grad.data.div_(4)  # .data: an alias with its own version counter (an old all-reduce idiom)


def _edit_grads_through_an_alias(m, opt, x):
    for p in m.parameters():
        p.grad.detach().data.mul_(0.5)  # an alias of an alias: no page, no shared version counter


def _set_grad_data(m, opt, x):
    p = next(m.parameters())
    p.grad.data = p.grad.mul(0.5)  # new bytes under the same tensor, version unchanged


def _replace_one_grad(m, opt, x):
    p = next(m.parameters())
    p.grad = p.grad * 2


def _zero_grad(m, opt, x):
    opt.zero_grad()


def _evaluate(m, opt, x):
    m.eval()
    with torch.no_grad():
        m(x)
    m.train()


def _read_grads(m, opt, x):
    _read_grads.norms = [float(p.grad.norm()) for p in m.parameters()]  # logging only: stays armed


def _read_params(m, opt, x):
    _read_params.norms = [float(p.detach().norm()) for p in m.parameters()]  # must see the pre-step values


def _state_dicts(m, opt, x):
    _state_dicts.saved = copy.deepcopy((m.state_dict(), opt.state_dict()))  # the values now (plain ones alias)


def _add_group(m, opt, x):
    if len(opt.param_groups) == 1:  # once, as a script unfreezing a part mid-training does
        extra = torch.nn.Parameter(torch.zeros(3))
        extra.grad = torch.ones(3)
        opt.add_param_group({"params": [extra], "lr": 0.5})


def _take_one_out(m, opt, x):
    """Stop training one weight: out of its group (and its state dropped), as a script freezing it."""
    params = opt.param_groups[0]["params"]
    if len(params) == len(list(m.parameters())):  # once
        p = params.pop(1)
        opt.state.pop(p, None)


CHANGES = {  # what comes between backward and step from step 3 on -> words of the reason
    "clip": (_clip, "clips"),
    "accumulation": (_accumulate, "forward ran"),
    "lr-changed": (_lr, "hyperparameters"),
    "group-added": (_add_group, "parameter group was added"),
    "grad-scaled": (_scale_one_grad, "wrote a gradient"),
    "grad-data-edited": (_divide_grads_through_data, "wrote a gradient"),
    "grad-alias-edited": (_edit_grads_through_an_alias, "wrote a gradient"),
    "grad-data-set": (_set_grad_data, "wrote a gradient"),
    "grad-replaced": (_replace_one_grad, "modified or replaced"),
    "zero-grad": (_zero_grad, "modified or replaced"),
    "evaluation": (_evaluate, "forward ran"),
    "parameters-read": (_read_params, "was used between backward"),
    "state-dict": (_state_dicts, "state_dict() was taken"),
    "parameter-taken-out": (_take_one_out, "taken out of the optimizer"),
}


#: changes whose reason and path another change already covers in the default suite (slow: the
#: suite's 15 minutes on 2 cores): grad-data-set and grad-alias-edited as grad-data-edited, evaluation
#: as accumulation
SLOW_CHANGES = {"grad-data-set", "grad-alias-edited", "evaluation"}


@pytest.mark.parametrize("change", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CHANGES else c
                                    for c in sorted(CHANGES)])
def test_a_loop_that_changes_later_is_rolled_back_and_stays_bitwise(tmp_path, change):
    """From step 3 on, something comes between backward and step: whatever it reads is what plain
    PyTorch shows there (the values before the step), and the training stays bitwise."""
    fn, words = CHANGES[change]
    seen = []

    def loop(m, opt):
        fn.norms = fn.saved = None
        losses = _loop(m, opt, 4, 3, fn)  # learning, two steps inside backward, the change
        seen.append((getattr(fn, "norms", None), getattr(fn, "saved", None)))
        return losses

    (ref, ref_state), (got, got_state), rep = _both(tmp_path, loop)
    assert got == ref
    assert_same(got_state, ref_state)
    if change == "parameters-read":
        assert seen[0][0] == seen[1][0]
    if change == "state-dict":  # the last one saved (step 3's, before its step): plain's
        (m_ref, o_ref), (m_got, o_got) = seen[0][1], seen[1][1]
        assert_same((m_got, {i: st for i, st in o_got["state"].items()}),
                    (m_ref, {i: st for i, st in o_ref["state"].items()}))
    # steps 1 and 2 ran inside backward; step 3's was rolled back and ran after backward
    assert rep["state"] == "off" and rep["steps_in_backward"] == 2 and rep["rolled_back"] == 1, rep
    assert words in rep["reason"], rep


def test_reading_gradients_between_backward_and_step_keeps_the_step_inside_backward(tmp_path):
    (ref, ref_state), (got, got_state), rep = _both(tmp_path, lambda m, opt: _loop(m, opt, 5, 1, _read_grads))
    assert got == ref
    assert_same(got_state, ref_state)
    assert rep["state"] == "armed" and rep["steps_in_backward"] == 4, rep


@pytest.mark.parametrize("loop,words", [
    (lambda m, opt: train(m, opt, 4, clip=0.5), "clips gradients"),
    (lambda m, opt: train(m, opt, 4, accum=2), "gradient accumulation: 2 backward passes"),
    (lambda m, opt: _loop(m, opt, 4, 0, _scale_one_grad), "wrote a gradient"),
], ids=["clip", "accumulation", "grad-modified"])
def test_the_first_step_recognises_loops_that_need_every_gradient_first(tmp_path, loop, words):
    (ref, ref_state), (got, got_state), rep = _both(tmp_path, loop)
    assert got == ref
    assert_same(got_state, ref_state)
    assert rep["state"] == "off" and rep["steps_in_backward"] == 0 and rep["rolled_back"] == 0
    assert words in rep["reason"], rep


def test_a_failure_inside_backward_rolls_the_step_back(tmp_path, monkeypatch):
    """A step taken inside backward fails (a disk error on its third parameter): the parameters
    stepped before it are rolled back, backward completes, and the usual step after backward runs
    at ``optimizer.step()`` (where a persistent error would be raised, as in plain PyTorch): the
    result is bitwise plain PyTorch's."""
    ref_m = model(dropout=0.0)
    ref_opt = make_opt(ref_m, "adamw")
    _loop(ref_m, ref_opt, 2)
    ref_loss = _loop(ref_m, ref_opt, 1, seed=3)
    m = model(dropout=0.0)
    opt = make_opt(m, "adamw")
    _enable(tmp_path)
    m.to("cpu")
    _loop(m, opt, 2)
    assert _report()["state"] == "armed"
    paging = vb_session().paging.optimizers
    real, calls = paging.run_chunk, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk gone")
        return real(*a, **k)

    monkeypatch.setattr(paging, "run_chunk", failing)
    assert _loop(m, opt, 1, seed=3) == ref_loss
    monkeypatch.undo()
    rep = _report()
    assert rep["state"] == "off" and rep["rolled_back"] == 1 and "disk gone" in rep["reason"], rep
    assert len(calls) > 3  # the usual step ran after backward
    assert_same(snapshot(m, opt), snapshot(ref_m, ref_opt))
    vb.disable()


def test_the_setting_and_its_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="paging_step_in_backward='sometimes'.*auto, on, off"):
        BackwardStep(None, "sometimes")
    monkeypatch.setenv("VB_PAGING_STEP_IN_BACKWARD", "always")
    with pytest.raises(ConfigError, match="VB_PAGING_STEP_IN_BACKWARD"):
        vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    monkeypatch.setenv("VB_PAGING_STEP_IN_BACKWARD", "off")
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    m = model()
    m.to("cpu")
    assert _report()["state"] == "off"
    vb.disable()



def test_the_trial_verdict_keeps_only_a_faster_step():
    keep, why = trial_verdict([1.0, 0.9, 1.1], [1.2, 1.3, 1.25])
    assert keep and "1.000 s per iteration with the step inside backward against 1.250 s" in why and "kept" in why
    keep, why = trial_verdict([1.0, 1.0, 1.0], [1.01, 1.0, 1.02])  # 1% faster: within the noise
    assert not keep and "not 2% faster, the step stays after backward" in why


@pytest.mark.parametrize("inside,after,kept", [(1.0, 2.0, True), pytest.param(2.0, 1.0, False, marks=pytest.mark.slow)],
                         ids=["faster", "slower"])  # "slower" is slow: the default suite's 15 minutes on 2 cores
def test_auto_keeps_the_step_inside_backward_only_where_the_trial_measured_it_faster(tmp_path, inside, after, kept):
    """``auto``: after the first step, six iterations take turns (in, after, after, in, in, after),
    timed between the ends of two steps; the verdict follows the medians. The clock is made to
    charge each iteration by its mode; the training is bitwise plain's either way."""
    def loop(m, opt):
        if vb.is_enabled():
            bs = vb_session().paging.backward_step
            now = [0.0]

            def clock():  # called when a step ends; bs._current is the mode of the iteration that ended
                now[0] += inside if bs._current == "in" else after
                return now[0]

            bs.clock = clock
        return _loop(m, opt, 1 + len(TRIAL) + 2)

    (ref, ref_state), (got, got_state), rep = _both(tmp_path, loop, paging_step_in_backward="auto")
    assert got == ref
    assert_same(got_state, ref_state)
    assert rep["trial"] == {"in": [inside] * 3, "after": [after] * 3}
    assert rep["state"] == ("armed" if kept else "off") and rep["rolled_back"] == 0
    assert ("kept" in rep["reason"]) == kept and "measured" in rep["reason"]
    assert rep["steps_in_backward"] == 3 + (2 if kept else 0)  # the trial's three, then every step if kept


# ------------------------------------------------------------------ loops found by the second review
class _Tied(torch.nn.Module):
    """``a.weight`` used by ``a`` and again outside it (``F.linear`` in the parent's forward)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.c(F.linear(h, self.a.weight))


def _review_case(name):
    """(build() -> (model, optimizers), loop(model, optimizers) -> losses) of a loop the second
    review broke the first version with."""
    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def batches(n):
        g = torch.Generator().manual_seed(1)
        return [torch.randn(8, 16, generator=g) for _ in range(n)]

    if name == "two-optimizers":  # each half stepped after a backward through the whole model
        def build():
            m = mlp()
            return m, [torch.optim.Adam(m[0].parameters(), lr=1e-2), torch.optim.Adam(m[2].parameters(), lr=1e-2)]

        def loop(m, opts):
            out = []
            for x in batches(6):
                for i, opt in enumerate(opts):
                    opt.zero_grad()
                    loss = (m(x) ** 2).mean() * (i + 1)
                    loss.backward()
                    opt.step()
                    out.append(loss.item())
            return out
        return build, loop
    if name == "tied":
        return (lambda: (lambda m: (m, [torch.optim.Adam(m.parameters(), lr=1e-2)]))(_Tied()),
                lambda m, opts: _plain_loop(m, opts[0], batches(6)))
    if name == "tensor-lr-scheduler-before-step":  # LRScheduler.step() fill_s a tensor lr in place
        def build():
            m = mlp()
            opt = torch.optim.Adam(m.parameters(), lr=torch.tensor(1e-2))
            return m, [opt, torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)]

        def loop(m, opts):
            opt, sched = opts
            return _plain_loop(m, opt, batches(6), between=lambda s: s >= 3 and sched.step())
        return build, loop
    if name in ("retain-graph", "two-forwards-two-backwards", "autograd-backward-retain", "submodules-twice"):
        def build():
            m = mlp()
            return m, [torch.optim.Adam(m.parameters(), lr=1e-2)]

        def loop(m, opts):
            opt, out = opts[0], []
            for s, x in enumerate(batches(6)):
                opt.zero_grad()
                if s < 3:
                    loss = (m(x) ** 2).mean()
                    loss.backward()
                elif name == "retain-graph":
                    loss = (m(x) ** 2).mean()
                    loss.backward(retain_graph=True)
                    (loss * 0.5).backward()
                elif name == "autograd-backward-retain":  # not through Tensor.backward
                    loss = (m(x) ** 2).mean()
                    torch.autograd.backward(loss, retain_graph=True)
                    torch.autograd.backward(loss * 0.5)
                elif name == "submodules-twice":  # the adopted model's children called, not the model
                    l1 = (m[2](torch.relu(m[0](x))) ** 2).mean()
                    l2 = (m[2](torch.relu(m[0](x + 1))) ** 2).mean()
                    l1.backward()
                    l2.backward()
                    loss = l1 + l2
                else:
                    l1, l2 = (m(x) ** 2).mean(), (m(x + 1) ** 2).mean()
                    l1.backward()
                    l2.backward()
                    loss = l1 + l2
                opt.step()
                out.append(loss.item())
            return out
        return build, loop
    if name == "grad-scaler":
        def build():
            m = mlp()
            return m, [torch.optim.Adam(m.parameters(), lr=1e-2), torch.amp.GradScaler("cpu", init_scale=1024.0)]

        def loop(m, opts):
            opt, scaler = opts
            out = []
            for x in batches(5):
                opt.zero_grad()
                loss = (m(x) ** 2).mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                out.append(loss.item())
            return out
        return build, loop
    raise KeyError(name)


def _plain_loop(m, opt, xs, between=None):
    out = []
    for s, x in enumerate(xs):
        opt.zero_grad()
        loss = (m(x) ** 2).mean()
        loss.backward()
        if between is not None:
            between(s)
        opt.step()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("name,words", [
    ("two-optimizers", "another optimizer"),
    ("tied", None),
    ("tensor-lr-scheduler-before-step", "hyperparameters changed"),
    ("retain-graph", "keeps its graph"),
    ("autograd-backward-retain", "keeps its graph"),
    ("submodules-twice", "built a graph twice"),
    ("two-forwards-two-backwards", "built a graph twice"),
    ("grad-scaler", "GradScaler.unscale_"),
])
def test_loops_the_review_found_stay_bitwise(tmp_path, name, words):
    """Each broke the first version: a second optimizer's step committed the pending transaction;
    a tied weight was evicted under autograd; a tensor learning rate edited in place looked the
    same; a second backward over a graph saved before the step failed autograd's version check;
    GradScaler.unscale_ rescales gradients without bumping their version."""
    build, loop = _review_case(name)

    def state(m, opts):
        return snapshot(m, next(o for o in opts if isinstance(o, torch.optim.Optimizer)))

    ref_m, ref_opts = build()
    ref = loop(ref_m, ref_opts)
    m, opts = build()
    _enable(tmp_path)
    m.to("cpu")
    got = loop(m, opts)
    rep = _report()
    assert got == ref
    assert_same(state(m, opts), state(ref_m, ref_opts))
    if len(opts) > 1 and all(isinstance(o, torch.optim.Optimizer) for o in opts):
        assert_same(snapshot(m, opts[1]), snapshot(ref_m, ref_opts[1]))
    vb.disable()
    if words is None:
        assert rep["state"] == "armed" and rep["steps_in_backward"] == 5, rep
    else:
        assert rep["state"] == "off" and words in rep["reason"], rep


def test_parameters_kept_resident_are_watched_between_backward_and_step(tmp_path):
    """A plan that keeps the parameters resident (gradients and states paged): the step changes
    them in place inside backward, no page protects them, so the fault handler watches them — a
    weight norm logged between backward and step reads plain's value and rolls the step back."""
    from apt_model.memory.placement import model_state_sizes

    norms = {}

    def loop(m, opt):
        key = "paged" if vb.is_enabled() else "plain"
        norms[key] = []
        return _loop(m, opt, 5, 3, lambda m, opt, x: norms[key].append([float(p.detach().norm())
                                                                            for p in m.parameters()]))

    p_bytes, t_bytes = model_state_sizes(model())
    (ref, ref_state), (got, got_state), rep = _both(tmp_path, loop, paging="over_budget",
                                                    device_budget=str(int(p_bytes + t_bytes)))
    assert got == ref
    assert_same(got_state, ref_state)
    assert norms["paged"] == norms["plain"]
    assert rep["state"] == "off" and rep["rolled_back"] == 1 and "was used between backward" in rep["reason"], rep


@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_no_grad_forward_before_backward_keeps_a_tied_weight_autograd_saved(tmp_path, mode):
    """An evaluation (or teacher) forward under no_grad between the training forward and its
    backward: the tied weight the training forward used outside its module stays resident for
    that backward (its pin used to be dropped by the next forward, which crashed the backward)."""
    def loop(m, opts):
        opt, out = opts[0], []
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            x, xv = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
            opt.zero_grad()
            loss = (m(x) ** 2).mean()
            with torch.no_grad():
                m(xv)
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    build = lambda: (lambda m: (m, [torch.optim.Adam(m.parameters(), lr=1e-2)]))(_Tied())  # noqa: E731
    ref_m, ref_opts = build()
    ref = loop(ref_m, ref_opts)
    m, opts = build()
    _enable(tmp_path, paging_step_in_backward=mode, device_budget="2KB")  # a.weight alone is 1 KiB
    m.to("cpu")
    got = loop(m, opts)
    rep = _report()
    state = snapshot(m, opts[0])
    vb.disable()
    assert got == ref
    assert_same(state, snapshot(ref_m, ref_opts[0]))
    assert rep["state"] == ("armed" if mode == "on" else "off"), rep


# ------------------------------------------------------------------ the third review's loops
def test_writes_through_untracked_gradient_aliases_are_caught(tmp_path):
    """A second view made while an earlier one keeps the gradient page pinned, written through
    ``.data`` (no version counter follows it): the alias is watched all the same, the step taken
    inside backward is rolled back, and training stays bitwise plain's."""
    def edit(m, opt, x):
        edit.keep = [p.grad.view(-1) for p in m.parameters()]  # pins every gradient page
        for v in [p.grad.view(-1) for p in m.parameters()]:
            v.data.mul_(0.5)

    (ref, ref_state), (got, got_state), rep = _both(tmp_path, lambda m, opt: _loop(m, opt, 5, 2, edit))
    assert got == ref
    assert_same(got_state, ref_state)
    assert rep["state"] == "off" and rep["rolled_back"] == 1 and "wrote a gradient" in rep["reason"], rep


def test_a_data_handle_to_gradients_kept_across_steps_turns_the_step_off_and_stays_bitwise(tmp_path):
    """``.data`` handles taken once and written every iteration (no version counter, made before
    the gradients land): taking them turns the step inside backward off for good; also no crash
    when an earlier handle that pinned the page dies (the later alias has its own pin)."""
    def loop(m, opt):
        gen = torch.Generator().manual_seed(1)
        torch.manual_seed(1)  # dropout
        handles, out = None, []
        for s in range(5):
            opt.zero_grad(set_to_none=False)
            if s >= 1:
                handles = [p.grad.data for p in m.parameters()]  # the previous ones die here
            x = torch.randint(0, 256, (4, 32), generator=gen)
            loss = F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1))
            loss.backward()
            for h in handles or ():
                h.mul_(0.5)
            opt.step()
            out.append(loss.item())
        return out

    (ref, ref_state), (got, got_state), rep = _both(tmp_path, loop)
    assert got == ref
    assert_same(got_state, ref_state)
    assert rep["state"] == "off" and ".data alias of a gradient" in rep["reason"], rep


class _Checkpointed(torch.nn.Module):
    """A block run under ``torch.utils.checkpoint`` (its activations recomputed in backward)."""

    def __init__(self, block, reentrant):
        super().__init__()
        self.block, self.reentrant = block, reentrant

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_stays_bitwise(tmp_path, reentrant):
    """Reentrant checkpointing runs one backward per block inside the backward, each accumulating
    into the gradients: the step stays after backward, and the reason says why (it used to say
    "gradient accumulation"). Non-reentrant checkpointing recomputes each block inside the one
    backward: the step inside backward stays armed."""
    def build():
        m = model(dropout=0.0)
        for i, block in enumerate(m.blocks):
            m.blocks[i] = _Checkpointed(block, reentrant)
        return m

    ref_m, m = build(), build()
    ref_opt, opt = make_opt(ref_m, "adamw"), make_opt(m, "adamw")
    ref = _loop(ref_m, ref_opt, 5)
    _enable(tmp_path)
    m.to("cpu")
    got = _loop(m, opt, 5)
    rep = _report()
    vb.disable()
    assert got == ref
    assert_same(snapshot(m, opt), snapshot(ref_m, ref_opt))
    if reentrant:
        assert rep["state"] == "off" and "reentrant activation checkpointing" in rep["reason"], rep
    else:
        assert rep["state"] == "armed" and rep["steps_in_backward"] == 4, rep


def test_the_step_stays_after_backward_where_it_would_break_the_level_0_bound(tmp_path, cpu_device):
    """The backward under way still pins the pages of the module it is in (and the tied
    embedding, faulted in by the root): with a budget the plan holds, stepping the last MLP weight
    inside backward would not fit beside them. The step stays after backward, says why, and the
    measured peak keeps the bound the plan promises (budget plus the largest page); training stays
    bitwise that of plain PyTorch."""
    def build():
        torch.manual_seed(0)
        from apt_model.models.gpt import GPT, GPTConfig
        return GPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=4, dropout=0.0))

    ref_m = build()
    ref_opt = make_opt(ref_m, "adamw")
    ref = _loop(ref_m, ref_opt, 3)
    m = build()
    opt = make_opt(m, "adamw")
    vb.enable("balanced", swap_dir=str(tmp_path), device_budget="256KB", attention="off", mixed_precision="off",
              banner=False, paging_step_in_backward="on")
    try:
        m.to("cpu")
        got = _loop(m, opt, 3)
        paging = vb.get_report()["memory"]["paging"]
        state = snapshot(m, opt)
    finally:
        vb.disable()
    rep, pager = paging["step_in_backward"], paging["pager"]
    assert rep["state"] == "off" and "inside backward would take level 0" in rep["reason"], rep
    assert pager["peak_resident"] <= pager["budget"] + pager["largest_page"], pager
    assert got == ref
    assert_same(state, snapshot(ref_m, ref_opt))


@pytest.mark.parametrize("when", ["before-backward", "between-backward-and-step"])
def test_a_parameter_moved_to_another_group_is_stepped_with_that_groups_settings(tmp_path, when):
    """The step inside backward took each parameter's group from the first step: a weight moved to
    a group with a 10x smaller learning rate later was still stepped with the old one, silently.
    Moved before a backward, it is stepped with its new group inside that backward; moved between
    backward and step, the step is rolled back and runs after backward. Bitwise either way."""
    def loop(m, opt):
        gen = torch.Generator().manual_seed(1)
        losses = []
        for s in range(6):
            opt.zero_grad()
            x = torch.randint(0, 256, (4, 32), generator=gen)
            if s == 3 and when == "before-backward":
                _move_head(opt)
            loss = F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1))
            loss.backward()
            if s == 3 and when != "before-backward":
                _move_head(opt)
            opt.step()
            losses.append(loss.item())
        return losses

    def two_groups(m, kind):
        params = list(m.parameters())
        return torch.optim.AdamW([{"params": params[:-1]}, {"params": params[-1:], "lr": 1e-4}], lr=1e-3)

    def _move_head(opt):
        p = opt.param_groups[0]["params"].pop(0)
        opt.param_groups[1]["params"].append(p)

    ref_m = model(dropout=0.0)
    ref_opt = two_groups(ref_m, None)
    ref = loop(ref_m, ref_opt)
    m = model(dropout=0.0)
    opt = two_groups(m, None)
    _enable(tmp_path)
    try:
        m.to("cpu")
        got = loop(m, opt)
        rep = _report()
        got_state = snapshot(m, opt)
    finally:
        vb.disable()
    assert got == ref
    assert_same(got_state, snapshot(ref_m, ref_opt))
    if when == "before-backward":
        assert rep["state"] == "armed" and rep["steps_in_backward"] == 5, rep
    else:
        assert rep["state"] == "off" and "moved to another parameter group" in rep["reason"], rep


def test_an_error_of_the_optimizers_own_step_is_raised_by_optimizer_step_not_by_backward(tmp_path):
    """After ``model.to(torch.bfloat16)`` the AdamW states (fp32) no longer match: plain PyTorch's
    ``optimizer.step()`` raises, and a script catches it there and builds a new optimizer. The step
    inside backward raised it from ``loss.backward()`` instead, with backward cut short. Now
    backward completes, ``optimizer.step()`` raises the same error, and the run goes on bitwise."""
    def loop(m, opt):
        gen = torch.Generator().manual_seed(1)
        losses, raised = [], []
        for s in range(5):
            if s == 2:
                m.to(torch.bfloat16)
            opt.zero_grad()
            x = torch.randint(0, 256, (4, 32), generator=gen)
            loss = F.cross_entropy(m(x).float().reshape(-1, 256), x.roll(-1, 1).reshape(-1))
            loss.backward()
            try:
                opt.step()
            except RuntimeError as err:
                raised.append((s, "dtype" in str(err)))
                opt = make_opt(m, "adamw")
            losses.append(loss.item())
        return losses + raised

    ref_m = model(dropout=0.0)
    ref = loop(ref_m, make_opt(ref_m, "adamw"))
    m = model(dropout=0.0)
    opt = make_opt(m, "adamw")
    _enable(tmp_path)
    try:
        m.to("cpu")
        got = loop(m, opt)
        rep = _report()
        params = {k: v.detach().clone() for k, v in m.state_dict().items()}
    finally:
        vb.disable()
    assert ref[-1] == (2, True)
    assert got == ref
    for k, v in ref_m.state_dict().items():
        assert torch.equal(params[k], v), k
    assert rep["rolled_back"] >= 1 and "in backward failed" in rep["reason"], rep


def test_a_parameter_outside_the_paged_models_is_named_by_its_shape_in_the_reason(tmp_path):
    """The optimizer holds a parameter that is no paged model's (a bare ``nn.Parameter`` scale):
    the step stays after backward. The reason said "param@7f...'s gradient did not come from
    backward", a raw address and an untrue cause (the gradient did come from backward; a probe's
    finding); it names the parameter's shape and the possible causes now."""
    scale = torch.nn.Parameter(torch.ones(3))

    def loop(m, opt):
        with torch.no_grad():
            scale.fill_(1.0)  # each run starts from the same scale
        opt.add_param_group({"params": [scale]})
        gen = torch.Generator().manual_seed(1)
        out = []
        for _ in range(3):
            opt.zero_grad()
            x = torch.randint(0, 256, (4, 32), generator=gen)
            loss = F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1)) * scale.sum() / 3
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    (ref, ref_state), (got, got_state), rep = _both(tmp_path, loop)
    assert got == ref
    assert rep["state"] == "off", rep
    assert "a parameter of shape (3,)" in rep["reason"] and "did not see arrive in backward" in rep["reason"], rep


def test_a_new_optimizer_made_mid_run_is_learned_again(tmp_path):
    """A script that makes a new optimizer mid-run (after unfreezing, after an LR finder) dropped
    the one the step inside backward was armed for: it turned off for good ("the optimizer it was
    armed for is gone"), a gap named in the 2026-11-29 note. It learns the new one's loop at the
    next iteration and is armed for it; training stays bitwise."""
    import gc

    def loop(m, opt):
        losses = _loop(m, opt, 3)
        del opt
        gc.collect()  # the old optimizer is gone
        new = make_opt(m, "adamw")
        return losses + _loop(m, new, 4, seed=2), new

    ref_m = model()
    ref, ref_opt = loop(ref_m, make_opt(ref_m, "adamw"))
    m = model()
    _enable(tmp_path)
    try:
        m.to("cpu")
        got, opt = loop(m, make_opt(m, "adamw"))
        rep = _report()
        got_state = snapshot(m, opt)
    finally:
        vb.disable()
    assert got == ref
    assert_same(got_state, snapshot(ref_m, ref_opt))
    # armed for the first (2 steps in backward), learned again at the new one's first step,
    # then armed for it: its last 3 steps ran in backward
    assert rep["state"] == "armed" and rep["relearned"] == 1, rep
    assert rep["steps_in_backward"] == 5 and rep["rolled_back"] == 0, rep


def test_a_new_optimizer_learned_again_is_checked_against_the_level0_bound(tmp_path):
    """Learning again kept the parameters already checked against the level-0 bound for the old
    optimizer: SGD (no states) then AdamW stepped inside backward past the bound (327,680 bytes
    resident against 321,536; the review of 2026-11-29). The new optimizer's states are checked:
    its step stays after backward, with the reason, and the peak stays within the bound."""
    import gc

    from apt_model.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    m = GPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=4, dropout=0.0))
    vb.enable("balanced", swap_dir=str(tmp_path), device_budget="256KB", attention="off", mixed_precision="off",
              compile="off", banner=False, paging_step_in_backward="on")
    try:
        m.to("cpu")
        gen = torch.Generator().manual_seed(1)

        def loop(opt, steps):
            for _ in range(steps):
                opt.zero_grad()
                x = torch.randint(0, 256, (4, 32), generator=gen)
                F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1)).backward()
                opt.step()

        loop(torch.optim.SGD(m.parameters(), lr=1e-2), 3)
        gc.collect()
        loop(torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1), 4)
        paging = vb.get_report()["memory"]["paging"]
    finally:
        vb.disable()
    rep, pager = paging["step_in_backward"], paging["pager"]
    assert rep["relearned"] == 1 and rep["state"] == "off" and "past its page budget" in rep["reason"], rep
    assert pager["peak_resident"] <= pager["budget"] + pager["largest_page"], pager
