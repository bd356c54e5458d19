"""A forward that raises only under the switch's autocast runs again without it.

A hand-written mixture-of-experts layer adds its experts' outputs into an fp32 buffer with
``index_add_``; under bf16 autocast the experts' ``Linear`` outputs are bf16 and ``index_add_``
raises ("self (Float) and source (BFloat16) must have the same scalar type"). Without the switch
the script trains; before 2026-11-28 it crashed with the switch on wherever its autocast was on
(forced, on trial, or kept by the trial: any GPU in balanced mode).
"""
import copy

import pytest
import torch
import torch.nn as nn

import apt_model.optimization.vb_global as vb


class Experts(nn.Module):
    """Two experts, each token routed to one by a gate; outputs added into an fp32 buffer."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.gate = nn.Linear(width, 2)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        pick = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            idx = (pick == i).nonzero().squeeze(1)
            out.index_add_(0, idx, expert(x[idx]))
        return self.head(out)


def _loss(model, x):
    return model(x).square().mean()


SETTINGS = {
    "forced bf16": dict(mixed_precision="bf16"),
    "on trial": dict(mixed_precision="auto", autocast_min_speedup=0.01, autocast_trial_calls=4),
    "paged, forced bf16": dict(mixed_precision="bf16", paging="always"),
}


@pytest.mark.parametrize("adopted", ["at .to()", "at its first call"])
@pytest.mark.parametrize("how", list(SETTINGS))
def test_a_forward_raising_only_under_autocast_runs_again_without_it(cpu_device, caplog, how, adopted):
    torch.manual_seed(0)
    model = Experts()
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    vb.enable("balanced", compile="off", banner=False, **SETTINGS[how])
    try:
        if adopted == "at .to()":
            model.to("cpu")
        for _ in range(4):
            x = torch.randn(8, 16, generator=gen)
            loss = _loss(model, x)
            want = _loss(plain, x)
            assert torch.equal(loss, want)  # every call ended in fp32, as written
            for o, m in ((opt, model), (plain_opt, plain)):
                o.zero_grad()
                (loss if m is model else want).backward()
                o.step()
        hooks = model._vb_autocast
        assert not hooks.active and "index_add_" in hooks.failure, hooks.failure
        feat = vb.get_report()["models"][0]["features"]["mixed_precision"]
        assert feat["chosen"] == "fp32" and "raised under bfloat16 autocast" in feat["reason"], feat
        assert "index_add_" in feat["reason"]
        assert any("autocast stays off for this model" in r.getMessage() for r in caplog.records)
    finally:
        vb.disable()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p, q)
    assert model._compiled_call_impl is None  # the call wrapper is gone with the switch


class Raises(nn.Module):
    """Raises ``error`` at every call, autocast or not; counts its calls."""

    def __init__(self, error: Exception):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.error, self.calls = error, 0

    def forward(self, x):
        self.calls += 1
        self.lin(x)
        raise self.error


@pytest.mark.parametrize("error,calls", [
    (TypeError("expected scalar type Float but found BFloat16"), 2),  # about dtypes: run again, raises again
    (ValueError("the script's own bug"), 1),  # not about dtypes: not run again
    (torch.OutOfMemoryError("out of memory: tried to allocate a bf16 buffer"), 1),
], ids=["about dtypes, raises also without autocast", "not about dtypes", "out of memory"])
def test_an_error_not_caused_by_autocast_propagates_alone_and_autocast_stays(cpu_device, error, calls):
    """A call whose retry raises too was not autocast's: that error propagates, without the first
    attempt chained to it, and autocast stays on. An error whose message is not about dtypes is
    not retried at all (a device or shape error would only raise again, its side effects twice),
    nor is out of memory (a script catching it to try a smaller batch)."""
    model = Raises(error)
    vb.enable("balanced", mixed_precision="bf16", compile="off", banner=False)
    try:
        model.to("cpu")
        with pytest.raises(type(error)) as info:
            model(torch.randn(2, 4))
        assert info.value.__context__ is None or info.value.__suppress_context__
        hooks = model._vb_autocast
        assert hooks.active and hooks.failure is None
        assert model.calls == calls
        assert vb.get_report()["models"][0]["features"]["mixed_precision"]["chosen"] == "bf16"
    finally:
        vb.disable()


def test_the_call_wrapper_does_not_hide_a_compile_by_the_script(cpu_device):
    """``Module.compile()`` after adoption replaces the switch's call wrapper; ``disable()`` then
    leaves the script's compiled call in place."""
    from apt_model.base.call_wrapper import script_call

    model = Experts()
    vb.enable("balanced", mixed_precision="bf16", compile="off", banner=False)
    try:
        model.to("cpu")
        assert model._compiled_call_impl is not None and script_call(model) is None
        model.compile(backend="eager")
        compiled = model._compiled_call_impl
        assert script_call(model) is not None
    finally:
        vb.disable()
    assert model._compiled_call_impl is compiled


