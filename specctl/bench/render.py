"""How a benchmark report is shown: the rich tables the CLI prints, report.md, acceptance.png,
sweep.png and latency.png; `write_report` writes them beside report.json and outputs.jsonl
(rewritten whole after every measurement, so an interrupted run leaves a readable report).

Everything here reads the report model: `BenchReport` and the figures it derives once
(`BenchReport.figures`: speedups, ratios, intervals, a sweep's points and recommendations).
The few helpers that take a report.json entry (`k_cell`, `with_interval`, `ranking_lines`,
`passes`, `hardware`) serve benchmarks/results.py, which re-renders committed report.json files;
they go through the same typed helpers (`k_label`, `estimate_cell`, `rank_speedups`, `passes_text`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specctl.bench.backends import BACKENDS
from specctl.bench.intervals import Estimate, compare, rank
from specctl.bench.plan import PLAIN, Method, chain_name
from specctl.bench.report import (
    LATENCIES,
    BenchReport,
    Figures,
    MethodFigures,
    PointFigures,
    Recommendation,
    ReportFigures,
    fmt,
    outputs_lines,
    report_dict,
)
from specctl.bench.spec import BackendSpec
from specctl.durable import write_atomic
from specctl.redact import redact_text, redact_tree
from specctl.vllm.capabilities import Need, needs_line


def k_label(method: Method) -> str:
    """K, and the confidence threshold that cut its drafts when there was one ("8, T 0.3"), or
    adaptive verification ("8, adaptive": K is then the most drafts a step verifies)."""
    if method.algo == PLAIN:
        return "-"
    t, k = method.confidence_threshold, method.num_speculative_tokens
    text = str(k) if t is None else f"{k}, T {t:g}"
    return f"{text}, adaptive" if method.adaptive else text


def entry_method(r: dict[str, Any]) -> Method:
    """The configuration a report.json entry (a result or a sweep point) describes."""
    return Method(
        r["name"],
        r["algo"],
        r["num_speculative_tokens"],
        confidence_threshold=r.get("confidence_threshold"),
        adaptive=bool(r.get("adaptive")),  # older reports have no adaptive
        tree_nodes=r.get("tree_nodes"),  # nor trees
    )


def k_cell(r: dict[str, Any]) -> str:
    """k_label of a report.json entry."""
    return k_label(entry_method(r))


def rates(values: list[float]) -> str:
    """Per-position rates (acceptance, accuracy) as one cell: "0.40 0.16 0.07", or "-" for none."""
    return " ".join(f"{a:.2f}" for a in values) or "-"


def estimate_cell(value: float | None, e: Estimate | None, digits: int = 2, suffix: str = "") -> str:
    """A figure and its 95% interval as one cell: "1.36x [1.30-1.41]"; the figure alone without one."""
    if e is None:
        return fmt(value, digits, suffix)
    return f"{fmt(e.value, digits, suffix)} [{fmt(e.low, digits)}-{fmt(e.high, digits)}]"


def figure_cell(f: Figures, name: str, digits: int = 2, suffix: str = "") -> str:
    """Figure `name` of `f` with its interval, as one cell (estimate_cell)."""
    return estimate_cell(getattr(f, name), f.estimate(name), digits, suffix)


def estimate_of(r: dict[str, Any], name: str) -> Estimate | None:
    """A report.json entry's figure with its interval (None: not measured, or no interval: a
    report from before intervals, or a measurement without units)."""
    interval = (r.get("intervals") or {}).get(name)
    if r.get(name) is None or interval is None:
        return None
    return Estimate(r[name], interval[0], interval[1])


def with_interval(r: dict[str, Any], name: str, digits: int = 2, suffix: str = "") -> str:
    """estimate_cell of a report.json entry's figure."""
    return estimate_cell(r.get(name), estimate_of(r, name), digits, suffix)


@dataclass(frozen=True)
class Speedup:
    """A method's speedup over no-spec as the ranking sentences read it."""

    name: str
    plain: bool
    estimate: Estimate | None  # None: no interval to rank by
    cell: str  # as the table shows it: "1.36x [1.30-1.41]"


def rank_speedups(entries: list[Speedup], baseline: str | None) -> list[str]:
    """One sentence per drafter against no-spec and against the baseline, written by
    intervals.rank from the speedups' intervals: an order only where they do not overlap."""
    plain = next((e for e in entries if e.plain), None)
    base = {e.name: e for e in entries}.get(baseline) if baseline else None
    lines = []
    for r in entries:
        if r.plain or r.estimate is None:
            continue
        for ref in (plain, base):
            theirs = ref.estimate if ref is not None and ref is not r else None
            if ref is not None and theirs is not None:
                order = rank(r.name, r.estimate, ref.name, theirs)
                lines.append(f"{order} (speedup over no-spec {r.cell} vs {ref.cell})")
    return lines


