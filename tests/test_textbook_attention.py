"""The textbook-attention rewrite (:mod:`apt_model.attention.textbook`) on hand-written attention
modules captured the way a user's ``torch.compile`` captures them: a custom backend receives the
dynamo ``GraphModule``, rewrites it to SDPA and runs ``gm.forward``.

Numbers are compared in fp32 with ``torch.testing.assert_close(atol=1e-5, rtol=1e-5)``: outputs and
gradients (of the parameters and of the input) of the compiled, rewritten module against the
original eager module, in eval mode and in train mode with dropout ``p=0``. With dropout ``p>0``
the random masks cannot match, so :func:`without_dropout` of the original graph and of the
rewritten graph are compared instead (same tolerance).
"""
from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from apt_model.compile.overrides import dropout_free as without_dropout
from apt_model.attention.textbook import (
    AttentionSite,
    find_textbook_attention,
    rewrite_textbook_attention,
)

TOL = dict(atol=1e-5, rtol=1e-5)
SDPA = F.scaled_dot_product_attention
SOFTMAXES = {F.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax}


# ---------------------------------------------------------------------------------------------
# modules written the way users write them


class NanoGPTAttention(nn.Module):
    """nanoGPT's CausalSelfAttention (the non-flash branch), verbatim in spirit."""

    def __init__(self, n_embd=32, n_head=4, block_size=16, dropout=0.0):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head = n_head
        self.n_embd = n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class TwoBlocks(nn.Module):
    """Two nanoGPT attentions in a row: the second site's q/k/v come from the first's output."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.a = NanoGPTAttention(dropout=dropout)
        self.b = NanoGPTAttention(dropout=dropout)

    def forward(self, x):
        x = x + self.a(x)
        return x + self.b(x)


class AdditiveMaskAttention(nn.Module):
    """BERT-style: ``torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d)`` plus an additive mask
    argument, ``torch.softmax``, functional dropout, ``torch.matmul``."""

    def __init__(self, d_model=32, n_heads=4, dropout=0.0):
        super().__init__()
        self.n_heads, self.d = n_heads, d_model // n_heads
        self.query, self.key, self.value = (nn.Linear(d_model, d_model) for _ in range(3))
        self.out = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def split(self, t):
        b, s, _ = t.shape
        return t.view(b, s, self.n_heads, self.d).permute(0, 2, 1, 3)

    def forward(self, x, mask):
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.d)
        scores = scores + mask
        probs = torch.softmax(scores, dim=-1)
        probs = F.dropout(probs, self.dropout, self.training)
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).flatten(2)
        return self.out(ctx)


class PlainBmmAttention(nn.Module):
    """No scale, no mask, 3-D ``torch.bmm`` with positive dims (``transpose(1, 2)``, ``dim=2``)."""

    def __init__(self, d=16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        w = torch.bmm(q, k.transpose(1, 2)).softmax(dim=2)
        return torch.bmm(w, v)


class ReturnsWeights(nn.Module):
    """The attention weights are returned too: softmax has two users, the site is left alone."""

    def __init__(self, d=16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        w = F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1)
        return w @ v, w


class SoftmaxOverDim1(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=1) @ v


class SoftmaxWithDtype(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1, dtype=torch.float32) @ v


class ScaleAttribute(nn.Module):
    """``self.scale`` and ``self.p`` as float attributes (dynamo may lift them to graph inputs)."""

    def __init__(self, d=16, heads=2, scale=0.25, p=0.0):
        super().__init__()
        self.heads, self.scale, self.p = heads, scale, p
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) * self.scale
        att = F.dropout(att.softmax(dim=-1), self.p, self.training)
        return (att @ v).transpose(1, 2).reshape(b, t, c)


class Traceable(nn.Module):
    """For ``torch.fx.symbolic_trace``: constant scale, ``masked_fill(~keep, -inf)``, ``nn.Dropout``."""

    def __init__(self, d=16, p=0.0):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.drop = nn.Dropout(p)

    def forward(self, x, keep):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = q @ k.transpose(-2, -1) * 0.25
        att = att.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        return self.drop(att) @ v


# ---------------------------------------------------------------------------------------------
# helpers


class Capture:
    """A ``torch.compile`` backend that keeps each graph, its pre-rewrite copy and the sites."""

    def __init__(self):
        self.graphs: list[fx.GraphModule] = []
        self.originals: list[fx.GraphModule] = []  # without_dropout copies taken before the rewrite
        self.inputs: list[list] = []
        self.found: list[list[AttentionSite]] = []
        self.sites: list[list[AttentionSite]] = []

    def __call__(self, gm: fx.GraphModule, example_inputs):
        self.originals.append(without_dropout(gm))
        self.found.append(find_textbook_attention(gm))
        self.sites.append(rewrite_textbook_attention(gm))
        self.graphs.append(gm)
        self.inputs.append(list(example_inputs))
        return gm.forward


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def count_sdpa(gm: fx.GraphModule) -> int:
    return sum(t is SDPA for t in targets(gm))


def has_softmax(gm: fx.GraphModule) -> bool:
    return any(t in SOFTMAXES or t == "softmax" for t in targets(gm))


def run_and_grads(fn, module: nn.Module, *args):
    """Output of ``fn(*args)`` and the gradients of a fixed linear loss w.r.t. ``module``'s
    parameters and ``args[0]``."""
    x = args[0].detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out = fn(x, *args[1:])
    weight = torch.linspace(-1.0, 1.0, out.numel()).view_as(out)
    (out * weight).sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in module.named_parameters()}
    return out.detach(), grads, x.grad.detach().clone()


def assert_matches_eager(module: nn.Module, *args, expect_sites: int, train: bool):
    """Compiled-and-rewritten ``module`` gives the eager outputs and gradients (atol=rtol=1e-5)."""
    module.train(train)
    torch.manual_seed(0)
    want_out, want_grads, want_xgrad = run_and_grads(module, module, *args)
    cap = Capture()
    compiled = torch.compile(module, backend=cap)
    got_out, got_grads, got_xgrad = run_and_grads(compiled, module, *args)
    assert len(cap.graphs) == 1, "expected one graph (no graph break)"
    assert len(cap.sites[0]) == expect_sites, cap.sites[0]
    assert cap.found[0] == cap.sites[0]
    gm = cap.graphs[0]
    assert count_sdpa(gm) == expect_sites
    if expect_sites:
        assert not has_softmax(gm), gm.code
    torch.testing.assert_close(got_out, want_out, **TOL)
    torch.testing.assert_close(got_xgrad, want_xgrad, **TOL)
    assert want_grads.keys() == got_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return cap


# ---------------------------------------------------------------------------------------------
# positive cases


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train-p0"])
def test_nanogpt_attention_is_rewritten_and_matches_eager(train):
    """Output and gradients equal the eager module's (fp32, atol=rtol=1e-5)."""
    torch.manual_seed(1)
    cap = assert_matches_eager(NanoGPTAttention(), torch.randn(2, 16, 32), expect_sites=1, train=train)
    site = cap.sites[0][0]
    assert site.scale == pytest.approx(1 / math.sqrt(8))
    assert site.mask == "boolean (masked_fill)"
    assert site.dropout_p == 0.0
    sdpa = next(n for n in cap.graphs[0].graph.nodes if n.target is SDPA)
    assert sdpa.kwargs["attn_mask"].target is torch.logical_not
    assert sdpa.kwargs["scale"] == pytest.approx(1 / math.sqrt(8))


