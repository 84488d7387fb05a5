"""Sliding-window attention and causal draft blocks, as vLLM runs a file that declares them.

A draft layer whose transformer_layer_config.layer_types entry is "sliding_attention" sees a key
only while it is less than `sliding_window` positions behind the query (vLLM's FlashAttention
window); a DFlash/DSpark file with sliding_window_non_causal false makes vLLM run its block
causal. The speculators trainer writes both by default. Each drafter's training pass is checked
against a dense brute-force reference with exactly those rules, and its training rows against its
serving pass (what vLLM computes), with windows short enough to cut the context.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from test_dflash import build as build_block
from test_dflash import perturbed, random_batch, reference_run_blocks
from test_eagle3 import pad_tail, ttt_attention_mask, verifier_batch
from test_eagle3 import tiny_verifier as tiny_llama
from test_peagle import reference_block_attention

from specctl.drafters import DRAFTERS
from specctl.drafters.api import greedy_propose
from specctl.drafters.dflash import (
    BlockRows,
    block_context_mask,
    block_queries,
    block_targets,
    causal_block_mask,
    sample_anchors,
)
from specctl.drafters.eagle3 import shift_left
from specctl.drafters.layers import window_mask
from specctl.drafters.peagle import block_layout

MASK_ID = 255


def test_window_mask_is_the_brute_force_rule():
    q, k = torch.tensor([0, 3, 7, 9]), torch.arange(10)
    for window in (1, 2, 5, 30):
        got = window_mask(q, k, window)
        for i, p in enumerate(q.tolist()):
            for j in k.tolist():
                assert bool(got[i, j]) == (j > p - window), (window, p, j)
    assert window_mask(q, k, None) is None


def test_window_must_exceed_what_one_draft_spans():
    with pytest.raises(ValueError, match="must exceed the 4 positions one draft spans"):
        DRAFTERS["dflash"].config_cls(block_size=4, sliding_window=4)
    with pytest.raises(ValueError, match="full_attention_layers \\[3\\]"):
        DRAFTERS["eagle3"].config_cls(num_layers=2, sliding_window=64, full_attention_layers=[3])
    config = DRAFTERS["peagle"].config_cls(num_layers=3, sliding_window=9, full_attention_layers=[1])
    assert config.layer_windows(3) == (9, None, 9)


# ---------------------------------------------------------------- DFlash / DSpark


def windowed_block_mask(anchors, valid, T, L, window, causal):
    """[B, A, L, T + L] brute force: slot o of a block at anchor a (position a + o) sees context t
    before a, inside the window (t > a + o - window), and the block's slots (0..o when causal)."""
    B, A = anchors.shape
    mask = torch.zeros(B, A, L, T + L, dtype=torch.bool)
    for b in range(B):
        for i in range(A):
            a = int(anchors[b, i])
            for o in range(L):
                for t in range(T):
                    mask[b, i, o, t] = bool(valid[b, i]) and t < a and t > a + o - window
                for o2 in range(L):
                    mask[b, i, o, T + o2] = o2 <= o or not causal
    return mask


@pytest.mark.parametrize("algo", ["dflash", "dspark"])
@pytest.mark.parametrize(("window", "causal"), [(5, False), (5, True), (100, True), (8, False)])
def test_block_training_pass_matches_the_windowed_reference(algo, window, causal):
    # the reference weighs positions by the fixed exp decay; D-PACE has its own reference test
    m = perturbed(
        build_block(
            algo,
            block_size=4,
            max_anchors=6,
            sliding_window=window,
            block_causal=causal,
            position_weights="exp",
        )
    )
    batch = random_batch(B=2, T=20, seed=window)
    input_ids, loss_mask, attention_mask = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
    rows = m.gather_rows(batch)  # eval mode: the anchors of generator seed 0
    anchors, valid = sample_anchors(loss_mask, attention_mask, 6, torch.Generator().manual_seed(0))
    L, K, first = 4, m.num_predictions, m.first_prediction
    ids, positions = block_queries(input_ids, anchors, L, MASK_ID)
    mask = windowed_block_mask(anchors, valid, input_ids.shape[1], L, window, causal)
    hidden = reference_run_blocks(m, ids, positions, m.context_kv(batch["aux_hidden_states"]), mask)
    hidden = hidden[:, :, first : first + K]
    target_pos, counted = block_targets(anchors, valid, loss_mask, attention_mask, K)
    b, a, k = counted.nonzero(as_tuple=True)
    ref = BlockRows(hidden[b, a, k], rows.target, rows.prev_ids, k, K)
    torch.testing.assert_close(m.draft_logits(rows.hidden), m.draft_logits(ref.hidden), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m.rows_loss(rows)[0], m.rows_loss(ref)[0], atol=1e-5, rtol=1e-5)
    if window < 20:  # the window cuts contexts: the full-attention reference differs
        mask = windowed_block_mask(anchors, valid, input_ids.shape[1], L, 10**6, causal)
        unwindowed = reference_run_blocks(m, ids, positions, m.context_kv(batch["aux_hidden_states"]), mask)
        assert not torch.allclose(unwindowed[:, :, first : first + K][b, a, k], rows.hidden, atol=1e-4)