def ranking_lines(d: dict[str, Any]) -> list[str]:
    """rank_speedups of a report.json."""
    entries = [
        Speedup(r["name"], r["algo"] == PLAIN, estimate_of(r, "speedup"), with_interval(r, "speedup", 2, "x"))
        for r in d["results"]
    ]
    return rank_speedups(entries, d["baseline"])


def report_ranking(report: BenchReport, f: ReportFigures) -> list[str]:
    """rank_speedups of the report's results."""
    entries = [
        Speedup(
            r.name,
            not r.speculative,
            r.figures.estimate("speedup"),
            figure_cell(r.figures, "speedup", 2, "x"),
        )
        for r in f.results
    ]
    return rank_speedups(entries, report.baseline)


def _rows(f: ReportFigures) -> list[list[str]]:
    rows = []
    for r in f.results:
        spec, x = r.speculative, r.figures
        rows.append(
            [
                r.name,
                k_label(r.method),
                figure_cell(x, "acceptance_length") if spec else fmt(x.acceptance_length),
                rates(x.per_position_acceptance) if spec else "-",
                figure_cell(x, "output_tokens_per_s", 1),
                figure_cell(x, "speedup", 2, "x") if spec else fmt(x.speedup, 2, "x"),
                figure_cell(x, "ratio_vs_baseline", 2, "x") if f.base else "-",
                fmt(x.acceptance_ratio_vs_baseline, 2, "x") if f.base else "-",
                match_cell(r),
            ]
        )
    return rows


def match_cell(entry: MethodFigures) -> str:
    """The "= plain" cell: prompts decoded exactly as plain decoding / prompts compared, e.g. 7/8;
    "-" when not comparable (sampling, no no-spec run, no ids)."""
    return "-" if entry.matched is None else f"{entry.matched}/{entry.outputs_compared}"


TAU_HEADER = "mean acceptance length (tau)"  # vLLM's name for it, with ours


def backend_of(name: str) -> BackendSpec | None:
    """The spec of the backend a report names (None: one this specctl does not have)."""
    return BACKENDS.get(name)


def engine_name(backend: str) -> str:
    """The engine a report measured on, as its recommendations name it (its spec's title)."""
    spec = backend_of(backend)
    return spec.title if spec is not None else backend


def _headers(report: BenchReport) -> list[str]:
    base = report.baseline or "EAGLE-3"
    return [
        "method",
        "K",
        TAU_HEADER,
        "acceptance per position",
        "output tok/s",
        "speedup",
        f"vs {base}",
        f"tau vs {base}",
        "= plain",
    ]


def _title(report: BenchReport) -> str:
    state = "" if report.complete else " (INCOMPLETE)"
    return (
        f"bench {report.verifier} on {report.dataset}: {report.num_prompts} prompts, "
        f"{report.max_new_tokens} new tokens, T={report.temperature:g}, {report.backend}{state}"
    )


def rich_table(report: BenchReport, figures: ReportFigures | None = None):
    """The summary table the CLI prints; under it, the ranking sentences (`report_ranking`).
    `figures`: the report's, when the caller has them (else computed here)."""
    from rich.table import Table

    f = figures or report.figures()
    caption = "\n".join(line for line in [_sweep_caption(report), *report_ranking(report, f)] if line) or None
    table = Table(title=_title(report), title_justify="left", caption=caption, caption_justify="left")
    for i, h in enumerate(_headers(report)):
        table.add_column(h, justify="left" if i in (0, 3) else "right", style="bold" if i == 0 else None)
    for row in _rows(f):
        table.add_row(*row)
    return table


def level_cell(p: PointFigures) -> str:
    """A point's level in a table's first column: its concurrency, or its request rate."""
    return str(p.concurrency) if p.request_rate is None else rate_text(p.request_rate)


def rate_text(rate: float) -> str:
    """A request rate as written: `4`, `0.5`, `inf`."""
    return f"{rate:g}"


def by_rate(report: BenchReport) -> bool:
    """Whether the sweep's levels are request rates (bench --request-rate), not concurrencies."""
    return report.sweep is not None and bool(report.sweep_rates)


def level_header(report: BenchReport) -> str:
    """The first column's name: `concurrency`, or under --request-rate the rate (the cap on
    requests in flight is in the report's header)."""
    return "request rate (req/s)" if by_rate(report) else "concurrency"


def level_phrase(key: str) -> str:
    """A recommendations key (PointFigures.level_key) in a sentence."""
    return f"request rate {key}" if key.endswith("req/s") else f"concurrency {key}"


def _sweep_caption(report: BenchReport) -> str | None:
    if not shows_sweep(report):
        return None
    rates = report.sweep_rates
    at = f"request rate {rate_text(rates[0])} req/s" if rates else f"concurrency {report.concurrency}"
    return f"K sweep: each method at its recommended K, {at}; every point below"


