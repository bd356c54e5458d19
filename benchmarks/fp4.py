#!/usr/bin/env python
"""FP4 formats: our quantize/dequantize vs torchao's, side by side on the same tensor; and the
FP4-base fine-tune check.

``speed`` (default): a ``--size`` x ``--size`` Gaussian fp32 tensor; for MXFP4 (FLOOR), MXFP4
(RCEIL) and NVFP4, one warm-up each, then ``--reps`` rounds in which ours and torchao's quantize and
dequantize run in turn (A, B, A, B). Reported: median seconds, GB/s of fp32 input (bytes of the
fp32 tensor / time, both directions), torchao / ours, SQNR, and whether the bytes are identical.
On a GPU (``--device cuda``) the device's copy bandwidth (read + write of a tensor of the same
size) is measured in the same run for comparison.

``finetune``: runs ``training/fp4_finetune.py`` (fp32 base vs MXFP4 / NVFP4 base, low-rank
adapters, real text) and records it with the machine description.

    python benchmarks/fp4.py speed --threads 2 --json bench-results/fp4_speed.json
    python benchmarks/fp4.py finetune --threads 1 --json bench-results/fp4_finetune.json
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from measure import machine_info, summarize, write_json  # noqa: E402

from apt_model.quantization import ckernel, quantize, sqnr_db  # noqa: E402

CASES = (("mxfp4", "floor"), ("mxfp4", "rceil"), ("nvfp4", None))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def _torchao_functions(fmt: str, rule: str | None):
    """torchao's quantize (returning its tensor) and dequantize for one case, or None without torchao."""
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    except ImportError:
        return None
    if fmt == "mxfp4":
        mode = getattr(ScaleCalculationMode, rule.upper())

        def quant(x):
            return MXTensor.to_mx(x, torch.float4_e2m1fn_x2, 32, scaling_mode=mode)
    else:
        def quant(x):
            return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(torch.max(torch.abs(x))))
    return quant, lambda t: t.dequantize(torch.float32)


def copy_bandwidth(x: torch.Tensor, reps: int = 10) -> float:
    """Device copy bandwidth in GB/s (bytes read + written per second), median of ``reps``."""
    y = torch.empty_like(x)
    y.copy_(x)
    times = []
    for _ in range(reps):
        _, t = _timed(lambda: y.copy_(x), x.device)
        times.append(t)
    return 2 * x.numel() * x.element_size() / summarize(times)["median"] / 1e9


def speed(args) -> dict:
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.size, args.size, generator=gen).to(device)
    gbytes = x.numel() * 4 / 1e9
    load_start = os.getloadavg()
    rows = []
    for fmt, rule in CASES:
        name = fmt + (f" {rule.upper()}" if rule else "")
        ours_q = lambda: quantize(x, fmt, rule or "floor")  # noqa: E731
        ta = _torchao_functions(fmt, rule)
        times = {"ours_quantize": [], "ours_dequantize": [], "torchao_quantize": [], "torchao_dequantize": []}
        q, _ = _timed(ours_q, device)  # warm-up
        d = q.dequantize(torch.float32)
        t_q = t_d = None
        if ta is not None:
            t_q, _ = _timed(lambda: ta[0](x), device)
            t_d = ta[1](t_q)
        for _ in range(args.reps):  # interleaved: ours, torchao, ours, torchao
            q, s = _timed(ours_q, device)
            times["ours_quantize"].append(s)
            if ta is not None:
                t_q, s = _timed(lambda: ta[0](x), device)
                times["torchao_quantize"].append(s)
            d, s = _timed(lambda: q.dequantize(torch.float32), device)
            times["ours_dequantize"].append(s)
            if ta is not None:
                t_d, s = _timed(lambda: ta[1](t_q), device)
                times["torchao_dequantize"].append(s)
        row = {"case": name, "sqnr_db": round(sqnr_db(x, d), 3)}
        for key, samples in times.items():
            if samples:
                st = summarize(samples)
                row[key] = {**{k: round(v, 6) if isinstance(v, float) else v for k, v in st.items()},
                            "gb_per_s": round(gbytes / st["median"], 4)}
        if ta is not None:
            row["torchao_sqnr_db"] = round(sqnr_db(x, t_d), 3)
            row["bit_identical"] = bool(torch.equal(q.data, t_q.qdata.view(torch.uint8))
                                        and torch.equal(q.scales, t_q.scale.view(torch.uint8).reshape(q.scales.shape))
                                        and torch.equal(d, t_d))
            for op in ("quantize", "dequantize"):
                row[f"{op}_speedup"] = round(row[f"torchao_{op}"]["median"] / row[f"ours_{op}"]["median"], 1)
        rows.append(row)
    result = {
        "benchmark": "fp4 speed", "machine": machine_info(torch.get_num_threads(), str(device) if device.type != "cpu" else None),
        "tensor": {"shape": [args.size, args.size], "dtype": "float32", "bytes": x.numel() * 4},
        "reps": args.reps, "load_average": {"start": load_start, "end": os.getloadavg()},
        "torchao": _torchao_version(), "codec": ckernel.status() if device.type == "cpu" else "pytorch ops",
        "rows": rows,
    }
    if device.type != "cpu":
        result["device_copy_gb_per_s"] = round(copy_bandwidth(x), 1)
    return result


