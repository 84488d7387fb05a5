"""Training targets shared by all drafters: the verifier's distribution, draft vocabulary, loss.

The verifier's next-token distribution at position t is norm + lm_head of its final hidden
state there; a drafter predicting the token after t is scored against it (KL) or against its
argmax/next token (CE). With a reduced draft vocabulary the target is restricted to the kept
ids and renormalised, as in vLLM where the drafter can only propose kept ids.

A feature store may hold the verifier's output compacted to its top-k log-probs plus the exact
logsumexp over the full vocabulary (`topk_compact`); `targets_from_topk` builds the same
`Targets` from that: the argmax, the logsumexp and every kept entry inside the top k are what
the full logits give, entries outside the top k are -inf. So "ce" is unchanged, and "kl"
matches the verifier's distribution restricted to top-k & draft vocabulary, renormalised (the
tail mass, typically a few percent, is dropped); `p(kept) = exp(kept_logits - logsumexp)` stays
exact on the top k and is 0 beyond it.

Memory: a step of an 8B recipe scores ~131k rows against a 128,256-token vocabulary, so neither
side of the loss is ever formed for all rows at once. `Targets` keep each row compact (the
verifier's final hidden state, its top k, or already formed logits when a table fits one chunk)
and form `kept_logits` for a slice of rows on demand; `chunked_rows` runs a drafter's logits and
loss a chunk of rows at a time, recomputing each chunk in the backward (`LOSS_CHUNK_BYTES`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from specctl.drafters.vocab import d2t_from_t2d, kept_ids_from_t2d, t2d_from_d2t


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
    d2t = (kept - torch.arange(draft_vocab_size, dtype=kept.dtype)).long()
    return d2t, t2d_from_d2t(d2t, V)


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


# ---------------------------------------------------------------- chunk size of the vocabulary loss

LOSS_CHUNK_BYTES = 1 << 30
"""Byte budget of one loss chunk's float32 [rows, vocab] buffer. The vocabulary loss forms a few
such buffers per chunk (draft logits, their log-softmax, the target's kept logits and softmax,
then their gradients in the backward; measured in float32: a peak of 5 buffers for "kl", 1.3 for
"ce", tests/test_chunked_loss.py), never one over every row of a step: 131k rows of a
128,256-token vocabulary would be 67 GB each."""


def loss_chunk_rows(vocab_size: int) -> int:
    """Rows of one loss chunk: how many float32 rows of `vocab_size` logits fit LOSS_CHUNK_BYTES (>= 1).

    vocab_size: the width of the logits the loss forms (the draft vocabulary; all V without one).
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return max(1, LOSS_CHUNK_BYTES // (4 * vocab_size))


# ---------------------------------------------------------------- kept logits, formed on demand


@dataclass(frozen=True)
class DenseKept:
    """Kept logits already formed, [M, Vd]: a table small enough to hold (one loss chunk's worth),
    or logits a caller already has (tests)."""

    logits: torch.Tensor  # [M, Vd]

    @property
    def width(self) -> int:
        return self.logits.shape[-1]

    def kept(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n] -> [n, Vd]."""
        return self.logits[rows]


@dataclass(frozen=True)
class HiddenKept:
    """The verifier's final hidden states at M positions and its frozen norm + the LM head rows of
    the kept ids: a row's kept logits are formed only when a loss chunk reads it."""

    hidden: torch.Tensor  # [M, H]
    norm_weight: torch.Tensor  # [H]
    head: torch.Tensor  # [Vd, H] the verifier's LM head rows of the draft vocabulary (all V without one)
    eps: float

    @property
    def width(self) -> int:
        return self.head.shape[0]

    @torch.no_grad()
    def kept(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n] -> [n, Vd]."""
        return verifier_logits(self.hidden[rows], self.norm_weight, self.head, self.eps)


@dataclass(frozen=True)
class TopKKept:
    """A top-k store's M positions: each stored id's column in the draft vocabulary and its logit
    (logprob + logsumexp); a row's kept logits are those at its columns and -inf elsewhere."""

    cols: torch.Tensor  # [M, k] int64 draft id of each stored id, -1 outside the draft vocabulary
    logits: torch.Tensor  # [M, k] float32 the verifier's logit there
    width: int  # Vd

    def kept(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n] -> [n, Vd]."""
        cols, logits = self.cols[rows], self.logits[rows]  # [n, k]
        # ids outside the draft vocabulary write -inf (into column 0) under a max, so they change
        # nothing: a scatter of fixed shape, where picking the inside entries by mask would make
        # the host wait for the GPU (nonzero); inside ids are distinct columns (d2t is one-to-one)
        out = torch.full((cols.shape[0], self.width), float("-inf"), device=logits.device)
        inside = cols >= 0
        src = logits.masked_fill(~inside, float("-inf"))
        return out.scatter_reduce_(1, cols.clamp(min=0), src, reduce="amax")


KeptTable = DenseKept | HiddenKept | TopKKept


@dataclass
class Targets:
    """The verifier's next-token distribution at N rows, reduced to what the losses read.

    `argmax` and `logsumexp` need the full vocabulary: they are formed once per scored position
    (from [chunk, V] logits, never kept) and shared by every row that reads the position (several
    blocks, depths or TTT steps); None when they were not asked for (training with the KL loss
    reads only the kept logits, see `full_stats_needed`) and the store did not keep them. The kept
    logits stay in the table's compact form (`KeptTable`) and a loss forms them for a chunk of
    rows at a time (`kept_logits` of a slice): indexing picks rows only, and no [N, Vd] buffer
    over every row of a step needs to exist.
    """

    argmax: torch.Tensor | None  # [N] the verifier's top token (full-vocabulary id)
    logsumexp: torch.Tensor | None  # [N] over the full vocabulary: p(kept) = exp(kept_logits - logsumexp)
    table: KeptTable  # the kept logits of M positions, compact
    rows: torch.Tensor  # [N] int64: the table position of each row

    @classmethod
    def dense(
        cls,
        kept_logits: torch.Tensor,
        argmax: torch.Tensor | None = None,
        logsumexp: torch.Tensor | None = None,
    ) -> Targets:
        """Targets from kept logits [N, Vd] a caller already holds."""
        rows = torch.arange(kept_logits.shape[0], device=kept_logits.device)
        return cls(argmax, logsumexp, DenseKept(kept_logits), rows)

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, index) -> Targets:
        pick = lambda t: None if t is None else t[index]
        return Targets(pick(self.argmax), pick(self.logsumexp), self.table, self.rows[index])

    @property
    def kept_logits(self) -> torch.Tensor:
        """[N, Vd] logits on the draft vocabulary (all V without one), formed now for every row:
        a loss reads it on a chunk (`chunked_rows`), not on a whole step's targets."""
        return self.table.kept(self.rows)

    def materialized(self) -> Targets:
        """The same rows with their kept logits formed once, for a chunk that reads them twice."""
        return Targets.dense(self.kept_logits, self.argmax, self.logsumexp)


def full_stats_needed(training: bool, loss_kind: str) -> bool:
    """Whether a drafter's step needs the verifier's argmax / logsumexp over the full vocabulary.

    Validation scores accuracy against the argmax and "ce" trains on it; a training step with the
    KL loss reads only the kept logits, and forming the full-vocabulary statistics was most of a
    DFlash step on a CPU (a [rows, 49152] matmul, max and exp per step).
    """
    return not training or loss_kind == "ce"


@dataclass
class TargetTable:
    """`Targets` for the scored positions of a batch, looked up by (row, position)."""

    targets: Targets  # [M] one row per scored position
    index: torch.Tensor  # [B, T] row of each position in `targets`, -1 where nothing is scored

    def at(self, b: torch.Tensor, t: torch.Tensor) -> Targets:
        """Targets for predictions scored against the verifier's output at positions (b, t), [N]."""
        return self.targets[self.index[b, t]]


@torch.no_grad()
def verifier_targets(
    last_hidden_state: torch.Tensor,
    norm_weight: torch.Tensor,
    lm_head: torch.Tensor,
    eps: float,
    t2d: torch.Tensor | None,
    chunk_rows: int | None = None,
    full: bool = True,
    dense_rows: int | None = None,
) -> Targets:
    """[M, H] final hidden states -> Targets [M].

    The kept logits are formed now when M <= dense_rows (default: one loss chunk,
    `loss_chunk_rows`), so a small step forms each position's logits once however many rows read
    it; beyond that the table keeps the hidden states and a loss chunk forms the logits it reads.
    full: also the argmax and logsumexp over the full vocabulary, from [chunk_rows, V] logits a
    chunk at a time (default: a loss chunk of V). full=False forms only kept logits: with a
    draft vocabulary that is a [M, Vd] product instead of [M, V] plus two passes over it.
    """
    kept_ids = None if t2d is None else kept_ids_from_t2d(t2d)
    kept_head = lambda: lm_head if kept_ids is None else lm_head.index_select(0, kept_ids)  # [Vd, H]
    positions = last_hidden_state.shape[0]
    rows = torch.arange(positions, device=last_hidden_state.device)
    width = lm_head.shape[0] if kept_ids is None else kept_ids.numel()
    dense = positions <= (loss_chunk_rows(width) if dense_rows is None else dense_rows)
    # float32 once here, not in every chunk that reads it (verifier_logits computes in float32)
    compact = None if dense else HiddenKept(last_hidden_state, norm_weight, kept_head().float(), eps)
    if not full:
        if compact is not None:
            return Targets(None, None, compact, rows)
        return Targets.dense(verifier_logits(last_hidden_state, norm_weight, kept_head(), eps))
    chunks = last_hidden_state.split(chunk_rows or loss_chunk_rows(lm_head.shape[0])) or [last_hidden_state]
    argmax, logsumexp, kept = [], [], []
    for part in chunks:
        logits = verifier_logits(part, norm_weight, lm_head, eps)  # [chunk, V]
        argmax.append(logits.argmax(-1))
        logsumexp.append(torch.logsumexp(logits.float(), -1))
        if dense:
            kept.append(logits if kept_ids is None else logits.index_select(1, kept_ids))
    if compact is not None:
        return Targets(torch.cat(argmax), torch.cat(logsumexp), compact, rows)
    return Targets.dense(torch.cat(kept), torch.cat(argmax), torch.cat(logsumexp))


def targets_from_logits(logits: torch.Tensor, t2d: torch.Tensor | None) -> Targets:
    """Full verifier logits [N, V] -> Targets [N]."""
    kept_logits = logits if t2d is None else logits.index_select(1, kept_ids_from_t2d(t2d))
    return Targets.dense(kept_logits, logits.argmax(-1), torch.logsumexp(logits.float(), -1))


def topk_compact(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full verifier logits [N, V] -> ids [N, k'] int64, logprobs [N, k'] float32, logsumexp [N] float32.

    k' = min(k, V). Ids are in descending order of logit, so ids[:, 0] is the argmax (ties broken
    by torch.topk). Log-probs rather than logits: the store keeps them in float16, where the
    entries holding the mass (log-probs near 0) are the precisely represented ones.
    """
    logits = logits.float()
    logsumexp = torch.logsumexp(logits, -1)  # [N]
    values, ids = logits.topk(min(k, logits.shape[-1]), -1)  # [N, k'] sorted descending
    return ids, values - logsumexp[:, None], logsumexp


@torch.no_grad()
def verifier_topk(
    last_hidden_state: torch.Tensor,
    norm_weight: torch.Tensor,
    lm_head: torch.Tensor,
    eps: float,
    k: int,
    chunk_rows: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, H] final hidden states -> `topk_compact` of their logits, a [chunk, V] block at a time."""
    chunks = last_hidden_state.split(chunk_rows) or [last_hidden_state]
    parts = [topk_compact(verifier_logits(rows, norm_weight, lm_head, eps), k) for rows in chunks]
    ids, logprobs, logsumexp = (torch.cat(p) for p in zip(*parts, strict=True))
    return ids, logprobs, logsumexp


def targets_from_topk(
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    logsumexp: torch.Tensor,
    t2d: torch.Tensor | None,
    vocab_size: int,
) -> Targets:
    """Stored top-k ids / log-probs [N, k] (descending) and logsumexp [N] -> Targets [N].

    The kept logits hold logprob + logsumexp (the verifier's logit) at the top-k ids that are in
    the draft vocabulary and -inf everywhere else; they stay [N, k] until a loss chunk reads them.
    """
    width = vocab_size if t2d is None else int(t2d.sum())
    logsumexp = logsumexp.float()
    table = TopKKept(target_to_draft(topk_ids, t2d), topk_logprobs.float() + logsumexp[:, None], width)
    rows = torch.arange(topk_ids.shape[0], device=topk_ids.device)
    return Targets(topk_ids[:, 0], logsumexp, table, rows)


def target_table(
    last_hidden_state: torch.Tensor,
    scored: torch.Tensor,
    norm_weight: torch.Tensor,
    lm_head: torch.Tensor,
    eps: float,
    t2d: torch.Tensor | None,
    full: bool = True,
) -> TargetTable:
    """Targets at the positions `scored` [B, T] (bool) of last_hidden_state [B, T, H], computed once.

    A drafter scores predictions of token j against the verifier's output at j-1, so `scored`
    is the loss mask shifted left by one: every position whose next token is a counted one.
    """
    b, t = scored.nonzero(as_tuple=True)
    return TargetTable(
        verifier_targets(last_hidden_state[b, t], norm_weight, lm_head, eps, t2d, full=full),
        _row_index(scored),
    )


def _row_index(scored: torch.Tensor) -> torch.Tensor:
    """[B, T] bool -> [B, T] int64: the row of each scored position among all of them, -1 elsewhere."""
    b, t = scored.nonzero(as_tuple=True)
    index = torch.full(scored.shape, -1, dtype=torch.long, device=scored.device)
    index[b, t] = torch.arange(b.numel(), device=scored.device)
    return index


def scored_positions(loss_mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: positions whose next token is a real loss-masked token (where targets are read)."""
    counted = loss_mask.bool() & attention_mask.bool()
    scored = torch.zeros_like(counted)
    scored[:, :-1] = counted[:, 1:]
    return scored


def batch_targets(
    batch: dict[str, torch.Tensor],
    norm_weight: torch.Tensor,
    lm_head: torch.Tensor,
    eps: float,
    t2d: torch.Tensor | None,
    rows: torch.Tensor | None = None,
    full: bool = True,
    dense_rows: int | None = None,
) -> TargetTable:
    """The verifier's distribution at the positions a drafter will read, each computed once.

    rows [B, T] bool: those positions (None = every scored position; a block drafter reads only
    the few its sampled anchors reach). full: also the argmax and logsumexp over the full
    vocabulary (see `full_stats_needed`); they come for free when the store kept them.
    dense_rows: the most positions whose kept logits are formed now (`verifier_targets`).

    From the batch's last_hidden_state [B, T, H] (norm + LM head here; target_argmax and
    logsumexp [B, T] when the store computed them at collect time), or, for a store that kept
    the top k, from topk_ids / topk_logprobs [B, T, k] and logsumexp [B, T].
    """
    if rows is None:
        rows = scored_positions(batch["loss_mask"], batch["attention_mask"])  # [B, T]
    b, t = rows.nonzero(as_tuple=True)
    if "last_hidden_state" in batch:
        stored = "target_argmax" in batch
        targets = verifier_targets(
            batch["last_hidden_state"][b, t],
            norm_weight,
            lm_head,
            eps,
            t2d,
            full=full and not stored,
            dense_rows=dense_rows,
        )
        if stored:
            stats = {"argmax": batch["target_argmax"][b, t], "logsumexp": batch["logsumexp"][b, t]}
            targets = replace(targets, **stats)
        return TargetTable(targets, _row_index(rows))
    targets = targets_from_topk(
        batch["topk_ids"][b, t], batch["topk_logprobs"][b, t], batch["logsumexp"][b, t], t2d, lm_head.shape[0]
    )
    return TargetTable(targets, _row_index(rows))


def draft_loss(
    draft_logits: torch.Tensor,
    target: Targets,
    t2d: torch.Tensor | None,
    kind: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row loss and correctness of draft predictions.

    draft_logits [N, Vd], target: the verifier's distribution for the same next token ([N] rows).
    Returns (loss [N], correct [N] bool or None, valid [N] bool). `kind` "kl": forward KL from the
    verifier's distribution (restricted to the draft vocab); "ce": cross-entropy to the
    verifier's argmax. `correct` compares argmaxes in target ids, which is what greedy
    verification accepts. Rows whose target argmax is outside the draft vocabulary are
    invalid for "ce" (nothing to learn) but still count as wrong for accuracy. For "kl", rows
    with no finite kept logit (top-k targets none of whose ids is in the draft vocabulary) are
    invalid, with loss 0 rather than NaN. `correct` is None when the target carries no argmax
    (a KL training step that did not form the full-vocabulary statistics).
    """
    target_argmax = target.argmax  # [N] or None
    # dtype= casts inside the kernel: a separate .float() is one more pass over [N, Vd] each way
    logp_draft = F.log_softmax(draft_logits, -1, dtype=torch.float32)
    if kind == "kl":
        kept = target.kept_logits
        valid = kept.amax(-1) > float("-inf")  # [N]; logits are never +inf or NaN
        if not isinstance(target.table, HiddenKept):  # top-k targets may keep no id: no NaN there
            # decided by the table's kind, not by `valid.all()`: reading that would make the host
            # wait for the GPU at every loss chunk; the verifier's own logits are never all -inf
            kept = kept.masked_fill(~valid[:, None], 0.0)
        p_target = F.softmax(kept, -1, dtype=torch.float32)  # [N, Vd]
        loss = -(p_target * logp_draft).sum(-1) * valid  # cross-entropy to p == KL up to a constant
    elif kind == "ce":
        if target_argmax is None:
            raise ValueError("the ce loss needs the verifier's argmax: form targets with full=True")
        labels = target_to_draft(target_argmax, t2d)
        valid = labels >= 0
        loss = -logp_draft.gather(-1, labels.clamp(min=0)[:, None])[:, 0] * valid
    else:
        raise ValueError(f"unknown loss kind {kind!r}; use 'kl' or 'ce'")
    if target_argmax is None:
        return loss, None, valid
    d2t_table = None if t2d is None else d2t_from_t2d(t2d)
    # max(-1).indices = argmax(-1), first maximal index on ties alike; on a CPU it is 4x faster on
    # bf16 rows (autocast's draft logits): 5.6 ms against 23 ms for [1536, 8192] (2-core EPYC)
    predicted = draft_to_target(draft_logits.max(-1).indices, d2t_table)
    return loss, predicted == target_argmax, valid


# ---------------------------------------------------------------- the loss, a chunk of rows at a time

RowOutputs = tuple[torch.Tensor | None, ...]  # per-row results [n] each (None: not formed)


def chunked_rows(
    fn: Callable[..., RowOutputs],
    inputs: tuple[torch.Tensor, ...],
    target: Targets,
    chunk_rows: int,
) -> RowOutputs:
    """fn(*inputs, target) over N rows, `chunk_rows` rows at a time -> its per-row outputs [N] each.

    inputs: per-row tensors [N, ...] (draft hidden rows [N, H] and whatever else the drafter's
    logits read); fn forms a chunk's draft logits [n, Vd] from them and reduces them with the
    chunk's targets to per-row results [n] (or None, the same in every chunk). With gradients,
    each chunk runs under a non-reentrant checkpoint (autocast kept): its logits are freed when
    it returns and formed again, one chunk at a time, in the backward, so no [N, Vd] buffer
    exists in either pass. Rows that fit one chunk take the plain call: nothing recomputed.
    """
    total = len(target)
    if total <= chunk_rows:
        return fn(*inputs, target)
    parts = []
    for start in range(0, total, chunk_rows):
        rows = slice(start, start + chunk_rows)
        args = (*(x[rows] for x in inputs), target[rows])
        if torch.is_grad_enabled():
            parts.append(checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False))
        else:
            parts.append(fn(*args))
    return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts, strict=True))


def chunked_draft_loss(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    target: Targets,
    t2d: torch.Tensor | None,
    kind: str,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`draft_loss` of head(hidden) [N, Vd] against `target` [N], formed a chunk at a time.

    head: the drafter's readout, hidden [n, H] -> draft logits [n, Vd]. chunk_rows: rows per
    chunk (default: `loss_chunk_rows` of the draft vocabulary).
    """
    rows = chunk_rows or loss_chunk_rows(target.table.width)
    score = lambda h, t: draft_loss(head(h), t, t2d, kind)
    loss, correct, valid = chunked_rows(score, (hidden,), target, rows)
    return loss, correct, valid
