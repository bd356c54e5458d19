"""Paging faults lose nothing (issue 16).

A full or read-only swap disk, an exceeded swap budget, a flipped bit, a missing file, a failure
inside ``optimizer.step``, a parameter frozen mid-run (tied ones too), a gradient edited between
backward and step, two processes (in two PID namespaces) on one swap dir, a swap dir with little
room: each is reproduced on the CPU with budgets of a few KB, ``paging="always"`` (or a plan that
keeps the parameters resident) and real swap files — on a real tmpfs where this machine lets the
test mount one, and through a fault-injecting file layer (patched ``os`` calls) everywhere.

The backbone is bitwise equality with plain PyTorch training: after a fault, the model's and the
optimizer's state are those of the last committed step (never a half-applied one), ``vb.disable()``
brings every tensor back — or raises a ``PagingRecoveryError`` naming exactly the tensors whose
bytes were lost, keeping their folder — and training goes on from there exactly as plain training.
"""
import errno
import io
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from apt_model.errors import ConfigError
from apt_model.memory import swap as swap_mod
from apt_model.memory.swap import (PagingRecoveryError, SwapCorruptionError, SwapError, SwapFullError, SwapSpace,
                                   clean_stale_folders)
from conftest import clean_env

FORCE = dict(paging="always", device_budget="16KB", attention="off", mixed_precision="off", banner=False)
#: over_budget with room for the parameters only: they stay resident, gradients and states are paged
KEPT = dict(paging="over_budget", device_budget="120KB", attention="off", mixed_precision="off", banner=False)
PLANS = {"all-paged": FORCE, "parameters-kept": KEPT}
#: the tests of a failure inside ``optimizer.step()`` need the step to run there, after backward
#: (a failure of the step taken inside backward: tests/test_backward_step.py)
AFTER = dict(paging_step_in_backward="off")


def mlp(seed=0, tied=False):
    """Four linear layers (8-16 KiB weights: with a 16 KB budget every weight is a chunk of its own)."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                            torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
    if tied:
        m[4].weight = m[2].weight
    return m


def adamw(m, cls=torch.optim.AdamW, **kw):
    return cls(m.parameters(), lr=1e-2, weight_decay=0.1, **kw)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)) for _ in range(n)]


def backward(m, batch):
    x, y = batch
    loss = F.mse_loss(m(x), y)
    loss.backward()
    return loss.item()


def one_step(m, opt, batch, zero_to_none=True):
    opt.zero_grad(set_to_none=zero_to_none)
    loss = backward(m, batch)
    opt.step()
    return loss


def snapshot(m, opt):
    """Copies of ``model.state_dict()`` and the optimizer's per-parameter state."""
    params = {k: v.detach().clone() for k, v in m.state_dict().items()}
    state = {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
             for i, st in opt.state_dict()["state"].items()}
    return params, state


def assert_same(a, b):
    pa, sa = a
    pb, sb = b
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    assert sa.keys() == sb.keys(), (sorted(sa), sorted(sb))
    for i in sa:
        assert sa[i].keys() == sb[i].keys(), i
        for k in sa[i]:
            assert torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k])), (i, k)


def plain_snapshots(n, opt_cls=torch.optim.AdamW, tied=False):
    """The plain-PyTorch run: ``snaps[k]`` is the state after ``k`` steps on :func:`batches`."""
    m = mlp(tied=tied)
    opt = adamw(m, opt_cls)
    snaps = [snapshot(m, opt)]
    for batch in batches(n):
        one_step(m, opt, batch)
        snaps.append(snapshot(m, opt))
    return snaps


def tensors_of(m, opt):
    out = [("param " + n, p) for n, p in m.named_parameters()]
    out += [("grad " + n, p.grad) for n, p in m.named_parameters() if p.grad is not None]
    for i, st in enumerate(opt.state.values()):
        out += [(f"state {i}.{k}", v) for k, v in st.items() if torch.is_tensor(v)]
    return out


def assert_no_empty_storage(m, opt):
    """No tensor of the training state is left with 0-byte storage (touching one would crash)."""
    for name, t in tensors_of(m, opt):
        with torch._C.DisableTorchFunction():
            assert t.untyped_storage().nbytes() >= t.numel() * t.element_size() > 0, name


def assert_saveable(m, opt, expected):
    """``torch.save`` of both state dicts loads back, equal to ``expected``."""
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    got = ({k: v for k, v in loaded["model"].items()},
           {i: dict(st) for i, st in loaded["opt"]["state"].items()})
    assert_same(got, expected)


def session():
    from apt_model.switch.controller import session as vb_session

    return vb_session().paging


def no_undo_warnings(caplog):
    return [r.getMessage() for r in caplog.records if "could not undo" in r.getMessage()]


