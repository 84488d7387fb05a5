"""Training checkpoints: write atomically, find the newest complete one, restore it on any world size.

Layout of `<drafters>/<algo>/checkpoints/`:

    step-N/
      drafter.safetensors   the drafter's state dict (full, unsharded; d2t/t2d included)
      optimizer.pt          optimizer state keyed by parameter name (world-size independent)
      trainer_state.pt      step, data cursor, LR scheduler, RNG states (python, numpy, torch, cuda)
      recipe.yaml           the recipe this run used
      meta.json             algo, loss, step, world size, the VerifierSpec the drafter was built for
      checksums.json        sha256 of every other file, checked before any is read
    latest                  text file naming the newest step-N directory

A checkpoint is written to a hidden temporary directory and renamed into place only when every
file is on disk, then `latest` is replaced (temp file + rename): a crash mid-write leaves the
previous checkpoint in charge, and a half-written directory is never picked up; a full disk ends
the save with one line naming the file and the checkpoint a rerun continues from. State dicts go
through `torch.distributed.checkpoint.state_dict`, so the same code saves a plain module, DDP or
FSDP2 (gathered to rank 0) and loads into any of them (rank 0 reads, then broadcasts).

Every file is checksummed like feature shards: a flipped bit in a weight or an optimizer moment
loads without complaint and silently skews the run, and a torn recipe.yaml or meta.json rebuilds
another drafter, so resume and export verify the sha256 first and name the file that no longer
matches (recipe.yaml and meta.json are plain text to read, not to edit). Resume takes the newest
checkpoint that verifies (`resume_checkpoint`), saying which newer ones it skipped and why: a
corrupt `latest` costs the steps since the one before, not the run. Checkpoints written before
recipe.yaml and meta.json were checksummed still load; those two are then only parsed.
"""

from __future__ import annotations

import io
import json
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from specctl.distributed import DistContext, broadcast_object
from specctl.drafters import DRAFTERS, VerifierSpec
from specctl.durable import Owner, disk_full, recover_dirs, replace_dir, sha256_file, write_atomic
from specctl.errors import CheckpointError, RecipeError, SpecctlError, first_line
from specctl.progress import note

if TYPE_CHECKING:
    from specctl.recipe import Recipe

DRAFTER_FILE = "drafter.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
TRAINER_FILE = "trainer_state.pt"
RECIPE_FILE = "recipe.yaml"
META_FILE = "meta.json"
CHECKSUM_FILE = "checksums.json"
STATE_FILES = (DRAFTER_FILE, OPTIMIZER_FILE, TRAINER_FILE)
CHECKSUMMED = (*STATE_FILES, RECIPE_FILE, META_FILE)  # every file but checksums.json itself
REQUIRED = (DRAFTER_FILE, OPTIMIZER_FILE, TRAINER_FILE, META_FILE, CHECKSUM_FILE)
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d+)$")
# every checkpoint (every version) has meta.json: a non-empty step-N without one is not train's
# to replace (re-saving a step) or delete (pruning)
OWNER = Owner(
    "train",
    (META_FILE,),
    "move it out of the checkpoints directory or choose another run name",
)


# ---------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    """Every RNG the loop may touch, in a form `torch.load(weights_only=True)` accepts."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(keys.copy()), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def seed_rngs(seed: int) -> None:
    """Seed every RNG `rng_state` saves: torch's (CUDA's with it), Python's `random` and numpy's
    global one. Seeding torch alone left the other two as the interpreter started them (from OS
    entropy), so a checkpoint's saved states differed between two runs of the same recipe and a
    drafter drawing from them could not be repeated; seeded, they are a function of the seed and
    of what training drew (numpy takes the seed modulo 2**32)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy(), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------- finding checkpoints


def step_of(path: Path) -> int | None:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def is_complete(path: Path) -> bool:
    return step_of(path) is not None and all((path / f).is_file() for f in REQUIRED)


def check_checkpoint_dirs(root: Path) -> None:
    """Refuse (ForeignDirError) before training when a step-N directory in `root` holds files
    train did not write: it would be replaced by a save of that step, or deleted by pruning."""
    for path in sorted(root.glob("step-*")):
        if step_of(path) is not None:
            OWNER.check(path)


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `latest` names, else the highest complete step-N (None when there is none)."""
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if is_complete(named):
            return named
    done = [p for p in root.glob("step-*") if is_complete(p)]
    return max(done, key=lambda p: step_of(p) or 0) if done else None


