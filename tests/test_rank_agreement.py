"""Rank 0's trial verdicts hold for every rank: what a trial's owner does while it waits for rank
0's verdict, driven on the CPU with a channel the test controls (the two-rank job through the
process group's store is tests/test_distributed.py::test_rank_0s_trial_verdict_holds_for_every_rank_of_a_job)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from apt_model.base.patches import PatchSet
from apt_model.compile.ladder import WARMUP_CALLS, CompileLadder, LadderPolicy, Rung
from apt_model.devices.trial import SpeedTrial
from apt_model.precision.autocast import attach_autocast


class Channel:
    """Rank 1's side of a channel: rank 0's verdict ``theirs`` arrives after ``after`` polls."""

    def __init__(self, theirs: bool, after: int):
        self.theirs, self.after = theirs, after
        self.polls = 0
        self.settled: list[tuple[bool, bool]] = []  # (local verdict, final)
        self.started = 0
        self.local = None

    def start(self):  # called at every timed call; the real channel publishes once
        self.started += 1

    def settle(self, keep, summary, final=False):
        self.settled.append((keep, final))
        self.local = (keep, summary)
        if final:
            return keep, {**summary, "ranks": {"world": 2, "rank": 1, "by": "own", "error": "final"}}
        return None

    def poll(self):
        self.polls += 1
        if self.polls < self.after:
            return None
        keep, summary = self.local
        return self.theirs, {**summary, "ranks": {"world": 2, "rank": 1, "by": "rank 0", "own_keep": keep,
                                                  "rank0_speedup": 0.5, "waited_calls": self.polls}}

    waited = property(lambda self: self.polls)

    def give_up(self):
        keep, summary = self.local
        return keep, {**summary, "ranks": {"world": 2, "rank": 1, "by": "own", "error": "gave up"}}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


def _train(model, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_a_ladder_rung_its_rank_would_keep_is_left_when_rank_0_says_no():
    """The rung wins this rank's trial (min_speedup 0.01: kept whatever the timings) but rank 0's
    verdict is 'not faster': while waiting, the calls go on alternating rung and eager; then the
    rung is left."""
    model = Net()
    ran = {"rung": 0, "eager": 0}
    eager_forward = model.forward

    def slow_eager(x):
        ran["eager"] += 1
        return eager_forward(x)

    model.forward = slow_eager

    def factory(eager, dynamic):
        def fn(x):
            ran["rung"] += 1
            return Net.forward(model, x)
        return fn, type("C", (), {"compiles": 1, "seconds": 0.0})()

    channel = Channel(theirs=False, after=6)
    records = []
    ladder = CompileLadder(model, [Rung("compile", "test rung", factory)],
                           LadderPolicy(trial_calls=8, min_speedup=0.01), torch.device("cpu"),
                           lambda chosen, reason, d: records.append((chosen, reason)), tag="net",
                           channel_for=lambda trial: channel)
    patches = PatchSet()
    ladder.attach(patches)
    steps = 0
    while not channel.settled:
        _train(model, 1)
        steps += 1
        assert steps < WARMUP_CALLS + 48 + 2 * 16 + 8, "no local verdict"
    assert channel.settled == [(True, False)] and ladder.state == "trial"  # this rank alone keeps it; waiting
    before = dict(ran)
    _train(model, 4)  # waiting: the variants alternate, untimed
    assert ran["rung"] - before["rung"] == 2 and ran["eager"] - before["eager"] == 2
    _train(model, 2)  # the sixth poll finds rank 0's verdict
    assert channel.polls == 6 and ladder.state == "done" and ladder.chosen == "eager"
    entry = ladder.timeline[-1]
    assert entry["outcome"] == "not faster"
    assert entry["reason"].startswith("turned off as rank 0 decided for all 2 ranks (rank 0 measured 0.50x)")
    assert "alone would have kept it" in entry["reason"]
    assert channel.started >= 1
    patches.restore_all()


def _hooks(channel):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    verdicts = []
    hooks = attach_autocast(m, "cpu", torch.bfloat16, PatchSet(), trial=SpeedTrial(calls=4, settle_max=8),
                            on_verdict=lambda keep, summary: verdicts.append((keep, summary)), channel=channel)
    return m, hooks, verdicts


def _until_settled(m, channel):
    for _ in range(60):
        if channel.settled:
            return
        m(torch.randn(4, 16)).float().square().mean().backward()
    raise AssertionError("no local verdict within 60 calls")


def test_autocast_stays_on_trial_until_rank_0s_verdict_and_follows_it():
    channel = Channel(theirs=True, after=3)
    m, hooks, verdicts = _hooks(channel)
    _until_settled(m, channel)
    assert verdicts == [] and hooks.timer.running and hooks.active  # waiting: still on trial
    for _ in range(3):
        m(torch.randn(4, 16)).float().square().mean().backward()
    assert len(verdicts) == 1 and verdicts[0][0] is True and hooks.active
    assert verdicts[0][1]["ranks"]["by"] == "rank 0" and not hooks.timer.running


def test_a_forward_failing_under_autocast_while_waiting_turns_it_off_for_good():
    """A give-up while rank 0's verdict is awaited is final: rank 0's later 'keep' cannot turn
    autocast back on."""
    channel = Channel(theirs=True, after=1000)
    m, hooks, verdicts = _hooks(channel)
    _until_settled(m, channel)
    hooks.timer.give_up("the forward raised under bfloat16 autocast")
    assert channel.settled[-1] == (False, True) and [v[0] for v in verdicts] == [False] and not hooks.active
    channel.after = 0
    m(torch.randn(4, 16)).float().square().mean().backward()
    assert [v[0] for v in verdicts] == [False] and not hooks.active


def test_the_undo_while_waiting_delivers_nothing_afterwards():
    channel = Channel(theirs=True, after=2)
    m, hooks, verdicts = _hooks(channel)
    _until_settled(m, channel)
    hooks.timer.close()
    for _ in range(4):
        m(torch.randn(4, 16)).float().square().mean().backward()
    assert verdicts == [] and channel.polls == 0 and not hooks.timer.running
