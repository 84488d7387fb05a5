"""How a benchmark report is shown: the rich tables the CLI prints, report.md, acceptance.png,
sweep.png and latency.png; `write_report` writes them beside report.json and outputs.jsonl
(rewritten whole after every measurement, so an interrupted run leaves a readable report)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specctl.bench.intervals import Estimate, compare, rank
from specctl.bench.plan import PLAIN
from specctl.bench.report import (
    LATENCIES,
    VLLM_BACKENDS,
    BenchReport,
    fmt,
    level_key,
    outputs_lines,
    point_setting,
    report_dict,
)
from specctl.durable import write_atomic
from specctl.redact import redact_tree


def k_cell(r: dict[str, Any]) -> str:
    """K, and the confidence threshold that cut its drafts when there was one ("8, T 0.3"), or
    adaptive verification ("8, adaptive": K is then the most drafts a step verifies)."""
    if r["algo"] == PLAIN:
        return "-"
    t = r.get("confidence_threshold")
    k = str(r["num_speculative_tokens"]) if t is None else f"{r['num_speculative_tokens']}, T {t:g}"
    return f"{k}, adaptive" if r.get("adaptive") else k


def rates(values: list[float]) -> str:
    """Per-position rates (acceptance, accuracy) as one cell: "0.40 0.16 0.07", or "-" for none."""
    return " ".join(f"{a:.2f}" for a in values) or "-"


def estimate_of(r: dict[str, Any], name: str) -> Estimate | None:
    """A report entry's figure with its interval (None: not measured, or no interval: a report
    from before intervals, or a measurement without units)."""
    interval = (r.get("intervals") or {}).get(name)
    if r.get(name) is None or interval is None:
        return None
    return Estimate(r[name], interval[0], interval[1])


def with_interval(r: dict[str, Any], name: str, digits: int = 2, suffix: str = "") -> str:
    """A figure and its 95% interval as one cell: "1.36x [1.30-1.41]"; the figure alone without one."""
    e = estimate_of(r, name)
    if e is None:
        return fmt(r.get(name), digits, suffix)
    return f"{fmt(e.value, digits, suffix)} [{fmt(e.low, digits)}-{fmt(e.high, digits)}]"


def ranking_lines(d: dict[str, Any]) -> list[str]:
    """One sentence per drafter against no-spec and against the baseline, written by
    intervals.rank from the speedups' intervals: an order only where they do not overlap."""
    by_name = {r["name"]: r for r in d["results"]}
    plain = next((r for r in d["results"] if r["algo"] == PLAIN), None)
    base = by_name.get(d["baseline"]) if d["baseline"] else None
    lines = []
    for r in d["results"]:
        mine = estimate_of(r, "speedup")
        if r["algo"] == PLAIN or mine is None:
            continue
        for ref in (plain, base):
            theirs = estimate_of(ref, "speedup") if ref is not None and ref is not r else None
            if theirs is not None:
                a, b = with_interval(r, "speedup", 2, "x"), with_interval(ref, "speedup", 2, "x")
                lines.append(
                    f"{rank(r['name'], mine, ref['name'], theirs)} (speedup over no-spec {a} vs {b})"
                )
    return lines


def _rows(d: dict[str, Any]) -> list[list[str]]:
    base_algo = next((r["algo"] for r in d["results"] if r["name"] == d["baseline"]), None)
    rows = []
    for r in d["results"]:
        spec = r["algo"] != PLAIN
        rows.append(
            [
                r["name"],
                k_cell(r),
                with_interval(r, "acceptance_length") if spec else fmt(r["acceptance_length"]),
                rates(r["per_position_acceptance"]) if spec else "-",
                with_interval(r, "output_tokens_per_s", 1),
                with_interval(r, "speedup", 2, "x") if spec else fmt(r["speedup"], 2, "x"),
                with_interval(r, "ratio_vs_baseline", 2, "x") if base_algo else "-",
                fmt(r["acceptance_ratio_vs_baseline"], 2, "x") if base_algo else "-",
                _match(r),
            ]
        )
    return rows


