"""Pages autograd saves stay resident while their graph lives (memory/paging/saved.py).

Each loop builds a graph that saves paged tensors outside the module hooks — a gradient penalty
(``torch.autograd.grad(create_graph=True)`` or ``backward(create_graph=True)``), an L2 term over
the parameters computed outside the forward — and is compared bitwise with plain PyTorch. Before
these pins existed each of them read evicted storage (a segfault or a 0-byte storage error).
"""
import gc

import pytest
import torch
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from apt_model.switch.controller import session as vb_session
from test_paging import FORCE, assert_same, make_opt, model, snapshot


def _penalty_loop(form, hooks=None):
    """``loop(m, opt)`` for one of the loops above, 3 steps, no dropout randomness in the way."""
    def loop(m, opt):
        gen = torch.Generator().manual_seed(1)
        torch.manual_seed(1)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            x = torch.randint(0, 256, (4, 32), generator=gen)
            loss = F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1))
            params = [p for p in m.parameters() if p.requires_grad]
            if form == "autograd.grad":
                grads = torch.autograd.grad(loss, params, create_graph=True)
                (loss + 0.1 * sum(g.pow(2).sum() for g in grads)).backward()
            elif form == "backward(create_graph)":
                loss.backward(create_graph=True)
                penalty = sum(p.grad.pow(2).sum() for p in params)
                opt.zero_grad()
                (loss + 0.1 * penalty).backward()
            else:  # "l2 outside forward"
                if hooks is not None:
                    with hooks:
                        reg = sum(p.pow(2).sum() for p in params)
                else:
                    reg = sum(p.pow(2).sum() for p in params)
                (loss + 1e-3 * reg).backward()
            opt.step()
            losses.append(loss.item())
        return losses
    return loop


def _both(tmp_path, loop, **enable):
    ref_m, got_m = model(dropout=0.0), model(dropout=0.0)
    ref_opt, got_opt = make_opt(ref_m, "adamw"), make_opt(got_m, "adamw")
    ref = loop(ref_m, ref_opt), snapshot(ref_m, ref_opt)
    vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, **enable})
    got_m.to("cpu")
    got = loop(got_m, got_opt), snapshot(got_m, got_opt)
    report = vb.get_report()["memory"]["paging"]
    vb.disable()
    return ref, got, report


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("form", ["autograd.grad", "backward(create_graph)", "l2 outside forward"])
@pytest.mark.parametrize("step_in_backward", ["on", "off"])
def test_graphs_that_save_pages_train_bitwise(tmp_path, form, step_in_backward):
    (ref_losses, ref_state), (losses, state), report = _both(
        tmp_path, _penalty_loop(form), paging_step_in_backward=step_in_backward)
    assert losses == ref_losses
    assert_same(ref_state, state)
    sib = report["step_in_backward"]
    if form == "l2 outside forward" and step_in_backward == "on":
        assert sib["steps_in_backward"] > 0  # the regularizer's saved parameters do not stop it
    elif form != "l2 outside forward":
        assert sib["state"] == "off" and sib["steps_in_backward"] == 0  # a graph kept: never stepped inside
        if step_in_backward == "on":
            assert "keeps its graph" in sib["reason"]


def test_user_saved_tensor_hooks_still_see_the_other_tensors(tmp_path):
    """The pins compose with hooks the user set: every tensor that is no page goes to the user's
    pack, and its unpack gives it back."""
    calls = {"pack": 0, "unpack": 0}

    def pack(t):
        calls["pack"] += 1
        return t.clone()

    def unpack(t):
        calls["unpack"] += 1
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
    (ref_losses, ref_state), (losses, state), _ = _both(tmp_path, _penalty_loop("l2 outside forward", hooks),
                                                         paging_step_in_backward="off")
    assert losses == ref_losses
    assert_same(ref_state, state)
    assert calls["pack"] > 0 and calls["unpack"] > 0


def test_pages_saved_by_a_graph_are_pinned_while_it_lives(tmp_path):
    """A parameter an L2 term saved stays resident and pinned until the backward frees the graph;
    then every pin is gone."""
    m = model(dropout=0.0)
    opt = make_opt(m, "adamw")
    vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, "paging_step_in_backward": "off"})
    try:
        m.to("cpu")
        pager = vb_session().paging.pager
        p = m.blocks[0].mlp[0].weight
        page = pager.by_tensor[id(p)]
        assert page.pins == 0 and page.state.value != "resident"  # paged out at adoption
        reg = p.pow(2).sum()  # pow saves p for its backward
        pager.evict_now([page])
        assert page.pins == 1 and page.state.value == "resident"  # kept: the graph holds it
        reg.backward()
        del reg
        gc.collect()
        pager.flush()  # applies the releases the freed graph queued
        assert page.pins == 0
        assert all(pg.pins == 0 for pg in pager.pages.values())
        opt.zero_grad()
    finally:
        vb.disable()


def test_without_saved_tensor_hooks_pages_stay_to_the_end_of_backward(tmp_path):
    """Where torch disabled saved-tensor hooks, a graph's pages are pinned until the backward ends
    instead: still bitwise."""
    def loop(m, opt):
        with torch.autograd.graph.disable_saved_tensors_hooks("disabled by the test"):
            return _penalty_loop("l2 outside forward")(m, opt)
    (ref_losses, ref_state), (losses, state), _ = _both(tmp_path, loop, paging_step_in_backward="off")
    assert losses == ref_losses
    assert_same(ref_state, state)
