"""The E2M1 element: the 4-bit float inside MXFP4 and NVFP4, and how two of them share a byte.

Format (OCP Microscaling Formats (MX) v1.0, section 5.3.3; NVIDIA's ``__nv_fp4_e2m1``; PyTorch's
``torch.float4_e2m1fn_x2``): bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa. Codes 0-7
are the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8-15 their negatives (8 is -0). There is
no Inf and no NaN.

Encoding rules used here (the same as torchao's, which is the interop reference):

* round to nearest, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
  3.5 -> 4, 5 -> 4);
* saturating: every magnitude above 5, +-Inf included, becomes +-6;
* the sign is kept for values that round to zero (-0.1 -> code 8, -0.0 -> code 8);
* NaN becomes code 0 (+0). The block formats mark a block holding NaN through its scale instead.

Packing (PyTorch ``float4_e2m1fn_x2``, NVIDIA ``__nv_fp4x2_e2m1``, torchao): along the last,
contiguous dimension element ``2i`` goes in the low nibble and element ``2i+1`` in the high
nibble of byte ``i``. (bitsandbytes puts the first element in the high nibble: not compatible.)

How encoding is fast without a compiled kernel: the code of an fp32 value depends only on its top
16 bits (sign, exponent, 7 mantissa bits) once the low 16 bits are folded into the lowest of them
as a "sticky" bit (round-to-odd). Every rounding boundary of E2M1 is a short bf16 value with an even
last bit, so a value folded this way never lands on a boundary it was not exactly on, and one
65,536-entry table lookup gives the correctly rounded code. The table is built from
:func:`reference_codes`, a direct nearest-value search, and covers every sign, zero, subnormal,
Inf and NaN pattern.
"""
from __future__ import annotations

import sys
import threading

import torch

#: Magnitude of codes 0-7 (codes 8-15 are the same values, negated).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Value of each of the 16 codes (code 8 is -0.0).
E2M1_VALUES = E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES)
#: Largest magnitude (the saturation value).
E2M1_MAX = 6.0

_LITTLE_ENDIAN = sys.byteorder == "little"
_lock = threading.Lock()
_encode_tables: dict[str, torch.Tensor] = {}
_decode_tables: dict[tuple[str, torch.dtype], torch.Tensor] = {}
_constants: dict[str, tuple] = {}