@pytest.mark.parametrize("full_attention_layers", [[], [0]])
def test_block_training_equals_serving_with_windows(full_attention_layers):
    """Every block of the training pass = the block run alone on the context before its anchor
    (the serving pass), with sliding layers (one of them full) and a causal block."""
    m = build_block(
        num_layers=2,
        block_size=4,
        sliding_window=6,
        block_causal=True,
        full_attention_layers=full_attention_layers,
    ).eval()
    batch = random_batch(B=2, T=18)
    anchors, valid = sample_anchors(
        batch["loss_mask"], batch["attention_mask"], 6, torch.Generator().manual_seed(0)
    )
    ids, positions = block_queries(batch["input_ids"], anchors, 4, MASK_ID)
    with torch.no_grad():
        context = m.context_kv(batch["aux_hidden_states"])
        trained = m.run_blocks(ids, positions, context, block_context_mask(anchors, valid, 18, 4))
        full = build_block(num_layers=2, block_size=4).eval()
        full.load_state_dict(m.state_dict())
        differs = False
        for b, i in valid.nonzero().tolist():
            n = int(anchors[b, i])
            alone = m.run_blocks(
                ids[b, i][None, None],
                positions[b, i][None, None],
                m.context_kv(batch["aux_hidden_states"][b : b + 1, :n]),
                None,
            )
            torch.testing.assert_close(trained[b, i], alone[0, 0], atol=1e-5, rtol=1e-5)
            unwindowed = full.run_blocks(
                ids[b, i][None, None],
                positions[b, i][None, None],
                full.context_kv(batch["aux_hidden_states"][b : b + 1, :n]),
                None,
            )
            differs |= not torch.allclose(unwindowed[0, 0], alone[0, 0], atol=1e-4)
    assert differs  # the window cuts some contexts: it is applied, not just accepted


def test_causal_block_mask():
    assert causal_block_mask(3).tolist() == [[True, False, False], [True, True, False], [True, True, True]]


# ---------------------------------------------------------------- EAGLE-3 / P-EAGLE


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def batch(llama):
    model, _, _ = llama
    ids = torch.randint(0, 255, (3, 24), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, 5:] = True
    return pad_tail(verifier_batch(model, ids, loss_mask), row=2, length=16)


def windowed_ttt_outputs(drafter, window, input_ids, aux_hidden_states):
    """The dense TTT reference (every step over the K/V of all cached steps) with the window on
    positions: step k's key of row j sits at j + k, step s's query of row t at t + s."""

    def attend(cache, mask, i, attn, x, cos, sin):
        q = attn.project_q(x, cos, sin)
        cache[i].append(attn.project_kv(x, cos, sin))
        k = torch.cat([kv[0] for kv in cache[i]], dim=2)
        v = torch.cat([kv[1] for kv in cache[i]], dim=2)
        return attn.attend(q, k, v, mask[:, None])

    B, T = input_ids.shape
    R = T - 1
    hidden = drafter.combine(aux_hidden_states[:, :R])
    positions = torch.arange(R).expand(B, R)
    cache = [[] for _ in drafter.layers]
    outs = []
    for s in range(drafter.config.ttt_steps):
        tokens = shift_left(input_ids, 1 + s)[:, :R]
        key_pos = torch.cat([torch.arange(R) + k for k in range(s + 1)])  # [(s+1) R]
        mask = ttt_attention_mask(R, s) & (key_pos[None, :] > (torch.arange(R) + s)[:, None] - window)
        out, hidden = drafter.run_layers(tokens, hidden, positions + s, partial(attend, cache, mask[None]))
        outs.append(out)
    return outs


