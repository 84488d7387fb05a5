"""The shared decoder pieces equal transformers' Qwen3/Llama modules (the layers vLLM serves)."""

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

from specctl.drafters.layers import MLP, Attention, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _qwen3_config(**kw) -> Qwen3Config:
    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
    )
    cfg = Qwen3Config(**{**base, **kw})
    cfg._attn_implementation = "eager"
    return cfg


def _causal(T: int) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool).tril()


def test_rmsnorm_matches_hf():
    torch.manual_seed(0)
    ours, hf = RMSNorm(64, 1e-5), Qwen3RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        hf.weight.normal_()
        ours.weight.copy_(hf.weight)
    x = torch.randn(3, 5, 64) * 7
    torch.testing.assert_close(ours(x), hf(x), rtol=0, atol=0)
    xb = x.bfloat16()
    torch.testing.assert_close(ours.bfloat16()(xb), hf.bfloat16()(xb), rtol=0, atol=0)


def test_mlp_matches_hf():
    torch.manual_seed(0)
    cfg = _qwen3_config()
    hf, ours = Qwen3MLP(cfg), MLP(64, 128)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 7, 64)
    torch.testing.assert_close(ours(x), hf(x))


@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3_SCALING],
    ids=["default", "linear", "llama3"],
)
def test_rope_tables_match_hf(scaling):
    cfg = LlamaConfig(
        hidden_size=64, num_attention_heads=4, head_dim=16, rope_theta=500000.0, rope_scaling=scaling
    )
    kind = cfg.rope_parameters["rope_type"]
    if kind == "default":
        hf_inv_freq, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        hf_inv_freq, _ = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    ours = rope_inv_freq(16, 500000.0, scaling)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, hf_inv_freq.float(), rtol=0, atol=0)

    positions = torch.tensor([[0, 1, 7, 63, 1000, 3000]])
    hf_cos, hf_sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, 6, 64), positions)
    cos, sin = rope_cos_sin(positions, ours)
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=1e-6)


def test_rope_rejects_unknown_scaling():
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(16, 10000.0, {"rope_type": "yarn", "factor": 4.0})


def test_apply_rope_preserves_norm_and_relative_positions():
    """Rotations keep vector norms and make q.k depend only on the position difference."""
    torch.manual_seed(0)
    inv = rope_inv_freq(16, 10000.0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(pq: int, pk: int) -> torch.Tensor:
        cq, sq = rope_cos_sin(torch.tensor([pq]), inv)
        ck, sk = rope_cos_sin(torch.tensor([pk]), inv)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    cos, sin = rope_cos_sin(torch.tensor([5]), inv)
    torch.testing.assert_close(apply_rope(q, cos, sin).norm(), q.norm())
    torch.testing.assert_close(score(9, 4), score(105, 100), atol=1e-4, rtol=0)
    assert not torch.allclose(score(9, 4), score(9, 8))


def test_qwen3_attention_matches_hf():
    """q_norm/k_norm + rope + GQA attention with a causal mask equals HF Qwen3Attention."""
    torch.manual_seed(0)
    cfg = _qwen3_config()
    hf = Qwen3Attention(cfg, layer_idx=0).eval()
    with torch.no_grad():
        hf.q_norm.weight.normal_()
        hf.k_norm.weight.normal_()
    ours = Attention(64, 4, 2, 16, qk_norm=True, eps=1e-6)
    ours.load_state_dict(hf.state_dict())
    B, T = 2, 9
    x = torch.randn(B, T, 64)
    positions = torch.arange(3, 3 + T).expand(B, T)
    cos, sin = Qwen3RotaryEmbedding(cfg)(x, positions)
    additive = torch.zeros(T, T).masked_fill(~_causal(T), float("-inf"))[None, None]
    expected, _ = hf(x, (cos, sin), attention_mask=additive)

    our_cos, our_sin = rope_cos_sin(positions, rope_inv_freq(16, 10000.0))
    q = ours.project_q(x, our_cos, our_sin)
    k, v = ours.project_kv(x, our_cos, our_sin)
    assert q.shape == (B, 4, T, 16) and k.shape == v.shape == (B, 2, T, 16)
    got = ours.attend(q, k, v, _causal(T)[None, None])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_llama_attention_matches_hf_with_llama3_rope():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_SCALING,
        max_position_embeddings=4096,
    )
    cfg._attn_implementation = "eager"
    hf = LlamaAttention(cfg, layer_idx=0).eval()
    ours = Attention(64, 4, 2, 16)
    ours.load_state_dict(hf.state_dict())
    T = 6
    x = torch.randn(1, T, 64)
    positions = torch.tensor([[0, 10, 100, 200, 300, 2000]])
    additive = torch.zeros(T, T).masked_fill(~_causal(T), float("-inf"))[None, None]
    expected, _ = hf(x, LlamaRotaryEmbedding(cfg)(x, positions), attention_mask=additive)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(16, 500000.0, LLAMA3_SCALING))
    got = ours.attend(ours.project_q(x, cos, sin), *ours.project_kv(x, cos, sin), _causal(T)[None, None])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
