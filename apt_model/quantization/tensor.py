"""The packed FP4 tensor (:class:`FP4Tensor`) and the quantize / dequantize entry points.

Layout of an FP4 tensor of logical shape ``(*lead, K)`` (blocks run along the last dimension):

* ``data``: uint8 ``(*lead, Kp / 2)``, two E2M1 codes per byte, element ``2i`` in the low nibble
  (PyTorch ``float4_e2m1fn_x2``; :meth:`FP4Tensor.as_float4` gives that view without a copy);
* ``scales``: uint8 ``(*lead, Kp / block)``, the bit patterns of the block scales — E8M0
  (``float8_e8m0fnu``) for MXFP4, E4M3 (``float8_e4m3fn``) for NVFP4 (:meth:`FP4Tensor.scale_tensor`);
* ``tensor_scale``: float32 0-d per-tensor scale (NVFP4), None for MXFP4.

``Kp`` is ``K`` rounded up to a multiple of the block (32 for MXFP4, 16 for NVFP4): a last dimension
that is not a multiple of the block is **padded with zeros** (zeros never change a block's scale),
and :meth:`FP4Tensor.dequantize` crops the padding away. torchao refuses such shapes; for shapes it
accepts the bytes are identical.

Storage: MXFP4 costs 4.25 bits per element (4 + 8/32), NVFP4 4.5 bits (4 + 8/16) plus 4 bytes.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from apt_model.quantization.blockwise import block_amax, decode_blocks, encode_scaled_blocks
from apt_model.quantization.mxfp4 import (MXFP4_BLOCK, check_scale_rule, e8m0_element_reciprocals,
                                          e8m0_exponents, e8m0_values)
from apt_model.quantization.nvfp4 import (NVFP4_BLOCK, nvfp4_block_multipliers, nvfp4_block_scales,
                                          nvfp4_tensor_scale)

#: Formats and their block sizes.
FORMATS = {"mxfp4": MXFP4_BLOCK, "nvfp4": NVFP4_BLOCK}
_SCALE_DTYPES = {"mxfp4": torch.float8_e8m0fnu, "nvfp4": torch.float8_e4m3fn}
_WIDENED_EXACTLY = (torch.float32, torch.bfloat16, torch.float16)


def check_format(fmt: str) -> str:
    """Return ``fmt`` lower-cased if it is an FP4 format.

    Raises:
        ValueError: ``fmt`` is not ``"mxfp4"`` or ``"nvfp4"``.
    """
    f = fmt.lower() if isinstance(fmt, str) else fmt
    if f not in FORMATS:
        raise ValueError(f"format={fmt!r} is not an FP4 format; valid: {', '.join(FORMATS)}")
    return f


class FP4Tensor:
    """A tensor stored as block-scaled FP4 (MXFP4 or NVFP4). See the module docstring for the layout.

    Attributes:
        data: uint8 ``(*lead, Kp/2)`` packed E2M1 codes.
        scales: uint8 ``(*lead, Kp/block)`` block-scale bit patterns (E8M0 or E4M3).
        tensor_scale: float32 0-d tensor (NVFP4) or None (MXFP4).
        shape: the logical shape ``(*lead, K)``.
        dtype: the dtype it was quantized from (the default of :meth:`dequantize`).
        format: ``"mxfp4"`` or ``"nvfp4"``.
        scale_rule: ``"floor"`` or ``"rceil"`` for MXFP4, None for NVFP4.
    """

    __slots__ = ("data", "scales", "tensor_scale", "shape", "dtype", "format", "scale_rule")

    def __init__(self, data: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor | None,
                 shape, dtype: torch.dtype, format: str, scale_rule: str | None = None):
        fmt = check_format(format)
        shape = torch.Size(shape)
        if len(shape) == 0:
            raise ValueError("FP4Tensor needs at least one dimension (blocks run along the last one)")
        block = FORMATS[fmt]
        padded = math.ceil(shape[-1] / block) * block
        want_data = (*shape[:-1], padded // 2)
        want_scales = (*shape[:-1], padded // block)
        if data.dtype != torch.uint8 or tuple(data.shape) != want_data:
            raise ValueError(f"{fmt} data for shape {tuple(shape)} must be uint8 {want_data}, "
                             f"got {data.dtype} {tuple(data.shape)}")
        if scales.dtype != torch.uint8 or tuple(scales.shape) != want_scales:
            raise ValueError(f"{fmt} scales for shape {tuple(shape)} must be uint8 {want_scales}, "
                             f"got {scales.dtype} {tuple(scales.shape)}")
        if fmt == "nvfp4":
            if tensor_scale is None or tensor_scale.numel() != 1:
                raise ValueError("an nvfp4 FP4Tensor needs a one-element float32 tensor_scale")
            tensor_scale = tensor_scale.to(torch.float32).reshape(())
            scale_rule = None
        else:
            if tensor_scale is not None:
                raise ValueError("an mxfp4 FP4Tensor has no tensor_scale (pass None)")
            scale_rule = check_scale_rule(scale_rule or "floor")
        self.data, self.scales, self.tensor_scale = data, scales, tensor_scale
        self.shape, self.dtype, self.format, self.scale_rule = shape, dtype, fmt, scale_rule

    # ------------------------------------------------------------------ views and sizes
    @property
    def block_size(self) -> int:
        return FORMATS[self.format]

    @property
    def device(self) -> torch.device:
        return self.data.device

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed codes, the block scales and the tensor scale."""
        extra = 4 if self.tensor_scale is not None else 0
        return self.data.numel() + self.scales.numel() + extra

    @property
    def bits_per_element(self) -> float:
        """Storage bits per logical element (4.25 for MXFP4, about 4.5 for NVFP4, more when padded)."""
        return 8.0 * self.nbytes / max(1, self.numel())

    def as_float4(self) -> torch.Tensor:
        """The codes as a ``torch.float4_e2m1fn_x2`` tensor ``(*lead, Kp/2)`` (a view, no copy)."""
        return self.data.view(torch.float4_e2m1fn_x2)

    def scale_tensor(self) -> torch.Tensor:
        """The block scales as ``float8_e8m0fnu`` (MXFP4) or ``float8_e4m3fn`` (NVFP4) (a view)."""
        return self.scales.view(_SCALE_DTYPES[self.format])

    def block_multipliers(self) -> torch.Tensor:
        """Float32 ``(n_blocks,)``: what each block's decoded codes are multiplied by."""
        flat = self.scales.reshape(-1)
        if self.format == "mxfp4":
            return e8m0_values(flat)
        return nvfp4_block_multipliers(flat, self.tensor_scale)

    # ------------------------------------------------------------------ conversion
    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The values as a ``dtype`` tensor of :attr:`shape` (default: the dtype it came from).

        Each value is ``code_value * block_multiplier`` rounded once in fp32, then cast to ``dtype``
        (for fp32 and bf16 this is bit-identical to torchao's dequantization).
        """
        dtype = dtype or self.dtype
        blocks = self.data.reshape(-1, self.block_size // 2)
        values = decode_blocks(blocks, self.block_multipliers(), dtype)
        padded = values.reshape(*self.shape[:-1], self.data.shape[-1] * 2)
        k = self.shape[-1]
        return padded if padded.shape[-1] == k else padded[..., :k].contiguous()

    def to(self, device) -> FP4Tensor:
        """A copy on ``device`` (the same object when it is already there)."""
        device = torch.device(device)
        if device == self.device:
            return self
        ts = None if self.tensor_scale is None else self.tensor_scale.to(device)
        return FP4Tensor(self.data.to(device), self.scales.to(device), ts, self.shape, self.dtype,
                         self.format, self.scale_rule)

    def equal(self, other: FP4Tensor) -> bool:
        """Bitwise equality: same format, rule, shape, codes, scales and tensor scale."""
        if (self.format, self.scale_rule, self.shape) != (other.format, other.scale_rule, other.shape):
            return False
        if not (torch.equal(self.data, other.data) and torch.equal(self.scales, other.scales)):
            return False
        if self.tensor_scale is None:
            return True
        return torch.equal(self.tensor_scale.view(torch.int32), other.tensor_scale.view(torch.int32))

    def __repr__(self) -> str:
        rule = f", scale_rule={self.scale_rule}" if self.scale_rule else ""
        ts = f", tensor_scale={float(self.tensor_scale):.6g}" if self.tensor_scale is not None else ""
        return (f"FP4Tensor(format={self.format}{rule}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}{ts}, {self.nbytes} bytes, {self.bits_per_element:.2f} bits/element)")


def _as_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` as contiguous ``(n_blocks, block)``, zero-padding the last dimension to a multiple of ``block``."""
    k = x.shape[-1]
    rows = x.reshape(math.prod(x.shape[:-1]), k)
    pad = -k % block
    if pad:
        rows = F.pad(rows, (0, pad))
    return rows.contiguous().view(-1, block)


def _check_input(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize needs a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"quantize needs a floating tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("quantize needs at least one dimension (blocks run along the last one); got a 0-d tensor")
    x = x.detach()
    return x if x.dtype in _WIDENED_EXACTLY else x.float()


def _nonfinite_error(x: torch.Tensor) -> ValueError:
    n_nan = int(torch.isnan(x).sum())
    n_inf = int(torch.isinf(x).sum())
    return ValueError(f"NVFP4 needs finite values: the tensor holds {n_nan} NaN and {n_inf} Inf, so its "
                      "per-tensor scale would not be finite; use MXFP4 (it marks such blocks NaN) or clean the tensor")


def quantize(x: torch.Tensor, format: str = "mxfp4", scale_rule: str = "floor",
             tensor_scale: torch.Tensor | float | None = None) -> FP4Tensor:
    """Quantize ``x`` to MXFP4 or NVFP4 along its last dimension.

    Args:
        x: floating tensor, at least 1-d, any device (float64 is rounded to fp32 first).
        format: ``"mxfp4"`` (OCP MX v1.0, blocks of 32, E8M0 scales) or ``"nvfp4"`` (blocks of 16,
            E4M3 scales, fp32 tensor scale).
        scale_rule: MXFP4 only: ``"floor"`` (OCP, torchao's default) or ``"rceil"`` (cuBLAS /
            Transformer Engine). See :mod:`apt_model.quantization.mxfp4`.
        tensor_scale: NVFP4 only: a per-tensor scale to use instead of ``amax / 2688`` (e.g. a
            calibrated one); must be finite and non-negative.

    Returns:
        :class:`FP4Tensor`.

    Raises:
        TypeError: ``x`` is not a floating tensor.
        ValueError: unknown format or scale rule; a 0-d tensor; NVFP4 of a tensor holding NaN/Inf;
            an invalid ``tensor_scale``.
    """
    fmt = check_format(format)
    x = _check_input(x)
    block = FORMATS[fmt]
    blocks = _as_blocks(x, block)
    lead = tuple(x.shape[:-1])
    amax = block_amax(blocks)
    ts = None
    rule = None
    if fmt == "mxfp4":
        rule = check_scale_rule(scale_rule)
        scales = e8m0_exponents(amax, rule)
        factors = e8m0_element_reciprocals(scales, rule)
    else:
        top = amax.max() if amax.numel() else torch.zeros((), device=x.device)  # max |x|, NaN if any
        if not torch.isfinite(top):
            raise _nonfinite_error(x)
        if tensor_scale is None:
            ts = nvfp4_tensor_scale(top)
        else:
            ts = torch.as_tensor(tensor_scale, dtype=torch.float32, device=x.device).reshape(())
            if not (torch.isfinite(ts) and ts >= 0):
                raise ValueError(f"tensor_scale={float(ts)} must be finite and >= 0")
        scales, factors = nvfp4_block_scales(amax, ts)
    data = encode_scaled_blocks(blocks, factors)
    padded = math.ceil(x.shape[-1] / block) * block
    return FP4Tensor(data.reshape(*lead, padded // 2), scales.reshape(*lead, padded // block),
                     ts, x.shape, x.dtype, fmt, rule)


def quantize_mxfp4(x: torch.Tensor, scale_rule: str = "floor") -> FP4Tensor:
    """``quantize(x, "mxfp4", scale_rule)``."""
    return quantize(x, "mxfp4", scale_rule=scale_rule)


def quantize_nvfp4(x: torch.Tensor, tensor_scale: torch.Tensor | float | None = None) -> FP4Tensor:
    """``quantize(x, "nvfp4", tensor_scale=tensor_scale)``."""
    return quantize(x, "nvfp4", tensor_scale=tensor_scale)


def dequantize(t: FP4Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t.dequantize(dtype)``."""
    return t.dequantize(dtype)


def fake_quantize(x: torch.Tensor, format: str = "mxfp4", scale_rule: str = "floor") -> torch.Tensor:
    """``dequantize(quantize(x))`` in ``x``'s dtype: the value FP4 storage would give back (no autograd)."""
    return quantize(x, format, scale_rule).dequantize(x.dtype)
