"""`specctl export --push-to-hub`: upload a validated export directory to a hub model repo, with
a model card (README.md: the hub's metadata block, then what the drafter is, what it was trained
on, the acceptance it measured, and the `vllm serve` line that serves it)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specctl.errors import SpecctlError, UsageError, first_line
from specctl.origin import read_origin
from specctl.validate import ExportDir, validate_export

CARD_FILE = "README.md"


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    return f"{n} B"


@dataclass
class PushPlan:
    repo: str
    path: Path
    files: list[tuple[str, int]]  # (path inside the repo, bytes)
    pushed: bool = False
    url: str | None = None
    warnings: list[str] = field(default_factory=list)
    card: str | None = None  # the model card written for the upload (None: the directory's README.md)

    def rows(self) -> list[tuple[str, str]]:
        card = "README.md written by specctl" if self.card is not None else "README.md of the directory"
        rows = [("repo", self.repo), ("from", str(self.path)), ("model card", card)]
        rows += [(name, human_bytes(size)) for name, size in self.files]
        rows.append(("total", human_bytes(sum(size for _, size in self.files))))
        rows.append(("status", f"uploaded: {self.url}" if self.pushed else "dry run: nothing uploaded"))
        rows += [("warning", w) for w in self.warnings]
        return rows


def check_repo_id(repo: str) -> None:
    """`user/name` the hub accepts (huggingface_hub's own check), before any work is done."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if repo.count("/") != 1 or not all(repo.split("/")):
        raise UsageError(f"--push-to-hub {repo!r}: expected a repo id like user/my-drafter")
    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise UsageError(f"--push-to-hub {repo!r}: {first_line(e, 200)}") from None


def _last_record(path: Path, key: str) -> dict[str, Any] | None:
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


def training_facts(export: ExportDir) -> dict[str, Any]:
    """What the run directory around an export says (runs/<name>/drafters/<algo>/export): the
    training data and steps (the latest checkpoint's recipe), the held-out tau_hat (metrics.jsonl)
    and the measured tau (a bench report that ran this directory). Empty outside a run."""
    from specctl.checkpoint import RECIPE_FILE, latest_checkpoint

    algo_dir = export.path.resolve().parent
    facts: dict[str, Any] = {}
    checkpoint = latest_checkpoint(algo_dir / "checkpoints") if (algo_dir / "checkpoints").is_dir() else None
    if checkpoint is not None and (checkpoint / RECIPE_FILE).is_file():
        import yaml

        recipe = yaml.safe_load((checkpoint / RECIPE_FILE).read_text()) or {}
        data, train = recipe.get("data", {}), recipe.get("train", {})
        facts["data"] = {k: data.get(k) for k in ("source", "max_samples", "max_length") if k in data}
        facts["steps"] = train.get("max_steps")
    val = _last_record(algo_dir / "metrics.jsonl", "tau_hat")
    if val is not None:
        facts["tau_hat"] = (val["tau_hat"], val.get("step"))
    origin = read_origin(export.path)
    if origin is not None:
        facts["origin"] = origin
    for report in sorted(algo_dir.parent.parent.glob("bench*/report.json")):
        try:
            d = json.loads(report.read_text())
        except (OSError, ValueError):
            continue
        for r in d.get("results", []):
            if r.get("drafter") and Path(r["drafter"]).resolve() == export.path.resolve():
                facts.setdefault("measured", []).append((r, d))
    return facts


def model_card(export: ExportDir, repo: str) -> str:
    """README.md for the hub: metadata (base_model, tags, library), then the drafter, its training,
    its measured acceptance and how vLLM serves it."""
    from huggingface_hub import ModelCardData

    config, spec = export.config, export.spec
    verifier = config.verifier_name or "VERIFIER"
    hub_verifier = verifier.count("/") == 1 and not verifier.startswith(("/", ".", "~"))
    data = ModelCardData(
        base_model=verifier if hub_verifier else None,
        library_name="speculators",
        pipeline_tag="text-generation",
        tags=["speculative-decoding", "speculators", spec.name, config.speculators_model_type, "specctl"],
    )
    K = config.speculative_tokens
    serve = {**spec.vllm_method, "model": repo, "num_speculative_tokens": K} if spec.vllm_method else None
    facts = training_facts(export)
    lines = [
        "---",
        data.to_yaml(),
        "---",
        "",
        f"# {repo.split('/')[-1]}",
        "",
        f"A **{spec.name}** drafter (speculators format, `speculators_model_type: "
        f"{config.speculators_model_type}`) for speculative decoding with **{verifier}**, trained and "
        "exported with specctl.",
        "",
        "| | |",
        "|---|---|",
        f"| verifier | `{verifier}` |",
        f"| algorithm | {spec.name} |",
        f"| speculative tokens (K) | {K} |",
        f"| draft vocabulary | {config.draft_vocab_size or config.layer.vocab_size} |",
        f"| parameters | {export.num_parameters:,} ({config.dtype or 'see model.safetensors'}) |",
    ]
    if "data" in facts:
        shown = ", ".join(f"{k} {v}" for k, v in facts["data"].items() if v is not None)
        lines.append(f"| training data | {shown} |")
    if "origin" in facts:
        lines.append(f"| features collected from | {facts['origin'].short()} (origin.json) |")
    if facts.get("steps"):
        lines.append(f"| training steps | {facts['steps']} |")
    if "tau_hat" in facts:
        tau, step = facts["tau_hat"]
        lines.append(f"| held-out tau_hat (training estimate) | {tau:.3f} (step {step}) |")
    for r, d in facts.get("measured", []):
        lines.append(
            f"| measured tau (`specctl bench`, {d.get('backend')}, {d.get('dataset')}) | "
            f"{r['acceptance_length']:.3f} at K={r['num_speculative_tokens']}, speedup "
            f"{r['speedup']:.2f}x |"
            if r.get("acceptance_length") is not None and r.get("speedup") is not None
            else f"| measured tau (`specctl bench`, {d.get('backend')}) | {r.get('acceptance_length')} |"
        )
    lines += ["", "## Serve it with vLLM", ""]
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
        "tau (acceptance length) counts the bonus token: 1 + accepted / drafts, so plain decoding is 1.0.",
        "",
    ]
    return "\n".join(lines)


