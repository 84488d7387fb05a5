"""What the two vLLM backends of `specctl bench` share: engine options, the verifier's tokenizer, and
vLLM's spec-decode counters read from a Prometheus exposition.

The server backend (specctl.bench.server) reads the counters from the server's /metrics, the offline
backend (specctl.bench.offline) from its worker's in-process registry; both turn a before/after
pair into the same `Measurement`, with the engine's `SpecCounters`.

The exposition is parsed by prometheus_client (`text_string_to_metric_families`). Metric names,
from vllm/v1/spec_decode/metrics.py (SpecDecodingProm) and vllm/v1/metrics/loggers.py:
vllm:spec_decode_num_drafts_total,
vllm:spec_decode_num_draft_tokens_total, vllm:spec_decode_num_accepted_tokens_total,
vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}, vllm:generation_tokens_total.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specctl.bench.plan import PLAIN, Method, display_name, speculative_config
from specctl.bench.report import Measurement
from specctl.counters import SpecCounters
from specctl.errors import SpecctlError, first_line
from specctl.recipe import Sampling, VerifierSection


class VllmError(SpecctlError):
    """vLLM failed to start, answer or report its counters; the message ends with its log tail."""


@dataclass(frozen=True)
class VllmSetup:
    """Everything a vLLM run needs besides the method and the prompts."""

    verifier: str  # a local HF directory or a hub id
    sampling: Sampling  # the run's bench settings'
    concurrency: int
    stop_token_ids: tuple[int, ...]
    log_dir: Path
    ready_timeout_s: float  # how long vLLM may take to start (bench.ready_timeout_s)
    repeats: int  # passes per configuration in its engine, each one a round (bench.repeats)
    max_model_len: int | None = None
    extra_args: tuple[str, ...] = ()
    request_timeout_s: float = 3600.0
    python: str = sys.executable

    def log_path(self, label: str, mode: str) -> Path:
        return self.log_dir / f"vllm-{mode}-{label}.log"


@dataclass(frozen=True)
class VllmVerifier:
    """What vLLM loads and what the prompts need, read without loading the weights here."""

    source: str  # a local directory or a hub id
    tokenizer: Any
    stop_token_ids: tuple[int, ...]
    max_positions: int | None  # the verifier's max_position_embeddings


def load_vllm_verifier(section: VerifierSection) -> VllmVerifier:
    """The verifier's tokenizer, stop ids and context limit; vLLM itself loads the weights."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from specctl.data.generate import stop_token_ids
    from specctl.verifier import locate_verifier, read_tokenizer_and_config

    source, _ = locate_verifier(section.name_or_path, section.revision)
    tokenizer, config = read_tokenizer_and_config(section, source)
    try:
        generation_config = GenerationConfig.from_pretrained(source, revision=section.revision)
    except OSError:
        generation_config = None
    stop_ids = stop_token_ids(tokenizer, SimpleNamespace(generation_config=generation_config))
    return VllmVerifier(source, tokenizer, tuple(stop_ids), getattr(config, "max_position_embeddings", None))


def engine_args(method: Method, setup: VllmSetup, cpu: bool) -> list[str]:
    """The engine options shared by server and offline mode (user's extra args last, so they win)."""
    args = ["--model", setup.verifier, "--seed", str(setup.sampling.seed), "--generation-config", "vllm"]
    if setup.max_model_len:
        args += ["--max-model-len", str(setup.max_model_len)]
    if cpu:
        args.append("--enforce-eager")
    spec = speculative_config(method)
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec)]
    return [*args, *setup.extra_args]


# ---------------------------------------------------------------- /metrics


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


def to_measurement(
    delta: MetricsSnapshot,
    num_prompts: int,
    output_tokens: int,
    wall_s: float,
    num_speculative_tokens: int,
    outputs: dict[int, list[int]] | None = None,
    failed: dict[int, str] | None = None,
) -> Measurement:
    """`num_prompts` answered prompts (the failed ones apart, in `failed`) and the counter delta
    over them; the delta's generation tokens are kept, so a report shows whether the server
    counted what the answers returned."""
    return Measurement(
        num_prompts,
        output_tokens,
        wall_s,
        delta.counters.padded(num_speculative_tokens),
        dict(outputs or {}),
        dict(failed or {}),
        delta.generation_tokens,
    )


def run_label(method: Method, sweeping: bool, started: int = 0) -> str:
    """What names a configuration's log: a sweep starts one engine per K (and per fixed K or
    adaptive verification), the K keeps each log;
    a configuration whose engine `started` before (bench --engine-rounds) gets -round<N>, so
    no round's log is written over another's."""
    label = (
        f"{method.name}-k{method.num_speculative_tokens}"
        if sweeping and method.algo != PLAIN
        else method.name
    )
    label += "-adaptive" if method.adaptive else ""  # beside its fixed-K twin (bench --adaptive both)
    return f"{label}-round{started + 1}" if started else label


def announce(say: Callable[..., None], method: Method, sweeping: bool, mode: str, log: Path) -> None:
    say(
        f"{display_name(method, sweeping)}: starting vLLM ({mode}; log {log})",
        highlight=False,
        soft_wrap=True,
    )
