"""The training loop: one loop for every drafter, offline (feature store) or online (verifier in the loop).

The loop only sees the drafter contract (`specctl.drafters.api`): build it from the recipe,
call `forward(batch) -> (loss, metrics)`, and read `metrics["correct"]` / `["count"]` at
validation. Everything else is shared: token-budget batching, gradient accumulation, AdamW or
Muon, warmup + decay, clipping, bf16 autocast (train.precision), DDP/FSDP2 under torchrun, checkpoints
with exact resume, metrics.jsonl (copied to the `train.report_to` tracker) and a live progress view.

Reproducibility: the torch RNG is reseeded from (train.seed, global micro-batch index) before
each micro-batch, so whatever a drafter samples (anchors, sparsified rows) depends only on which
micro-batch it is, not on the rank that runs it or on where a run was interrupted. With the data
cursor and optimizer state in the checkpoint, a resumed run repeats an uninterrupted one, and
W ranks x A accumulation steps see the same global batches as one rank with W*A. Python's `random`
and numpy's global RNG, which checkpoints also save and restore, are seeded from train.seed once
when the run starts (checkpoint.seed_rngs).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specctl import devices, distributed, interrupts
from specctl.batching import length_buckets
from specctl.checkpoint import (
    check_checkpoint_dirs,
    check_resumable,
    latest_checkpoint,
    load_checkpoint,
    remove_checkpoints,
    resume_checkpoint,
    resume_line,
    save_checkpoint,
    seed_rngs,
)
from specctl.data import load_samples, load_token_freq, prepare_data
from specctl.distributed import DistContext, all_reduce_sum
from specctl.drafters import DRAFTERS
from specctl.drafters.api import VerifierSpec, VerifierWeights, as_module
from specctl.drafters.targets import build_draft_vocab
from specctl.durable import write_atomic
from specctl.errors import DataError, FeatureStoreError, RecipeError, SpecctlError, UsageError
from specctl.features import STORED_KEYS, FeatureStore, Layout, all_finite, decode_features, open_features
from specctl.optim import build_optimizer, build_scheduler, scheduler_at, vocab_sizes
from specctl.origin import FeatureOrigin
from specctl.progress import note
from specctl.recipe import Recipe, dump_recipe
from specctl.recipe_origin import check_store_origin
from specctl.resources import check_stage
from specctl.runlock import RunLocked, run_lock
from specctl.train.curves import plot_curves, read_curve
from specctl.train.loader import StepSampler, collate, data_workers, micro_batch_at, micro_batches, pieces
from specctl.train.tracking import Tracker, check_tracker, open_tracker
from specctl.verifier import (
    BorrowedVerifier,
    Verifier,
    capture_hidden_states,
    check_aux_layer_ids,
    config_hash,
    default_aux_layer_ids,
    load_borrowed,
    load_verifier,
    locate_verifier,
    recipe_verifier_spec,
    resolve_mask_token_id,
    verifier_weights,
)


@dataclass
class TrainSummary:
    algo: str
    steps: int
    loss: float | None  # training loss of the last logged step
    val_loss: float | None
    tau_hat: float | None  # 1 + sum_k prod_{i<=k} acc_i at the last validation
    val_acc_per_position: list[float] | None
    run_dir: Path
    output_dir: Path  # run_dir/drafters/<algo>: checkpoints/, metrics.jsonl
    checkpoint: Path | None


# ---------------------------------------------------------------- pure pieces


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded train/validation split of n samples: (train, val), each ascending.

    Holds out round(n * val_fraction) samples, at least one when val_fraction > 0 and n > 1.
    """
    num_val = round(n * val_fraction)
    if val_fraction > 0 and n > 1:
        num_val = min(max(num_val, 1), n - 1)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[num_val:]), sorted(order[:num_val])


def micro_batch_seed(seed: int, cursor: int) -> int:
    """Torch seed of the cursor-th micro-batch: independent of rank and of interruptions."""
    return (seed * 2**32 + cursor) % 2**63


def tokens_field(seen: int | None) -> dict[str, int]:
    """`tokens_seen` for a metrics record: training tokens consumed so far, all ranks (absent when a
    run resumed from a checkpoint that did not count them)."""
    return {} if seen is None else {"tokens_seen": seen}


def tau_hat(acc_per_position: list[float]) -> float:
    """Expected accepted length from per-position accuracies: 1 + sum_k prod_{i<=k} acc_i
    (the bonus token counts; accuracy at position k assumes every earlier draft was accepted)."""
    total, run = 1.0, 1.0
    for acc in acc_per_position:
        run *= acc
        total += run
    return total


# ---------------------------------------------------------------- where samples come from