def find_checkpoint(path: str | Path, algo: str | None = None) -> Path:
    """A checkpoint directory from a step dir, a checkpoints/ dir, a drafters/<algo>/ dir, or a
    run dir (with `algo`, or when exactly one drafter was trained there)."""
    path = Path(path)
    if is_complete(path):
        return path
    candidates = [path, path / "checkpoints"]
    drafters = path / "drafters"
    if drafters.is_dir():
        algos = [algo] if algo else sorted(p.name for p in drafters.iterdir() if (p / "checkpoints").is_dir())
        if len(algos) > 1:
            raise SpecctlError(f"{path}: checkpoints for {', '.join(algos)}; say which algorithm (--algo)")
        candidates += [drafters / a / "checkpoints" for a in algos]
    for root in candidates:
        if root.is_dir() and (found := latest_checkpoint(root)) is not None:
            return found
    raise SpecctlError(f"{path}: no training checkpoint found; run `specctl train RECIPE` first")


class DamagedCheckpoint(CheckpointError):
    """A checkpoint file that cannot be used, with the short `reason` a resume that skips the
    checkpoint prints; the message adds what to do."""

    def __init__(self, file: Path, reason: str):
        self.file, self.reason = file, reason
        super().__init__(
            f"{file}: {reason}; delete {file.parent}: the checkpoint before it then counts as the "
            "latest (a rerun of train skips it by itself)"
        )


def read_meta(path: Path) -> dict[str, Any]:
    """meta.json as a dict; DamagedCheckpoint when it is missing, not JSON or not an object."""
    file = path / META_FILE
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise DamagedCheckpoint(file, f"unreadable ({first_line(e)})") from None
    if not isinstance(meta, dict):
        raise DamagedCheckpoint(file, f"holds a JSON {type(meta).__name__}, not an object")
    return meta


def load_drafter_state(path: Path) -> dict[str, torch.Tensor]:
    """The drafter's full state dict from a checkpoint (for export: build, then load_state_dict)."""
    verify_checksums(path, (DRAFTER_FILE,))
    return load_file(path / DRAFTER_FILE)


def saved_recipe(checkpoint: Path) -> Recipe:
    """The Recipe a checkpoint was trained with (its recipe.yaml)."""
    import yaml

    from specctl.recipe import recipe_from_dict

    recipe_file = checkpoint / RECIPE_FILE
    if not recipe_file.is_file():
        raise DamagedCheckpoint(recipe_file, "missing; the checkpoint cannot be rebuilt without its recipe")
    try:
        tree = yaml.safe_load(recipe_file.read_text()) or {}
    except (OSError, ValueError, yaml.YAMLError) as e:  # UnicodeDecodeError is a ValueError
        raise DamagedCheckpoint(recipe_file, f"unreadable ({first_line(e)})") from None
    try:
        return recipe_from_dict(tree, RECIPE_FILE)
    except RecipeError as e:
        raise DamagedCheckpoint(recipe_file, f"not a valid recipe ({first_line(e)})") from None


def drafter_settings(recipe: Recipe, algo: str) -> dict[str, Any]:
    """What defines the `algo` drafter in a recipe: its own section, the shared draft vocabulary and
    mask token. Training settings (steps, learning rate, cadence) are not: they may change on resume."""
    d = recipe.drafter
    own = getattr(d, algo).model_dump(mode="json")
    return {"drafter": {algo: own, "draft_vocab_size": d.draft_vocab_size, "mask_token_id": d.mask_token_id}}


# Training settings that change neither the weights nor the learning curve (cadence of saving and
# logging, where metrics go, when a streak of skipped steps stops the run, how long a collective may
# wait); per_algo is applied by `for_algo`, not compared itself.
BOOKKEEPING = frozenset(
    {
        "per_algo",
        "save_every",
        "log_every",
        "keep_checkpoints",
        "report_to",
        "max_skipped_steps",
        "collective_timeout_minutes",
    }
)


def training_settings(recipe: Recipe, algo: str) -> dict[str, Any]:
    """How the `algo` drafter is trained in a recipe (its `per_algo` entry applied), bookkeeping
    aside: two runs with equal settings train the same weights on the same schedule."""
    return recipe.train.for_algo(algo).model_dump(mode="json", exclude=set(BOOKKEEPING))


