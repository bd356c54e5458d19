#!/usr/bin/env python
"""Regenerate ``fp4_torchao.json``: small inputs and torchao's MXFP4 (FLOOR, RCEIL) and NVFP4 outputs.

The interop test (tests/test_fp4_interop.py) compares our packed bytes, scales and dequantized
values with these, so it runs where torchao is not installed. Needs torchao (the version below).
Arrays are stored as base64 of their little-endian bytes; dequantized values as the SHA-256 of
their fp32 bytes (the test hashes ours the same way), which keeps the file a few KB.

    pip install torchao==0.18.0 && python tests/golden/make_fp4_golden.py
"""
from __future__ import annotations

import base64
import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp4_cases import golden_inputs  # noqa: E402

OUT = Path(__file__).resolve().parent / "fp4_torchao.json"
TORCHAO_VERSION = "0.18.0"


def encode_array(t: torch.Tensor) -> str:
    """Base64 of a CPU tensor's bytes (little-endian, as stored)."""
    return base64.b64encode(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).decode("ascii")


def sha256_of(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def torchao_outputs(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """torchao's packed bytes, scale bytes and fp32 dequantization of ``x`` for each format."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    out = {}
    for rule in ("floor", "rceil"):
        t = MXTensor.to_mx(x, torch.float4_e2m1fn_x2, 32, scaling_mode=getattr(ScaleCalculationMode, rule.upper()))
        out[f"mxfp4_{rule}/data"] = t.qdata.view(torch.uint8).clone()
        out[f"mxfp4_{rule}/scales"] = t.scale.view(torch.uint8).clone()
        out[f"mxfp4_{rule}/dequantized"] = t.dequantize(torch.float32).clone()
    if x.dim() in (2, 3):
        ts = per_tensor_amax_to_scale(torch.max(torch.abs(x)))
        t = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=ts)
        out["nvfp4/data"] = t.qdata.view(torch.uint8).clone()
        out["nvfp4/scales"] = t.scale.view(torch.uint8).clone()
        out["nvfp4/tensor_scale"] = ts.clone()
        out["nvfp4/dequantized"] = t.dequantize(torch.float32).clone()
    return out


def main() -> None:
    import torchao

    if torchao.__version__ != TORCHAO_VERSION:
        raise SystemExit(f"torchao {torchao.__version__} is installed; the golden vectors pin {TORCHAO_VERSION}")
    cases = {}
    for name, x in golden_inputs().items():
        case = {"shape": list(x.shape), "input": encode_array(x)}
        for key, value in torchao_outputs(x).items():
            case[key] = sha256_of(value) if key.endswith("/dequantized") else encode_array(value)
        cases[name] = case
    golden = {"torchao_version": TORCHAO_VERSION, "torch_version": torch.__version__, "cases": cases}
    OUT.write_text(json.dumps(golden, indent=0) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(cases)} cases)")


if __name__ == "__main__":
    main()