@dataclass
class Source:
    """The training data as the loop sees it: lengths (for batching) and batches on a device.

    Offline, samples come from the feature store with their hidden states, as stored; online, from
    the data stage's token samples, and `featurize` runs the verifier on each batch.
    """

    lengths: list[int]
    sample: Callable[[int], dict[str, torch.Tensor]]  # host side; runs in DataLoader workers
    featurize: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    spec: VerifierSpec
    weights: VerifierWeights
    features_path: Path | None = None
    origin: FeatureOrigin | None = None  # the feature store's (offline; checkpoints carry it)

    def batch(self, indices: list[int], device: torch.device, max_tokens: int) -> dict[str, torch.Tensor]:
        return self.on_device(collate([self.sample(i) for i in indices], max_tokens), device)

    def on_device(self, batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        """A padded host batch (`collate`) as drafters read it: on `device`, its stored features
        decoded there (fp8 crosses as fp8), hidden states float32 (autocast picks the compute dtype)."""
        batch = decode_features({k: v.to(device, non_blocking=True) for k, v in batch.items()})
        batch = self.featurize(batch)
        for k in ("aux_hidden_states", "last_hidden_state"):
            if k in batch:  # a top-k store has no last_hidden_state
                batch[k] = batch[k].float()
        return batch


def open_source(recipe: Recipe, ctx: DistContext, progress: bool) -> Source:
    """The verifier (its spec and frozen tensors are what every drafter is built from), then the
    feature store (offline) or the data stage's samples (online), checking they fit.

    Offline reads only the tensors drafters borrow (`load_borrowed`): no rank builds the verifier.
    Online runs it, so every rank loads it whole.
    """
    # rank 0 first: it may download or convert the model into a shared cache (for hours)
    with distributed.main_first(ctx, "loading the verifier"):
        preflight(recipe)
        # each rank holds the verifier's borrowed tensors (offline) or the whole verifier (online) on
        # its own GPU: verifier.tensor_parallel_size is for the collect and data stages, and a rank's
        # GPU group would overlap its neighbours'
        section = recipe.verifier.model_copy(update={"device": str(ctx.device), "tensor_parallel_size": 1})
        offline = recipe.train.mode == "offline"
        verifier = load_borrowed(section) if offline else load_verifier(section)
    spec = recipe_verifier_spec(verifier, recipe)
    if isinstance(verifier, BorrowedVerifier):
        path = recipe.run_dir / "features"
        store = open_store(path, spec, config_hash(verifier.config), Layout.from_section(recipe.features))
        origin = check_store_origin(path, store, recipe, verifier)  # refuses another verifier's or data's
        verify_store(store, ctx)
        samples = FiniteSamples(store, path)
        return Source(list(store.lengths), samples, identity, spec, verifier.weights, path, origin)
    return online_source(recipe, ctx, verifier, spec, progress)


def identity(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return batch


def online_source(
    recipe: Recipe, ctx: DistContext, verifier: Verifier, spec: VerifierSpec, progress: bool
) -> Source:
    """The data stage's token samples (rank 0 prepares them), featurized by the verifier per batch."""
    data_dir = recipe.run_dir / "data"
    with distributed.main_first(ctx, "preparing the data"):  # hours of generation, on rank 0 alone
        if ctx.is_main:  # reuses a complete data dir for the same recipe; builds it otherwise
            prepare_data(recipe.data, verifier.tokenizer, data_dir, model=verifier.model, progress=progress)
    samples = load_samples(data_dir)
    if not any(bool(s["loss_mask"].any()) for s in samples):
        raise DataError(f"{data_dir}: no sample has a loss-masked (assistant) token; nothing to train on")
    aux_ids = spec.aux_layer_ids

    @torch.no_grad()
    def featurize(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        aux, last = capture_hidden_states(
            verifier.model, batch["input_ids"], batch["attention_mask"].long(), aux_ids
        )
        # clone: inference-mode tensors cannot be saved for the drafter's backward
        return {**batch, "aux_hidden_states": aux.clone(), "last_hidden_state": last.clone()}

    lengths = [len(s["input_ids"]) for s in samples]
    return Source(lengths, samples.__getitem__, featurize, spec, verifier_weights(verifier))


def verify_store(store: FeatureStore, ctx: DistContext) -> None:
    """Check every shard's sha256 once for the run on each machine, split over its ranks, before any
    batch is read; after that every rank reads the store unchecked (`store.verify` off, in DataLoader
    workers too).

    Still safe: every shard a rank will read is hashed on that rank's machine before training starts
    (each machine may hold its own copy of the run directory, docs/training.md), and a corrupted
    shard stops every rank with the same one-line error naming the file. Local rank l of L hashes
    shards j = l mod L: 1/L of the store each, instead of every rank hashing each shard it opens;
    the ranks finish together, well inside a collective's timeout. A shard unchanged since it last
    verified is not hashed again (`FeatureStore.verify_shards`'s records): a requeue starts at once.
    """
    error = None
    try:
        shards = range(ctx.local_rank, len(store.manifest.shards), ctx.local_world_size)
        store.verify_shards(shards, remember=True)
    except FeatureStoreError as e:
        error = str(e)
    errors = [e for e in distributed.gather_objects(error, ctx) if e is not None]
    if errors:
        raise FeatureStoreError(errors[0])
    store.verify = False


def open_store(
    path: Path, spec: VerifierSpec, verifier_config_hash: str | None = None, layout: Layout | None = None
):
    """The feature store at `path`, checked against the verifier and recipe it will train with
    (and against the recipe's features layout, when given)."""
    if not (path / "manifest.json").is_file() and not (path / "plan.json").is_file():
        raise FeatureStoreError(
            f"{path}: no feature store; run `specctl collect-hidden-states RECIPE` first "
            "(or set train.mode=online)"
        )
    store = open_features(path, layout=layout)  # names an incomplete store / a layout mismatch itself
    manifest = store.manifest
    if manifest.hidden_size != spec.hidden_size:
        raise FeatureStoreError(
            f"{path}: features have hidden size {manifest.hidden_size} (verifier {manifest.verifier}) but "
            f"verifier {spec.name_or_path} has {spec.hidden_size}; re-run collect-hidden-states for it"
        )
    if tuple(manifest.aux_layer_ids) != tuple(spec.aux_layer_ids):
        raise FeatureStoreError(
            f"{path}: features hold aux layers {list(manifest.aux_layer_ids)} but the recipe asks for "
            f"{list(spec.aux_layer_ids)} (features.aux_layer_ids); re-run collect-hidden-states or match them"
        )
    if verifier_config_hash is not None and manifest.verifier_config_hash != verifier_config_hash:
        raise FeatureStoreError(
            f"{path}: features come from verifier {manifest.verifier} "
            f"(config {manifest.verifier_config_hash}) but the recipe's verifier {spec.name_or_path} "
            f"has config {verifier_config_hash}; re-run collect-hidden-states for this verifier"
        )
    if len(store) == 0:
        raise FeatureStoreError(f"{path}: the feature store holds no samples; re-run collect-hidden-states")
    return store


class FiniteSamples:
    """store.row(i), refusing NaN/Inf features and naming the shard and sample that hold them.

    A verifier run in float16 can overflow, and a store may come from another tool: the
    checksums match what was written, NaN included. Unchecked, the loss turns NaN some steps
    later with no hint where from. Each sample is checked the first time it is read (one pass
    over the store, like the shard checksums), before it reaches a batch. Rows stay as stored
    (fp8 aux states, uint16 ids): training decodes them on its device. A class, not a closure:
    DataLoader workers may get it pickled.
    """

    def __init__(self, store: FeatureStore, path: Path):
        self.store, self.path = store, path
        self.checked = bytearray(len(store))

    def __call__(self, i: int) -> dict[str, torch.Tensor]:
        s = self.store.row(i)
        if self.checked[i]:
            return s
        for key in STORED_KEYS:
            if key in s and not all_finite(s[key]):
                manifest = self.store.manifest
                shards = zip(manifest.shards, manifest.shard_files, strict=True)
                (start, _), info = next(((a, b), f) for (a, b), f in shards if a <= i < b)
                raise FeatureStoreError(
                    f"{self.path / info['file']}: sample {i - start} (store sample {i}) holds NaN/Inf in "
                    f"{key}; delete {self.path} and collect again with verifier.dtype float32 or bfloat16 "
                    "(float16 can overflow)"
                )
        self.checked[i] = 1
        return s


def check_draft_vocab_size(size: int | None, vocab_size: int) -> None:
    if size is not None and size > vocab_size:
        raise RecipeError(
            f"drafter.draft_vocab_size={size} exceeds the verifier's vocabulary of {vocab_size}"
        )


def preflight(recipe: Recipe) -> None:
    """Check the recipe against the verifier's config.json alone, before any heavy work.

    Layer ids, the mask token and the draft vocabulary are otherwise checked after the verifier's
    weights, the data and the feature store are loaded: a typo should cost a second, not a model
    load. A config that cannot be read is left to load_verifier, which says what to pass instead.
    """
    from transformers import AutoConfig

    check_tracker(recipe.train.report_to)
    section = recipe.verifier
    source, _ = locate_verifier(section.name_or_path, section.revision)
    try:
        config = AutoConfig.from_pretrained(
            source, revision=section.revision, trust_remote_code=section.trust_remote_code
        )
    except (OSError, ValueError):
        return
    num_layers = config.num_hidden_layers
    check_aux_layer_ids(recipe.features.aux_layer_ids or default_aux_layer_ids(num_layers), num_layers)
    if recipe.drafter.mask_token_id is not None:  # None is resolved from the tokenizer, at load
        resolve_mask_token_id(None, config, recipe.drafter.mask_token_id)
    check_draft_vocab_size(recipe.drafter.draft_vocab_size, config.vocab_size)


def draft_vocab(recipe: Recipe, vocab_size: int) -> torch.Tensor | None:
    """d2t offsets of the `drafter.draft_vocab_size` most frequent assistant tokens (None = full vocab)."""
    size = recipe.drafter.draft_vocab_size
    if size is None:
        return None
    check_draft_vocab_size(size, vocab_size)
    freq = load_token_freq(recipe.run_dir / "data", vocab_size)[:vocab_size]
    return build_draft_vocab(freq, size)[0]


# ---------------------------------------------------------------- validation, logs, live view


@torch.no_grad()
def validate(
    model: nn.Module, source: Source, buckets: list[list[int]], ctx: DistContext, max_tokens: int, autocast
) -> dict[str, Any] | None:
    """Mean loss over validation micro-batches and per-position accuracy over all their predictions.

    Every rank runs the same number of forwards (FSDP2 gathers weights collectively): ranks
    short of a batch repeat one with weight 0.
    """
    if not buckets:
        return None
    model.eval()
    rounds = math.ceil(len(buckets) / ctx.world_size)
    sums = None
    for r in range(rounds):
        i = r * ctx.world_size + ctx.rank
        weight = 1.0 if i < len(buckets) else 0.0
        batch = source.batch(buckets[min(i, len(buckets) - 1)], ctx.device, max_tokens)
        with autocast:
            loss, metrics = model(batch)
        part = (
            torch.cat(
                [
                    loss.detach().float().view(1),
                    torch.ones(1, device=ctx.device),
                    metrics["correct"].float(),
                    metrics["count"].float(),
                ]
            )
            * weight
        )
        sums = part if sums is None else sums + part
    all_reduce_sum(sums, ctx)
    K = (len(sums) - 2) // 2
    correct, count = sums[2 : 2 + K], sums[2 + K :]
    acc = (correct / count.clamp(min=1)).tolist()
    return {"val_loss": (sums[0] / sums[1]).item(), "val_acc_per_position": acc, "tau_hat": tau_hat(acc)}


def _json_line(line: str) -> dict[str, Any] | None:
    """One record of metrics.jsonl; None for a blank line or one cut off by a kill or a full disk
    (only ever the last line: every record is appended whole)."""
    try:
        record = json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


@dataclass
class MetricsLog:
    """metrics.jsonl (one JSON object per line), each line also sent to the `train.report_to`
    tracker; rank 0 only.

    On resume, lines after the resumed step (written by the interrupted run) are dropped so
    the file reads as one uninterrupted run.
    """

    path: Path
    enabled: bool
    last: dict[str, Any] = field(default_factory=dict)  # latest values seen, for the summary
    tracker: Tracker | None = None

    def open(self, keep_until: int | None) -> MetricsLog:
        if not self.enabled:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if keep_until is not None and self.path.is_file():
            kept = [r for r in map(_json_line, self.path.read_text().splitlines()) if r is not None]
            kept = [r for r in kept if r.get("step", keep_until + 1) <= keep_until]
        # a kill mid-rewrite keeps the old log
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept), durable=False)
        for r in kept:
            self.last.update(r)
        return self

    def write(self, record: dict[str, Any]) -> None:
        self.last.update(record)
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tracker is not None:
            self.tracker.log(record)

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.finish()


@contextlib.contextmanager
def live_view(enabled: bool, total: int, start: int) -> Iterator[Callable[..., None]]:
    """Step/max, loss, lr, tokens/s and the last tau_hat: a rich bar on a terminal, plain lines at a
    steady interval in a log file (specctl.progress); yields update(**fields)."""
    if not enabled:
        yield lambda **_: None
        return
    from specctl.progress import progress_bar

    fields = (("loss", "loss"), ("lr", "lr"), ("tok/s", "tps"), ("tau", "tau"))
    with progress_bar("step", fields=fields) as bar:
        task = bar.add_task("train", total=total, completed=start, loss="-", lr="-", tps="-", tau="-")
        yield lambda **fields: bar.update(task, **fields)


# ---------------------------------------------------------------- the loop

RESTARTING = ".restarting"  # in drafters/<algo>/ while `--restart` removes the earlier run


def run_training(
    recipe: Recipe, resume: bool = False, progress: bool = True, force: bool = False, restart: bool = False
) -> TrainSummary | None:
    """Train `recipe.drafter.algo` as the recipe says (`train.per_algo` included); under torchrun,
    on every rank. A rerun continues the drafter's checkpoints (`starting_point`: `resume` also
    with changed training settings, `restart` starts over). `force` starts even when the plan says
    the step will not fit this machine.

    Returns the summary on rank 0 and None on the other ranks (which write and print nothing).
    """
    ctx = distributed.setup(
        recipe.verifier.device, timedelta(minutes=recipe.train.collective_timeout_minutes)
    )
    finished = False
    try:
        summary = train(recipe.for_training(), ctx, resume, progress, force, restart)
        finished = True
        return summary
    finally:
        distributed.teardown(ctx, together=finished)


@dataclass
class Pieces:
    """What the loop trains and with what: built once per run, identically on every rank."""

    source: Source
    model: nn.Module  # the drafter, wrapped for DDP / FSDP2 when distributed
    optimizer: torch.optim.Optimizer
    scheduler: Any
    buckets: list[list[int]]  # training micro-batches (sample indices)
    val_buckets: list[list[int]]
    meta: dict[str, Any]  # what every checkpoint records about the run
    autocast: Any


def build_pieces(recipe: Recipe, ctx: DistContext, progress: bool) -> Pieces:
    """Data, drafter (seeded init: identical weights on every rank), optimizer, schedule, batches."""
    cfg, algo = recipe.train, recipe.drafter.algo
    source = open_source(recipe, ctx, progress)
    d2t = draft_vocab(recipe, source.spec.vocab_size)
    seed_rngs(cfg.seed)  # torch, Python's and numpy's: what checkpoints save and a resume restores
    built = DRAFTERS[algo].build(getattr(recipe.drafter, algo), source.spec, source.weights, d2t, cfg.loss)
    drafter = as_module(built)
    if cfg.activation_checkpointing:
        distributed.checkpoint_layers(drafter)
    model = distributed.wrap(drafter.to(ctx.device), ctx, cfg.parallelism)
    optimizer = build_optimizer(drafter, cfg, vocab_sizes(source.spec.vocab_size, d2t))
    train_ids, val_ids = split_indices(len(source.lengths), cfg.val_fraction, cfg.seed)
    buckets = length_buckets(source.lengths, cfg.batch_tokens, train_ids)
    if not buckets:
        raise DataError(
            f"no training samples ({len(source.lengths)} in all, train.val_fraction={cfg.val_fraction})"
        )
    dtype = devices.compute_dtype(ctx.device, cfg.precision)
    meta = {
        "algo": algo,
        "loss": cfg.loss,
        "world_size": ctx.world_size,
        "parallelism": cfg.parallelism,
        "verifier": asdict(source.spec),
        "features": str(source.features_path) if source.features_path else None,
        "features_origin": source.origin.to_json() if source.origin else None,
        "compute_dtype": str(dtype).removeprefix("torch."),
    }
    return Pieces(
        source,
        model,
        optimizer,
        build_scheduler(optimizer, cfg),
        buckets,
        length_buckets(source.lengths, cfg.batch_tokens, val_ids),
        meta,
        devices.autocast(ctx.device, dtype),
    )


@dataclass
class StepFigures:
    """One optimizer step, summed over ranks: mean micro-batch loss, counted predictions, tokens."""

    loss: float
    counted: float
    tokens: int
    grad_norm: float | None  # total, before clipping; None when the loss was not finite
    skipped: bool = False  # the gradients held NaN/Inf: nothing was applied


@dataclass
class Skips:
    """Steps skipped for non-finite gradients: in all (metrics.jsonl's `skipped_steps`) and in a row.
    Kept in checkpoints, so a resumed run counts (and stops) as an uninterrupted one."""

    total: int = 0
    in_a_row: int = 0

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Skips:
        return cls(state.get("skipped_steps", 0), state.get("skipped_in_a_row", 0))

    def state(self) -> dict[str, int]:
        return {"skipped_steps": self.total, "skipped_in_a_row": self.in_a_row}

    def count(self, s: StepFigures, step: int, limit: int) -> str | None:
        """Count optimizer step `step`: the warning line when it was skipped (None otherwise);
        SpecctlError naming it when it is the `limit`-th skipped in a row."""
        if not s.skipped:
            self.in_a_row = 0
            return None
        self.total, self.in_a_row = self.total + 1, self.in_a_row + 1
        if self.in_a_row >= limit:
            raise SpecctlError(
                f"step {step}: gradients not finite (NaN/Inf) {self.in_a_row} steps in a row (steps "
                f"{step - self.in_a_row + 1}-{step}), none applied, so the checkpoints are sound; lower "
                f"train.lr and resume, or check the features for NaN/Inf (train.max_skipped_steps={limit})"
            )
        return (
            f"warning: step {step}: gradients not finite (norm {s.grad_norm}) with a finite loss "
            f"({s.loss:.4g}); step skipped, weights unchanged ({self.in_a_row} in a row, {self.total} in "
            f"all; train.max_skipped_steps={limit} in a row stop the run)"
        )


def optimizer_step(
    p: Pieces, cfg: Any, ctx: DistContext, cursor: int, batches: Iterator[dict[str, torch.Tensor]]
) -> StepFigures:
    """This rank's share of the step's micro-batches (the next items of `batches`, which starts at
    `cursor`; a micro-batch split into pieces by train.micro_batch_tokens is one item a piece):
    forward, backward (gradients synchronised on the last), clip, optimizer and scheduler step. Each
    micro-batch reseeds the RNG from its global index, so what it samples does not depend on the rank
    or on a resume; its pieces reseed from the same index. Under FSDP2 a rank with fewer pieces than
    a peer repeats its last one at weight 0 (`distributed.forwards_collective`)."""
    per_step = ctx.world_size * cfg.grad_accum
    p.model.train()
    work = step_work(p, cfg, cursor, ctx.rank)  # (micro-batch, piece weight), as the loader yields them
    forwards = len(work)
    if distributed.forwards_collective(p.model):  # every rank the most pieces of any rank this step
        forwards = max(len(step_work(p, cfg, cursor, r)) for r in range(ctx.world_size))
    totals = torch.zeros(3, device=ctx.device)  # loss sum, counted predictions, tokens
    batch: dict[str, torch.Tensor] = {}
    for n in range(forwards):
        padding = n >= len(work)  # a repeat of the last piece at weight 0: its collectives, no update
        i, weight = work[-1] if padding else work[n]
        seed = micro_batch_seed(cfg.seed, cursor + ctx.rank * cfg.grad_accum + i)
        torch.manual_seed(seed if weight == 1.0 else (seed + n * 2**40) % 2**63)
        batch = batch if padding else p.source.on_device(next(batches), ctx.device)
        weight = 0.0 if padding else weight
        with distributed.gradient_sync(p.model, enabled=n == forwards - 1):
            with p.autocast:
                loss, metrics = p.model(batch)
            (loss * weight / cfg.grad_accum).backward()
        counted = metrics["count"].sum().float() * (not padding)
        tokens = batch["attention_mask"].sum().float() * (not padding)
        totals += torch.stack([loss.detach().float() * weight, counted, tokens])
    loss_sum, counted, tokens = all_reduce_sum(totals, ctx).tolist()
    figures = StepFigures(loss_sum / per_step, counted, int(tokens), None)
    if not math.isfinite(figures.loss):  # before the update: the checkpoints stay finite
        return figures
    figures.grad_norm = apply_gradients(p, cfg.grad_clip)
    figures.skipped = not math.isfinite(figures.grad_norm)
    return figures


def step_work(p: Pieces, cfg: Any, cursor: int, rank: int) -> list[tuple[int, float]]:
    """Rank `rank`'s forwards of the step that starts at micro-batch `cursor`: (its micro-batch
    0..grad_accum-1, piece weight) per piece of train.micro_batch_tokens. Pure and the same on every
    rank (the buckets, lengths and seed are), so a rank knows its peers' counts without a collective."""
    work = []
    for i in range(cfg.grad_accum):
        indices = micro_batch_at(p.buckets, cursor + rank * cfg.grad_accum + i, cfg.seed)
        work += [(i, w) for _, w in pieces(indices, p.source.lengths, cfg.micro_batch_tokens)]
    return work


def apply_gradients(p: Pieces, grad_clip: float) -> float:
    """Clip and apply the accumulated gradients, step the schedule; returns their total norm.

    The norm is the same on every rank (DDP has averaged the gradients; FSDP2's shards are
    reduced), and so is what follows. A norm that is not finite means NaN/Inf in some gradient
    while the loss was finite (an overflow in the backward): clipping would scale every gradient
    by NaN and the optimizer would write it into the weights and its moments, and the next
    checkpoint would be NaN. So the step is skipped: gradients dropped, weights and optimizer
    state untouched. The schedule still steps: a skipped step is a step of the run (its data is
    consumed, it is counted), and step N's learning rate stays what the schedule says for N.
    """
    params = [q for q in p.model.parameters() if q.grad is not None]
    norm = nn.utils.get_total_norm([q.grad for q in params])  # what clip_grad_norm_ computes
    total = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if math.isfinite(total):
        if grad_clip > 0:
            nn.utils.clip_grads_with_norm_(params, grad_clip, norm)
        p.optimizer.step()
    with warnings.catch_warnings():  # a skipped first step: "scheduler.step() before optimizer.step()"
        warnings.simplefilter("ignore", UserWarning)
        p.scheduler.step()
    p.optimizer.zero_grad(set_to_none=True)
    return total


def check_step(s: StepFigures, step: int, first: bool) -> None:
    """Stop on a step that cannot be trained on: a non-finite loss (before the update was applied,
    so the last checkpoint is sound), or nothing counted in the first step of a run."""
    if not math.isfinite(s.loss):
        raise SpecctlError(
            f"step {step}: training loss is {s.loss}; lower train.lr or check the features for NaN/Inf"
        )
    if first and s.counted == 0:
        raise DataError(
            f"step {step}: the drafter found nothing to train on (zero counted predictions): no "
            "loss-masked tokens, or block/anchor settings too long for these sequences"
        )


def restore(
    p: Pieces, checkpoint: Path | None, ctx: DistContext, cfg: Any
) -> tuple[int, int, int | None, Skips]:
    """Where the loop starts: (optimizer steps done, micro-batches consumed (global, across ranks),
    training tokens seen (all ranks; the x axis of the learning curve), skipped steps); from
    `checkpoint` (verified by `resume_checkpoint`), its weights and optimizer loaded, the schedule
    of `cfg` (the train section) replayed up to its step (`scheduler_at`)."""
    if checkpoint is None:
        return 0, 0, 0, Skips()
    state = load_checkpoint(checkpoint, p.model, p.optimizer, ctx, verified=True)
    p.scheduler = scheduler_at(p.optimizer, cfg, state["step"])
    # tokens_seen None: a checkpoint from before the count was kept
    return state["step"], state["cursor"], state.get("tokens_seen"), Skips.from_state(state)


def start_over(out_dir: Path, say: Callable[[str], None]) -> None:
    """`train --restart`: remove what the drafter's earlier run left (checkpoints, metrics.jsonl,
    the learning curve) before anything new is written, so nothing of it survives into the new
    run: no stale step-N beside the new ones, no old metrics lines among the new. The marker
    makes it all or nothing: a removal cut short is finished by the next train, whatever its flags
    (otherwise a half-removed run would be resumed)."""
    marker = out_dir / RESTARTING
    if marker.exists():
        say(f"{out_dir}: finishing an interrupted --restart (removing the earlier run)")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(marker, "")
    remove_checkpoints(out_dir / "checkpoints")
    for name in ("metrics.jsonl", "learning-curve.png"):
        (out_dir / name).unlink(missing_ok=True)
    marker.unlink()
    say(f"{out_dir}: the earlier run's checkpoints and metrics removed; training from step 0")


def starting_point(
    recipe: Recipe, ctx: DistContext, out_dir: Path, resume: bool, restart: bool, say: Callable[[str], None]
) -> Path | None:
    """The checkpoint this run continues from (None: from step 0), decided before any work.

    Rerunning the same command continues (a requeued job): from the newest checkpoint that
    verifies, when the training settings are the ones it was saved with (`resume_line` refuses
    otherwise). `resume` (--resume) also continues with changed settings and needs a checkpoint;
    `restart` (--restart) removes the earlier run first (`start_over`)."""
    if resume and restart:
        raise UsageError("train: --resume and --restart contradict each other; pass one of them")
    ckpt_root = out_dir / "checkpoints"
    check_checkpoint_dirs(ckpt_root)
    if restart or (out_dir / RESTARTING).exists():
        with distributed.main_first(ctx, "removing the earlier run"):
            if ctx.is_main:
                start_over(out_dir, say)
        return None
    found = resume_checkpoint(ckpt_root, ctx)  # the newest that verifies
    if found is None:
        if resume:
            raise SpecctlError(f"{ckpt_root}: no checkpoint to resume from; train without --resume first")
        return None
    check_resumable(found, recipe)
    say(resume_line(found, recipe, explicit=resume))
    return found


@contextlib.contextmanager
def drafter_lock(out_dir: Path, ctx: DistContext) -> Iterator[None]:
    """The run lock of this drafter's training (`specctl.runlock`), held by rank 0; every rank
    stops with its one line when another process holds it."""
    with contextlib.ExitStack() as stack:
        error = None
        if ctx.is_main:
            try:
                stack.enter_context(run_lock(out_dir, f"train {out_dir.name}"))
            except RunLocked as e:
                error = str(e)
        error = distributed.broadcast_object(error, ctx)
        if error is not None:
            raise RunLocked(error)
        yield


def train(
    recipe: Recipe, ctx: DistContext, resume: bool, progress: bool, force: bool = False, restart: bool = False
) -> TrainSummary | None:
    """The loop, on this process's rank of `ctx` (see run_training), under the drafter's run lock."""
    out_dir = recipe.run_dir / "drafters" / recipe.drafter.algo
    preflight(recipe)  # the recipe's own errors first, each in its line, before anything is written
    with drafter_lock(out_dir, ctx):
        try:
            return train_locked(recipe, ctx, resume, progress, force, restart)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM (the CLI turns it into this): what a rerun does
            raise KeyboardInterrupt(interrupted_line(out_dir / "checkpoints")) from None
        except Exception:
            if not interrupts.signalled():
                raise
            # the signal fired inside native code (a safetensors read), which raised its own error
            raise KeyboardInterrupt(interrupted_line(out_dir / "checkpoints")) from None


def interrupted_line(ckpt_root: Path) -> str:
    """What rerunning the interrupted command does, read from the checkpoints on disk."""
    last = latest_checkpoint(ckpt_root) if ckpt_root.is_dir() else None
    if last is None:
        return f"no checkpoint saved yet: rerunning the same command starts {ckpt_root.parent} over"
    return f"rerunning the same command continues from {last}"


def open_metrics(recipe: Recipe, ctx: DistContext, out_dir: Path, step: int, resumed: bool) -> MetricsLog:
    """metrics.jsonl and the `train.report_to` tracker (rank 0), starting after `step`: a resumed
    run keeps the lines up to it, and the tracker drops what an interrupted run logged past it."""
    tracker = None
    if ctx.is_main:
        config = recipe.model_dump(mode="json")
        tracker = open_tracker(
            recipe.train.report_to, out_dir, recipe.name, recipe.drafter.algo, config, first_step=step + 1
        )
    log = MetricsLog(out_dir / "metrics.jsonl", ctx.is_main, tracker=tracker)
    return log.open(step if resumed else None)


def batch_stream(
    p: Pieces, cfg: Any, ctx: DistContext, cursor: int
) -> contextlib.AbstractContextManager[Iterator[dict[str, torch.Tensor]]]:
    """This rank's micro-batches from global micro-batch `cursor` on, in the order `optimizer_step`
    takes them, loaded by `train.data_workers` (`cfg`: the train section)."""
    sampler = StepSampler(
        p.buckets,
        cfg.seed,
        ctx.world_size,
        cfg.grad_accum,
        ctx.rank,
        cursor,
        p.source.lengths,
        cfg.micro_batch_tokens,
    )
    workers = data_workers(cfg.data_workers, ctx.device, ctx.local_world_size)
    return micro_batches(p.source.sample, sampler, cfg.batch_tokens, workers, ctx)


def trainer_state(p: Pieces, step: int, cursor: int, seen: int | None, skips: Skips) -> dict[str, Any]:
    """What a checkpoint records of the loop beside the weights and the optimizer: enough to resume
    exactly (the RNG states are added by `save_checkpoint`)."""
    return {
        "step": step,
        "cursor": cursor,
        "scheduler": p.scheduler.state_dict(),
        "tokens_seen": seen,
        **skips.state(),
    }


def step_record(
    step: int, seen: int | None, s: StepFigures, lr: float, tokens_per_s: float, skips: Skips
) -> dict[str, Any]:
    """The metrics.jsonl line of optimizer step `step` (grad_norm only when the step was applied)."""
    record = {"step": step, **tokens_field(seen), "loss": s.loss, "lr": lr, "tokens_per_s": tokens_per_s}
    if s.grad_norm is not None and not s.skipped:
        record["grad_norm"] = s.grad_norm
    record["skipped_steps"] = skips.total
    return record


def finish(
    recipe: Recipe, ctx: DistContext, log: MetricsLog, step: int, checkpoint: Path | None
) -> TrainSummary | None:
    """Close the log; on rank 0, draw the learning curve and return the run's summary."""
    log.close()
    if not ctx.is_main:
        return None
    algo = recipe.drafter.algo
    out_dir = log.path.parent
    if log.path.is_file():
        plot_curves({algo: read_curve(log.path)}, out_dir / "learning-curve.png", f"{algo}: held-out tau_hat")
    latest = {k: log.last.get(k) for k in ("loss", "val_loss", "tau_hat", "val_acc_per_position")}
    return TrainSummary(
        algo, step, **latest, run_dir=recipe.run_dir, output_dir=out_dir, checkpoint=checkpoint
    )


def train_locked(
    recipe: Recipe, ctx: DistContext, resume: bool, progress: bool, force: bool, restart: bool
) -> TrainSummary | None:
    """The loop: set up (where to start, the stage's resource check, the pieces, the log), then
    validate / checkpoint / step / log until train.max_steps, then the summary."""
    cfg = recipe.train
    out_dir = recipe.run_dir / "drafters" / recipe.drafter.algo
    say = lambda text: note(text, enabled=progress and ctx.is_main)  # noqa: E731
    resume_from = starting_point(recipe, ctx, out_dir, resume, restart, say)
    check_stage(recipe, "train", force, say, recipe.run_dir)
    p = build_pieces(recipe, ctx, progress)

    step, cursor, seen, skips = restore(p, resume_from, ctx, cfg)
    start, checkpoint = step, resume_from
    log = open_metrics(recipe, ctx, out_dir, step, resumed=resume_from is not None)
    saved, keep = (dump_recipe(recipe), p.meta), cfg.keep_checkpoints  # what each checkpoint records
    tokens_since, busy = 0.0, 0.0  # tokens and seconds of training steps since the last log line
    with (
        live_view(progress and ctx.is_main, cfg.max_steps, step) as live,
        batch_stream(p, cfg, ctx, cursor) as batches,
    ):
        while True:
            done = step >= cfg.max_steps
            # ---- periodic blocks: validate, checkpoint (not again right after resuming)
            if step > start and (step % cfg.eval_every == 0 or done):
                val = validate(p.model, p.source, p.val_buckets, ctx, cfg.batch_tokens, p.autocast)
                if val is not None:
                    log.write({"step": step, **tokens_field(seen), **val})
                    live(tau=f"{val['tau_hat']:.2f}")
            if step > start and (step % cfg.save_every == 0 or done):
                trainer = trainer_state(p, step, cursor, seen, skips)
                checkpoint = save_checkpoint(
                    out_dir / "checkpoints", step, p.model, p.optimizer, trainer, *saved, ctx, keep
                )
            if done:
                break

            # ---- one optimizer step over the global batch
            began, lr = time.perf_counter(), p.scheduler.get_last_lr()[0]
            s = optimizer_step(p, cfg, ctx, cursor, batches)
            check_step(s, step + 1, first=step == start)
            if (warning := skips.count(s, step + 1, cfg.max_skipped_steps)) is not None:
                note(warning, enabled=ctx.is_main)
            cursor += ctx.world_size * cfg.grad_accum
            seen = None if seen is None else seen + s.tokens
            step += 1
            tokens_since, busy = tokens_since + s.tokens, busy + time.perf_counter() - began

            # ---- log
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                record = step_record(step, seen, s, lr, tokens_since / busy, skips)
                log.write(record)
                live(loss=f"{s.loss:.4f}", lr=f"{lr:.2e}", tps=f"{record['tokens_per_s']:.0f}")
                tokens_since, busy = 0.0, 0.0
            live(completed=step)

    return finish(recipe, ctx, log, step, checkpoint)