def test_two_sites_in_a_row_are_both_rewritten():
    """The second site's inputs come from the first site's SDPA (fp32, atol=rtol=1e-5)."""
    torch.manual_seed(2)
    cap = assert_matches_eager(TwoBlocks(), torch.randn(2, 16, 32), expect_sites=2, train=False)
    assert all(s.mask == "boolean (masked_fill)" for s in cap.sites[0])


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train-p0"])
def test_matmul_div_with_additive_mask(train):
    """``/ math.sqrt(d)`` becomes ``scale=1/sqrt(d)``; the float mask is passed as is
    (fp32, atol=rtol=1e-5)."""
    torch.manual_seed(3)
    mask = torch.zeros(2, 1, 1, 8)
    mask[0, ..., 6:] = float("-inf")  # padding of the first sequence
    mask[1, ..., 3:] = torch.finfo(torch.float32).min
    cap = assert_matches_eager(AdditiveMaskAttention(), torch.randn(2, 8, 32), mask, expect_sites=1, train=train)
    site = cap.sites[0][0]
    assert site.scale == pytest.approx(1 / math.sqrt(8))
    assert site.mask == "additive"


def test_no_scale_no_mask_bmm_passes_scale_one():
    """SDPA's default scale is 1/sqrt(E): an unscaled site must pass ``scale=1.0``
    (fp32, atol=rtol=1e-5)."""
    torch.manual_seed(4)
    cap = assert_matches_eager(PlainBmmAttention(), torch.randn(3, 8, 16), expect_sites=1, train=False)
    assert cap.sites[0] == [AttentionSite(scores=cap.sites[0][0].scores, scale=1.0, mask=None, dropout_p=0.0)]
    sdpa = next(n for n in cap.graphs[0].graph.nodes if n.target is SDPA)
    assert sdpa.kwargs["scale"] == 1.0 and sdpa.kwargs["attn_mask"] is None


