"""FP4 quantization gives the same bits on every device: the arithmetic, checked on a CPU.

Why: on an NVIDIA H100 the NVFP4 codes and scales of a tensor differed from the CPU's (issue 11;
MXFP4 matched). The cause was ``tensor / python_float``. PyTorch's CUDA true-division kernel turns
a divisor that lives on the host (a Python number, or a 0-d CPU tensor) into a multiplication by
its fp32 reciprocal, ``a * fp32(1 / b)`` (``aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu``,
"this may lose one bit of precision"); the CPU kernel divides. ``amax / 2688`` and
``block_amax / 6`` then differ by one ulp for about a quarter / a third of all values, which flips
the E4M3 rounding of the block scales that sit next to a rounding boundary, and with them the codes.

What runs here without a GPU:

* :func:`test_nvfp4_equals_the_stepwise_fp32_reference`: the quantizer (both CPU codecs) against an
  independent float64 model of the op sequence in :mod:`apt_model.quantization.nvfp4`, every op
  rounded to fp32 explicitly, on inputs built to sit next to every rounding boundary;
* :func:`test_the_inputs_tell_division_from_reciprocal_multiplication`: the same model with CUDA's
  host-scalar rewrite gives other bits on those inputs (so the test above can fail);
* :func:`test_quantizing_under_cudas_host_scalar_rewrite_changes_nothing`: quantizing under a
  dispatch mode that makes the CPU do what CUDA does with host-scalar divisors changes no bit, and
  no such division is left;
* :func:`test_the_float_arithmetic_is_single_rounded_ops_only`: the floating-point ops of the path
  are single, individually rounded IEEE operations (nothing that multiplies and adds in one kernel,
  where a compiler could contract to an FMA).

With a GPU (``python -m pytest -m gpu``), :func:`test_cuda_gives_the_cpu_bits_on_adversarial_inputs`
compares the device with the CPU bit for bit on the same inputs.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from apt_model.quantization import blockwise, quantize
from apt_model.quantization.e2m1 import E2M1_MAGNITUDES

aten = torch.ops.aten
F64 = torch.float64
E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
FORMATS = [("mxfp4", "floor"), ("mxfp4", "rceil"), ("nvfp4", None)]


@pytest.fixture(params=["compiled", "pytorch"])
def codec(request, monkeypatch):
    """Run on the compiled CPU codec (where it builds) and on the pure-PyTorch block loop."""
    monkeypatch.setattr(blockwise, "PREFER_COMPILED", request.param == "compiled")
    return request.param


# --------------------------------------------------------------------------- the float64 model
def f32(t: torch.Tensor) -> torch.Tensor:
    """Round float64 values to the nearest fp32 (ties to even, subnormals kept), back in float64.

    Every fp32 op below is computed exactly or nearly in float64 and rounded once here: a product
    of two fp32 values is exact in float64, and a float64 quotient rounded again to fp32 is the
    correctly rounded fp32 quotient (53 >= 2 * 24 + 2, so the double rounding is innocuous).
    """
    return t.to(torch.float32).to(F64)


def _e4m3_grid() -> torch.Tensor:
    """The 127 non-negative finite float8_e4m3fn values, index = bit pattern (0x7F is NaN)."""
    vals = [(b & 7) / 8 * 2.0 ** -6 if b >> 3 == 0 else (1 + (b & 7) / 8) * 2.0 ** ((b >> 3) - 7)
            for b in range(0x7F)]
    return torch.tensor(vals, dtype=F64)


E4M3_GRID = _e4m3_grid()
E2M1_GRID = torch.tensor(E2M1_MAGNITUDES, dtype=F64)


def nearest_even(values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the grid value nearest to each of ``values`` (1-d float64, finite, >= 0); between
    two equally near neighbours the even index (the even last mantissa bit) wins."""
    dist = (values[:, None] - grid[None, :]).abs()
    nearest = dist == dist.min(dim=1, keepdim=True).values
    idx = torch.arange(len(grid))
    even = nearest & (idx % 2 == 0)
    return torch.where(even.any(dim=1), (even.long() * idx).sum(dim=1), nearest.long().argmax(dim=1))


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of float64 ``y`` (fp32 values): nearest, ties to even, saturating, sign kept, NaN -> 0."""
    flat = y.reshape(-1)
    nan = torch.isnan(flat)
    mag = torch.where(nan, 0.0, flat.abs()).clamp(max=6.0)
    code = nearest_even(mag, E2M1_GRID)
    sign = torch.signbit(flat) & ~nan
    return (code | (sign.long() << 3)).reshape(y.shape)


def _by_constant(v: torch.Tensor, c: float, host_divisions: str) -> torch.Tensor:
    """``v / c`` in fp32: divided ("divide", the definition) or multiplied by fp32(1/c) ("reciprocal",
    what CUDA did with a host-scalar divisor)."""
    if host_divisions == "divide":
        return f32(v / c)
    return f32(v * f32(torch.tensor(1.0 / c, dtype=F64)))


def reference_nvfp4(x: torch.Tensor, host_divisions: str = "divide") -> dict[str, torch.Tensor]:
    """NVFP4 of ``x`` by the op sequence of :mod:`apt_model.quantization.nvfp4`, in float64 with each
    op rounded to fp32 by :func:`f32`.

    Args:
        x: float32 tensor whose last dimension is a multiple of 16, finite.
        host_divisions: ``"divide"`` (the definition) or ``"reciprocal"`` (the two divisions by
            constants done as CUDA does a host-scalar division: multiplied by fp32(1/c)).

    Returns:
        ``codes`` int64 ``(n_blocks, 16)``, ``scales`` int64 ``(n_blocks,)`` (E4M3 bit patterns),
        ``tensor_scale`` float32 0-d, ``dequantized`` float32 ``(n_blocks, 16)``.
    """
    blocks = x.detach().to(torch.float32).reshape(-1, 16).to(F64)
    # step numbers as in the docstring of apt_model/quantization/nvfp4.py
    a_b = blocks.abs().amax(dim=1)                                  # 1. block maxima, exact
    s_t = _by_constant(a_b.max(), 2688.0, host_divisions)           # 2. s_t = A / 2688
    if s_t < 2.0 ** -126:                                           # stored as zeros
        scale_idx = torch.full_like(a_b, 8, dtype=torch.long)       # E4M3 2^-6
        y = blocks * 0.0
    else:
        d = _by_constant(a_b, 6.0, host_divisions)                  # 3. d_b = a_b / 6
        q = f32(d / s_t)                                            # 4. q_b = d_b / s_t
        scale_idx = nearest_even(q.clamp(2.0 ** -6, 448.0), E4M3_GRID)  # 5. s_b = E4M3(clamp(q_b))
        s_b = E4M3_GRID[scale_idx]
        r = f32(1.0 / s_t)                                          # 6. r = 1 / s_t
        f = f32(r / s_b)                                            # 7. f_b = r / s_b
        y = f32(blocks * f[:, None])                                # 8. y = x * f_b
    codes = e2m1_codes(y)                                           # 8. E2M1(y)
    m = f32(s_t * E4M3_GRID[scale_idx])                             # 9. m_b = s_t * s_b
    values = torch.tensor([*E2M1_MAGNITUDES, *(-v for v in E2M1_MAGNITUDES)], dtype=F64)
    deq = f32(values[codes] * m[:, None])                           # 9. code value * m_b
    return {"codes": codes, "scales": scale_idx, "tensor_scale": s_t.to(torch.float32),
            "dequantized": deq.to(torch.float32)}


# --------------------------------------------------------------------------- adversarial inputs
def _ulp_neighbours(values: torch.Tensor, k: int) -> torch.Tensor:
    """fp32 ``values`` (1-d) and their neighbours up to ``k`` ulps below and above: ``(2k+1) * n``."""
    out, up, down = [values], values, values
    for _ in range(k):
        up = torch.nextafter(up, torch.tensor(float("inf")))
        down = torch.nextafter(down, torch.tensor(float("-inf")))
        out += [up, down]
    return torch.cat(out)


def _blocks_with_maxima(maxima: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One 16-element block per maximum: the maximum (random sign, random place), then values of
    random sign in (-max, max)."""
    n = maxima.numel()
    rest = (torch.rand(n, 16, generator=gen, dtype=F64) * 2 - 1) * maxima.to(F64)[:, None]
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).to(F64)
    rest[torch.arange(n), torch.randint(0, 16, (n,), generator=gen)] = maxima.to(F64) * sign
    return rest.to(torch.float32)


