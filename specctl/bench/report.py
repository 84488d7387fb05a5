"""The figures of a benchmark run: the report model (measurements, sweeps, requirements) and report.json.

Counters mean what vLLM's spec-decode metrics mean, whichever backend produced them:
tau (acceptance_length) = 1 + accepted / drafts (the bonus token counted, so plain decoding
is 1.0), per-position acceptance = accepted_at_position / drafts, and speedup = output
tokens/s over the plain-decoding run of the same report. Each method's generated token ids
are kept per prompt, so a greedy run also shows whether speculation reproduced plain
decoding token for token (outputs_match_plain), the losslessness check speedups rest on.
Each timed (prompt, round) cell is kept (`Unit`, report.json's `units`); tok/s, speedup, the
ratio to the baseline and tau are the median over rounds with a 95% interval from them
(specctl.bench.intervals).

A sweep (`--sweep-k`, or several concurrency levels) measures every drafter at several K and
concurrency levels and recommends, per drafter and level, the K with the highest output
tokens/s; `results` then holds each method at its recommended K at the lowest level. Draft trees
(`--tree`) stay methods of their own in the tables, but the recommendation weighs them as settings
of their drafter: a tree is recommended over the drafter's best chain only when it is faster
beyond noise (`chain_or_tree`).
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specctl.bench.arrivals import rate_label
from specctl.bench.divergence import Divergence, summary_line
from specctl.bench.intervals import (
    RESAMPLES,
    Estimate,
    acceptance_length,
    paired_ratio,
    tokens_per_s,
    tokens_per_s_point,
)
from specctl.bench.plan import PLAIN, Method, chain_name, speculative_config
from specctl.counters import SpecCounters
from specctl.errors import SpecctlError, UsageError
from specctl.recipe import BenchSection
from specctl.redact import redact_tree


@dataclass(frozen=True)
class Unit:
    """One timed cell of a run: a prompt decoded in one round (the embedded engine), or where a
    backend only times prompts together (vLLM gets a category's prompts at once, its counters are
    server-wide) that group in one pass, named by its first prompt index. The cells that
    specctl.bench.intervals resamples; report.json keeps them all (`units`)."""

    prompt: int  # the prompt index (a group's first)
    round: int  # the repetition (bench.repeats) it was decoded in
    num_prompts: int
    output_tokens: int
    wall_s: float
    num_drafts: int
    num_accepted_tokens: int


UNIT_FIELDS = tuple(Unit.__dataclass_fields__)


@dataclass
class Measurement:
    """What one method did on a group of prompts: output volume, time and acceptance counters."""

    num_prompts: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    counters: SpecCounters = field(default_factory=SpecCounters)
    # prompt index -> generated ids, the stop token included when one ended the answer, as every
    # backend counts it in output_tokens (the engine's tokens, vLLM's token_ids and usage)
    outputs: dict[int, list[int]] = field(default_factory=dict)
    # prompt index -> why its request failed (vLLM server: an HTTP error, a dropped connection);
    # num_prompts, output_tokens and outputs cover the answered prompts only
    failed: dict[int, str] = field(default_factory=dict)
    # vLLM's generation-token counter over the same requests (None where nothing counts them):
    # equal to output_tokens when the server generated exactly what the answers returned
    server_generation_tokens: int | None = None
    # streamed requests (server backends): seconds to the first token per request, per output
    # token after the first per request, and between consecutive chunks (specctl.bench.client)
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    counted: bool = True  # False: nothing counted acceptance (a server without vLLM's /metrics)
    units: list[Unit] = field(default_factory=list)  # every (prompt, round) cell timed, in order

    def __add__(self, other: Measurement) -> Measurement:
        return Measurement(
            self.num_prompts + other.num_prompts,
            self.output_tokens + other.output_tokens,
            self.wall_s + other.wall_s,
            self.counters + other.counters,
            {**self.outputs, **other.outputs},
            {**self.failed, **other.failed},
            _add_counts(self.server_generation_tokens, other.server_generation_tokens),
            self.ttft_s + other.ttft_s,
            self.tpot_s + other.tpot_s,
            self.itl_s + other.itl_s,
            self.counted and other.counted,
            self.units + other.units,
        )

    @property
    def acceptance_length(self) -> float:
        return self.counters.acceptance_length

    @property
    def per_position_acceptance(self) -> list[float]:
        return self.counters.acceptance_rate_per_position

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def request_throughput(self) -> float:
        """Answered requests per second."""
        return self.num_prompts / self.wall_s if self.wall_s > 0 else 0.0


def _add_counts(a: int | None, b: int | None) -> int | None:
    """A sum where None means "not counted" (an empty Measurement() is a sum's start)."""
    return b if a is None else a if b is None else a + b


@dataclass
class MethodResult:
    method: Method
    categories: dict[str, Measurement]  # category ("" when the prompts have none) -> measurement

    @property
    def total(self) -> Measurement:
        out = Measurement()
        for m in self.categories.values():
            out = out + m
        return out

    def __add__(self, other: MethodResult) -> MethodResult:
        """The same configuration measured on more prompts (another round)."""
        categories = dict(self.categories)
        for category, m in other.categories.items():
            categories[category] = categories[category] + m if category in categories else m
        return MethodResult(self.method, categories)


@dataclass
class Point:
    """One configuration measured at one concurrency level: what a backend's measure() returns,
    one per level it covers (the embedded engine and vLLM offline have one level). A server
    backend's `bench --request-rate` level has its rate: requests arrived as a Poisson process
    (specctl.bench.arrivals), `concurrency` of them in flight at most."""

    concurrency: int
    result: MethodResult
    request_rate: float | None = None  # requests/s (inf: all at once); None: a closed loop

    @property
    def level(self) -> Level:
        return self.concurrency, self.request_rate


Level = tuple[int, float | None]  # (concurrency, request rate): what tells a sweep's levels apart


@dataclass
class BenchReport:
    verifier: str
    backend: str
    dataset: str
    num_prompts: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    concurrency: int
    repeats: int = 1  # passes per configuration; each category reports its median one (vllm-offline)
    engine_rounds: int = 1  # engines per configuration, each on its share of the prompts (vLLM)
    # the figures are the installed vLLM's (the backend's spec: vllm_measured), so a sweep
    # recommends the --speculative-config that serves each drafter
    vllm_measured: bool = False
    results: list[MethodResult] = field(default_factory=list)
    baseline: str | None = None  # name of the EAGLE-3 reference method, if any
    complete: bool = False
    requirements: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # requirements that fell short, one line each
    errors: list[str] = field(default_factory=list)  # methods that could not be measured, one line each
    # known defects of the serving vLLM that make a drafter draft otherwise (specctl.vllm.defects)
    warnings: list[str] = field(default_factory=list)
    output_dir: Path | None = None
    # every (method, K, concurrency) a sweep measured, in order; None = not a sweep
    sweep: list[Point] | None = None
    sweep_levels: list[int] = field(default_factory=list)  # the concurrency levels swept, ascending
    sweep_rates: list[float] = field(default_factory=list)  # bench --request-rate: the rates, ascending
    sweep_skipped: list[str] = field(default_factory=list)  # requested K a drafter cannot draft
    provenance: dict[str, Any] | None = None  # specctl.provenance: versions, commit, hardware, time
    # method name -> its outputs that differ from plain decoding's, explained (specctl.bench.divergence);
    # None: not analysed (sampling, no plain run, no ids, or a backend without a local verifier)
    divergences: dict[str, list[Divergence]] | None = None
    # the bench settings the run read, whole (report.json's `settings`); None: a report built by hand
    settings: BenchSection | None = None

    @property
    def first_level(self) -> Level:
        """The level a sweep's `results` are read at: the lowest concurrency (or request rate)."""
        return self.concurrency, self.sweep_rates[0] if self.sweep_rates else None

    @property
    def ok(self) -> bool:
        """Every method measured and every requirement met: the command exits 0."""
        return self.complete and not self.errors and not self.failures

    @property
    def categories(self) -> list[str]:
        """The prompts' categories, sorted ([] when they have none)."""
        return sorted({c for r in self.results for c in r.categories if c})

    @property
    def divergence_summary(self) -> str | None:
        """One line on the outputs that left plain decoding's (None: not analysed)."""
        return summary_line(self.divergences) if self.divergences is not None else None

    def figures(self, intervals: bool = True) -> ReportFigures:
        """Every derived figure -- speedups, ratios, intervals, output comparisons, a sweep's points
        and recommendations -- from the measurements as they stand. `intervals` False skips the
        bootstrap (the point figures stay)."""
        resamples = RESAMPLES if intervals else 0
        results = result_figures(self, resamples)
        points = point_figures(self, resamples) if self.sweep is not None else None
        return ReportFigures(
            categories=self.categories,
            results=results,
            plain=next((r for r in results if not r.speculative), None),
            base=next((r for r in results if r.name == self.baseline), None),
            points=points,
            recommended=recommendations(points or [], self.backend, self.vllm_measured, self.seed, resamples),
        )

    def to_dict(self, intervals: bool = True) -> dict[str, Any]:
        """report.json's content (specctl.bench.report.report_dict)."""
        return report_dict(self, intervals)


# ---------------------------------------------------------------- figures


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


LATENCIES = ("ttft", "tpot", "itl")  # vllm bench serve's names: {mean,median,p90,p99}_<name>_ms
LATENCY_STATS = (("mean", None), ("median", 50), ("p90", 90), ("p99", 99))
LATENCY_FIELDS = tuple(f"{stat}_{name}_ms" for name in LATENCIES for stat, _ in LATENCY_STATS)


def latency_dict(m: Measurement) -> dict[str, float | None]:
    """TTFT, TPOT and ITL in milliseconds as `vllm bench serve` names them (None: not streamed)."""
    import numpy as np

    out: dict[str, float | None] = {}
    for name in LATENCIES:
        samples = np.asarray(getattr(m, f"{name}_s"), dtype=float) * 1e3
        for stat, q in LATENCY_STATS:
            value = None
            if samples.size:
                value = float(samples.mean() if q is None else np.percentile(samples, q))
            out[f"{stat}_{name}_ms"] = value
    return out


INTERVAL_FIGURES = ("output_tokens_per_s", "speedup", "ratio_vs_baseline", "acceptance_length")


def unit_grids(sides: Sequence[Sequence[Unit]], fields: Sequence[str]) -> list[list[np.ndarray]] | None:
    """The (prompt, round) cells every side has, as one [P, R] array per field per side (None when
    they share none). Only rounds holding every shared prompt are kept, so a partial last round
    (an interrupted run) does not shrink the prompts of the finished ones."""
    cells = [{(u.prompt, u.round): u for u in side} for side in sides]
    common = set.intersection(*(set(c) for c in cells))
    prompts = sorted({p for p, _ in common})
    rounds = sorted(r for r in {r for _, r in common} if all((p, r) in common for p in prompts))
    if not rounds:  # no round finished every prompt: the prompts each round of them has
        rounds = sorted({r for _, r in common})
        prompts = [p for p in prompts if all((p, r) in common for r in rounds)]
    if not prompts or not rounds:
        return None
    return [
        [np.array([[getattr(c[p, r], f) for r in rounds] for p in prompts], dtype=float) for f in fields]
        for c in cells
    ]


def median_rate(m: Measurement) -> float:
    """Output tokens/s as the report states it: the median over rounds where the measurement has
    units, else the pooled rate. What a sweep's best K is chosen by, so the pick and the
    figures it is shown with agree."""
    own = unit_grids([m.units], ("output_tokens", "wall_s"))
    return m.output_tokens_per_s if own is None else tokens_per_s_point(*own[0])


def estimates(
    m: Measurement,
    plain: Measurement | None,
    base: Measurement | None,
    seed: int = 0,
    resamples: int = RESAMPLES,
) -> dict[str, Estimate | None]:
    """Each figure of INTERVAL_FIGURES as the median over rounds with its 95% interval, from the
    measurement's units (speedups paired with the reference's same cells); None where there are
    no units to resample (a measurement built by hand) or no reference."""
    out: dict[str, Estimate | None] = dict.fromkeys(INTERVAL_FIGURES)
    own = unit_grids([m.units], ("output_tokens", "wall_s", "num_accepted_tokens", "num_drafts"))
    if own is None:
        return out
    tokens, wall, accepted, drafts = own[0]
    out["output_tokens_per_s"] = tokens_per_s(tokens, wall, seed, resamples)
    out["acceptance_length"] = acceptance_length(accepted, drafts, seed, resamples) if m.counted else None
    for name, ref in (("speedup", plain), ("ratio_vs_baseline", base)):
        pair = unit_grids([m.units, ref.units], ("output_tokens", "wall_s")) if ref is not None else None
        if pair is not None:
            out[name] = paired_ratio(*pair[0], *pair[1], seed=seed, resamples=resamples)
    return out


def units_dict(units: Sequence[Unit]) -> dict[str, list[Any]]:
    """report.json's `units`: one list per Unit field (columns, so thousands of cells stay small)."""
    return {
        f: [round(getattr(u, f), 6) if f == "wall_s" else getattr(u, f) for u in units] for f in UNIT_FIELDS
    }


def units_from_dict(columns: dict[str, list[Any]]) -> list[Unit]:
    """report.json's `units` (units_dict) back as cells, so a page re-rendered from a report
    bootstraps the same paired intervals the report did."""
    return [Unit(*cell) for cell in zip(*(columns[f] for f in UNIT_FIELDS), strict=True)]


@dataclass(frozen=True)
class Figures:
    """One measurement's figures against its references (plain decoding, the baseline): what
    report.json writes per method, per category and per sweep point, and what every table and plot
    reads. Acceptance is None where nothing counted it; tok/s, speedup, the ratio to the baseline
    and tau are the median over rounds where there are units, with their 95% `intervals`."""

    acceptance_length: float | None = None
    per_position_acceptance: list[float] = field(default_factory=list)
    num_drafts: int | None = None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    # drafts the verifier had to check per draft it kept: what a dynamic draft length saves
    draft_tokens_per_accepted: float | None = None
    # verifier rows per token a drafting pass emitted (1 + drafts or tree nodes over 1 + accepted):
    # what a tree spends for its longer accepted paths
    verify_rows_per_token: float | None = None
    num_prompts: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    output_tokens_per_s: float = 0.0
    request_throughput: float = 0.0
    latency: dict[str, float | None] = field(default_factory=dict)  # LATENCY_FIELDS, ms (latency_dict)
    speedup: float | None = None
    ratio_vs_baseline: float | None = None
    acceptance_ratio_vs_baseline: float | None = None
    server_generation_tokens: int | None = None
    failed: dict[int, str] = field(default_factory=dict)  # prompt index -> why its request failed
    rounds: int = 0
    # INTERVAL_FIGURES -> (low, high) of the 95% interval; None: no units, no reference, or skipped
    intervals: dict[str, tuple[float, float] | None] = field(default_factory=dict)

    def estimate(self, name: str) -> Estimate | None:
        """Figure `name` with its interval (None: not measured, or no interval)."""
        value, interval = getattr(self, name), self.intervals.get(name)
        return None if value is None or interval is None else Estimate(value, *interval)

    def to_dict(self, baseline: bool = True) -> dict[str, Any]:
        """report.json's figures (a sweep point has no baseline: `baseline` False leaves its ratios out)."""
        out = {
            "acceptance_length": self.acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "draft_tokens_per_accepted": self.draft_tokens_per_accepted,
            "verify_rows_per_token": self.verify_rows_per_token,
            "num_prompts": self.num_prompts,
            "output_tokens": self.output_tokens,
            "wall_s": self.wall_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "request_throughput": self.request_throughput,
            **self.latency,
            "speedup": self.speedup,
            "ratio_vs_baseline": self.ratio_vs_baseline,
            "acceptance_ratio_vs_baseline": self.acceptance_ratio_vs_baseline,
            "server_generation_tokens": self.server_generation_tokens,
            "num_failed": len(self.failed),
            "failed_requests": {str(i): why for i, why in sorted(self.failed.items())},
            "rounds": self.rounds,
            "intervals": {name: list(i) if i is not None else None for name, i in self.intervals.items()},
        }
        if not baseline:
            del out["ratio_vs_baseline"], out["acceptance_ratio_vs_baseline"]
        return out


def measurement_figures(
    m: Measurement,
    plain: Measurement | None,
    base: Measurement | None,
    seed: int = 0,
    resamples: int = RESAMPLES,
) -> Figures:
    """One measurement's figures. Where it has units, tok/s, speedup, the ratio to the baseline and
    tau are the median over rounds (with one round: the ratio of sums) with their 95% intervals
    (none with `resamples` 0: a report rewritten mid-run skips the bootstrap); without units, the
    figures of the sums (every round pooled)."""
    found = estimates(m, plain, base, seed, resamples)
    median = {name: e.value for name, e in found.items() if e is not None}
    tps, c, counted = m.output_tokens_per_s, m.counters, m.counted
    tau = m.acceptance_length if counted else None
    base_tau = (base.acceptance_length if base.counted else None) if base else None
    return Figures(
        acceptance_length=median.get("acceptance_length", tau),
        per_position_acceptance=m.per_position_acceptance if counted else [],
        num_drafts=c.num_drafts if counted else None,
        num_draft_tokens=c.num_draft_tokens if counted else None,
        num_accepted_tokens=c.num_accepted_tokens if counted else None,
        draft_tokens_per_accepted=_ratio(c.num_draft_tokens, c.num_accepted_tokens) if counted else None,
        verify_rows_per_token=_rows_per_token(c) if counted else None,
        num_prompts=m.num_prompts,
        output_tokens=m.output_tokens,
        wall_s=m.wall_s,
        output_tokens_per_s=median.get("output_tokens_per_s", tps),
        request_throughput=m.request_throughput,
        latency=latency_dict(m),
        speedup=median.get("speedup", _ratio(tps, plain.output_tokens_per_s if plain else None)),
        ratio_vs_baseline=median.get(
            "ratio_vs_baseline", _ratio(tps, base.output_tokens_per_s if base else None)
        ),
        acceptance_ratio_vs_baseline=_ratio(tau, base_tau) if tau is not None else None,
        server_generation_tokens=m.server_generation_tokens,
        failed=dict(m.failed),
        rounds=len({u.round for u in m.units}),
        intervals={
            name: (e.low, e.high) if e is not None and math.isfinite(e.low) else None
            for name, e in found.items()
        },
    )


def _rows_per_token(c: SpecCounters) -> float | None:
    """Verify rows per token of the drafting passes: (1 + drafts) rows each emit 1 + accepted."""
    return _ratio(c.num_drafts + c.num_draft_tokens, c.num_drafts + c.num_accepted_tokens)


def outputs_match(outputs: dict[int, list[int]], plain: dict[int, list[int]]) -> tuple[int, int]:
    """(prompts whose ids equal plain decoding's exactly, prompts both have ids for).

    Only prompts present on both sides count, so an answer without ids (a server that did not
    return them) leaves the comparison instead of counting as a mismatch.
    """
    shared = outputs.keys() & plain.keys()
    return sum(outputs[i] == plain[i] for i in shared), len(shared)


@dataclass(frozen=True)
class MethodFigures:
    """A configuration as a table row shows it: the method (K, threshold, adaptive), its figures,
    and how its greedy outputs compare with plain decoding's (outputs_match_plain: the fraction
    decoded exactly alike, of outputs_compared; None where not comparable: sampling, no plain
    run, no ids)."""

    method: Method
    figures: Figures
    outputs_match_plain: float | None
    outputs_compared: int
    units: list[Unit]

    @property
    def name(self) -> str:
        return self.method.name

    @property
    def speculative(self) -> bool:
        return self.method.algo != PLAIN

    @property
    def matched(self) -> int | None:
        """Prompts decoded exactly as plain decoding (None: not comparable)."""
        frac = self.outputs_match_plain
        return None if frac is None or not self.outputs_compared else round(frac * self.outputs_compared)


def _compared(method: Method, total: Measurement, plain_outputs: dict[int, list[int]]) -> dict[str, Any]:
    same, compared = outputs_match(total.outputs, plain_outputs)
    return dict(
        method=method,
        outputs_match_plain=same / compared if compared else None,
        outputs_compared=compared,
        units=list(total.units),
    )


@dataclass(frozen=True)
class ResultFigures(MethodFigures):
    """A method of the summary table (report.json's `results`): with its divergences from plain
    decoding (None: not analysed) and, when the prompts have categories, a figure per category."""

    divergences: list[Divergence] | None
    categories: dict[str, Figures] | None

    @property
    def unexplained_divergences(self) -> int | None:
        return None if self.divergences is None else sum(not d.near_tie for d in self.divergences)

    def to_dict(self) -> dict[str, Any]:
        out = {
            **_method_dict(self.method),
            **self.figures.to_dict(),
            "outputs_match_plain": self.outputs_match_plain,
            "outputs_compared": self.outputs_compared,
            "units": units_dict(self.units),
            "divergences": None if self.divergences is None else [d.to_dict() for d in self.divergences],
            "unexplained_divergences": self.unexplained_divergences,
        }
        if self.categories is not None:
            out["categories"] = {c: f.to_dict() for c, f in self.categories.items()}
        return out


@dataclass(frozen=True)
class PointFigures(MethodFigures):
    """A sweep point: a configuration at one level (concurrency, or request rate), its speedup and
    output comparison against no-spec at the same level (batching changes both)."""

    concurrency: int
    request_rate: float | None

    @property
    def level_key(self) -> str:
        """Its level as the recommendations key it: `"4"`, or under --request-rate `"4 req/s"`."""
        if self.request_rate is None:
            return str(self.concurrency)
        return f"{rate_label(self.request_rate)} req/s"

    @property
    def level_order(self) -> tuple[int, float]:
        """Its place among a sweep's levels: by concurrency, then request rate (inf last)."""
        return self.concurrency, -1.0 if self.request_rate is None else self.request_rate

    def to_dict(self) -> dict[str, Any]:
        rate = {"request_rate": rate_json(self.request_rate)} if self.request_rate is not None else {}
        return {
            **_method_dict(self.method),
            "concurrency": self.concurrency,
            **rate,
            **self.figures.to_dict(baseline=False),
            "outputs_match_plain": self.outputs_match_plain,
            "outputs_compared": self.outputs_compared,
            "units": units_dict(self.units),
        }


@dataclass(frozen=True)
class Recommendation:
    """The recommended configuration of a drafter at a level: the fastest point, the engine it was
    `measured_on`, and the vLLM `--speculative-config` that serves it -- only when vLLM measured it
    (another engine's step costs differ, so its best K need not be vLLM's).

    Where draft trees were measured beside the drafter's chain (bench --tree), `chain` is its
    fastest chain, `tree` its fastest tree and `versus` the tree's tok/s over the chain's, paired
    on their shared (prompt, round) cells (`tree_vs_chain`); `point` is one of the two
    (`chain_or_tree`). No released vLLM verifies a tree, so the chain is what vLLM serves today."""

    point: PointFigures
    speculative_config: dict[str, Any] | None
    measured_on: str
    chain: PointFigures | None = None
    tree: PointFigures | None = None
    versus: Estimate | None = None

    @property
    def is_tree(self) -> bool:
        return self.point.method.tree_nodes is not None

    def to_dict(self) -> dict[str, Any]:
        m, f = self.point.method, self.point.figures
        return {
            "method": m.name,
            "num_speculative_tokens": m.num_speculative_tokens,
            "confidence_threshold": m.confidence_threshold,
            "adaptive": m.adaptive,
            "tree_nodes": m.tree_nodes,
            "acceptance_length": f.acceptance_length,
            "draft_tokens_per_accepted": f.draft_tokens_per_accepted,
            "output_tokens_per_s": f.output_tokens_per_s,
            "speedup": f.speedup,
            "intervals": f.to_dict()["intervals"],
            "speculative_config": self.speculative_config,
            "measured_on": self.measured_on,
            "tree_vs_chain": self._versus_dict(),
        }

    def _versus_dict(self) -> dict[str, Any] | None:
        """report.json's chain-against-tree comparison (None: no tree measured beside a chain)."""
        if self.chain is None or self.tree is None or self.versus is None:
            return None
        c, t, v = self.chain.method, self.tree.method, self.versus
        return {
            "tree_nodes": t.tree_nodes,
            "tree_num_speculative_tokens": t.num_speculative_tokens,
            "chain_num_speculative_tokens": c.num_speculative_tokens,
            "chain_confidence_threshold": c.confidence_threshold,
            "chain_adaptive": c.adaptive,
            "ratio": v.value,
            "interval": [v.low, v.high] if _finite(v) else None,
        }


@dataclass(frozen=True)
class ReportFigures:
    """Every derived figure of a report, computed once (BenchReport.figures): what report.json,
    the tables and the plots show."""

    categories: list[str]  # the prompts' categories, sorted ([] when they have none)
    results: list[ResultFigures]
    plain: ResultFigures | None  # the no-spec entry: the denominator of every speedup
    base: ResultFigures | None  # the baseline's entry: the reference of "vs EAGLE-3"
    points: list[PointFigures] | None  # a sweep's points, in the order measured; None: not a sweep
    recommended: dict[str, dict[str, Recommendation]]  # method name -> level key -> recommendation

    def recommendation_for(self, p: PointFigures) -> Recommendation | None:
        """The recommendation of the drafter a point measured (a tree's is its chain's)."""
        return self.recommended.get(chain_name(p.method), {}).get(p.level_key)

    def is_recommended(self, p: PointFigures) -> bool:
        """Whether the point is the configuration recommended at its level."""
        r = self.recommendation_for(p)
        return r is not None and r.point.method == p.method


def result_figures(report: BenchReport, resamples: int = RESAMPLES) -> list[ResultFigures]:
    """The summary table's entries: speedups against the no-spec entry, ratios against the baseline."""
    plain = next((r for r in report.results if r.method.algo == PLAIN), None)
    base = next((r for r in report.results if r.method.name == report.baseline), None)
    categories = report.categories
    plain_outputs = plain.total.outputs if plain is not None and report.temperature == 0 else {}
    entries = []
    for r in report.results:
        total = r.total
        per_category = None
        if categories:
            per_category = {
                c: measurement_figures(
                    m,
                    plain.categories.get(c) if plain else None,
                    base.categories.get(c) if base else None,
                    report.seed,
                    resamples,
                )
                for c, m in sorted(r.categories.items())
            }
        figures = measurement_figures(
            total, plain.total if plain else None, base.total if base else None, report.seed, resamples
        )
        divergences = None if report.divergences is None else report.divergences.get(r.method.name)
        entries.append(
            ResultFigures(
                figures=figures,
                **_compared(r.method, total, plain_outputs),
                divergences=divergences,
                categories=per_category,
            )
        )
    return entries


def point_figures(report: BenchReport, resamples: int = RESAMPLES) -> list[PointFigures]:
    """Every sweep point, with its speedup and output comparison against no-spec at its level."""
    plain = {p.level: p.result.total for p in report.sweep or [] if p.result.method.algo == PLAIN}
    points = []
    for p in report.sweep or []:
        total, ref = p.result.total, plain.get(p.level)
        ref_outputs = ref.outputs if ref is not None and report.temperature == 0 else {}
        points.append(
            PointFigures(
                figures=measurement_figures(total, ref, None, report.seed, resamples),
                **_compared(p.result.method, total, ref_outputs),
                concurrency=p.concurrency,
                request_rate=p.request_rate,
            )
        )
    return points


def divergence_dict(divergences: dict[str, list[Divergence]] | None, name: str) -> dict[str, Any]:
    """A method's divergences from plain decoding and how many are not near-ties (None: not
    analysed; `--require lossless` fails then, as it cannot tell)."""
    found = None if divergences is None else divergences.get(name)
    if found is None:
        return {"divergences": None, "unexplained_divergences": None}
    return {
        "divergences": [d.to_dict() for d in found],
        "unexplained_divergences": sum(not d.near_tie for d in found),
    }


def _method_dict(method: Method) -> dict[str, Any]:
    return {
        "name": method.name,
        "algo": method.algo,
        "num_speculative_tokens": method.num_speculative_tokens,
        "confidence_threshold": method.confidence_threshold,
        "adaptive": method.adaptive,
        "tree_nodes": method.tree_nodes,
        "drafter": str(method.drafter) if method.drafter else None,
    }


def report_dict(
    report: BenchReport, intervals: bool = True, figures: ReportFigures | None = None
) -> dict[str, Any]:
    """report.json, written from the report's figures (`figures`, when the caller has them):
    settings, then one entry per method (speedups vs the no-spec entry), the sweep's points and
    recommendations.

    `intervals` False skips the bootstrap (the point figures stay): the rewrite after every
    measurement of a run, where 64 intervals of a 12-prompt, 3-round, 4-method report would
    add ~0.2 s to each of its 144 decodes.
    """
    f = figures or report.figures(intervals)
    out = {
        "verifier": report.verifier,
        "backend": report.backend,
        "dataset": report.dataset,
        "num_prompts": report.num_prompts,
        "temperature": report.temperature,
        "top_p": report.top_p,
        "max_new_tokens": report.max_new_tokens,
        "seed": report.seed,
        "concurrency": report.concurrency,
        "repeats": report.repeats,
        "engine_rounds": report.engine_rounds,
        "complete": report.complete,
        "baseline": report.baseline,
        "categories": f.categories,
        "results": [r.to_dict() for r in f.results],
        "requirements": list(report.requirements),
        "failures": list(report.failures),
        "errors": list(report.errors),
        "warnings": list(report.warnings),
        "provenance": report.provenance,
        "divergence_summary": report.divergence_summary,
    }
    if report.settings is not None:  # credentials in bench.base_url masked, as everywhere
        out["settings"] = redact_tree(report.settings.model_dump(mode="json"))
    if f.points is not None:
        rates = {"request_rate": [rate_json(r) for r in report.sweep_rates]} if report.sweep_rates else {}
        out["sweep"] = {
            "concurrency": list(report.sweep_levels),
            **rates,
            "points": [p.to_dict() for p in f.points],
            "recommended": {
                name: {level: r.to_dict() for level, r in levels.items()}
                for name, levels in f.recommended.items()
            },
            "skipped": list(report.sweep_skipped),
        }
    return out


# ---------------------------------------------------------------- the K sweep


# (K, confidence threshold or None, adaptive verification): one configuration of a drafter
Setting = tuple[int, float | None, bool]


def recommend(points: Iterable[tuple[Setting, float]]) -> Setting:
    """The (K, threshold, adaptive) of the (setting, output tokens/s) point with the highest tokens/s.

    A tie goes to the smaller K (the same speed for less drafting work and fewer speculative
    KV-cache slots per request, which leaves more room for other requests), then to no threshold
    (nothing to tune), then to the lower one, then to fixed K over adaptive (nothing to turn on).
    """
    measured = list(points)
    if not measured:
        raise ValueError("no measured setting to recommend from")
    setting, _ = min(measured, key=lambda p: (-p[1], p[0][0], p[0][1] is not None, p[0][1] or 0.0, p[0][2]))
    return setting


def setting_of(method: Method) -> Setting:
    """A configuration's (K, threshold, adaptive)."""
    return method.num_speculative_tokens, method.confidence_threshold, method.adaptive


def point_setting(point: dict[str, Any]) -> Setting:
    """The (K, threshold, adaptive) of a point or result as report.json writes it (older reports
    have no T and no adaptive)."""
    return point["num_speculative_tokens"], point.get("confidence_threshold"), bool(point.get("adaptive"))


def best_results(points: Sequence[Point], level: int | Level) -> list[MethodResult]:
    """Each method, in the order first measured, at its recommended K (and threshold) at `level`
    (a concurrency, or (concurrency, request rate)): the `results` of a sweep, so the summary
    table, speedups and --require read it."""
    want = (level, None) if isinstance(level, int) else level
    by_name: dict[str, list[MethodResult]] = {}
    for p in points:
        if p.level == want:
            by_name.setdefault(p.result.method.name, []).append(p.result)
    best = []
    for results in by_name.values():
        chosen = recommend((setting_of(r.method), median_rate(r.total)) for r in results)
        best.append(next(r for r in results if setting_of(r.method) == chosen))
    return best


def rate_json(rate: float) -> float | str:
    """A request rate in report.json: requests/s, or "inf" (JSON has no infinity), as vllm bench
    serve writes it."""
    return rate_label(rate) if math.isinf(rate) else rate


def level_text(level: Level) -> str:
    """A level in a sentence: `concurrency 4`, or `request rate 4 req/s` (at most N in flight)."""
    concurrency, rate = level
    if rate is None:
        return f"concurrency {concurrency}"
    return f"request rate {rate_label(rate)} req/s"


def recommendations(
    points: Sequence[PointFigures],
    backend: str,
    vllm_measured: bool,
    seed: int = 0,
    resamples: int = RESAMPLES,
) -> dict[str, dict[str, Recommendation]]:
    """method name -> level key -> the recommended configuration at that level. A drafter's chain
    configurations (K, confidence threshold, adaptive) are ranked by their reported output
    tokens/s (`recommend`); its draft trees (`<name>-treeN`, grouped under the chain's name) are
    a setting of the same drafter and win only by beating its best chain beyond noise
    (`chain_or_tree`). Plain decoding has none."""
    grouped: dict[tuple[str, str], list[PointFigures]] = {}
    for p in points:
        if p.speculative:
            grouped.setdefault((chain_name(p.method), p.level_key), []).append(p)
    out: dict[str, dict[str, Recommendation]] = {}
    for (name, level), group in grouped.items():
        chain = _fastest_chain([p for p in group if p.method.tree_nodes is None])
        tree = _fastest_tree([p for p in group if p.method.tree_nodes is not None])
        versus = tree_vs_chain(tree, chain, seed, resamples) if tree and chain else None
        best = chain_or_tree(chain, tree, versus)
        try:
            spec = speculative_config(best.method) if vllm_measured and best is chain else None
        except SpecctlError:  # an algorithm vLLM has no method for (measured on the embedded engine)
            spec = None
        compared = (chain, tree) if tree is not None else (None, None)
        out.setdefault(name, {})[level] = Recommendation(best, spec, backend, *compared, versus)
    return out


def _fastest_chain(points: list[PointFigures]) -> PointFigures | None:
    """The chain configuration `recommend` picks (None: no chain measured)."""
    if not points:
        return None
    chosen = recommend((setting_of(p.method), p.figures.output_tokens_per_s) for p in points)
    return next(p for p in points if setting_of(p.method) == chosen)


def _fastest_tree(points: list[PointFigures]) -> PointFigures | None:
    """The fastest tree by reported output tokens/s; a tie goes to fewer nodes (fewer verify rows),
    then to the shallower tree, as `recommend` gives a tie to the smaller K."""
    return min(
        points,
        key=lambda p: (-p.figures.output_tokens_per_s, p.method.tree_nodes, p.method.num_speculative_tokens),
        default=None,
    )


def tree_vs_chain(
    tree: PointFigures, chain: PointFigures, seed: int = 0, resamples: int = RESAMPLES
) -> Estimate:
    """The tree's output tokens/s over the chain's: the median over rounds of the per-round ratio
    on the (prompt, round) cells both decoded, with its 95% interval from the same paired redraws
    as a speedup (specctl.bench.intervals), so a slow spell that hit both cancels. Without shared
    cells (points built by hand) or with `resamples` 0, the ratio of their reported tok/s with no
    interval (NaN)."""
    pair = unit_grids([tree.units, chain.units], ("output_tokens", "wall_s"))
    if pair is None:
        ratio = _ratio(tree.figures.output_tokens_per_s, chain.figures.output_tokens_per_s)
        return Estimate(math.nan if ratio is None else ratio, math.nan, math.nan)
    return paired_ratio(*pair[0], *pair[1], seed=seed, resamples=resamples)


def chain_or_tree(
    chain: PointFigures | None, tree: PointFigures | None, versus: Estimate | None
) -> PointFigures:
    """The recommended one of a drafter's fastest chain and fastest tree. The tree costs more per
    step (a row per node) and no released vLLM serves it, so, as `recommend` gives a tie to the
    simpler setting, the tree is recommended only when it beats the chain beyond noise: the 95%
    interval of `versus` (tree tok/s over chain tok/s, paired) lies wholly above 1 -- the rule by
    which the report calls one method faster than another (intervals.compare). Without an
    interval, only a point ratio above 1 does. With one of the two missing, the other."""
    if tree is None or chain is None:
        found = tree or chain
        if found is None:
            raise ValueError("no measured chain or tree to recommend from")
        return found
    if versus is None:
        return chain
    if _finite(versus):
        return tree if versus.low > 1.0 else chain
    return tree if versus.value > 1.0 else chain


def _finite(e: Estimate) -> bool:
    return math.isfinite(e.low) and math.isfinite(e.high)


# ---------------------------------------------------------------- thresholds (CI)

_OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, ">": operator.gt, "<": operator.lt}
_REQUIREMENT = re.compile(r"^\s*(?P<path>[A-Za-z0-9_.\-]+?)\s*(?P<op>>=|<=|==|>|<)\s*(?P<value>\S+)\s*$")
REQUIREMENT_FIELDS = (
    "acceptance_length",
    "output_tokens_per_s",
    "speedup",
    "ratio_vs_baseline",
    "acceptance_ratio_vs_baseline",
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "output_tokens",
    "wall_s",
    "request_throughput",
    "unexplained_divergences",
    *LATENCY_FIELDS,
)
# `--require lossless`: every speculative method's outputs equal plain decoding's but at near-ties
LOSSLESS = "lossless"
EVERY_METHOD = "*"


