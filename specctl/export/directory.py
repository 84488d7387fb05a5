"""The export stage: trained drafters written as speculators directories vLLM loads, re-exports.

An export is a directory with the drafter's own two files (`config.json`, `model.safetensors`:
specctl.speculators.io writes and reads them), its model card `README.md` (specctl.export.card), the
`origin.json` of the features it was trained on and, exported from a training run, the verifier's
tokenizer files (what hub users and `vllm serve DRAFTER_DIR`-style tools look for beside a model).
This stage adds what goes around the two files: where they come from (a training checkpoint, or an
export re-cast to another dtype), the card, the atomic swap into the output directory, and the
`--check`.

The jobs beside this one: specctl.speculators (the format: typed config, validation, reading and
writing), specctl.vllm.check (`--check`: vLLM's own parser), specctl.export.hub (`--push-to-hub`);
rebuilding a drafter from a training checkpoint is specctl.checkpoint.drafter_from_checkpoint.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from specctl.drafters import DRAFTERS
from specctl.durable import Owner, disk_full, recover_dir, replace_dir
from specctl.errors import SpecctlError
from specctl.export.card import CARD_FILE, model_card, written_by_specctl
from specctl.export.units import binary_bytes
from specctl.origin import FeatureOrigin, origin_of_meta, write_origin
from specctl.recipe import VerifierSection
from specctl.runlock import run_lock
from specctl.speculators.io import drafter_files, dtype_name, export_dtype, read_files
from specctl.speculators.validate import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    ExportDir,
    is_export_dir,
    validate_export,
)
from specctl.verifier import locate_verifier, read_tokenizer_and_config
from specctl.vllm.check import CheckResult, check_result, refuse_check


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
            ("size", binary_bytes(self.size_bytes)),
            ("model card", str(self.output / CARD_FILE)),
        ]
        return rows + [r for r in self.check.rows() if r[0] not in ("export", "algorithm")]


# ---------------------------------------------------------------- writing


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
    output = Path(output)
    files = drafter_files(drafter, dtype)

    def write(tmp: Path) -> None:
        files.write(tmp)
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
    is, else the model card of this export (specctl.export.card), the facts read around `output`."""
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
    export = validate_export(source)
    if check_vllm:
        refuse_check(export.spec, export.path)  # before anything is written
    target = Path(output) if output is not None else export.path
    files = read_files(export)
    if dtype is not None:
        files = files.cast(export_dtype(dtype))

    def write(tmp: Path) -> None:
        files.write(tmp)
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
    floating = sorted({dtype_name(d) for _, d in written.headers.values() if d.is_floating_point})
    size = sum(f.stat().st_size for f in target.iterdir() if f.is_file())
    check = check_result(written, check_vllm)
    return ExportResult(export.spec.name, export.path, None, target, ", ".join(floating), size, check, True)


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
    name = dtype_name(export_dtype(dtype or recipe.export.dtype))
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
