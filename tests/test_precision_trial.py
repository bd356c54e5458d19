"""The on-line autocast trial: schedule, verdict, and its effect on a real training loop."""
import pytest
import torch
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from apt_model.models.gpt import GPT, GPTConfig
from apt_model.devices.trial import SpeedTrial


def _drive(t, on, off):
    """Run a trial to its verdict; ``on(k)`` / ``off(k)`` give the k-th duration of each setting."""
    k = {True: 0, False: 0}
    for _ in range(500):
        setting = t.next_setting()
        seconds = (on if setting else off)(k[setting])
        k[setting] += 1
        if t.record(seconds) is not None:
            return t.verdict
    raise AssertionError("trial never ended")


def test_settles_before_timing_then_abba():
    t = SpeedTrial(calls=8, settle_window=2, settle_tolerance=1.2, settle_max=40)
    assert t.phase == "settle" and [t.next_setting()] == [True]
    seen = []
    k = {True: 0, False: 0}
    while t.phase == "settle":
        s = t.next_setting()
        seen.append(s)
        # "off" alternates 1.0 / 2.0 for its first 8 calls (unsteady), then stays at 2.0
        t.record(1.0 if s else (2.0 if k[False] >= 8 or k[False] % 2 else 1.0))
        k[s] += 1
    assert seen[:4] == [True, False, False, True]  # ABBA from the first call
    assert t.settle_calls % 4 == 0 and k[False] >= 9  # timing waited for "off" to settle
    assert SpeedTrial(calls=0).verdict is True and not SpeedTrial(calls=0).running
    for bad in (dict(calls=6), dict(calls=-4), dict(min_speedup=0), dict(settle_window=1), dict(settle_tolerance=1.0)):
        with pytest.raises(ValueError):
            SpeedTrial(**bad)


def test_settle_max_bounds_the_wait():
    t = SpeedTrial(calls=4, settle_window=2, settle_max=12)
    _drive(t, lambda k: 1.0 + (k % 2), lambda k: 2.0 + (k % 2))  # never steady
    assert t.settle_calls == 12


@pytest.mark.parametrize("on_s,off_s,keep", [(1.0, 2.0, True), (1.0, 1.02, False), (1.4, 1.0, False)])
def test_verdict_from_medians(on_s, off_s, keep):
    t = SpeedTrial(calls=8, min_speedup=1.05, settle_window=2)
    assert _drive(t, lambda k: on_s, lambda k: off_s) is keep
    s = t.summary()
    assert s["calls"] == 8 and s["on_ms"] == 1e3 * on_s and s["off_ms"] == 1e3 * off_s
    assert s["extended"] is False and s["settle_calls"] == 4 and s["stopped_early"] is False


def test_a_clearly_slower_setting_ends_the_trial_while_settling():
    """A setting whose fastest settling calls are still 1.5x the other's slowest is off at the end
    of that ABBA cycle: a 10-step script paid the whole settling phase (48 calls) for bf16 twice as
    slow as fp32, and ran 2-2.5x its plain time (a probe's finding). A slow first call (a kernel
    built on first use) does not end it, nor does a setting allowed to be that much slower."""
    t = SpeedTrial(calls=16)
    assert _drive(t, lambda k: 2.0, lambda k: 1.0) is False
    s = t.summary()
    assert s["stopped_early"] and s["settle_calls"] == 8 and s["calls"] == 8, s  # two ABBA cycles
    assert s["on_ms"] == 2000.0 and s["off_ms"] == 1000.0
    t = SpeedTrial(calls=16)
    assert _drive(t, lambda k: 10.0 if k == 0 else 0.5, lambda k: 1.0) is True and not t.stopped_early
    t = SpeedTrial(calls=16, min_speedup=0.4)  # up to 2.5x slower allowed
    assert _drive(t, lambda k: 2.0, lambda k: 1.0) is True and not t.stopped_early


def test_an_unclear_win_is_extended_once_then_refused():
    t = SpeedTrial(calls=8, min_speedup=1.05, settle_window=2, settle_max=8)
    # medians say 1.1x, but each setting swings wider than the gap: not a clear win
    verdict = _drive(t, lambda k: (1.0, 1.6)[k % 2], lambda k: (1.2, 1.7)[k % 2])
    assert verdict is False and t.extended and t.summary()["calls"] == 16
    assert t.summary()["speedup"] >= 1.05 and t.summary()["clear"] is False


def _train(model, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 16), generator=gen)
        loss = F.cross_entropy(model(x).reshape(-1, 256), x.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return opt


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=16, d_model=64, n_layers=1, n_heads=2, attn_implementation="sdpa"))


