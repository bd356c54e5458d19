"""Probes that run on the device itself: what works there, and what is faster there.

Each probe is small (tiny tensors for support checks; one transformer block for speed checks),
returns plain dicts that go straight into reports, and never raises: a failure becomes the
exact error text. :mod:`apt_model.devices.capabilities` caches the results per device.

Speed probes time forward + backward, interleave the candidates (A, B, A, B, ...), discard a
warm-up, and compare medians, so a burst of noise hits both sides alike.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from apt_model.devices.plugins import describe_exception

#: dtypes whose support is probed, by their torch names.
PROBED_DTYPES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
)
LOW_PRECISION = {"float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float4_e2m1fn_x2"}


def short_error(err: BaseException, limit: int = 300) -> str:
    """The error as one line, cut to ``limit`` characters."""
    text = describe_exception(err).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _sync(device: torch.device) -> None:
    if device.type == "cpu":
        return
    mod = getattr(torch, device.type, None)
    if mod is not None and hasattr(mod, "synchronize"):
        mod.synchronize(device)


def _try(fn: Callable[[], object]) -> str | None:
    try:
        fn()
        return None
    except Exception as err:  # noqa: BLE001 - the error text is the probe's answer
        return short_error(err)


# ----------------------------------------------------------------------------- support


def probe_dtypes(device: torch.device) -> dict[str, dict]:
    """Which dtypes can be stored, cast to, and used in a matmul and an add on ``device``.

    Returns:
        ``{dtype_name: {"storage": bool, "cast": bool, "matmul": bool, "add": bool, "errors": {...}}}``;
        dtypes missing from this torch are reported with ``"present": False``.
    """
    out: dict[str, dict] = {}
    for name in PROBED_DTYPES:
        dt = getattr(torch, name, None)
        if dt is None:
            out[name] = {"present": False, "storage": False, "cast": False, "matmul": False, "add": False, "errors": {}}
            continue
        errors: dict[str, str] = {}
        res = {"present": True}
        if name == "float4_e2m1fn_x2":  # packed pairs: only a byte view, no arithmetic in torch
            e = _try(lambda: torch.zeros(8, dtype=torch.uint8, device=device).view(dt))
            res["storage"] = e is None
            if e:
                errors["storage"] = e
            e = _try(lambda: torch.ones(8, device=device).to(dt))
            res["cast"] = e is None
            if e:
                errors["cast"] = e
            res["matmul"] = res["add"] = False
            errors["matmul"] = "packed FP4 has no plain matmul; see fp4_matmul"
        else:
            e = _try(lambda: torch.zeros(8, dtype=dt, device=device))
            res["storage"] = e is None
            if e:
                errors["storage"] = e
            a = torch.randn(16, 16)
            e = _try(lambda: a.to(device=device, dtype=dt))
            res["cast"] = e is None
            if e:
                errors["cast"] = e
            e = _try(lambda: (a.to(device=device, dtype=dt) @ a.to(device=device, dtype=dt)).float().cpu())
            res["matmul"] = e is None
            if e:
                errors["matmul"] = e
            e = _try(lambda: (a.to(device=device, dtype=dt) + a.to(device=device, dtype=dt)).float().cpu())
            res["add"] = e is None
            if e:
                errors["add"] = e
        res["errors"] = errors
        out[name] = res
    return out


def probe_sdpa_backends(device: torch.device) -> dict[str, dict[str, str]]:
    """Which SDPA backends run on ``device`` for fp32, bf16 and fp16 (causal, small shapes).

    Returns:
        ``{backend_name: {dtype_name: "ok" | error_text}}`` for every ``SDPBackend`` except ERROR.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out: dict[str, dict[str, str]] = {}
    for bname, backend in SDPBackend.__members__.items():
        if bname == "ERROR":
            continue
        per_dtype: dict[str, str] = {}
        for dname in ("float32", "bfloat16", "float16"):
            dt = getattr(torch, dname)

            def run():
                q = torch.randn(1, 2, 16, 64, device=device, dtype=dt)
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, q, q, is_causal=True)
                _sync(device)

            err = _try(run)
            per_dtype[dname] = "ok" if err is None else err
        out[bname] = per_dtype
    return out


