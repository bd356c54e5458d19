"""Native FP4 matrix products through ``torch._scaled_mm``, only where the capability probe says so.

Native FP4 matrix units exist on NVIDIA Blackwell (sm_100+) and AMD gfx950 (MI350). Everywhere
else FP4 is a storage format: weights are dequantized to the compute dtype and multiplied there,
which saves memory and bytes moved but is not faster arithmetic. This module never calls
``_scaled_mm`` with FP4 inputs unless
``apt_model.devices.capabilities.get_support(device).fp4_matmul["supported"]`` is True (the probe
itself only tries on sm_100+ / gfx950).

What the hardware wants (PyTorch's scaled-matmul tests and cuBLAS's "block scaling factors
layout" documentation): ``A`` row-major ``(M, K/2)`` float4_e2m1fn_x2, ``B`` column-major (the
weight ``(N, K/2)`` transposed), block scales per operand — E8M0 for MXFP4 (32 elements), E4M3 for
NVFP4 (16 elements, NVIDIA only) — and on CUDA the scales in cuBLAS's blocked layout
(:func:`swizzle_scales`); on ROCm plain row-major, with M and N multiples of 16 and K of 128. The
NVFP4 per-tensor scales multiply the result afterwards.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from apt_model.quantization.tensor import FP4Tensor, quantize

_TILE_ROWS, _TILE_COLS = 128, 4  # one 512-byte tile of the blocked layout


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Block scales ``(rows, cols)`` in cuBLAS's blocked ("32x4x4 swizzled") layout, flattened.

    The matrix is zero-padded to multiples of 128 rows and 4 columns and cut into 128 x 4 tiles,
    stored tile after tile (all tiles of a row band, then the next band), 512 bytes each. Inside a
    tile, scale ``(r, c)`` sits at byte ``(r % 32) * 16 + (r // 32) * 4 + c``.

    Args:
        scales: 2-d tensor of scale bytes (uint8, float8_e8m0fnu or float8_e4m3fn).

    Returns:
        1-d tensor of ``ceil(rows/128)*128 * ceil(cols/4)*4`` elements, same dtype.
    """
    if scales.dim() != 2:
        raise ValueError(f"swizzle_scales needs a 2-d scale matrix, got shape {tuple(scales.shape)}")
    rows, cols = scales.shape
    pr, pc = _ceil_to(rows, _TILE_ROWS), _ceil_to(cols, _TILE_COLS)
    raw = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    padded = torch.zeros(pr, pc, dtype=torch.uint8, device=scales.device)
    padded[:rows, :cols] = raw
    # (row band, row in band = 4 x 32, column band, column in band) -> (row band, column band, r % 32, r // 32, c)
    tiles = padded.view(pr // 128, 4, 32, pc // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).view(scales.dtype)


def unswizzle_scales(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: the ``(rows, cols)`` matrix back from the blocked layout."""
    pr, pc = _ceil_to(rows, _TILE_ROWS), _ceil_to(cols, _TILE_COLS)
    raw = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    tiles = raw.reshape(pr // 128, pc // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(pr, pc)[:rows, :cols].contiguous().view(flat.dtype)


def native_support(device: torch.device | str) -> tuple[bool, str]:
    """Whether native FP4 matrix products run on ``device``, and why (the capability probe's answer).

    A CPU (and every device type other than CUDA/ROCm) is answered without probing.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"{device.type} has no native FP4 matmul; FP4 is a storage format there"
    from apt_model.devices.capabilities import get_support

    fp4 = get_support(device).fp4_matmul
    return bool(fp4.get("supported")), str(fp4.get("reason", ""))


def shape_problem(fmt: str, m: int, n: int, k_padded: int, device: torch.device) -> str | None:
    """Why a native product of these sizes cannot run (None when it can)."""
    if device.type == "cuda" and torch.version.hip:
        if fmt != "mxfp4":
            return "ROCm has native MXFP4 only, not NVFP4"
        if m % 16 or n % 16 or k_padded % 128:
            return f"ROCm needs M, N multiples of 16 and K of 128 (M={m}, N={n}, K={k_padded})"
    elif fmt == "nvfp4" and k_padded % 32:
        return f"cuBLAS NVFP4 needs K divisible by 32 (K={k_padded})"
    return None


def _operand_scales(t: FP4Tensor, rows: int) -> torch.Tensor:
    scales = t.scales.reshape(rows, -1).view(t.scale_tensor().dtype)
    if torch.version.hip:
        return scales.contiguous()
    return swizzle_scales(scales)


def native_fp4_matmul(x: torch.Tensor, weight: FP4Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x @ weight.T`` on FP4 matrix units: ``x`` is quantized to ``weight``'s format on the fly.

    Args:
        x: ``(M, K)`` floating tensor on the weight's device.
        weight: 2-d :class:`FP4Tensor` ``(N, K)``.
        out_dtype: result dtype (bf16 is what the kernels produce natively).

    Returns:
        ``(M, N)`` tensor of ``out_dtype``.

    Raises:
        RuntimeError: the capability probe says this device has no native FP4 matmul (nothing is
            attempted), or the sizes do not fit the kernel (:func:`shape_problem`).
    """
    ok, why = native_support(x.device)
    if not ok:
        raise RuntimeError(f"native FP4 matmul is not available on {x.device}: {why}")
    if weight.data.dim() != 2 or x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"native_fp4_matmul needs x (M, K) and a 2-d weight (N, K); got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    m, n, kp = x.shape[0], weight.shape[0], weight.data.shape[1] * 2
    problem = shape_problem(weight.format, m, n, kp, x.device)
    if problem:
        raise RuntimeError(problem)
    a = quantize(x, weight.format, weight.scale_rule or "floor")
    sa, sb = _operand_scales(a, m), _operand_scales(weight, n)
    if weight.format == "mxfp4" and hasattr(F, "scaled_mm"):
        # the recipe-explicit API: 1x32 E8M0 blocks, cuBLAS's blocked layout on CUDA, plain on ROCm
        swizzle = F.SwizzleType.NO_SWIZZLE if torch.version.hip else F.SwizzleType.SWIZZLE_32_4_4
        out = F.scaled_mm(a.as_float4(), weight.as_float4().t(), sa, F.ScalingType.BlockWise1x32, sb,
                          F.ScalingType.BlockWise1x32, swizzle_a=swizzle, swizzle_b=swizzle,
                          output_dtype=torch.bfloat16)
    else:  # NVFP4 (1x16 E4M3 blocks, inferred from the scale dtype), or a torch without F.scaled_mm
        out = torch._scaled_mm(a.as_float4(), weight.as_float4().t(), sa, sb, out_dtype=torch.bfloat16)
    if weight.format == "nvfp4":
        out = out * (a.tensor_scale * weight.tensor_scale).to(out.dtype)
    return out.to(out_dtype)
