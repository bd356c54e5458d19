"""fp32 arithmetic that gives the same bits on every device.

The FP4 formats are defined by a short sequence of fp32 operations (see
:mod:`apt_model.quantization.nvfp4`). IEEE-754 makes a single ``+ - * /`` on two fp32 operands
correctly rounded (round to nearest, ties to even) on every conforming device, so a sequence of
such single operations gives the same bits everywhere — provided each one really runs as that
operation. Two things in PyTorch can silently change an operation:

* **Division by a host scalar on CUDA.** ``tensor / 6.0`` (a Python number) or ``tensor / t`` where
  ``t`` is a 0-d *CPU* tensor is computed by CUDA's true-division kernel as ``tensor * fp32(1 / b)``
  (``div_true_kernel_cuda`` in ``aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu``; "this may
  lose one bit of precision"), while the CPU kernel divides. For fp32 ``x / 6`` and
  ``x * fp32(1/6)`` differ in about a third of all values, ``x / 2688`` and ``x * fp32(1/2688)`` in
  about a quarter. This is what made NVFP4 on an H100 differ from the CPU (issue 11).
  :func:`div` therefore always divides by a tensor on the dividend's own device.
* **Contraction** of a multiply and an add into one fused multiply-add (one rounding instead of
  two), which compilers may do inside one kernel (``-ffp-contract=fast``, GPU compilers by
  default). PyTorch's eager kernels each do one operation, so there is nothing to contract across
  ops; the FP4 path uses no op that multiplies and adds in one kernel (``addcmul``, ``addmm``,
  ``lerp``...), and the compiled CPU codec is built with ``-ffp-contract=off``. ``torch.compile``
  is outside this guarantee: its code generators may rewrite ``x / c`` as ``x * (1/c)`` or fuse.

Subnormal fp32 values are part of the arithmetic (tiny blocks, tiny tensors). PyTorch's CUDA
kernels keep them (no flush-to-zero), and so does the CPU unless ``torch.set_flush_denormal(True)``
was called, which makes the CPU flush subnormal operands and results in the calling thread only:
FP4 bits are defined with it off (the default).
"""
from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_constants: dict[tuple[float, str], torch.Tensor] = {}


def constant(value: float, device: torch.device | str) -> torch.Tensor:
    """A cached 0-d float32 tensor holding ``value`` on ``device``.

    Args:
        value: a number exactly representable in fp32 (6.0, 2688.0, 1.0...).
        device: where the tensor lives.

    Returns:
        0-d float32 tensor (shared: never modify it in place).

    Raises:
        ValueError: ``value`` is not exact in fp32 (rounding it here would hide an extra rounding).
    """
    key = (float(value), str(device))
    t = _constants.get(key)
    if t is None:
        host = torch.tensor(float(value), dtype=torch.float32)
        if float(host) != float(value):
            raise ValueError(f"{value!r} is not exact in fp32; pass an fp32 tensor instead")
        t = host.to(device)
        with _lock:
            t = _constants.setdefault(key, t)
    return t


def div(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """``a / b``: one correctly rounded IEEE-754 fp32 division per element, the same bits on every device.

    The divisor is made a float32 tensor on ``a``'s device (a Python number becomes a cached
    constant there, a tensor elsewhere is moved), so CUDA never takes its host-scalar shortcut
    ``a * fp32(1/b)``. Broadcasting follows ``torch.div``.

    Args:
        a: float32 tensor, any shape, any device.
        b: float32 tensor broadcastable with ``a`` (any device), or a number exact in fp32.

    Returns:
        float32 tensor on ``a``'s device, shaped like ``a`` broadcast with ``b``.

    Raises:
        TypeError: ``a`` or a tensor ``b`` is not float32 (a silent conversion would be one more
            rounding).
        ValueError: a number ``b`` is not exact in fp32.
    """
    if a.dtype != torch.float32:
        raise TypeError(f"fp32.div needs a float32 dividend, got {a.dtype}")
    if isinstance(b, torch.Tensor):
        if b.dtype != torch.float32:
            raise TypeError(f"fp32.div needs a float32 divisor, got {b.dtype}")
        b = b.to(a.device)
    else:
        b = constant(b, a.device)
    return torch.div(a, b)