def test_trial_turns_autocast_off_on_a_real_loop_and_the_model_is_fp32_again():
    model = _gpt()
    vb.enable("balanced", autocast_min_speedup=0.01, autocast_trial_calls=4, autocast_trial_min_speedup=99.0,
              banner=False)
    model.to("cpu")
    hooks = model._vb_autocast
    assert hooks.trial.running
    steps = 0
    while hooks.trial.running:
        assert hooks.active  # on (tentatively) until the verdict
        _train(model, 1)
        steps += 1
        assert steps <= 60
    # every step but the first (run as written, its graph looked at for custom autograd Functions) timed
    assert hooks.active is False and hooks.trial.index == steps - 1
    feat = vb.get_report()["models"][0]["features"]["mixed_precision"]
    assert feat["chosen"] == "fp32" and feat["reason"].startswith("turned off after the trial")
    assert feat["trial"]["calls"] == (8 if feat["trial"]["stopped_early"] else 4)  # settling's last 4 each
    model.eval()
    x = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        out = model(x)
    vb.disable()
    with torch.no_grad():
        assert torch.equal(model(x), out)  # no autocast any more: plain fp32 results
    assert vb.get_stats()["autocast_models"] == 0


def test_trial_keeps_autocast_when_it_wins():
    model = _gpt()
    vb.enable("balanced", autocast_min_speedup=0.01, autocast_trial_calls=4, autocast_trial_min_speedup=0.01,
              banner=False)
    model.to("cpu")
    trial = model._vb_autocast.trial
    trial.clear = lambda: True  # a tie on this tiny model must count as a win for this check
    _train(model, 120)  # room beyond the at most 48 settling + 4 timed calls: once failed at 60 on a loaded machine
    assert not trial.running
    feat = vb.get_report()["models"][0]["features"]["mixed_precision"]
    assert feat["chosen"] == "bf16" and feat["reason"].startswith("kept after the trial")
    assert model._vb_autocast.active


def test_eval_calls_do_not_count_and_do_not_block_the_trial():
    model = _gpt()
    vb.enable("balanced", autocast_min_speedup=0.01, autocast_trial_calls=4, banner=False)
    model.to("cpu")
    trial = model._vb_autocast.trial
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 16)))
    assert trial.index == 0
    model(torch.randint(0, 256, (1, 16)))  # a training-mode forward never followed by backward
    assert trial.index == 0
    _train(model, 1)
    assert trial.index == 1
    _train(model, 80)
    assert not trial.running


def test_invalid_trial_settings():
    from apt_model.errors import ConfigError

    with pytest.raises(ConfigError, match="autocast_trial_calls=6 must be a multiple of 4"):
        vb.enable(autocast_trial_calls=6)


# --- the mechanism: backward on another thread, device events, nothing after the verdict ------

import threading  # noqa: E402

import torch.nn as nn  # noqa: E402

from apt_model.devices.timing import EventClock, HostClock, SyncClock, clock_for  # noqa: E402
from apt_model.precision.autocast import attach_autocast  # noqa: E402
from apt_model.base.patches import PatchSet  # noqa: E402


class CountingClock(HostClock):
    """Host clock that counts every use; ``lag`` makes a mark 'complete' only after ``lag`` later
    marks, as device events complete some time after they are recorded."""

    def __init__(self, lag: int = 0):
        self.lag, self.marks, self.readies, self.waits, self.elapsed_calls = lag, 0, 0, 0, 0
        self.waited: list[int] = []

    def uses(self) -> int:
        return self.marks + self.readies + self.waits + self.elapsed_calls

    def mark(self):
        self.marks += 1
        return (self.marks, super().mark())

    def ready(self, mark):
        self.readies += 1
        return self.marks - mark[0] >= self.lag

    def wait(self, mark):
        self.waits += 1
        self.waited.append(mark[0])

    def elapsed(self, start, end):
        self.elapsed_calls += 1
        return end[1] - start[1]


def _mlp_hooks(clock=None, settle_max=8, calls=4):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    verdicts = []
    hooks = attach_autocast(m, "cpu", torch.bfloat16, PatchSet(),
                            trial=SpeedTrial(calls=calls, settle_max=settle_max),
                            on_verdict=lambda keep, summary: verdicts.append((keep, summary)), clock=clock)
    return m, hooks, verdicts


def _step(m, opt, x, backward_thread: bool):
    loss = F.mse_loss(m(x).float(), x)
    if backward_thread:  # what autograd does for accelerator tensors: backward on its device thread
        t = threading.Thread(target=loss.backward)
        t.start()
        t.join()
    else:
        loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("backward_thread", [False, True])
def test_trial_decides_when_backward_runs_on_another_thread(backward_thread):
    m, hooks, verdicts = _mlp_hooks()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(8, 32)
    budget = hooks.trial.settle_max + 2 * hooks.trial.calls + hooks.max_lag
    steps = 0
    while hooks.trial.running:
        _step(m, opt, x, backward_thread)
        steps += 1
        assert steps <= budget, f"no verdict within the trial's call budget ({budget} calls)"
        assert _gradient_hooks(m) == 0  # a timed call's hooks go once its backward has been through
    assert len(verdicts) == 1 and verdicts[0][0] is hooks.active
    assert hooks.trial.index == steps  # every call was timed: none lost between threads