@pytest.mark.parametrize("style", ["llama", "qwen3"])
def test_eagle3_training_pass_matches_the_windowed_reference(llama, batch, style, monkeypatch):
    _, spec, weights = llama
    torch.manual_seed(0)
    config = DRAFTERS["eagle3"].config_cls(num_layers=2, ttt_steps=3, sliding_window=5, draft_layers=style)
    drafter = DRAFTERS["eagle3"].build(config, spec, weights, None, "kl")
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn_like(p))
    params = [p for p in drafter.parameters() if p.requires_grad]
    loss, _ = drafter(batch)
    grads = torch.autograd.grad(loss, params)
    monkeypatch.setattr(drafter, "ttt_outputs", partial(windowed_ttt_outputs, drafter, 10**6))
    assert not torch.allclose(drafter(batch)[0], loss, atol=1e-4)  # the window is applied
    monkeypatch.setattr(drafter, "ttt_outputs", partial(windowed_ttt_outputs, drafter, 5))
    ref_loss, _ = drafter(batch)
    ref_grads = torch.autograd.grad(ref_loss, params)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_eagle3_training_step_equals_serving_step_with_windows(llama, batch):
    _, spec, weights = llama
    torch.manual_seed(3)
    config = DRAFTERS["eagle3"].config_cls(
        num_layers=2, ttt_steps=3, num_speculative_tokens=3, sliding_window=5, full_attention_layers=[1]
    )
    drafter = DRAFTERS["eagle3"].build(config, spec, weights, None, "kl").eval()
    ids, aux = batch["input_ids"][0], batch["aux_hidden_states"][0]
    for t in (0, 7, 14):
        state: dict = {}
        if t:  # a cached prefix first, as a request's earlier proposal leaves it
            greedy_propose(drafter, ids[: t + 1], aux[:t], 3, state=state)
        drafts = greedy_propose(drafter, ids[: t + 2], aux[: t + 1], 3, state=state)
        assert torch.equal(
            drafts, greedy_propose(drafter, ids[: t + 2], aux[: t + 1], 3)
        )  # with or without the cache
        forced = ids.clone()
        forced[t + 2 : t + 4] = drafts[:2]
        with torch.no_grad():
            outs = drafter.ttt_outputs(forced[None], aux[None])
        trained = torch.stack([drafter.lm_head(out[0, t]).argmax() for out in outs])
        assert torch.equal(trained, drafts), (t, trained, drafts)
    with pytest.raises(ValueError, match="do not fit the sliding window"):
        greedy_propose(drafter, ids[:10], aux[:9], 5)


def windowed_rows_forward(drafter, window, input_ids, aux_hidden_states, anchor, depth, present):
    """P-EAGLE's dense reference with the window: real row t sees rows (t - window, t], a depth row
    at position anchor + depth sees real rows j <= anchor with j > anchor + depth - window."""
    B, R = aux_hidden_states.shape[:2]
    M = anchor.shape[1]
    ctx_mask, blk_index, blk_mask = block_layout(anchor, depth, present, R, drafter.config.num_depths)
    rows = torch.arange(R)
    ctx_mask = ctx_mask & (rows[None, None, :] > (anchor + depth)[..., None] - window)
    band = ((rows[None, :] <= rows[:, None]) & (rows[None, :] > rows[:, None] - window))[None, None]
    tokens = torch.cat([input_ids[:, 1 : R + 1], torch.full_like(anchor, drafter.verifier.mask_token_id)], 1)
    mask_feature = drafter.combine(drafter.mask_hidden.view(1, *aux_hidden_states.shape[-2:]))
    features = torch.cat([drafter.combine(aux_hidden_states), mask_feature.expand(B, M, -1)], 1)
    positions = torch.cat([rows.expand(B, R), anchor + depth], 1)
    bidx, gather = torch.arange(B)[:, None, None], blk_index.clamp(min=0)

    def attend(i, attn, x, cos, sin):
        q = attn.project_q(x, cos, sin)
        k, v = attn.project_kv(x, cos, sin)
        real = attn.attend(q[:, :, :R], k[:, :, :R], v[:, :, :R], band)
        bk = k[:, :, R:].transpose(1, 2)[bidx, gather].permute(0, 3, 1, 2, 4)
        bv = v[:, :, R:].transpose(1, 2)[bidx, gather].permute(0, 3, 1, 2, 4)
        drafts = reference_block_attention(
            attn, q[:, :, R:], k[:, :, :R], v[:, :, :R], ctx_mask, bk, bv, blk_mask
        )
        return torch.cat([real, drafts], 1)

    out, _ = drafter.run_layers(tokens, features, positions, attend)
    return out[:, :R], out[:, R:]


