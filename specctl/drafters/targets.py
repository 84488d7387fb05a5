"""Training targets shared by all drafters: the verifier's distribution, draft vocabulary, loss.

The verifier's next-token distribution at position t is norm + lm_head of its final hidden
state there; a drafter predicting the token after t is scored against it (KL) or against its
argmax/next token (CE). With a reduced draft vocabulary the target is restricted to the kept
ids and renormalised, as in vLLM where the drafter can only propose kept ids.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def build_draft_vocab(token_freq: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the `draft_vocab_size` most frequent target ids (ties: lower id first).

    token_freq [V] -> d2t [Vd] int64 OFFSET table (target = draft + d2t[draft]), t2d [V] bool.
    Kept ids are sorted ascending, as vLLM expects.
    """
    V = token_freq.numel()
    if not 0 < draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size must be in 1..{V}, got {draft_vocab_size}")
    # stable sort on -freq keeps lower ids first among equal counts
    order = torch.sort(-token_freq.double(), stable=True).indices[:draft_vocab_size]
    kept = torch.sort(order).values  # [Vd] ascending target ids
    d2t = kept - torch.arange(draft_vocab_size, dtype=kept.dtype)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    return d2t.long(), t2d


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """Map draft-vocab ids to verifier ids (identity without a reduced vocabulary)."""
    return draft_ids if d2t is None else draft_ids + d2t[draft_ids]


def target_to_draft(target_ids: torch.Tensor, t2d: torch.Tensor | None) -> torch.Tensor:
    """Map verifier ids to draft ids; ids outside the draft vocabulary become -1."""
    if t2d is None:
        return target_ids
    index = torch.cumsum(t2d.long(), 0) - 1  # [V] draft id of each kept target id
    return torch.where(t2d[target_ids], index[target_ids], torch.full_like(target_ids, -1))


def verifier_logits(
    last_hidden_state: torch.Tensor, norm_weight: torch.Tensor, lm_head: torch.Tensor, eps: float
) -> torch.Tensor:
    """[..., H] final hidden state -> [..., V] verifier logits (its frozen final norm + LM head)."""
    h = last_hidden_state.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    return h @ lm_head.float().T


def draft_loss(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    t2d: torch.Tensor | None,
    kind: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row loss and correctness of draft predictions.

    draft_logits [N, Vd], target_logits [N, V] (verifier logits for the same next token).
    Returns (loss [N], correct [N] bool, valid [N] bool). `kind` "kl": forward KL from the
    verifier's distribution (restricted to the draft vocab); "ce": cross-entropy to the
    verifier's argmax. `correct` compares argmaxes in target ids, which is what greedy
    verification accepts. Rows whose target argmax is outside the draft vocabulary are
    invalid for "ce" (nothing to learn) but still count as wrong for accuracy.
    """
    target_argmax = target_logits.argmax(-1)  # [N]
    kept_logits = target_logits if t2d is None else target_logits[:, t2d]  # [N, Vd]
    logp_draft = F.log_softmax(draft_logits.float(), -1)
    if kind == "kl":
        p_target = F.softmax(kept_logits.float(), -1)
        loss = -(p_target * logp_draft).sum(-1)  # cross-entropy to p == KL up to a constant
        valid = torch.ones_like(target_argmax, dtype=torch.bool)
    elif kind == "ce":
        labels = target_to_draft(target_argmax, t2d)
        valid = labels >= 0
        loss = -logp_draft.gather(-1, labels.clamp(min=0)[:, None])[:, 0] * valid
    else:
        raise ValueError(f"unknown loss kind {kind!r}; use 'kl' or 'ce'")
    d2t_table = None
    if t2d is not None:
        kept = t2d.nonzero()[:, 0]
        d2t_table = kept - torch.arange(kept.numel(), device=kept.device)
    predicted = draft_to_target(draft_logits.argmax(-1), d2t_table)
    return loss, predicted == target_argmax, valid
