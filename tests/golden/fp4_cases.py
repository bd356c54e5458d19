"""Inputs shared by the golden-vector generator and the torchao interop test.

Every case is small (a few hundred values) and deterministic. The tie cases place elements
exactly on E2M1 rounding boundaries *after* scaling: for MXFP4 each block's maximum is 4 x 2^s, so
the block scale is 2^s under both rules and ``t x 2^s`` scales to exactly ``t``; for NVFP4 the
tensor maximum is 2688 (tensor scale 1) and a block whose maximum is 6 x 2^j gets the E4M3 scale
2^j exactly.
"""
from __future__ import annotations

import torch

TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _tie_block(width: int, shift: int, gen: torch.Generator) -> torch.Tensor:
    """One block of ``width`` values: its maximum, then ties (both signs), then random values, all x 2^shift."""
    ties = torch.tensor(TIES + tuple(-t for t in TIES))
    rest = torch.empty(width - 1 - len(ties)).uniform_(-4, 4, generator=gen)
    return torch.cat([torch.tensor([4.0]), ties, rest]) * 2.0 ** shift


def mx_ties(gen: torch.Generator) -> torch.Tensor:
    return torch.stack([_tie_block(32, s, gen) for s in (-20, -3, 0, 0, 5, 17)]).reshape(3, 64)


def nv_ties(gen: torch.Generator) -> torch.Tensor:
    blocks = []
    for j in (-4, -1, 0, 2, 5):
        b = _tie_block(16, 0, gen)
        b[0] = 6.0  # block maximum 6 x 2^j -> E4M3 scale exactly 2^j
        blocks.append(b * 2.0 ** j)
    top = torch.zeros(16)
    top[0] = 2688.0  # tensor maximum: tensor scale 2688 / (448 * 6) = 1
    blocks.append(top)
    return torch.stack(blocks).reshape(3, 32)


def golden_inputs() -> dict[str, torch.Tensor]:
    """Named fp32 inputs (2-D or 3-D, last dimension a multiple of 32)."""
    gen = torch.Generator().manual_seed(2026)
    magnitudes = torch.tensor([1e-3, 1.0, 1e3, 3e-30]).repeat_interleave(2)[:, None]
    special = torch.randn(4, 32, generator=gen)
    special[0] = 0.0
    special[1, :8] = torch.tensor([-0.0, 1e-40, -3e-39, 1e-38, 0.0, 2e-45, -1e-44, 5e-39])
    special[1, 8:] = 0.0
    special[2] *= 3e38 / special[2].abs().max()  # blocks near the top of the fp32 range
    return {
        "gauss": torch.randn(2, 64, generator=gen),
        "magnitudes": torch.randn(8, 32, generator=gen) * magnitudes,
        "three_d": torch.randn(2, 2, 32, generator=gen) * 0.02,
        "mx_ties": mx_ties(gen),
        "nv_ties": nv_ties(gen),
        "special_mx": special,
    }