class RequirementError(UsageError):
    """A --require / bench.require expression that cannot be parsed: a usage error."""

    exit_code = 2


@dataclass(frozen=True)
class Requirement:
    text: str
    method: str
    category: str | None
    field: str
    op: str
    value: float


def parse_requirement(text: str) -> Requirement:
    """`METHOD[.CATEGORY].FIELD OP NUMBER`, e.g. `dflash.acceptance_length>=2.5`, or `lossless`
    (every method's unexplained_divergences == 0)."""
    if text.strip() == LOSSLESS:
        return Requirement(LOSSLESS, EVERY_METHOD, None, "unexplained_divergences", "==", 0.0)
    m = _REQUIREMENT.match(text)
    example = "e.g. dflash.acceptance_length>=2.5, dflash.code.speedup>1.2 or lossless"
    if not m:
        raise RequirementError(f"--require {text!r}: expected METHOD[.CATEGORY].FIELD OP NUMBER, {example}")
    parts = m["path"].split(".")
    if len(parts) < 2 or not all(parts):
        raise RequirementError(f"--require {text!r}: name a method and a figure, {example}")
    name = parts[-1]
    if name not in REQUIREMENT_FIELDS:
        raise RequirementError(
            f"--require {text!r}: unknown figure {name!r}; use one of {', '.join(REQUIREMENT_FIELDS)}"
        )
    try:
        value = float(m["value"])
    except ValueError:
        raise RequirementError(f"--require {text!r}: {m['value']!r} is not a number") from None
    if math.isnan(value):
        raise RequirementError(f"--require {text!r}: the threshold is NaN")
    category = ".".join(parts[1:-1]) or None
    return Requirement(text.strip(), parts[0], category, name, m["op"], value)


