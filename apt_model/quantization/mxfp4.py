"""MXFP4 block scales: E8M0 exponents by the FLOOR or RCEIL rule (OCP MX v1.0).

An MXFP4 block is 32 consecutive elements along the last dimension, stored as 32 E2M1 codes plus
one E8M0 scale byte: an unsigned power of two ``2^(byte - 127)``, byte 255 meaning NaN (OCP
Microscaling Formats (MX) v1.0, sections 5.3-5.4). Element value = code value x scale.

Two rules pick a block's exponent from its largest magnitude ``amax``:

* ``"floor"`` — OCP v1.0 section 6.3 and torchao's default: ``floor(log2(amax)) - 2``, read from the
  exponent bits of ``amax`` (2 = the exponent of 4, E2M1's largest power of two). Values above
  ``6 x scale`` saturate, which happens to the block maximum in roughly a third of Gaussian blocks.
* ``"rceil"`` — cuBLAS, Transformer Engine and the Blackwell conversion instruction:
  ``ceil(log2(amax / 6))``, computed exactly from the bits of the fp32 quotient ``amax / 6`` (no
  block maximum saturates). Note: ``x.to(torch.float8_e8m0fnu)`` rounds to nearest, which is
  neither rule.

Edge cases, matched bit for bit to torchao 0.18 (the interop reference) unless said otherwise:

* all-zero block: byte 0; its elements encode as +-0.
* FLOOR with ``amax < 2^-124`` (fp32 subnormal range): byte 0, but the elements are divided by
  ``2^-126`` (the smallest normal), as torchao does, so a few subnormal inputs keep a 0.5 code.
* RCEIL with ``amax / 6 <= 2^-127``: byte 0 and the elements are scaled by 1 (Transformer Engine's
  rule), so they encode as +-0.
* a block holding +-Inf (and no NaN): FLOOR byte 253, RCEIL byte 254; the Inf elements saturate
  to +-6, which dequantizes to +-Inf again; the finite elements of that block flush to +-0.
* a block holding NaN: byte 255 (NaN), so the whole block dequantizes to NaN. Its element codes
  are +-0 here (torchao stores other codes there; only the scale carries meaning).
* RCEIL, deliberate difference: torchao 0.18's eager fallback evaluates ``ceil(log2(.))`` with
  ``torch.log2`` in fp32, which rounds ``log2`` of a few thousand fp32 quotients that lie a few
  ulps above a power of two (all with ``|exponent| >= 4``) down to the integer, giving one
  exponent less than the exact rule. We follow the exact rule, as the hardware and cuBLAS do.
"""
from __future__ import annotations

import torch

from apt_model.quantization import fp32
from apt_model.quantization.e2m1 import E2M1_MAX

#: Elements per MXFP4 block (OCP MX v1.0).
MXFP4_BLOCK = 32
#: The two scale rules (see the module docstring).
SCALE_RULES = ("floor", "rceil")
E8M0_BIAS = 127
E8M0_NAN = 255
_F32_MANTISSA_BITS = 23
_E2M1_MAX_EXPONENT = 2  # 4 = 2^2, the largest power of two E2M1 holds


def check_scale_rule(rule: str) -> str:
    """Return ``rule`` lower-cased if it is a scale rule.

    Raises:
        ValueError: ``rule`` is not ``"floor"`` or ``"rceil"``.
    """
    r = rule.lower() if isinstance(rule, str) else rule
    if r not in SCALE_RULES:
        raise ValueError(f"scale_rule={rule!r} is not an MXFP4 scale rule; valid: {', '.join(SCALE_RULES)}")
    return r


def e8m0_exponents(amax: torch.Tensor, rule: str = "floor") -> torch.Tensor:
    """Biased E8M0 scale bytes of blocks whose largest magnitudes are ``amax``.

    Args:
        amax: float32 tensor of per-block maxima of ``|x|`` (NaN where a block holds NaN).
        rule: ``"floor"`` or ``"rceil"``.

    Returns:
        uint8 tensor shaped like ``amax``: ``exponent + 127`` in 0-254, or 255 for NaN.

    Raises:
        ValueError: unknown ``rule``.
    """
    rule = check_scale_rule(rule)
    amax = amax.to(torch.float32)
    if rule == "floor":
        field = (amax.view(torch.int32) >> _F32_MANTISSA_BITS) & 0xFF  # biased fp32 exponent of amax
        biased = (field - _E2M1_MAX_EXPONENT).clamp(0, 254)  # inf -> 253; zero/subnormal -> 0
    else:
        descale = fp32.div(amax, E2M1_MAX)  # a true division on every device (see fp32.div)
        bits = descale.view(torch.int32)
        field = (bits >> _F32_MANTISSA_BITS) & 0xFF
        mantissa = bits & 0x7FFFFF
        # exact ceil(log2(descale)) + 127 for normal descale; subnormal ones are <= 2^-126: 1 if
        # above 2^-127, else 0 (zero included); inf -> 254 (torchao's saturating rule)
        normal = (field + (mantissa != 0).to(torch.int32)).clamp(max=254)
        subnormal = (mantissa > (1 << 22)).to(torch.int32)
        biased = torch.where(field == 0, subnormal, normal)
        biased = torch.where(field == 0xFF, 254, biased)
    biased = torch.where(torch.isnan(amax), E8M0_NAN, biased)
    return biased.to(torch.uint8)


def _pow2(biased: torch.Tensor) -> torch.Tensor:
    """``2^(b - 127)`` as float32 for biased exponents ``b`` in 1-254 (built from the bits: exact)."""
    return (biased.to(torch.int32) << _F32_MANTISSA_BITS).view(torch.float32)


def e8m0_element_reciprocals(biased: torch.Tensor, rule: str = "floor") -> torch.Tensor:
    """The factor each block's elements are multiplied by before E2M1 rounding (float32).

    ``1 / scale``, with the rule-specific edge cases in the module docstring: FLOOR uses at most
    ``2^126`` (it divides by the smallest normal for byte 0), RCEIL uses 1 for byte 0, and a NaN
    block (255) gets 0 so its elements encode as +-0. Every factor is a power of two, so the
    product ``x * factor`` equals torchao's ``x / scale`` (FLOOR) and ``x * reciprocal`` (RCEIL).
    """
    rule = check_scale_rule(rule)
    b = biased.to(torch.int32)
    if rule == "floor":
        recip = _pow2(254 - b.clamp(1, 253))
    else:
        recip = _pow2(254 - b.clamp(1, 253))
        recip = torch.where(b == 0, 1.0, recip)
        recip = torch.where(b == 254, 2.0 ** -127, recip)
    return torch.where(b == E8M0_NAN, 0.0, recip)


def e8m0_values(biased: torch.Tensor) -> torch.Tensor:
    """Scale values ``2^(b - 127)`` of E8M0 bytes as float32 (byte 0 is 2^-127, subnormal; 255 is NaN)."""
    b = biased.to(torch.int32)
    value = torch.where(b == 0, 2.0 ** -127, _pow2(b.clamp(1, 254)))
    return torch.where(b == E8M0_NAN, float("nan"), value)
