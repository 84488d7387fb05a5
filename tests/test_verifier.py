"""Verifier loading: the grouped-query SDPA path computes what transformers' own SDPA computes."""

from __future__ import annotations

import torch
from conftest import make_tiny_verifier

from specctl.recipe import VerifierSection
from specctl.verifier import GQA_SDPA, load_verifier, use_gqa_sdpa


def _left_padded(batch: int, width: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, width), generator=g)
    mask = torch.ones(batch, width, dtype=torch.long)
    for b in range(batch):
        mask[b, : 2 * b] = 0  # row b has 2b pad tokens on the left
        ids[b, : 2 * b] = 0
    return ids, mask


def test_gqa_sdpa_equals_transformers_sdpa_with_and_without_padding():
    model = make_tiny_verifier("llama", vocab_size=320)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    model.set_attn_implementation("sdpa")
    ids, mask = _left_padded(4, 12, 320)
    with torch.no_grad():
        ref_masked = model(ids, attention_mask=mask).logits
        ref_causal = model(ids).logits
        ref_gen = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0
        )
    use_gqa_sdpa(model)
    assert model.config._attn_implementation == GQA_SDPA
    with torch.no_grad():
        assert torch.allclose(model(ids, attention_mask=mask).logits, ref_masked, atol=1e-5)
        assert torch.allclose(model(ids).logits, ref_causal, atol=1e-5)
        gen = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0
        )
    assert torch.equal(gen, ref_gen)


def test_qwen3_verifier_also_switches(tmp_path):
    model = make_tiny_verifier("qwen3")
    model.set_attn_implementation("sdpa")
    ids, mask = _left_padded(3, 10, 320)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        use_gqa_sdpa(model)
        assert torch.allclose(model(ids, attention_mask=mask).logits, ref, atol=1e-5)


def test_load_verifier_uses_gqa_sdpa(tiny_verifier_dir):
    verifier = load_verifier(VerifierSection(name_or_path=str(tiny_verifier_dir)))
    assert verifier.model.config._attn_implementation == GQA_SDPA


def test_eager_models_are_left_alone():
    model = make_tiny_verifier("llama")
    model.set_attn_implementation("eager")
    use_gqa_sdpa(model)
    assert model.config._attn_implementation == "eager"