def probe_fp8_matmul(device: torch.device) -> dict:
    """Whether ``torch._scaled_mm`` runs with float8_e4m3fn inputs on ``device``."""
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return {"supported": False, "reason": "this torch has no float8_e4m3fn / _scaled_mm"}

    def run():
        a = torch.randn(32, 32, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(32, 32, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        _sync(device)

    err = _try(run)
    return {"supported": err is None, "reason": "torch._scaled_mm ran with float8_e4m3fn" if err is None else err}


def fp4_hardware(device: torch.device, properties: dict) -> tuple[bool, str]:
    """Whether the device has native FP4 matrix units: NVIDIA sm_100+ (Blackwell) or AMD gfx950."""
    if device.type != "cuda":
        return False, f"{device.type} has no native FP4 matmul; FP4 is a storage format there"
    if torch.version.hip:
        arch = str(properties.get("gcnArchName", ""))
        if arch.startswith("gfx950"):
            return True, f"AMD {arch} has FP4 matrix instructions"
        return False, f"AMD {arch or 'GPU'} lacks FP4 matrix instructions (gfx950 has them)"
    major = int(properties.get("major", 0))
    minor = int(properties.get("minor", 0))
    if major >= 10:
        return True, f"sm_{major}{minor} (Blackwell) has FP4 tensor cores"
    return False, f"sm_{major}{minor} lacks FP4 tensor cores (Blackwell sm_100+ has them)"


def probe_fp4_matmul(device: torch.device, properties: dict) -> dict:
    """Native FP4 (MXFP4) matmul: tried only where the hardware has it, never elsewhere.

    Returns:
        ``{"hardware": bool, "supported": bool, "reason": str}``.
    """
    hw, why = fp4_hardware(device, properties)
    if not hw:
        return {"hardware": False, "supported": False, "reason": f"not attempted: {why}"}
    if not hasattr(torch, "float4_e2m1fn_x2") or not hasattr(torch, "float8_e8m0fnu"):
        return {"hardware": True, "supported": False, "reason": "this torch lacks float4_e2m1fn_x2 / float8_e8m0fnu"}

    def run():
        m = n = k = 128
        a = torch.zeros(m, k // 2, dtype=torch.uint8, device=device).view(torch.float4_e2m1fn_x2)
        b = torch.zeros(n, k // 2, dtype=torch.uint8, device=device).view(torch.float4_e2m1fn_x2).t()
        # blocked (swizzled) E8M0 scales: one per 32 elements, padded to 128 x 4 tiles; 127 = 2^0
        sa = torch.full((m * (k // 32),), 127, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)
        sb = torch.full((n * (k // 32),), 127, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)
        torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
        _sync(device)

    err = _try(run)
    return {"hardware": True, "supported": err is None, "reason": why if err is None else f"{why}, but the call failed: {err}"}


# ----------------------------------------------------------------------------- speed


def _time_interleaved(fns: dict[str, Callable[[], None]], device: torch.device, reps: int,
                      abort_ratio: float | None = None, baseline: str | None = None) -> dict[str, list[float]]:
    """Warm each fn up once, then run ``reps`` interleaved rounds; return seconds per timed run.

    With ``abort_ratio`` and a ``baseline``, a candidate that cannot win is dropped early, so a
    dtype 30x slower than fp32 (bf16 on CPUs without bf16 units) does not blow the time budget:
    after warm-up if its warm-up took over ``3 * abort_ratio`` times the baseline's (its one timed
    sample is then the warm-up), and after two rounds if even its fastest run is over
    ``abort_ratio`` times the baseline's median. Two samples are needed for the second rule, so
    one noisy run cannot turn an optimization off.
    """
    times: dict[str, list[float]] = {k: [] for k in fns}
    warm: dict[str, float] = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        _sync(device)
        warm[name] = time.perf_counter() - t0
    active = list(fns)
    if abort_ratio and baseline:
        for name in list(active):
            if name != baseline and warm[name] > 3 * abort_ratio * warm[baseline]:
                times[name] = [warm[name]]
                active.remove(name)
    for r in range(reps):
        for name in list(active):
            t0 = time.perf_counter()
            fns[name]()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
        if abort_ratio and baseline and r == 1:
            base = statistics.median(times[baseline])
            for name in list(active):
                if name != baseline and min(times[name]) > abort_ratio * base:
                    active.remove(name)
    return times


def attention_workloads(device: torch.device, batch: int, heads: int, seq: int, head_dim: int) -> dict:
    """The attention A/B pair the probes and ``apt-vb bench`` time: causal attention, forward +
    backward, fp32, on (batch, heads, seq, head_dim) inputs.

    Returns:
        ``{"eager": fn, "sdpa": fn}``: hand-written masked softmax, and
        ``F.scaled_dot_product_attention(is_causal=True)``; each call runs one forward + backward.
    """
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, requires_grad=True) for _ in range(3))
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()

    def eager():
        att = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        (att @ v).sum().backward()

    def sdpa():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return {"eager": eager, "sdpa": sdpa}


def probe_attention_speed(device: torch.device, width: int, seq: int, batch: int, reps: int = 5) -> dict:
    """Causal attention, forward + backward, fp32: hand-written masked softmax vs SDPA.

    Returns:
        ``{"eager_ms", "sdpa_ms", "speedup"}`` (speedup = eager / sdpa, medians) or ``{"error"}``.
    """
    heads = max(1, width // 64)
    try:
        t = _time_interleaved(attention_workloads(device, batch, heads, seq, width // heads), device, reps)
    except Exception as err:  # noqa: BLE001
        return {"error": short_error(err)}
    e, s = statistics.median(t["eager"]), statistics.median(t["sdpa"])
    return {"eager_ms": round(e * 1e3, 3), "sdpa_ms": round(s * 1e3, 3), "speedup": round(e / s, 3)}


def representative_block(width: int, device: torch.device) -> nn.Module:
    """A pre-norm transformer block (attention through SDPA, GELU MLP 4x) of the given width."""
    heads = max(1, width // 64)
    block = nn.TransformerEncoderLayer(
        width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True, device=device
    )
    block._vb_internal = True  # a probe, not a user model: the switch must not adopt it
    return block


def probe_autocast_speed(device: torch.device, width: int, seq: int, batch: int,
                         dtypes: tuple[str, ...] = ("bfloat16",), reps: int = 5) -> dict[str, dict]:
    """Forward + backward of :func:`representative_block`: fp32 vs autocast to each dtype.

    Returns:
        ``{dtype_name: {"fp32_ms", "autocast_ms", "speedup"} | {"error"} | {"fp32_ms", "autocast_ms",
        "speedup", "aborted": True}}``; speedup = fp32 / autocast (medians); ``aborted`` means the
        dtype was clearly over 3x slower than fp32 and its remaining runs were skipped.
    """
    out: dict[str, dict] = {}
    try:
        block = representative_block(width, device)
        x = torch.randn(batch, seq, width, device=device, requires_grad=True)
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=device)
    except Exception as err:  # noqa: BLE001
        return {d: {"error": short_error(err)} for d in dtypes}

    def fp32():
        block(x, src_mask=mask, is_causal=True).sum().backward()

    fns: dict[str, Callable[[], None]] = {"fp32": fp32}
    for dname in dtypes:
        dt = getattr(torch, dname)

        def amp(dt=dt):
            with torch.autocast(device.type, dtype=dt):
                y = block(x, src_mask=mask, is_causal=True)
            y.float().sum().backward()

        err = _try(amp)
        if err is not None:
            out[dname] = {"error": err}
        else:
            fns[dname] = amp
    try:
        t = _time_interleaved(fns, device, reps, abort_ratio=3.0, baseline="fp32")
    except Exception as err:  # noqa: BLE001
        return {d: {"error": short_error(err)} for d in dtypes}
    base = statistics.median(t["fp32"])
    for dname in fns:
        if dname == "fp32":
            continue
        amp_t = statistics.median(t[dname])
        res = {"fp32_ms": round(base * 1e3, 3), "autocast_ms": round(amp_t * 1e3, 3), "speedup": round(base / amp_t, 3)}
        if len(t[dname]) < reps:
            res["aborted"] = True
        out[dname] = res
    return out
