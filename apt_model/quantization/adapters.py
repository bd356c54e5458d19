"""Low-rank adapters (LoRA) that train on top of frozen layers, FP4 ones included (QLoRA style).

``LoRALinear(base)`` computes ``base(x) + (alpha / rank) * x A^T B^T`` with ``A`` ``(rank, in)``
initialised like ``nn.Linear`` (Kaiming-uniform) and ``B`` ``(out, rank)`` zero, so a fresh adapter
changes nothing. Only ``A`` and ``B`` train; the base can be an ``nn.Linear`` or an
:class:`~apt_model.quantization.linear.FP4Linear`, whose gradient reaches the input through the
dequantized weight while the packed weight stays frozen.

Written here rather than taken from ``peft``: it is ~40 lines, has to wrap our ``FP4Linear``
(``peft`` dispatches on ``nn.Linear``), and keeps the test suite free of another dependency.
"""
from __future__ import annotations

import fnmatch
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from apt_model.quantization.linear import FP4Linear, FP4QATLinear


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update.

    Args:
        base: an ``nn.Linear`` or :class:`FP4Linear` (kept as ``self.base``, not copied).
        rank: rank of the update (>= 1).
        alpha: scaling numerator; the update is multiplied by ``alpha / rank``.
        dropout: dropout on the adapter's input (training only).

    Input ``(..., in_features)``; output ``(..., out_features)``.

    Raises:
        TypeError: ``base`` has no ``in_features`` / ``out_features``.
        ValueError: ``rank`` < 1.
    """

    def __init__(self, base: nn.Module, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0):
        super().__init__()
        if not hasattr(base, "in_features") or not hasattr(base, "out_features"):
            raise TypeError(f"LoRALinear wraps a linear layer; {type(base).__name__} has no in/out_features")
        if int(rank) < 1:
            raise ValueError(f"rank={rank} must be >= 1")
        self.base = base
        self.rank, self.alpha = int(rank), float(alpha)
        self.scaling = self.alpha / self.rank
        ref = base.weight_data if isinstance(base, FP4Linear) else base.weight
        dtype = base.weight_dtype if isinstance(base, FP4Linear) else ref.dtype
        self.lora_a = nn.Parameter(torch.empty(self.rank, base.in_features, device=ref.device, dtype=dtype))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, self.rank, device=ref.device, dtype=dtype))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b)
        return self.base(x) + update * self.scaling

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}"


def add_lora(model: nn.Module, targets=("*",), rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
             freeze: bool = True) -> list[str]:
    """Wrap every ``nn.Linear`` / :class:`FP4Linear` / :class:`FP4QATLinear` whose qualified name
    matches a pattern in ``targets``.

    Args:
        model: modified in place.
        targets: ``fnmatch`` patterns of module names (``"*"``: every linear layer). A pattern never
            matches the model itself.
        rank, alpha, dropout: see :class:`LoRALinear`.
        freeze: set ``requires_grad=False`` on every parameter that is not an adapter's.

    Returns:
        The names of the wrapped layers.

    Raises:
        ValueError: no layer matched (nothing is changed, nothing frozen); the message names the
            patterns and a few of the model's linear layers. Until 2026-11-29 the whole model was
            frozen with no adapter added: an optimizer over ``model.parameters()`` trained nothing
            (a QAT model's ``FP4QATLinear`` layers were not matched: a probe's finding).
    """
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    kinds = (nn.Linear, FP4Linear, FP4QATLinear)
    found, linear = [], []
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            continue
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if type(child) in kinds:
                linear.append(full)
                if any(fnmatch.fnmatchcase(full, t) for t in targets):
                    found.append((module, child_name, child, full))
    if not found:
        shown = ", ".join(linear[:5]) + (f" and {len(linear) - 5} more" if len(linear) > 5 else "")
        raise ValueError(f"add_lora: no layer matched targets={list(targets)}; the model's linear layers "
                         f"({', '.join(k.__name__ for k in kinds)}) are: {shown or 'none'}")
    if freeze:
        for p in model.parameters():
            p.requires_grad_(False)
    for parent, child_name, child, _ in found:
        setattr(parent, child_name, LoRALinear(child, rank, alpha, dropout))
    return [full for *_, full in found]


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapters' parameters (``lora_a``, ``lora_b``) of every :class:`LoRALinear` in ``model``."""
    return [p for m in model.modules() if isinstance(m, LoRALinear) for p in (m.lora_a, m.lora_b)]
