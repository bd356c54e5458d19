"""Pages autograd saves outside the module hooks (memory/paging/saved.py): parameters are saved
by reference and reloaded in backward; other pages stay pinned while their graph lives.

Each loop builds a graph that saves paged tensors outside the module hooks — a gradient penalty
(``torch.autograd.grad(create_graph=True)`` or ``backward(create_graph=True)``), an L2 term over
the parameters computed outside the forward — and is compared bitwise with plain PyTorch. Before
these pins existed each of them read evicted storage (a segfault or a 0-byte storage error).
"""
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from apt_model.models.gpt import GPT, GPTConfig
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


def _both(tmp_path, loop, build=lambda: model(dropout=0.0), move=True, **enable):
    ref_m, got_m = build(), build()
    ref_opt, got_opt = make_opt(ref_m, "adamw"), make_opt(got_m, "adamw")
    ref = loop(ref_m, ref_opt), snapshot(ref_m, ref_opt)
    vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, **enable})
    if move:  # else adopted inside its first forward
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


def test_parameters_a_graph_saves_are_reloaded_in_backward_not_kept(tmp_path):
    """An L2 term over every parameter, computed outside the forward, saves every parameter: they
    are saved by reference (not pinned), so level 0 keeps its budget while the graph lives, and
    backward reloads each one for its node — the gradient is exactly plain PyTorch's."""
    m = model(dropout=0.0)
    ref = {n: p.detach().clone() for n, p in m.named_parameters()}
    vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, "paging_step_in_backward": "off"})
    try:
        m.to("cpu")
        pager = vb_session().paging.pager
        whole = sum(p.numel() * p.element_size() for p in m.parameters())
        reg = sum(p.pow(2).sum() for p in m.parameters())  # pow saves each p for its backward
        assert not _pinned_pages()
        assert pager.resident_bytes < whole / 4, (pager.resident_bytes, whole)  # the graph holds no page
        reg.backward()
        assert not _pinned_pages()
        for n, p in m.named_parameters():
            assert torch.equal(p.grad, 2 * ref[n]), n
    finally:
        vb.disable()


def test_a_saved_parameter_modified_in_place_raises_as_without_paging(tmp_path):
    """Autograd refuses a saved tensor modified in place since it was saved; a parameter saved by
    reference keeps that rule (else backward would read the new values)."""
    plain = model(dropout=0.0)
    reg = plain.head.weight.pow(2).sum()
    with torch.no_grad():
        plain.head.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        reg.backward()
    m = model(dropout=0.0)
    vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, "paging_step_in_backward": "off"})
    try:
        m.to("cpu")
        reg = m.head.weight.pow(2).sum()
        with torch.no_grad():
            m.head.weight.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            reg.backward()
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


# ------------------------------------------------------------------ found by a review of the first version
def _lm_loss(out, x):
    return F.cross_entropy(out.reshape(-1, 256), x.roll(-1, 1).reshape(-1))


def _loop_with(forward, steps=2, between=None):
    """``loop(m, opt)``: ``steps`` steps of ``forward(m, x)``; ``between(m, pager)`` after each step."""
    def loop(m, opt):
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            x = torch.randint(0, 256, (4, 32), generator=gen)
            loss = _lm_loss(forward(m, x), x)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if between is not None:
                between(m)
        return losses
    return loop


def _pinned_pages():
    """The pages pinned now, after a collection ([] in the plain run: no session)."""
    if vb_session() is None:
        return []
    pager = vb_session().paging.pager
    gc.collect()
    pager.flush()
    return [pg for pg in pager.pages.values() if pg.pins]


def test_an_op_saving_its_own_output_frees_its_graph(tmp_path):
    """``p.norm()`` and ``p.exp()`` save their output: kept as is, the saved tensor held its own
    node (a cycle through C++ that gc cannot break), and every page stayed pinned for good."""
    seen = []

    def metric(m):
        sum(p.norm() ** 2 for p in m.parameters()).sqrt().item()  # a weight-norm metric without no_grad
        e = m.blocks[0].mlp[0].weight.exp()
        freed = weakref.ref(e)
        del e
        seen.append((freed() is None, len(_pinned_pages())))

    (ref_losses, ref_state), (losses, state), _ = _both(tmp_path, _loop_with(lambda m, x: m(x), 3, metric),
                                                         paging_step_in_backward="off")
    assert losses == ref_losses
    assert_same(ref_state, state)
    assert seen[3:] == [(True, 0)] * 3  # the paged run's steps (the plain run's come first)