def _gradient_hooks(m):
    return sum(len(p._backward_hooks or {}) for p in m.parameters())


def test_no_timing_hook_is_left_on_the_parameters_after_the_verdict_or_the_undo():
    """A timed call whose backward never came (withdrawn at the next call), and one still pending
    when the patches are undone: their hooks on the parameters are removed (they piled up, one set
    per call, and kept the timer and the model alive)."""
    x = torch.randn(8, 32)
    for undo in (False, True):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        patches = PatchSet()
        hooks = attach_autocast(m, "cpu", torch.bfloat16, patches, trial=SpeedTrial(calls=4, settle_max=8))
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        out = m(x)  # a timed training call awaiting its backward
        pending = hooks.timer._pending
        assert pending is not None and pending.handles
        assert _gradient_hooks(m) == 0  # since 2026-11-27 the timer hooks the output's graph only
        if undo:
            patches.restore_all()
        else:
            _step(m, opt, x, backward_thread=False)  # withdraws the first, times and finishes its own
        assert _gradient_hooks(m) == 0 and pending.handles == [] and hooks.timer._pending is None
        assert hooks.trial.running
        del out


def test_a_backward_finishing_after_the_undo_records_nothing():
    """On an accelerator backward runs on autograd's device thread: a timed call's backward that
    has taken its last mark when ``disable()`` closes the timer must not be recorded afterwards
    (the trial went on after the undo, and a verdict fired then; the compile ladder put its rung
    back on the model's forward for good). The backward thread is held just before it queues the
    sample, while the patches are undone."""
    import sys

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
    patches = PatchSet()
    verdicts = []
    hooks = attach_autocast(m, "cpu", torch.bfloat16, patches, trial=SpeedTrial(calls=4, settle_max=0),
                            on_verdict=lambda keep, summary: verdicts.append(keep))
    reached, go = threading.Event(), threading.Event()

    def tracer(frame, event, arg):  # hold the thread where the finished sample would be queued
        if (event == "call" and frame.f_code.co_name == "_finish"
                and frame.f_globals.get("__name__") == "apt_model.devices.call_timer"):
            reached.set()
            go.wait(10)
        return None

    def backward(loss):
        sys.settrace(tracer)
        try:
            loss.backward()
        finally:
            sys.settrace(None)

    loss = m(torch.randn(4, 16)).float().sum()
    index = hooks.trial.index
    t = threading.Thread(target=backward, args=(loss,))
    t.start()
    assert reached.wait(10)
    patches.restore_all()  # disable()
    go.set()
    t.join()
    assert hooks.trial.index == index and verdicts == []
    assert _gradient_hooks(m) == 0


def test_lagging_events_are_read_in_order_and_the_wait_is_bounded():
    clock = CountingClock(lag=40)  # events far behind: the hooks must block on the oldest, in order
    m, hooks, verdicts = _mlp_hooks(clock=clock, settle_max=8, calls=4)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(8, 32)
    steps = 0
    while hooks.trial.running:
        _step(m, opt, x, backward_thread=True)
        steps += 1
        assert hooks.trial.in_flight <= hooks.max_lag + 1
        assert steps <= hooks.trial.settle_max + 2 * hooks.trial.calls + hooks.max_lag + 1
    assert verdicts and clock.waits > 0
    assert clock.waited == sorted(clock.waited)  # oldest first, one event at a time
    assert hooks.trial.index + hooks.max_lag >= steps - 1


def test_no_clock_use_and_no_synchronize_after_the_verdict(monkeypatch):
    clock = CountingClock()
    m, hooks, verdicts = _mlp_hooks(clock=clock)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(8, 32)
    while hooks.trial.running:
        _step(m, opt, x, backward_thread=True)
    used = clock.uses()
    assert used > 0
    syncs = []
    import apt_model.devices.timing as timing

    monkeypatch.setattr(timing, "synchronize", lambda device: syncs.append(device))
    for _ in range(10):
        _step(m, opt, x, backward_thread=True)
    assert clock.uses() == used, "a hook took a mark, read or waited on an event after the verdict"
    assert syncs == []


def test_a_forward_without_backward_gives_its_abba_slot_to_the_next_call():
    clock = CountingClock()
    m, hooks, _ = _mlp_hooks(clock=clock)
    x = torch.randn(8, 32)
    m(x)  # training-mode forward, never followed by backward
    assert hooks.trial.issued == 1 and hooks.trial.index == 0
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    _step(m, opt, x, backward_thread=False)  # takes the withdrawn slot: still ABBA position 0
    assert hooks.trial.issued == 1 and hooks.trial.index == 1


def test_clock_for_each_kind_of_device():
    clock, why = clock_for("cpu")
    assert type(clock) is HostClock and "host clock" in why
    clock, why = clock_for("meta")  # a device kind without timing events
    assert isinstance(clock, SyncClock) and "no timing events" in why
    a, b = clock.mark(), clock.mark()
    assert clock.ready(b) and clock.elapsed(a, b) >= 0
    from apt_model.precision.autocast import AutocastHooks

    with pytest.raises(ValueError, match="max_lag=-1"):
        AutocastHooks("cpu", torch.bfloat16, max_lag=-1)


