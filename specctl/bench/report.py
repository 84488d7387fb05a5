"""The figures of a benchmark run and the ways they are shown: rich table, JSON, markdown, PNG.

Counters mean what vLLM's spec-decode metrics mean, whichever backend produced them:
tau (acceptance_length) = 1 + accepted / drafts (the bonus token counted, so plain decoding
is 1.0), per-position acceptance = accepted_at_position / drafts, and speedup = output
tokens/s over the plain-decoding run of the same report. Each method's generated token ids
are kept per prompt, so a greedy run also shows whether speculation reproduced plain
decoding token for token (outputs_match_plain), the losslessness check speedups rest on.

A sweep (`--sweep-k`, or several concurrency levels) measures every drafter at several K and
concurrency levels and recommends, per drafter and level, the K with the highest output
tokens/s; `results` then holds each method at its recommended K at the lowest level.
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

from specctl.durable import write_atomic
from specctl.errors import SpecctlError

PLAIN = "none"  # the `algo` of plain decoding, the denominator of every speedup


@dataclass(frozen=True)
class Method:
    """One configuration to benchmark: plain decoding, a drafter directory, or vLLM's ngram."""

    name: str  # unique in a report; what `--require NAME.field>=x` refers to
    algo: str  # speculators_model_type, "ngram", or "none"
    num_speculative_tokens: int = 0
    drafter: Path | None = None
    verifier: str | None = None  # the verifier the drafter records (speculators_config.verifier)


@dataclass
class Measurement:
    """What one method did on a group of prompts: output volume, time and acceptance counters."""

    num_prompts: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [K]
    # prompt index -> generated ids, the stop token included when one ended the answer, as every
    # backend counts it in output_tokens (the engine's tokens, vLLM's token_ids and usage)
    outputs: dict[int, list[int]] = field(default_factory=dict)
    # prompt index -> why its request failed (vLLM server: an HTTP error, a dropped connection);
    # num_prompts, output_tokens and outputs cover the answered prompts only
    failed: dict[int, str] = field(default_factory=dict)
    # vLLM's generation-token counter over the same requests (None where nothing counts them):
    # equal to output_tokens when the server generated exactly what the answers returned
    server_generation_tokens: int | None = None

    def __add__(self, other: Measurement) -> Measurement:
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        a = self.accepted_per_position + [0] * (width - len(self.accepted_per_position))
        b = other.accepted_per_position + [0] * (width - len(other.accepted_per_position))
        return Measurement(
            self.num_prompts + other.num_prompts,
            self.output_tokens + other.output_tokens,
            self.wall_s + other.wall_s,
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            [x + y for x, y in zip(a, b, strict=True)],
            {**self.outputs, **other.outputs},
            {**self.failed, **other.failed},
            _add_counts(self.server_generation_tokens, other.server_generation_tokens),
        )

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_position]

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


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


@dataclass
class SweepPoint:
    """One measured configuration of a sweep: a method at one K, at one concurrency level."""

    concurrency: int
    result: MethodResult


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
    results: list[MethodResult] = field(default_factory=list)
    baseline: str | None = None  # name of the EAGLE-3 reference method, if any
    complete: bool = False
    requirements: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # requirements that fell short, one line each
    errors: list[str] = field(default_factory=list)  # methods that could not be measured, one line each
    output_dir: Path | None = None
    # every (method, K, concurrency) a sweep measured, in order; None = not a sweep
    sweep: list[SweepPoint] | None = None
    sweep_levels: list[int] = field(default_factory=list)  # the concurrency levels swept, ascending
    sweep_skipped: list[str] = field(default_factory=list)  # requested K a drafter cannot draft

    @property
    def ok(self) -> bool:
        """Every method measured and every requirement met: the command exits 0."""
        return self.complete and not self.errors and not self.failures

    def to_dict(self) -> dict[str, Any]:
        return report_dict(self)


# ---------------------------------------------------------------- figures


def _ratio(a: float, b: float | None) -> float | None:
    return a / b if b else None


