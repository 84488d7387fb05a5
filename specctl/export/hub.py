"""`specctl export --push-to-hub`: upload a validated export directory to a hub model repo, with
its model card (specctl.export.card: README.md, rewritten for the upload so that the `vllm serve` line
names the hub repo, unless the user wrote their own)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from specctl.errors import SpecctlError, UsageError, first_line
from specctl.export.card import CARD_FILE, model_card, written_by_specctl
from specctl.export.units import binary_bytes
from specctl.speculators.validate import validate_export

__all__ = [
    "CARD_FILE",
    "PushPlan",
    "check_repo_id",
    "model_card",
    "push_to_hub",
    "upload_files",
]


@dataclass
class PushPlan:
    repo: str
    path: Path
    files: list[tuple[str, int]]  # (path inside the repo, bytes)
    pushed: bool = False
    url: str | None = None
    warnings: list[str] = field(default_factory=list)
    card: str = ""  # the model card uploaded as README.md
    card_written: bool = False  # specctl wrote `card` for this upload (else: the user's README.md)

    def rows(self) -> list[tuple[str, str]]:
        card = "README.md written by specctl" if self.card_written else "README.md of the directory"
        rows = [("repo", self.repo), ("from", str(self.path)), ("model card", card)]
        rows += [(name, binary_bytes(size)) for name, size in self.files]
        rows.append(("total", binary_bytes(sum(size for _, size in self.files))))
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
    model card: the user's own README.md when the directory has one, else one written from the
    export and its run for this repo (`model_card`; a card an earlier export wrote is rewritten,
    its serve line naming the local directory). The export directory itself is not changed.

    `dry_run` validates the directory and lists what would be uploaded, touching no network.
    """
    path = Path(path)
    check_repo_id(repo)
    export = validate_export(path)
    written = written_by_specctl(path) or not (path / CARD_FILE).is_file()
    files = [p for p in upload_files(path) if not (written and p == path / CARD_FILE)]
    listed = [(str(p.relative_to(path)), p.stat().st_size) for p in files]
    card = model_card(export, repo) if written else (path / CARD_FILE).read_text(errors="replace")
    if written:
        listed = sorted([*listed, (CARD_FILE, len(card.encode()))])
    plan = PushPlan(repo, path, listed, card=card, card_written=written)
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
    if written:
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
