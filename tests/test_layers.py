"""The shared decoder pieces equal transformers' Qwen3/Llama modules (the layers vLLM serves)."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

from specctl.drafters.layers import (
    MLP,
    Attention,
    RMSNorm,
    apply_rope,
    attend_with_own_keys,
    attention_dtype,
    own_key_attention,
    rope_cos_sin,
    rope_inv_freq,
    shared_key_bias,
)

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


# ---------------------------------------------------------------- shared keys + own keys


def brute_force_attention(q, shared_k, shared_v, visible, own_k, own_v, own_visible):
    """One softmax per query over its visible shared keys and its visible own keys, query by
    query and head by head (grouped-query heads read kv head h // (heads / kv_heads))."""
    B, h, N, hd = q.shape
    kvh = shared_k.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for head in range(h):
            kv = head // (h // kvh)
            for n in range(N):
                keys = torch.cat([shared_k[b, kv][visible[b, n]], own_k[b, kv, n][own_visible[b, n]]])
                values = torch.cat([shared_v[b, kv][visible[b, n]], own_v[b, kv, n][own_visible[b, n]]])
                weights = torch.softmax(keys @ q[b, head, n] * hd**-0.5, 0)
                out[b, head, n] = weights @ values
    return out


@pytest.mark.parametrize(
    ("heads", "kv_heads", "N", "S", "J"), [(4, 2, 5, 7, 3), (2, 2, 6, 6, 1), (4, 1, 3, 9, 4)]
)
def test_attend_with_own_keys_is_one_softmax(heads, kv_heads, N, S, J):
    """Shared keys behind a mask + per-query own keys (some masked, one query with none) =
    one softmax over both, in float64 to rounding; gradients agree too."""
    g = torch.Generator().manual_seed(N * S)
    B, hd = 2, 16

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)

    q, k, v = rand(B, heads, N, hd), rand(B, kv_heads, S, hd), rand(B, kv_heads, S, hd)
    own_k, own_v = rand(B, kv_heads, N, J, hd), rand(B, kv_heads, N, J, hd)
    visible = torch.rand(B, N, S, generator=g) < 0.5
    visible[:, :, 0] = True
    own_visible = torch.rand(B, N, J, generator=g) < 0.6
    own_visible[0, 1] = False  # a query with no own key: the shared keys alone
    own_visible[1, 0, 0] = True

    def ours(q, k, v, own_k, own_v):
        lse, out = own_key_attention(q[:, :, :, None], own_k, own_v, own_visible[:, :, None])
        assert lse.shape == (B, heads, N, 1) and out.shape == (B, heads, N, 1, hd)
        bias = shared_key_bias(visible, q.dtype)  # [B, 1, N, S + 1]
        return attend_with_own_keys(q, k, v, lse[..., 0], out[..., 0, :], bias)

    inputs = (q, k, v, own_k, own_v)
    got = ours(*inputs)
    want = brute_force_attention(q, k, v, visible, own_k, own_v, own_visible)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    weights = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, b in zip(
        torch.autograd.grad((got * weights).sum(), inputs),
        torch.autograd.grad((want * weights).sum(), inputs),
        strict=True,
    ):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # no bias: every shared key visible
    lse, out = own_key_attention(q[:, :, :, None], own_k, own_v, own_visible[:, :, None])
    torch.testing.assert_close(
        attend_with_own_keys(q, k, v, lse[..., 0], out[..., 0, :]),
        brute_force_attention(q, k, v, torch.ones_like(visible), own_k, own_v, own_visible),
    )


