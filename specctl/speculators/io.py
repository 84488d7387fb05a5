"""A speculators directory's files written from a drafter, and read back: as files or as a drafter.

An export's own two files are `config.json` (the drafter's typed `export_config()`, see
specctl.speculators.config) and `model.safetensors` (its `export_state()`: floating tensors cast to
the export dtype, `d2t` int64 and `t2d` bool kept as they are). `ExportFiles` is exactly that pair
in memory, so what is written and what is read back compare as values. The verifier's embeddings,
and its LM head when the drafter drafts over the full vocabulary, are not in the file: vLLM shares
them from the verifier, and `load_drafter` borrows them from it too.

What goes around the two files -- the model card, origin.json, the tokenizer, the atomic swap into
the output directory, the vLLM check -- is the export stage's (specctl.export). Every stage that
loads an export as a drafter (bench's embedded engine, the perf benchmarks) reads it here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from specctl.drafters import VerifierWeights
from specctl.drafters.vocab import t2d_from_d2t
from specctl.errors import SpecctlError, first_line
from specctl.recipe import VerifierSection
from specctl.speculators.config import SpeculatorsConfig
from specctl.speculators.validate import (
    CONFIG_FILE,
    SHAREABLE,
    WEIGHTS_FILE,
    ExportDir,
    load_tensors,
    validate_export,
)
from specctl.verifier import Verifier, load_verifier, verifier_weights

EXPORT_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def export_dtype(name: str) -> torch.dtype:
    if name not in EXPORT_DTYPES:
        raise SpecctlError(f"export dtype {name!r}: choose bfloat16, float16 or float32")
    return EXPORT_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """config.json's spelling of a dtype (`bfloat16`, as the speculators library writes it)."""
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------- the two files


@dataclass(frozen=True)
class ExportFiles:
    """config.json as a JSON object and model.safetensors as name -> tensor: a directory's own
    content, before it is written or after it is read."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    def write(self, directory: Path) -> None:
        """config.json (2-space JSON and a newline) and model.safetensors into `directory`."""
        (directory / CONFIG_FILE).write_text(json.dumps(self.config, indent=2) + "\n")
        state = {name: t.contiguous() for name, t in self.tensors.items()}
        save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})

    def cast(self, dtype: torch.dtype) -> ExportFiles:
        """The floating tensors in `dtype` (d2t / t2d keep theirs), config.json's dtype saying so."""
        tensors = {n: t.to(dtype) if t.is_floating_point() else t for n, t in self.tensors.items()}
        return ExportFiles({**self.config, "dtype": dtype_name(dtype)}, tensors)


def drafter_files(drafter: nn.Module, dtype: str) -> ExportFiles:
    """What a drafter exports: its `export_config()` (dtype recorded) and its `export_state()` with
    floating tensors cast to `dtype`, on the CPU."""
    torch_dtype = export_dtype(dtype)
    config: SpeculatorsConfig = drafter.export_config()
    config.dtype = dtype_name(torch_dtype)
    state = {
        name: (t.to(torch_dtype) if t.is_floating_point() else t).detach().cpu()
        for name, t in drafter.export_state().items()
    }
    return ExportFiles(config.to_json(), state)


def read_files(export: ExportDir) -> ExportFiles:
    """A validated directory's config.json and every tensor of its weights (shared copies of the
    verifier's included): what a re-export writes back, cast or not."""
    config = json.loads((export.path / CONFIG_FILE).read_text())
    return ExportFiles(config, load_tensors(export.files))


# ---------------------------------------------------------------- as a drafter


def _borrowed_weights(export: ExportDir, verifier: Verifier | VerifierWeights | None) -> VerifierWeights:
    if verifier is None:
        name = export.config.verifier_name
        if not name:
            raise SpecctlError(
                f"{export.path / CONFIG_FILE}: records no speculators_config.verifier.name_or_path; "
                "pass the verifier"
            )
        verifier = load_verifier(VerifierSection(name_or_path=name))
    weights = verifier if isinstance(verifier, VerifierWeights) else verifier_weights(verifier)
    want = (export.config.layer.vocab_size, export.config.layer.hidden_size)
    for what in ("embed_tokens", "lm_head"):
        got = tuple(getattr(weights, what).shape)
        if got != want:
            raise SpecctlError(
                f"{export.path / CONFIG_FILE}: the drafter needs a verifier with [vocab, hidden] "
                f"{list(want)}, "
                f"but the verifier given has {what} {list(got)}; pass the verifier it was trained for"
            )
    return weights


def _own_copies(export: ExportDir, weights: VerifierWeights) -> dict[str, torch.Tensor]:
    """The verifier-shaped tensors the file ships that differ from the verifier's (compared at the
    file's precision, as vLLM compares in its serving dtype): the drafter uses those as its own,
    as vLLM keeps a distinct embed_tokens. An LM head the drafter borrows has no own variant."""
    own = {}
    for name, values in load_tensors(export.files, export.shared).items():
        reference = getattr(weights, SHAREABLE[name])
        if torch.equal(values, reference.detach().cpu().to(values.dtype)):
            continue
        if name != "embed_tokens.weight":
            raise SpecctlError(
                f"{export.files[name]}: tensor {name!r} differs from the verifier's; the {export.spec.name} "
                f"drafter borrows the verifier's {SHAREABLE[name]}, it cannot use its own"
            )
        own[name] = values
    return own


def load_drafter(
    path: str | Path,
    verifier: Verifier | VerifierWeights | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[nn.Module, SpeculatorsConfig]:
    """Rebuild a drafter from a speculators directory (ours or third-party) for the embedded engine.

    The verifier tensors it borrows (embeddings, final norm, LM head) come from `verifier` when
    given (a loaded Verifier or its VerifierWeights, to avoid loading it twice), else from the
    verifier config.json records (hub id, local directory, or a built-in model by its hub id).
    Returns (module in eval mode on `device` and in `dtype`, default the borrowed tensors' device
    and dtype, i.e. the verifier's: vLLM runs a drafter in its verifier's dtype too, and a float32
    drafter beside a bf16 verifier reads twice the weight bytes per proposal, which bounds its cost
    at batch 1 (docs/performance.md, "The drafter's share of a step").
    """
    export = validate_export(path)
    weights = _borrowed_weights(export, verifier)
    tensors = load_tensors(export.files, [n for n in export.files if n not in export.shared])
    if export.derive_t2d:
        tensors["t2d"] = t2d_from_d2t(tensors["d2t"], export.config.layer.vocab_size)
    own = _own_copies(export, weights)
    try:
        module = export.spec.from_export(export.config, tensors, weights)
    except (KeyError, ValueError, TypeError, RuntimeError) as e:  # validated above: a drafter bug if hit
        raise SpecctlError(
            f"{export.path}: the {export.spec.name} drafter could not load it ({first_line(e)})"
        ) from None
    if "embed_tokens.weight" in own:
        module.adopt_embeddings(own["embed_tokens.weight"].to(weights.embed_tokens.dtype))
    module = module.to(device or weights.embed_tokens.device, dtype or weights.embed_tokens.dtype)
    return module.eval(), export.config