def _sweep_rows(f: ReportFigures) -> list[list[str]]:
    """One row per sweep point, grouped by concurrency level (the points are in the order
    measured: K by K, each at every level); the last cell marks the recommended K."""
    rows = []
    for p in sorted(f.points or [], key=lambda p: p.level_order):
        spec, x = p.speculative, p.figures
        rows.append(
            [
                level_cell(p),
                p.name,
                k_label(p.method),
                fmt(x.acceptance_length),
                rates(x.per_position_acceptance) if spec else "-",
                fmt(x.draft_tokens_per_accepted) if spec else "-",
                fmt(x.output_tokens_per_s, 1),
                fmt(x.speedup, 2, "x"),
                match_cell(p),
                "*" if f.is_recommended(p) else "",
            ]
        )
    return rows


SWEEP_HEADERS = [
    "concurrency",
    "method",
    "K",
    TAU_HEADER,
    "acceptance per position",
    "drafted per accepted",
    "output tok/s",
    "speedup",
    "= plain",
    "best",
]
_SWEEP_NOTE = (
    "Best = the highest output tokens/s at that concurrency; a tie goes to the smaller K, then to no "
    "confidence threshold (T: verify only the drafts whose confidence product stays >= T). Drafted "
    "per accepted = draft tokens the verifier checked per draft token it kept. Under T, tau counts "
    "only the passes that verified a draft (vLLM's definition): a pass whose block was cut to nothing "
    "still costs a forward, so compare output tok/s. Speedups are against no-spec at the same "
    "concurrency. A draft tree (`<name>-treeN`) is a setting of its drafter: it is best only when its "
    "tok/s over the drafter's best chain's, paired on the same prompts and rounds, has a 95% interval "
    "wholly above 1 (a tie goes to the chain: fewer verify rows, and vLLM serves it)."
)


def recommendation_lines(
    report: BenchReport, figures: ReportFigures | None = None
) -> list[tuple[str, str | None]]:
    """(what was recommended, where and why; the --speculative-config argument) per drafter and
    level. Measured on another engine than vLLM, a last line says that no vLLM measurement backs
    a --speculative-config (report.recommendations gives none)."""
    f = figures or report.figures()
    lines = []
    for name, levels in f.recommended.items():
        for level, r in levels.items():
            x = r.point.figures
            text = (
                f"{level_phrase(level)}, {name}: {setting_text(r)}, measured on "
                f"{engine_name(r.measured_on)} ({fmt(x.output_tokens_per_s, 1)} tok/s, "
                f"{figure_cell(x, 'speedup', 2, 'x')} no-spec, tau {fmt(x.acceptance_length)}"
                f"{_against_plain(name, x)}){tree_text(r)}"
            )
            spec = r.speculative_config
            lines.append((text, f"--speculative-config '{json.dumps(spec)}'" if spec else None))
    if lines and not report.vllm_measured:
        lines.append((NO_VLLM_MEASUREMENT.format(engine=engine_name(report.backend)), None))
    return lines


def chain_label(m: Method) -> str:
    """A chain configuration in a sentence: `K=3`, with its threshold or adaptive verification."""
    t = m.confidence_threshold
    cut = "" if t is None else f", confidence threshold {t:g}"
    cut += ", adaptive verification" if m.adaptive else ""
    return f"K={m.num_speculative_tokens}{cut}"


def tree_label(m: Method) -> str:
    return f"tree of {m.tree_nodes} nodes, depth {m.num_speculative_tokens}"


def setting_text(r: Recommendation) -> str:
    """The recommended setting: `K=3` where no tree was measured, else `chain K=3` or `tree of 8
    nodes, depth 3` (depth: the chain's K the tree was built within)."""
    m = r.point.method
    if r.is_tree:
        return tree_label(m)
    return f"chain {chain_label(m)}" if r.tree is not None else chain_label(m)


def ratio_text(v: Estimate) -> str:
    """A paired ratio with its interval, `1.12x [1.09-1.16]`. A bound within 0.005 of 1 gets a
    third decimal, so an interval the tree-or-chain rule reads as wholly above 1 never prints as
    `[1.00-...]` beside one it reads as touching 1."""
    if not math.isfinite(v.low):
        return fmt(v.value, 2, "x")
    digits = 3 if any(f"{b:.2f}" == "1.00" for b in (v.low, v.high)) else 2
    return f"{fmt(v.value, 2, 'x')} [{v.low:.{digits}f}-{v.high:.{digits}f}]"


def tree_text(r: Recommendation) -> str:
    """After a recommendation where trees were measured: the tree against the chain (paired tok/s
    ratio), and for a tree, what vLLM can serve instead (specctl.vllm.capabilities)."""
    if r.tree is None or r.chain is None or r.versus is None:
        return ""
    ratio = ratio_text(r.versus)
    if not r.is_tree:
        return (
            f"; its fastest {tree_label(r.tree.method)}, runs at {ratio} the chain's tok/s: not faster "
            "beyond noise, so the chain"
        )
    chain = chain_label(r.chain.method)
    return (
        f"; {ratio} the tok/s of its fastest chain ({chain}). For specctl's embedded engine or a server "
        f"with tree support: {needs_line(Need.TREE)}, so serve the chain {chain} in vLLM today"
    )


