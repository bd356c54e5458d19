"""The op-level page-fault handler: on in every forward (a learned fast path was unsafe, see
paging/model.py), reported per model where it is needed; off inside the streamed optimizer step,
whose pages the step acquires itself, and always put back."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from apt_model.memory.paging.fault import PageFaultMode
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


def test_forwards_keep_the_handler_and_the_report_says_it_was_not_needed(tmp_path, op_calls):
    """The project's GPT (tied embedding and output weights): every paged tensor its forwards touch
    is pinned by the module that owns it — reported — yet the handler stays on in every forward
    (a later forward could take another branch); the losses stay bitwise."""
    ref_m = model()
    ref = train(ref_m, make_opt(ref_m, "adamw"), 4, clip=0.5)
    per_forward = []
    vb.enable("balanced", swap_dir=str(tmp_path), compile="off", **FORCE)
    try:
        m = model().to("cpu")
        m.register_forward_pre_hook(lambda mod, a: per_forward.append(op_calls[0]))
        m.register_forward_hook(lambda mod, a, o: per_forward.append(op_calls[0] - per_forward.pop()))
        got = train(m, make_opt(m, "adamw"), 4, clip=0.5)
        state = _faults_state()
    finally:
        vb.disable()
    assert got == ref
    assert state == "not needed so far (4 forwards; the handler stays on)"
    assert len(per_forward) == 4 and all(n > 0 for n in per_forward)


def test_the_optimizer_step_runs_without_the_handler_and_always_puts_it_back(tmp_path, op_calls, monkeypatch):
    """The streamed step acquires every page it touches: its ops skip the handler. An interrupt in
    the middle of the step (a KeyboardInterrupt is not an Exception) still leaves the handler on the
    stack, so code after it faults paged tensors in instead of reading freed storage."""
    from apt_model.memory.paging.optimizer import OptimizerPaging
    from apt_model.switch.controller import session as vb_session

    vb.enable("balanced", swap_dir=str(tmp_path), compile="off", **FORCE,
              paging_step_in_backward="off")  # the step after backward is what this tests
    try:
        m = model().to("cpu")
        opt = make_opt(m, "adamw")
        train(m, opt, 1)
        mode = vb_session().paging.mode
        x = torch.randint(0, 256, (4, 32))
        m(x).sum().backward()
        before = op_calls[0]
        opt.step()
        in_step = op_calls[0] - before  # only torch's own wrapper around the step
        m(x).sum().backward()
        with monkeypatch.context() as mp:
            mp.setattr(type(vb_session().paging), "suspend_fault_handler", lambda self: False)
            before = op_calls[0]
            opt.step()
            with_handler = op_calls[0] - before
        m(x).sum().backward()
        real = OptimizerPaging._stream

        def interrupted(self, o):
            real(self, o)
            raise KeyboardInterrupt

        monkeypatch.setattr(OptimizerPaging, "_stream", interrupted)
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        on_stack = mode in torch.overrides._get_current_function_mode_stack()
        w = m.tok_emb.weight.detach().clone()  # paged out: loaded through the handler
    finally:
        vb.disable()
    assert in_step < 10 and with_handler > 100, (in_step, with_handler)
    assert on_stack and torch.isfinite(w).all() and w.abs().sum() > 0


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
    assert state == "needed: a paged tensor was used outside its module"
    assert in_forward > 0