def _match(r: dict[str, Any]) -> str:
    """The "= plain" cell: prompts decoded exactly as plain decoding / prompts compared, e.g. 7/8;
    "-" when not comparable (sampling, no no-spec run, no ids)."""
    frac, n = r.get("outputs_match_plain"), r.get("outputs_compared") or 0
    return "-" if frac is None or not n else f"{round(frac * n)}/{n}"


TAU_HEADER = "mean acceptance length (tau)"  # vLLM's name for it, with ours
# the engine a report measured on, as its recommendations name it
ENGINES = {
    "embedded": "specctl's embedded engine",
    "vllm": "vLLM (server)",
    "vllm-offline": "vLLM (offline engine)",
    "remote": "the server at --base-url",
}


def engine_name(backend: str) -> str:
    return ENGINES.get(backend, backend)


def _headers(d: dict[str, Any]) -> list[str]:
    base = d["baseline"] or "EAGLE-3"
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


def _title(d: dict[str, Any]) -> str:
    state = "" if d["complete"] else " (INCOMPLETE)"
    return (
        f"bench {d['verifier']} on {d['dataset']}: {d['num_prompts']} prompts, {d['max_new_tokens']} new "
        f"tokens, T={d['temperature']:g}, {d['backend']}{state}"
    )


def rich_table(report: BenchReport | dict[str, Any]):
    """The summary table the CLI prints; under it, the ranking sentences (`ranking_lines`)."""
    from rich.table import Table

    d = report if isinstance(report, dict) else report_dict(report)
    caption = "\n".join(line for line in [_sweep_caption(d), *ranking_lines(d)] if line) or None
    table = Table(title=_title(d), title_justify="left", caption=caption, caption_justify="left")
    for i, h in enumerate(_headers(d)):
        table.add_column(h, justify="left" if i in (0, 3) else "right", style="bold" if i == 0 else None)
    for row in _rows(d):
        table.add_row(*row)
    return table


def level_order(p: dict[str, Any]) -> tuple[int, float]:
    """A point's place among a sweep's levels: by concurrency, then request rate (inf last)."""
    rate = p.get("request_rate")
    return p["concurrency"], -1.0 if rate is None else float(rate)  # float("inf") reads "inf"


def level_cell(p: dict[str, Any]) -> str:
    """A point's level in a table's first column: its concurrency, or its request rate."""
    rate = p.get("request_rate")
    return str(p["concurrency"]) if rate is None else rate_text(rate)


def rate_text(rate: float | str) -> str:
    """A report.json request rate as written: `4`, `0.5`, `inf`."""
    return rate if isinstance(rate, str) else f"{rate:g}"


def level_header(d: dict[str, Any]) -> str:
    """The first column's name: `concurrency`, or under --request-rate the rate (the cap on
    requests in flight is in the report's header)."""
    return "request rate (req/s)" if d.get("sweep", {}).get("request_rate") else "concurrency"


def level_phrase(key: str) -> str:
    """A recommendations key (report.level_key) in a sentence."""
    return f"request rate {key}" if key.endswith("req/s") else f"concurrency {key}"


def _sweep_caption(d: dict[str, Any]) -> str | None:
    if not shows_sweep(d):
        return None
    rates = d["sweep"].get("request_rate")
    at = f"request rate {rate_text(rates[0])} req/s" if rates else f"concurrency {d['concurrency']}"
    return f"K sweep: each method at its recommended K, {at}; every point below"


