"""FP4: MXFP4 and NVFP4 formats bit-compatible with PyTorch's float4_e2m1fn_x2 and torchao, FP4
weight storage, FP4 quantization-aware training, native FP4 matmul where the hardware has it.

* :mod:`~apt_model.quantization.e2m1` — the E2M1 element codec and nibble packing;
* :mod:`~apt_model.quantization.mxfp4` / :mod:`~apt_model.quantization.nvfp4` — the block-scale rules;
* :mod:`~apt_model.quantization.blockwise` — the chunked block loop both formats share;
* :mod:`~apt_model.quantization.tensor` — :class:`FP4Tensor`, :func:`quantize`, :func:`dequantize`;
* :mod:`~apt_model.quantization.quality` — SQNR;
* :mod:`~apt_model.quantization.linear` — :class:`FP4Linear` (frozen storage, native compute),
  :class:`FP4QATLinear` (quantization-aware training);
* :mod:`~apt_model.quantization.native` — ``torch._scaled_mm`` on FP4 units, scale swizzling;
* :mod:`~apt_model.quantization.adapters` — low-rank adapters on frozen (FP4) layers;
* :mod:`~apt_model.quantization.footprint` — module bytes, releasing frozen weights;
* :mod:`~apt_model.quantization.policy` — which layers convert, and the switch's FP4 step.

See ``docs/fp4.md``.
"""
from apt_model.quantization.adapters import LoRALinear, add_lora, lora_parameters
from apt_model.quantization.linear import FP4Linear, FP4QATLinear, fake_quantize_ste
from apt_model.quantization.footprint import module_bytes, release_parameter
from apt_model.quantization.native import native_support, swizzle_scales, unswizzle_scales
from apt_model.quantization.policy import FP4Policy, convert_to_fp4, plan_fp4
from apt_model.quantization.quality import sqnr_db
from apt_model.quantization.tensor import (FORMATS, FP4Tensor, dequantize, fake_quantize, quantize,
                                           quantize_mxfp4, quantize_nvfp4)

__all__ = [
    "FORMATS", "FP4Linear", "FP4Policy", "FP4QATLinear", "FP4Tensor", "LoRALinear", "add_lora",
    "convert_to_fp4", "dequantize", "fake_quantize", "fake_quantize_ste", "lora_parameters", "module_bytes",
    "native_support", "plan_fp4", "quantize", "quantize_mxfp4", "quantize_nvfp4", "release_parameter",
    "sqnr_db", "swizzle_scales", "unswizzle_scales",
]