def test_attend_with_own_keys_causal_and_grouped_queries():
    """is_causal: query i sees shared keys 0..i with no mask tensor; P queries of a group
    sharing J keys (DFlash's blocks) equal each query holding its own copy of them."""
    g = torch.Generator().manual_seed(0)
    B, h, kvh, N, hd, P, J = 2, 4, 2, 6, 16, 3, 3
    q = torch.randn(B, h, N, hd, generator=g, dtype=torch.float64)
    k, v = (
        torch.randn(B, kvh, N, hd, generator=g, dtype=torch.float64),
        torch.randn(B, kvh, N, hd, generator=g),
    )
    v = v.double()
    group_k = torch.randn(B, kvh, N // P, J, hd, generator=g, dtype=torch.float64)
    group_v = torch.randn(B, kvh, N // P, J, hd, generator=g, dtype=torch.float64)
    lse, out = own_key_attention(q.view(B, h, N // P, P, hd), group_k, group_v, None)
    got = attend_with_own_keys(q, k, v, lse.view(B, h, N), out.view(B, h, N, hd), is_causal=True)
    per_query_k = group_k.repeat_interleave(P, dim=2)  # [B, kvh, N, J, hd]
    per_query_v = group_v.repeat_interleave(P, dim=2)
    causal = torch.ones(N, N, dtype=torch.bool).tril().expand(B, N, N)
    want = brute_force_attention(
        q, k, v, causal, per_query_k, per_query_v, torch.ones(B, N, J, dtype=torch.bool)
    )
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="is_causal"):
        attend_with_own_keys(
            q, k[:, :, :-1], v[:, :, :-1], lse.view(B, h, N), out.view(B, h, N, hd), is_causal=True
        )


def test_attend_with_own_keys_keeps_bf16_precision():
    """In bf16 the merge is about as accurate as plain SDPA over the same keys: own-key scores
    and their logsumexp stay float32, and the summary score rides in two bf16 channels (one
    would round a logsumexp of ~60 by ~0.06, shifting the own keys' weight by ~6%)."""
    g = torch.Generator().manual_seed(1)
    B, h, N, S, J, hd = 1, 2, 64, 48, 8, 16
    q = (torch.randn(B, h, N, hd, generator=g) * 4).bfloat16()  # sharp: logsumexp up to ~70
    k = (torch.randn(B, h, S, hd, generator=g) * 4).bfloat16()
    own_k = (torch.randn(B, h, N, J, hd, generator=g) * 4).bfloat16()
    v = -torch.ones(B, h, S, hd, dtype=torch.bfloat16)  # output = own weight * 2 - 1
    own_v = torch.ones(B, h, N, J, hd, dtype=torch.bfloat16)
    everything, own_all = torch.ones(B, N, S, dtype=torch.bool), torch.ones(B, N, J, dtype=torch.bool)
    exact = brute_force_attention(
        q.double(), k.double(), v.double(), everything, own_k.double(), own_v.double(), own_all
    )
    lse, out = own_key_attention(q[:, :, :, None], own_k, own_v, None)
    assert lse.dtype == out.dtype == torch.float32
    ours = attend_with_own_keys(q, k, v, lse[..., 0], out[..., 0, :])
    assert ours.dtype == torch.bfloat16
    # plain bf16 SDPA with the own keys as extra keys of every query: the error to match
    dense_k = torch.cat([k[:, :, None].expand(B, h, N, S, hd), own_k], 3)
    dense_v = torch.cat([v[:, :, None].expand(B, h, N, S, hd), own_v], 3)
    plain = F.scaled_dot_product_attention(q[:, :, :, None], dense_k, dense_v)[:, :, :, 0]
    plain_error = (plain.double() - exact).abs().max()
    assert (ours.double() - exact).abs().max() < 4 * plain_error


def test_attention_dtype_follows_autocast():
    x = torch.zeros(2, 3)
    assert attention_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention_dtype(x) == torch.bfloat16
    bias = shared_key_bias(torch.tensor([[[True, False]]]), torch.bfloat16)
    assert bias.dtype == torch.bfloat16 and bias.shape == (1, 1, 1, 3)
    assert bias.tolist() == [[[[0.0, float("-inf"), 0.0]]]]


def test_attend_is_causal_equals_the_causal_mask():
    torch.manual_seed(0)
    attn = Attention(64, 4, 2, 16)
    q, k, v = torch.randn(2, 4, 7, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    torch.testing.assert_close(
        attn.attend(q, k, v, None, is_causal=True), attn.attend(q, k, v, _causal(7)[None, None])
    )