def check_requirements(report: dict[str, Any], requirements: Sequence[Requirement]) -> list[str]:
    """One line per requirement the report's figures do not meet (empty = all met)."""
    by_name = {r["name"]: r for r in report["results"]}
    failures = []
    for req in requirements:
        if req.method == EVERY_METHOD:
            failures += _lossless_failures(report)
            continue
        entry = by_name.get(req.method)
        if entry is None:
            failures.append(
                f"{req.text}: no method {req.method!r} in this run ({', '.join(by_name) or 'none'})"
            )
            continue
        if req.category is not None:
            entry = entry.get("categories", {}).get(req.category)
            if entry is None:
                cats = ", ".join(report.get("categories", [])) or "the prompts have none"
                failures.append(f"{req.text}: no category {req.category!r} ({cats})")
                continue
        got = entry.get(req.field)
        if got is None:
            why = _unmeasured(req.field)
            failures.append(f"{req.text}: {req.method}.{req.field} was not measured ({why})")
        elif not _OPS[req.op](got, req.value):
            failures.append(f"{req.text}: got {fmt(got)}")
    return failures


def _lossless_failures(report: dict[str, Any]) -> list[str]:
    """`lossless`: one line per speculative method with a divergence that is not a near-tie, or
    whose outputs were not analysed."""
    failures = []
    for entry in report["results"]:
        if entry["algo"] == PLAIN:
            continue
        wide = [d for d in entry.get("divergences") or [] if not d["near_tie"]]
        if entry.get("unexplained_divergences") is None:
            failures.append(
                f"{LOSSLESS}: {entry['name']}'s outputs were not compared with plain decoding's (greedy "
                "runs with a no-spec method and token ids only)"
            )
        elif wide:
            d = wide[0]
            failures.append(
                f"{LOSSLESS}: {entry['name']} left plain decoding at prompt {d['prompt_index']} token "
                f"{d['token_index']}, margin {fmt(d['pair_margin'], 3)} >= near-tie {d['limit']:.3g} "
                f"({len(wide)} such prompt(s); divergences in report.json)"
            )
    return failures


