"""A module that writes its own paged parameter in place inside its forward: the write must reach
the swap file. The module's hooks acquire the page clean for the forward, so before 2026-11-26
the write was dropped at eviction (the old bytes came back at the next load):
``nn.Embedding(max_norm=...)``, whose forward renormalizes the rows it looks up, and a weight
clamped in place in the forward."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from test_paging import FORCE, assert_same, snapshot


class _ClampedLinear(nn.Linear):
    def forward(self, x):
        with torch.no_grad():
            self.weight.clamp_(-0.05, 0.05)
        return super().forward(x)


def _build(kind):
    torch.manual_seed(0)
    first = nn.Embedding(64, 32, max_norm=1.0) if kind == "embedding max_norm" else _ClampedLinear(64, 32)
    return nn.Sequential(first, nn.ReLU(), nn.Linear(32, 64))


def _train(m, kind, steps=3):
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        if kind == "embedding max_norm":
            x = torch.randint(0, 64, (4, 8), generator=gen)
            target = x
        else:
            x = torch.randn(4, 8, 64, generator=gen)
            target = torch.randint(0, 64, (4, 8), generator=gen)
        opt.zero_grad()
        loss = F.cross_entropy(m(x).reshape(-1, 64), target.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, snapshot(m, opt)


@pytest.mark.parametrize("kind", ["embedding max_norm", "clamped in forward"])
def test_a_parameter_written_in_its_own_forward_keeps_the_write(tmp_path, kind, cpu_device):
    ref_losses, ref_state = _train(_build(kind), kind)
    m = _build(kind)
    vb.enable("memory", swap_dir=str(tmp_path), **{**FORCE, "device_budget": "8KB"}, fp4="off",
              activation_checkpointing=False, activation_offload=False, paging_step_in_backward="off")
    try:
        m.to("cpu")
        losses, state = _train(m, kind)
        rep = vb.get_report()
    finally:
        vb.disable()
    assert rep["models"][0]["features"]["paging"]["chosen"] == "paged"
    assert rep["memory"]["paging"]["pager"]["bytes_in"] > 0
    assert losses == ref_losses
    assert_same(ref_state, state)



def test_only_the_pages_an_in_place_op_writes_are_marked_written(tmp_path):
    """``y.add_(b)`` writes ``y``, not ``b``: a pinned page the op only reads stays clean (marking
    every page a writing op touched wrote ``b`` out again at every eviction)."""
    from apt_model.base.patches import PatchSet
    from apt_model.memory.paging.session import PagingSession
    from apt_model.memory.swap import SwapSpace

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    patches = PatchSet()
    session = PagingSession(2 * 2**20, SwapSpace(tmp_path), patches, device="cpu")
    try:
        session.page_model(m, page_params=True, page_grads=False)
        weight, bias = (session.param_pages[id(p)] for p in (m[0].weight, m[0].bias))
        session.pager.acquire([weight, bias])  # pinned clean, as a module's pre-hook leaves them
        session.enter([weight, bias], True, [weight])  # an op writing the weight, reading the bias
        assert weight.dirty and not bias.dirty
        session.enter([bias], True, None)  # writes unknown: any of its pages
        assert bias.dirty
        session.pager.release([weight, bias])
    finally:
        patches.restore_all()


class _LayerScaleBlock(nn.Module):
    """``fc1 -> relu_ -> fc2`` scaled by a parameter the block owns itself (LayerScale). On a 3-D
    input ``fc1``'s output is an autograd view, and the in-place ``relu_`` rebases its history:
    a gradient hook on that output never fires."""

    def __init__(self, d=64, how="relu_"):
        super().__init__()
        self.fc1, self.fc2, self.how = nn.Linear(d, d), nn.Linear(d, d), how
        self.gamma = nn.Parameter(torch.full((d,), 0.5))

    def forward(self, x):
        h = self.fc1(x)
        if self.how == "relu_":
            h.relu_()
        else:
            h.mul_(0.5)
        return x + self.gamma * self.fc2(h)


@pytest.mark.parametrize("how", ["relu_", "mul_"])
def test_an_in_place_op_on_a_units_view_output_still_brings_its_weights_back_for_backward(tmp_path, how):
    """A unit's backward starts at the first gradient that reaches its outputs — or their bases:
    hooked on a view that is later modified in place, it never fired, and ``fc1``'s evicted weight
    was read as 0-byte storage in backward ("setStorage ... out of bounds")."""

    def run(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            loss = m(torch.randn(4, 8, 64, generator=gen)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, snapshot(m, opt)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(_LayerScaleBlock(how=how), _LayerScaleBlock(how=how))

    ref_losses, ref_state = run(build())
    m = build()
    vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, "device_budget": "64KB"})
    try:
        m.to("cpu")
        losses, state = run(m)
        paged = vb.get_report()["memory"]["paging"]["pager"]["bytes_in"]
    finally:
        vb.disable()
    assert paged > 0
    assert losses == ref_losses
    assert_same(ref_state, state)
