"""The compiled CPU codec and the pure-PyTorch block loop give the same bits; the fallback works."""
import os

import pytest
import torch

from apt_model.quantization import blockwise, ckernel, quantize
from apt_model.quantization.e2m1 import pack_nibbles, reference_codes
from conftest import run_python


@pytest.fixture
def compiled():
    if not ckernel.status()["compiled"]:
        pytest.skip(f"no compiled codec here: {ckernel.status()['reason']}")
    return ckernel


def test_compiled_rounding_matches_the_reference_on_every_top_half(compiled):
    hi = torch.arange(-32768, 32768, dtype=torch.int32) << 16
    lows = torch.tensor([0, 1, 0x8000, 0xFFFF], dtype=torch.int32)
    values = (hi[:, None] | lows[None, :]).reshape(-1).view(torch.float32)
    gen = torch.Generator().manual_seed(3)
    rand = torch.randint(-2**31, 2**31 - 1, (1 << 18,), generator=gen, dtype=torch.int64).to(torch.int32)
    for v in (values, rand.view(torch.float32)):
        for block in (16, 32, 64):  # the two vectorized sizes and the generic loop
            b = v.reshape(-1, block)
            got = compiled.encode(b, torch.ones(b.shape[0]))
            assert torch.equal(got, pack_nibbles(reference_codes(b))), block


@pytest.mark.parametrize("fmt, rule", [("mxfp4", "floor"), ("mxfp4", "rceil"), ("nvfp4", "floor")])
@pytest.mark.parametrize("shape", [(257, 96), (3, 5, 64), (1, 4096), (4, 37)])
def test_compiled_and_pytorch_paths_give_the_same_bits(compiled, monkeypatch, fmt, rule, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen) * torch.logspace(-6, 6, shape[-1])
    x.view(-1)[:4] = torch.tensor([0.0, -0.0, 1e-40, 2.5])
    if fmt == "mxfp4":
        x.view(-1)[40:42] = torch.tensor([float("inf"), float("nan")])
    fast = quantize(x, fmt, rule)
    fast_values = fast.dequantize()
    monkeypatch.setattr(blockwise, "PREFER_COMPILED", False)
    slow = quantize(x, fmt, rule)
    assert fast.equal(slow)
    assert torch.equal(fast_values.view(torch.int32), slow.dequantize().view(torch.int32))


def test_work_is_split_over_threads_with_the_same_result(compiled):
    x = torch.randn(64, 4096)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quantize(x, "nvfp4")
        torch.set_num_threads(2)
        two = quantize(x, "nvfp4")
    finally:
        torch.set_num_threads(before)
    assert one.equal(two) and torch.equal(one.dequantize(), two.dequantize())


def test_without_a_compiler_the_pytorch_path_runs(monkeypatch):
    x = torch.randn(32, 64)
    ref = quantize(x, "mxfp4")
    monkeypatch.setattr(ckernel, "_compiler", lambda: None)
    ckernel.reset()
    try:
        st = ckernel.status()
        assert st["compiled"] is False and "no C compiler" in st["reason"]
        assert quantize(x, "mxfp4").equal(ref)
    finally:
        monkeypatch.undo()
        ckernel.reset()


def test_the_environment_can_ask_for_the_pytorch_codec():
    code = ("import torch\nfrom apt_model.quantization import ckernel, quantize\n"
            "q = quantize(torch.randn(4, 32))\nprint(ckernel.status()['compiled'], ckernel.status()['reason'])")
    r = run_python(code, env={**os.environ, "VB_FP4_KERNEL": "torch"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("False VB_FP4_KERNEL=torch")
