"""The model card (README.md) of an export: what the drafter is, what it was trained on and for how
long, the acceptance it reached held-out and in a bench, how vLLM serves it, and where it came from.

Every export writes one (specctl.export), so a directory copied off the cluster or uploaded by hand
says what it holds; `--push-to-hub` uploads it with the hub repo as the served model. A card
specctl wrote carries MARKER, so a re-export or a push may rewrite it with newer facts (a bench that
ran since); a README.md the user wrote has none and is never replaced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from specctl.origin import FeatureOrigin, read_origin
from specctl.speculators.validate import ExportDir

CARD_FILE = "README.md"
MARKER = "<!-- written by specctl export; a README.md without this line is the user's and is kept -->"
TAU = "mean acceptance length (tau)"


@dataclass
class Training:
    """What the run's latest checkpoint says about how the drafter was trained."""

    data: str  # the training data, as the recipe names it
    steps: int | None  # optimizer steps the checkpoint holds
    max_steps: int
    lr: float
    schedule: str
    batch_tokens: int  # tokens of one optimizer step at most, per rank (micro-batch x accumulation)
    checkpoint: Path


@dataclass
class Measured:
    """One bench result of this directory (a report.json of the run)."""

    backend: str
    dataset: str
    tau: float | None
    k: int | None
    speedup: float | None


@dataclass
class CardFacts:
    training: Training | None = None
    tau_hat: tuple[float, int | None] | None = None  # (held-out estimate, at step)
    origin: FeatureOrigin | None = None
    measured: list[Measured] = field(default_factory=list)


def _last_record(path: Path, key: str) -> dict | None:
    """The last metrics.jsonl line holding `key` (None without the file or the key)."""
    if not path.is_file():
        return None
    found = None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and key in record:
            found = record
    return found


def _training(algo_dir: Path, algo: str) -> Training | None:
    from specctl.checkpoint import latest_checkpoint, read_meta, saved_recipe
    from specctl.errors import SpecctlError

    checkpoints = algo_dir / "checkpoints"
    checkpoint = latest_checkpoint(checkpoints) if checkpoints.is_dir() else None
    if checkpoint is None:
        return None
    try:
        recipe, meta = saved_recipe(checkpoint), read_meta(checkpoint)
    except SpecctlError:  # a damaged checkpoint: the card says what it can without it
        return None
    train, data = recipe.train.for_algo(algo), recipe.data
    shown = [data.source] + [
        f"{k} {v}"
        for k, v in (("max_samples", data.max_samples), ("max_length", data.max_length))
        if v is not None
    ]
    return Training(
        ", ".join(shown),
        meta.get("step"),
        train.max_steps,
        train.lr,
        train.schedule,
        train.batch_tokens * train.grad_accum,
        checkpoint,
    )


def _measured(run_dir: Path, export_path: Path) -> list[Measured]:
    found = []
    for report in sorted(run_dir.glob("bench*/report.json")):
        try:
            d = json.loads(report.read_text())
        except (OSError, ValueError):
            continue
        for r in d.get("results", []) if isinstance(d, dict) else []:
            if r.get("drafter") and Path(r["drafter"]).resolve() == export_path.resolve():
                found.append(
                    Measured(
                        str(d.get("backend")),
                        str(d.get("dataset")),
                        r.get("acceptance_length"),
                        r.get("num_speculative_tokens"),
                        r.get("speedup"),
                    )
                )
    return found


def card_facts(export: ExportDir, path: Path | None = None) -> CardFacts:
    """What the run directory around an export at `path` (default: where it is) says:
    runs/<name>/drafters/<algo>/export. Empty outside a run. `path` lets an export being written
    in a temporary sibling describe the directory it will become."""
    path = (path or export.path).resolve()
    algo_dir = path.parent
    facts = CardFacts(_training(algo_dir, export.spec.name), origin=read_origin(export.path))
    val = _last_record(algo_dir / "metrics.jsonl", "tau_hat")
    if val is not None:
        facts.tau_hat = (val["tau_hat"], val.get("step"))
    facts.measured = _measured(algo_dir.parent.parent, path)
    return facts


