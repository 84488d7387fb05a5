"""vLLM's spec-decode counters read from a Prometheus exposition.

The bench's server backend reads them from the server's /metrics, the offline backend from its
worker's in-process registry (the worker's "metrics" request); both turn a before/after pair into
the same measurement, with the engine's `SpecCounters`.

The exposition is parsed by prometheus_client (`text_string_to_metric_families`). Metric names,
from vllm/v1/spec_decode/metrics.py (SpecDecodingProm) and vllm/v1/metrics/loggers.py:
vllm:spec_decode_num_drafts_total,
vllm:spec_decode_num_draft_tokens_total, vllm:spec_decode_num_accepted_tokens_total,
vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}, vllm:generation_tokens_total.
"""

from __future__ import annotations

from dataclasses import dataclass

from specctl.counters import SpecCounters
from specctl.errors import first_line
from specctl.vllm import VllmError


@dataclass(frozen=True)
class MetricsSnapshot:
    """vLLM's cumulative spec-decode counters (summed over engines) and generated tokens."""

    counters: SpecCounters  # accepted_per_position is as long as the server's K (it exports every position)
    generation_tokens: int = 0

    def __sub__(self, before: MetricsSnapshot) -> MetricsSnapshot:
        return MetricsSnapshot(
            self.counters - before.counters, self.generation_tokens - before.generation_tokens
        )


_COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "num_drafts",
    "vllm:spec_decode_num_draft_tokens_total": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "num_accepted_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
}
_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def is_vllm_metrics(text: str) -> bool:
    """Whether a /metrics page is vLLM's (it names `vllm:` families)."""
    return "\nvllm:" in f"\n{text}" or "# TYPE vllm:" in text


def parse_spec_decode_metrics(text: str) -> MetricsSnapshot:
    """The spec-decode counters of a Prometheus text exposition (absent counters read as 0),
    parsed by prometheus_client; a page it cannot parse is a VllmError."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(_COUNTERS.values(), 0.0)
    per_pos: dict[int, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == _PER_POSITION and "position" in sample.labels:
                    position = int(sample.labels["position"])
                    per_pos[position] = per_pos.get(position, 0.0) + sample.value
                elif sample.name in _COUNTERS:
                    totals[_COUNTERS[sample.name]] += sample.value
    except ValueError as e:
        raise VllmError(f"/metrics is not a Prometheus text exposition ({first_line(e, 120)})") from None
    width = max(per_pos) + 1 if per_pos else 0
    counters = SpecCounters(
        int(round(totals["num_drafts"])),
        int(round(totals["num_draft_tokens"])),
        int(round(totals["num_accepted_tokens"])),
        [int(round(per_pos.get(i, 0.0))) for i in range(width)],
    )
    return MetricsSnapshot(counters, int(round(totals["generation_tokens"])))