def resume_line(checkpoint: Path, recipe: Recipe, explicit: bool) -> str:
    """The one line train says when it continues from `checkpoint` under `recipe`.

    A plain rerun (a requeued job) continues only when the training settings are the ones the
    checkpoint was saved with: otherwise SpecctlError naming those that differ, since continuing
    would train on another schedule than either run describes. `explicit` (`--resume`) continues
    with the new settings, and the line names them (a longer run: the schedule follows the new
    max_steps, `optim.scheduler_at`)."""
    from specctl.recipe import config_diff

    algo, step = recipe.drafter.algo, step_of(checkpoint)
    before = {"train": training_settings(saved_recipe(checkpoint), algo)}
    now = {"train": training_settings(recipe, algo)}
    where = f"{checkpoint}: resuming at step {step} of {recipe.train.max_steps}"
    if before == now:
        return f"{where} (same training settings; --restart starts over)"
    if explicit:
        return f"{where} with changed training settings ({config_diff(before, now)})"
    raise SpecctlError(
        f"{checkpoint.parent.parent}: trained to step {step} with other training settings "
        f"({config_diff(before, now)}); pass --resume to continue with the new ones, or --restart to "
        "start over"
    )


def remove_checkpoints(root: Path) -> None:
    """Delete the checkpoints train wrote under `root` (`train --restart`): `latest` first, then
    every step-N directory and the leftovers of interrupted writes. A step-N train cannot prove it
    wrote (`OWNER`) is left: train refuses to start beside one (`check_checkpoint_dirs`)."""
    if not root.is_dir():
        return
    (root / LATEST).unlink(missing_ok=True)
    recover_dirs(root)
    for tmp in root.glob(f".{LATEST}.tmp-*"):
        tmp.unlink(missing_ok=True)
    for path in root.glob("step-*"):
        if step_of(path) is not None and OWNER.owns(path):
            shutil.rmtree(path)


def check_resumable(checkpoint: Path, recipe: Recipe) -> None:
    """Refuse to resume a checkpoint as a different drafter. Shapes alone do not catch it: a DFlash
    block of 8 and one of 4 have the same weights, so the run would go on training (and export) a
    drafter its recipe does not describe."""
    from specctl.recipe import config_diff

    algo = recipe.drafter.algo
    before, now = drafter_settings(saved_recipe(checkpoint), algo), drafter_settings(recipe, algo)
    if before != now:
        raise SpecctlError(
            f"{checkpoint}: trained as another {algo} drafter than the recipe describes "
            f"({config_diff(before, now)}); resume with the recipe it was trained with "
            f"(`specctl train {checkpoint / RECIPE_FILE} --resume`), or train with --restart to start over"
        )


def drafter_from_checkpoint(checkpoint: Path) -> tuple[nn.Module, Any, dict[str, Any]]:
    """Rebuild a trained drafter from a training checkpoint, without loading the verifier:
    (module in eval mode, the checkpoint's recipe, its meta.json).

    The module is built from the checkpoint's recipe and VerifierSpec on the meta device, then the
    saved state is assigned into it; the verifier tensors it borrows stay meta (they are never
    exported). The verifier name is replaced by the hub id when one is known.
    """
    import dataclasses

    from accelerate import init_empty_weights

    from specctl.speculators.validate import meta_weights
    from specctl.verifier import verifier_reference

    meta = read_meta(checkpoint)
    algo = meta.get("algo")
    if algo not in DRAFTERS:
        raise SpecctlError(
            f"{checkpoint}: checkpoint of unknown algorithm {algo!r}; known: {', '.join(DRAFTERS)}"
        )
    recipe = saved_recipe(checkpoint)
    try:
        verifier = VerifierSpec.from_dict(meta["verifier"])
    except (KeyError, TypeError) as e:
        raise SpecctlError(
            f"{checkpoint}: meta.json does not describe the verifier ({first_line(e)})"
        ) from None
    verifier = dataclasses.replace(verifier, name_or_path=verifier_reference(verifier.name_or_path))
    state = load_drafter_state(checkpoint)
    loss = meta.get("loss", recipe.train.loss)  # older checkpoints: the recipe's
    with init_empty_weights():
        module = DRAFTERS[algo].build(
            getattr(recipe.drafter, algo),
            verifier,
            meta_weights(verifier.vocab_size, verifier.hidden_size),
            state.get("d2t"),
            loss,
        )
    own = module.state_dict()
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    misshapen = sorted(n for n in own.keys() & state.keys() if own[n].shape != state[n].shape)
    if missing or unexpected or misshapen:
        raise SpecctlError(
            f"{checkpoint}: the saved drafter does not fit the {algo} drafter its recipe describes "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]}, other shape {misshapen[:5]})"
        )
    module.load_state_dict(state, strict=True, assign=True)
    return module.eval(), recipe, meta


# ---------------------------------------------------------------- checksums


def write_checksums(path: Path) -> None:
    sums = {name: sha256_file(path / name) for name in CHECKSUMMED}
    (path / CHECKSUM_FILE).write_text(json.dumps(sums, indent=1) + "\n")


