"""FP4 formats: the E2M1 codec, MXFP4/NVFP4 scale rules, the packed tensor, edge cases, quality."""
import math

import pytest
import torch

from apt_model.quantization import FP4Tensor, quantize, sqnr_db
from apt_model.quantization.e2m1 import (E2M1_VALUES, decode_e2m1, encode_e2m1, pack_nibbles,
                                         reference_codes, unpack_nibbles)
from apt_model.quantization.mxfp4 import e8m0_exponents, e8m0_values
from apt_model.quantization.nvfp4 import E4M3_MIN


def f32(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


# ----------------------------------------------------------------------------- E2M1 element


@pytest.mark.parametrize("value, code", [
    (0.0, 0), (-0.0, 8), (0.25, 0), (0.2500001, 1), (-0.25, 8), (0.5, 1), (0.75, 2), (0.7499999, 1),
    (1.0, 2), (1.25, 2), (1.2500001, 3), (1.5, 3), (1.75, 4), (2.0, 4), (2.5, 4), (2.5000002, 5),
    (3.0, 5), (3.5, 6), (4.0, 6), (5.0, 6), (5.0000005, 7), (6.0, 7), (7.0, 7), (1e30, 7),
    (float("inf"), 7), (float("-inf"), 15), (-6.0, 15), (-1.75, 12), (-0.1, 8), (1e-45, 0),
    (-1e-45, 8), (float("nan"), 0),
])
def test_e2m1_rounds_to_nearest_even_and_saturates(value, code):
    x = torch.tensor([value], dtype=torch.float32)
    assert encode_e2m1(x).item() == code
    assert reference_codes(x).item() == code


def test_e2m1_table_matches_the_reference_on_every_top_half_and_its_sticky_bits():
    """Every fp32 pattern's top 16 bits, with low halves 0, 1, 0x8000 and 0xFFFF: 262,144 values
    covering every exponent, sign, subnormal, Inf and NaN pattern and every tie's neighbours."""
    hi = torch.arange(-32768, 32768, dtype=torch.int32) << 16
    lows = torch.tensor([0, 1, 0x8000, 0xFFFF], dtype=torch.int32)
    values = (hi[:, None] | lows[None, :]).reshape(-1).view(torch.float32)
    assert torch.equal(encode_e2m1(values), reference_codes(values))


def test_e2m1_random_bit_patterns_match_the_reference():
    gen = torch.Generator().manual_seed(7)
    bits = torch.randint(-2**31, 2**31 - 1, (200_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    values = bits.view(torch.float32)
    assert torch.equal(encode_e2m1(values), reference_codes(values))


def test_e2m1_decode_table_and_nibble_order():
    codes = torch.arange(16, dtype=torch.uint8)
    assert decode_e2m1(codes).tolist() == list(E2M1_VALUES)
    assert math.copysign(1.0, decode_e2m1(codes)[8].item()) == -1.0  # code 8 is -0
    packed = pack_nibbles(torch.tensor([[1, 2, 15, 7]], dtype=torch.uint8))
    assert packed.tolist() == [[0x21, 0x7F]]  # element 2i in the low nibble
    assert torch.equal(unpack_nibbles(packed), torch.tensor([[1, 2, 15, 7]], dtype=torch.uint8))
    with pytest.raises(ValueError, match="even last dimension"):
        pack_nibbles(torch.zeros(3, dtype=torch.uint8))


def test_encode_rejects_wrong_dtype_or_layout():
    with pytest.raises(TypeError, match="float32"):
        encode_e2m1(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        encode_e2m1(torch.zeros(4, 4).t())


# ----------------------------------------------------------------------------- MXFP4 scales


def test_e8m0_floor_and_rceil_rules():
    amax = torch.tensor([6.0, 6.5, 4.0, 3.9, 1.0, 0.0, 1e-40, float("inf"), float("nan"), 3.0e38])
    floor = e8m0_exponents(amax, "floor").tolist()
    rceil = e8m0_exponents(amax, "rceil").tolist()
    # FLOOR: floor(log2 amax) - 2 ; RCEIL: ceil(log2(amax / 6))
    assert floor[:5] == [127, 127, 127, 126, 125]
    assert rceil[:5] == [127, 128, 127, 127, 125]
    assert floor[5] == rceil[5] == 0  # zero block
    assert floor[6] == rceil[6] == 0  # subnormal amax
    assert (floor[7], rceil[7]) == (253, 254)  # Inf
    assert floor[8] == rceil[8] == 255  # NaN
    assert (floor[9], rceil[9]) == (252, 253)
    with pytest.raises(ValueError, match="valid: floor, rceil"):
        e8m0_exponents(amax, "nearest")


def test_rceil_is_the_exact_ceiling_even_one_ulp_above_a_power_of_two():
    """torch.log2 in fp32 rounds log2(2^10 * (1 + 2^-23)) to exactly 10; the exact rule gives 11."""
    descale = torch.tensor([f32((127 + 10) << 23 | 1)])  # 2^10 * (1 + 2^-23)
    amax = descale * 6.0
    assert torch.equal(amax / 6.0, descale)  # the quotient the rule sees is that value
    assert e8m0_exponents(amax, "rceil").item() == 127 + 11
    assert e8m0_exponents(torch.tensor([6.0 * 1024]), "rceil").item() == 127 + 10  # exact power: no round-up


def test_e8m0_values_are_exact_powers_of_two():
    b = torch.tensor([0, 1, 127, 200, 254, 255], dtype=torch.uint8)
    v = e8m0_values(b)
    assert v[:5].tolist() == [2.0 ** -127, 2.0 ** -126, 1.0, 2.0 ** 73, 2.0 ** 127]
    assert math.isnan(v[5].item())


# ----------------------------------------------------------------------------- the packed tensor


@pytest.mark.parametrize("fmt, rule", [("mxfp4", "floor"), ("mxfp4", "rceil"), ("nvfp4", "floor")])
def test_representable_values_round_trip_exactly(fmt, rule):
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (8, 64), generator=gen)
    x = torch.tensor(E2M1_VALUES)[codes] * 2.0 ** -3
    x[:, ::16] = 6 * 2.0 ** -3  # every block reaches the largest code, so no scale needs rounding
    q = quantize(x, fmt, rule)
    assert torch.equal(q.dequantize(), x)


@pytest.mark.parametrize("fmt, bits", [("mxfp4", 4.25), ("nvfp4", 4.5)])
def test_packed_tensor_layout_views_and_size(fmt, bits):
    x = torch.randn(64, 256)
    q = quantize(x, fmt)
    block = 32 if fmt == "mxfp4" else 16
    assert q.data.shape == (64, 128) and q.data.dtype == torch.uint8
    assert q.scales.shape == (64, 256 // block)
    f4 = q.as_float4()
    assert f4.dtype == torch.float4_e2m1fn_x2 and f4.shape == (64, 128)
    assert f4.data_ptr() == q.data.data_ptr()  # a view, not a copy
    assert q.scale_tensor().dtype == (torch.float8_e8m0fnu if fmt == "mxfp4" else torch.float8_e4m3fn)
    assert q.bits_per_element == pytest.approx(bits, abs=0.01)
    assert q.nbytes == 64 * 128 + 64 * 256 // block + (4 if fmt == "nvfp4" else 0)
    assert fmt in repr(q) and "bits/element" in repr(q)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_last_dimension_not_a_multiple_of_the_block_is_zero_padded(fmt):
    x = torch.randn(3, 2, 37)
    q = quantize(x, fmt)
    block = 32 if fmt == "mxfp4" else 16
    padded = math.ceil(37 / block) * block
    assert q.data.shape == (3, 2, padded // 2) and q.scales.shape == (3, 2, padded // block)
    y = q.dequantize()
    assert y.shape == x.shape
    ref = quantize(torch.nn.functional.pad(x, (0, padded - 37)), fmt)  # zeros change no scale
    assert torch.equal(ref.data, q.data) and torch.equal(ref.dequantize()[..., :37], y)


def test_16_bit_inputs_quantize_like_their_fp32_values_and_dequantize_to_any_dtype():
    x = torch.randn(16, 64).bfloat16()
    for fmt in ("mxfp4", "nvfp4"):
        a, b = quantize(x, fmt), quantize(x.float(), fmt)
        assert a.equal(b)  # same codes, scales and tensor scale
        assert a.dequantize().dtype == torch.bfloat16
        assert torch.equal(a.dequantize(torch.bfloat16), b.dequantize(torch.float32).bfloat16())
    h = torch.randn(4, 32).half()
    assert torch.equal(quantize(h).data, quantize(h.float()).data)


def test_zero_subnormal_inf_and_nan_inputs_mxfp4():
    x = torch.zeros(6, 32)
    x[1, 0] = -0.0
    x[2, :4] = torch.tensor([1e-40, -2e-40, 3e-39, 0.0])  # fp32 subnormals
    x[3, :3] = torch.tensor([float("inf"), 1.0, -2.0])
    x[4, :3] = torch.tensor([float("nan"), 1.0, 5.0])
    x[5, :2] = torch.tensor([float("-inf"), 7.0])
    for rule in ("floor", "rceil"):
        q = quantize(x, "mxfp4", rule)
        y = q.dequantize()
        assert torch.equal(y[0], torch.zeros(32)) and q.scales[0].item() == 0
        assert math.copysign(1, y[1, 0].item()) == -1.0  # -0 stays -0
        assert q.scales[2].item() == 0 and torch.isfinite(y[2]).all() and y[2].abs().max() <= 3e-39
        assert y[3, 0].item() == float("inf") and (y[3, 1:] == 0).all()  # Inf survives, its block flushes
        assert q.scales[4].item() == 255 and torch.isnan(y[4]).all()  # NaN marks the whole block
        assert y[5, 0].item() == float("-inf")


def test_nvfp4_zero_tiny_and_nonfinite_tensors():
    q = quantize(torch.zeros(4, 32), "nvfp4")
    assert torch.equal(q.dequantize(), torch.zeros(4, 32)) and q.tensor_scale.item() == 0.0
    assert (q.scales.view(torch.float8_e4m3fn).float() == E4M3_MIN).all()
    tiny = torch.full((2, 16), 1e-36)
    assert torch.equal(quantize(tiny, "nvfp4").dequantize(), torch.zeros(2, 16))
    x = torch.randn(4, 32)
    x[0, 0] = 1e-3 * x.abs().max()
    x[1, :16] = 1e-9  # a block far below the tensor's range gets the smallest E4M3 scale
    q = quantize(x, "nvfp4")
    assert q.scales[1, 0].item() == torch.tensor(E4M3_MIN).to(torch.float8_e4m3fn).view(torch.uint8).item()
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[2, 3] = bad
        with pytest.raises(ValueError, match="NVFP4 needs finite values"):
            quantize(y, "nvfp4")


def test_nvfp4_accepts_a_given_tensor_scale():
    x = torch.randn(8, 32)
    auto = quantize(x, "nvfp4")
    given = quantize(x, "nvfp4", tensor_scale=auto.tensor_scale.item())
    assert given.equal(auto)
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        quantize(x, "nvfp4", tensor_scale=-1.0)


def test_bad_arguments_name_the_valid_values():
    with pytest.raises(ValueError, match="valid: mxfp4, nvfp4"):
        quantize(torch.randn(4, 32), "fp4")
    with pytest.raises(ValueError, match="valid: floor, rceil"):
        quantize(torch.randn(4, 32), "mxfp4", "even")
    with pytest.raises(TypeError, match="floating"):
        quantize(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="0-d"):
        quantize(torch.tensor(1.0))
    q = quantize(torch.randn(4, 32))
    with pytest.raises(ValueError, match=r"must be uint8 \(4, 16\)"):
        FP4Tensor(q.data[:, :8], q.scales, None, (4, 32), torch.float32, "mxfp4")
    with pytest.raises(ValueError, match="no tensor_scale"):
        FP4Tensor(q.data, q.scales, torch.tensor(1.0), (4, 32), torch.float32, "mxfp4")


def test_empty_tensors_quantize():
    q = quantize(torch.empty(0, 64), "nvfp4")
    assert q.dequantize().shape == (0, 64)
    assert quantize(torch.empty(5, 0)).dequantize().shape == (5, 0)


def test_equal_and_to_device():
    x = torch.randn(8, 64)
    q = quantize(x, "nvfp4")
    assert q.to("cpu") is q
    r = quantize(x + 1e-3, "nvfp4")
    assert q.equal(q) and not q.equal(r)


# ----------------------------------------------------------------------------- quality


def test_sqnr_on_a_4096_square_gaussian_meets_the_reference():
    x = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0))
    floor = sqnr_db(x, quantize(x, "mxfp4", "floor").dequantize())
    rceil = sqnr_db(x, quantize(x, "mxfp4", "rceil").dequantize())
    nv = sqnr_db(x, quantize(x, "nvfp4").dequantize())
    assert floor >= 18.7 and rceil >= 18.7 and nv >= 20.4, (floor, rceil, nv)
    assert floor < 19.5 and nv < 21.5  # 4 bits cannot do much better: a sign the test measures FP4
    assert sqnr_db(x, x) == math.inf
