"""NVFP4 scales: an fp32 per-tensor scale and one E4M3 scale per block of 16 elements.

NVFP4 (NVIDIA Blackwell; NVIDIA's NVFP4 documentation and Transformer Engine's recipe; torchao's
``NVFP4Tensor`` is the interop reference matched bit for bit):

* block: 16 consecutive elements along the last dimension, stored as E2M1 codes;
* tensor scale ``s_t = amax(|x|) / (448 * 6)`` in fp32 (448 = E4M3's largest value, 6 = E2M1's), so
  the largest block scale can use E4M3's whole range;
* block scale ``s_b = E4M3(clamp((block_amax / 6) / s_t, 2^-6, 448))`` — a round-to-nearest-even
  cast to ``float8_e4m3fn``. The lower clamp is ``torch.finfo(float8_e4m3fn).tiny`` = 2^-6, as in
  torchao 0.18 (DESIGN.md's summary says 2^-9; the reference code uses 2^-6 and we match the code);
* elements: E2M1 of ``x * ((1 / s_t) / s_b)``, the product rounded in fp32 first;
* dequantize: ``code_value * (s_t * s_b)``, the two scales multiplied first (torchao's order).

Defined edge cases (torchao 0.18 returns NaN or Inf for all of them):

* a tensor holding NaN or +-Inf cannot get a tensor scale: quantizing raises ``ValueError``;
* a tensor whose ``s_t`` is below the smallest normal fp32 (``amax < 2688 * 2^-126``, about
  3.2e-35; an all-zero tensor included) is stored as zeros: codes +-0, block scales 2^-6,
  ``s_t`` as computed. It dequantizes to zeros.
"""
from __future__ import annotations

import torch

from apt_model.quantization.e2m1 import E2M1_MAX

#: Elements per NVFP4 block.
NVFP4_BLOCK = 16
#: Largest finite float8_e4m3fn value.
E4M3_MAX = 448.0
#: Smallest normal float8_e4m3fn value, the lower clamp of block scales (torchao 0.18).
E4M3_MIN = 2.0 ** -6
_F32_MIN_NORMAL = 2.0 ** -126


def nvfp4_tensor_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """Per-tensor scale ``amax / (448 * 6)`` as a 0-d float32 tensor."""
    amax = torch.as_tensor(amax).to(torch.float32).reshape(())
    return amax / (E4M3_MAX * E2M1_MAX)


def tensor_scale_is_usable(tensor_scale: torch.Tensor) -> bool:
    """Whether elements can be scaled by ``1 / tensor_scale`` (a normal fp32 value, finite)."""
    s = float(tensor_scale)
    return _F32_MIN_NORMAL <= s < float("inf")


def nvfp4_block_scales(block_amax: torch.Tensor, tensor_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 block scales and the per-block factor the elements are multiplied by.

    Args:
        block_amax: float32 tensor of per-block maxima of ``|x|``.
        tensor_scale: 0-d float32 per-tensor scale (see :func:`nvfp4_tensor_scale`).

    Returns:
        ``(scale_bytes, factors)``: uint8 bit patterns of the float8_e4m3fn block scales, and
        float32 ``(1 / tensor_scale) / block_scale`` (0 where the tensor is stored as zeros), both
        shaped like ``block_amax``.
    """
    tensor_scale = tensor_scale.to(device=block_amax.device, dtype=torch.float32)
    if not tensor_scale_is_usable(tensor_scale):
        scales = torch.full_like(block_amax, E4M3_MIN).to(torch.float8_e4m3fn)
        return scales.view(torch.uint8), torch.zeros_like(block_amax)
    block = block_amax.to(torch.float32) / E2M1_MAX
    scales = torch.clamp(block / tensor_scale, min=E4M3_MIN, max=E4M3_MAX).to(torch.float8_e4m3fn)
    factors = (1.0 / tensor_scale) / scales.to(torch.float32)
    return scales.view(torch.uint8), factors


def nvfp4_block_multipliers(scale_bytes: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """What each block's decoded codes are multiplied by: ``tensor_scale * e4m3_scale`` (float32)."""
    scales = scale_bytes.view(torch.float8_e4m3fn).to(torch.float32)
    return tensor_scale.to(device=scales.device, dtype=torch.float32) * scales