from conftest import accelerator as _accelerator, needs_accelerator  # noqa: E402


@pytest.mark.gpu
@needs_accelerator
def test_on_the_accelerator_the_trial_decides_with_events_and_never_synchronizes_after(monkeypatch):
    dev = torch.device(_accelerator().type, 0)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).to(dev)
    hooks = attach_autocast(m, dev.type, torch.bfloat16, PatchSet(),
                            trial=SpeedTrial(calls=8, settle_max=16), device=dev)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(64, 256, device=dev)
    budget = hooks.trial.settle_max + 2 * hooks.trial.calls + hooks.max_lag
    steps = 0
    while hooks.trial.running:
        loss = F.mse_loss(m(x).float(), x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        steps += 1
        assert steps <= budget
    assert isinstance(hooks.clock, EventClock), hooks.clock_reason
    mod = getattr(torch, dev.type)
    calls = []
    real = mod.synchronize
    monkeypatch.setattr(mod, "synchronize", lambda *a, **k: (calls.append(1), real(*a, **k)))
    for _ in range(5):
        loss = F.mse_loss(m(x).float(), x)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert calls == []


def test_device_events_are_recorded_on_the_models_own_device(monkeypatch):
    """``torch.Event(device="cuda:1")`` keeps only the device type, and ``record()`` with no stream
    records on the current device's stream: a model on ``cuda:1`` while ``cuda:0`` was current was
    timed on the idle device (launch time), and the trials judged noise. The clock now records on
    the stream of its own device. (The device and its streams stood in at torch's boundary.)"""
    recorded = []

    class FakeEvent:
        def __init__(self, device=None, enable_timing=False):
            self.device = device

        def record(self, stream=None):
            recorded.append(stream)

    streams_of = {1: "stream of cuda:1", 0: "stream of cuda:0"}
    monkeypatch.setattr(torch, "Event", FakeEvent)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: streams_of[torch.device(device).index])
    EventClock(torch.device("cuda", 1)).mark()
    assert recorded == ["stream of cuda:1"]


def test_a_setting_allowed_to_be_slower_is_kept_when_within_its_allowance():
    """``min_speedup`` below 1 allows the setting to be that much slower; the clear-win rule still
    asked for "on" strictly faster, so it could never be kept (and the verdict said the timings
    overlapped: a probe's finding)."""
    t = SpeedTrial(calls=8, min_speedup=0.5, settle_window=2)
    assert _drive(t, lambda k: 1.5, lambda k: 1.0) is True and t.summary()["clear"] is True
    t = SpeedTrial(calls=8, min_speedup=0.5, settle_window=2)
    assert _drive(t, lambda k: 2.5, lambda k: 1.0) is False


def test_the_trial_decides_with_autograd_grad_a_no_grad_call_and_checkpointing_in_the_loop():
    """Three loops that kept a trial from deciding or crashed it (a probe's findings):
    ``torch.autograd.grad`` over the parameters raised "A leaf node was passed to
    _will_engine_execute_node" (the timer's hook on the parameters); a ``no_grad`` call between a
    forward and its backward withdrew the timed call every step, so bf16 ran on trial for good;
    the whole model under ``torch.utils.checkpoint`` withdrew it at the recomputation. A
    recomputation now runs the variant of the call it recomputes (checkpoint's metadata check)."""
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(8, 32)
    for loop in ("autograd.grad", "no_grad target", "checkpoint"):
        m, hooks, verdicts = _mlp_hooks()
        params = list(m.parameters())
        budget = hooks.trial.settle_max + 2 * (hooks.trial.calls + hooks.trial.calls) + hooks.max_lag + 4
        for step in range(budget):
            if not hooks.trial.running:
                break
            if loop == "autograd.grad":
                grads = torch.autograd.grad(F.mse_loss(m(x).float(), x), params)
                assert all(g is not None for g in grads)
            elif loop == "no_grad target":
                pred = m(x)
                with torch.no_grad():
                    target = m(x * 0.5)
                F.mse_loss(pred.float(), target.float()).backward()
            else:
                F.mse_loss(checkpoint(m, x, use_reentrant=False).float(), x).backward()
        assert not hooks.trial.running and len(verdicts) == 1, (loop, hooks.trial.phase, hooks.trial.index)
        assert "gave_up" not in verdicts[0][1]


def test_a_trial_that_cannot_time_any_call_gives_up_and_leaves_the_setting_off():
    """Training-mode calls whose backward never comes (each withdrawn by the next) recorded nothing,
    and the trial ran, with the setting on, for good. It gives up after four times the calls it
    needs, and the setting is off."""
    from apt_model.devices.call_timer import GIVE_UP_FACTOR

    m, hooks, verdicts = _mlp_hooks()
    x = torch.randn(8, 32)
    limit = GIVE_UP_FACTOR * hooks.trial.needed()
    for _ in range(limit + 1):
        m(x)
    assert not hooks.trial.running and hooks.active is False
    (keep, summary), = verdicts
    assert keep is False and f"no verdict after {limit} timed training calls" in summary["gave_up"]