NO_VLLM_MEASUREMENT = (
    "no vLLM measurement in this run, so no --speculative-config is recommended: the K above is "
    "{engine}'s best, and vLLM's step costs (and best K) differ; `specctl bench RECIPE --backend vllm "
    "--sweep-k all` measures the K to serve"
)


def _against_plain(name: str, x: Figures) -> str:
    """The recommendation's note on plain decoding: slower only when the speedup's interval lies
    below 1 (intervals.rank), a tie when it holds 1; without an interval, the point figure."""
    e = x.estimate("speedup")
    if e is None:
        slower = x.speedup is not None and x.speedup < 1
        return "; slower than no-spec, serve without speculation" if slower else ""
    plain = Estimate(1.0, 1.0, 1.0)
    order = compare(e, plain)
    if order > 0:
        return ""
    serve = ", serve without speculation" if order < 0 else ""
    return f"; {rank(name, e, 'no-spec', plain)}{serve}"


ADAPTIVE_HEADERS = [
    "concurrency",
    "method",
    "fixed K",
    "fixed tok/s",
    "fixed drafted per accepted",
    "adaptive K",
    "adaptive tok/s",
    "adaptive drafted per accepted",
    "adaptive / fixed tok/s",
]
ADAPTIVE_NOTE = (
    "Each drafter's fastest fixed-K configuration against its fastest adaptive one (K: the most "
    "drafts a step verifies), at each concurrency. Adaptive verification verifies only the drafts "
    "likely to be accepted (vLLM: enable_adaptive_verification; embedded engine: a cut where the "
    "estimated survival falls below bench.adaptive_threshold), so it drafts fewer tokens per "
    "accepted one; it pays off where verifying a draft costs more than its chance of acceptance "
    "brings -- at high concurrency, or on a CPU."
)


def _fastest(points: list[PointFigures]) -> PointFigures | None:
    return max(points, key=lambda p: p.figures.output_tokens_per_s or 0.0, default=None)


def adaptive_rows(f: ReportFigures) -> list[list[str]]:
    """Fixed K against adaptive verification, per drafter and concurrency level: one row where the
    sweep measured both (bench.adaptive both); none otherwise."""
    points = f.points or []
    rows = []
    keys = dict.fromkeys((p.concurrency, p.name) for p in points if p.method.adaptive)
    for level, name in sorted(keys, key=lambda key: key[0]):
        mine = [p for p in points if (p.concurrency, p.name) == (level, name)]
        fixed = _fastest([p for p in mine if not p.method.adaptive and p.method.confidence_threshold is None])
        adaptive = _fastest([p for p in mine if p.method.adaptive])
        if fixed is None or adaptive is None:
            continue
        a, b = adaptive.figures, fixed.figures
        ratio = a.output_tokens_per_s / b.output_tokens_per_s if b.output_tokens_per_s else None
        rows.append(
            [
                str(level),
                name,
                str(fixed.method.num_speculative_tokens),
                fmt(b.output_tokens_per_s, 1),
                fmt(b.draft_tokens_per_accepted),
                str(adaptive.method.num_speculative_tokens),
                fmt(a.output_tokens_per_s, 1),
                fmt(a.draft_tokens_per_accepted),
                fmt(ratio, 2, "x"),
            ]
        )
    return rows


def shows_sweep(report: BenchReport) -> bool:
    """A K sweep to show: a remote server has one configuration (its own), so its concurrency
    levels are the latency table's rows, with nothing to recommend."""
    spec = backend_of(report.backend)
    return report.sweep is not None and not (spec is not None and spec.as_it_runs)


