"""The `specctl` command line: parse, call the library, print. No pipeline logic lives here."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

import specctl
from specctl import interrupts
from specctl.cli_schema import SectionOptionsCommand, with_section_options
from specctl.console import make_console

app = typer.Typer(
    name="specctl",
    help="Train, export and benchmark parallel drafters (P-EAGLE, DFlash, DSpark) for speculative "
    "decoding in vLLM.\n\nExample: specctl collect-hidden-states recipes/quickstart.yaml",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
out = make_console()
err = make_console(stderr=True)


def Flag(*names: str, help: str) -> typer.models.OptionInfo:
    """A boolean flag: shown without a value in --help (typer would print `<bool>`)."""
    return typer.Option(*names, help=help, metavar="")


ALGO_HELP = "A registered algorithm: {algos} (default: the recipe's drafter.algo)."


class AlgoHelpCommand(typer.core.TyperCommand):
    """A command whose --help lists the registered algorithms. They are known only once the
    drafters are imported (torch: ~2.4 s), so the list is filled in when help is shown rather
    than on every start of the CLI."""

    def format_help(self, ctx, formatter) -> None:
        from specctl.drafters import DRAFTERS

        for param in self.params:
            if param.name == "algo":
                param.help = ALGO_HELP.format(algos=", ".join(DRAFTERS))
        super().format_help(ctx, formatter)


RecipeArg = Annotated[
    str, typer.Argument(help="Recipe YAML file, or a built-in recipe name such as 'quickstart'.")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a recipe field, e.g. --set train.lr=3e-4 (repeatable)."),
]


def _version(value: bool) -> None:
    if value:
        out.print(f"specctl {specctl.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Show the version and exit.", metavar=""
        ),
    ] = False,
) -> None:
    """specctl: the toolchain that gives a served LLM a parallel drafter."""


def _summary(title: str, rows: list[tuple[str, str]]) -> None:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for k, v in rows:
        table.add_row(k, v)
    out.print(table)


@app.command("collect-hidden-states")
def collect_hidden_states(
    recipe: RecipeArg,
    set_: SetOpt = None,
    max_samples: Annotated[int | None, typer.Option(help="Use at most N conversations.")] = None,
    shard: Annotated[
        str | None,
        typer.Option(
            help="Compute part I of N only (I/N), e.g. one per machine; default: the whole store "
            "(under torchrun: each rank its part first, then whatever no live rank holds)."
        ),
    ] = None,
    backend: Annotated[
        str | None, typer.Option(help="hf or vllm (default: the recipe's features.backend).")
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Start even if the estimate says the features will not fit on the disk, or the plan "
            "that the verifier forward will not fit this machine's memory.",
        ),
    ] = False,
) -> None:
    """Run the verifier over the recipe's conversations and keep the hidden states drafters learn from.

    Prints the plan first (conversations to generate, the feature store's size against the free
    disk) and refuses a store that will not fit unless --force. Resumable: rerun the same command
    after an interruption and it keeps the finished conversations and shards.

    Example: specctl collect-hidden-states recipes/quickstart.yaml --set data.max_samples=16
    """
    from specctl.collect import collect
    from specctl.recipe import load_recipe

    overrides = list(set_ or [])
    if max_samples is not None:
        overrides.append(f"data.max_samples={max_samples}")
    if backend is not None:
        overrides.append(f"features.backend={backend}")
    r = load_recipe(recipe, overrides)
    s = collect(r, shard=shard, force=force)
    _summary(
        "collect-hidden-states",
        [
            ("features", str(s.features_dir)),
            ("samples", f"{s.num_samples:,}"),
            ("shards written / already done", f"{s.shards_written} / {s.shards_skipped}"),
            ("tokens this run", f"{s.num_tokens:,} ({s.tokens_per_s:,.0f} tok/s)"),
            ("bytes per token", f"{s.bytes_per_token:,.0f}" if s.bytes_per_token else "-"),
            ("verifier device", s.device),
            ("store", "complete" if s.complete else "waiting for the other --shard parts"),
        ],
    )


@app.command(cls=AlgoHelpCommand)
def train(
    recipe: RecipeArg,
    algo: Annotated[str | None, typer.Option(help=ALGO_HELP.format(algos="..."))] = None,
    set_: SetOpt = None,
    resume: Annotated[
        bool,
        Flag(
            "--resume",
            help="Continue from the latest checkpoint even with changed training settings (a rerun of "
            "the same command continues by itself).",
        ),
    ] = False,
    restart: Annotated[
        bool, Flag("--restart", help="Start over: first remove this drafter's checkpoints and metrics.")
    ] = False,
    force: Annotated[
        bool, Flag("--force", help="Start even if `specctl plan` says the step will not fit this machine.")
    ] = False,
    lr: Annotated[float | None, typer.Option("--lr", help="Same as --set train.lr=LR.")] = None,
    max_steps: Annotated[
        int | None, typer.Option("--max-steps", help="Same as --set train.max_steps=N.")
    ] = None,
    epochs: Annotated[
        float | None,
        typer.Option(
            "--epochs",
            help="Train N passes over the feature store: sets train.max_steps from its samples, "
            "train.batch_tokens and grad_accum (printed).",
        ),
    ] = None,
) -> None:
    """Train a drafter on the recipe's feature store (or online, with train.mode=online).

    Rerunning the same command (a requeued job) continues from the latest checkpoint; with other
    training settings it refuses, naming them (--resume continues anyway, --restart starts over).
    Under torchrun every rank trains its share of each batch (DDP); rank 0 writes checkpoints.

    Example: specctl train recipes/quickstart.yaml --algo dflash --max-steps 200 --lr 3e-4

    Example: specctl train recipes/quickstart.yaml --epochs 2
    """
    from specctl.train import run_training

    overrides = list(set_ or [])
    if algo is not None:
        overrides.append(f"drafter.algo={algo}")
    s = run_training(
        _train_recipe(recipe, overrides, lr, max_steps, epochs), resume=resume, force=force, restart=restart
    )
    if s is None:  # non-zero ranks under torchrun print nothing
        return
    acc = s.val_acc_per_position
    _summary(
        f"train {s.algo}",
        [
            ("steps", str(s.steps)),
            ("train loss", f"{s.loss:.4f}" if s.loss is not None else "-"),
            ("val loss", f"{s.val_loss:.4f}" if s.val_loss is not None else "-"),
            ("tau_hat (estimated acceptance length)", f"{s.tau_hat:.3f}" if s.tau_hat is not None else "-"),
            ("val acc per position", " ".join(f"{a:.2f}" for a in acc) if acc else "-"),
            ("checkpoint", str(s.checkpoint) if s.checkpoint else "-"),
            ("metrics", str(s.output_dir / "metrics.jsonl")),
        ],
    )


def _train_recipe(
    recipe: str, overrides: list[str], lr: float | None, steps: int | None, epochs: float | None
):
    """The recipe train runs, with --lr / --max-steps / --epochs applied as the --set overrides they
    stand for (validated by the schema like any --set). An alias the recipe's train.per_algo entry
    would override is refused: the flag would otherwise do nothing."""
    from specctl.errors import UsageError
    from specctl.recipe import load_recipe

    if steps is not None and epochs is not None:
        raise UsageError("--max-steps and --epochs both set the number of steps; pass one")
    aliases = {"lr": lr, "max_steps": steps}
    overrides = overrides + [f"train.{k}={v!r}" for k, v in aliases.items() if v is not None]
    loaded = load_recipe(recipe, overrides)
    if epochs is not None:
        from specctl.train.epochs import epoch_steps

        converted = epoch_steps(loaded, epochs)
        err.print(converted.line(), highlight=False, soft_wrap=True)
        aliases["max_steps"] = converted.max_steps
        loaded = load_recipe(recipe, [*overrides, f"train.max_steps={converted.max_steps}"])
    trained = loaded.for_training().train
    for name, value in aliases.items():
        if value is not None and getattr(trained, name) != value:
            algo = loaded.drafter.algo
            raise UsageError(
                f"--{name.replace('_', '-')} {value}: train.per_algo.{algo}.{name} "
                f"({getattr(trained, name)}) "
                f"overrides it in this recipe; pass --set train.per_algo.{algo}.{name}=..."
            )
    return loaded


@app.command()
def export(
    source: Annotated[
        Path,
        typer.Argument(
            help="runs/<name>, runs/<name>/drafters/<algo>, a checkpoint, or an export directory "
            "(validated; --dtype / --output re-export it)."
        ),
    ],
    output: Annotated[
        Path | None, typer.Option(help="Output directory (default: <algo dir>/export).")
    ] = None,
    dtype: Annotated[
        str | None, typer.Option(help="bf16 | fp16 | fp32 (default: the recipe's export.dtype).")
    ] = None,
    check: Annotated[bool, Flag("--check", help="Validate with vLLM's own config parser too.")] = False,
    push_to_hub: Annotated[
        str | None,
        typer.Option(help="Upload the export to this hub repo (user/name), with a model card (README.md)."),
    ] = None,
    dry_run: Annotated[
        bool,
        Flag(
            "--dry-run", help="With --push-to-hub: list the files and print the model card, upload nothing."
        ),
    ] = False,
    private: Annotated[bool, Flag("--private", help="With --push-to-hub: create a private repo.")] = False,
) -> None:
    """Write the speculators checkpoint format vLLM loads (config.json + model.safetensors), with a
    model card (README.md) and the verifier's tokenizer files.

    Example: specctl export runs/quickstart --check

    Example: specctl export runs/quickstart/drafters/dflash/export --dtype fp16 --output dflash-fp16
    """
    from specctl.errors import SpecctlError, UsageError
    from specctl.export import convert_export, export_drafters, names_export
    from specctl.export.hub import check_repo_id
    from specctl.export.hub import push_to_hub as push
    from specctl.vllm.check import check_export

    if push_to_hub:
        check_repo_id(push_to_hub)  # before any work
    elif dry_run or private:
        raise UsageError("--dry-run and --private go with --push-to-hub REPO")
    if names_export(source) and (dtype is not None or output is not None):
        r = convert_export(source, output, dtype, check_vllm=check)
        _summary(f"re-export {r.algo}", r.rows())
        dirs, checks = [r.output], [r.check]
    elif names_export(source):
        checks = [check_export(source, use_vllm=check)]
        _summary("export check", checks[0].rows())
        dirs = [source]
    else:
        results = export_drafters(source, output, dtype, check_vllm=check)
        for r in results:
            _summary(f"export {r.algo}", r.rows())
        dirs, checks = [r.output for r in results], [r.check for r in results]
    for c in checks:  # written, but the vLLM installed here cannot serve it
        if c.unserved is not None:
            err.print(f"[yellow]warning:[/yellow] {c.unserved}", highlight=False, soft_wrap=True)
    if push_to_hub:
        if len(dirs) != 1:
            raise SpecctlError("--push-to-hub uploads one drafter: pass runs/<name>/drafters/<algo>")
        pushed = push(dirs[0], push_to_hub, dry_run=dry_run, private=private)
        _summary("push-to-hub", pushed.rows())
        if dry_run:  # the card is what a reader of the hub page sees first: show it before uploading
            typer.echo(f"--- {pushed.path / 'README.md'} as uploaded ---")
            typer.echo(pushed.card, nl=not pushed.card.endswith("\n"))


BaseUrlOpt = Annotated[
    str | None,
    typer.Option(
        "--base-url",
        metavar="URL",
        help="Bench an OpenAI-compatible server that is already running, e.g. http://127.0.0.1:8000 "
        "(nothing is started; acceptance from /metrics when it is vLLM). OPENAI_API_KEY is sent if set, "
        "to loopback or https only unless bench.allow_key_over_http.",
    ),
]
SweepKOpt = Annotated[
    str | None,
    typer.Option(
        "--sweep-k",
        metavar="all|K,...",
        help="Measure each drafter at several K and recommend the fastest: 'all' (every K it can "
        "draft) or a list such as 1,2,4,7 or 1-4.",
    ),
]


BaselineOpt = Annotated[
    Path | None, typer.Option(help="An EAGLE-3 drafter directory: the reference of 'vs EAGLE-3'.")
]
DrafterOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--drafter",
        help="A speculators-format drafter directory (repeatable); DIR@K or DIR@K,T runs it at K "
        "(and confidence threshold T) instead of its exported K.",
    ),
]


def _bench_recipe(recipe: str | None, set_: list[str] | None, *, base_url: str | None, drafters: bool):
    """The recipe bench reads, or None: `--set` alone means the quickstart's, but only where the
    overrides have something to apply to (not a --base-url or --drafter-only run)."""
    from specctl.errors import RecipeError
    from specctl.recipe import load_recipe

    if recipe is not None:
        return load_recipe(recipe, list(set_ or []))
    if not set_:
        return None
    if base_url is not None:
        raise RecipeError("--set needs a RECIPE with --base-url; pass the bench flags themselves")
    if drafters:
        raise RecipeError("--set needs a RECIPE when benchmarking --drafter directories")
    return load_recipe("quickstart", list(set_))


ConcurrencyOpt = Annotated[
    str | None,
    typer.Option(
        metavar="N,...",
        help="Requests in flight (vLLM backends); a list such as 1,4,16 measures each (vllm): "
        "bench.concurrency, one level per value.",
    ),
]
RequireOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--require",
        help="Fail unless a figure holds, e.g. 'dflash.acceptance_length>=2.5'; 'lossless': every "
        "divergence from plain decoding is a near-tie (repeatable; added to bench.require).",
    ),
]


def _bench_section():
    """The recipe's bench section, which bench's options are generated from: imported when they
    are needed (the schema imports the drafters, and with them torch)."""
    from specctl.recipe import BenchSection

    return BenchSection


@app.command(cls=SectionOptionsCommand)
@with_section_options(_bench_section)
def bench(
    recipe: Annotated[
        str | None, typer.Argument(help="Recipe YAML or built-in name (default: quickstart).")
    ] = None,
    drafter: DrafterOpt = None,
    baseline: BaselineOpt = None,
    base_url: BaseUrlOpt = None,
    concurrency: ConcurrencyOpt = None,
    verifier: Annotated[
        str | None, typer.Option(help="Verifier instead of the recipe's / the drafters' own.")
    ] = None,
    output: Annotated[
        Path | None, typer.Option(help="Output directory (default: runs/<name>/bench).")
    ] = None,
    require: RequireOpt = None,
    ngram: Annotated[
        int | None, typer.Option(help="Also run vLLM's n-gram speculation with K tokens (vLLM backends).")
    ] = None,
    sweep_k: SweepKOpt = None,
    vllm_arg: Annotated[
        list[str] | None,
        typer.Option("--vllm-arg", help="Extra vLLM engine option, e.g. --vllm-arg=--max-num-seqs=8."),
    ] = None,
    json_: Annotated[bool, Flag("--json", help="Print report.json to stdout.")] = False,
    set_: SetOpt = None,
    **settings: object,  # one option per field of the recipe's bench section (specctl.cli_schema)
) -> None:
    """Benchmark drafters against plain decoding and EAGLE-3: acceptance length and throughput.

    The options below --set are the recipe's bench settings (docs/recipe.md), over the recipe's.

    Example: specctl bench recipes/quickstart.yaml --backend vllm --require 'dflash.acceptance_length>=2'

    Example: specctl bench RECIPE --backend vllm --sweep-k all --concurrency 1,4,16

    Example: specctl bench --base-url http://127.0.0.1:8000 --concurrency 1,4,16

    Example: specctl bench --backend vllm --ngram 3 --request-rate 1,4,inf --num-prompts 8
    """
    from specctl.bench.plan import parse_int_list, parse_sweep_k
    from specctl.bench.run import default_recipe, run_bench
    from specctl.bench.settings import settings_from_flags
    from specctl.cli_schema import given_settings

    section = _bench_section()
    drafters = drafter or []
    loaded = _bench_recipe(recipe, set_, base_url=base_url, drafters=bool(drafters or baseline))
    loaded = default_recipe(loaded, drafters, baseline, base_url)
    given = {**given_settings(section, settings), "base_url": base_url}
    report = run_bench(
        loaded,
        settings_from_flags(loaded.bench if loaded is not None else section(), given),
        drafters=drafters,
        baseline=baseline,
        verifier=verifier,
        output=output,
        requires=require or [],
        concurrency=parse_int_list(concurrency, "--concurrency") if concurrency is not None else None,
        ngram=ngram,
        sweep_k=parse_sweep_k(sweep_k) if sweep_k is not None else False,
        vllm_args=vllm_arg or [],
    )
    _print_bench(report, json_)
    if not report.ok:
        raise typer.Exit(1)


@app.command(cls=AlgoHelpCommand)
def plan(
    recipe: RecipeArg,
    set_: SetOpt = None,
    algo: Annotated[str | None, typer.Option(help=ALGO_HELP.format(algos="..."))] = None,
    gpus: Annotated[int, typer.Option(min=1, help="GPUs per node (torchrun --nproc-per-node).")] = 8,
    gpu_memory: Annotated[float, typer.Option(min=0.1, help="Memory of one GPU, GiB.")] = 80.0,
    nodes: Annotated[int, typer.Option(min=1, help="Nodes.")] = 1,
    disk: Annotated[float | None, typer.Option(min=0, help="Free disk for the run directory, TB.")] = None,
    tflops: Annotated[
        float, typer.Option(min=0.1, help="Dense bf16 TFLOP/s of one GPU (H100: 989).")
    ] = 989.0,
    mfu: Annotated[float, typer.Option(min=0.01, max=1.0, help="Share of --tflops a step reaches.")] = 0.35,
    as_json: Annotated[bool, Flag("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Say before any work whether each stage fits and what it costs: peak memory per GPU (each term
    and how it was obtained), disk, tokens and time. Exit 1 with one line when a stage does not fit.

    Example: specctl plan recipes/dflash-llama.yaml --gpus 8 --gpu-memory 80
    """
    from specctl.recipe import load_recipe
    from specctl.resources import GIB, Cluster, plan_recipe, refusal

    loaded = load_recipe(recipe, list(set_ or []) + ([f"drafter.algo={algo}"] if algo else []))
    cluster = Cluster(
        "cuda", gpus, int(gpu_memory * GIB), nodes, None if disk is None else int(disk * 1e12), tflops, mfu
    )
    result = plan_recipe(loaded, cluster)
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2))
    else:
        _print_plan(result)
    reason = refusal(result)
    if reason is not None:
        err.print(f"[red]error:[/red] {reason}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def _print_plan(result) -> None:
    """The stages table, then each stage's terms and assumptions."""
    from specctl.estimate import human_count, si_bytes
    from specctl.progress import duration

    gib = lambda n: f"{n / (1 << 30):,.1f} GiB"  # noqa: E731
    c = result.cluster
    table = Table(title=f"plan: {result.recipe} on {c.nodes} x {c.gpus} GPU(s) of {gib(c.memory)}")
    for column in ("stage", "peak / GPU", "fits", "disk", "tokens", "time"):
        table.add_column(column)
    for s in result.stages:
        fits = "-" if not s.capacity else ("yes" if s.fits else "[red]NO[/red]")
        peak = gib(s.peak) if s.capacity else f"{gib(s.peak)} host" if s.terms else "-"
        time = duration(s.seconds) if s.seconds else "-"
        table.add_row(s.stage, peak, fits, si_bytes(s.disk), human_count(s.tokens) if s.tokens else "-", time)
    out.print(table)
    for s in result.stages:
        for t in s.terms:
            out.print(
                f"  {s.stage:8} {gib(t.bytes):>11}  {t.what} ({t.how})", highlight=False, soft_wrap=True
            )
        for a in s.assumptions:
            out.print(f"  {s.stage:8} {'':>11}  assumes: {a}", highlight=False, soft_wrap=True)


recipe_app = typer.Typer(
    help="Inspect recipes.\n\nExample: specctl recipe list\n\nExample: specctl recipe show quickstart --diff",
    no_args_is_help=True,
)
app.add_typer(recipe_app, name="recipe")


@recipe_app.command("show")
def recipe_show(
    recipe: RecipeArg,
    set_: SetOpt = None,
    diff: Annotated[
        bool, Flag("--diff", help="Only the settings that differ from the defaults (docs/recipe.md).")
    ] = False,
) -> None:
    """Print the resolved recipe as YAML: `extends` merged, --set applied, every default filled in.

    The output is itself a recipe: save it to pin a run's settings. With --diff, only what differs
    from the defaults (still a recipe that loads back to the same settings).

    Example: specctl recipe show quickstart --set train.max_steps=200 > my-recipe.yaml

    Example: specctl recipe show results --diff
    """
    from specctl.recipe import dump_recipe, dump_recipe_diff, load_recipe

    loaded = load_recipe(recipe, list(set_ or []))
    typer.echo(dump_recipe_diff(loaded) if diff else dump_recipe(loaded), nl=False)


@recipe_app.command("list")
def recipe_list() -> None:
    """List the built-in recipes (every RECIPE argument and `extends:` takes these names), each with
    the first line of its header comment.

    Example: specctl recipe list
    """
    from specctl.recipe import builtin_recipe_summaries

    rows = builtin_recipe_summaries()
    width = max(len(name) for name, _ in rows)
    for name, description in rows:
        typer.echo(f"{name:<{width}}  {description}".rstrip())


def _print_bench(report, as_json: bool) -> None:
    """The summary (or report.json), the files written, and one line per error or unmet requirement."""
    from specctl.bench.render import rich_latency, rich_sweep, rich_table

    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        figures = report.figures()  # once for the three tables
        for table in (
            rich_table(report, figures),
            rich_sweep(report, figures),
            rich_latency(report, figures),
        ):
            if table is not None:
                out.print(table)
        if report.divergence_summary:
            out.print(f"divergences: {report.divergence_summary}", highlight=False, soft_wrap=True)
        out.print(f"report: {report.output_dir}/report.md")
        for figure in ("acceptance.png", "sweep.png", "latency.png"):
            if report.output_dir is not None and (report.output_dir / figure).is_file():
                out.print(f"figure: {report.output_dir / figure}")
    for e in report.errors:
        err.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
    for f in report.failures:
        err.print(f"[red]requirement not met:[/red] {f}", highlight=False, soft_wrap=True)


def _rerun_hint(error: BaseException | None) -> str:
    """What rerunning does, as the interrupted stage said it (a KeyboardInterrupt with a message,
    anywhere in the chain Typer wraps it in: train names the checkpoint it continues from)."""
    while error is not None:
        if isinstance(error, KeyboardInterrupt) and error.args:
            return str(error.args[0])
        error = error.__cause__ or error.__context__
    return "rerun the same command to resume"


def _interrupted(error: BaseException | None = None) -> None:
    """One line and exit 130 for Ctrl-C and SIGTERM alike (docs/troubleshooting.md's table)."""
    name = signal.Signals(interrupts.received[0] if interrupts.received else signal.SIGINT).name
    err.print(
        f"[red]error:[/red] interrupted ({name}); {_rerun_hint(error)}", highlight=False, soft_wrap=True
    )
    sys.exit(130)


def main() -> None:
    """Entry point: run the app, turning known errors into one line and an exit code."""
    debug = os.environ.get("SPECCTL_DEBUG") == "1"
    interrupts.received.clear()
    main_thread = threading.current_thread() is threading.main_thread()  # only it may set handlers
    handler = interrupts.handler  # SIGTERM (a SLURM time limit, `kill`) unwinds like Ctrl-C
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM) if main_thread}
    try:
        _run(debug)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(debug: bool) -> None:
    """The app under the one error handler: one line and an exit code per known failure."""
    from specctl.errors import SpecctlError
    from specctl.redact import redact_text

    try:
        app()
    except SpecctlError as e:
        if debug:
            raise
        # a job's stderr is a log file: a server URL's credentials stay out of it
        err.print(f"[red]error:[/red] {redact_text(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except Exception as e:  # a full disk, however the writing library reports it (torch, safetensors)
        from specctl.durable import disk_full

        if interrupts.signalled() and not debug:  # native code made the KeyboardInterrupt its own error
            _interrupted(e)
        if debug or not disk_full(e):
            raise
        filename = getattr(e, "filename", None)
        where = f" writing {filename}" if filename else ""
        err.print(
            f"[red]error:[/red] disk full{where}; free space and rerun (finished work is kept)",
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(1)
    except KeyboardInterrupt as e:
        _interrupted(e)
    except SystemExit as e:
        if e.code == 130 and interrupts.received:  # Typer turns KeyboardInterrupt into a silent exit 130
            _interrupted(e)
        raise


if __name__ == "__main__":
    main()
