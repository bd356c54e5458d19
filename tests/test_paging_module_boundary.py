"""Paging at module boundaries: forwards that reach every paged tensor through its own module run
without the op-level page-fault handler once learned; anything else keeps it (paging/model.py)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from apt_model.memory.paging.fault import PageFaultMode
from apt_model.memory.paging.model import LEARN_FORWARDS
from test_paging import FORCE, make_opt, model, train


@pytest.fixture
def op_calls(monkeypatch):
    """How many ops went through the page-fault handler (its ``__torch_function__``)."""
    calls = [0]
    real = PageFaultMode.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        calls[0] += 1
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(PageFaultMode, "__torch_function__", counting)
    return calls


def _faults_state(kind_label="train"):
    from apt_model.switch.controller import session as vb_session

    return vb_session().paging.models[0].describe()["op_level_faults"].get(kind_label)


def test_an_ordinary_module_tree_runs_its_forwards_without_the_op_level_handler(tmp_path, op_calls):
    """The project's GPT (tied embedding and output weights): after the learning forwards its
    training forwards issue no op through the handler, the losses stay bitwise, and the handler is
    back on between steps — a paged weight read by user code is still loaded, not read as 0 bytes."""
    ref_m = model()
    ref = train(ref_m, make_opt(ref_m, "adamw"), 6, clip=0.5)
    per_forward = []
    vb.enable("balanced", swap_dir=str(tmp_path), compile="off", **FORCE)
    try:
        m = model().to("cpu")
        m.register_forward_pre_hook(lambda mod, a: per_forward.append(op_calls[0]))
        m.register_forward_hook(lambda mod, a, o: per_forward.append(op_calls[0] - per_forward.pop()))
        got = train(m, make_opt(m, "adamw"), 6, clip=0.5)
        state = _faults_state()
        w = m.tok_emb.weight.detach().clone()  # outside a forward: through the handler, loaded
        between = op_calls[0]
    finally:
        vb.disable()
    assert got == ref
    assert state == "off"
    assert all(n > 0 for n in per_forward[:LEARN_FORWARDS])  # learning: every op seen
    assert per_forward[LEARN_FORWARDS:] == [0] * (6 - LEARN_FORWARDS)  # then none
    assert w.abs().sum() > 0 and between > sum(per_forward)


class Borrower(nn.Module):
    """Uses another module's weight in its own forward: that access is only seen per op."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)  # never called: its weight is borrowed

    def forward(self, x):
        return F.linear(torch.relu(self.a(x)), self.b.weight, self.b.bias)


def _train_borrower(m, steps=5):
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        loss = m(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_forward_that_borrows_another_modules_weight_keeps_the_op_level_handler(tmp_path, op_calls):
    torch.manual_seed(0)
    ref = _train_borrower(Borrower())
    vb.enable("balanced", swap_dir=str(tmp_path), compile="off", **FORCE)
    try:
        torch.manual_seed(0)
        m = Borrower().to("cpu")
        got = _train_borrower(m)
        state = _faults_state()
        before = op_calls[0]
        m(torch.randn(8, 16))
        in_forward = op_calls[0] - before
    finally:
        vb.disable()
    assert got == ref
    assert state == "on: a paged tensor was used outside its module"
    assert in_forward > 0


class Flaky(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise RuntimeError("planted")
        return self.a(x)


def test_a_forward_that_raises_without_the_handler_puts_it_back(tmp_path, caplog):
    vb.enable("balanced", swap_dir=str(tmp_path), compile="off", **FORCE)
    try:
        m = Flaky().to("cpu")
        for _ in range(LEARN_FORWARDS):
            m(torch.randn(2, 16)).sum().backward()
        assert _faults_state() == "off"
        m.fail = True
        with pytest.raises(RuntimeError, match="planted"):
            m(torch.randn(2, 16))
        stack = torch.overrides._get_current_function_mode_stack()
        from apt_model.switch.controller import session as vb_session

        on_stack = vb_session().paging.mode in stack
        state = _faults_state()
        m.fail = False
        out = m(torch.randn(2, 16))  # works, with the handler
    finally:
        vb.disable()
    assert on_stack  # put back by the root hook, which runs when the forward raises
    assert state == "on: a paged tensor was used outside its module"
    assert "back on" in caplog.text
    assert out.shape == (2, 16)
