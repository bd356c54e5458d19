"""The feature-step protocol, and the worked example of docs/architecture.md ("Adding a feature"):
a toy step added to the adoption list is decided, applied, recorded and undone like the built-in ones."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import apt_model.optimization.vb_global as vb
from apt_model.base.feature import Decision, FeatureStep
from apt_model.switch import adoption


class CallCounter(FeatureStep):
    """The toy feature of docs/architecture.md: count the forward calls of every adopted model
    that has a ``nn.Linear`` (a hook, undone by ``disable()``)."""

    name = "call_counter"

    def __init__(self, session):
        super().__init__(session)
        self.calls = 0

    def decide(self, model, ctx):
        linears = sum(isinstance(m, nn.Linear) for m in model.modules())
        if not linears:
            return Decision(self.name, "on", "off", "no nn.Linear to watch")
        return Decision(self.name, "on", "counting", f"{linears} nn.Linear layer(s)", act=True,
                        facts={"paging_blocked": "the toy step says so"})

    def apply(self, model, ctx, patches, decision):
        def count(module, args):
            self.calls += 1

        patches.add_handle(model.register_forward_pre_hook(count), f"call counter {ctx.record.scope}")
        ctx.on_first_call(lambda module, args, kwargs: count(module, args))
        return decision.amend(reason=decision.reason + "; a pre-hook counts calls")

    def stats(self):
        return {"toy_calls": self.calls}


@pytest.fixture
def toy_step(monkeypatch, cpu_device):
    monkeypatch.setattr(adoption, "FEATURE_STEPS", (*adoption.FEATURE_STEPS, CallCounter))
    yield
    vb.disable()


def test_a_new_step_is_decided_applied_recorded_and_undone(toy_step):
    vb.enable("balanced", banner=False)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    model(x)  # adopted at its first call: the step's hook must count this call too
    model(x)
    feature = vb.get_report()["models"][0]["features"]["call_counter"]
    assert feature["chosen"] == "counting" and feature["reason"] == "2 nn.Linear layer(s); a pre-hook counts calls"
    assert any(d["feature"] == "call_counter" for d in vb.get_report()["decisions"])
    step = next(s for s in vb.session().steps if s.name == "call_counter")
    assert step.calls == 2
    vb.disable()
    model(x)
    assert step.calls == 2  # the hook went with disable()


def test_facts_flow_to_later_steps(monkeypatch, cpu_device, tmp_path):
    """A fact a step states (here the toy step's ``paging_blocked``, placed before paging) is read
    by the steps after it: paging stays off with the fact as its reason."""
    steps = list(adoption.FEATURE_STEPS)
    steps.insert(steps.index(adoption.PagingStep), CallCounter)
    monkeypatch.setattr(adoption, "FEATURE_STEPS", tuple(steps))
    try:
        vb.enable("balanced", paging="always", device_budget="1MB", swap_dir=str(tmp_path), banner=False)
        nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).to("cpu")
        paging = vb.get_report()["models"][0]["features"]["paging"]
        assert paging["chosen"] == "off" and paging["reason"] == "the toy step says so"
        nn.Sequential(nn.ReLU(), nn.Conv1d(2, 2, 1)).to("cpu")  # no Linear: no fact, so it is paged
        assert vb.get_report()["models"][1]["features"]["paging"]["chosen"] == "paged"
    finally:
        vb.disable()


def test_decisions_say_why():
    with pytest.raises(ValueError, match="every decision says why"):
        Decision("attention", "auto", "sdpa", "")
    with pytest.raises(ValueError, match="feature name"):
        Decision("", "auto", "sdpa", "why")
    d = Decision("attention", "auto", "sdpa", "faster", tried=["probe"])
    assert d.tried == ("probe",) and d.amend(reason="slower").reason == "slower" and d.reason == "faster"