def measurement_dict(m: Measurement, plain: Measurement | None, base: Measurement | None) -> dict[str, Any]:
    tps = m.output_tokens_per_s
    return {
        "acceptance_length": m.acceptance_length,
        "per_position_acceptance": m.per_position_acceptance,
        "num_drafts": m.num_drafts,
        "num_draft_tokens": m.num_draft_tokens,
        "num_accepted_tokens": m.num_accepted_tokens,
        "num_prompts": m.num_prompts,
        "output_tokens": m.output_tokens,
        "wall_s": m.wall_s,
        "output_tokens_per_s": tps,
        "speedup": _ratio(tps, plain.output_tokens_per_s if plain else None),
        "ratio_vs_baseline": _ratio(tps, base.output_tokens_per_s if base else None),
        "acceptance_ratio_vs_baseline": _ratio(m.acceptance_length, base.acceptance_length if base else None),
        "server_generation_tokens": m.server_generation_tokens,
        "num_failed": len(m.failed),
        "failed_requests": {str(i): why for i, why in sorted(m.failed.items())},
    }


def outputs_match(outputs: dict[int, list[int]], plain: dict[int, list[int]]) -> tuple[int, int]:
    """(prompts whose ids equal plain decoding's exactly, prompts both have ids for).

    Only prompts present on both sides count, so an answer without ids (a server that did not
    return them) leaves the comparison instead of counting as a mismatch.
    """
    shared = outputs.keys() & plain.keys()
    return sum(outputs[i] == plain[i] for i in shared), len(shared)


def report_dict(report: BenchReport) -> dict[str, Any]:
    """report.json: settings, then one entry per method (speedups vs the no-spec entry).

    outputs_match_plain is the fraction of prompts decoded exactly as plain decoding did; only
    greedy runs (temperature 0) are comparable, sampling draws differ by design, so it is None
    there and wherever no ids were recorded. outputs_compared says out of how many prompts.
    """
    plain = next((r for r in report.results if r.method.algo == PLAIN), None)
    base = next((r for r in report.results if r.method.name == report.baseline), None)
    categories = sorted({c for r in report.results for c in r.categories if c})
    plain_outputs = plain.total.outputs if plain is not None and report.temperature == 0 else {}
    results = []
    for r in report.results:
        total = r.total
        same, compared = outputs_match(total.outputs, plain_outputs)
        entry: dict[str, Any] = {
            **_method_dict(r.method),
            **measurement_dict(total, plain.total if plain else None, base.total if base else None),
            "outputs_match_plain": same / compared if compared else None,
            "outputs_compared": compared,
        }
        if categories:
            entry["categories"] = {
                c: measurement_dict(
                    m,
                    plain.categories.get(c) if plain else None,
                    base.categories.get(c) if base else None,
                )
                for c, m in sorted(r.categories.items())
            }
        results.append(entry)
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
        "complete": report.complete,
        "baseline": report.baseline,
        "categories": categories,
        "results": results,
        "requirements": list(report.requirements),
        "failures": list(report.failures),
        "errors": list(report.errors),
    }
    if report.sweep is not None:
        out["sweep"] = sweep_dict(report)
    return out


def _method_dict(method: Method) -> dict[str, Any]:
    return {
        "name": method.name,
        "algo": method.algo,
        "num_speculative_tokens": method.num_speculative_tokens,
        "drafter": str(method.drafter) if method.drafter else None,
    }


# ---------------------------------------------------------------- the K sweep


def recommend_k(points: Iterable[tuple[int, float]]) -> int:
    """The K of the (K, output tokens/s) point with the highest tokens/s.

    A tie goes to the smaller K: the same speed for less drafting work and fewer speculative
    KV-cache slots per request, which leaves more room for other requests.
    """
    measured = list(points)
    if not measured:
        raise ValueError("no measured K to recommend from")
    return min(measured, key=lambda p: (-p[1], p[0]))[0]


def best_results(points: Sequence[SweepPoint], concurrency: int) -> list[MethodResult]:
    """Each method, in the order first measured, at its recommended K at `concurrency`: the
    `results` of a sweep, so the summary table, speedups and --require read the right K."""
    by_name: dict[str, list[MethodResult]] = {}
    for p in points:
        if p.concurrency == concurrency:
            by_name.setdefault(p.result.method.name, []).append(p.result)
    best = []
    for results in by_name.values():
        k = recommend_k((r.method.num_speculative_tokens, r.total.output_tokens_per_s) for r in results)
        best.append(next(r for r in results if r.method.num_speculative_tokens == k))
    return best