def _checkpointed_forward(m, x):
    """Blocks under non-reentrant checkpointing, each adding a projection through a weight its
    block does not own (the head's: used outside its module), called by the loop itself (the
    model's own forward never runs)."""
    h = m.drop(m.tok_emb(x) + m.pos_emb(torch.arange(x.shape[1])))
    for blk in m.blocks:
        h = torch.utils.checkpoint.checkpoint(lambda t, blk=blk: blk(t) + F.linear(t, m.head.weight[:64]), h,
                                              use_reentrant=False)
    return m.head(m.ln_f(h))


def test_checkpointing_around_a_parameter_used_outside_its_module(tmp_path):
    """The checkpoint's hooks see the page's saved tensor too (it counts the forward's saved
    tensors against the recomputation's: CheckpointError before), and the page stays resident
    for the recomputation."""
    (ref_losses, ref_state), (losses, state), _ = _both(tmp_path, _loop_with(_checkpointed_forward),
                                                         paging_step_in_backward="off")
    assert losses == ref_losses
    assert_same(ref_state, state)


def test_blocks_called_directly_pin_nothing_after_the_forward(tmp_path):
    """Pages a unit's hooks hold are not pinned by the saved-tensor hooks, also where the model's
    own forward never runs (the loop calls its blocks): before, the whole model stayed resident."""
    after_forward = []

    def forward(m, x):
        h = m.drop(m.tok_emb(x) + m.pos_emb(torch.arange(x.shape[1])))
        for blk in m.blocks:
            h = blk(h)
        out = m.head(m.ln_f(h))
        after_forward.append(len(_pinned_pages()))
        return out

    (ref_losses, ref_state), (losses, state), _ = _both(tmp_path, _loop_with(forward), paging_step_in_backward="off")
    assert losses == ref_losses
    assert_same(ref_state, state)
    assert after_forward[2:] == [0, 0]  # the paged run (the plain one counts nothing: no session)


class _TiedGPT(GPT):
    """The output layer is the token embedding, used through ``F.linear`` in the model's forward
    (outside the embedding's module)."""

    def forward(self, idx):
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1])))
        for blk in self.blocks:
            x = blk(x)
        return F.linear(self.ln_f(x), self.tok_emb.weight)


def test_a_parameter_used_outside_its_module_in_two_forwards(tmp_path):
    """Two forwards, then two backwards: the second forward's use of the tied weight found its
    page pinned by the first graph's saved tensor, was not pinned itself, and the second backward
    read it evicted once the first had freed its graph."""
    def build():
        torch.manual_seed(0)
        return _TiedGPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=2, dropout=0.0))

    def loop(m, opt):
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            xs = [torch.randint(0, 256, (4, 32), generator=gen) for _ in range(2)]
            ls = [_lm_loss(m(x), x) / 2 for x in xs]
            for loss in ls:
                loss.backward()
            opt.step()
            losses.append(sum(loss.item() for loss in ls))
        assert not _pinned_pages()
        return losses

    (ref_losses, ref_state), (losses, state), _ = _both(tmp_path, loop, build, paging_step_in_backward="off")
    assert losses == ref_losses
    assert_same(ref_state, state)


def test_a_sparse_saved_tensor(tmp_path):
    """A sparse matrix saved beside a page (``torch.sparse.mm`` on the embedding) has no storage:
    skipped, not an error."""
    idx = torch.tensor([[0, 1, 2], [3, 4, 5]])
    lap = torch.sparse_coo_tensor(idx, torch.tensor([1.0, -2.0, 0.5]), (8, 256), check_invariants=True)

    def forward(m, x):
        out = m(x)
        return out + 1e-3 * torch.sparse.mm(lap, m.tok_emb.weight).pow(2).sum()

    (ref_losses, ref_state), (losses, state), _ = _both(tmp_path, _loop_with(forward), paging_step_in_backward="off")
    assert losses == ref_losses
    assert_same(ref_state, state)


