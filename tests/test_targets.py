"""The verifier-target table: computed once per scored position, equal to per-row logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specctl.drafters.targets import (
    batch_targets,
    build_draft_vocab,
    draft_loss,
    scored_positions,
    target_table,
    targets_from_logits,
    targets_from_topk,
    topk_compact,
    verifier_logits,
    verifier_targets,
    verifier_topk,
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


def test_correct_is_the_first_maximal_draft_id_against_the_verifier_argmax_even_with_ties():
    """`correct` is what greedy verification accepts: the draft's first maximal id (mapped to
    target ids) equals the verifier's. Checked row by row in Python on bf16 logits full of ties
    (autocast's dtype, where draft_loss takes its fast path)."""
    g = torch.Generator().manual_seed(5)
    _, t2d = build_draft_vocab(torch.rand(V, generator=g), 30)
    d2t = t2d.nonzero()[:, 0]  # [Vd] draft id -> target id
    draft = torch.randint(-2, 2, (200, 30), generator=g).to(torch.bfloat16)  # [N, Vd], many ties
    target = targets_from_logits(torch.randn(200, V, generator=g), t2d)
    target.argmax = d2t[torch.randint(0, 30, (200,), generator=g)]  # the verifier's top ids, all kept
    _, correct, _ = draft_loss(draft, target, t2d, "kl")
    rows = zip(draft.tolist(), target.argmax.tolist(), strict=True)
    expected = [int(d2t[row.index(max(row))]) == top for row, top in rows]
    assert correct.tolist() == expected and 0 < sum(expected) < 200


def _hidden_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return g, {
        "last_hidden_state": torch.randn(3, 10, H, generator=g),
        "loss_mask": torch.rand(3, 10, generator=g) < 0.7,
        "attention_mask": torch.tensor([[1] * 10, [1] * 7 + [0] * 3, [1] * 10], dtype=torch.bool),
    }


def test_rows_subset_gives_the_same_targets_as_the_whole_table():
    """A block drafter asks only for the positions its anchors reach: each such row is the row
    the whole table has there, and the table holds no other row."""
    norm, lm_head = _weights()
    g, batch = _hidden_batch(10)
    _, t2d = build_draft_vocab(torch.rand(V, generator=g), 30)
    scored = scored_positions(batch["loss_mask"], batch["attention_mask"])
    rows = scored & (torch.rand(3, 10, generator=g) < 0.5)
    b, t = rows.nonzero(as_tuple=True)
    for kept in (None, t2d):
        whole = batch_targets(batch, norm, lm_head, 1e-6, kept).at(b, t)
        part = batch_targets(batch, norm, lm_head, 1e-6, kept, rows=rows)
        assert part.targets.kept_logits.shape[0] == int(rows.sum())
        got = part.at(b, t)
        assert torch.equal(got.argmax, whole.argmax)
        torch.testing.assert_close(got.kept_logits, whole.kept_logits)
        torch.testing.assert_close(got.logsumexp, whole.logsumexp)


def test_kept_only_targets_have_the_same_kept_logits_and_no_full_statistics():
    norm, lm_head = _weights()
    g, batch = _hidden_batch(11)
    _, t2d = build_draft_vocab(torch.rand(V, generator=g), 30)
    for kept in (None, t2d):
        full = batch_targets(batch, norm, lm_head, 1e-6, kept).targets
        lean = batch_targets(batch, norm, lm_head, 1e-6, kept, full=False).targets
        assert lean.argmax is None and lean.logsumexp is None
        torch.testing.assert_close(lean.kept_logits, full.kept_logits)
        draft = torch.randn(lean.kept_logits.shape, generator=g)
        loss_full, correct, _ = draft_loss(draft, full, kept, "kl")
        loss_lean, none, _ = draft_loss(draft, lean, kept, "kl")
        torch.testing.assert_close(loss_lean, loss_full)
        assert correct is not None and none is None


def test_stored_statistics_are_used_as_they_are():
    """A store that kept argmax / logsumexp at collect time: training reads them (even when the
    step asks for the full statistics) and forms only the kept logits itself."""
    norm, lm_head = _weights()
    g, batch = _hidden_batch(12)
    _, t2d = build_draft_vocab(torch.rand(V, generator=g), 30)
    logits = verifier_logits(batch["last_hidden_state"], norm, lm_head, 1e-6)  # [B, T, V]
    stored = {**batch, "target_argmax": logits.argmax(-1), "logsumexp": torch.logsumexp(logits, -1)}
    fake = {**stored, "target_argmax": (stored["target_argmax"] + 1) % V}  # proves it is read, not recomputed
    for kept in (None, t2d):
        want = batch_targets(batch, norm, lm_head, 1e-6, kept).targets
        got = batch_targets(stored, norm, lm_head, 1e-6, kept).targets
        assert torch.equal(got.argmax, want.argmax)
        torch.testing.assert_close(got.logsumexp, want.logsumexp)
        torch.testing.assert_close(got.kept_logits, want.kept_logits)
        read = batch_targets(fake, norm, lm_head, 1e-6, kept, full=False).targets
        assert torch.equal(read.argmax, (want.argmax + 1) % V)


def test_ce_needs_the_argmax():
    norm, lm_head = _weights()
    _, batch = _hidden_batch(13)
    lean = batch_targets(batch, norm, lm_head, 1e-6, None, full=False).targets
    with pytest.raises(ValueError, match="argmax"):
        draft_loss(torch.randn(lean.kept_logits.shape), lean, None, "ce")


# ---------------------------------------------------------------- top-k targets (compact feature stores)


def _brute_topk_kept(logits: torch.Tensor, k: int, t2d: torch.Tensor | None) -> torch.Tensor:
    """[N, V] -> [N, Vd]: the full logits at each row's k largest ids that are kept, -inf elsewhere,
    one row and one id at a time."""
    N, V = logits.shape
    kept_ids = list(range(V)) if t2d is None else t2d.nonzero()[:, 0].tolist()
    out = torch.full((N, len(kept_ids)), float("-inf"))
    for n in range(N):
        top = sorted(range(V), key=lambda v: -logits[n, v].item())[:k]
        for col, v in enumerate(kept_ids):
            if v in top:
                out[n, col] = logits[n, v]
    return out


def test_topk_compact_is_the_k_largest_logits_as_logprobs():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, V, generator=g) * 4
    for k in (1, 5, V, V + 3):
        ids, logprobs, lse = topk_compact(logits, k)
        assert ids.shape == logprobs.shape == (6, min(k, V)) and lse.shape == (6,)
        for n in range(6):
            order = sorted(range(V), key=lambda v: -logits[n, v].item())[: min(k, V)]
            assert ids[n].tolist() == order
        torch.testing.assert_close(lse, torch.logsumexp(logits, -1))
        torch.testing.assert_close(logprobs, F.log_softmax(logits, -1).gather(1, ids))
        assert (logprobs[:, 1:] <= logprobs[:, :-1]).all()  # descending: ids[:, 0] is the argmax