def reference_codes(values: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of ``values`` by a direct nearest-value search (slow; builds the tables, and tests).

    Args:
        values: a floating tensor of any shape (computed in float64, so every fp32/bf16 value is exact).

    Returns:
        uint8 tensor of the same shape with codes 0-15, following the rules in the module docstring.
    """
    v = values.detach().to(torch.float64).cpu()
    mag = v.abs().reshape(-1, 1)
    grid = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    dist = (mag - grid).abs()
    nearest = dist == dist.min(dim=1, keepdim=True).values
    idx = torch.arange(8)
    even = nearest & (idx % 2 == 0)
    # one nearest grid value, or a tie between two neighbours: one of them has the even code
    code = torch.where(even.any(dim=1), (even * idx).sum(dim=1), nearest.to(torch.int64).argmax(dim=1))
    code = torch.where(mag.flatten() > 5.0, 7, code)  # saturation: above the last boundary, Inf included
    nan = torch.isnan(v.flatten())
    code = torch.where(nan, 0, code)
    sign = torch.signbit(v.flatten()) & ~nan
    return (code | (sign.to(torch.int64) << 3)).to(torch.uint8).reshape(values.shape)


def encode_table(device: torch.device) -> torch.Tensor:
    """The encoding table: uint8 codes of the 65,536 round-to-odd top halves, indexed by
    ``(top 16 bits of the fp32 pattern, as a signed number) + 32768`` (built once per device)."""
    key = str(device)
    table = _encode_tables.get(key)
    if table is None:
        with _lock:
            table = _encode_tables.get(key)
            if table is None:
                hi16 = torch.arange(-32768, 32768, dtype=torch.int32)
                table = reference_codes((hi16 << 16).view(torch.float32)).to(device)
                _encode_tables[key] = table
    return table


def decode_pair_table(device: torch.device) -> torch.Tensor:
    """For every byte, its two decoded elements (low nibble first) as one int64 holding two fp32
    patterns; ``.view(torch.float32)`` gives the 512 floats (built once per device)."""
    key = (str(device), torch.float32)
    table = _decode_tables.get(key)
    if table is None:
        with _lock:
            table = _decode_tables.get(key)
            if table is None:
                values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
                byte = torch.arange(256)
                pairs = torch.stack([values[byte & 0xF], values[byte >> 4]], dim=1)  # (256, 2): low, high
                table = pairs.contiguous().view(torch.int64).reshape(256).to(device)
                _decode_tables[key] = table
    return table


def _int32_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """0-d int32 tensors 0xFFFF, 16 and 32768 (a Python scalar costs a conversion on every call)."""
    key = str(device)
    consts = _constants.get(key)
    if consts is None:
        consts = tuple(torch.tensor(v, dtype=torch.int32, device=device) for v in (0xFFFF, 16, 32768))
        _constants[key] = consts
    return consts


def encode_e2m1(values: torch.Tensor, out: torch.Tensor | None = None,
                work: torch.Tensor | None = None) -> torch.Tensor:
    """E2M1 codes (one per byte, unpacked) of fp32 ``values``.

    Args:
        values: float32 tensor, contiguous, any shape.
        out: optional uint8 tensor with ``values.numel()`` elements to write into.
        work: optional int32 scratch tensor with ``values.numel()`` elements.

    Returns:
        uint8 tensor shaped like ``values``, codes 0-15.

    Raises:
        TypeError: ``values`` is not float32.
        ValueError: ``values`` is not contiguous.
    """
    if values.dtype != torch.float32:
        raise TypeError(f"encode_e2m1 needs float32 values, got {values.dtype}; convert with .float() first")
    if not values.is_contiguous():
        raise ValueError("encode_e2m1 needs a contiguous tensor; call .contiguous() first")
    bits = values.view(torch.int32).reshape(-1)
    if work is None:
        work = torch.empty_like(bits)
    work = work.reshape(-1)
    low_mask, shift, offset = _int32_constants(values.device)
    # sticky: bit 16 of ((low 16 bits) + 0xFFFF) is set exactly when the low 16 bits are not all zero
    torch.bitwise_and(bits, low_mask, out=work)
    work.add_(low_mask)
    work.bitwise_or_(bits)
    work.bitwise_right_shift_(shift)  # top 16 bits with the sticky bit folded in, sign-extended
    work.add_(offset)
    table = encode_table(values.device)
    if out is None:
        return table.index_select(0, work).reshape(values.shape)
    torch.index_select(table, 0, work, out=out.reshape(-1))
    return out


def pack_nibbles(codes: torch.Tensor, out: torch.Tensor | None = None,
                 work: torch.Tensor | None = None) -> torch.Tensor:
    """Pack codes two per byte: element ``2i`` in the low nibble, ``2i+1`` in the high nibble.

    Args:
        codes: uint8 tensor of codes 0-15; its last dimension must be even.
        out: optional uint8 tensor of the result's shape to write into.
        work: optional int16 scratch tensor shaped like ``codes.view(torch.int16)``.

    Returns:
        uint8 tensor with the last dimension halved.

    Raises:
        ValueError: the last dimension is odd.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dimension, got shape {tuple(codes.shape)}")
    codes = codes.contiguous()
    shape = (*codes.shape[:-1], codes.shape[-1] // 2)
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8, device=codes.device)
    if _LITTLE_ENDIAN:  # a uint8 pair read as int16 holds element 2i in its low byte
        pair = codes.view(torch.int16)
        work = torch.bitwise_right_shift(pair, 4) if work is None else torch.bitwise_right_shift(pair, 4, out=work)
        work.bitwise_or_(pair)
        out.copy_(work.view(shape))  # keeps the low byte: element 2i | element 2i+1 << 4
        return out
    return torch.bitwise_or(codes[..., 0::2], codes[..., 1::2] << 4, out=out)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 ``(..., n)`` -> codes ``(..., 2n)``."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def decode_e2m1(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of unpacked codes (uint8, 0-15) as ``dtype`` (every E2M1 value is exact in any float dtype)."""
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=codes.device)
    return table[codes.long()]


def decode_packed(packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode packed bytes to fp32 values, two per byte (low nibble first).

    Args:
        packed: uint8 tensor ``(..., n)``, contiguous.
        out: optional contiguous float32 tensor with ``2 * packed.numel()`` elements.

    Returns:
        float32 tensor ``(..., 2n)``.
    """
    idx = packed.reshape(-1).to(torch.int32)
    table = decode_pair_table(packed.device)
    shape = (*packed.shape[:-1], packed.shape[-1] * 2)
    if out is None:
        return table.index_select(0, idx).view(torch.float32).reshape(shape)
    torch.index_select(table, 0, idx, out=out.view(torch.int64).reshape(-1))
    return out
