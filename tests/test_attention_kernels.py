"""specctl.attention_kernels: the CUDA SDPA kernel rules against a table of calls, and every stage's
attention calls checked against them (CUDA's math fallback is invisible on a CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from specctl.attention_kernels import (
    CUDNN,
    EFFICIENT,
    FLASH,
    MATH,
    FusedAttentionGuard,
    MathFallback,
    SdpaCall,
    cuda_attention_form,
    cuda_sdpa_kernel,
    cuda_sdpa_kernels,
    grouped_kv,
    repeat_kv,
)
from specctl.drafters import DRAFTERS
from tests.test_dflash import random_batch, tiny_verifier, tiny_weights

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

BF16 = torch.bfloat16
# an 8B DFlash layer: 32 query / 8 KV heads, 512 block rows over 513 keys (context + summary key)
Q, K, K_FULL, MASK = (2, 32, 512, 128), (2, 8, 513, 128), (2, 32, 513, 128), (2, 1, 512, 513)
Q136, K136, K136_FULL = (2, 32, 512, 136), (2, 8, 513, 136), (2, 32, 513, 136)  # own-key channels

CASES = [
    # (id, call, fused kernels in default order, kernel run by default, with cuDNN preferred)
    ("masked gqa d128", SdpaCall(Q, K, BF16, mask_shape=MASK, enable_gqa=True), [CUDNN], MATH, CUDNN),
    ("masked gqa d136", SdpaCall(Q136, K136, BF16, mask_shape=MASK, enable_gqa=True), [], MATH, MATH),
    (
        "masked repeated d136",
        SdpaCall(Q136, K136_FULL, BF16, mask_shape=MASK),
        [EFFICIENT],
        EFFICIENT,
        EFFICIENT,
    ),
    (
        "masked repeated d128",
        SdpaCall(Q, K_FULL, BF16, mask_shape=MASK),
        [EFFICIENT, CUDNN],
        EFFICIENT,
        CUDNN,
    ),
    (
        "causal square gqa",
        SdpaCall((2, 32, 513, 136), K136, BF16, enable_gqa=True, is_causal=True),
        [FLASH],
        FLASH,
        FLASH,
    ),
    ("causal non-square gqa", SdpaCall(Q, K, BF16, enable_gqa=True, is_causal=True), [CUDNN], MATH, CUDNN),
    ("gqa without enable_gqa", SdpaCall(Q, K, BF16), [], MATH, MATH),
    (
        "bool mask 2-D repeated",
        SdpaCall(Q, K_FULL, BF16, mask_shape=(512, 513)),
        [EFFICIENT, CUDNN],
        EFFICIENT,
        CUDNN,
    ),
    (
        "mask 3-D: not cuDNN's",
        SdpaCall(Q, K_FULL, BF16, mask_shape=(2, 512, 513)),
        [EFFICIENT],
        EFFICIENT,
        EFFICIENT,
    ),
    ("float32: no flash", SdpaCall(Q, K_FULL, torch.float32), [EFFICIENT], EFFICIENT, EFFICIENT),
    (
        "float32 d132 (4-aligned)",
        SdpaCall((1, 4, 8, 132), (1, 4, 8, 132), torch.float32),
        [EFFICIENT],
        EFFICIENT,
        EFFICIENT,
    ),
    (
        "bf16 d100 (not 8-aligned)",
        SdpaCall((1, 4, 8, 100), (1, 4, 8, 100), BF16, mask_shape=(8, 8)),
        [],
        MATH,
        MATH,
    ),
    (
        "d264: past flash's 256",
        SdpaCall((1, 4, 8, 264), (1, 4, 8, 264), BF16),
        [EFFICIENT],
        EFFICIENT,
        EFFICIENT,
    ),
    ("misaligned offset", SdpaCall(Q, K_FULL, BF16, mask_shape=MASK, aligned=False), [CUDNN], MATH, CUDNN),
    (
        "mask stride not 1",
        SdpaCall(Q, K_FULL, BF16, mask_shape=MASK, last_dim_contiguous=False),
        [],
        MATH,
        MATH,
    ),
    ("no keys", SdpaCall((1, 4, 8, 64), (1, 4, 0, 64), BF16), [], MATH, MATH),
    ("one key: not cuDNN's", SdpaCall((1, 4, 1, 64), (1, 4, 1, 64), BF16), [FLASH, EFFICIENT], FLASH, FLASH),
    (
        "mask with grad: not cuDNN's",
        SdpaCall(Q, K_FULL, BF16, mask_shape=MASK, mask_requires_grad=True),
        [EFFICIENT],
        EFFICIENT,
        EFFICIENT,
    ),
]


@pytest.mark.parametrize("name,call,kernels,default,preferred", CASES, ids=[c[0] for c in CASES])
def test_kernel_rules_table(name, call, kernels, default, preferred):
    assert cuda_sdpa_kernels(call) == kernels
    assert cuda_sdpa_kernel(call) == default
    assert cuda_sdpa_kernel(call, cudnn_first=True) == preferred


def test_cudnn_head_dims_past_128_need_its_d256_build_and_no_backward():
    """d136: cuDNN only with a cuDNN/frontend that has d256, and then not for a training step."""
    call = SdpaCall(Q136, K136_FULL, BF16, mask_shape=MASK)
    assert CUDNN not in cuda_sdpa_kernels(call)
    assert CUDNN in cuda_sdpa_kernels(call, cudnn_d256=True)
    training = SdpaCall(Q136, K136_FULL, BF16, mask_shape=MASK, requires_grad=True)
    assert CUDNN not in cuda_sdpa_kernels(training, cudnn_d256=True)


def test_a_call_reads_off_tensors():
    q = torch.randn(2, 4, 6, 8, dtype=BF16, requires_grad=True)
    kv = torch.randn(2, 2, 7, 8, dtype=BF16)
    mask = torch.ones(6, 7, dtype=torch.bool)
    call = SdpaCall.of(q, kv, kv, mask, enable_gqa=True)
    assert call == SdpaCall((2, 4, 6, 8), (2, 2, 7, 8), BF16, 8, (6, 7), False, True, False, 0.0, True)
    assert not SdpaCall.of(q, kv, kv, mask.t()).last_dim_contiguous  # a mask's stride must be 1
    assert not SdpaCall.of(q[..., 1:], kv[..., 1:], kv[..., 1:]).aligned  # offset 1 x 2 bytes
    with torch.no_grad():
        assert not SdpaCall.of(q, kv, kv).requires_grad


def test_repeated_heads_compute_what_enable_gqa_computes():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 5, 8, generator=g) for h in (6, 3, 3))
    mask = torch.rand(5, 5, generator=g) < 0.7
    mask[:, 0] = True
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got = F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=mask)
    torch.testing.assert_close(got, want)


def test_the_form_changes_only_for_cuda():
    """CPU calls keep `enable_gqa` (bit-identical to before); the CUDA form repeats K/V only where
    flash cannot take the call."""
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    mask = torch.ones(6, 6, dtype=torch.bool)
    assert grouped_kv(q, k, k, mask)[2] is True
    assert grouped_kv(q, q, q, mask)[2] is False
    with cuda_attention_form():
        k2, _, gqa = grouped_kv(q, k, k, mask)
        assert (k2.shape[1], gqa) == (4, False)
        qh, kh = q.to(BF16), k.to(BF16)
        assert grouped_kv(qh, kh, kh, None, is_causal=True)[2] is True  # flash takes it
        assert grouped_kv(qh, kh[:, :, :5], kh[:, :, :5], None, is_causal=True)[1].shape[1] == 4
        # float32 (train.precision float32): flash runs only fp16/bf16, so no enable_gqa either
        assert grouped_kv(q, k, k, None, is_causal=True)[:2][0].shape[1] == 4
    assert grouped_kv(q, k, k, mask)[2] is True


# ---------------------------------------------------------------- the guard on fake CUDA tensors


def fake_cuda(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="cuda")


def test_the_guard_raises_on_a_masked_gqa_call_on_fake_cuda_tensors():
    with FakeTensorMode(), FusedAttentionGuard() as guard:
        q, k, bias = fake_cuda(*Q), fake_cuda(*K), fake_cuda(*MASK)
        with pytest.raises(MathFallback):
            F.scaled_dot_product_attention(q, k, k, attn_mask=bias, enable_gqa=True)
        k2, v2, gqa = grouped_kv(q, k, k, bias)
        out = F.scaled_dot_product_attention(q, k2, v2, attn_mask=bias, enable_gqa=gqa)
        assert out.shape == Q and out.device.type == "cuda"
    assert [kernel for _, kernel in guard.calls] == [MATH, EFFICIENT]


def test_the_guard_ignores_cpu_calls_outside_a_cuda_trace():
    q, k = torch.randn(1, 4, 6, 8, dtype=BF16), torch.randn(1, 2, 6, 8, dtype=BF16)
    mask = torch.ones(6, 6, dtype=torch.bool)
    with FusedAttentionGuard() as guard:
        F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)
    assert guard.calls == []


# ---------------------------------------------------------------- every stage's calls

# real-width heads (Llama-3.1-8B / Qwen3-8B: head_dim 128, 4 query heads per KV head); the own-key
# path (DSpark, P-EAGLE, EAGLE-3's later steps) widens them to 136
GQA_WIDTH = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=128)
STAGES = [
    ("dflash", {}),
    ("dspark", {}),
    ("peagle", {}),
    ("eagle3", {}),
    ("dflash", {"sliding_window": 5}),
    ("eagle3", {"num_layers": 2, "sliding_window": 5}),
    ("peagle", {"num_layers": 3, "sliding_window": 9, "full_attention_layers": [1]}),
]


@pytest.mark.parametrize("algo,fields", STAGES, ids=[f"{a}-{'-'.join(f) or 'full'}" for a, f in STAGES])
def test_every_drafters_training_step_runs_a_fused_kernel_on_cuda(algo, fields):
    """A bf16 training step in the CUDA form (the form on a GPU: `cuda_attention_form` stands for
    the device, as in `specctl plan`'s trace): every SDPA call is one flash or the memory-efficient
    kernel takes, and the step still trains (finite loss, gradients)."""
    cls = DRAFTERS[algo]
    torch.manual_seed(0)
    model = cls.build(
        cls.config_cls(**{**cls.tiny, **fields}), tiny_verifier(**GQA_WIDTH), tiny_weights(), None, "kl"
    )
    with cuda_attention_form(), FusedAttentionGuard() as guard, torch.autocast("cpu", dtype=BF16):
        loss, _ = model.train()(random_batch())
    loss.backward()
    kernels = [kernel for _, kernel in guard.calls]
    assert kernels and MATH not in kernels
    assert all(call.dtype == BF16 and call.q_shape[-1] in (128, 136) for call, _ in guard.calls)
    assert torch.isfinite(loss) and any(p.grad is not None for p in model.parameters())


def test_attention_call_sites_on_fake_cuda_tensors():
    """The device branch itself, on fake CUDA tensors: EAGLE-3's TTT step 0 with a window mask and
    causal, and the verifier's collect call (`_sdpa`, what `gqa_sdpa_attention` runs) on a padded
    Llama-3.3-70B batch (64 query / 8 KV heads, bool mask [B, 1, T, T]) and an unpadded one.

    Fake CUDA tensors on this CPU-only build cannot copy across dtypes or layouts (`.to(bf16)`,
    `.contiguous()` raise "not linked with support for cuda devices"), so the own-key merge and the
    layers around these calls run in `test_every_drafters_training_step_runs_a_fused_kernel_on_cuda`
    (CPU tensors in the CUDA form) instead."""
    from specctl.drafters.eagle3 import ttt_attention
    from specctl.verifier import _sdpa

    B, h, kvh, n, hd, T = 2, 8, 2, 16, 128, 64
    with FakeTensorMode(), FusedAttentionGuard() as guard:
        q, k = fake_cuda(B, h, n, hd), fake_cuda(B, kvh, n, hd)
        visible = torch.ones(n, n, dtype=torch.bool, device="cuda")
        assert ttt_attention(q, (k, k), None, causal=False, visible=visible).shape == (B, h, n, hd)
        assert ttt_attention(q, (k, k), None, causal=True).shape == (B, h, n, hd)
        q, k = fake_cuda(B, 64, T, 128), fake_cuda(B, 8, T, 128)
        padded = torch.ones(B, 1, T, T, dtype=torch.bool, device="cuda")
        assert _sdpa(q, k, k, padded, None).shape == (B, 64, T, 128)
        assert _sdpa(q, k, k, None, None, is_causal=True).shape == (B, 64, T, 128)
    assert [kernel for _, kernel in guard.calls] == [EFFICIENT, FLASH, EFFICIENT, FLASH]


def test_the_verifiers_collect_forward_in_the_cuda_form():
    """A whole padded collect batch through a tiny GQA Llama with specctl's attention: every call
    fused in the CUDA form, and the hidden states those of the CPU form (same attention)."""
    from specctl.verifier import capture_hidden_states, use_gqa_sdpa
    from tests.conftest import make_tiny_verifier

    model = make_tiny_verifier()
    model.config._attn_implementation = "sdpa"
    use_gqa_sdpa(model)
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    with torch.no_grad():
        want = capture_hidden_states(model, ids, mask, (1, 2))
        with cuda_attention_form(), FusedAttentionGuard() as guard:
            got = capture_hidden_states(model.to(BF16), ids, mask, (1, 2))
    assert guard.calls and MATH not in [kernel for _, kernel in guard.calls]
    torch.testing.assert_close(got[0].float(), want[0], rtol=0.05, atol=0.05)


def test_the_plans_training_trace_runs_the_cuda_form():
    """`specctl plan` traces an 8B DFlash step for CUDA on this CPU: its masked calls carry K/V
    repeated to the query's 32 heads (counted in the peak, as on the GPU), and none falls to math."""
    from specctl import resources
    from specctl.recipe import load_recipe

    recipe = load_recipe("recipes/dflash-llama.yaml", ["train.micro_batch_tokens=512"])
    x = resources.inputs(recipe.for_training(), resources.Cluster("cuda", 8, 80 * resources.GIB))
    with FusedAttentionGuard() as guard:
        resources.trace_train_step(x.recipe, x.spec, 512, "cuda")
    masked = [call for call, _ in guard.calls if call.mask_shape is not None]
    assert masked and all(call.k_shape[1] == call.q_shape[1] == 32 for call in masked)
    assert MATH not in [kernel for _, kernel in guard.calls]
