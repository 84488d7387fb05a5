"""`specctl export --push-to-hub`: upload a validated export directory to a hub model repo."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specctl.errors import SpecctlError, first_line
from specctl.validate import validate_export


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

    def rows(self) -> list[tuple[str, str]]:
        rows = [("repo", self.repo), ("from", str(self.path))]
        rows += [(name, human_bytes(size)) for name, size in self.files]
        rows.append(("total", human_bytes(sum(size for _, size in self.files))))
        rows.append(("status", f"uploaded: {self.url}" if self.pushed else "dry run: nothing uploaded"))
        rows += [("warning", w) for w in self.warnings]
        return rows


def push_to_hub(
    path: str | Path,
    repo: str,
    dry_run: bool = False,
    private: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
) -> PushPlan:
    """Upload an export directory to a hub model repo (created if needed) with huggingface_hub.

    `dry_run` validates the directory and lists what would be uploaded, touching no network.
    """
    path = Path(path)
    export = validate_export(path)
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise SpecctlError(f"--push-to-hub {repo!r}: expected a repo id like user/my-drafter")
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    plan = PushPlan(repo, path, [(str(p.relative_to(path)), p.stat().st_size) for p in files])
    verifier = export.config.verifier_name or ""
    if verifier.startswith(("/", ".", "~")):
        plan.warnings.append(
            f"config.json records the verifier as the local path {verifier}; "
            "on another machine pass the verifier "
            'explicitly: vllm serve VERIFIER --speculative-config \'{"model": "' + repo + "\", ...}'"
        )
    if dry_run:
        return plan
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    message = commit_message or f"specctl export: {export.spec.name} drafter for {verifier}"
    try:
        api.create_repo(repo_id=repo, repo_type="model", private=private, exist_ok=True)
        commit = api.upload_folder(
            folder_path=str(path),
            repo_id=repo,
            repo_type="model",
            commit_message=message,
            allow_patterns=[name for name, _ in plan.files],
        )
    except Exception as e:  # network, auth, quota, offline: all end the same way, on one line
        raise SpecctlError(f"push to {repo} failed: {first_line(e)}") from None
    plan.pushed = True
    plan.url = getattr(commit, "commit_url", None) or f"https://huggingface.co/{repo}"
    return plan
