"""Speculative-decoding acceptance counters: one type for the embedded engine, vLLM's metrics and bench.

They mean what vLLM's spec-decode metrics mean (vllm/v1/spec_decode/metrics.py): a draft is one
proposal that was verified, draft tokens the tokens it proposed, accepted tokens the drafts the
verifier kept, and accepted_per_position[i] how many drafts had position i accepted. tau
(acceptance_length) = 1 + accepted / drafts counts the bonus token, so plain decoding is 1.0.
Counters of different K add up with the shorter per-position list zero-padded -- in one place.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


def _padded(values: list[int], width: int) -> list[int]:
    return values + [0] * (width - len(values))


def _aligned(a: list[int], b: list[int]) -> tuple[list[int], list[int]]:
    width = max(len(a), len(b))
    return _padded(list(a), width), _padded(list(b), width)


@dataclass
class SpecCounters:
    """Speculative-decoding counters, summed over requests (vLLM's spec_decode_* meaning)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [K]

    @property
    def acceptance_length(self) -> float:
        """tau: tokens emitted per verifier pass that verified a draft, bonus token included
        (1 + accepted / drafts; plain decoding is 1.0)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """accepted_at_position / drafts, the per-position rate vLLM reports."""
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_position]

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verified draft of `num_draft_tokens` tokens whose first `num_accepted` were kept."""
        self.accepted_per_position = _padded(self.accepted_per_position, num_draft_tokens)
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def padded(self, width: int) -> SpecCounters:
        """The same counters with at least `width` per-position entries (a method's K)."""
        return SpecCounters(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            _padded(list(self.accepted_per_position), width),
        )

    def __add__(self, other: SpecCounters) -> SpecCounters:
        a, b = _aligned(self.accepted_per_position, other.accepted_per_position)
        return SpecCounters(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            [x + y for x, y in zip(a, b, strict=True)],
        )

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        """The counts between two snapshots of cumulative counters (vLLM's /metrics)."""
        a, b = _aligned(self.accepted_per_position, before.accepted_per_position)
        return SpecCounters(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            [x - y for x, y in zip(a, b, strict=True)],
        )

    @classmethod
    def merge(cls, counters: Iterable[SpecCounters]) -> SpecCounters:
        """Sum of several requests' counters."""
        out = cls()
        for c in counters:
            out = out + c
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_length": self.acceptance_length,
        }