def _e2m1_tie_blocks(maxima: torch.Tensor, s_t: torch.Tensor) -> torch.Tensor:
    """Blocks whose elements scale to (and one ulp beside) E2M1 rounding ties: ``t / f_b``, with the
    block factor ``f_b`` of the reference model; elements above the block maximum are dropped."""
    a = maxima.to(F64)
    s_b = E4M3_GRID[nearest_even(f32(f32(a / 6.0) / s_t).clamp(2.0 ** -6, 448.0), E4M3_GRID)]
    f = f32(f32(1.0 / s_t) / s_b)
    ties = torch.tensor([*E2M1_TIES, *(-t for t in E2M1_TIES)], dtype=F64)
    rows = []
    for k in (-1, 0, 1):
        x = f32(ties[None, :] / f[:, None]).to(torch.float32)
        for _ in range(abs(k)):
            x = torch.nextafter(x, torch.full_like(x, float("inf") if k > 0 else float("-inf")))
        x = torch.where(x.abs() <= maxima[:, None], x, 0.0)
        rows.append(torch.cat([maxima[:, None], x, torch.zeros(len(maxima), 1)], dim=1))
    return torch.cat(rows)


def _tensor_around(amax: float, gen: torch.Generator, offsets: int = 3) -> torch.Tensor:
    """A tensor whose largest magnitude is ``amax`` (fp32), with blocks whose maxima put ``q_b`` on
    and beside every E4M3 rounding tie, on both clamp ends, at the top, zero, and E2M1-tie blocks."""
    A = torch.tensor(amax, dtype=torch.float32)
    s_t = f32(A.to(F64) / 2688.0)
    mids = (E4M3_GRID[8:-1] + E4M3_GRID[9:]) / 2                   # ties between normal E4M3 values
    targets = torch.cat([mids, torch.tensor([2.0 ** -6, 448.0, 2.0 ** -7, 2.0 ** -9], dtype=F64)])
    maxima = _ulp_neighbours(f32(targets * 6.0 * s_t).to(torch.float32), offsets)
    maxima = torch.cat([maxima, _ulp_neighbours(A.reshape(1), offsets), A * 1e-9 * torch.ones(2)])
    maxima = maxima[(maxima <= A) & (maxima > 0)]
    blocks = [_blocks_with_maxima(maxima, gen), _e2m1_tie_blocks(maxima[:: max(1, len(maxima) // 40)], s_t)]
    zeros = torch.zeros(3, 16)
    zeros[1] = -0.0
    zeros[2, ::2] = -0.0
    top = torch.zeros(1, 16)
    top[0, 5] = -A
    out = torch.cat([*blocks, zeros, top])
    pad = torch.zeros(-len(out) % 4, 16)  # whole rows of 64 (two MXFP4 blocks)
    return torch.cat([out, pad]).reshape(-1, 64)


def _first_amax_where_reciprocal_differs(start: float, c: float) -> float:
    """The first fp32 value from ``start`` up whose ``/ c`` differs from ``* fp32(1/c)``."""
    v = torch.tensor(start, dtype=torch.float32)
    for _ in range(64):
        if _by_constant(v.to(F64), c, "divide") != _by_constant(v.to(F64), c, "reciprocal"):
            return float(v)
        v = torch.nextafter(v, torch.tensor(float("inf")))
    raise AssertionError(f"no fp32 value near {start} tells / {c} from * (1/{c})")


def adversarial_inputs() -> dict[str, torch.Tensor]:
    """Named fp32 inputs (last dimension a multiple of 64) that sit next to the rounding boundaries
    of NVFP4 (and of MXFP4's scale rules, through ``x * 2^k`` maxima)."""
    gen = torch.Generator().manual_seed(11)
    min_normal_amax = 2688 * 2.0 ** -126  # tensor scale exactly 2^-126, the smallest usable one
    cases = {
        "gauss": torch.randn(64, 512, generator=gen),
        "unit": _tensor_around(1.0, gen),
        "ugly": _tensor_around(3.7, gen),
        "reciprocal_differs": _tensor_around(_first_amax_where_reciprocal_differs(1.2345, 2688.0), gen),
        "small": _tensor_around(1.1e-20, gen),
        "large": _tensor_around(3.1e38, gen),
        # tensor scale just above the smallest normal: subnormal d_b, factors that overflow to Inf
        "subnormal": _tensor_around(1.5 * min_normal_amax, gen),
    }
    for k in (-2, -1, 0, 1, 2):  # tensor scales around 2^-126: usable, or stored as zeros
        x = torch.randn(4, 64, generator=gen)
        x = x / x.abs().max() * min_normal_amax
        v = torch.tensor(min_normal_amax, dtype=torch.float32)
        for _ in range(abs(k)):
            v = torch.nextafter(v, torch.tensor(float("inf") if k > 0 else float("-inf")))
        x[0, 0] = v
        cases[f"tensor_scale_edge{k:+d}"] = x
    subnormals = torch.randn(4, 64, generator=gen) * 1e-39
    subnormals[0, :8] = torch.tensor([2e-45, -2e-45, 1e-44, 0.0, -0.0, 1.17e-38, 6e-39, -3e-39])
    cases["subnormal_inputs"] = subnormals
    return cases


ADVERSARIAL = adversarial_inputs()


def _codes(q) -> torch.Tensor:
    d = q.data.reshape(-1).long()
    return torch.stack([d & 0xF, d >> 4], dim=1).reshape(-1, 16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


# --------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_nvfp4_equals_the_stepwise_fp32_reference(name, codec):
    x = ADVERSARIAL[name]
    ref = reference_nvfp4(x)
    q = quantize(x, "nvfp4")
    assert torch.equal(_bits(q.tensor_scale), _bits(ref["tensor_scale"])), name
    assert torch.equal(q.scales.reshape(-1).long(), ref["scales"]), name
    assert torch.equal(_codes(q), ref["codes"]), name
    assert torch.equal(_bits(q.dequantize()).reshape(-1, 16), _bits(ref["dequantized"])), name


def test_the_inputs_really_reach_the_boundaries():
    """The adversarial set hits exact E4M3 ties, both clamp ends, E2M1 ties, subnormal d_b,
    infinite factors and the stored-as-zeros tensors (else the reference test proves less)."""
    seen = dict.fromkeys(["e4m3_tie", "clamp_low", "clamp_high", "e2m1_tie", "subnormal_d", "inf_factor",
                          "zeros"], False)
    mids = (E4M3_GRID[8:-1] + E4M3_GRID[9:]) / 2
    for x in ADVERSARIAL.values():
        blocks = x.reshape(-1, 16).to(F64)
        a_b = blocks.abs().amax(dim=1)
        s_t = f32(a_b.max() / 2688.0)
        if s_t < 2.0 ** -126:
            seen["zeros"] = True
            continue
        d = f32(a_b / 6.0)
        q = f32(d / s_t)
        seen["subnormal_d"] |= bool(((d > 0) & (d < 2.0 ** -126)).any())
        seen["e4m3_tie"] |= bool(torch.isin(q, mids).any())
        seen["clamp_low"] |= bool((q < 2.0 ** -6).any())
        seen["clamp_high"] |= bool((q > 448.0).any())
        s_b = E4M3_GRID[nearest_even(q.clamp(2.0 ** -6, 448.0), E4M3_GRID)]
        f = f32(f32(1.0 / s_t) / s_b)
        seen["inf_factor"] |= bool(torch.isinf(f).any())
        y = f32(blocks * f[:, None])
        seen["e2m1_tie"] |= bool(torch.isin(y.abs(), torch.tensor(E2M1_TIES, dtype=F64)).any())
    assert all(seen.values()), seen


def test_the_inputs_tell_division_from_reciprocal_multiplication():
    """What CUDA did (``* fp32(1/c)`` for the two divisions by constants) gives other scales, codes
    and tensor scales on these inputs than the definition: the reference test above can fail."""
    scales = codes = tensor_scales = 0
    for x in ADVERSARIAL.values():
        good, bad = reference_nvfp4(x), reference_nvfp4(x, host_divisions="reciprocal")
        scales += int((good["scales"] != bad["scales"]).sum())
        codes += int((good["codes"] != bad["codes"]).sum())
        tensor_scales += int(not torch.equal(good["tensor_scale"], bad["tensor_scale"]))
    assert scales > 0 and codes > 0 and tensor_scales > 0, (scales, codes, tensor_scales)


class CudaHostScalarDivision(TorchDispatchMode):
    """Makes CPU ops divide the way PyTorch's CUDA kernel does when the divisor is a host scalar.

    CUDA's ``div_true_kernel_cuda``: if the divisor is a CPU scalar, ``inv = opmath(1) / b`` is
    computed once in fp32 and the kernel multiplies ``a * inv``. Here every floating true division
    whose divisor is a Python number is done that way (a 0-d CPU tensor is also a CPU scalar on CUDA,
    but cannot be told from a device tensor on a CPU; the code under test puts its divisors on the
    dividend's device, see ``apt_model.quantization.fp32``). ``rewritten`` counts the rewrites.
    """

    _DIVS = {aten.div.Tensor, aten.div_.Tensor, aten.div.Scalar, aten.div_.Scalar}

    def __init__(self):
        super().__init__()
        self.rewritten = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        a = args[0] if args else None
        b = args[1] if len(args) > 1 else None
        if (func in self._DIVS and isinstance(a, torch.Tensor) and a.dtype == torch.float32
                and isinstance(b, (int, float)) and not isinstance(b, bool)
                and kwargs.get("rounding_mode") is None):
            self.rewritten += 1
            inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(b), dtype=torch.float32)
            out = torch.mul(a, inv)
            if func in (aten.div_.Tensor, aten.div_.Scalar):
                return a.copy_(out)
            return out
        return func(*args, **kwargs)


def test_the_emulated_cuda_division_differs_from_the_cpus():
    """The mode does what CUDA does: ``x / 6.0`` and ``x / 2688.0`` change for many fp32 values."""
    x = torch.rand(10_000, generator=torch.Generator().manual_seed(1)) * 100
    for c in (6.0, 2688.0):
        with CudaHostScalarDivision() as mode:
            cuda_like = x / c
        assert mode.rewritten == 1
        assert torch.equal(cuda_like, x * (torch.tensor(1.0) / torch.tensor(c)))
        assert not torch.equal(cuda_like, x / c)


def _old_nvfp4_block_scales(block_amax, tensor_scale):
    """The NVFP4 scale step as it was when the H100 run failed (Python-number divisors)."""
    block = block_amax / 6.0
    scales = torch.clamp(block / tensor_scale, min=2.0 ** -6, max=448.0).to(torch.float8_e4m3fn)
    return scales.view(torch.uint8)


def test_the_old_formula_fails_under_the_emulated_cuda_division():
    """The emulation reproduces the H100 failure: the old scale formula changes bits under it."""
    changed = 0
    for x in ADVERSARIAL.values():
        a_b = x.reshape(-1, 16).abs().amax(dim=1)
        ts = a_b.max() / 2688.0
        if ts < 2.0 ** -126:
            continue
        with CudaHostScalarDivision():
            ts_cuda = a_b.max() / 2688.0
            cuda = _old_nvfp4_block_scales(a_b, ts_cuda)
        changed += int((cuda != _old_nvfp4_block_scales(a_b, ts)).sum())
    assert changed > 0


@pytest.mark.parametrize("fmt, rule", FORMATS)
def test_quantizing_under_cudas_host_scalar_rewrite_changes_nothing(fmt, rule, codec):
    for name, x in ADVERSARIAL.items():
        for inp in (x, x.bfloat16()):
            plain = quantize(inp, fmt, rule or "floor")
            with CudaHostScalarDivision() as mode:
                emulated = quantize(inp, fmt, rule or "floor")
                deq = emulated.dequantize(torch.float32)
            assert mode.rewritten == 0, (name, fmt, rule)  # no host-scalar division is left
            assert emulated.equal(plain), (name, fmt, rule)
            assert torch.equal(_bits(deq), _bits(plain.dequantize(torch.float32))), (name, fmt, rule)


class FloatOps(TorchDispatchMode):
    """Records the ops that read or write a floating-point tensor."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in (*args, *(kwargs or {}).values(), *(out if isinstance(out, (tuple, list)) else (out,)))
                   if isinstance(t, torch.Tensor)]
        if any(t.is_floating_point() for t in tensors):
            self.ops.add(func.overloadpacket.__name__)
        return out


#: Ops that may touch floating tensors on the FP4 path: exact ones (copies, views, selections,
#: comparisons, max/abs, casts that keep the value) and the single correctly rounded IEEE ops ``div``
#: and ``mul`` (``_to_copy`` also does the E4M3 cast, of a clamped, in-range value). No ``add``/``sub``:
#: on floats those are where a multiply-add could be fused.
SINGLE_ROUNDED_OR_EXACT = {
    "div", "mul", "mul_", "clamp", "_to_copy", "copy_", "abs", "abs_", "amax", "max", "view", "slice",
    "unsqueeze", "empty", "detach", "lift_fresh", "scalar_tensor", "where", "isnan", "eq", "ne", "gt",
    "_local_scalar_dense",
}


@pytest.mark.parametrize("fmt, rule", FORMATS)
def test_the_float_arithmetic_is_single_rounded_ops_only(fmt, rule, monkeypatch):
    """No op of the quantize/dequantize path may combine a multiply and an add (addcmul, addmm,
    lerp, baddbmm, ...: a kernel where a compiler may contract to an FMA), and the only rounding
    arithmetic on floats is div and mul. Integer ops (table indices) may add."""
    monkeypatch.setattr(blockwise, "PREFER_COMPILED", False)  # the PyTorch path: every op visible
    x = ADVERSARIAL["ugly"]
    quantize(x, fmt, rule or "floor").dequantize(torch.bfloat16)  # build the lookup tables first
    with FloatOps() as rec:
        quantize(x, fmt, rule or "floor").dequantize(torch.float32)
        quantize(x.bfloat16(), fmt, rule or "floor").dequantize(torch.bfloat16)
    assert rec.ops <= SINGLE_ROUNDED_OR_EXACT, sorted(rec.ops - SINGLE_ROUNDED_OR_EXACT)
    assert "div" in rec.ops or fmt == "mxfp4"


def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA/ROCm GPU")
    return torch.device("cuda", 0)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, rule", FORMATS)
def test_cuda_gives_the_cpu_bits_on_adversarial_inputs(fmt, rule, codec):
    dev = _gpu()
    for name, x in ADVERSARIAL.items():
        for inp in (x, x.bfloat16()):
            cpu, gpu = quantize(inp, fmt, rule or "floor"), quantize(inp.to(dev), fmt, rule or "floor")
            assert gpu.device.type == dev.type
            assert gpu.to("cpu").equal(cpu), (name, fmt, rule, inp.dtype)  # codes, scales, tensor scale bits
            for dt in (torch.float32, torch.bfloat16):
                assert torch.equal(_bits(gpu.dequantize(dt).cpu()), _bits(cpu.dequantize(dt))), (name, fmt, dt)
        if fmt == "nvfp4":  # and the device meets the definition itself, not only the CPU
            ref, gpu = reference_nvfp4(x), quantize(x.to(dev), "nvfp4").to("cpu")
            assert torch.equal(gpu.scales.reshape(-1).long(), ref["scales"]), name
            assert torch.equal(_codes(gpu), ref["codes"]), name