def rich_sweep(report: BenchReport, figures: ReportFigures | None = None):
    """The sweep table and the recommended --speculative-config per drafter and level (None
    when the report is not a sweep), printed by the CLI under the summary table."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    if not shows_sweep(report):
        return None
    f = figures or report.figures()
    table = Table(
        title="K sweep (best = highest output tok/s; a tie goes to the smaller K)", title_justify="left"
    )
    for i, h in enumerate([level_header(report), *SWEEP_HEADERS[1:]]):
        table.add_column(h, justify="left" if i in (1, 4) else "right", style="bold" if i == 1 else None)
    level = None
    for row in _sweep_rows(f):
        if level is not None and row[0] != level:
            table.add_section()
        level = row[0]
        table.add_row(*row)
    parts: list[Any] = [table, Text("recommended:")]
    for text, arg in recommendation_lines(report, f):
        parts.append(Text(f"  {text}"))
        if arg:  # one unbroken line, so it can be copied into a vllm serve command
            parts.append(Text(f"    {arg}", no_wrap=True, overflow="ignore"))
    parts += [Text(f"skipped: {line}", style="yellow") for line in report.sweep_skipped]
    compared = adaptive_rows(f)
    if compared:
        versus = Table(title="Fixed K vs adaptive verification (fastest of each)", title_justify="left")
        for i, h in enumerate(ADAPTIVE_HEADERS):
            versus.add_column(h, justify="left" if i == 1 else "right", style="bold" if i == 1 else None)
        for row in compared:
            versus.add_row(*row)
        parts.append(versus)
    return Group(*parts)


LATENCY_HEADERS = [
    "concurrency",
    "method",
    "K",
    TAU_HEADER,
    "req/s",
    "output tok/s",
    "TTFT ms p50 / p90 / p99",
    "TPOT ms p50 / p90 / p99",
    "ITL ms p50 / p90 / p99",
]
LATENCY_NOTE = (
    "TTFT = time to the first token; TPOT = time per output token after the first, per request; "
    "ITL = time between streamed chunks (with speculation a chunk holds every token one step "
    "accepted, so ITL > TPOT). Percentiles over requests (TTFT, TPOT) and over chunk gaps (ITL)."
)


# (its level's place, the level as a table cell, the configuration): what the latency table and plot read
LatencyEntry = tuple[tuple[int, float], str, MethodFigures]


def latency_entries(report: BenchReport, f: ReportFigures) -> list[LatencyEntry]:
    """The configurations with streamed latencies, by level: a sweep's points, else the results
    at the run's concurrency."""
    if f.points is not None:
        entries = [(p.level_order, level_cell(p), p) for p in f.points]
    else:
        entries = [((report.concurrency, -1.0), str(report.concurrency), r) for r in f.results]
    kept = [e for e in entries if e[2].figures.latency.get("median_ttft_ms") is not None]
    return sorted(kept, key=lambda e: e[0])


def _pcts(x: Figures, name: str) -> str:
    return " / ".join(fmt(x.latency[f"{stat}_{name}_ms"], 1) for stat in ("median", "p90", "p99"))


def latency_rows(report: BenchReport, figures: ReportFigures | None = None) -> list[list[str]]:
    """One row per configuration and concurrency level (a sweep's points, else the results)."""
    return [
        [
            cell,
            e.name,
            str(e.method.num_speculative_tokens) if e.speculative else "-",
            fmt(e.figures.acceptance_length),
            fmt(e.figures.request_throughput, 2),
            fmt(e.figures.output_tokens_per_s, 1),
            _pcts(e.figures, "ttft"),
            _pcts(e.figures, "tpot"),
            _pcts(e.figures, "itl"),
        ]
        for _, cell, e in latency_entries(report, figures or report.figures())
    ]


def latency_title(report: BenchReport) -> str:
    """Where the latencies come from: streamed requests, or the embedded engine's steps (each
    step's tokens one chunk, as a server streams them)."""
    spec = backend_of(report.backend)
    return f"latency ({spec.latency if spec is not None else 'streamed requests'})"


def rich_latency(report: BenchReport, figures: ReportFigures | None = None):
    """The latency table (None without streamed requests), printed under the summary."""
    from rich.table import Table

    rows = latency_rows(report, figures)
    if not rows:
        return None
    table = Table(title=latency_title(report), title_justify="left", caption=LATENCY_NOTE)
    for i, h in enumerate([level_header(report), *LATENCY_HEADERS[1:]]):
        table.add_column(h, justify="left" if i == 1 else "right", style="bold" if i == 1 else None)
    level = None
    for row in rows:
        if level is not None and row[0] != level:
            table.add_section()
        level = row[0]
        table.add_row(*row)
    return table


BF16_KINDS = {"amx": "AMX bf16", "avx512_bf16": "AVX512-BF16, no AMX", None: "bf16 emulated"}


def hardware(p: dict[str, Any]) -> str:
    """A provenance's machine: "2x AMD EPYC (AVX512-BF16, no AMX), no GPU" (the bf16 part only
    where the report recorded it, since 2026-12-04)."""
    bf16 = f" ({BF16_KINDS.get(p['cpu_bf16'], p['cpu_bf16'])})" if "cpu_bf16" in p else ""
    gpus = f"{p['gpu_count']}x {p['gpu']}" if p.get("gpu_count") else "no GPU"
    return f"{p.get('cpu_count', '?')}x {p.get('cpu', '?')}{bf16}, {gpus}"