def test_autograd_grad_leaves_no_pins_and_loads_pages_one_unit_at_a_time(tmp_path):
    """``torch.autograd.grad`` w.r.t. the parameters: their gradients already exist (accumulation),
    yet no gradient page stays pinned (one more pin per call before), and the call does not load
    every parameter at once (the fault handler used to, for everything in ``inputs``)."""
    resident_at_end = []

    def loop(m, opt):
        gen = torch.Generator().manual_seed(1)
        losses = []
        hook = m.tok_emb.weight.register_hook(
            lambda g: resident_at_end.append(vb_session().paging.pager.resident_bytes) if vb_session() else None)
        for _ in range(3):
            opt.zero_grad()
            for _ in range(2):
                x = torch.randint(0, 256, (4, 32), generator=gen)
                loss = _lm_loss(m(x), x) / 2
                grads = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
                (loss + 0.1 * sum(g.pow(2).sum() for g in grads)).backward()
                del grads
            opt.step()
            losses.append(loss.item())
        x = torch.randint(0, 256, (4, 32), generator=gen)
        torch.autograd.grad(_lm_loss(m(x), x), list(m.parameters()))  # the last call: no create_graph
        hook.remove()
        if vb_session() is not None:
            assert not _pinned_pages()
        return losses

    (ref_losses, ref_state), (losses, state), _ = _both(tmp_path, loop, paging_step_in_backward="off")
    assert losses == ref_losses
    assert_same(ref_state, state)
    whole = sum(p.numel() * 4 for p in model(dropout=0.0).parameters())
    assert resident_at_end[-1] < whole / 4, (resident_at_end[-1], whole)


def test_a_parameter_saved_by_reference_survives_paging_copying_its_storage(tmp_path):
    """A NumPy export makes paging give the tensor a new storage when it is evicted; a parameter
    saved by reference before that must still unpack (it raised "got new storage" before)."""
    def loop(m, opt):
        gen = torch.Generator().manual_seed(1)
        out = []
        w = m.blocks[0].mlp[0].weight
        for _ in range(3):
            opt.zero_grad()
            reg = w.pow(2).sum() * 1e-4  # saved by reference, before the forward
            x = torch.randint(0, 256, (4, 32), generator=gen)
            loss = _lm_loss(m(x), x) + reg
            loss.backward()
            opt.step()
            out += [loss.item(), float(w.detach().numpy().sum())]
        return out

    (ref_out, ref_state), (out, state), _ = _both(tmp_path, loop, paging_step_in_backward="off")
    assert out == ref_out
    assert_same(ref_state, state)


class _CheckpointedEncoder(torch.nn.Module):
    """``nn.TransformerEncoderLayer`` blocks, each run through a non-reentrant checkpoint: its
    ``nn.MultiheadAttention`` hands ``out_proj.weight`` and ``.bias`` to a function, and never
    calls ``out_proj`` itself."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(256, 64)
        self.layers = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
                                          for _ in range(2))
        self.head = torch.nn.Linear(64, 256)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
        return self.head(h)


@pytest.mark.parametrize("move", [True, False], ids=["moved", "adopted at its first forward"])
def test_a_checkpointed_block_using_a_childs_parameters_in_a_function_recomputes_them(tmp_path, move):
    """The recomputation inside backward runs without the fault handler and reaches parameters
    only through module hooks. ``out_proj``'s bias, used by the attention's forward but saved by
    no op, was evicted by then: "setStorage: ... out of bounds for storage of size 0" at the first
    backward. The attention unit now loads the pages its forward used outside their module. A
    model adopted inside its first forward learned nothing there (the root pre-hook, added during
    that call, did not run for it) and crashed the same way until 2026-11-28 (a probe's finding)."""
    (ref_losses, ref_state), (losses, state), report = _both(tmp_path, _lm_loop, move=move,
                                                             build=_CheckpointedEncoder, device_budget="64KB",
                                                             paging_step_in_backward="off")
    assert losses == ref_losses
    assert_same(ref_state, state)
    assert report["pager"]["bytes_in"] > 0


def _lm_loop(m, opt, on_phase=lambda phase: None):
    """Three next-byte training steps of ``m`` on random 4 x 16 batches; returns the losses.
    ``on_phase("forward" | "backward")`` is called as each phase begins."""
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        x = torch.randint(0, 256, (4, 16), generator=gen)
        on_phase("forward")
        loss = F.cross_entropy(m(x).reshape(-1, 256), x.roll(-1, 1).reshape(-1))
        on_phase("backward")
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class _Interruptible(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64) * 0.1)  # owned directly: a unit
        self.lin = torch.nn.Linear(64, 64)
        self.interrupt = False

    def forward(self, x):
        y = self.lin(x @ self.w)
        if self.interrupt:
            raise KeyboardInterrupt  # Ctrl-C: PyTorch skips the always-called forward hooks
        return y