def _sweep_rows(d: dict[str, Any]) -> list[list[str]]:
    """One row per sweep point, grouped by concurrency level (the points are in the order
    measured: K by K, each at every level); the last cell marks the recommended K."""
    recommended = d["sweep"]["recommended"]
    rows = []
    for p in sorted(d["sweep"]["points"], key=level_order):
        spec = p["algo"] != PLAIN
        best = recommended.get(p["name"], {}).get(level_key(p), {})
        rows.append(
            [
                level_cell(p),
                p["name"],
                k_cell(p),
                fmt(p["acceptance_length"]),
                rates(p["per_position_acceptance"]) if spec else "-",
                fmt(p.get("draft_tokens_per_accepted")) if spec else "-",
                fmt(p["output_tokens_per_s"], 1),
                fmt(p["speedup"], 2, "x"),
                _match(p),
                "*" if best and point_setting(best) == point_setting(p) else "",
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
    "concurrency."
)


def recommendation_lines(d: dict[str, Any]) -> list[tuple[str, str | None]]:
    """(what was recommended, where and why; the --speculative-config argument) per drafter and
    level. Measured on another engine than vLLM, a last line says that no vLLM measurement backs
    a --speculative-config (report.recommendations gives none)."""
    lines = []
    for name, levels in d["sweep"]["recommended"].items():
        for level, r in levels.items():
            t = r.get("confidence_threshold")
            cut = "" if t is None else f", confidence threshold {t:g}"
            cut += ", adaptive verification" if r.get("adaptive") else ""
            where = engine_name(r.get("measured_on", d["backend"]))
            text = (
                f"{level_phrase(level)}, {name}: K={r['num_speculative_tokens']}{cut}, measured on {where} "
                f"({fmt(r['output_tokens_per_s'], 1)} tok/s, {with_interval(r, 'speedup', 2, 'x')} no-spec, "
                f"tau {fmt(r['acceptance_length'])}{_against_plain(name, r)})"
            )
            spec = r["speculative_config"]
            lines.append((text, f"--speculative-config '{json.dumps(spec)}'" if spec else None))
    if lines and d["backend"] not in VLLM_BACKENDS:
        lines.append((NO_VLLM_MEASUREMENT.format(engine=engine_name(d["backend"])), None))
    return lines


NO_VLLM_MEASUREMENT = (
    "no vLLM measurement in this run, so no --speculative-config is recommended: the K above is "
    "{engine}'s best, and vLLM's step costs (and best K) differ; `specctl bench RECIPE --backend vllm "
    "--sweep-k all` measures the K to serve"
)


def _against_plain(name: str, r: dict[str, Any]) -> str:
    """The recommendation's note on plain decoding: slower only when the speedup's interval lies
    below 1 (intervals.rank), a tie when it holds 1; without an interval, the point figure."""
    e = estimate_of(r, "speedup")
    if e is None:
        slower = r["speedup"] is not None and r["speedup"] < 1
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


def _fastest(points: list[dict[str, Any]]) -> dict[str, Any] | None:
    return max(points, key=lambda p: p["output_tokens_per_s"] or 0.0, default=None)


def adaptive_rows(d: dict[str, Any]) -> list[list[str]]:
    """Fixed K against adaptive verification, per drafter and concurrency level: one row where the
    sweep measured both (bench.adaptive both); none otherwise."""
    points = d["sweep"]["points"] if "sweep" in d else []
    rows = []
    keys = dict.fromkeys((p["concurrency"], p["name"]) for p in points if p.get("adaptive"))
    for level, name in sorted(keys, key=lambda key: key[0]):
        mine = [p for p in points if (p["concurrency"], p["name"]) == (level, name)]
        fixed = _fastest([p for p in mine if not p.get("adaptive") and p.get("confidence_threshold") is None])
        adaptive = _fastest([p for p in mine if p.get("adaptive")])
        if fixed is None or adaptive is None:
            continue
        ratio = None
        if fixed["output_tokens_per_s"] and adaptive["output_tokens_per_s"] is not None:
            ratio = adaptive["output_tokens_per_s"] / fixed["output_tokens_per_s"]
        rows.append(
            [
                str(level),
                name,
                str(fixed["num_speculative_tokens"]),
                fmt(fixed["output_tokens_per_s"], 1),
                fmt(fixed.get("draft_tokens_per_accepted")),
                str(adaptive["num_speculative_tokens"]),
                fmt(adaptive["output_tokens_per_s"], 1),
                fmt(adaptive.get("draft_tokens_per_accepted")),
                fmt(ratio, 2, "x"),
            ]
        )
    return rows


def shows_sweep(d: dict[str, Any]) -> bool:
    """A K sweep to show: a remote server has one configuration (its own), so its concurrency
    levels are the latency table's rows, with nothing to recommend."""
    return "sweep" in d and d["backend"] != "remote"


def rich_sweep(report: BenchReport | dict[str, Any]):
    """The sweep table and the recommended --speculative-config per drafter and level (None
    when the report is not a sweep), printed by the CLI under the summary table."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    d = report if isinstance(report, dict) else report_dict(report)
    if not shows_sweep(d):
        return None
    table = Table(
        title="K sweep (best = highest output tok/s; a tie goes to the smaller K)", title_justify="left"
    )
    for i, h in enumerate([level_header(d), *SWEEP_HEADERS[1:]]):
        table.add_column(h, justify="left" if i in (1, 4) else "right", style="bold" if i == 1 else None)
    level = None
    for row in _sweep_rows(d):
        if level is not None and row[0] != level:
            table.add_section()
        level = row[0]
        table.add_row(*row)
    parts: list[Any] = [table, Text("recommended:")]
    for text, arg in recommendation_lines(d):
        parts.append(Text(f"  {text}"))
        if arg:  # one unbroken line, so it can be copied into a vllm serve command
            parts.append(Text(f"    {arg}", no_wrap=True, overflow="ignore"))
    parts += [Text(f"skipped: {line}", style="yellow") for line in d["sweep"]["skipped"]]
    compared = adaptive_rows(d)
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


def has_latency(d: dict[str, Any]) -> bool:
    points = d["sweep"]["points"] if "sweep" in d else d["results"]
    return any(p.get("median_ttft_ms") is not None for p in points)


def _pcts(p: dict[str, Any], name: str) -> str:
    return " / ".join(fmt(p[f"{stat}_{name}_ms"], 1) for stat in ("median", "p90", "p99"))


def latency_rows(d: dict[str, Any]) -> list[list[str]]:
    """One row per configuration and concurrency level (a sweep's points, else the results)."""
    if "sweep" in d:
        points = sorted(d["sweep"]["points"], key=level_order)
    else:
        points = [{**r, "concurrency": d["concurrency"]} for r in d["results"]]
    return [
        [
            level_cell(p),
            p["name"],
            str(p["num_speculative_tokens"]) if p["algo"] != PLAIN else "-",
            fmt(p["acceptance_length"]),
            fmt(p["request_throughput"], 2),
            fmt(p["output_tokens_per_s"], 1),
            _pcts(p, "ttft"),
            _pcts(p, "tpot"),
            _pcts(p, "itl"),
        ]
        for p in points
        if p.get("median_ttft_ms") is not None
    ]


def latency_title(d: dict[str, Any]) -> str:
    """Where the latencies come from: streamed requests, or the embedded engine's steps (each
    step's tokens one chunk, as a server streams them)."""
    if d["backend"] == "embedded":
        return "latency (specctl's embedded engine: each verifier step's tokens as one streamed chunk)"
    return "latency (streamed requests)"


def rich_latency(report: BenchReport | dict[str, Any]):
    """The latency table (None without streamed requests), printed under the summary."""
    from rich.table import Table

    d = report if isinstance(report, dict) else report_dict(report)
    if not has_latency(d):
        return None
    table = Table(title=latency_title(d), title_justify="left", caption=LATENCY_NOTE)
    for i, h in enumerate([level_header(d), *LATENCY_HEADERS[1:]]):
        table.add_column(h, justify="left" if i == 1 else "right", style="bold" if i == 1 else None)
    level = None
    for row in latency_rows(d):
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


def provenance_line(d: dict[str, Any]) -> str | None:
    """report.json's provenance in one line: versions, commit, hardware, time, recipe hash."""
    p = d.get("provenance")
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
        parts.append(f"engine {engine['dtype']}, {engine['linear_kernel']} matmuls")
    return "; ".join(parts)


def load_phrase(d: dict[str, Any]) -> str:
    """How requests reached the engine: `concurrency 4`, or under --request-rate the rates and
    the cap on requests in flight."""
    rates = d.get("sweep", {}).get("request_rate")
    if not rates:
        return f"concurrency {d['concurrency']}"
    text = ", ".join(rate_text(r) for r in rates)
    return (
        f"requests arriving as a Poisson process at {text} req/s (seed {d['seed']}), "
        f"at most {d['concurrency']} in flight"
    )


def passes(d: dict[str, Any]) -> str:
    """How a report's throughput was taken, when more than one pass or engine per configuration."""
    n, r = d.get("repeats", 1), d.get("engine_rounds", 1)
    out = ""
    if n > 1:
        how = "methods interleaved round by round" if d["backend"] == "embedded" else "in each engine"
        out = f", {n} rounds over the prompts, {how}"
    if r > 1:
        out += f", {r} engine rounds per configuration (order reversed every other round)"
    return out


def markdown(report: BenchReport | dict[str, Any], image: str | None = "acceptance.png") -> str:
    d = report if isinstance(report, dict) else report_dict(report)
    lines = [f"# {_title(d)}", ""]
    lines += [
        f"- verifier: `{d['verifier']}`",
        f"- backend: {d['backend']} ({load_phrase(d)}{passes(d)})",
        f"- dataset: {d['dataset']}, {d['num_prompts']} prompts, seed {d['seed']}",
        f"- sampling: temperature {d['temperature']:g}, top_p {d['top_p']:g}, "
        f"max_new_tokens {d['max_new_tokens']}",
        f"- {TAU_HEADER} = 1 + accepted / drafts (bonus token included, as vLLM counts it); "
        "speedup = output tokens/s over no-spec",
        "- each figure: the median over rounds [95% interval: bootstrap over the (prompt, round) cells, "
        "paired with the reference for ratios]; a ranking below is written only where two intervals "
        "do not overlap, else the methods tie",
        '- "= plain": prompts whose greedy output ids equal no-spec\'s exactly (ids in outputs.jsonl)',
    ]
    provenance = provenance_line(d)
    if provenance:
        lines.append(f"- provenance: {provenance}")
    if d.get("divergence_summary"):
        lines.append(
            f"- divergences: {d['divergence_summary']} (first differing token, margins in report.json)"
        )
    lines += [""]
    lines += _md_table(_headers(d), _rows(d))
    ranking = ranking_lines(d)
    if ranking:
        lines += ["", *[f"- {line}" for line in ranking]]
    if has_latency(d):
        lines += ["", "## Latency", "", LATENCY_NOTE, ""]
        lines += _md_table([level_header(d), *LATENCY_HEADERS[1:]], latency_rows(d))
        if image:
            against = "request rate" if d.get("sweep", {}).get("request_rate") else "concurrency"
            lines += ["", f"![TTFT, TPOT and ITL against {against}](latency.png)"]
    for cat in d["categories"]:
        lines += ["", f"## {cat}", ""]
        rows = []
        for r in d["results"]:
            c = r.get("categories", {}).get(cat)
            if c is not None:
                rows.append(
                    [
                        r["name"],
                        str(c["num_prompts"]),
                        fmt(c["acceptance_length"]),
                        fmt(c["output_tokens_per_s"], 1),
                        fmt(c["speedup"], 2, "x"),
                    ]
                )
        lines += _md_table(["method", "prompts", TAU_HEADER, "output tok/s", "speedup"], rows)
    if shows_sweep(d):
        lines += [
            "",
            "## K sweep",
            "",
            f"The table above holds each method at its recommended K. {_SWEEP_NOTE}",
            "",
        ]
        lines += _md_table([level_header(d), *SWEEP_HEADERS[1:]], _sweep_rows(d))
        vllm = d["backend"] in VLLM_BACKENDS
        heading = "Recommended `--speculative-config`" if vllm else "Recommended K"
        lines += ["", f"### {heading} (measured on {engine_name(d['backend'])})", ""]
        for text, arg in recommendation_lines(d):
            lines.append(f"- {text}" + (f"\n\n  ```\n  {arg}\n  ```" if arg else ""))
        lines += [f"- skipped: {line}" for line in d["sweep"]["skipped"]]
        compared = adaptive_rows(d)
        if compared:
            lines += ["", "## Fixed K vs adaptive verification", "", ADAPTIVE_NOTE, ""]
            lines += _md_table(ADAPTIVE_HEADERS, compared)
        if image:
            lines += ["", "![output tokens/s and tau against K](sweep.png)"]
    if d["requirements"]:
        lines += ["", "## Requirements", ""]
        failed = {f.split(": ", 1)[0] for f in d["failures"]}
        for req in d["requirements"]:
            lines.append(f"- {'FAIL' if req in failed else 'ok'} `{req}`")
        lines += [f"  - {f}" for f in d["failures"]]
    if d["errors"]:
        lines += ["", "## Errors", ""]
        lines += [f"- {e.splitlines()[0]}" for e in d["errors"]]
    if d.get("warnings"):  # older reports have none
        lines += ["", "## Warnings", ""]
        lines += [f"- {w}" for w in d["warnings"]]
    if image:
        lines += ["", f"![acceptance per position and throughput]({image})"]
    return "\n".join(lines) + "\n"


def _md_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def plot(report: BenchReport | dict[str, Any], path: Path) -> Path:
    """acceptance.png: per-position acceptance curves (left), output tokens/s per method (right).

    Drawn on an Agg canvas directly, so no GUI backend and no global pyplot state.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    d = report if isinstance(report, dict) else report_dict(report)
    fig = Figure(figsize=(11, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    drawn = False
    for r in d["results"]:
        acc = r["per_position_acceptance"]
        if r["algo"] != PLAIN and acc:
            left.plot(
                range(1, len(acc) + 1),
                acc,
                marker="o",
                label=f"{r['name']} (tau {r['acceptance_length']:.2f})",
            )
            drawn = True
    left.set(
        xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05), title="per-position acceptance"
    )
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.grid(alpha=0.3)
    if drawn:
        left.legend(fontsize=8)
    names = [r["name"] for r in d["results"]]
    tps = [r["output_tokens_per_s"] for r in d["results"]]
    bars = right.bar(names, tps, color=["0.6" if r["algo"] == PLAIN else "C0" for r in d["results"]])
    for bar, r in zip(bars, d["results"], strict=True):
        if r["speedup"] is not None:
            right.annotate(
                f"{r['speedup']:.2f}x",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    right.set(ylabel="output tokens/s", title="throughput")
    right.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.suptitle(_title(d), fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_sweep(report: BenchReport | dict[str, Any], path: Path) -> Path:
    """sweep.png: output tokens/s (top) and tau (bottom) against K, one line per drafter and one
    column per concurrency level; no-spec is the dashed line, the recommended K a star."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    d = report if isinstance(report, dict) else report_dict(report)
    s = d["sweep"]
    order = {level_key(p): level_order(p) for p in s["points"]}
    levels = sorted(order, key=order.__getitem__) or [str(c) for c in s["concurrency"]]
    fig = Figure(figsize=(max(8.0, 1.5 + 4.5 * len(levels)), 7), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(levels), squeeze=False)
    series = list(
        dict.fromkeys(
            (p["name"], p.get("confidence_threshold"), bool(p.get("adaptive")))
            for p in s["points"]
            if p["algo"] != PLAIN
        )
    )
    for col, level in enumerate(levels):
        top, bottom = axes[0][col], axes[1][col]
        here = [p for p in s["points"] if level_key(p) == level]
        for p in here:
            if p["algo"] == PLAIN:
                top.axhline(p["output_tokens_per_s"], color="0.5", linestyle="--", label="no-spec")
        for i, (name, t, adaptive) in enumerate(series):
            key = (name, t, adaptive)
            mine = (
                p for p in here if (p["name"], p.get("confidence_threshold"), bool(p.get("adaptive"))) == key
            )
            pts = sorted(mine, key=lambda p: p["num_speculative_tokens"])
            if not pts:
                continue
            label = (name if t is None else f"{name} T={t:g}") + (" adaptive" if adaptive else "")
            ks = [p["num_speculative_tokens"] for p in pts]
            top.plot(ks, [p["output_tokens_per_s"] for p in pts], marker="o", color=f"C{i}", label=label)
            taus = [p["acceptance_length"] for p in pts]
            if None not in taus:
                bottom.plot(ks, taus, marker="o", color=f"C{i}", label=label)
            best = s["recommended"].get(name, {}).get(level)
            if best is not None and (best.get("confidence_threshold"), bool(best.get("adaptive"))) == (
                t,
                adaptive,
            ):
                top.plot(
                    best["num_speculative_tokens"], best["output_tokens_per_s"], "*", ms=15, color=f"C{i}"
                )
        top.set(title=level_phrase(level), ylabel="output tokens/s")
        taus = [
            p["acceptance_length"] for p in here if p["algo"] != PLAIN and p["acceptance_length"] is not None
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
    fig.suptitle(f"{_title(d)}\nK sweep: star = recommended K (highest output tokens/s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_latency(report: BenchReport | dict[str, Any], path: Path) -> Path:
    """latency.png: TTFT, TPOT and ITL (median solid, p99 dotted) against concurrency (or request
    rate), one line per configuration (method at K)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    d = report if isinstance(report, dict) else report_dict(report)
    if "sweep" in d:
        points = d["sweep"]["points"]
    else:
        points = [{**r, "concurrency": d["concurrency"]} for r in d["results"]]
    points = [p for p in points if p.get("median_ttft_ms") is not None]
    configs = list(dict.fromkeys((p["name"], p["num_speculative_tokens"]) for p in points))
    by_rate = any(p.get("request_rate") is not None for p in points)
    # concurrency on a log2 axis; request rates (inf among them) evenly spaced, in order
    ticks = sorted({level_order(p): level_cell(p) for p in points}.items())
    place = {key: key[0] if not by_rate else i for i, (key, _) in enumerate(ticks)}
    fig = Figure(figsize=(13, 4), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    titles = {"ttft": "time to first token", "tpot": "time per output token", "itl": "inter-token latency"}
    for ax, name in zip(axes, LATENCIES, strict=True):
        for i, (method, k) in enumerate(configs):
            mine = sorted(
                (p for p in points if (p["name"], p["num_speculative_tokens"]) == (method, k)),
                key=level_order,
            )
            xs = [place[level_order(p)] for p in mine]
            label = (
                method if k == 0 or len({c[1] for c in configs if c[0] == method}) == 1 else f"{method} K={k}"
            )
            ax.plot(xs, [p[f"median_{name}_ms"] for p in mine], marker="o", color=f"C{i}", label=label)
            ax.plot(xs, [p[f"p99_{name}_ms"] for p in mine], linestyle=":", color=f"C{i}")
        xlabel = "request rate (req/s)" if by_rate else "concurrency"
        ax.set(title=f"{titles[name]} (p50, p99 dotted)", xlabel=xlabel, ylabel="ms")
        if not by_rate:
            ax.set_xscale("log", base=2)
        ax.set_xticks([place[key] for key, _ in ticks], [label for _, label in ticks])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    if configs:
        axes[0].legend(fontsize=8)
    fig.suptitle(_title(d), fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return path


def write_report(report: BenchReport, out_dir: Path, figures: bool = True) -> dict[str, Path]:
    """Write report.json and outputs.jsonl (always) and report.md + acceptance.png, and sweep.png
    for a sweep (when `figures`: the intervals are bootstrapped then too, else left null)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    d = redact_tree(
        report_dict(report, intervals=figures)
    )  # a server URL's credentials stay out of the files
    paths = {"json": out_dir / "report.json", "outputs": out_dir / "outputs.jsonl"}
    write_atomic(paths["json"], json.dumps(d, indent=2) + "\n", durable=False)
    write_atomic(paths["outputs"], "".join(line + "\n" for line in outputs_lines(report)), durable=False)
    if figures:
        paths["md"] = out_dir / "report.md"
        write_atomic(paths["md"], markdown(d), durable=False)
        paths["png"] = plot(d, out_dir / "acceptance.png")
        if shows_sweep(d):
            paths["sweep_png"] = plot_sweep(d, out_dir / "sweep.png")
        if has_latency(d):
            paths["latency_png"] = plot_latency(d, out_dir / "latency.png")
    return paths
