"""Samples of similar length grouped into batches that fit a token budget (collect and train).

A batch of n right-padded samples costs n * longest tokens, so samples are sorted by length and
packed greedily. The verifier forward (collect) packs longest first, so the largest batch (and the
memory peak) comes first and an out-of-memory shows in the first seconds; training packs shortest
first. A sample longer than the budget forms a batch of its own (training crops it to the budget).
"""

from __future__ import annotations

from collections.abc import Sequence


def length_buckets(
    lengths: Sequence[int], budget: int, indices: Sequence[int] | None = None, longest_first: bool = False
) -> list[list[int]]:
    """Indices (default: all of `lengths`) in batches of <= `budget` padded tokens each.

    Sorted by length (ties by index; descending with `longest_first`), then filled greedily:
    a sample joins the current batch when (batch size + 1) * the batch's longest sample, capped
    at the budget, still fits.
    """
    order = range(len(lengths)) if indices is None else indices
    key = (lambda i: (-lengths[i], i)) if longest_first else (lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    for i in sorted(order, key=key):
        batch = batches[-1] if batches else None
        longest = 0 if batch is None else min(max(lengths[batch[0]], lengths[i]), budget)
        if batch is not None and (len(batch) + 1) * longest <= budget:
            batch.append(i)
        else:
            batches.append([i])
    return batches