def _paged_and_interrupted(tmp_path):
    """A three-layer model paged under the switch (on, for the caller to turn off), whose first
    forward a ``KeyboardInterrupt`` ended inside its middle unit; returns it and its input."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), _Interruptible(), torch.nn.Linear(64, 64))
    vb.enable("balanced", swap_dir=str(tmp_path), **{**FORCE, "device_budget": "64KB"}, compile="off")
    try:
        m.to("cpu")
        x = torch.randn(4, 64)
        m[1].interrupt = True
        try:
            m(x)
        except KeyboardInterrupt:
            pass
        m[1].interrupt = False
    except BaseException:
        vb.disable()
        raise
    return m, x


def test_an_interrupted_forward_leaves_no_pins_and_teaches_no_unit(tmp_path):
    """The units whose forward an interrupt ended kept their pages pinned (never evicted again),
    and a page used outside its module later was learned into such a unit no longer running.
    The next forward lets them go."""
    m, x = _paged_and_interrupted(tmp_path)
    try:
        assert _pinned_pages()  # the interrupted units' pins (a unit's forward hook never ran)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        (m(x).sum() + torch.nn.functional.linear(x, m[0].weight).sum()).backward()  # a use outside any unit
        opt.step()
        pinned = _pinned_pages()
        units = vb_session().paging.models[0].units
    finally:
        vb.disable()
    assert pinned == [], [pg.label for pg in pinned]
    assert all(len(u.pages) + len(u.learned) == len(list(u.module.parameters(recurse=False))) for u in units)


def test_an_interrupted_forward_does_not_leave_the_next_ones_counted_as_nested(tmp_path):
    """The root forward hook that lowers the forward depth never ran after an interrupt: every
    later forward counted as nested, so none began a pass (an unfinished backward's pins were never
    let go, nor an unclaimed step inside backward undone)."""
    m, x = _paged_and_interrupted(tmp_path)
    try:
        m(x).sum().backward()
        depth = vb_session().paging.forward_depth
    finally:
        vb.disable()
    assert depth == 0


class _Body(torch.nn.Module):
    """A non-root container that owns a parameter directly (a unit) and applies the embedding's
    weight as its output layer (tied, used outside ``wte``) after its child units ran."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(256, 64)
        self.wpe = torch.nn.Parameter(torch.randn(16, 64) * 0.02)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))

    def forward(self, idx):
        h = self.wte(idx) + self.wpe[: idx.shape[1]]
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return F.linear(h, self.wte.weight)


class _Tied(torch.nn.Module):
    def __init__(self, checkpointed=False):
        super().__init__()
        torch.manual_seed(0)
        self.body = _Body()
        self.checkpointed = checkpointed

    def forward(self, idx):
        if self.checkpointed:  # the recomputation in backward runs without the fault handler
            return torch.utils.checkpoint.checkpoint(self.body, idx, use_reentrant=False)
        return self.body(idx)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_a_container_unit_does_not_hold_a_page_it_uses_after_its_children(tmp_path, checkpointed):
    """A container that owns a parameter (``wpe``) is a unit; the tied weight it applies after
    its blocks is used outside ``wte``. It was learned into the container and pinned through its
    whole forward and backward, the blocks' included: level 0 held one page more than the plan
    said. Where the fault handler is on, the page is loaded where it is used instead; a
    recomputation in backward (checkpointing), which runs without the handler, still loads it
    with the container. Training stays bitwise."""
    held, phase = [], ["forward"]

    def loop(m, opt):
        return _lm_loop(m, opt, on_phase=lambda ph: phase.__setitem__(0, ph))

    def build():
        m = _Tied(checkpointed)
        last = m.body.blocks[-1]

        def tied_pinned(*_):
            if vb_session() is not None:
                pages = [pg for pg in vb_session().paging.pager.pages.values() if pg.label == "body.wte.weight"]
                held.append((phase[0], bool(pages and pages[0].pins)))

        last.register_forward_pre_hook(tied_pinned)
        last.weight.register_post_accumulate_grad_hook(tied_pinned)
        return m

    (ref_losses, ref_state), (losses, state), report = _both(tmp_path, loop, build=build, device_budget="64KB",
                                                             paging_step_in_backward="off", compile="off")
    assert losses == ref_losses
    assert_same(ref_state, state)
    assert report["pager"]["bytes_in"] > 0
    forward = [pinned for ph, pinned in held if ph == "forward"]
    assert len(forward) == 3 and not any(forward[1:]), held  # the first forward learns it
    if not checkpointed:  # (a recomputation loads it with the container: pinned through its backward)
        assert len(held) == 6 and not any(pinned for _, pinned in held[1:]), held