def provenance_line(report: BenchReport) -> str | None:
    """The report's provenance in one line: versions, commit, hardware, time, recipe hash."""
    p = report.provenance
    if not p:
        return None
    versions = ", ".join(f"{k} {v}" for k, v in p["versions"].items() if v)
    commit = (
        f" ({p['git_commit'][:12]}{'+dirty' if p.get('git_dirty') else ''})" if p.get("git_commit") else ""
    )
    parts = [f"{versions}{commit}", hardware(p), p["timestamp"]]
    if p.get("recipe_sha256"):
        parts.append(f"recipe sha256 {p['recipe_sha256'][:12]}")
    server = p.get("server")
    if server:
        parts.append(
            f"server {server['base_url']} ({server.get('model') or '?'}"
            f"{', vLLM ' + server['vllm_version'] if server.get('vllm_version') else ''})"
        )
    engine = p.get("engine")
    if engine:
        attention = engine.get("verify_attention", "exact")  # absent from reports before the setting
        parts.append(
            f"engine {engine['dtype']}, {engine['linear_kernel']} matmuls, {attention} verify attention"
        )
    return "; ".join(parts)


def load_phrase(report: BenchReport) -> str:
    """How requests reached the engine: `concurrency 4`, or under --request-rate the rates and
    the cap on requests in flight."""
    if not by_rate(report):
        return f"concurrency {report.concurrency}"
    text = ", ".join(rate_text(r) for r in report.sweep_rates)
    return (
        f"requests arriving as a Poisson process at {text} req/s (seed {report.seed}), "
        f"at most {report.concurrency} in flight"
    )


def passes_text(backend: str, repeats: int, engine_rounds: int) -> str:
    """How a report's throughput was taken, when more than one pass or engine per configuration."""
    out = ""
    if repeats > 1:
        spec = backend_of(backend)
        interleaved = spec is not None and spec.interleave
        how = "methods interleaved round by round" if interleaved else "in each engine"
        out = f", {repeats} rounds over the prompts, {how}"
    if engine_rounds > 1:
        out += f", {engine_rounds} engine rounds per configuration (order reversed every other round)"
    return out


def passes(d: dict[str, Any]) -> str:
    """passes_text of a report.json."""
    return passes_text(d.get("backend", ""), d.get("repeats", 1), d.get("engine_rounds", 1))


def markdown(
    report: BenchReport, image: str | None = "acceptance.png", figures: ReportFigures | None = None
) -> str:
    """report.md: the settings, the summary table and its ranking, then latency, categories, the
    K sweep, requirements, errors and warnings, each where the report has them."""
    f = figures or report.figures()
    lines = _md_head(report, f)
    if latency_entries(report, f):
        lines += ["", "## Latency", "", LATENCY_NOTE, ""]
        lines += _md_table([level_header(report), *LATENCY_HEADERS[1:]], latency_rows(report, f))
        if image:
            against = "request rate" if by_rate(report) else "concurrency"
            lines += ["", f"![TTFT, TPOT and ITL against {against}](latency.png)"]
    for cat in f.categories:
        lines += ["", f"## {cat}", ""]
        rows = [
            [
                r.name,
                str(c.num_prompts),
                fmt(c.acceptance_length),
                fmt(c.output_tokens_per_s, 1),
                fmt(c.speedup, 2, "x"),
            ]
            for r in f.results
            if (c := (r.categories or {}).get(cat)) is not None
        ]
        lines += _md_table(["method", "prompts", TAU_HEADER, "output tok/s", "speedup"], rows)
    if shows_sweep(report):
        lines += _md_sweep(report, f, image)
    lines += _md_outcome(report)
    if image:
        lines += ["", f"![acceptance per position and throughput]({image})"]
    return "\n".join(lines) + "\n"


def _md_head(report: BenchReport, f: ReportFigures) -> list[str]:
    """report.md's title, settings list and summary table with its ranking."""
    taken = passes_text(report.backend, report.repeats, report.engine_rounds)
    lines = [f"# {_title(report)}", ""]
    lines += [
        f"- verifier: `{report.verifier}`",
        f"- backend: {report.backend} ({load_phrase(report)}{taken})",
        f"- dataset: {report.dataset}, {report.num_prompts} prompts, seed {report.seed}",
        f"- sampling: temperature {report.temperature:g}, top_p {report.top_p:g}, "
        f"max_new_tokens {report.max_new_tokens}",
        f"- {TAU_HEADER} = 1 + accepted / drafts (bonus token included, as vLLM counts it); "
        "speedup = output tokens/s over no-spec",
        "- each figure: the median over rounds [95% interval: bootstrap over the (prompt, round) cells, "
        "paired with the reference for ratios]; a ranking below is written only where two intervals "
        "do not overlap, else the methods tie",
        '- "= plain": prompts whose greedy output ids equal no-spec\'s exactly (ids in outputs.jsonl)',
    ]
    provenance = provenance_line(report)
    if provenance:
        lines.append(f"- provenance: {provenance}")
    if report.divergence_summary:
        lines.append(
            f"- divergences: {report.divergence_summary} (first differing token, margins in report.json)"
        )
    lines += [""]
    lines += _md_table(_headers(report), _rows(f))
    ranking = report_ranking(report, f)
    if ranking:
        lines += ["", *[f"- {line}" for line in ranking]]
    return lines


