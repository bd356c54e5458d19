"""A small GPT-style decoder (pre-norm transformer, learned positions, tied embeddings).

Written the way many hand-written training scripts are: attention is the textbook
``softmax(QK^T/sqrt(d)) V`` unless ``attn_implementation="sdpa"`` — the same switch Hugging Face
models expose. With the Virtual Blackwell switch on, the eager attention is routed to SDPA when
the device's probe says it is faster, and nothing else in the model changes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from apt_model.attention.causal import CausalSelfAttention
from apt_model.base.errors import ConfigError


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`.

    Attributes:
        vocab_size: number of token ids (256 for byte-level text).
        seq_len: maximum context length (positions).
        d_model: width; n_heads must divide it.
        n_layers: transformer blocks.
        n_heads: attention heads.
        dropout: dropout probability (0 disables).
        attn_implementation: ``"eager"`` or ``"sdpa"``.
    """

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    dropout: float = 0.0
    attn_implementation: str = "eager"

    def to_dict(self) -> dict:
        return asdict(self)


#: Size presets for the main job: ``tiny`` trains in minutes on 2 CPU cores.
PRESETS = {
    "tiny": dict(d_model=128, n_layers=4, n_heads=4),
    "small": dict(d_model=256, n_layers=6, n_heads=4),
    "medium": dict(d_model=512, n_layers=8, n_heads=8),
}


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))`` (GELU, 4x width)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads, cfg.dropout, cfg.attn_implementation)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only language model.

    ``forward(idx)`` takes token ids ``(batch, seq)`` int64 with ``seq <= cfg.seq_len`` and returns
    logits ``(batch, seq, vocab_size)`` float.

    Raises:
        ConfigError: for an invalid config (non-positive sizes, heads not dividing the width).
        ValueError: in forward, for a sequence longer than ``cfg.seq_len``.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads"):
            if getattr(cfg, name) <= 0:
                raise ConfigError(f"GPTConfig.{name}={getattr(cfg, name)} must be positive")
        if not 0.0 <= cfg.dropout < 1.0:
            raise ConfigError(f"GPTConfig.dropout={cfg.dropout} must be in [0, 1)")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def num_parameters(self) -> int:
        """Number of distinct parameters (tied weights counted once)."""
        return sum(p.numel() for p in self.parameters())