def test_targets_from_topk_equal_full_targets_on_argmax_logsumexp_and_kept_entries():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(9, V, generator=g) * 3
    _, t2d = build_draft_vocab(torch.rand(V, generator=g), 40)
    for kept in (None, t2d):
        full = targets_from_logits(logits, kept)
        for k in (1, 8, V):
            got = targets_from_topk(*topk_compact(logits, k), kept, V)
            assert torch.equal(got.argmax, full.argmax)
            torch.testing.assert_close(got.logsumexp, full.logsumexp)
            want = _brute_topk_kept(logits, k, kept)
            assert torch.equal(got.kept_logits.isfinite(), want.isfinite())
            inside = want.isfinite()
            torch.testing.assert_close(got.kept_logits[inside], full.kept_logits[inside])
            torch.testing.assert_close(got.kept_logits[inside], want[inside])
        # k = V keeps everything: the same Targets as the full logits
        torch.testing.assert_close(
            targets_from_topk(*topk_compact(logits, V), kept, V).kept_logits, full.kept_logits
        )


def test_float16_logprobs_keep_the_mass_carrying_entries_precise():
    """The store keeps top-k log-probs in float16: the error is relative to |log p|, so it is
    smallest where the probability is largest, and p itself moves by under |log p| * 2^-11."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(64, V, generator=g) * 6
    _, logprobs, _ = topk_compact(logits, 16)
    stored = logprobs.half().float()
    assert ((stored - logprobs).abs() <= logprobs.abs() * 2**-11 + 1e-7).all()
    p, q = logprobs.exp(), stored.exp()
    assert ((p - q).abs() <= p * (logprobs.abs() * 2**-11 * 1.01 + 1e-6)).all()


def test_verifier_topk_is_topk_of_verifier_logits_in_any_chunking():
    norm, lm_head = _weights()
    last = torch.randn(37, H, generator=torch.Generator().manual_seed(7))
    want = topk_compact(verifier_logits(last, norm, lm_head, 1e-6), 6)
    for chunk in (5, 1000):
        got = verifier_topk(last, norm, lm_head, 1e-6, 6, chunk_rows=chunk)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
        torch.testing.assert_close(got[2], want[2])


def test_batch_targets_from_a_topk_batch_match_the_hidden_state_batch():
    norm, lm_head = _weights()
    g = torch.Generator().manual_seed(8)
    last = torch.randn(2, 9, H, generator=g)
    masks = {
        "loss_mask": torch.rand(2, 9, generator=g) < 0.7,
        "attention_mask": torch.tensor([[1] * 9, [1] * 6 + [0] * 3], dtype=torch.bool),
    }
    ids, logprobs, lse = verifier_topk(last.flatten(0, 1), norm, lm_head, 1e-6, 7)
    compact = {
        "topk_ids": ids.view(2, 9, 7),
        "topk_logprobs": logprobs.view(2, 9, 7),
        "logsumexp": lse.view(2, 9),
        **masks,
    }
    _, t2d = build_draft_vocab(torch.rand(V, generator=g), 30)
    for kept in (None, t2d):
        full = batch_targets({"last_hidden_state": last, **masks}, norm, lm_head, 1e-6, kept)
        got = batch_targets(compact, norm, lm_head, 1e-6, kept)
        assert torch.equal(got.index, full.index)
        assert torch.equal(got.targets.argmax, full.targets.argmax)
        torch.testing.assert_close(got.targets.logsumexp, full.targets.logsumexp)
        inside = got.targets.kept_logits.isfinite()
        assert (inside.sum(-1) <= 7).all()
        torch.testing.assert_close(got.targets.kept_logits[inside], full.targets.kept_logits[inside])


def test_losses_from_topk_targets():
    """ce: exactly the full-logit loss (the argmax is exact). kl: cross-entropy to the verifier's
    distribution on top-k & draft vocabulary, renormalised; a row whose top k all fall outside
    the draft vocabulary is invalid with loss 0, never NaN."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(12, V, generator=g) * 3
    _, t2d = build_draft_vocab(torch.rand(V, generator=g), 30)
    logits[0, ~t2d] += 50.0  # row 0: its top 4 are all outside the draft vocabulary
    draft = torch.randn(12, 30, generator=g, requires_grad=True)
    full = targets_from_logits(logits, t2d)
    topk = targets_from_topk(*topk_compact(logits, 4), t2d, V)

    ce_full, ok_full, valid_full = draft_loss(draft, full, t2d, "ce")
    ce_topk, ok_topk, valid_topk = draft_loss(draft, topk, t2d, "ce")
    torch.testing.assert_close(ce_topk, ce_full)
    assert torch.equal(ok_topk, ok_full) and torch.equal(valid_topk, valid_full)

    loss, correct, valid = draft_loss(draft, topk, t2d, "kl")
    assert torch.equal(correct, ok_full) and loss.isfinite().all()
    logp = F.log_softmax(draft.detach(), -1)
    kept_ids = t2d.nonzero()[:, 0]
    for n in range(12):
        top = set(sorted(range(V), key=lambda v: -logits[n, v].item())[:4])
        cols = [c for c, v in enumerate(kept_ids.tolist()) if v in top]
        assert bool(valid[n]) == bool(cols)
        if not cols:
            assert loss[n] == 0
            continue
        p = F.softmax(logits[n, kept_ids[cols]], -1)
        torch.testing.assert_close(loss[n], -(p * logp[n, cols]).sum())
    assert not valid[0] and valid.any()
    loss.sum().backward()
    assert draft.grad.isfinite().all() and draft.grad[0].abs().sum() == 0
