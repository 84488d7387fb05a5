"""specctl.memtrace: live-bytes accounting against known allocations, and fake tracing against the
same code run on real tensors (the brute-force reference)."""

from __future__ import annotations

import pytest
import torch

from specctl.drafters import DRAFTERS
from specctl.drafters.api import VerifierSpec, VerifierWeights
from specctl.memtrace import FAKE_FACTORY_ELEMENTS, MemoryTrace


def tiny_spec(H: int = 64, V: int = 320, heads: int = 4, kv: int = 2) -> VerifierSpec:
    return VerifierSpec(
        name_or_path="tiny",
        architectures=("LlamaForCausalLM",),
        hidden_size=H,
        vocab_size=V,
        num_hidden_layers=4,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=H // heads,
        intermediate_size=2 * H,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        aux_layer_ids=(1, 2, 3),
        mask_token_id=V - 1,
    )


def test_live_bytes_follow_allocations_and_frees():
    with MemoryTrace() as t:
        a = torch.empty(1000, dtype=torch.float32)  # 4,000 B
        b = torch.empty(500, dtype=torch.float64)  # 4,000 B
        view = a[:10]  # a view: no new storage
        a.add_(1)  # in place: no new storage
        assert t.live == 8000
        del b
        c = torch.empty(250, dtype=torch.int8)
        assert t.live == 4250
        del a, view, c
        assert t.live == 0
    assert t.peak == 8000


def test_mark_restarts_the_peak_and_reports_flops():
    with MemoryTrace() as t:
        x = torch.randn(8, 16)
        w = torch.randn(32, 16)
        y = x @ w.T  # 2 * 8 * 32 * 16 FLOPs
        first = t.mark()
        del y
        z = torch.nn.functional.linear(x, w)
        second = t.mark()
    assert first.flops == 2 * 8 * 32 * 16
    assert second.flops == 2 * first.flops
    assert second.peak == first.live  # z replaced y: no higher than before
    del z


def test_heavy_tensors_are_fake_and_counted_without_memory():
    with MemoryTrace() as t:
        with t.heavy():
            big = torch.empty(1 << 20, 1 << 12)  # 16 GiB, never allocated
        assert t.live == (1 << 32) * 4
        small = torch.arange(10)  # steering tensors stay real
        assert small.sum().item() == 45
        assert type(big).__name__ == "FakeTensor"
        large = torch.zeros(FAKE_FACTORY_ELEMENTS + 1)  # a factory this large is made fake too
        assert type(large).__name__ == "FakeTensor"


def test_real_bool_masks_select_rows_of_fake_tensors():
    with MemoryTrace() as t:
        with t.heavy():
            x = torch.empty(100, 64)
        mask = torch.zeros(100, dtype=torch.bool)
        mask[::4] = True
        picked = x[mask]
        assert picked.shape == (25, 64)
        x[mask] = picked * 2  # index_put with the same mask
        assert bool(picked.isfinite().all())  # a value read off a fake: the common branch


def _dflash_step(fake: bool, V: int = 320, B: int = 3, T: int = 48) -> tuple[int, int]:
    """(peak, flops) of one DFlash training step traced with heavy tensors fake or real."""
    spec = tiny_spec(V=V)
    H = spec.hidden_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V - 1, (B, T), generator=g)
    loss_mask = torch.rand(B, T, generator=g) < 0.7
    topk_ids = torch.randint(0, V, (B, T, 4), generator=g)
    with MemoryTrace() as t:
        heavy = t.heavy() if fake else torch.no_grad()
        with heavy:
            torch.manual_seed(0)
            weights = VerifierWeights(torch.randn(V, H), torch.randn(V, H), torch.ones(H))
            config = DRAFTERS["dflash"].config_cls(num_layers=2, block_size=4, max_anchors=6)
            drafter = DRAFTERS["dflash"].build(config, spec, weights, None, "kl")
            aux = torch.randn(B, T, 3, H)
            logprobs = torch.randn(B, T, 4).log_softmax(-1)
            lse = torch.randn(B, T)
        t.mark()
        batch = {
            "input_ids": ids,
            "loss_mask": loss_mask,
            "attention_mask": torch.ones(B, T, dtype=torch.bool),
            "aux_hidden_states": aux,
            "topk_ids": topk_ids,
            "topk_logprobs": logprobs,
            "logsumexp": lse,
        }
        torch.manual_seed(1)
        loss, _ = drafter(batch)
        loss.backward()
        point = t.mark()
    return point.peak, point.flops


@pytest.mark.parametrize("vocab", [320, 4096])
def test_a_fake_trace_equals_the_same_step_on_real_tensors(vocab):
    """The fake/real mixing rules change nothing the step allocates: the peak and FLOPs of a DFlash
    training step with fake features and weights equal those of the step on real ones."""
    real_peak, real_flops = _dflash_step(fake=False, V=vocab)
    fake_peak, fake_flops = _dflash_step(fake=True, V=vocab)
    assert real_flops > 0
    assert fake_flops == real_flops
    assert fake_peak == real_peak
