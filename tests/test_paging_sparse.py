"""Sparse gradients and paging: a model with ``nn.Embedding(sparse=True)`` is left unpaged, with
the reason recorded, and trains exactly as without the switch; a sparse gradient that reaches a
paged model anyway fails with an error naming it (it used to fail deep in backward with
``NotImplementedError: ... 'aten::linalg_vector_norm' ... 'SparseCPU' backend``)."""
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from apt_model.base.patches import PatchSet
from apt_model.memory.paging.session import PagingSession, SparseGradientError
from apt_model.memory.paging.step import sparse_gradient_sources
from apt_model.memory.swap import SwapSpace


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(512, 256, sparse=True), nn.Linear(256, 256), nn.Linear(256, 512))


def _train(m, opt, steps=3):
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 512, (8, 16), generator=gen)
        opt.zero_grad()
        loss = F.cross_entropy(m(x).reshape(-1, 512), x.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("paging", ["tight", "always"])
def test_a_model_with_sparse_gradients_is_not_paged_and_trains_as_without_the_switch(tmp_path, paging, caplog,
                                                                                     cpu_device):
    ref_m = _model()
    ref = _train(ref_m, torch.optim.SGD(ref_m.parameters(), lr=0.1, momentum=0.9))
    m = _model()
    vb.enable("memory", swap_dir=str(tmp_path), device_budget="2MB", paging=paging, compile="off",
              mixed_precision="off", banner=False)
    try:
        with caplog.at_level(logging.WARNING, logger="apt_model.memory.paging.step"):
            m.to("cpu")
        got = _train(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
        decision = vb.get_report()["models"][0]["features"]["paging"]
    finally:
        vb.disable()
    assert decision["chosen"] == "off", decision  # the 5 MB of training state is over the 2 MB budget
    assert "Embedding(sparse=True) at 0" in decision["reason"] and "sparse=False" in decision["reason"]
    assert got == ref
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref_m.parameters()))
    warned = [r for r in caplog.records if "sparse gradients" in r.getMessage()]
    assert len(warned) == (1 if paging == "always" else 0)


def test_a_sparse_gradient_reaching_a_paged_model_fails_with_an_error_naming_it(tmp_path):
    m = _model()
    patches = PatchSet()
    session = PagingSession(2 * 2**20, SwapSpace(tmp_path), patches, device="cpu")
    try:
        session.page_model(m, page_params=True, page_grads=True)
        with pytest.raises(SparseGradientError, match=r"gradient of 0\.weight is torch\.sparse_coo"):
            m(torch.randint(0, 512, (2, 4))).sum().backward()
    finally:
        patches.restore_all()


def test_sparse_gradient_sources_names_modules_and_gradients():
    m = _model()
    assert sparse_gradient_sources(m) == ["Embedding(sparse=True) at 0"]
    assert sparse_gradient_sources(nn.EmbeddingBag(4, 2, sparse=True)) == ["EmbeddingBag(sparse=True) at (the model)"]
    dense = nn.Linear(3, 3)
    assert sparse_gradient_sources(dense) == []
    dense.weight.grad = torch.eye(3).to_sparse()
    assert sparse_gradient_sources(dense) == ["the torch.sparse_coo gradient of weight"]


class GCN(nn.Module):
    """Two graph convolutions over a fixed normalized adjacency, kept as a sparse ``Parameter``
    (``requires_grad=False``, so it moves with ``.to()``) or as a sparse buffer."""

    def __init__(self, how: str, n: int = 64, d: int = 32):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        dense = (torch.rand(n, n, generator=gen) < 0.1).float() + torch.eye(n)
        adj = (dense / dense.sum(1, keepdim=True)).to_sparse()
        if how == "parameter":
            self.adj = nn.Parameter(adj, requires_grad=False)
        else:
            self.register_buffer("adj", adj)
        self.lin1, self.lin2 = nn.Linear(d, d), nn.Linear(d, 4)

    def forward(self, x):
        h = torch.relu(torch.sparse.mm(self.adj, self.lin1(x)))
        return torch.sparse.mm(self.adj, self.lin2(h))


def _train_gcn(m, steps=3):
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 32, generator=gen), torch.randint(0, 4, (64,), generator=gen)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in m.parameters() if p.layout is torch.strided]


@pytest.mark.parametrize("how,settings", [
    ("parameter", dict(paging="always", device_budget="16KB")),
    ("buffer", dict(activation_offload=True, offload_min_bytes=1, activation_budget="1KB")),
], ids=["sparse-parameter-paging-always", "sparse-buffer-activation-offload"])
def test_a_gcn_with_a_sparse_adjacency_trains_as_without_the_switch(tmp_path, cpu_device, how, settings):
    """A GCN's fixed sparse adjacency. Kept as a sparse ``Parameter``, paging it raised "Cannot
    access storage of SparseTensorImpl" at ``.to()`` (and its plan counted its dense size); kept as
    a buffer, activation offload's pre-hook asked its storage and raised the same at the first
    forward (a probe's findings). Paging is off for such a model, with the parameter named; a
    sparse buffer is not offloaded; training is bitwise plain PyTorch's."""
    torch.manual_seed(0)
    ref = _train_gcn(GCN(how))
    torch.manual_seed(0)
    m = GCN(how)
    vb.enable("memory", swap_dir=str(tmp_path), compile="off", mixed_precision="off", banner=False, **settings)
    try:
        m.to("cpu")
        got = _train_gcn(m)
        paging = vb.get_report()["models"][0]["features"]["paging"]
    finally:
        vb.disable()
    assert got[0] == ref[0] and all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))
    if how == "parameter":
        assert paging["chosen"] == "off" and "the torch.sparse_coo parameter adj" in paging["reason"], paging