def _md_sweep(report: BenchReport, f: ReportFigures, image: str | None) -> list[str]:
    """report.md's K sweep: every point, the recommendations, fixed K against adaptive."""
    lines = [
        "",
        "## K sweep",
        "",
        f"The table above holds each method at its recommended K. {_SWEEP_NOTE}",
        "",
    ]
    lines += _md_table([level_header(report), *SWEEP_HEADERS[1:]], _sweep_rows(f))
    vllm = report.vllm_measured
    heading = "Recommended `--speculative-config`" if vllm else "Recommended K"
    lines += ["", f"### {heading} (measured on {engine_name(report.backend)})", ""]
    for text, arg in recommendation_lines(report, f):
        lines.append(f"- {text}" + (f"\n\n  ```\n  {arg}\n  ```" if arg else ""))
    lines += [f"- skipped: {line}" for line in report.sweep_skipped]
    compared = adaptive_rows(f)
    if compared:
        lines += ["", "## Fixed K vs adaptive verification", "", ADAPTIVE_NOTE, ""]
        lines += _md_table(ADAPTIVE_HEADERS, compared)
    if image:
        lines += ["", "![output tokens/s and tau against K](sweep.png)"]
    return lines


def _md_outcome(report: BenchReport) -> list[str]:
    """report.md's requirements (met or not), errors and warnings."""
    lines = []
    if report.requirements:
        lines += ["", "## Requirements", ""]
        failed = {f.split(": ", 1)[0] for f in report.failures}
        for req in report.requirements:
            lines.append(f"- {'FAIL' if req in failed else 'ok'} `{req}`")
        lines += [f"  - {f}" for f in report.failures]
    if report.errors:
        lines += ["", "## Errors", ""]
        lines += [f"- {e.splitlines()[0]}" for e in report.errors]
    if report.warnings:
        lines += ["", "## Warnings", ""]
        lines += [f"- {w}" for w in report.warnings]
    return lines


def _md_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def plot(report: BenchReport, path: Path, figures: ReportFigures | None = None) -> Path:
    """acceptance.png: per-position acceptance curves (left), output tokens/s per method (right).

    Drawn on an Agg canvas directly, so no GUI backend and no global pyplot state.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    results = (figures or report.figures()).results
    fig = Figure(figsize=(11, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    drawn = False
    for r in results:
        acc = r.figures.per_position_acceptance
        if r.speculative and acc:
            left.plot(
                range(1, len(acc) + 1),
                acc,
                marker="o",
                label=f"{r.name} (tau {r.figures.acceptance_length:.2f})",
            )
            drawn = True
    left.set(
        xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05), title="per-position acceptance"
    )
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.grid(alpha=0.3)
    if drawn:
        left.legend(fontsize=8)
    names = [r.name for r in results]
    tps = [r.figures.output_tokens_per_s for r in results]
    bars = right.bar(names, tps, color=["C0" if r.speculative else "0.6" for r in results])
    for bar, r in zip(bars, results, strict=True):
        if r.figures.speedup is not None:
            right.annotate(
                f"{r.figures.speedup:.2f}x",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    right.set(ylabel="output tokens/s", title="throughput")
    right.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.suptitle(_title(report), fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return path


Series = tuple[str, float | None, bool]  # a drafter's line in sweep.png: (name, threshold, adaptive)


def _series(p: PointFigures) -> Series:
    return p.name, p.method.confidence_threshold, p.method.adaptive


def plot_sweep(report: BenchReport, path: Path, figures: ReportFigures | None = None) -> Path:
    """sweep.png: output tokens/s (top) and tau (bottom) against K, one line per drafter and one
    column per concurrency level; no-spec is the dashed line, the recommended K a star."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    f = figures or report.figures()
    points = f.points or []
    order = {p.level_key: p.level_order for p in points}
    levels = sorted(order, key=order.__getitem__) or [str(c) for c in report.sweep_levels]
    fig = Figure(figsize=(max(8.0, 1.5 + 4.5 * len(levels)), 7), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(levels), squeeze=False)
    series = list(dict.fromkeys(_series(p) for p in points if p.speculative))
    for col, level in enumerate(levels):
        _sweep_column(
            axes[0][col], axes[1][col], [p for p in points if p.level_key == level], series, f, level
        )
    fig.suptitle(f"{_title(report)}\nK sweep: star = recommended K (highest output tokens/s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _sweep_column(
    top, bottom, here: list[PointFigures], series: list[Series], f: ReportFigures, level: str
) -> None:
    """One level of sweep.png: tok/s (top) and tau (bottom) against K, a line per series."""
    from matplotlib.ticker import MaxNLocator

    for p in here:
        if not p.speculative:
            top.axhline(p.figures.output_tokens_per_s, color="0.5", linestyle="--", label="no-spec")
    for i, key in enumerate(series):
        name, t, adaptive = key
        pts = sorted((p for p in here if _series(p) == key), key=lambda p: p.method.num_speculative_tokens)
        if not pts:
            continue
        label = (name if t is None else f"{name} T={t:g}") + (" adaptive" if adaptive else "")
        ks = [p.method.num_speculative_tokens for p in pts]
        top.plot(ks, [p.figures.output_tokens_per_s for p in pts], marker="o", color=f"C{i}", label=label)
        taus = [p.figures.acceptance_length for p in pts]
        if None not in taus:
            bottom.plot(ks, taus, marker="o", color=f"C{i}", label=label)
        best = f.recommended.get(chain_name(pts[0].method), {}).get(level)
        if best is not None and _series(best.point) == key:
            best_k, best_tps = (
                best.point.method.num_speculative_tokens,
                best.point.figures.output_tokens_per_s,
            )
            top.plot(best_k, best_tps, "*", ms=15, color=f"C{i}")
    top.set(title=level_phrase(level), ylabel="output tokens/s")
    taus = [
        p.figures.acceptance_length for p in here if p.speculative and p.figures.acceptance_length is not None
    ]
    bottom.set(
        xlabel="K (num_speculative_tokens)",
        ylabel="tau (acceptance length)",
        ylim=(0.95, 1.05 * max([2.0, *taus])),  # tau >= 1 always; a flat 1.0 reads as flat
    )
    for ax in (top, bottom):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    if here:
        top.legend(fontsize=8)