def recommendations(points: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """method name -> concurrency level (a string: JSON keys are) -> the recommended K with its
    figures and the vLLM `--speculative-config` that serves it. Plain decoding has none."""
    from specctl.bench.vllm import speculative_config  # imported here: vllm.py imports this module

    grouped: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for p in points:
        if p["algo"] != PLAIN:
            grouped.setdefault((p["name"], p["concurrency"]), []).append(p)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (name, level), group in grouped.items():
        k = recommend_k((p["num_speculative_tokens"], p["output_tokens_per_s"]) for p in group)
        best = next(p for p in group if p["num_speculative_tokens"] == k)
        method = Method(name, best["algo"], k, Path(best["drafter"]) if best["drafter"] else None)
        try:
            spec = speculative_config(method)
        except SpecctlError:  # an algorithm vLLM has no method for (measured on the embedded engine)
            spec = None
        out.setdefault(name, {})[str(level)] = {
            "num_speculative_tokens": k,
            "acceptance_length": best["acceptance_length"],
            "output_tokens_per_s": best["output_tokens_per_s"],
            "speedup": best["speedup"],
            "speculative_config": spec,
        }
    return out


def sweep_dict(report: BenchReport) -> dict[str, Any]:
    """report.json's `sweep`: every measured point, with its speedup and output comparison
    against no-spec at the same concurrency (batching changes both), and the recommendations."""
    plain = {p.concurrency: p.result.total for p in report.sweep or [] if p.result.method.algo == PLAIN}
    points = []
    for p in report.sweep or []:
        total, ref = p.result.total, plain.get(p.concurrency)
        ref_outputs = ref.outputs if ref is not None and report.temperature == 0 else {}
        same, compared = outputs_match(total.outputs, ref_outputs)
        figures = measurement_dict(total, ref, None)
        points.append(
            {
                **_method_dict(p.result.method),
                "concurrency": p.concurrency,
                **{k: v for k, v in figures.items() if "baseline" not in k},
                "outputs_match_plain": same / compared if compared else None,
                "outputs_compared": compared,
            }
        )
    return {
        "concurrency": list(report.sweep_levels),
        "points": points,
        "recommended": recommendations(points),
        "skipped": list(report.sweep_skipped),
    }


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
)


class RequirementError(SpecctlError):
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
    """`METHOD[.CATEGORY].FIELD OP NUMBER`, e.g. `dflash.acceptance_length>=2.5`."""
    m = _REQUIREMENT.match(text)
    example = "e.g. dflash.acceptance_length>=2.5 or dflash.code.speedup>1.2"
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
            why = "no no-spec run" if req.field == "speedup" else "no baseline run"
            failures.append(f"{req.text}: {req.method}.{req.field} was not measured ({why})")
        elif not _OPS[req.op](got, req.value):
            failures.append(f"{req.text}: got {_fmt(got)}")
    return failures


# ---------------------------------------------------------------- rendering


def _fmt(x: float | None, digits: int = 2, suffix: str = "") -> str:
    return "-" if x is None else f"{x:,.{digits}f}{suffix}"


def _rows(d: dict[str, Any]) -> list[list[str]]:
    base_algo = next((r["algo"] for r in d["results"] if r["name"] == d["baseline"]), None)
    rows = []
    for r in d["results"]:
        spec = r["algo"] != PLAIN
        rows.append(
            [
                r["name"],
                str(r["num_speculative_tokens"]) if spec else "-",
                _fmt(r["acceptance_length"]),
                " ".join(f"{a:.2f}" for a in r["per_position_acceptance"]) if spec else "-",
                _fmt(r["output_tokens_per_s"], 1),
                _fmt(r["speedup"], 2, "x"),
                _fmt(r["ratio_vs_baseline"], 2, "x") if base_algo else "-",
                _fmt(r["acceptance_ratio_vs_baseline"], 2, "x") if base_algo else "-",
                _match(r),
            ]
        )
    return rows