# ---------------------------------------------------------------------------------------------
# dropout p > 0


@pytest.mark.parametrize("make, args", [
    (lambda: NanoGPTAttention(dropout=0.2), lambda: (torch.randn(2, 16, 32),)),
    (lambda: AdditiveMaskAttention(dropout=0.3), lambda: (torch.randn(2, 8, 32), torch.zeros(2, 1, 1, 8))),
], ids=["nanogpt", "additive"])
def test_dropout_in_training_without_dropout_graphs_agree(make, args):
    """In train mode with p>0 the rewritten site carries ``dropout_p``; with dropout made identity
    the original and the rewritten graph agree (fp32, atol=rtol=1e-5)."""
    torch.manual_seed(5)
    module = make().train()
    cap = Capture()
    out = torch.compile(module, backend=cap)(*args())
    assert out.shape[0] == 2
    (site,) = cap.sites[0]
    assert site.dropout_p == pytest.approx(module.attn_dropout.p if hasattr(module, "attn_dropout") else module.dropout)
    gm = cap.graphs[0]
    sdpa = next(n for n in gm.graph.nodes if n.target is SDPA)
    assert sdpa.kwargs["dropout_p"] == pytest.approx(site.dropout_p)
    inputs = cap.inputs[0]
    want = cap.originals[0](*inputs)
    got = without_dropout(gm)(*inputs)
    torch.testing.assert_close(got, want, **TOL)
    # without_dropout is a copy: the rewritten graph still drops
    assert count_sdpa(gm) == 1 and sdpa.kwargs["dropout_p"] > 0


def test_float_attributes_lifted_to_graph_inputs_after_a_recompile():
    """A second module with other float attributes makes dynamo lift ``scale``/``p`` to graph
    inputs (``tensor.item()``); SDPA's scale and dropout_p are then computed at run time
    (fp32, atol=rtol=1e-5)."""
    torch.manual_seed(6)
    x = torch.randn(2, 8, 16)
    cap = Capture()
    for scale, p in ((0.25, 0.0), (0.5, 0.1), (0.125, 0.3)):
        module = ScaleAttribute(scale=scale, p=p).eval()
        torch.testing.assert_close(torch.compile(module, backend=cap)(x), module(x), **TOL)
        module.train()
        compiled_graphs = len(cap.graphs)
        torch.compile(module, backend=cap)(x)
        if len(cap.graphs) > compiled_graphs:  # a train-mode graph was made: compare without dropout
            torch.testing.assert_close(without_dropout(cap.graphs[-1])(*cap.inputs[-1]),
                                       cap.originals[-1](*cap.inputs[-1]), **TOL)
    assert all(len(s) == 1 for s in cap.sites), cap.sites
    assert [s[0].scale for s in cap.sites if s][0] == pytest.approx(0.25)
    assert all(count_sdpa(gm) == 1 and not has_softmax(gm) for gm in cap.graphs)


# ---------------------------------------------------------------------------------------------
# negative cases