def test_a_model_cast_to_half_after_adoption_runs_as_written():
    """The switch decided on fp32 parameters at ``.to()``; ``model.half()`` after it kept
    autocast, which computed the fp16 model in bf16 and returned fp32 (a probe's finding). The
    script manages precision then: its calls run as written."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    plain = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    plain.load_state_dict(model.state_dict())
    plain.half()
    x = torch.randn(4, 16, dtype=torch.float16)
    vb.enable("balanced", mixed_precision="bf16", compile="off", banner=False)
    try:
        model.to("cpu")
        assert vb.get_report()["models"][0]["features"]["mixed_precision"]["chosen"] == "bf16"
        model.half()
        out = model(x)
        assert out.dtype == torch.float16 and torch.equal(out, plain(x))
        assert model._vb_autocast.cast_by_script == torch.float16 and model._vb_autocast.calls == 0
    finally:
        vb.disable()


def test_a_recomputation_after_the_verdict_runs_what_its_forward_ran():
    """The whole model under ``torch.utils.checkpoint``: a verdict that comes between a forward and
    its backward (at an evaluation call, which reads the finished samples) turned autocast off, and
    the recomputation in backward then ran in fp32 what its forward had run in bf16 - tensors of
    another dtype, a CheckpointError. A recomputation runs what its forward ran."""
    from torch.utils.checkpoint import checkpoint

    m, hooks, verdicts = _mlp_hooks(settle_max=4, calls=4)
    x = torch.randn(8, 32)
    out = checkpoint(m, x, use_reentrant=False)  # the trial's first call runs with autocast on
    assert out.dtype == torch.float32 and hooks.calls == 1
    hooks.timer.close()
    hooks._verdict(False, {})  # the verdict, off, before this forward's backward
    F.mse_loss(out, x).backward()
    assert all(p.grad is not None for p in m.parameters()) and hooks.active is False
    with torch.no_grad():
        assert m(x).dtype == torch.float32 and hooks.calls == 1  # and later calls run without it


@pytest.mark.parametrize("how", ["its own autocast", "the model cast to half", "accelerate's forward wrapper"])
def test_a_trial_on_a_model_whose_script_manages_precision_ends_and_says_so(how, capsys):
    """A model adopted with the trial whose training calls then all run under the script's own
    ``torch.autocast`` (a GradScaler loop), or after ``model.half()``: the hooks leave those calls
    alone, so the trial never timed one and the report said "bf16 ... on trial" for good (a
    probe's finding). After 8 such calls in a row the trial gives up, and the report says why."""
    model = _gpt()
    vb.enable("balanced", autocast_min_speedup=0.01, autocast_trial_calls=4, compile="off", banner=False)
    model.to("cpu")
    assert model._vb_autocast.trial.running
    if how == "the model cast to half":
        model.half()
    elif how == "accelerate's forward wrapper":  # what Accelerator(mixed_precision="bf16").prepare does
        model._original_forward = model.forward
        model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model._original_forward)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(9):
        x = torch.randint(0, 256, (2, 16))
        if how == "its own autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x).reshape(-1, 256).float(), x.reshape(-1))
        else:
            loss = F.cross_entropy(model(x).reshape(-1, 256).float(), x.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert not model._vb_autocast.trial.running and model._vb_autocast.calls == 0
    feat = vb.get_report()["models"][0]["features"]["mixed_precision"]
    # "as written", not "fp32": the calls ran the script's precision (under Lightning's bf16-mixed the
    # report said fp32, a probe's finding), and print_stats counts them
    assert feat["chosen"] == "as written" and "the script managed precision in 8 training calls" in feat["reason"], feat
    calls = feat["calls"]
    assert calls["autocast"] == calls["evaluation"] == 0 and calls["script"] >= 8, feat
    capsys.readouterr()
    vb.print_stats()
    assert f"{calls['script']} under the script's own precision" in capsys.readouterr().out


def test_deterministic_algorithms_keep_the_scripts_precision_and_eager_forward(cpu_device):
    """The bf16 trial alternates bf16 and fp32 calls and keeps bf16 by timing, and the compile
    ladder keeps a rung by timing: the same script under torch.use_deterministic_algorithms(True)
    gave a different result in each run (a probe: three runs, three digests, bf16 kept once).
    With deterministic algorithms on, neither trial runs; forcing bf16 still works."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        vb.enable("balanced", autocast_min_speedup=0.01, banner=False)
        _gpt().to("cpu")
        features = vb.get_report()["models"][0]["features"]
        mp, comp = features["mixed_precision"], features["compile"]
        assert mp["chosen"] == "fp32" and "use_deterministic_algorithms(True) is on" in mp["reason"], mp
        assert comp["chosen"] == "eager" and "use_deterministic_algorithms(True) is on" in comp["reason"], comp
        vb.disable()
        vb.enable("balanced", mixed_precision="bf16", banner=False)
        _gpt().to("cpu")
        assert vb.get_report()["models"][0]["features"]["mixed_precision"]["chosen"] == "bf16"
    finally:
        vb.disable()
        torch.use_deterministic_algorithms(before)


def test_deterministic_algorithms_turned_on_during_the_trial_end_it(cpu_device):
    """Turned on after adoption, while the bf16 trial runs: the trial gave its verdict by timing
    all the same (a probe's minor). It gives up at the next timed call: the script's precision."""
    before = torch.are_deterministic_algorithms_enabled()
    try:
        vb.enable("balanced", autocast_min_speedup=0.01, compile="off", banner=False)
        m = _gpt().to("cpu")
        _train(m, 2)
        assert "on trial" in vb.get_report()["models"][0]["features"]["mixed_precision"]["reason"]
        torch.use_deterministic_algorithms(True)
        _train(m, 1)
        mp = vb.get_report()["models"][0]["features"]["mixed_precision"]
        assert mp["chosen"] == "fp32" and "use_deterministic_algorithms(True) was turned on" in mp["reason"], mp
    finally:
        vb.disable()
        torch.use_deterministic_algorithms(before)


def test_the_report_counts_a_frozen_teachers_evaluation_calls_as_fp32(cpu_device, capsys):
    """Under forced bf16 a frozen teacher called in eval mode under no_grad was reported "bf16",
    with nothing to say that every one of its calls ran as written in fp32 (a probe's finding).
    Each model's mixed-precision entry now counts its calls: under autocast, and evaluation
    calls run in fp32; ``print_stats`` shows both, and a trial's verdict keeps them."""
    vb.enable("balanced", mixed_precision="bf16", banner=False)
    try:
        teacher, student = _gpt().eval(), _gpt()
        teacher.requires_grad_(False)
        opt = torch.optim.SGD(student.parameters(), lr=0.01)
        x = torch.randint(0, 256, (2, 16))
        for _ in range(4):
            with torch.no_grad():
                target = teacher(x)
            assert target.dtype == torch.float32
            loss = F.mse_loss(student(x), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
        models = vb.get_report()["models"]
        assert len(models) == 2
        first, second = (m["features"]["mixed_precision"] for m in models)
        # the teacher was called first: adopted at its first call (run as written), 3 evaluation calls after
        assert first["chosen"] == "bf16" and first["calls"] == {"autocast": 0, "evaluation": 3, "script": 0, "transform": 0}, first
        assert second["chosen"] == "bf16" and second["calls"] == {"autocast": 3, "evaluation": 0, "script": 0, "transform": 0}, second
        capsys.readouterr()
        vb.print_stats()
        out = capsys.readouterr().out
        assert "[calls so far: 0 under bf16 autocast, 3 evaluation calls as written in fp32]" in out, out
        assert "[calls so far: 3 under bf16 autocast, 0 evaluation calls as written in fp32]" in out, out
    finally:
        vb.disable()

    vb.enable("balanced", autocast_min_speedup=0.01, autocast_trial_calls=4, autocast_trial_min_speedup=99.0,
              banner=False)
    try:
        model = _gpt()
        model.to("cpu")
        hooks = model._vb_autocast
        steps = 0
        while hooks.trial.running and steps < 60:
            _train(model, 1)
            steps += 1
        feat = vb.get_report()["models"][0]["features"]["mixed_precision"]
        assert feat["chosen"] == "fp32" and feat["calls"]["autocast"] == hooks.calls > 0, feat
    finally:
        vb.disable()


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_target_network_called_only_without_grad_runs_as_written_and_its_trial_ends(cpu_device, mode):
    """A DQN/SAC target network (a copy of the online net, called under ``no_grad`` and left in
    train mode, never trained) ran under bf16 autocast for good: the trial times training calls
    only, so it never got a verdict, and every untimed call used autocast (outputs off by bf16's
    rounding, and slower: a probe's finding). While a trial has no verdict, a call it does not time
    runs as written; a model with no training call in four times the calls a trial needs gives the
    trial up, and the report says why."""
    import copy

    vb.enable("balanced", autocast_min_speedup=0.01, autocast_trial_calls=4, compile="off", attention="off",
              banner=False)
    try:
        torch.manual_seed(0)
        online = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 2)).to("cpu")
        target = copy.deepcopy(online).to("cpu").train(mode == "train")  # a frozen reference: eval mode
        assert target._vb_autocast.trial.running
        x = torch.randn(16, 4)
        for _ in range(4 * target._vb_autocast.trial.needed() + 2):
            with torch.no_grad():
                got = target(x)
            want = F.linear(F.relu(F.linear(x, target[0].weight, target[0].bias)), target[2].weight, target[2].bias)
            assert torch.equal(got, want)  # fp32, as written
        hooks = target._vb_autocast
        feature = vb.get_report()["models"][1]["features"]["mixed_precision"]  # the target, adopted second
    finally:
        vb.disable()
    assert hooks.calls == 0 and hooks.counts["evaluation"] >= 4 * 60, hooks.counts
    assert feature["chosen"] == "fp32" and "a model called only without gradients" in feature["reason"], feature


class Gate(torch.autograd.Function):
    """SiLU with a backward that takes fp32 only, as an extension's backward kernel often does."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if x.dtype != torch.float32:
            raise RuntimeError(f"gate_backward: expected Float, got {x.dtype}")
        s = torch.sigmoid(x)
        return g * (s + x * s * (1 - s))


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 4)

    def forward(self, x):
        return self.b(Gate.apply(self.a(x)))


@pytest.mark.parametrize("adopted", ["at .to()", "at its first call"])
def test_a_model_with_a_custom_autograd_function_keeps_the_scripts_precision(cpu_device, adopted):
    """A forward under the trial's bf16 made a custom Function's fp32-only backward raise inside
    the script's ``loss.backward()``, where plain PyTorch trains (a probe's finding, balanced mode:
    a backward error is out of the forward retry's reach). The trial's first training call runs as
    written and a graph holding a custom Function ends the trial: fp32, bitwise as plain."""
    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(6):
            x = torch.randn(16, 32, generator=gen)
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    torch.manual_seed(0)
    model = Gated()
    plain = Gated()
    plain.load_state_dict(model.state_dict())
    expected = train(plain)
    vb.enable("balanced", autocast_min_speedup=0.01, autocast_trial_calls=4, compile="off", banner=False)
    try:
        if adopted == "at .to()":
            model.to("cpu")
        assert train(model) == expected
        feat = vb.get_report()["models"][0]["features"]["mixed_precision"]
    finally:
        vb.disable()
    assert feat["chosen"] == "fp32" and "custom autograd Functions (Gate)" in feat["reason"], feat
    from apt_model.precision.autocast import custom_functions

    x = torch.randn(2, 32, requires_grad=True)
    assert custom_functions(Gated()(x)) == ["Gate"] and custom_functions(nn.Linear(32, 2)(x)) == []
    # a model fed by one that runs a custom Function is not blamed for it (a review probe's finding)
    upstream = Gated()(x)
    assert custom_functions(nn.Linear(4, 2)(upstream), inputs=(upstream,)) == []


def test_a_model_fed_by_keyword_from_one_with_a_custom_function_is_not_blamed_for_it(cpu_device):
    """The screen stops at the call's inputs; the hooks see no keyword arguments, so a decoder
    called as ``dec(x, memory=m)`` (Hugging Face style) was blamed for its encoder's custom
    Function and lost bf16 (a review probe's finding). The call's keyword inputs count too."""
    class Dec(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, memory=None):
            return self.lin(x + memory)

    vb.enable("balanced", autocast_min_speedup=0.01, autocast_trial_calls=4, compile="off", banner=False)
    try:
        torch.manual_seed(0)
        enc, dec = Gated().to("cpu"), Dec().to("cpu")
        opt = torch.optim.SGD(list(enc.parameters()) + list(dec.parameters()), lr=0.1)
        for _ in range(3):
            x = torch.randn(8, 32)
            m = enc(x)
            loss = dec(torch.zeros_like(m), memory=m).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        models = {m["name"]: m["features"]["mixed_precision"] for m in vb.get_report()["models"]}
    finally:
        vb.disable()
    assert "custom autograd Functions (Gate)" in models["Gated"]["reason"], models
    assert "custom autograd" not in models["Dec"]["reason"], models


def test_per_sample_gradients_under_torch_func_run_as_written_during_the_trial(cpu_device):
    """DP-SGD with ``vmap(grad(loss))`` over ``functional_call``: the trial's bf16 autocast inside
    the transform made its backward raise "expected scalar type BFloat16 but found Float" at the
    second step (PyTorch's own autocast fails the same there; a probe's finding). Calls inside a
    ``torch.func`` transform run as written and untimed: bitwise as plain PyTorch, and a model
    called only there gives its trial up."""
    from torch.func import functional_call, grad, vmap

    def train(on: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 1))
        if on:
            model.to("cpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.05)

        def loss(params, x, y):
            return F.mse_loss(functional_call(model, params, (x.unsqueeze(0),)), y.unsqueeze(0))

        gen = torch.Generator().manual_seed(1)
        steps = 4 * model._vb_autocast.trial.needed() + 2 if on else STEPS[0]
        for _ in range(steps):
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
            params = {k: v.detach() for k, v in model.named_parameters()}
            g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
            for k, p in model.named_parameters():
                p.grad = g[k].mean(0)
            opt.step()
        STEPS[0] = steps
        return model

    STEPS = [0]
    vb.enable("balanced", autocast_min_speedup=0.01, autocast_trial_calls=4, compile="off", attention="off",
              banner=False)
    try:
        got = train(True)
        hooks = got._vb_autocast
        feature = vb.get_report()["models"][0]["features"]["mixed_precision"]
    finally:
        vb.disable()
    want = train(False)
    assert all(torch.equal(a, b) for a, b in zip(want.state_dict().values(), got.state_dict().values()))
    assert hooks.calls == 0 and hooks.counts["transform"] >= STEPS[0], hooks.counts
    assert feature["chosen"] == "fp32" and "inside torch.func transforms" in feature["reason"], feature


def test_the_scripts_hooks_on_layers_end_the_trial_with_autocast_off(cpu_device):
    """Per-sample gradients the Opacus way: forward hooks keep each Linear's input, full backward
    hooks its gradient output, and the script builds each layer's gradient from the two. Under the
    trial's autocast they were bf16: the script's einsum raised, or its ``p.grad = ...`` did (a
    probe's finding). Hooks the script puts on the model's layers (here after adoption) end the
    trial with autocast off: bitwise as plain PyTorch, and the report names the hooks."""
    def train(on: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        if on:
            model.to("cpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        acts, gouts = {}, {}
        for m in model:
            if isinstance(m, nn.Linear):
                m.register_forward_hook(lambda mod, i, o: acts.__setitem__(mod, i[0].detach()))
                m.register_full_backward_hook(lambda mod, gi, go: gouts.__setitem__(mod, go[0].detach()))
        gen = torch.Generator().manual_seed(1)
        for _ in range(6):
            x, y = torch.randn(16, 16, generator=gen), torch.randn(16, 1, generator=gen)
            opt.zero_grad()
            F.mse_loss(model(x), y, reduction="sum").backward()
            for m in acts:
                per_sample = torch.einsum("bo,bi->boi", gouts[m], acts[m])
                factor = (1.0 / (per_sample.flatten(1).norm(dim=1) + 1e-6)).clamp(max=1.0)
                m.weight.grad = torch.einsum("b,boi->oi", factor, per_sample) / 16
            opt.step()
        return model

    vb.enable("balanced", autocast_min_speedup=0.01, autocast_trial_calls=4, compile="off", attention="off",
              banner=False)
    try:
        got = train(True)
        hooks = got._vb_autocast
        feature = vb.get_report()["models"][0]["features"]["mixed_precision"]
    finally:
        vb.disable()
    want = train(False)
    assert all(torch.equal(a, b) for a, b in zip(want.state_dict().values(), got.state_dict().values()))
    assert hooks.calls == 0, hooks.counts
    assert feature["chosen"] == "fp32" and "forward hook on 0" in feature["reason"], feature


def test_hooks_torch_defines_are_not_the_scripts_activation_hooks():
    """``spectral_norm``'s pre-hook computes the weight from parameters: not counted with
    ``skip_torch``; a script's hook is."""
    from apt_model.base.module_hooks import script_hooks

    model = nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 4)), nn.ReLU())
    assert script_hooks(model) == ["forward pre-hook on 0"] and script_hooks(model, skip_torch=True) == []
    model[1].register_forward_hook(lambda m, i, o: None)
    assert script_hooks(model, skip_torch=True) == ["forward hook on 1"]


def test_a_model_of_complex_parameters_only_keeps_its_precision(cpu_device):
    """A model whose parameters are all complex (a spectral filter) has no real floating-point
    parameter for autocast to act on: its report read bf16 (a probe's finding); it reads its
    dtype now, and no autocast is attached."""
    class Spectral(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(9, dtype=torch.complex64))

        def forward(self, x):
            return torch.fft.irfft(torch.fft.rfft(x) * self.w, n=16)

    vb.enable("balanced", mixed_precision="bf16", compile="off", banner=False)
    try:
        model = Spectral().to("cpu")
        feature = vb.get_report()["models"][0]["features"]["mixed_precision"]
        assert not hasattr(model, "_vb_autocast")
    finally:
        vb.disable()
    assert feature["chosen"] == "complex64" and "none real floating point" in feature["reason"], feature


def test_a_hook_on_the_model_itself_ends_the_trial_too(cpu_device):
    """A forward hook on the model keeping its logits for a metric got them in bf16 during the
    trial (``.numpy()`` raised "Got unsupported ScalarType BFloat16": a review probe's finding):
    the model's own hooks end the trial as its layers' do."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    kept = {}
    vb.enable("balanced", autocast_min_speedup=0.01, autocast_trial_calls=4, compile="off", attention="off",
              banner=False)
    try:
        model.to("cpu")
        model.register_forward_hook(lambda m, a, out: kept.__setitem__("logits", out.detach()))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(6):
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(8, 16)), torch.arange(8) % 4).backward()
            opt.step()
            assert kept["logits"].dtype == torch.float32
            kept["logits"].numpy()
        feature = vb.get_report()["models"][0]["features"]["mixed_precision"]
    finally:
        vb.disable()
    assert feature["chosen"] == "fp32" and "forward hook on" in feature["reason"], feature