def test_no_retry_inside_the_scripts_own_non_reentrant_checkpoint(cpu_device):
    """A retry inside the script's non-reentrant ``torch.utils.checkpoint`` left the failed
    attempt's saved tensors counted: the backward raised "CheckpointError: A different number of
    tensors was saved" (a probe's finding). There the dtype error propagates, as documented."""
    from torch.utils.checkpoint import checkpoint

    model = Experts()
    vb.enable("balanced", mixed_precision="bf16", compile="off", banner=False)
    try:
        model.to("cpu")
        x = torch.randn(8, 16, requires_grad=True)
        with pytest.raises(RuntimeError, match="same scalar type"):
            checkpoint(model, x, use_reentrant=False).square().mean().backward()
        assert model._vb_autocast.active and model._vb_autocast.failure is None
        loss = _loss(model, x)  # outside the checkpoint the call is retried as usual
        loss.backward()
        assert not model._vb_autocast.active
    finally:
        vb.disable()


class SparseGCN(nn.Module):
    """A graph convolution over a fixed sparse adjacency (``torch.sparse.mm``), with dropout."""

    def __init__(self, n: int = 32, width: int = 8):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        idx = torch.randint(0, n, (2, 128), generator=gen)
        self.register_buffer("adj", torch.sparse_coo_tensor(idx, torch.rand(128, generator=gen), (n, n)).coalesce())
        self.lin, self.drop = nn.Linear(width, width), nn.Dropout(0.5)

    def forward(self, x):
        return torch.sparse.mm(self.adj, self.drop(self.lin(x)))


def test_a_sparse_operand_under_autocast_runs_the_model_as_written_with_the_first_attempts_random_numbers(
        cpu_device, caplog):
    """``torch.sparse.mm`` of an fp32 sparse adjacency runs under bf16 autocast, but its backward
    mixes dtypes and raised ("expected scalar type Float but found BFloat16") at the first
    ``backward``, out of reach of the forward's retry (a probe's finding: a GCN under forced bf16).
    The first calls under autocast are watched for sparse operands: the call runs again as written
    and autocast stays off. The retry draws the random numbers the first attempt drew (dropout: the
    run's masks differed from plain PyTorch's from the retried call on, another finding): training
    is bitwise plain PyTorch's."""
    def run(switch):
        torch.manual_seed(0)
        model = SparseGCN()
        if switch:
            vb.enable("balanced", compile="off", mixed_precision="bf16", banner=False)
            model.to("cpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
        losses = []
        try:
            for _ in range(4):
                loss = model(x).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            feature = vb.get_report()["models"][0]["features"]["mixed_precision"] if switch else None
        finally:
            vb.disable()
        return losses, feature

    ref, _ = run(False)
    got, feature = run(True)
    assert got == ref
    assert feature["chosen"] == "fp32" and "sparse_coo tensor under bfloat16 autocast" in feature["reason"], feature


class NormalisedExperts(Experts):
    """Experts behind a batch norm and a running count (a buffer), both updated before the expert
    sum that raises under bf16."""

    def __init__(self, width: int = 16):
        super().__init__(width)
        self.norm = nn.BatchNorm1d(width)
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("total", torch.zeros(()))

    def forward(self, x):
        self.seen.add_(x.shape[0])  # in place
        self.total = self.total + x.sum()  # re-assigned: a new tensor each call
        return super().forward(self.norm(x))


@pytest.mark.parametrize("how", ["forced bf16", "on trial"])
def test_a_retried_call_updates_the_models_buffers_once(cpu_device, how):
    """The retry after a forward that raised under autocast ran the forward's side effects twice:
    a batch norm's running statistics and ``num_batches_tracked``, a running normaliser's count
    (a probe's finding: 31 observations counted for 30), and a buffer the forward re-assigns was
    left as the failed attempt made it (a review probe's finding). The early calls' retry starts
    from the buffers the failed attempt started from; every buffer ends as in plain PyTorch."""
    torch.manual_seed(0)
    model = NormalisedExperts()
    plain = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 16, generator=gen) for _ in range(3)]
    for x in batches:
        _loss(plain, x).backward()
    vb.enable("balanced", compile="off", banner=False, **SETTINGS[how])
    try:
        model.to("cpu")
        for x in batches:
            _loss(model, x).backward()
        retried = model._vb_autocast.failure is not None
    finally:
        vb.disable()
    assert retried  # the first call raised under autocast and ran again
    for name, want in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], want), name
