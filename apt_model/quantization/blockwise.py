"""The block loop shared by MXFP4 and NVFP4: per-block maxima, scaled E2M1 encoding, decoding.

Every function here sees a tensor as ``(n_blocks, block)``: consecutive blocks of the last
dimension, contiguous. Work is done in chunks of blocks so the intermediates (fp32 products,
int32 table indices, byte codes) stay in the CPU's cache: each chunk makes a handful of passes
over a few hundred KiB instead of over the whole tensor. On accelerators the chunks are large
(kernel launches, not caches, are what costs there).
"""
from __future__ import annotations

import torch

from apt_model.quantization.e2m1 import decode_packed, encode_e2m1, pack_nibbles

#: Elements per chunk: CPU chunks fit in L2 with their intermediates; accelerators take big ones.
CHUNK_ELEMENTS = {"cpu": 1 << 18}
_ACCEL_CHUNK_ELEMENTS = 1 << 26


def chunk_blocks(device: torch.device, block: int) -> int:
    """Blocks per chunk on ``device`` (at least one)."""
    return max(1, CHUNK_ELEMENTS.get(device.type, _ACCEL_CHUNK_ELEMENTS) // block)


def _chunks(n_blocks: int, step: int):
    for start in range(0, n_blocks, step):
        yield start, min(start + step, n_blocks)


def block_amax(blocks: torch.Tensor) -> torch.Tensor:
    """Largest magnitude of each block, float32 ``(n_blocks,)``; NaN where a block holds NaN.

    Args:
        blocks: float32, bfloat16 or float16 tensor ``(n_blocks, block)``, contiguous.
    """
    n, block = blocks.shape
    out = torch.empty(n, dtype=torch.float32, device=blocks.device)
    step = chunk_blocks(blocks.device, block)
    work = torch.empty(min(step, n), block, dtype=torch.float32, device=blocks.device)
    for s, e in _chunks(n, step):
        w = work[: e - s]
        if blocks.dtype == torch.float32:
            torch.abs(blocks[s:e], out=w)
        else:
            w.copy_(blocks[s:e]).abs_()  # bf16/fp16 widen exactly
        torch.amax(w, dim=1, out=out[s:e])
    return out


def encode_blocks(blocks: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """E2M1-encode ``blocks * factors[:, None]`` (product rounded in fp32) and pack two codes per byte.

    Args:
        blocks: float32, bfloat16 or float16 tensor ``(n_blocks, block)``, contiguous (the 16-bit
            ones are widened to fp32 exactly).
        factors: float32 ``(n_blocks,)``, the per-block multiplier (``1 / scale``).

    Returns:
        uint8 ``(n_blocks, block // 2)``.
    """
    n, block = blocks.shape
    dev = blocks.device
    packed = torch.empty(n, block // 2, dtype=torch.uint8, device=dev)
    step = chunk_blocks(dev, block)
    m = min(step, n)
    scaled = torch.empty(m, block, dtype=torch.float32, device=dev)
    work = torch.empty(m * block, dtype=torch.int32, device=dev)
    codes = torch.empty(m, block, dtype=torch.uint8, device=dev)
    pair_work = torch.empty(m, block // 2, dtype=torch.int16, device=dev)
    for s, e in _chunks(n, step):
        k = e - s
        y = scaled[:k]
        torch.mul(blocks[s:e], factors[s:e, None], out=y)
        c = encode_e2m1(y, out=codes[:k], work=work[: k * block])
        pack_nibbles(c, out=packed[s:e], work=pair_work[:k])
    return packed


def decode_blocks(packed: torch.Tensor, multipliers: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values of packed blocks: ``code_value * multipliers[:, None]`` rounded in fp32, then cast to ``dtype``.

    Args:
        packed: uint8 ``(n_blocks, block // 2)``, contiguous.
        multipliers: float32 ``(n_blocks,)``, each block's scale.
        dtype: the output floating dtype.

    Returns:
        ``dtype`` tensor ``(n_blocks, block)``.
    """
    n, half = packed.shape
    block = half * 2
    dev = packed.device
    out = torch.empty(n, block, dtype=dtype, device=dev)
    step = chunk_blocks(dev, block)
    values = torch.empty(min(step, n), block, dtype=torch.float32, device=dev)
    for s, e in _chunks(n, step):
        v = values[: e - s]
        decode_packed(packed[s:e], out=v)
        if dtype == torch.float32:
            torch.mul(v, multipliers[s:e, None], out=out[s:e])
        else:
            v.mul_(multipliers[s:e, None])
            out[s:e].copy_(v)
    return out