# ------------------------------------------------------------------ the file layers
class Injected:
    """A fault-injecting file layer: the ``os`` calls of the swap level fail when armed.

    ``full``: writes fail with ENOSPC; ``read-only``: opening a swap file for writing fails with
    EROFS; ``eio``: the ``nth`` read from now on fails with EIO (once).
    """

    def __init__(self, monkeypatch, root):
        self.root = str(root)
        self.mode = None
        self.nth = 0
        real_open, real_pwrite, real_preadv = os.open, os.pwrite, os.preadv

        def fake_open(path, flags, *args, **kwargs):
            if (self.mode == "read-only" and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
                    and str(path).startswith(self.root)):
                raise OSError(errno.EROFS, "Read-only file system", str(path))
            return real_open(path, flags, *args, **kwargs)

        def fake_pwrite(fd, data, offset):
            if self.mode == "full":
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_pwrite(fd, data, offset)

        def fake_preadv(fd, buffers, offset, *args):
            if self.mode == "eio":
                self.nth -= 1
                if self.nth == 0:
                    self.mode = None
                    raise OSError(errno.EIO, "Input/output error")
            return real_preadv(fd, buffers, offset, *args)

        monkeypatch.setattr(swap_mod.os, "open", fake_open)
        monkeypatch.setattr(swap_mod.os, "pwrite", fake_pwrite)
        monkeypatch.setattr(swap_mod.os, "preadv", fake_preadv)

    def arm(self, mode, nth=1):
        self.mode, self.nth = mode, nth

    def disarm(self):
        self.mode = None


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(size) -> folder``: a real tmpfs of ``size`` (e.g. ``"256k"``), unmounted afterwards;
    the test is skipped where this machine does not let it mount one (not root, no mount)."""
    mounted = []

    def mount(size):
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a tmpfs needs root and mount(8)")
        d = tmp_path / f"tmpfs{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0777", "tmpfs", str(d)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(d)
        return d

    yield mount
    if mounted:
        vb.disable()  # the swap files go before their filesystem does
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def remount(folder, how):
    """Remount the test's tmpfs. ``ro`` fails with EBUSY while a file there is open for writing (a
    background page write in flight, the cause of this test's rare failures): the pager's writes are
    waited for first, and a busy remount is retried briefly."""
    if how == "ro" and vb.is_enabled() and session() is not None:
        session().pager.flush()
    for attempt in range(20):
        res = subprocess.run(["mount", "-o", f"remount,{how}", str(folder)], capture_output=True)
        if res.returncode == 0:
            return
        time.sleep(0.05)
    res.check_returncode()


# ------------------------------------------------------------------ 1. write faults, then disable()
@pytest.mark.parametrize("fault,layer", [
    ("full", "tmpfs"), ("full", "injected"), ("read-only", "tmpfs"), ("read-only", "injected"),
    ("budget", "swap budget"),
])
def test_a_write_fault_keeps_the_last_step_and_disable_brings_everything_back(fault, layer, tmp_path, monkeypatch,
                                                                             tmpfs, caplog):
    """SwapFullError (disk full, swap budget) or SwapError (read-only filesystem) mid-run: the
    state is that of the last committed step, both state dicts save and load, ``disable()``
    returns normally with every tensor in memory (no 0-byte storage), and training continues
    bitwise like plain training."""
    n = 8
    snaps = plain_snapshots(n + 2)
    data = batches(n + 2)
    root = tmpfs("256k" if fault == "full" else "16m") if layer == "tmpfs" else tmp_path
    files = Injected(monkeypatch, root) if layer == "injected" else None
    m = mlp()
    opt = adamw(m)
    vb.enable("balanced", swap_dir=str(root), **FORCE)
    m.to("cpu")
    done, err = 0, None
    for i in range(n):
        if i == 2:  # two good steps, then the fault
            if files is not None:
                files.arm(fault)
            elif fault == "read-only":
                remount(root, "ro")
            elif fault == "budget":
                swap = session().swap
                swap.budget = swap.bytes_on_disk + 4096
        try:
            one_step(m, opt, data[i])
            done += 1
        except SwapError as e:
            err = e
            break
    assert err is not None, "the fault never happened"
    assert isinstance(err, SwapFullError) == (fault in ("full", "budget")), err
    assert "evict" not in str(err)
    caplog.set_level(logging.WARNING)
    assert_same(snapshot(m, opt), snaps[done])  # the last committed step, not a half-applied one
    assert_saveable(m, opt, snaps[done])
    vb.disable()  # nothing was lost: no error
    assert not vb.is_enabled() and not no_undo_warnings(caplog)
    assert_no_empty_storage(m, opt)
    assert_same(snapshot(m, opt), snaps[done])
    assert_saveable(m, opt, snaps[done])
    if files is not None:
        files.disarm()
    elif fault == "read-only":
        remount(root, "rw")
    for i in range(done, done + 2):  # plain training goes on exactly where the paged one stopped
        one_step(m, opt, data[i])
    assert_same(snapshot(m, opt), snaps[done + 2])


# ------------------------------------------------------------------ 1. lost bytes: named, kept, never deleted
@pytest.mark.parametrize("what", ["param", "state", "missing"])
def test_a_corrupt_or_missing_file_loses_that_tensor_only_and_disable_names_it(what, tmp_path, caplog):
    """One flipped bit in one swap file (a weight's, or an Adam state's), or a deleted file: the
    error names the tensor and the file; the step is not applied; the other state dict still
    saves; ``disable()`` brings every other tensor back and raises PagingRecoveryError listing
    exactly that tensor, which holds NaN (not 0-byte storage); its folder and file are kept, with
    a RECOVERY.txt, and no later stale-folder cleanup removes them."""
    snaps = plain_snapshots(3)
    data = batches(3)
    m = mlp()
    opt = adamw(m)
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    m.to("cpu")
    for i in range(2):
        one_step(m, opt, data[i])
    s = session()
    s.pager.flush()
    w = m[4].weight
    page = s.optimizers.state_pages[(id(opt), id(w))]["exp_avg"] if what == "state" else s.param_pages[id(w)]
    assert page.state.value == "lower"
    path = s.swap.record(page.key).path
    if what == "missing":
        path.unlink()
    else:
        raw = bytearray(path.read_bytes())
        raw[100] ^= 0x04  # one bit
        path.write_bytes(bytes(raw))
    with pytest.raises(SwapCorruptionError) as info:
        one_step(m, opt, data[2])
    assert page.label in str(info.value) and str(path) in str(info.value)
    params, states = snaps[2]
    if what == "state":  # found inside the step: the chunks before it were rolled back
        assert_same((params_of(m), {}), (params, {}))
        with pytest.raises(SwapCorruptionError, match=page.label):
            opt.state_dict()
    else:  # found in the forward: the step never ran
        with pytest.raises(SwapCorruptionError, match=page.label):
            m.state_dict()
        assert_same(({}, snapshot_states(opt)), ({}, states))
    caplog.set_level(logging.WARNING)
    with pytest.raises(PagingRecoveryError) as rec:
        vb.disable()
    assert not vb.is_enabled() and not no_undo_warnings(caplog)
    assert set(rec.value.lost) == {page.label} and page.label in str(rec.value)
    assert_no_empty_storage(m, opt)
    lost = opt.state[w]["exp_avg"] if what == "state" else w
    assert torch.isnan(lost).all()
    got_params, got_states = snapshot(m, opt)
    for k, v in params.items():
        if what == "state" or k != "4.weight":
            assert torch.equal(got_params[k], v), k
    for i, st in states.items():
        for k, v in st.items():
            if not (what == "state" and i == 4 and k == "exp_avg"):
                assert torch.equal(torch.as_tensor(got_states[i][k]), torch.as_tensor(v)), (i, k)
    folder = rec.value.folder
    assert folder.is_dir() and page.label in (folder / "RECOVERY.txt").read_text()
    assert path.exists() == (what != "missing")  # the only copy of those bytes is never deleted
    again = SwapSpace(tmp_path)  # a later process's cleanup leaves a folder kept for inspection alone
    assert folder.is_dir() and folder not in again.stale_removed
    again.close()
    shutil.rmtree(folder)


def params_of(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def snapshot_states(opt):
    return {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
            for i, st in opt.state_dict()["state"].items()}


# ------------------------------------------------------------------ 2. a failure inside optimizer.step
class FailingAdamW(torch.optim.AdamW):
    """AdamW whose ``fail_on``-th step call raises — before updating, or after updating its
    parameters (``after``). The paging session calls the step once per chunk; ``vb_per_parameter``
    tells it the overridden step still updates each parameter alone."""

    vb_per_parameter = True

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.calls = 0
        self.fail_on = None
        self.after = False

    def step(self, closure=None):
        self.calls += 1
        if self.calls == self.fail_on and not self.after:
            raise RuntimeError("injected failure inside optimizer.step")
        out = super().step(closure)
        if self.calls == self.fail_on and self.after:
            raise RuntimeError("injected failure inside optimizer.step (after updating)")
        return out


@pytest.mark.parametrize("plan", ["all-paged", "parameters-kept"])
@pytest.mark.parametrize("after", [False, True], ids=["raises-before-its-update", "raises-after-its-update"])
@pytest.mark.parametrize("first", [False, True], ids=["third-step", "first-step"])
def test_a_failure_inside_optimizer_step_applies_nothing_and_a_retry_steps_once(plan, after, first, tmp_path):
    """The third chunk of a step raises (the chunks before it were applied, the third one too
    when it raises after its update): the step is rolled back completely — parameters, Adam's
    m, v and step counts, and on a first step the states it created — so the state is bitwise
    the last committed one, and retrying the step gives exactly one step."""
    snaps = plain_snapshots(5)
    data = batches(5)
    m = mlp()
    opt = adamw(m, FailingAdamW)
    vb.enable("balanced", swap_dir=str(tmp_path), **PLANS[plan], **AFTER)
    m.to("cpu")
    paging = vb.get_report()["models"][0]["features"]["paging"]
    assert paging["chosen"] == "paged"
    assert paging["plan"]["kept"] == (["parameters"] if plan == "parameters-kept" else [])
    k = 0 if first else 2
    for i in range(k):
        one_step(m, opt, data[i])
    opt.zero_grad()
    backward(m, data[k])
    opt.fail_on, opt.after = opt.calls + 3, after
    with pytest.raises(RuntimeError, match="injected failure"):
        opt.step()
    assert opt.calls >= 3  # it did fail in the third chunk, after two chunks were applied
    assert_same(snapshot(m, opt), snaps[k])
    opt.fail_on = None
    opt.step()  # the retry: the gradients are still there
    assert_same(snapshot(m, opt), snaps[k + 1])
    one_step(m, opt, data[k + 1])
    assert_same(snapshot(m, opt), snaps[k + 2])
    vb.disable()
    assert_no_empty_storage(m, opt)
    assert_same(snapshot(m, opt), snaps[k + 2])


def three_level_session(tmp_path, host_budget):
    """A paging session below a stand-in accelerator (the CPU): a 16 KB device budget, a pinned
    host level of ``host_budget`` bytes, the disk below it, the step after backward."""
    from apt_model.memory.paging.session import PagingSession
    from apt_model.base.patches import PatchSet

    patches = PatchSet()
    s = PagingSession(16_000, SwapSpace(tmp_path), patches, device="cpu", host_budget=host_budget, host_level=True,
                      step_in_backward="off")
    return s, patches


@pytest.mark.parametrize("host_budget", [8 * 2**20, 20 * 1024], ids=["host-holds-all", "host-spills-to-disk"])
def test_the_three_level_path_rolls_a_failed_step_back(host_budget, tmp_path):
    """Below an accelerator (the CPU standing in for the device) the pre-step copies live in the
    pinned host level, or on disk once it spills: a step failing in its third chunk is rolled back
    there too, and the retry steps once."""

    snaps = plain_snapshots(3)
    data = batches(3)
    m = mlp()
    opt = adamw(m, FailingAdamW)
    s, patches = three_level_session(tmp_path, host_budget)
    try:
        s.page_model(m, page_params=True, page_grads=True)
        for i in range(2):
            one_step(m, opt, data[i])
        opt.zero_grad()
        backward(m, data[2])
        opt.fail_on, opt.after = opt.calls + 3, True
        with pytest.raises(RuntimeError, match="injected failure"):
            opt.step()
        assert_same(snapshot(m, opt), snaps[2])
        opt.fail_on = None
        opt.step()
        assert_same(snapshot(m, opt), snaps[3])
        spilled = s.pager.store.spills
    finally:
        patches.restore_all()
    assert (spilled > 0) == (host_budget < 2**20)
    assert_no_empty_storage(m, opt)
    assert_same(snapshot(m, opt), snaps[3])


@pytest.mark.parametrize("edit", [None, "in-place", "data-in-place", "data-set"])
def test_resident_parameters_are_copied_for_the_step_during_backward_and_still_rolled_back(edit, tmp_path):
    """Parameters kept on the (stand-in) device, gradients and states paged to the host level: from
    the second step on, the parameters' pre-step copies are written while backward runs, so the step
    itself writes only the states. A step failing in its third chunk is still rolled back bitwise —
    also when a weight was edited between backward and ``step()``, after its copy began, in ways
    that bump its version counter (``mul_`` under ``no_grad``) or not (``p.data.mul_``,
    ``p.data = x``) — and training goes on bitwise like plain PyTorch."""

    def edit_weight(m):
        w = m[2].weight
        if edit == "in-place":
            with torch.no_grad():
                w.mul_(0.5)
        elif edit == "data-in-place":
            w.data.mul_(0.5)
        elif edit == "data-set":
            w.data = w.data * 0.5

    data = batches(4)
    ref_m = mlp()
    ref_opt = adamw(ref_m)
    for i in range(2):
        one_step(ref_m, ref_opt, data[i])
    ref_opt.zero_grad()
    backward(ref_m, data[2])
    edit_weight(ref_m)
    before = snapshot(ref_m, ref_opt)
    ref_opt.step()
    one_step(ref_m, ref_opt, data[3])
    after = snapshot(ref_m, ref_opt)

    m = mlp()
    opt = adamw(m, FailingAdamW)
    p_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    s, patches = three_level_session(tmp_path, 8 * 2**20)
    try:
        s.page_model(m, page_params=False, page_grads=True)
        for i in range(2):
            one_step(m, opt, data[i])
        opt.zero_grad()
        written = s.pager.store.stats()["bytes_in"]
        backward(m, data[2])
        in_backward = s.pager.store.stats()["bytes_in"] - written
        edit_weight(m)
        opt.fail_on, opt.after = opt.calls + 3, True
        with pytest.raises(RuntimeError, match="injected failure"):
            opt.step()
        assert_same(snapshot(m, opt), before)
        opt.fail_on = None
        opt.step()
        opt.zero_grad()
        written, kinds0 = s.pager.store.stats()["bytes_in"], s.pager.store.stats()["bytes_in_by_kind"]
        backward(m, data[3])
        mid, kinds1 = s.pager.store.stats()["bytes_in"], s.pager.store.stats()["bytes_in_by_kind"]
        opt.step()
        in_step, kinds2 = s.pager.store.stats()["bytes_in"] - mid, s.pager.store.stats()["bytes_in_by_kind"]
        in_backward_again = mid - written
    finally:
        patches.restore_all()
    assert_same(snapshot(m, opt), after)
    assert in_backward == in_backward_again == 2 * p_bytes  # each gradient, and each parameter's pre-step copy
    assert in_step == 2 * p_bytes  # AdamW's m and v written back; no parameter copy left for the step
    # the same bytes by what they are (the split that tells where a step's traffic goes)
    delta = lambda a, b: {k: b.get(k, 0) - a.get(k, 0) for k in b if b.get(k, 0) != a.get(k, 0)}  # noqa: E731
    assert delta(kinds0, kinds1) == {"grad": p_bytes, "pre-step copy": p_bytes}
    assert delta(kinds1, kinds2) == {"state": 2 * p_bytes}
    assert sum(kinds2.values()) == s.pager.store.stats()["bytes_in"]


def test_early_copies_no_step_takes_are_let_go(tmp_path):
    """An optimizer over every parameter steps twice, then one over the last layer only takes over
    while every parameter still gets a gradient: the other parameters' pre-step copies, begun in
    backward, are let go at the next backward and not begun again — the host level ends as it
    does when the last layer's optimizer is used from the start — and training is plain PyTorch's."""
    def run(switch, folder):
        data = batches(8)
        m = mlp()
        folder.mkdir()
        s, patches = three_level_session(folder, 8 * 2**20)
        try:
            s.page_model(m, page_params=False, page_grads=True)
            if switch:
                opt = adamw(m)
                for i in range(2):
                    one_step(m, opt, data[i])
                del opt
            head = torch.optim.AdamW(m[6].parameters(), lr=1e-2)
            for i in range(2 if switch else 0, 8):
                one_step(m, head, data[i])
            resident = s.pager.store.stats()["resident_bytes"]
        finally:
            patches.restore_all()
        return m, resident

    ref = mlp()
    opt = adamw(ref)
    data = batches(8)
    for i in range(2):
        one_step(ref, opt, data[i])
    head = torch.optim.AdamW(ref[6].parameters(), lr=1e-2)
    for i in range(2, 8):
        one_step(ref, head, data[i])
    m, resident = run(True, tmp_path / "a")
    _, resident_head_only = run(False, tmp_path / "b")
    for a, b in zip(m.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert resident == resident_head_only


@pytest.mark.parametrize("plan", ["all-paged", "parameters-kept"])
def test_a_read_error_inside_the_step_rolls_it_back(plan, tmp_path, monkeypatch):
    """An EIO on the fourth swap read of a step (a later chunk's state): SwapError naming the
    tensor, the step rolled back bitwise, and the retry gives exactly one step."""
    snaps = plain_snapshots(4)
    data = batches(4)
    files = Injected(monkeypatch, tmp_path)
    m = mlp()
    opt = adamw(m)
    vb.enable("balanced", swap_dir=str(tmp_path), **PLANS[plan], **AFTER)
    m.to("cpu")
    for i in range(2):
        one_step(m, opt, data[i])
    opt.zero_grad()
    backward(m, data[2])
    session().pager.flush()
    files.arm("eio", nth=4)
    with pytest.raises(SwapError, match="Input/output error") as info:
        opt.step()
    assert any(label in str(info.value) for label in session().labels.values())
    files.disarm()
    assert_same(snapshot(m, opt), snaps[2])
    opt.step()
    assert_same(snapshot(m, opt), snaps[3])
    one_step(m, opt, data[3])
    vb.disable()
    assert_no_empty_storage(m, opt)
    assert_same(snapshot(m, opt), snaps[4])


def test_a_full_disk_inside_the_step_rolls_it_back(tmp_path, monkeypatch):
    """The step's own write-behind fails (ENOSPC) — with a budget so small the step must wait
    for its writes: SwapFullError, nothing applied, and the retry on a disk with room steps once."""
    snaps = plain_snapshots(4)
    data = batches(4)
    files = Injected(monkeypatch, tmp_path)
    m = mlp()
    opt = adamw(m)
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE, **AFTER)
    m.to("cpu")
    for i in range(2):
        one_step(m, opt, data[i])
    opt.zero_grad()
    backward(m, data[2])
    session().pager.flush()
    files.arm("full")
    with pytest.raises(SwapFullError):
        opt.step()
    files.disarm()
    assert_same(snapshot(m, opt), snaps[2])
    opt.step()
    assert_same(snapshot(m, opt), snaps[3])
    vb.disable()
    assert_no_empty_storage(m, opt)


# ------------------------------------------------------------------ 3 and 4. what PyTorch allows between two calls
def _scale(factor):
    def edit(m, step):
        for p in m.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)
    return edit


def _div(m, step):
    for p in m.parameters():
        if p.grad is not None:
            p.grad.div_(2.0)


def _nan_to_num(m, step):
    for p in m.parameters():
        if p.grad is not None:
            p.grad[0] = float("nan")  # an overflowed entry, as mixed precision would see
            p.grad.nan_to_num_(0.0)


def _replace(m, step):
    for p in m.parameters():
        if p.grad is not None:
            p.grad = p.grad * 0.5  # manual unscaling


HELD = []


def _replace_keep_old(m, step):
    HELD.clear()
    for p in m.parameters():
        if p.grad is not None:
            HELD.append((p.grad, p.grad.detach().clone()))  # the user keeps the old gradient
            p.grad = p.grad.clone() * 0.5


def _noise(m, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in m.parameters():
        if p.grad is not None:
            p.grad.add_(torch.randn(p.grad.shape, generator=g) * 1e-3)  # gradient noise


def _replace_then_clip(m, step):
    _replace(m, step)
    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)  # after the replacement: the new gradients' norm


def _freeze(layers, at=2, until=None):
    def edit(m, step):
        if step == at:
            for i in layers:
                m[i].requires_grad_(False)
        if step == until:
            for i in layers:
                m[i].requires_grad_(True)
    edit.before_backward = True
    return edit


EDITS = {
    "grad.mul_": _scale(0.5), "grad.div_": _div, "grad.nan_to_num_": _nan_to_num, "p.grad = p.grad * 0.5": _replace,
    "replace, old grad kept": _replace_keep_old, "gradient noise": _noise, "replace, then clip": _replace_then_clip,
    "freeze a layer": _freeze([2]), "freeze a block": _freeze([0, 2]), "freeze a tied weight": _freeze([4]),
    "freeze, then unfreeze": _freeze([2], at=2, until=5),
    "unfreeze a layer frozen at adoption": _freeze([4], at=-1, until=3),
}


def _run(m, opt, data, edit, zero_to_none):
    losses = []
    for step, batch in enumerate(data):
        if getattr(edit, "before_backward", False):
            edit(m, step)
        opt.zero_grad(set_to_none=zero_to_none)
        losses.append(backward(m, batch))
        if not getattr(edit, "before_backward", False):
            edit(m, step)
        opt.step()
    return losses


def _paged_run_matches_plain(name, plan, zero_to_none, swap_dir, caplog):
    edit = EDITS[name]
    tied = "tied" in name
    data = batches(7)
    ref_m = mlp(tied=tied)
    if name.startswith("unfreeze"):
        ref_m[4].requires_grad_(False)
    ref_opt = adamw(ref_m)
    ref = _run(ref_m, ref_opt, data, edit, zero_to_none)
    expected = snapshot(ref_m, ref_opt)

    m = mlp(tied=tied)
    if name.startswith("unfreeze"):
        m[4].requires_grad_(False)
    opt = adamw(m)
    vb.enable("balanced", swap_dir=str(swap_dir), **PLANS[plan])
    m.to("cpu")
    assert vb.get_report()["models"][0]["features"]["paging"]["chosen"] == "paged"
    got = _run(m, opt, data, edit, zero_to_none)
    assert got == ref
    assert_same(snapshot(m, opt), expected)
    caplog.clear()
    vb.disable()
    assert not no_undo_warnings(caplog)
    assert_no_empty_storage(m, opt)
    assert_same(snapshot(m, opt), expected)
    assert_saveable(m, opt, expected)
    for old, value in HELD:  # a gradient the user kept after replacing it still has its bytes
        assert torch.equal(old, value)
    HELD.clear()


def _combinations(name, half):
    """Half the (plan, zero_grad mode) pairs for each edit, the other half in the slow test: every
    pair is met by half the edits in the default suite (the suite's 15 minutes on 2 cores)."""
    first = list(EDITS).index(name) % 2 == 0
    pairs = [(plan, (i % 2 == 0) == first) for i, plan in enumerate(PLANS)]
    if half == "other":
        pairs = [(plan, not zero) for plan, zero in pairs]
    return pairs


#: edits another one stands for in the default suite (slow: the suite's 15 minutes on 2 cores):
#: grad.div_ and grad.nan_to_num_ as grad.mul_ (an in-place op on the gradient), freezing a block
#: as freezing a layer, replacing with the old gradient kept as replacing
SLOW_EDITS = {"grad.div_", "grad.nan_to_num_", "freeze a block", "replace, old grad kept"}


@pytest.mark.parametrize("half", ["one", pytest.param("other", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_EDITS else n for n in EDITS])
def test_freezing_and_gradient_edits_train_bitwise_like_plain_pytorch(name, half, tmp_path, caplog):
    """Frozen and unfrozen parameters (a layer, a block, a tied weight, one frozen before adoption)
    and gradients edited or replaced between backward and step train bitwise like plain PyTorch —
    with every parameter paged and with the parameters kept resident, after
    ``zero_grad(set_to_none=True)`` and ``zero_grad(set_to_none=False)`` — and ``disable()`` then
    restores every tensor, with nothing logged and nothing left at 0 bytes."""
    caplog.set_level(logging.WARNING)
    for plan, zero_to_none in _combinations(name, half):
        try:
            _paged_run_matches_plain(name, plan, zero_to_none, tmp_path, caplog)
        except AssertionError as err:
            raise AssertionError(f"{plan}, zero_grad(set_to_none={zero_to_none}): {err}") from err


def test_a_gradient_dropped_while_its_write_is_in_flight_is_written_intact(tmp_path):
    """``zero_grad(set_to_none=True)`` while a gradient's write-behind is still running: the I/O
    job holds the storage it writes, so it never reads freed (or reused, or unmapped) memory — in
    a fresh process, because reading unmapped memory would kill it."""
    from conftest import run_python

    code = textwrap.dedent(f"""
        import os, time, torch
        from apt_model.memory import swap as swap_mod
        from apt_model.memory.io_engine import IOEngine
        from apt_model.memory.pages import Category, Page
        from apt_model.memory.stores import DiskStore
        from apt_model.memory.swap import SwapSpace

        real = os.pwrite
        def slow(fd, data, off):
            time.sleep(0.3)
            return real(fd, data, off)

        space = SwapSpace({str(tmp_path)!r})
        store = DiskStore(space, IOEngine())
        g = torch.full((16 << 20,), 3.0)  # 64 MiB: its memory is unmapped when freed
        page = Page(Category.GRAD, lambda: None, g.untyped_storage().nbytes(), "w:grad")
        swap_mod.os.pwrite = slow
        fut = store.start_write(page, g.untyped_storage())
        del g  # the user dropped the gradient while it is being written
        junk = [torch.full((16 << 20,), 7.0) for _ in range(2)]  # the allocator hands the memory out again
        fut.result()
        swap_mod.os.pwrite = real
        out = torch.empty(16 << 20)
        space.read_into(page.key, memoryview(out.numpy()).cast("B"))
        print("INTACT" if bool((out == 3.0).all()) else "WRONG")
        store.close()
    """)
    proc = run_python(code, timeout=120)
    assert proc.returncode == 0 and "INTACT" in proc.stdout, (proc.returncode, proc.stdout, proc.stderr[-2000:])


# ------------------------------------------------------------------ 5. two PID namespaces, one swap dir
def test_a_live_folder_is_kept_when_its_owners_pid_looks_dead_from_here(tmp_path, monkeypatch):
    """From another PID namespace the owner's PID is meaningless (gone, or another process):
    simulated by making every PID look dead and every start time differ. The owner's lock decides:
    its live folder is kept and still works; a folder whose owner really died is removed."""
    owner = SwapSpace(tmp_path)
    owner.write("pg1", memoryview(b"x" * 5000))
    code = textwrap.dedent(f"""
        import os, signal
        from apt_model.memory.swap import SwapSpace
        s = SwapSpace({str(tmp_path)!r})
        print("FOLDER", s.folder, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=120)
    dead = proc.stdout.split("FOLDER ", 1)[1].strip()
    monkeypatch.setattr(swap_mod.psutil, "pid_exists", lambda pid: False)
    monkeypatch.setattr(swap_mod, "_process_start", lambda pid: None)
    removed = clean_stale_folders(tmp_path)
    assert owner.folder.is_dir() and owner.folder not in removed
    assert [str(p) for p in removed] == [dead] and not os.path.exists(dead)
    out = bytearray(5000)
    owner.read_into("pg1", memoryview(out))
    assert bytes(out) == b"x" * 5000
    owner.close()
    assert not owner.folder.exists()


def test_without_flock_the_owner_marker_decides(tmp_path, monkeypatch):
    """On a filesystem without flock the ``.owner`` marker decides: an owner in another PID
    namespace of the same boot is kept (its PID means nothing here), one from before a reboot or
    a dead process of this namespace is removed."""
    import json

    monkeypatch.setattr(swap_mod, "_try_lock", lambda fd: None)
    me = swap_mod.owner_identity()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cases = {"other-namespace": dict(me, pid_ns="pid:[1]", pid=dead.pid),
             "other-boot": dict(me, boot_id="00000000-0000-0000-0000-000000000000"),
             "dead-here": dict(me, pid=dead.pid)}
    folders = {}
    for name, owner in cases.items():
        f = tmp_path / f"vb-{owner['pid']}-{len(folders)}-abcd000{len(folders)}"
        f.mkdir()
        (f / swap_mod.OWNER_FILE).write_text(json.dumps(owner))
        folders[name] = f
    removed = clean_stale_folders(tmp_path)
    assert folders["other-namespace"].is_dir()
    assert sorted(removed) == sorted([folders["other-boot"], folders["dead-here"]])


def _unshare_works():
    return (os.geteuid() == 0 and shutil.which("unshare") is not None
            and subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"], capture_output=True).returncode == 0)


@pytest.mark.slow  # a PID namespace: 4 s, and root only
@pytest.mark.skipif(not _unshare_works(), reason="needs root and unshare(1) to create a PID namespace")
def test_a_process_in_another_pid_namespace_keeps_its_folder(tmp_path):
    """Real containers: the owner runs in its own PID namespace (its PID there is 1, which here
    is init with another start time); this process opens the same swap dir and must not remove
    the owner's live folder; the owner then reads its page back."""
    code = textwrap.dedent(f"""
        import os, sys
        from apt_model.memory.swap import SwapSpace
        s = SwapSpace({str(tmp_path)!r})
        s.write("pg2", memoryview(b"y" * 8192))
        print("FOLDER", os.getpid(), s.folder, flush=True)
        sys.stdin.readline()  # the other process opens the swap dir meanwhile
        out = bytearray(8192)
        s.read_into("pg2", memoryview(out))
        print("READ", bytes(out) == b"y" * 8192, flush=True)
        s.close()
    """)
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.Popen(["unshare", "-p", "-f", "--mount-proc", sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("FOLDER"), (line, proc.stderr.read() if proc.poll() is not None else "")
        _, pid, folder = line.split()
        assert int(pid) == 1  # its PID in its namespace: here, that is init
        other = SwapSpace(tmp_path)
        assert os.path.isdir(folder) and not other.stale_removed
        other.close()
        out, err = proc.communicate("go\n", timeout=120)
        assert "READ True" in out, err
    finally:
        if proc.poll() is None:
            proc.kill()


# ------------------------------------------------------------------ 6. a swap dir with little room
@pytest.mark.parametrize("layer", ["tmpfs", "injected"])
def test_a_small_swap_dir_gets_a_small_probe_and_paging_works(layer, tmp_path, monkeypatch, tmpfs):
    """A swap folder with less than the probe's 64 MiB free: the bandwidth probe shrinks to half
    the free room and says its figure is rough; ``model.to()`` pages and training is bitwise plain."""
    from apt_model.memory import bandwidth

    if layer == "tmpfs":
        root = tmpfs("12m")
    else:
        root = tmp_path
        monkeypatch.setattr(SwapSpace, "free_bytes", lambda self: 12 << 20)
    monkeypatch.setattr(bandwidth, "_cache", {})
    snaps = plain_snapshots(3)
    m = mlp()
    opt = adamw(m)
    vb.enable("balanced", swap_dir=str(root), **FORCE)
    m.to("cpu")
    from apt_model.switch.controller import session as vb_session

    bw = vb_session().stack.bandwidths
    assert bw["disk"] is not None and bw["disk_probe"]["probe_bytes"] <= 6 << 20
    assert "rough" in bw["disk_probe"]["note"] and "rough" in str(vb_session().stack)
    for batch in batches(3):
        one_step(m, opt, batch)
    assert_same(snapshot(m, opt), snaps[3])
    vb.disable()
    assert_same(snapshot(m, opt), snaps[3])


def test_no_room_for_a_probe_skips_it_and_says_so(tmp_path, monkeypatch):
    """With less room than the smallest probe, the disk is not measured (no figure, a note that
    says why) and adoption goes on; the message says what was being done, not "evicting"."""
    from apt_model.memory import bandwidth

    monkeypatch.setattr(bandwidth, "_cache", {})
    monkeypatch.setattr(SwapSpace, "free_bytes", lambda self: 300 * 1024)
    m = mlp()
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE)
    m.to("cpu")
    from apt_model.switch.controller import session as vb_session

    bw = vb_session().stack.bandwidths
    assert bw["disk"] is None and "not measured" in bw["disk_probe"]["note"] and "probe" in bw["disk_probe"]["note"]
    assert "evict" not in bw["disk_probe"]["note"]
    assert vb.get_report()["models"][0]["features"]["paging"]["chosen"] == "paged"


def test_a_full_disk_under_the_probe_names_the_probe(tmp_path, monkeypatch):
    """A disk that fills under the probe (the free figure was optimistic): the error is the
    probe's — "the disk bandwidth probe could not write" — never "evicting"."""
    from apt_model.memory.bandwidth import measure_disk

    real = os.pwrite

    def full(fd, data, off):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(swap_mod.os, "pwrite", full)
    with pytest.raises(SwapFullError) as info:
        measure_disk(tmp_path, mb=1)
    monkeypatch.setattr(swap_mod.os, "pwrite", real)
    assert "bandwidth probe could not write" in str(info.value) and "evict" not in str(info.value)


def test_a_model_the_levels_cannot_hold_is_refused_before_anything_is_paged(tmp_path, cpu_device):
    """A swap_budget below what the paged parameters and gradients need: the model was refused
    halfway through being paged (SwapFullError while its parameters were written out) and left
    half-paged with the switch on - state_dict() and every later call raised again (a probe's
    finding). It is refused up front now, naming the room and the swap_budget to set; nothing is
    paged, so the model stays readable and usable."""
    torch.manual_seed(0)
    nn = torch.nn
    m = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    vb.enable("balanced", swap_dir=str(tmp_path), paging="always", device_budget="64KB", swap_budget="1KB",
              mixed_precision="off", compile="off", banner=False)
    try:
        with pytest.raises(ConfigError) as info:
            m.to("cpu")
        text = str(info.value)
        assert "cannot be paged" in text and "swap_budget 1000B" in text and "raise swap_budget" in text, text
        feat = vb.get_report()["models"][0]["features"]["paging"]
        assert feat["chosen"] == "refused" and "cannot be paged" in feat["reason"]
        sd = m.state_dict()  # readable: nothing was paged
        assert all(torch.equal(sd[n], before[n]) for n in before)
        m(torch.randn(2, 64)).sum().backward()  # and trains, unpaged
        assert all(p.grad is not None for p in m.parameters())
    finally:
        vb.disable()
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n]), n


# ------------------------------------------------------------------ 7. input gaps of the memory stack
def test_sizes_are_whole_bytes_and_everything_else_is_refused():
    """A size is a whole number of bytes >= 1: fractions of a byte (``device_budget=3.5`` used to be
    3 bytes), NaN and infinities (a raw ValueError before) are ConfigErrors naming the value and
    the accepted forms; whole sizes written with fractions of a unit still parse."""
    from apt_model.base.sizes import parse_size

    for value, message in [("3.5", "not a whole number of bytes"), (3.5, "not a whole number of bytes"),
                           ("0.5B", "not a whole number"), ("1.1KiB", "1126.4 bytes"),
                           ("1.2GiB", r"1288490188.8 bytes, not a whole number of bytes \(1288490188 would be\)"), (float("nan"), "is not a size"),
                           (float("inf"), "is not a size"), (0, "at least 1 byte"), (True, "is not a size"),
                           ("lots", "is not a size"), ("\u0661\u0666MB", "is not a size")]:  # Arabic-Indic "16"
        with pytest.raises(ConfigError, match=message) as info:
            parse_size(value, "device_budget")
        assert "device_budget=" in str(info.value) and "512MB" in str(info.value), value
    assert parse_size("1.5KiB") == 1536 and parse_size("1.5GB") == 1_500_000_000 and parse_size(4096.0) == 4096
    assert parse_size("512MB") == 512_000_000 and parse_size(" 4 GiB ") == 4 << 30


def test_budgets_above_the_machine_are_a_warning_naming_capacity_and_consequence(tmp_path, monkeypatch, caplog):
    import psutil

    from apt_model.memory.levels import VGPUStack

    monkeypatch.setenv("VB_DEVICE_BUDGET", "1TB")
    caplog.set_level(logging.WARNING)
    stack = VGPUStack("cpu", swap_dir=str(tmp_path), swap_budget="1000TB", measure=False)
    try:
        ram = psutil.virtual_memory().total
        assert ram < 10**12
        text = " ".join(stack.warnings)
        assert "device_budget 1000000000000 bytes" in text and "exceeds this machine's RAM" in text
        assert "never paged" in text and "swap_budget" in text and "SwapFullError" in text
        assert any("exceeds this machine's RAM" in r.getMessage() for r in caplog.records)
    finally:
        stack.close()
    quiet = VGPUStack("cpu", device_budget="1MB", swap_dir=str(tmp_path), measure=False)
    assert quiet.warnings == []
    quiet.close()


# ------------------------------------------------------------------ the undo stack raises what it must
def test_a_critical_undo_failure_is_raised_after_everything_else_is_undone():
    from apt_model.base.patches import PatchSet

    done = []
    ps = PatchSet()
    ps.add_undo(lambda: done.append("first"), "first")
    ps.add_undo(lambda: (_ for _ in ()).throw(ValueError("minor")), "minor")

    def critical():
        done.append("critical")
        raise PagingRecoveryError("lost pg1", lost={"w": "gone"})

    ps.add_undo(critical, "paging session", critical=True)
    ps.add_undo(lambda: done.append("last"), "last")
    with pytest.raises(PagingRecoveryError) as info:
        ps.restore_all()
    assert done == ["last", "critical", "first"] and len(ps) == 0
    assert info.value.undo_failures == ["minor: ValueError: minor"]


def test_an_attribute_the_script_replaced_after_a_patch_is_left_by_its_undo():
    """accelerate's add_hook_to_module after adoption sets the block's forward over the switch's
    checkpoint wrapper: disable() deleted the script's hook (a review probe's finding)."""
    from apt_model.base.patches import PatchSet

    class Box:
        pass

    box, kept = Box(), Box()
    ps = PatchSet()
    ps.set_attr(box, "forward", "switch's", label="wrapper")
    ps.set_attr(kept, "forward", "switch's", label="wrapper")
    box.forward = "script's"
    ps.restore_all()
    assert box.forward == "script's" and not hasattr(kept, "forward")


def test_restore_since_undoes_only_what_came_after_the_mark():
    from apt_model.base.patches import PatchSet

    class Box:
        pass

    box, done, gone = Box(), [], Box()
    ps = PatchSet()
    ps.add_undo(lambda: done.append("older"), "older")
    ps.add_undo(lambda: done.append("pruned"), "of a dropped object", owner=gone)
    mark = ps.mark()
    ps.set_attr(box, "flag", 1, label="flag")
    ps.add_undo(lambda: done.append("newer"), "newer")
    del gone
    assert ps.prune() == 1  # the stack shrank below the mark's length: the mark still holds
    assert ps.restore_since(mark) == []
    assert done == ["newer"] and not hasattr(box, "flag") and ps.labels() == ["older"]
    with pytest.raises(ValueError, match="mark 9 is not between 0 and the last mark 4"):
        ps.restore_since(9)
    ps.restore_all()
    assert done == ["newer", "older"]


# ---------------------------------------------------------------- interrupts (KeyboardInterrupt from a signal)
# Python raises a signal handler's exception between any two bytecodes of the main thread. These
# tests put a KeyboardInterrupt exactly where a probe's random SIGALRMs landed and did harm.

def _interrupt_once(monkeypatch, owner, name, when=lambda *a, **k: True):
    """Make ``owner.name`` raise KeyboardInterrupt once, on the first call for which ``when`` is
    true (the call itself runs first where ``after``), like a signal arriving there."""
    orig = getattr(owner, name)
    armed = [True]

    def wrapped(*a, **k):
        if armed[0] and when(*a, **k):
            armed[0] = False
            raise KeyboardInterrupt(f"simulated signal in {name}")
        return orig(*a, **k)

    monkeypatch.setattr(owner, name, wrapped)
    return armed


def _plain_and_paged(tmp_path, plain_batches, paged_batches):
    """Plain training over ``plain_batches``; then the same model paged (everything paged, the step
    after backward) and trained over ``paged_batches``. Returns ``(plain, its optimizer, model,
    optimizer)``; the switch is left on."""
    plain = mlp()
    popt = adamw(plain)
    for b in plain_batches:
        one_step(plain, popt, b)
    m = mlp()
    opt = adamw(m)
    vb.enable("balanced", swap_dir=str(tmp_path), **FORCE, **AFTER)
    try:
        m.to("cpu")
        for b in paged_batches:
            one_step(m, opt, b)
    except BaseException:
        vb.disable()
        raise
    return plain, popt, m, opt


def test_an_interrupt_just_after_a_read_was_queued_frees_no_memory_the_read_writes(tmp_path, monkeypatch, cpu_device):
    """A KeyboardInterrupt right after the read job was queued (inside the pool's submit) made the
    pager give the page's memory back while the reader thread still wrote into it: heap
    corruption, then a segfault or abort (3 runs of 3). The read is taken back or waited for first;
    training goes on exactly as plain training that skipped the interrupted step."""
    from apt_model.memory.io_engine import DaemonThreadPool

    data = batches(6)
    plain, popt, m, opt = _plain_and_paged(tmp_path, data[:2] + data[3:], data[:2])
    try:
        read_into = SwapSpace.read_into
        monkeypatch.setattr(SwapSpace, "read_into", lambda self, key, view: (time.sleep(0.2), read_into(self, key, view))[1])
        armed = _interrupt_once(monkeypatch, DaemonThreadPool, "_grow",
                                lambda pool: any(t.name.startswith("vb-swap-read") for t in pool.threads))
        with pytest.raises(KeyboardInterrupt):
            one_step(m, opt, data[2])
        assert not armed[0]
        monkeypatch.undo()
        opt.zero_grad()
        for b in data[3:]:
            one_step(m, opt, b)
        assert_same(snapshot(m, opt), snapshot(plain, popt))
    finally:
        vb.disable()


def test_an_interrupt_inside_disable_loses_nothing_and_a_second_disable_finishes(tmp_path, monkeypatch, cpu_device):
    """A KeyboardInterrupt while ``disable()`` brought the pages back was taken for a lost page:
    the tensor was NaN-filled, a PagingRecoveryError raised and the folder kept for good. One cut
    short inside the folder's deletion left the folder behind. Now the interrupt propagates, and
    the next ``disable()`` brings every tensor back bitwise and removes the folder."""
    import apt_model.memory.pager as pager_mod

    data = batches(3)
    plain = mlp()
    popt = adamw(plain)
    for b in data:
        one_step(plain, popt, b)
    for where in ("wait", "rmtree"):
        m = mlp()
        opt = adamw(m)
        vb.enable("balanced", swap_dir=str(tmp_path), **FORCE, **AFTER)
        m.to("cpu")
        for b in data:
            one_step(m, opt, b)
        folder = session().swap.folder
        if where == "wait":
            armed = _interrupt_once(monkeypatch, pager_mod, "wait_future")
        else:
            armed = _interrupt_once(monkeypatch, shutil, "rmtree", lambda path, *a, **k: str(path) == str(folder))
        with pytest.raises(KeyboardInterrupt):
            vb.disable()
        assert not armed[0]
        monkeypatch.undo()
        vb.disable()
        assert_same(snapshot(m, opt), snapshot(plain, popt))
        assert not folder.exists(), where


def test_a_lock_is_given_back_wherever_an_interrupt_lands(monkeypatch):
    """A KeyboardInterrupt from a signal handler lands at the first instruction of any Python
    function (and after calls). Landing just after ``TimedLock.__enter__`` acquired its lock, or at
    the start of a Python ``__exit__``, left it held for good: the next thread that wanted it (an
    I/O thread) timed out, and training hung on its writes. An interrupt is raised here at every
    trace event of the lock's own code under ``with lock:`` in turn — alone, and inside an outer
    hold — and each time the lock must end up held exactly as before."""
    import sys
    import threading

    from apt_model.memory.swap import SwapTimeoutError
    from apt_model.memory.waits import TimedLock

    monkeypatch.setenv("VB_SWAP_TIMEOUT", "0.5")
    lock = TimedLock("test")

    def taken_by_another_thread():
        out = []

        def enter():
            try:
                with lock:
                    out.append("entered")
            except SwapTimeoutError:
                out.append("timed out")

        t = threading.Thread(target=enter)
        t.start()
        t.join()
        return out

    def interrupt_at(n: int) -> bool:
        """Run ``with lock: pass`` raising KeyboardInterrupt at its ``n``-th trace event; returns
        whether it was raised (False: ``n`` is past the last event)."""
        seen = [0]

        def tracer(frame, event, arg):
            # where signals are delivered: a function's start, and (a superset of) the points after
            # calls — in the lock's own frames (a trace event raising in ``block`` itself lands on
            # the instruction before, which no real signal does)
            if event not in ("call", "line") or frame.f_code is block.__code__:
                return tracer
            seen[0] += 1
            if seen[0] == n:
                raise KeyboardInterrupt(f"simulated signal at trace event {n} ({event} {frame.f_code.co_name})")
            return tracer

        def block():
            with lock:
                pass

        sys.settrace(tracer)
        try:
            block()
        except KeyboardInterrupt:
            return True
        finally:
            sys.settrace(None)
        return False

    for outer in (False, True):
        landed = 0
        for n in range(1, 200):
            if outer:
                lock.acquire()
            hit = interrupt_at(n)
            if outer:
                assert lock.holds() == 1, (n, lock.holds())
                lock.release()
            assert lock.holds() == 0, n
            if not hit:
                break
            landed += 1
            assert taken_by_another_thread() == ["entered"], (outer, n)
        assert landed >= 3, landed  # at least __enter__'s call, its acquire's line, its return
    with lock:  # and a lock held really is held
        assert taken_by_another_thread() == ["timed out"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
def test_disable_in_a_forked_child_is_quick_and_leaves_the_parent_alone(tmp_path, cpu_device):
    """``vb.disable()`` in a child made by os.fork() while the parent pages waited for the parent's
    I/O threads, which do not exist in the child: VB_SWAP_TIMEOUT (2 minutes) per page in flight.
    It now raises ForkedPagingError at once, naming the tensors it could not bring back; the
    parent's folder and training are untouched."""
    data = batches(4)
    plain, popt, m, opt = _plain_and_paged(tmp_path, data, data[:2])
    try:
        folder = session().swap.folder
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 when disable() raised ForkedPagingError quickly
            status = 1
            try:
                t0 = time.monotonic()
                try:
                    vb.disable()
                except swap_mod.ForkedPagingError as err:
                    status = 0 if time.monotonic() - t0 < 10 and "forked" in str(err) else 2
            finally:
                os._exit(status)
        deadline = time.monotonic() + 60
        while True:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("disable() in the forked child hung")
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(st) == 0
        assert folder.exists() and not (folder / swap_mod.RECOVERY_FILE).exists()
        for b in data[2:]:
            one_step(m, opt, b)
        assert_same(snapshot(m, opt), snapshot(plain, popt))
    finally:
        vb.disable()


def test_a_tensor_reusing_a_dead_gradients_id_is_not_taken_for_its_page(tmp_path):
    """The pager finds a tensor's page by ``id()`` and holds the tensor weakly. After
    ``zero_grad(set_to_none=True)`` a gradient dies before its page is settled, and CPython hands
    its ``id()`` to the next tensor made; the fault handler took that unrelated tensor for the
    gradient's page (on the H200 a fresh byte view inside a side-stream copy, which then evicted
    pages from there). A page is now the tensor's only if the page holds that very tensor."""
    from apt_model.base.patches import PatchSet
    from apt_model.memory.paging.session import PagingSession
    from apt_model.memory.swap import SwapSpace

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    patches = PatchSet()
    session = PagingSession(4096, SwapSpace(tmp_path), patches, device="cpu")
    try:
        session.page_model(m, page_params=True, page_grads=True)
        m(torch.randn(4, 64)).sum().backward()
        pager = session.pager
        grad_pages = {pg.tensor_id: pg for pg in session.grad_pages.values()}
        for p in m.parameters():
            p.grad = None  # the gradients die; their pages hold them weakly, their entries stay for now
        stale = {tid for tid, pg in grad_pages.items() if pager.by_tensor.get(tid) is pg and pg.bound() is None}
        assert stale
        keep, found = [], None
        for _ in range(10000):  # CPython gives a freed object's memory to the next object of its size
            t = torch.zeros(16)
            if id(t) in stale:
                found = t
                break
            keep.append(t)
        if found is None:
            pytest.skip("no new tensor reused a dead gradient's id() here")
        seen = []
        real = session.enter
        session.enter = lambda pages, *a, **k: (seen.extend(pages), real(pages, *a, **k))[1]
        found.add_(1)  # an op on a tensor that is no page
        assert seen == [], [pg.label for pg in seen]
        assert torch.equal(found, torch.ones(16))
    finally:
        patches.restore_all()
