"""FP4 formats and layers: MXFP4 and NVFP4, bit-compatible with PyTorch's float4_e2m1fn_x2 and torchao.

* :mod:`~apt_model.quantization.e2m1` — the E2M1 element codec and nibble packing;
* :mod:`~apt_model.quantization.mxfp4` / :mod:`~apt_model.quantization.nvfp4` — the block-scale rules;
* :mod:`~apt_model.quantization.blockwise` — the chunked block loop both formats share;
* :mod:`~apt_model.quantization.tensor` — :class:`FP4Tensor`, :func:`quantize`, :func:`dequantize`;
* :mod:`~apt_model.quantization.quality` — SQNR.

See ``docs/fp4.md``.
"""
from apt_model.quantization.quality import sqnr_db
from apt_model.quantization.tensor import (FORMATS, FP4Tensor, dequantize, fake_quantize, quantize,
                                           quantize_mxfp4, quantize_nvfp4)

__all__ = ["FORMATS", "FP4Tensor", "dequantize", "fake_quantize", "quantize", "quantize_mxfp4",
           "quantize_nvfp4", "sqnr_db"]
