"""The draft vocabulary tables, one helper each: d2t (what vLLM reads) and t2d (what training masks with).

`d2t[int64, V_draft]` is an OFFSET table: target_id = draft_id + d2t[draft_id], the kept target ids
strictly increasing. `t2d[bool, V]` marks the kept target ids. Either one determines the other; vLLM
ignores t2d, so a file may omit it and it is rebuilt from d2t here.
"""

from __future__ import annotations

import torch


def kept_ids(d2t: torch.Tensor) -> torch.Tensor:
    """[V_draft] int64 target id of each draft id (on the CPU, whatever device d2t is on)."""
    d2t = d2t.detach().long().cpu().flatten()
    return torch.arange(d2t.numel()) + d2t


def t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] bool marking the target ids the offset table keeps."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept_ids(d2t)] = True
    return t2d


def kept_ids_from_t2d(t2d: torch.Tensor) -> torch.Tensor:
    """[V_draft] int64 kept target ids, ascending (on t2d's device)."""
    return t2d.nonzero()[:, 0]


def d2t_from_t2d(t2d: torch.Tensor) -> torch.Tensor:
    """[V_draft] int64 offset table of the kept target ids (on t2d's device)."""
    kept = kept_ids_from_t2d(t2d)
    return kept - torch.arange(kept.numel(), device=kept.device)


def d2t_problem(d2t: torch.Tensor, vocab_size: int) -> str | None:
    """Why `d2t` is not a valid offset table for a `vocab_size` vocabulary (None when it is)."""
    if d2t.dtype != torch.int64 or d2t.dim() != 1:
        return f"must be int64 [draft_vocab_size], got {d2t.dtype} {list(d2t.shape)}"
    kept = kept_ids(d2t)
    if d2t.numel() == 0 or kept.min() < 0 or kept.max() >= vocab_size or (kept.diff() <= 0).any():
        return (
            f"does not map draft ids to strictly increasing target ids below {vocab_size} "
            "(it is an offset table: target = draft + d2t[draft])"
        )
    return None


def check_d2t(d2t: torch.Tensor | None, vocab_size: int, fold_identity: bool = True) -> torch.Tensor | None:
    """A validated offset table (int64, CPU), or None for the full vocabulary.

    vLLM only creates `draft_id_to_target_id` when draft_vocab_size != vocab_size, so a full-size
    (identity) table is folded into None unless `fold_identity` is off.
    """
    if d2t is None:
        return None
    d2t = d2t.detach().long().cpu().flatten()
    problem = d2t_problem(d2t, vocab_size)
    if problem is not None:
        raise ValueError(f"d2t {problem}")
    return None if fold_identity and d2t.numel() == vocab_size else d2t
