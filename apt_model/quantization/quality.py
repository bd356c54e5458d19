"""Quantization quality: signal-to-quantization-noise ratio."""
from __future__ import annotations

import math

import torch


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """SQNR in dB: ``10 log10(sum(reference^2) / sum((reference - approx)^2))``, computed in float64.

    Returns ``inf`` when the two are equal.

    Raises:
        ValueError: the shapes differ.
    """
    if reference.shape != approx.shape:
        raise ValueError(f"sqnr_db needs equal shapes, got {tuple(reference.shape)} and {tuple(approx.shape)}")
    ref = reference.detach().double()
    noise = (ref - approx.detach().double()).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10.0 * math.log10(signal / noise)