def plot_latency(report: BenchReport, path: Path, figures: ReportFigures | None = None) -> Path:
    """latency.png: TTFT, TPOT and ITL (median solid, p99 dotted) against concurrency (or request
    rate), one line per configuration (method at K)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    entries = latency_entries(report, figures or report.figures())
    configs = list(dict.fromkeys((e.name, e.method.num_speculative_tokens) for _, _, e in entries))
    rated = any(isinstance(e, PointFigures) and e.request_rate is not None for _, _, e in entries)
    # concurrency on a log2 axis; request rates (inf among them) evenly spaced, in order
    ticks = sorted({order: cell for order, cell, _ in entries}.items())
    place = {key: key[0] if not rated else i for i, (key, _) in enumerate(ticks)}
    fig = Figure(figsize=(13, 4), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    titles = {"ttft": "time to first token", "tpot": "time per output token", "itl": "inter-token latency"}
    for ax, name in zip(axes, LATENCIES, strict=True):
        for i, (method, k) in enumerate(configs):
            mine = [
                (order, e)
                for order, _, e in entries
                if (e.name, e.method.num_speculative_tokens) == (method, k)
            ]
            xs = [place[order] for order, _ in mine]
            label = (
                method if k == 0 or len({c[1] for c in configs if c[0] == method}) == 1 else f"{method} K={k}"
            )
            ax.plot(
                xs,
                [e.figures.latency[f"median_{name}_ms"] for _, e in mine],
                marker="o",
                color=f"C{i}",
                label=label,
            )
            ax.plot(xs, [e.figures.latency[f"p99_{name}_ms"] for _, e in mine], linestyle=":", color=f"C{i}")
        xlabel = "request rate (req/s)" if rated else "concurrency"
        ax.set(title=f"{titles[name]} (p50, p99 dotted)", xlabel=xlabel, ylabel="ms")
        if not rated:
            ax.set_xscale("log", base=2)
        ax.set_xticks([place[key] for key, _ in ticks], [label for _, label in ticks])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    if configs:
        axes[0].legend(fontsize=8)
    fig.suptitle(_title(report), fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return path


def write_report(report: BenchReport, out_dir: Path, figures: bool = True) -> dict[str, Path]:
    """Write report.json and outputs.jsonl (always) and report.md + acceptance.png, and sweep.png
    for a sweep (when `figures`: the intervals are bootstrapped then too, else left null). The
    report's figures are computed once for all of them; a server URL's credentials stay out of
    every file (specctl.redact)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    f = report.figures(intervals=figures)
    paths = {"json": out_dir / "report.json", "outputs": out_dir / "outputs.jsonl"}
    d = redact_tree(report_dict(report, figures=f))
    write_atomic(paths["json"], json.dumps(d, indent=2) + "\n", durable=False)
    write_atomic(paths["outputs"], "".join(line + "\n" for line in outputs_lines(report)), durable=False)
    if figures:
        paths["md"] = out_dir / "report.md"
        write_atomic(paths["md"], redact_text(markdown(report, figures=f)), durable=False)
        paths["png"] = plot(report, out_dir / "acceptance.png", f)
        if shows_sweep(report):
            paths["sweep_png"] = plot_sweep(report, out_dir / "sweep.png", f)
        if latency_entries(report, f):
            paths["latency_png"] = plot_latency(report, out_dir / "latency.png", f)
    return paths