def test_peagle_training_pass_matches_the_windowed_reference(llama, batch, monkeypatch):
    _, spec, weights = llama
    torch.manual_seed(0)
    config = DRAFTERS["peagle"].config_cls(
        num_layers=2, num_depths=4, num_speculative_tokens=4, sliding_window=6
    )
    drafter = DRAFTERS["peagle"].build(config, spec, weights, None, "kl").eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn_like(p))
    loss, metrics = drafter(batch)
    monkeypatch.setattr(drafter, "rows_forward", partial(windowed_rows_forward, drafter, 10**6))
    assert not torch.allclose(drafter(batch)[0], loss, atol=1e-4)  # the window is applied
    monkeypatch.setattr(drafter, "rows_forward", partial(windowed_rows_forward, drafter, 6))
    ref_loss, ref_metrics = drafter(batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(metrics["depth_loss"], ref_metrics["depth_loss"], rtol=1e-5, atol=1e-5)


def test_peagle_training_rows_equal_serving_pass_with_windows(llama, batch):
    _, spec, weights = llama
    torch.manual_seed(4)
    config = DRAFTERS["peagle"].config_cls(
        num_layers=2, num_depths=4, num_speculative_tokens=4, sliding_window=6, draft_layers="qwen3"
    )
    drafter = DRAFTERS["peagle"].build(config, spec, weights, None, "kl").eval()
    ids, aux = batch["input_ids"][:1], batch["aux_hidden_states"][:1, :-1]
    valid = torch.ones(4, 1, ids.shape[1] - 1, dtype=torch.bool)
    anchor, depth, present = drafter.sample_rows(valid, keep_all=True)
    with torch.no_grad():
        out_real, out_depth = drafter.rows_forward(ids, aux, anchor, depth, present)
    for t in (0, 9, 18):
        drafts = greedy_propose(drafter, ids[0, : t + 2], aux[0, : t + 1], 4)
        where = [((anchor[0] == t) & (depth[0] == d) & present[0]).nonzero()[0, 0] for d in range(1, 4)]
        trained = torch.stack(
            [drafter.lm_head(r).argmax() for r in [out_real[0, t]] + [out_depth[0, m] for m in where]]
        )
        assert torch.equal(trained, drafts), (t, trained, drafts)


@pytest.mark.parametrize("algo", sorted(DRAFTERS))
def test_a_window_longer_than_the_sequence_changes_nothing(llama, batch, algo):
    """The windowed path on a sequence the window covers = the full-attention path, exactly."""
    _, spec, weights = llama
    s = DRAFTERS[algo]
    torch.manual_seed(0)
    full = s.build(s.config_cls(**s.tiny), spec, weights, None, "kl").eval()
    windowed = s.build(s.config_cls(**s.tiny, sliding_window=64), spec, weights, None, "kl").eval()
    windowed.load_state_dict(full.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(windowed(batch)[0], full(batch)[0], rtol=1e-6, atol=1e-6)
    ids, aux = batch["input_ids"][0, :15], batch["aux_hidden_states"][0, :14]
    assert torch.equal(greedy_propose(windowed, ids, aux, 2), greedy_propose(full, ids, aux, 2))
