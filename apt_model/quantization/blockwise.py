"""The block loops shared by MXFP4 and NVFP4: per-block maxima, scaled E2M1 encoding, decoding.

Every function here sees a tensor as ``(n_blocks, block)``: consecutive blocks of the last
dimension, contiguous. Quantizing is two passes: the block maxima (:func:`block_amax`), then —
once the format has turned them into scales and per-block factors, vectorized over all blocks —
the scaled encoding (:func:`encode_scaled_blocks`).

Two implementations give the same bits. On the CPU, for fp32, the compiled codec
(:mod:`~apt_model.quantization.ckernel`) makes one pass per loop. Everywhere else (accelerators,
16-bit inputs, no C compiler) PyTorch ops run in chunks of blocks, so the intermediates (fp32
products, int32 table indices, byte codes) stay in the CPU's cache: each chunk makes a handful of
passes over a few hundred KiB instead of over the whole tensor. On accelerators the chunks are
large (kernel launches, not caches, are what costs there).
"""
from __future__ import annotations

import torch

from apt_model.quantization import ckernel
from apt_model.quantization.e2m1 import decode_packed, decode_pair_table, encode_e2m1, pack_nibbles

#: Elements per chunk: CPU chunks fit in L2 with their intermediates; accelerators take big ones.
CHUNK_ELEMENTS = {"cpu": 1 << 18}
_ACCEL_CHUNK_ELEMENTS = 1 << 24  # 16M elements: about 250 MB of temporaries
_ABS_MASK: dict[str, torch.Tensor] = {}
#: Use the compiled CPU codec (:mod:`~apt_model.quantization.ckernel`) where it is available; the
#: tests switch this off to compare the two paths bit for bit.
PREFER_COMPILED = True


def _compiled(*tensors: torch.Tensor) -> bool:
    return PREFER_COMPILED and ckernel.usable(*tensors)


def chunk_blocks(device: torch.device, block: int) -> int:
    """Blocks per chunk on ``device`` (at least one)."""
    return max(1, CHUNK_ELEMENTS.get(device.type, _ACCEL_CHUNK_ELEMENTS) // block)


def _chunks(n_blocks: int, step: int):
    for start in range(0, n_blocks, step):
        yield start, min(start + step, n_blocks)


def _abs_mask(device: torch.device) -> torch.Tensor:
    key = str(device)
    if key not in _ABS_MASK:
        _ABS_MASK[key] = torch.tensor(0x7FFFFFFF, dtype=torch.int32, device=device)
    return _ABS_MASK[key]


def chunk_amax(blocks: torch.Tensor, out: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """Largest magnitude of each block of ``blocks`` ``(k, block)`` into float32 ``out`` ``(k,)``.

    For fp32 the maximum is taken over the bit patterns with the sign cleared, which orders every
    non-NaN value like its magnitude and puts NaN above Inf, so a block holding NaN gets NaN.
    ``work`` is an int32 (fp32 input) or float32 (16-bit input) tensor shaped like ``blocks``.
    """
    if blocks.dtype == torch.float32:
        torch.bitwise_and(blocks.view(torch.int32), _abs_mask(blocks.device), out=work)
        torch.amax(work, dim=1, out=out.view(torch.int32))
    else:
        work.copy_(blocks).abs_()  # bf16/fp16 widen exactly
        torch.amax(work, dim=1, out=out)
    return out


def block_amax(blocks: torch.Tensor) -> torch.Tensor:
    """Largest magnitude of every block of ``blocks`` ``(n_blocks, block)``: float32 ``(n_blocks,)``."""
    if blocks.dtype == torch.float32 and _compiled(blocks):
        return ckernel.block_amax(blocks)
    n, block = blocks.shape
    out = torch.empty(n, dtype=torch.float32, device=blocks.device)
    step = chunk_blocks(blocks.device, block)
    work = torch.empty(min(step, n), block, device=blocks.device,
                       dtype=torch.int32 if blocks.dtype == torch.float32 else torch.float32)
    for s, e in _chunks(n, step):
        chunk_amax(blocks[s:e], out[s:e], work[: e - s])
    return out


def decode_blocks(packed: torch.Tensor, multipliers: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values of packed blocks: ``code_value * multipliers[:, None]`` rounded in fp32, then cast to ``dtype``.

    Args:
        packed: uint8 ``(n_blocks, block // 2)``, contiguous.
        multipliers: float32 ``(n_blocks,)``, each block's scale.
        dtype: the output floating dtype.

    Returns:
        ``dtype`` tensor ``(n_blocks, block)``.
    """
    if _compiled(packed, multipliers):
        values = ckernel.decode(packed, multipliers, decode_pair_table(packed.device).view(torch.float32))
        return values if dtype == torch.float32 else values.to(dtype)
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


def encode_scaled_blocks(blocks: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """E2M1-encode ``blocks * factors[:, None]`` (product rounded in fp32), two codes per byte.

    Args:
        blocks: float32, bfloat16 or float16 ``(n_blocks, block)``, contiguous (16-bit inputs are
            widened to fp32 exactly).
        factors: float32 ``(n_blocks,)``, each block's multiplier (``1 / scale``).

    Returns:
        uint8 ``(n_blocks, block // 2)``.
    """
    if blocks.dtype == torch.float32 and _compiled(blocks, factors):
        return ckernel.encode(blocks, factors)
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
