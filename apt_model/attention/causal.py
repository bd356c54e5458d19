"""Causal multi-head self-attention with two implementations, chosen by ``attn_implementation``.

* ``"eager"`` — the textbook form: ``softmax(QK^T / sqrt(d) + causal mask) V``, materializing the
  ``T x T`` score matrix, as many hand-written models do.
* ``"sdpa"`` — :func:`torch.nn.functional.scaled_dot_product_attention` with ``is_causal=True``,
  which dispatches to a fused kernel (flash / memory-efficient / cuDNN) where the device has one.

The two are mathematically equal (fp32 results agree to rounding). The class declares
``supported_attn_implementations``: that is the protocol the switch's router looks for in any
module, the project's or the user's (see :mod:`apt_model.attention.routing`).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from apt_model.base.errors import ConfigError


class CausalSelfAttention(nn.Module):
    """Causal self-attention over ``x`` of shape ``(batch, seq, d_model)``, float.

    Args:
        d_model: model width; must be divisible by ``n_heads``.
        n_heads: number of heads.
        dropout: dropout on attention probabilities and on the output projection (training only).
        attn_implementation: ``"eager"`` or ``"sdpa"``.

    Raises:
        ConfigError: when ``d_model % n_heads != 0`` or the implementation is unknown.
    """

    supported_attn_implementations = ("eager", "sdpa")

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, attn_implementation: str = "eager"):
        super().__init__()
        if d_model % n_heads:
            raise ConfigError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        if attn_implementation not in self.supported_attn_implementations:
            raise ConfigError(
                f"attn_implementation={attn_implementation!r}; valid: {', '.join(self.supported_attn_implementations)}"
            )
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.dropout = dropout
        self.attn_implementation = attn_implementation
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        if self.attn_implementation == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = self.attn_drop(att) @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))