def _match(r: dict[str, Any]) -> str:
    """The "= plain" cell: prompts decoded exactly as plain decoding / prompts compared, e.g. 7/8;
    "-" when not comparable (sampling, no no-spec run, no ids)."""
    frac, n = r.get("outputs_match_plain"), r.get("outputs_compared") or 0
    return "-" if frac is None or not n else f"{round(frac * n)}/{n}"


def _headers(d: dict[str, Any]) -> list[str]:
    base = d["baseline"] or "EAGLE-3"
    return [
        "method",
        "K",
        "tau",
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
    """The summary table the CLI prints."""
    from rich.table import Table

    d = report if isinstance(report, dict) else report_dict(report)
    table = Table(title=_title(d), title_justify="left", caption=_sweep_caption(d), caption_justify="left")
    for i, h in enumerate(_headers(d)):
        table.add_column(h, justify="left" if i in (0, 3) else "right", style="bold" if i == 0 else None)
    for row in _rows(d):
        table.add_row(*row)
    return table


def _sweep_caption(d: dict[str, Any]) -> str | None:
    if "sweep" not in d:
        return None
    return f"K sweep: each method at its recommended K, concurrency {d['concurrency']}; every point below"


def _sweep_rows(d: dict[str, Any]) -> list[list[str]]:
    """One row per sweep point, grouped by concurrency level (the points are in the order
    measured: K by K, each at every level); the last cell marks the recommended K."""
    recommended = d["sweep"]["recommended"]
    rows = []
    for p in sorted(d["sweep"]["points"], key=lambda p: p["concurrency"]):
        spec = p["algo"] != PLAIN
        best = recommended.get(p["name"], {}).get(str(p["concurrency"]), {})
        rows.append(
            [
                str(p["concurrency"]),
                p["name"],
                str(p["num_speculative_tokens"]) if spec else "-",
                _fmt(p["acceptance_length"]),
                " ".join(f"{a:.2f}" for a in p["per_position_acceptance"]) if spec else "-",
                _fmt(p["output_tokens_per_s"], 1),
                _fmt(p["speedup"], 2, "x"),
                _match(p),
                "*" if best.get("num_speculative_tokens") == p["num_speculative_tokens"] else "",
            ]
        )
    return rows


SWEEP_HEADERS = [
    "concurrency",
    "method",
    "K",
    "tau",
    "acceptance per position",
    "output tok/s",
    "speedup",
    "= plain",
    "best",
]
_SWEEP_NOTE = (
    "Best = the highest output tokens/s at that concurrency; a tie goes to the smaller K. Speedups "
    "are against no-spec at the same concurrency."
)


def recommendation_lines(d: dict[str, Any]) -> list[tuple[str, str | None]]:
    """(what was recommended and why, the --speculative-config argument) per drafter and level."""
    lines = []
    for name, levels in d["sweep"]["recommended"].items():
        for level, r in levels.items():
            slower = r["speedup"] is not None and r["speedup"] < 1
            note = "; slower than no-spec, serve without speculation" if slower else ""
            text = (
                f"concurrency {level}, {name}: K={r['num_speculative_tokens']} "
                f"({_fmt(r['output_tokens_per_s'], 1)} tok/s, {_fmt(r['speedup'], 2, 'x')} no-spec, "
                f"tau {_fmt(r['acceptance_length'])}{note})"
            )
            spec = r["speculative_config"]
            lines.append((text, f"--speculative-config '{json.dumps(spec)}'" if spec else None))
    return lines


def rich_sweep(report: BenchReport | dict[str, Any]):
    """The sweep table and the recommended --speculative-config per drafter and level (None
    when the report is not a sweep), printed by the CLI under the summary table."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    d = report if isinstance(report, dict) else report_dict(report)
    if "sweep" not in d:
        return None
    table = Table(
        title="K sweep (best = highest output tok/s; a tie goes to the smaller K)", title_justify="left"
    )
    for i, h in enumerate(SWEEP_HEADERS):
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
    return Group(*parts)


def markdown(report: BenchReport | dict[str, Any], image: str | None = "acceptance.png") -> str:
    d = report if isinstance(report, dict) else report_dict(report)
    lines = [f"# {_title(d)}", ""]
    lines += [
        f"- verifier: `{d['verifier']}`",
        f"- backend: {d['backend']} (concurrency {d['concurrency']})",
        f"- dataset: {d['dataset']}, {d['num_prompts']} prompts, seed {d['seed']}",
        f"- sampling: temperature {d['temperature']:g}, top_p {d['top_p']:g}, "
        f"max_new_tokens {d['max_new_tokens']}",
        "- tau = 1 + accepted / drafts (bonus token included); speedup = output tokens/s over no-spec",
        '- "= plain": prompts whose greedy output ids equal no-spec\'s exactly (ids in outputs.jsonl)',
        "",
    ]
    lines += _md_table(_headers(d), _rows(d))
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
                        _fmt(c["acceptance_length"]),
                        _fmt(c["output_tokens_per_s"], 1),
                        _fmt(c["speedup"], 2, "x"),
                    ]
                )
        lines += _md_table(["method", "prompts", "tau", "output tok/s", "speedup"], rows)
    if "sweep" in d:
        lines += [
            "",
            "## K sweep",
            "",
            f"The table above holds each method at its recommended K. {_SWEEP_NOTE}",
            "",
        ]
        lines += _md_table(SWEEP_HEADERS, _sweep_rows(d))
        lines += ["", "### Recommended `--speculative-config`", ""]
        for text, arg in recommendation_lines(d):
            lines.append(f"- {text}" + (f"\n\n  ```\n  {arg}\n  ```" if arg else ""))
        lines += [f"- skipped: {line}" for line in d["sweep"]["skipped"]]
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
    levels = s["concurrency"] or sorted({p["concurrency"] for p in s["points"]})
    fig = Figure(figsize=(max(8.0, 1.5 + 4.5 * len(levels)), 7), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(levels), squeeze=False)
    names = list(dict.fromkeys(p["name"] for p in s["points"] if p["algo"] != PLAIN))
    for col, level in enumerate(levels):
        top, bottom = axes[0][col], axes[1][col]
        here = [p for p in s["points"] if p["concurrency"] == level]
        for p in here:
            if p["algo"] == PLAIN:
                top.axhline(p["output_tokens_per_s"], color="0.5", linestyle="--", label="no-spec")
        for i, name in enumerate(names):
            pts = sorted((p for p in here if p["name"] == name), key=lambda p: p["num_speculative_tokens"])
            if not pts:
                continue
            ks = [p["num_speculative_tokens"] for p in pts]
            top.plot(ks, [p["output_tokens_per_s"] for p in pts], marker="o", color=f"C{i}", label=name)
            bottom.plot(ks, [p["acceptance_length"] for p in pts], marker="o", color=f"C{i}", label=name)
            best = s["recommended"].get(name, {}).get(str(level))
            if best is not None:
                top.plot(
                    best["num_speculative_tokens"], best["output_tokens_per_s"], "*", ms=15, color=f"C{i}"
                )
        top.set(title=f"concurrency {level}", ylabel="output tokens/s")
        taus = [p["acceptance_length"] for p in here if p["algo"] != PLAIN]
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
            }
            for index, ids in sorted(p.result.total.outputs.items()):
                lines.append(json.dumps({**head, "prompt_index": index, "token_ids": ids}))
        return lines
    for r in report.results:
        for index, ids in sorted(r.total.outputs.items()):
            lines.append(json.dumps({"method": r.method.name, "prompt_index": index, "token_ids": ids}))
    return lines


def write_report(report: BenchReport, out_dir: Path, figures: bool = True) -> dict[str, Path]:
    """Write report.json and outputs.jsonl (always) and report.md + acceptance.png, and sweep.png
    for a sweep (when `figures`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    d = report_dict(report)
    paths = {"json": out_dir / "report.json", "outputs": out_dir / "outputs.jsonl"}
    write_atomic(paths["json"], json.dumps(d, indent=2) + "\n", durable=False)
    write_atomic(paths["outputs"], "".join(line + "\n" for line in outputs_lines(report)), durable=False)
    if figures:
        paths["md"] = out_dir / "report.md"
        write_atomic(paths["md"], markdown(d), durable=False)
        paths["png"] = plot(d, out_dir / "acceptance.png")
        if "sweep" in d:
            paths["sweep_png"] = plot_sweep(d, out_dir / "sweep.png")
    return paths
