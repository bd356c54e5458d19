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

The definition, op by op (the same bits on every device)
--------------------------------------------------------
``rn()`` is one IEEE-754 fp32 operation, correctly rounded to nearest, ties to even, subnormals
kept. Every step is either exact or a single ``rn(a op b)`` of two fp32 operands; IEEE-754 gives
such an operation exactly one result, so CPU, CUDA and the compiled C codec agree as long as each
step runs as written:

1. ``a_b = max |x_i|`` over a block, ``A = max a_b`` — exact (a maximum of sign-cleared bit patterns).
2. ``s_t = rn(A / 2688)`` — a division (2688 = 448 * 6 is exact in fp32), not ``A * rn(1/2688)``.
3. ``d_b = rn(a_b / 6)`` — a division, not ``a_b * rn(1/6)``.
4. ``q_b = rn(d_b / s_t)``.
5. ``s_b = E4M3_rne(clamp(q_b, 2^-6, 448))`` — the clamp is exact, and in that range every
   implementation of the cast (PyTorch's integer code on CPU and GPU, the hardware's
   ``cvt.rn.satfinite``) rounds to the same nearest-even E4M3 value; E4M3 subnormals never occur.
6. ``r = rn(1 / s_t)``; 7. ``f_b = rn(r / s_b)`` (``inf`` where ``r / s_b`` overflows, which needs
   ``s_t < 2^-122``, i.e. a tensor amax below about 5e-34, and a small block scale: that block's
   nonzero elements then saturate to +-6, its zeros encode as +0 — the same on every device).
8. ``y_i = rn(x_i * f_b)``, then ``code_i = E2M1_rne(y_i)`` (bit-exact table or integer rounding).
9. dequantize: ``m_b = rn(s_t * s_b)``, ``v_i = rn(value(code_i) * m_b)``.

Why each step is device-independent: every division is done by :func:`apt_model.quantization.fp32.div`,
with the divisor on the dividend's device — a plain ``tensor / 6.0`` is what broke it on an H100:
CUDA computes a division by a host scalar (a Python number or a 0-d CPU tensor) as
``x * rn(1/6)``, which differs from ``rn(x / 6)`` for about a third of all fp32 values (a quarter
for 2688), flipping the E4M3 rounding of blocks next to a tie and, through a one-ulp different
``s_t``, element codes next to an E2M1 tie and every dequantized value. Multiplications by a host
scalar are plain products on every device. No step multiplies and adds, so there is nothing an
FMA could contract (the C codec is built with ``-ffp-contract=off`` all the same), and no step
uses a wider intermediate than fp32: the CPU kernels compute fp32 ops in fp32, as CUDA does (a
Python number is converted to fp32 first, exactly, since every constant here is exact in fp32).
Subnormal ``d_b``, ``y_i`` and inputs are computed as IEEE subnormals on both (CUDA kernels do not
flush; the CPU does not unless ``torch.set_flush_denormal(True)``, which is not supported here).
``torch.compile`` of this code is outside the definition (its code generators may rewrite a
division by a constant into a multiplication). ``tests/test_fp4_device_independence.py`` checks
the sequence against a float64 model with every op rounded to fp32, and under an emulation of
CUDA's host-scalar division.

Defined edge cases (torchao 0.18 returns NaN or Inf for all of them):

* a tensor holding NaN or +-Inf cannot get a tensor scale: quantizing raises ``ValueError``;
* a tensor whose ``s_t`` is below the smallest normal fp32 (``amax < 2688 * 2^-126``, about
  3.2e-35; an all-zero tensor included) is stored as zeros: codes +-0, block scales 2^-6,
  ``s_t`` as computed. It dequantizes to zeros.
"""
from __future__ import annotations

import torch

from apt_model.quantization import fp32
from apt_model.quantization.e2m1 import E2M1_MAX

#: Elements per NVFP4 block.
NVFP4_BLOCK = 16
#: Largest finite float8_e4m3fn value.
E4M3_MAX = 448.0
#: Smallest normal float8_e4m3fn value, the lower clamp of block scales (torchao 0.18).
E4M3_MIN = 2.0 ** -6
_F32_MIN_NORMAL = 2.0 ** -126


def nvfp4_tensor_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """Per-tensor scale ``rn(amax / 2688)`` (2688 = 448 * 6) as a 0-d float32 tensor on ``amax``'s device.

    Args:
        amax: the tensor's largest magnitude: a one-element tensor (rounded to fp32 first if it
            is not fp32) or a number.

    Returns:
        0-d float32 tensor (step 2 of the module docstring: a true division on every device).
    """
    amax = torch.as_tensor(amax).to(torch.float32).reshape(())
    return fp32.div(amax, E4M3_MAX * E2M1_MAX)


def tensor_scale_is_usable(tensor_scale: torch.Tensor) -> bool:
    """Whether elements can be scaled by ``1 / tensor_scale`` (a normal fp32 value, finite)."""
    s = float(tensor_scale)
    return _F32_MIN_NORMAL <= s < float("inf")


def nvfp4_block_scales(block_amax: torch.Tensor, tensor_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 block scales and the per-block factor the elements are multiplied by.

    Args:
        block_amax: float32 tensor of per-block maxima of ``|x|`` (finite), any shape and device.
        tensor_scale: 0-d float32 per-tensor scale (see :func:`nvfp4_tensor_scale`); moved to
            ``block_amax``'s device.

    Returns:
        ``(scale_bytes, factors)``: uint8 bit patterns of the float8_e4m3fn block scales, and
        float32 ``(1 / tensor_scale) / block_scale`` (0 where the tensor is stored as zeros), both
        shaped like ``block_amax``.
    """
    tensor_scale = tensor_scale.to(device=block_amax.device, dtype=torch.float32)
    if not tensor_scale_is_usable(tensor_scale):
        scales = torch.full_like(block_amax, E4M3_MIN).to(torch.float8_e4m3fn)
        return scales.view(torch.uint8), torch.zeros_like(block_amax)
    # steps 3-7 of the module docstring: every division a true fp32 division on the blocks' device
    block = fp32.div(block_amax.to(torch.float32), E2M1_MAX)
    scales = torch.clamp(fp32.div(block, tensor_scale), min=E4M3_MIN, max=E4M3_MAX).to(torch.float8_e4m3fn)
    reciprocal = fp32.div(fp32.constant(1.0, block_amax.device), tensor_scale)
    factors = fp32.div(reciprocal, scales.to(torch.float32))
    return scales.view(torch.uint8), factors


def nvfp4_block_multipliers(scale_bytes: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """What each block's decoded codes are multiplied by: ``rn(tensor_scale * e4m3_scale)``.

    Args:
        scale_bytes: uint8 E4M3 bit patterns, any shape and device.
        tensor_scale: 0-d float32 per-tensor scale (moved to ``scale_bytes``' device).

    Returns:
        float32 tensor shaped like ``scale_bytes`` (step 9 of the module docstring).
    """
    scales = scale_bytes.view(torch.float8_e4m3fn).to(torch.float32)
    return tensor_scale.to(device=scales.device, dtype=torch.float32) * scales
