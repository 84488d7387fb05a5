"""The export stage: write trained drafters in the speculators format vLLM loads, and load them back.

An export is a directory with `config.json` (the drafter's typed `export_config()`, see
specctl.format) and `model.safetensors` (its `export_state()`: floating tensors cast to the export
dtype, `d2t` int64 and `t2d` bool kept as they are), its model card `README.md` (specctl.card) and,
exported from a training run, the verifier's tokenizer files (what hub users and `vllm serve
DRAFTER_DIR`-style tools look for beside a model). The verifier's embeddings, and its LM head when
the drafter drafts over the full vocabulary, are not in the file: vLLM shares them from the
verifier, and `load_drafter` borrows them from it too.

The jobs beside this one: specctl.validate (is a directory a loadable export), specctl.vllm.check
(`--check`: vLLM's own parser), specctl.hub (`--push-to-hub`); rebuilding a drafter from a training
checkpoint is specctl.checkpoint.drafter_from_checkpoint.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from specctl.card import CARD_FILE, model_card, written_by_specctl
from specctl.drafters import DRAFTERS, VerifierWeights
from specctl.drafters.vocab import t2d_from_d2t
from specctl.durable import Owner, disk_full, recover_dir, replace_dir
from specctl.errors import SpecctlError, first_line
from specctl.format import SpeculatorsConfig
from specctl.hub import human_bytes
from specctl.origin import FeatureOrigin, origin_of_meta, write_origin
from specctl.recipe import VerifierSection
from specctl.runlock import run_lock
from specctl.validate import (
    CONFIG_FILE,
    SHAREABLE,
    WEIGHTS_FILE,
    ExportDir,
    is_export_dir,
    load_tensors,
    validate_export,
)
from specctl.verifier import (
    Verifier,
    load_verifier,
    locate_verifier,
    read_tokenizer_and_config,
    verifier_weights,
)
from specctl.vllm.check import CheckResult, check_result, refuse_check

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


@dataclass
class ExportResult:
    algo: str
    checkpoint: Path
    step: int | None
    output: Path
    dtype: str
    size_bytes: int
    check: CheckResult
    reexport: bool = False  # `checkpoint` is an export directory (convert_export)

    def rows(self) -> list[tuple[str, str]]:
        step = f" (step {self.step})" if self.step is not None else ""
        rows = [
            ("algorithm", self.algo),
            ("re-exported from" if self.reexport else "checkpoint", f"{self.checkpoint}{step}"),
            ("output", str(self.output)),
            ("dtype", self.dtype),
            ("size", human_bytes(self.size_bytes)),
            ("model card", str(self.output / CARD_FILE)),
        ]
        return rows + [r for r in self.check.rows() if r[0] not in ("export", "algorithm")]


# ---------------------------------------------------------------- writing


def export_dtype(name: str) -> torch.dtype:
    if name not in EXPORT_DTYPES:
        raise SpecctlError(f"export dtype {name!r}: choose bfloat16, float16 or float32")
    return EXPORT_DTYPES[name]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# an export directory proves itself by a speculators config.json (ours or anyone's); a model
# directory's config.json does not, and an --output pointing at one is refused
OWNER = Owner("export", (CONFIG_FILE,), "choose another --output", proves=is_export_dir)


def _replace_dir(output: Path, write: Callable[[Path], None]) -> None:
    """Write the export through `durable.replace_dir`: a failure or a kill leaves `output` as it
    was (or wholly new). A full disk (or file size limit) raises one line naming `output`."""
    recover_dir(output)  # an export killed mid-swap: its previous directory back first
    if output.exists() and not output.is_dir():
        raise SpecctlError(f"{output}: exists and is not a directory; choose another --output")
    if output.is_dir() and any(output.iterdir()) and not is_export_dir(output):
        raise SpecctlError(
            f"{output}: exists and is not a speculators export; refusing to replace it "
            "(choose another --output)"
        )
    existed = output.exists()
    try:
        replace_dir(output, write, OWNER)
    except Exception as e:
        if not disk_full(e):
            raise
        kept = "the export already there is unchanged" if existed else "nothing was written"
        raise SpecctlError(f"{output}: disk full writing the export, {kept}; free space and rerun") from None


def verifier_tokenizer(section: VerifierSection) -> Any:
    """The verifier's tokenizer (no weights read), to ship beside the drafter: the run trained
    against this verifier, so it is local (a directory, a built-in, or the hub cache)."""
    source, _ = locate_verifier(section.name_or_path, section.revision)
    return read_tokenizer_and_config(section, source)[0]


def save_drafter(
    drafter: nn.Module,
    output: str | Path,
    dtype: str = "bfloat16",
    origin: FeatureOrigin | None = None,
    tokenizer: Any = None,
) -> Path:
    """Write `drafter` as a speculators directory (config.json + model.safetensors, README.md, and
    origin.json when the features it was trained on recorded where they came from; the
    `tokenizer`'s files when given), atomically.

    Floating tensors are cast to `dtype`; integer and bool tables (d2t, t2d) keep theirs. The
    written directory is validated before it replaces anything at `output`; a README.md the user
    wrote there is kept, a card specctl wrote is rewritten.
    """
    import json

    output = Path(output)
    torch_dtype = export_dtype(dtype)
    config: SpeculatorsConfig = drafter.export_config()
    config.dtype = _dtype_name(torch_dtype)
    text = json.dumps(config.to_json(), indent=2) + "\n"
    state = {
        name: (t.to(torch_dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
        for name, t in drafter.export_state().items()
    }

    def write(tmp: Path) -> None:
        (tmp / CONFIG_FILE).write_text(text)
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if origin is not None:
            write_origin(tmp, origin)
        try:
            written = validate_export(tmp)
        except SpecctlError as e:  # export_state()/export_config() disagree with the format
            raise SpecctlError(f"{output}: not written, the export would not load back: {e}") from None
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        _write_card(written, output, tmp)

    _replace_dir(output, write)
    return output


def _write_card(export: ExportDir, output: Path, tmp: Path) -> None:
    """README.md in `tmp` (becoming `output`): the user's own README.md at `output` copied as it
    is, else the model card of this export (specctl.card), the facts read around `output`."""
    if (output / CARD_FILE).is_file() and not written_by_specctl(output):
        shutil.copy2(output / CARD_FILE, tmp / CARD_FILE)
    else:
        (tmp / CARD_FILE).write_text(model_card(export, path=output))


def names_export(path: str | Path) -> bool:
    """`path` holds a config.json that is a speculators export's, or that does not parse at all:
    either way the user named an export directory (its validation says what is wrong), not a
    training run. A model directory's config.json (no speculators_model_type) is not one."""
    import json

    config = Path(path) / CONFIG_FILE
    if not config.is_file():
        return False
    try:
        data = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return True
    return not isinstance(data, dict) or "speculators_model_type" in data


def convert_export(
    source: str | Path, output: str | Path | None, dtype: str | None, check_vllm: bool = False
) -> ExportResult:
    """Re-export an export directory: its weights cast to `dtype` (default: as they are) and
    written to `output` (default: in place), config.json's dtype updated; validated before it
    replaces anything, like every export. Works on third-party directories too."""
    import json

    export = validate_export(source)
    if check_vllm:
        refuse_check(export.spec, export.path)  # before anything is written
    target = Path(output) if output is not None else export.path
    torch_dtype = export_dtype(dtype) if dtype is not None else None
    config = json.loads((export.path / CONFIG_FILE).read_text())
    tensors = load_tensors(export.files)
    if torch_dtype is not None:
        tensors = {n: t.to(torch_dtype) if t.is_floating_point() else t for n, t in tensors.items()}
        config["dtype"] = _dtype_name(torch_dtype)
    state = {n: t.contiguous() for n, t in tensors.items()}
    text = json.dumps(config, indent=2) + "\n"

    def write(tmp: Path) -> None:
        (tmp / CONFIG_FILE).write_text(text)
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        for f in export.path.iterdir():  # a tokenizer, the user's README.md: kept (the weights are rewritten)
            if (
                f.is_file()
                and f.name not in (CONFIG_FILE, CARD_FILE)
                and not f.name.startswith(WEIGHTS_FILE.split(".")[0])
            ):
                shutil.copy2(f, tmp / f.name)
        written = validate_export(tmp)
        if (export.path / CARD_FILE).is_file() and not written_by_specctl(export.path):
            shutil.copy2(export.path / CARD_FILE, tmp / CARD_FILE)
        else:  # the card says the new dtype and size
            (tmp / CARD_FILE).write_text(model_card(written, path=target))

    with run_lock(target, "export"):
        _replace_dir(target, write)
        written = validate_export(target, check_values=False)
    floating = sorted({_dtype_name(d) for _, d in written.headers.values() if d.is_floating_point})
    size = sum(f.stat().st_size for f in target.iterdir() if f.is_file())
    check = check_result(written, check_vllm)
    return ExportResult(export.spec.name, export.path, None, target, ", ".join(floating), size, check, True)


# ---------------------------------------------------------------- loading


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


# ---------------------------------------------------------------- from training checkpoints


def find_checkpoints(source: str | Path) -> list[Path]:
    """The checkpoints a source names: a step-N dir, a checkpoints/ dir, runs/<name>/drafters/<algo>,
    or runs/<name> (the latest checkpoint of every trained algorithm)."""
    from specctl.checkpoint import is_complete, latest_checkpoint  # torch.distributed.checkpoint: slow import

    source = Path(source)
    if is_complete(source):
        return [source]
    roots = [source] if source.name == "checkpoints" else [source / "checkpoints"]
    drafters = source / "drafters"
    if drafters.is_dir():
        roots += [d / "checkpoints" for d in sorted(drafters.iterdir()) if (d / "checkpoints").is_dir()]
    found = [c for root in roots if root.is_dir() and (c := latest_checkpoint(root)) is not None]
    if not found:
        raise SpecctlError(
            f"{source}: no training checkpoint found (pass runs/<name>, runs/<name>/drafters/<algo> or a "
            "step-N checkpoint); run `specctl train RECIPE` first"
        )
    return found


def default_output(checkpoint: Path) -> Path:
    """runs/<name>/drafters/<algo>/checkpoints/step-N -> runs/<name>/drafters/<algo>/export."""
    if checkpoint.parent.name != "checkpoints":
        raise SpecctlError(f"{checkpoint}: not inside a run's checkpoints/ directory; pass --output DIR")
    return checkpoint.parent.parent / "export"


def export_drafter(
    checkpoint: str | Path,
    output: str | Path | None = None,
    dtype: str | None = None,
    check_vllm: bool = False,
) -> ExportResult:
    """Export one training checkpoint (default output: runs/<name>/drafters/<algo>/export)."""
    from specctl.checkpoint import drafter_from_checkpoint

    checkpoint = Path(checkpoint)
    module, recipe, meta = drafter_from_checkpoint(checkpoint)
    name = _dtype_name(export_dtype(dtype or recipe.export.dtype))
    output = Path(output) if output is not None else default_output(checkpoint)
    origin = origin_of_meta(meta, checkpoint / "meta.json")
    # the verifier the drafter was trained against (meta.json), read as the recipe reads it
    trained_on = meta.get("verifier", {}).get("name_or_path") or recipe.verifier.name_or_path
    tokenizer = verifier_tokenizer(recipe.verifier.model_copy(update={"name_or_path": trained_on}))
    with run_lock(output, "export"):  # a second export of it exits naming this one
        # validated (values included) before it was swapped in
        save_drafter(module, output, name, origin, tokenizer)
        check = check_result(validate_export(output, check_values=False), check_vllm)
        size = sum(f.stat().st_size for f in output.iterdir() if f.is_file())
    return ExportResult(meta["algo"], checkpoint, meta.get("step"), output, name, size, check)


def export_drafters(
    source: str | Path, output: str | Path | None = None, dtype: str | None = None, check_vllm: bool = False
) -> list[ExportResult]:
    """Export what `source` names (see `find_checkpoints`): one result per algorithm.

    With several algorithms and an explicit `output`, each goes to output/<algo>.
    """
    from specctl.checkpoint import read_meta

    checkpoints = find_checkpoints(source)
    if check_vllm:  # a check the installed vLLM cannot pass: refused before any export is written
        for checkpoint in checkpoints:
            refuse_check(DRAFTERS[read_meta(checkpoint)["algo"]], checkpoint)
    results = []
    for checkpoint in checkpoints:
        target = output
        if output is not None and len(checkpoints) > 1:
            target = Path(output) / read_meta(checkpoint)["algo"]
        results.append(export_drafter(checkpoint, target, dtype, check_vllm))
    return results