def _unmeasured(name: str) -> str:
    if name == "speedup":
        return "no no-spec run"
    if "baseline" in name:
        return "no baseline run"
    if name in LATENCY_FIELDS:
        return "latency is measured on server backends, from streamed requests"
    if name == "unexplained_divergences":
        return "greedy runs with a no-spec method and token ids only"
    return "the server exports no vLLM spec-decode counters"


def fmt(x: float | None, digits: int = 2, suffix: str = "") -> str:
    return "-" if x is None else f"{x:,.{digits}f}{suffix}"


def outputs_lines(report: BenchReport) -> list[str]:
    """outputs.jsonl: one line per (method, prompt index), ids apart from report.json so it stays
    small; enough to find the first token where a method left plain decoding. A sweep writes
    every point's, each line also naming its K and concurrency."""
    lines = []
    if report.sweep is not None:
        for p in report.sweep:
            head = {
                "method": p.result.method.name,
                "num_speculative_tokens": p.result.method.num_speculative_tokens,
                "concurrency": p.concurrency,
                **({"request_rate": rate_json(p.request_rate)} if p.request_rate is not None else {}),
            }
            for index, ids in sorted(p.result.total.outputs.items()):
                lines.append(json.dumps({**head, "prompt_index": index, "token_ids": ids}))
        return lines
    for r in report.results:
        for index, ids in sorted(r.total.outputs.items()):
            lines.append(json.dumps({"method": r.method.name, "prompt_index": index, "token_ids": ids}))
    return lines