@pytest.mark.parametrize("cls, reason", [
    (ReturnsWeights, "users"),
    (SoftmaxOverDim1, "dim=1"),
    (SoftmaxWithDtype, "dtype"),
], ids=["weights-returned", "softmax-dim1", "softmax-dtype"])
def test_sites_that_are_not_textbook_attention_are_left_alone(cls, reason, caplog):
    """Not rewritten; outputs still equal eager (fp32, atol=rtol=1e-5); the reason is logged at DEBUG."""
    torch.manual_seed(7)
    module = cls().eval()
    x = torch.randn(2, 8, 16)
    cap = Capture()
    with caplog.at_level(logging.DEBUG, logger="apt_model.attention.textbook"):
        got = torch.compile(module, backend=cap)(x)
    assert cap.sites == [[]] and cap.found == [[]]
    gm = cap.graphs[0]
    assert count_sdpa(gm) == 0 and has_softmax(gm)
    torch.testing.assert_close(got, module(x), **TOL)
    assert any(reason in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_find_does_not_change_the_graph_and_rejects_non_graph_modules():
    gm = fx.symbolic_trace(Traceable())
    before = gm.code
    assert len(find_textbook_attention(gm)) == 1
    assert gm.code == before
    with pytest.raises(TypeError, match="GraphModule"):
        find_textbook_attention(Traceable())
    with pytest.raises(TypeError, match="GraphModule"):
        rewrite_textbook_attention(Traceable())
    with pytest.raises(TypeError, match="GraphModule"):
        without_dropout(Traceable())


# ---------------------------------------------------------------------------------------------
# symbolic_trace graphs (no metadata)


def test_symbolic_trace_graph_is_rewritten_and_reads_dropout_mode_at_run_time():
    """A ``symbolic_trace`` graph (no ``example_value`` metadata): ``masked_fill(~keep)`` becomes
    ``attn_mask=keep``; the ``nn.Dropout`` submodule's rate is read at run time, so switching the
    mode after the rewrite still works (fp32, atol=rtol=1e-5)."""
    torch.manual_seed(8)
    module = Traceable(p=0.25).train()
    x = torch.randn(2, 8, 16)
    keep = torch.ones(8, 8, dtype=torch.bool).tril()
    original = fx.symbolic_trace(module)
    gm = fx.symbolic_trace(module)
    (site,) = rewrite_textbook_attention(gm)
    assert site == AttentionSite(scores=site.scores, scale=0.25, mask="boolean (masked_fill)", dropout_p=0.25)
    assert count_sdpa(gm) == 1 and not has_softmax(gm)
    sdpa = next(n for n in gm.graph.nodes if n.target is SDPA)
    assert sdpa.kwargs["attn_mask"].name == "keep"  # ~keep was undone, no logical_not(~keep)
    assert not any(n.op == "call_module" and n.target == "drop" for n in gm.graph.nodes)
    # train mode: compare with dropout made identity
    torch.testing.assert_close(without_dropout(gm)(x, keep), without_dropout(original)(x, keep), **TOL)
    # eval mode after the rewrite: the rate is read from the module now, so the output is exact
    module.eval()
    torch.testing.assert_close(gm(x, keep), module(x, keep), **TOL)
    # and gradients
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    gm(xa, keep).sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    module(xb, keep).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, **TOL)
    for got, want in zip(grads, [p.grad for p in module.parameters()]):
        torch.testing.assert_close(got, want, **TOL)