def upload_files(path: Path) -> list[Path]:
    """The files of an export directory an upload takes (hidden ones left out), in order. A symlink
    whose target is outside `path` is refused (UsageError): the upload would publish whatever it
    points to -- a home directory's key, another model -- under the drafter's name."""
    root = path.resolve()
    files = []
    for p in sorted(path.rglob("*")):
        if p.name.startswith("."):
            continue
        if p.is_symlink() and not p.resolve().is_relative_to(root):
            raise UsageError(
                f"{p}: a symlink to {os.readlink(p)}, outside the export directory {path}; "
                "copy the file into the directory (or remove the link) and push again"
            )
        if p.is_file():
            files.append(p)
    return files


def push_to_hub(
    path: str | Path,
    repo: str,
    dry_run: bool = False,
    private: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
) -> PushPlan:
    """Upload an export directory to a hub model repo (created if needed) in one commit, with a
    model card: the directory's own README.md when it has one, else one written from the export
    and its run (`model_card`). The export directory itself is not changed.

    `dry_run` validates the directory and lists what would be uploaded, touching no network.
    """
    path = Path(path)
    check_repo_id(repo)
    export = validate_export(path)
    files = upload_files(path)
    listed = [(str(p.relative_to(path)), p.stat().st_size) for p in files]
    card = None if (path / CARD_FILE).is_file() else model_card(export, repo)
    if card is not None:
        listed = sorted([*listed, (CARD_FILE, len(card.encode()))])
    plan = PushPlan(repo, path, listed, card=card)
    verifier = export.config.verifier_name or ""
    if verifier.startswith(("/", ".", "~")):
        plan.warnings.append(
            f"config.json records the verifier as the local path {verifier}; "
            "on another machine pass the verifier "
            'explicitly: vllm serve VERIFIER --speculative-config \'{"model": "' + repo + "\", ...}'"
        )
    if dry_run:
        return plan
    from huggingface_hub import CommitOperationAdd, HfApi

    operations = [
        CommitOperationAdd(path_in_repo=str(p.relative_to(path)), path_or_fileobj=str(p)) for p in files
    ]
    if card is not None:
        operations.append(CommitOperationAdd(path_in_repo=CARD_FILE, path_or_fileobj=card.encode()))
    api = HfApi(token=token)
    message = commit_message or f"specctl export: {export.spec.name} drafter for {verifier}"
    try:
        api.create_repo(repo_id=repo, repo_type="model", private=private, exist_ok=True)
        commit = api.create_commit(
            repo_id=repo, repo_type="model", operations=operations, commit_message=message
        )
    except Exception as e:  # network, auth, quota, offline: all end the same way, on one line
        raise SpecctlError(f"push to {repo} failed: {first_line(e)}") from None
    plan.pushed = True
    plan.url = getattr(commit, "commit_url", None) or f"https://huggingface.co/{repo}"
    return plan