def _fact_rows(facts: CardFacts) -> list[str]:
    rows = []
    t = facts.training
    if t is not None:
        rows.append(f"| training data | {t.data} |")
        steps = f"{t.steps} of {t.max_steps}" if t.steps is not None else f"max {t.max_steps}"
        rows.append(
            f"| training budget | {steps} steps, <= {t.batch_tokens:,} tokens a step (per rank), "
            f"lr {t.lr:g} ({t.schedule}) |"
        )
    if facts.origin is not None:
        rows.append(f"| features collected from | {facts.origin.short()} (origin.json) |")
    if facts.tau_hat is not None:
        tau, step = facts.tau_hat
        rows.append(f"| held-out {TAU}, training estimate | {tau:.3f} (step {step}) |")
    for m in facts.measured:
        where = f"`specctl bench`, {m.backend} engine, {m.dataset}"
        if m.tau is not None and m.speedup is not None:
            rows.append(f"| measured {TAU} ({where}) | {m.tau:.3f} at K={m.k}, speedup {m.speedup:.2f}x |")
        else:
            rows.append(f"| measured {TAU} ({where}) | {m.tau} |")
    if not facts.measured:
        rows.append("| measured speedup | none yet: run `specctl bench` on this run |")
    return rows


def _provenance(facts: CardFacts) -> list[str]:
    import specctl
    from specctl.provenance import git_state

    commit, dirty = git_state(Path(specctl.__file__).parent)
    built = f"specctl {specctl.__version__}" + (
        f" (commit {commit[:12]}{', modified' if dirty else ''})" if commit else ""
    )
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["## Provenance", "", f"- exported {when} by {built}"]
    if facts.training is not None:
        lines.append(f"- from the training checkpoint `{facts.training.checkpoint}`")
    if facts.origin is not None:
        lines.append("- origin.json: the verifier build and data the features were collected from")
    return lines


def model_card(export: ExportDir, repo: str | None = None, path: Path | None = None) -> str:
    """README.md: the hub's metadata block, the drafter, its training, the acceptance it reached,
    the `vllm serve` line (the served model is `repo`, else the directory itself) and provenance."""
    from huggingface_hub import ModelCardData

    config, spec = export.config, export.spec
    home = (path or export.path).resolve()
    verifier = config.verifier_name or "VERIFIER"
    hub_verifier = verifier.count("/") == 1 and not verifier.startswith(("/", ".", "~"))
    data = ModelCardData(
        base_model=verifier if hub_verifier else None,
        library_name="speculators",
        pipeline_tag="text-generation",
        tags=["speculative-decoding", "speculators", spec.name, config.speculators_model_type, "specctl"],
    )
    K = config.speculative_tokens
    model = repo or str(home)
    serve = {**spec.vllm_method, "model": model, "num_speculative_tokens": K} if spec.vllm_method else None
    facts = card_facts(export, path)
    lines = [
        "---",
        data.to_yaml(),
        "---",
        MARKER,
        "",
        f"# {repo.split('/')[-1] if repo else home.parent.name + ' drafter'}",
        "",
        f"A **{spec.name}** drafter (speculators format, `speculators_model_type: "
        f"{config.speculators_model_type}`) for speculative decoding with **{verifier}**, trained and "
        "exported with specctl. The tokenizer files are the verifier's.",
        "",
        "| | |",
        "|---|---|",
        f"| verifier | `{verifier}` |",
        f"| algorithm | {spec.name} |",
        f"| speculative tokens (K) | {K} |",
        f"| draft vocabulary | {config.draft_vocab_size or config.layer.vocab_size} |",
        f"| parameters | {export.num_parameters:,} ({config.dtype or 'see model.safetensors'}) |",
        *_fact_rows(facts),
        "",
        "## Serve it with vLLM",
        "",
    ]
    if serve is not None:
        lines += [
            "```bash",
            f"vllm serve {verifier} \\",
            f"  --speculative-config '{json.dumps(serve)}'",
            "```",
        ]
    else:
        lines.append(
            f"vLLM has no method for `{config.speculators_model_type}` yet; specctl's engine runs it."
        )
    lines += [
        "",
        f"The {TAU} counts the bonus token: 1 + accepted / drafts, so plain decoding is 1.0.",
        "",
        *_provenance(facts),
        "",
    ]
    return "\n".join(lines)


def written_by_specctl(directory: Path) -> bool:
    """The directory's README.md is a card specctl wrote (and may rewrite), not the user's."""
    card = directory / CARD_FILE
    try:
        return card.is_file() and MARKER in card.read_text(errors="replace")
    except OSError:
        return False