class TraceableAdditive(nn.Module):
    """For ``torch.fx.symbolic_trace``: an additive mask added before the scale, ``nn.Softmax``."""

    def __init__(self, d=16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        s = (torch.matmul(q, k.transpose(-1, -2)) + mask) / 4.0
        return torch.matmul(self.softmax(s), v)


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
def test_symbolic_trace_additive_mask_before_the_scale(mask_dtype):
    """Without metadata the mask's dtype is unknown: it is passed as ``mask.type_as(q)`` (a boolean
    added to the scores counts as 0/1, never as SDPA's keep-mask) and multiplied by the scale that
    follows the add (fp32, atol=rtol=1e-5)."""
    torch.manual_seed(11)
    module = TraceableAdditive().eval()
    x = torch.randn(2, 8, 16)
    mask = torch.randn(8, 8).to(mask_dtype)
    gm = fx.symbolic_trace(module)
    (site,) = rewrite_textbook_attention(gm)
    assert site.mask == "additive" and site.scale == 0.25
    assert count_sdpa(gm) == 1 and not any(n.op == "call_module" for n in gm.graph.nodes if n.target == "softmax")
    assert "type_as" in targets(gm)
    torch.testing.assert_close(gm(x, mask), module(x, mask), **TOL)


def test_symbolic_trace_accepts_only_negative_transpose_dims_without_metadata():
    """Without metadata the rank is unknown: ``transpose(1, 2)`` is not known to be the last two."""
    gm = fx.symbolic_trace(PlainBmmAttention())
    assert find_textbook_attention(gm) == []


# ---------------------------------------------------------------------------------------------
# spellings of the same pattern, and near misses (functions compiled directly)


def _qkv(b=2, h=3, l=5, s=5, e=8, kv_heads=None):
    g = torch.Generator().manual_seed(9)
    q = torch.randn(b, h, l, e, generator=g)
    k = torch.randn(b, kv_heads or h, s, e, generator=g)
    v = torch.randn(b, kv_heads or h, s, e, generator=g)
    return q, k, v


def _keep(l=5, s=5):
    keep = torch.rand(l, s, generator=torch.Generator().manual_seed(10)) > 0.4
    keep[:, 0] = True  # no query row without keys (SDPA gives zeros there, softmax NaN)
    return keep


def mt_itruediv_torch_dropout(q, k, v):
    s = q @ k.mT
    s /= 8
    s = s.softmax(-1)
    s = torch.dropout(s, 0.1, False)
    return torch.matmul(s, v)


def masked_fill_before_div(q, k, v, keep):
    s = torch.matmul(q, k.transpose(-2, -1)).masked_fill(keep == 0, -1e9) / math.sqrt(8)
    return F.softmax(s, -1) @ v


def additive_before_scale_positive_dims(q, k, v, bias):
    s = ((q @ k.transpose(2, 3)) + bias) * 0.3
    return torch.softmax(s, 3) @ v


def permute_and_left_scale_finfo_min(q, k, v, keep):
    s = 0.5 * (q @ k.permute(0, 1, 3, 2))
    s = s.masked_fill(~keep, torch.finfo(s.dtype).min)
    return torch.nn.functional.softmax(s, dim=-1) @ v


def mqa_broadcast_kv(q, k, v):
    return ((q @ k.transpose(-2, -1)) * 0.25).softmax(dim=-1) @ v


def bool_mask_added(q, k, v, keep):
    return ((q @ k.transpose(-2, -1)) * 0.25 + keep).softmax(dim=-1) @ v


def mask_enlarges_scores(q, k, v, mask):
    return ((q[0] @ k[0].transpose(-2, -1)) * 0.25 + mask).softmax(dim=-1) @ v[0]


def two_masks(q, k, v, keep):
    s = (q @ k.transpose(-2, -1)).masked_fill(~keep, float("-inf")) + torch.zeros(5, 5)
    return s.softmax(dim=-1) @ v


def scale_by_tensor(q, k, v, t):
    return ((q @ k.transpose(-2, -1)) * t).softmax(dim=-1) @ v


def fill_value_too_small(q, k, v, keep):
    return (q @ k.transpose(-2, -1)).masked_fill(~keep, -100.0).softmax(dim=-1) @ v


def softmax_over_minus_two(q, k, v):
    return (q @ k.transpose(-2, -1)).softmax(dim=-2) @ v


VARIANTS = [
    # fn, extra inputs, sites, mask kind, scale
    (mt_itruediv_torch_dropout, lambda: (), 1, None, 1 / 8),
    (masked_fill_before_div, lambda: (_keep(),), 1, "boolean (masked_fill)", 1 / math.sqrt(8)),
    (additive_before_scale_positive_dims, lambda: (torch.randn(1, 3, 5, 5),), 1, "additive", 0.3),
    (permute_and_left_scale_finfo_min, lambda: (_keep(),), 1, "boolean (masked_fill)", 0.5),
    (mqa_broadcast_kv, lambda: (), 1, None, 0.25),
    (bool_mask_added, lambda: (_keep(),), 0, None, None),
    (mask_enlarges_scores, lambda: (torch.zeros(2, 3, 5, 5),), 0, None, None),
    (two_masks, lambda: (_keep(),), 0, None, None),
    (scale_by_tensor, lambda: (torch.tensor([0.25]),), 0, None, None),
    (fill_value_too_small, lambda: (_keep(),), 0, None, None),
    (softmax_over_minus_two, lambda: (), 0, None, None),
]


@pytest.mark.parametrize("fn, extra, n_sites, mask, scale", VARIANTS, ids=[v[0].__name__ for v in VARIANTS])
def test_spellings_and_near_misses(fn, extra, n_sites, mask, scale):
    """Rewritten or left alone as expected; either way the compiled function gives the eager
    result (fp32, atol=rtol=1e-5)."""
    q, k, v = _qkv(kv_heads=1 if fn is mqa_broadcast_kv else None)
    args = (q, k, v, *extra())
    cap = Capture()
    got = torch.compile(fn, backend=cap)(*args)
    torch.testing.assert_close(got, fn(*args), **TOL)
    assert len(cap.graphs) == 1
    assert len(cap.sites[0]) == n_sites, cap.sites
    assert count_sdpa(cap.graphs[0]) == n_sites and has_softmax(cap.graphs[0]) == (n_sites == 0)
    if n_sites:
        (site,) = cap.sites[0]
        assert site.mask == mask and site.scale == pytest.approx(scale)


@pytest.mark.parametrize("fn", [masked_fill_before_div, permute_and_left_scale_finfo_min],
                         ids=["fill=-1e9", "fill=finfo.min"])
def test_a_query_row_masked_entirely_by_a_finite_fill_averages_v_as_the_original_does(fn):
    """Left padding masks every key of some query rows. With a finite fill value the original's
    scores in such a row are all equal, so it averages ``v``; SDPA gives zeros there, and the
    rewrite gave zeros (a probe's finding: 0.2008 against 0.0, and a training run drifting from
    its first padded step). The first call's check had passed on inputs without such a row."""
    q, k, v = _qkv()
    keep = _keep()
    keep[1] = False  # query row 1 sees no key
    for t in (q, k, v):
        t.requires_grad_(True)
    cap = Capture()
    got = torch.compile(fn, backend=cap)(q, k, v, keep)
    assert len(cap.sites[0]) == 1 and count_sdpa(cap.graphs[0]) == 1
    want = fn(q, k, v, keep)
    torch.testing.assert_close(got, want, **TOL)
    assert got[:, :, 1].abs().max() > 0.05  # the average of v, not SDPA's zeros
    weight = torch.linspace(-1.0, 1.0, want.numel()).view_as(want)
    got_grads = torch.autograd.grad((got * weight).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * weight).sum(), (q, k, v))
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, **TOL)


class TraceableNumberKeep(nn.Module):
    """For ``torch.fx.symbolic_trace``: ``masked_fill(torch.logical_not(keep), -inf)`` with
    ``keep`` a float 0/1 mask (not bool)."""

    def forward(self, q, k, v, keep):
        att = (q @ k.transpose(-2, -1) * 0.25).masked_fill(torch.logical_not(keep), float("-inf"))
        return att.softmax(dim=-1) @ v


def test_symbolic_trace_masked_fill_of_logical_not_of_a_number_mask_stays_exact():
    """Without metadata the rewrite took ``masked_fill(logical_not(keep))`` for a boolean ``keep``
    and passed ``attn_mask=keep``: a float 0/1 ``keep`` was then added to the scores instead of
    selecting keys (a probe measured a difference of 1.46). It passes ``logical_not`` of the
    condition now, which is right for any dtype."""
    q, k, v = _qkv()
    keep = _keep().float()
    gm = fx.symbolic_trace(TraceableNumberKeep())
    (site,) = rewrite_textbook_attention(gm)
    assert site.mask == "boolean (masked_fill)" and count_sdpa(gm) == 1
    torch.testing.assert_close(gm(q, k, v, keep), TraceableNumberKeep()(q, k, v, keep), **TOL)