def checksum_problem(path: Path, names: tuple[str, ...] = CHECKSUMMED) -> tuple[str, str] | None:
    """(file name, what is wrong) for the first of `names` that does not match checksums.json, or
    for checksums.json itself; None when all match. The state files must be listed; recipe.yaml and
    meta.json are checked when listed (checkpoints from before they were are only parsed)."""
    try:
        sums = json.loads((path / CHECKSUM_FILE).read_text())
        expected = {name: sums[name] for name in names if name in STATE_FILES or name in sums}
    except (OSError, ValueError, KeyError, TypeError):
        return CHECKSUM_FILE, "missing or unreadable"
    for name, digest in expected.items():
        try:
            actual = sha256_file(path / name)
        except OSError as e:
            return name, f"unreadable ({first_line(e)})"
        if actual != digest:
            return name, "checksum mismatch (corrupted)"
    return None


def verify_checksums(path: Path, names: tuple[str, ...] = CHECKSUMMED) -> None:
    """Raise DamagedCheckpoint naming the first of `names` whose sha256 differs from checksums.json."""
    problem = checksum_problem(path, names)
    if problem is not None:
        raise DamagedCheckpoint(path / problem[0], problem[1])


def checkpoint_problem(path: Path) -> str | None:
    """Why resume cannot use the checkpoint at `path` (one short phrase naming the file), or None:
    a file missing, one that differs from its checksum, a meta.json or recipe.yaml that does not
    parse. Hashes every file, so it costs a read of the checkpoint."""
    missing = [name for name in (*REQUIRED, RECIPE_FILE) if not (path / name).is_file()]
    if missing:
        return f"incomplete: no {', '.join(missing)}"
    if (problem := checksum_problem(path)) is not None:
        return f"{problem[0]}: {problem[1]}"
    try:
        read_meta(path)
        saved_recipe(path)
    except DamagedCheckpoint as e:
        return f"{e.file.name}: {e.reason}"
    return None


def resume_candidates(root: Path) -> list[Path]:
    """Checkpoints resume may take, best first: the one `latest` names, then the complete step-N
    below it, newest first (any above it are left over from another run). Without a usable
    pointer, every complete step-N, newest first."""
    done = sorted((p for p in root.glob("step-*") if is_complete(p)), key=lambda p: -(step_of(p) or 0))
    pointer = root / LATEST
    named = root / pointer.read_text().strip() if pointer.is_file() else None
    if named is None or step_of(named) is None or not named.is_dir():
        return done
    below = [p for p in done if (step_of(p) or 0) < (step_of(named) or 0)]
    return [named, *below]


def pick_resume_checkpoint(root: Path, say: Callable[[str], None]) -> Path | None:
    """The newest checkpoint under `root` that verifies (`checkpoint_problem`), after one line via
    `say` for each newer one skipped and why; None when there is none at all, CheckpointError
    when none of them verifies."""
    skipped = []
    for path in resume_candidates(root):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        say(f"{path}: skipped for resume ({problem}); trying the checkpoint before it")
        skipped.append(f"{path.name} ({problem})")
    if skipped:
        raise CheckpointError(
            f"{root}: no checkpoint verifies ({'; '.join(skipped)}); train with --restart to start over"
        )
    return None


def resume_checkpoint(root: Path, ctx: DistContext) -> Path | None:
    """`pick_resume_checkpoint` on rank 0 (its lines printed there), the same answer on every rank:
    one rank hashes the checkpoints, the others do not read them."""
    found: Path | None = None
    error = None
    if ctx.is_main:
        try:
            found = pick_resume_checkpoint(root, lambda text: note(text))
        except CheckpointError as e:
            error = str(e)
    found, error = broadcast_object((found, error), ctx)
    if error is not None:
        raise CheckpointError(error)
    return found


# ---------------------------------------------------------------- save


def _write_latest(root: Path, name: str) -> None:
    write_atomic(root / LATEST, name + "\n")


def _torch_save(obj: Any, path: Path) -> None:
    # through a Python file: a refused write then surfaces as an OSError with its errno
    with open(path, "wb") as f:
        torch.save(obj, f)


def prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints (and whatever `latest` names); drop leftovers
    of interrupted writes. A step-N directory train cannot prove it wrote (`OWNER`) is never
    deleted (train refused to start beside one: `check_checkpoint_dirs`)."""
    recover_dirs(root)  # step dirs a kill caught mid-write or mid-swap
    for tmp in root.glob(f".{LATEST}.tmp-*"):
        tmp.unlink(missing_ok=True)
    steps = sorted((p for p in root.glob("step-*") if step_of(p) is not None), key=lambda p: step_of(p) or 0)
    pointer = root / LATEST
    current = pointer.read_text().strip() if pointer.is_file() else None
    for old in steps[:-keep] if keep > 0 else steps:
        if old.name != current and OWNER.owns(old):
            shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    recipe_yaml: str,
    meta: dict[str, Any],
    ctx: DistContext,
    keep: int,
) -> Path:
    """Gather the full state on rank 0 (a collective: every rank calls this) and write step-N/.

    A full disk (or file size limit) raises CheckpointError naming the file and the checkpoint
    a rerun continues from; the temporary directory is removed, the previous
    checkpoints are untouched.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    path = root / f"step-{step}"
    error: Exception | None = None
    if ctx.is_main:
        try:
            _write_checkpoint(root, step, model_state, optim_state, trainer_state, recipe_yaml, meta)
            prune(root, keep)
        except Exception as e:
            error = e
    # Every rank learns whether rank 0 saved: raising on rank 0 alone would leave the others
    # waiting in the next collective until the process group's timeout (train.collective_timeout_minutes).
    failed = broadcast_object(None if error is None else str(error) or type(error).__name__, ctx)
    if error is not None:
        raise error
    if failed is not None:
        raise CheckpointError(f"{path.name}: rank 0 could not save the checkpoint: {failed}")
    return path


def _write_checkpoint(
    root: Path,
    step: int,
    model_state: dict[str, Any],
    optim_state: dict[str, Any],
    trainer_state: dict[str, Any],
    recipe_yaml: str,
    meta: dict[str, Any],
) -> None:
    """Rank 0: every file of step-N through `replace_dir`, then `latest`."""
    path = root / f"step-{step}"
    root.mkdir(parents=True, exist_ok=True)
    # clone: safetensors refuses tensors that share storage (tied weights)
    drafter_state = {k: v.detach().clone().contiguous() for k, v in model_state.items()}
    files = (
        (DRAFTER_FILE, lambda f: save_file(drafter_state, str(f))),
        (OPTIMIZER_FILE, lambda f: _torch_save(optim_state, f)),
        (TRAINER_FILE, lambda f: _torch_save({**trainer_state, "rng": rng_state()}, f)),
        (RECIPE_FILE, lambda f: f.write_text(recipe_yaml)),
        (META_FILE, lambda f: f.write_text(json.dumps({**meta, "step": step}, indent=2) + "\n")),
        (CHECKSUM_FILE, lambda f: write_checksums(f.parent)),
    )
    writing = path

    def write(tmp: Path) -> None:
        nonlocal writing
        for name, write_file in files:
            writing = path / name
            write_file(tmp / name)
        writing = path

    try:
        replace_dir(path, write, OWNER)  # re-saving a step (after resuming from it) swaps it whole
        writing = root / LATEST
        _write_latest(root, path.name)
    except Exception as e:
        if not disk_full(e):
            raise
        previous = latest_checkpoint(root)
        resume = f"it continues from {previous.name}" if previous else "none was saved yet: it starts over"
        raise CheckpointError(
            f"{writing}: disk full, checkpoint {path.name} not saved; free space and rerun the same "
            f"command ({resume})"
        ) from None


# ---------------------------------------------------------------- load


def load_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext, verified: bool = False
) -> dict[str, Any]:
    """Restore drafter, optimizer and RNG states from `path` (read on rank 0, broadcast to the rest);
    returns the trainer state (step, cursor, scheduler, ...). Works across world sizes. `verified`:
    the checksums were just checked (`resume_checkpoint`); hashing gigabytes twice buys nothing."""
    model_state: dict[str, Any] = {}
    optim_state: dict[str, Any] = {}
    trainer_bytes = None
    if ctx.is_main:
        if not verified:
            verify_checksums(path)
        model_state = load_file(path / DRAFTER_FILE)
        optim_state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        trainer_bytes = (path / TRAINER_FILE).read_bytes()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=ctx.distributed)
    try:
        set_model_state_dict(model, model_state, options=options)
    except RuntimeError as e:
        raise CheckpointError(
            f"{path}: checkpoint does not fit this drafter ({first_line(e)}); "
            "was the drafter section of the recipe changed since it was saved?"
        ) from None
    set_optimizer_state_dict(model, optimizer, optim_state, options=options)
    # broadcast the file's bytes: pickled tensors do not survive broadcast_object_list
    trainer_bytes = broadcast_object(trainer_bytes, ctx)
    trainer_state = torch.load(io.BytesIO(trainer_bytes), map_location="cpu", weights_only=True)
    set_rng_state(trainer_state["rng"])
    return trainer_state