def _torchao_version() -> str | None:
    try:
        import torchao
        return torchao.__version__
    except ImportError:
        return None


def print_speed(result: dict) -> None:
    m = result["machine"]
    print(f"FP4 on {result['tensor']['shape']} fp32 ({result['tensor']['bytes'] / 2**20:.0f} MiB), "
          f"{m['cpu']} / {m.get('device_name') or 'cpu'}, {m['torch_threads']} threads, torchao {result['torchao']}, "
          f"load {result['load_average']['start'][0]:.2f} -> {result['load_average']['end'][0]:.2f}")
    codec = result["codec"]
    print("codec: " + (("compiled C" if codec["compiled"] else "PyTorch ops") + f" ({codec['reason']})"
                       if isinstance(codec, dict) else codec))
    print(f"{'case':<13} {'SQNR dB':>8} {'quant GB/s':>11} {'torchao':>8} {'x':>6} {'dequant GB/s':>13} "
          f"{'torchao':>8} {'x':>6}  bit-identical")
    for r in result["rows"]:
        ta_q = r.get("torchao_quantize", {}).get("gb_per_s", float("nan"))
        ta_d = r.get("torchao_dequantize", {}).get("gb_per_s", float("nan"))
        print(f"{r['case']:<13} {r['sqnr_db']:>8.2f} {r['ours_quantize']['gb_per_s']:>11.3f} {ta_q:>8.3f} "
              f"{r.get('quantize_speedup', float('nan')):>6.1f} {r['ours_dequantize']['gb_per_s']:>13.3f} "
              f"{ta_d:>8.3f} {r.get('dequantize_speedup', float('nan')):>6.1f}  {r.get('bit_identical', 'n/a')}")
    if "device_copy_gb_per_s" in result:
        print(f"device copy bandwidth (read + write): {result['device_copy_gb_per_s']} GB/s")


def finetune(args, rest: list[str]) -> dict:
    spec = importlib.util.spec_from_file_location("fp4_finetune", HERE.parent / "training" / "fp4_finetune.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    argv = list(rest) + (["--threads", str(args.threads)] if args.threads else [])
    load_start = os.getloadavg()
    out = job.main(argv)
    return {"benchmark": "fp4 finetune", "machine": machine_info(out["threads"]),
            "load_average": {"start": load_start, "end": os.getloadavg()}, **out}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", nargs="?", default="speed", choices=("speed", "finetune"))
    p.add_argument("--size", type=int, default=4096, help="speed: the tensor is size x size")
    p.add_argument("--reps", type=int, default=5, help="speed: timed rounds per case")
    p.add_argument("--device", default="cpu", help="speed: cpu or cuda")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (fixed and reported)")
    p.add_argument("--json", default=None, help="write the result here")
    args, rest = p.parse_known_args(argv)
    if args.what == "speed":
        if rest:
            p.error(f"unknown arguments for speed: {rest}")
        result = speed(args)
        print_speed(result)
    else:
        result = finetune(args, rest)
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
