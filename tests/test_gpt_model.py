"""The shipped GPT: attention implementations agree; bad configs are refused."""
import pytest
import torch

from apt_model.attention.causal import CausalSelfAttention
from apt_model.errors import ConfigError
from apt_model.models.gpt import GPT, PRESETS, GPTConfig


def test_eager_and_sdpa_agree_and_are_causal():
    torch.manual_seed(0)
    attn = CausalSelfAttention(64, 4).eval()
    x = torch.randn(2, 12, 64)
    eager = attn(x)
    attn.attn_implementation = "sdpa"
    torch.testing.assert_close(attn(x), eager, atol=2e-6, rtol=1e-5)
    x2 = x.clone()
    x2[:, 6:] += 1.0  # the future must not change the past
    torch.testing.assert_close(attn(x2)[:, :6], eager[:, :6], atol=2e-6, rtol=1e-5)


def test_gpt_shapes_tying_and_errors():
    m = GPT(GPTConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2))
    out = m(torch.randint(0, 256, (3, 16)))
    assert out.shape == (3, 16, 256)
    assert m.head.weight is m.tok_emb.weight
    with pytest.raises(ValueError, match="exceeds the model's seq_len=16"):
        m(torch.randint(0, 256, (1, 17)))
    with pytest.raises(ConfigError, match="not divisible"):
        GPT(GPTConfig(d_model=30, n_heads=4))
    with pytest.raises(ConfigError, match="n_layers=0 must be positive"):
        GPT(GPTConfig(n_layers=0))
    with pytest.raises(ConfigError, match="attn_implementation='flash'"):
        CausalSelfAttention(32, 2, attn_implementation="flash")
    assert set(PRESETS) == {"tiny", "small", "medium"}
