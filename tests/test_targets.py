"""The verifier-target table: computed once per scored position, equal to per-row logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specctl.drafters.targets import (
    batch_targets,
    build_draft_vocab,
    draft_loss,
    scored_positions,
    target_table,
    verifier_logits,
    verifier_targets,
)

V, H = 97, 16


def _weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(H, generator=g) + 0.5, torch.randn(V, H, generator=g)


def test_scored_positions_are_the_loss_mask_shifted_left():
    loss = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]], dtype=torch.bool)
    attn = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    want = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(scored_positions(loss, attn), want)


def test_table_rows_equal_per_row_logits_with_and_without_draft_vocab():
    norm, lm_head = _weights()
    g = torch.Generator().manual_seed(1)
    last = torch.randn(3, 11, H, generator=g)
    scored = torch.rand(3, 11, generator=g) < 0.6
    _, t2d = build_draft_vocab(torch.rand(V, generator=g), 40)
    b, t = scored.nonzero(as_tuple=True)
    perm = torch.randperm(b.numel(), generator=g)
    b, t = torch.cat([b[perm], b]), torch.cat([t[perm], t])  # repeated, in any order
    for kept in (None, t2d):
        table = target_table(last, scored, norm, lm_head, 1e-6, kept)
        assert table.targets.argmax.numel() == int(scored.sum())  # one row per position
        got = table.at(b, t)
        full = verifier_logits(last[b, t], norm, lm_head, 1e-6)  # brute force: every row again
        assert torch.equal(got.argmax, full.argmax(-1))
        want_kept = full if kept is None else full[:, kept]
        torch.testing.assert_close(got.kept_logits, want_kept)
        torch.testing.assert_close(got.logsumexp, torch.logsumexp(full, -1))


def test_chunking_does_not_change_targets():
    norm, lm_head = _weights()
    last = torch.randn(37, H, generator=torch.Generator().manual_seed(2))
    a = verifier_targets(last, norm, lm_head, 1e-6, None, chunk_rows=5)
    b = verifier_targets(last, norm, lm_head, 1e-6, None, chunk_rows=1000)
    assert torch.equal(a.argmax, b.argmax)
    torch.testing.assert_close(a.kept_logits, b.kept_logits)
    empty = verifier_targets(last[:0], norm, lm_head, 1e-6, None)
    assert empty.argmax.shape == (0,) and empty.kept_logits.shape == (0, V)


def test_kl_loss_matches_cross_entropy_to_the_renormalised_kept_distribution():
    norm, lm_head = _weights()
    g = torch.Generator().manual_seed(3)
    last = torch.randn(2, 9, H, generator=g)
    batch = {
        "last_hidden_state": last,
        "loss_mask": torch.ones(2, 9, dtype=torch.bool),
        "attention_mask": torch.ones(2, 9, dtype=torch.bool),
    }
    _, t2d = build_draft_vocab(torch.rand(V, generator=g), 30)
    table = batch_targets(batch, norm, lm_head, 1e-6, t2d)
    b, t = scored_positions(batch["loss_mask"], batch["attention_mask"]).nonzero(as_tuple=True)
    draft = torch.randn(b.numel(), 30, generator=g)
    loss, correct, valid = draft_loss(draft, table.at(b, t), t2d, "kl")
    p = F.softmax(verifier_logits(last[b, t], norm, lm_head, 1e-6)[:, t2d], -1)
    torch.testing.assert_close(loss, -(p * F.log_softmax(draft, -1)).sum(-1))
    assert valid.all() and correct.dtype == torch.bool
