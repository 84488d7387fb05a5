"""`specctl train --epochs N`: an epoch of the feature store as a number of optimizer steps.

Training counts steps (`train.max_steps`), as the loop, its checkpoints and its learning-rate
schedule do; users coming from speculators or HF Trainer think in epochs. The conversion is exact,
not a token estimate: the loop's stream visits every training micro-batch (a length bucket of at
most `train.batch_tokens` padded tokens) once per epoch, and a step takes world_size x grad_accum
of them (specctl.train.loader), so an epoch is ceil(buckets / (world_size x grad_accum)) steps.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from specctl.batching import length_buckets
from specctl.errors import UsageError
from specctl.recipe import Recipe


@dataclass(frozen=True)
class EpochSteps:
    epochs: float
    steps_per_epoch: int
    train_samples: int
    train_tokens: int
    batch_tokens: int
    micro_batches: int  # per step: world_size x grad_accum
    world_size: int

    @property
    def max_steps(self) -> int:
        return max(1, math.ceil(self.epochs * self.steps_per_epoch))

    def line(self) -> str:
        """The one line train prints: what an epoch is here and the steps it set."""
        ranks = f", {self.world_size} ranks" if self.world_size > 1 else ""
        return (
            f"--epochs {self.epochs:g}: {self.epochs:g} x {self.steps_per_epoch:,} steps "
            f"({self.train_samples:,} training samples, {self.train_tokens:,} tokens, in micro-batches of "
            f"<= {self.batch_tokens:,} tokens, {self.micro_batches} a step{ranks}) = train.max_steps "
            f"{self.max_steps:,}"
        )


def steps_per_epoch(
    lengths: Sequence[int], train_ids: Sequence[int], batch_tokens: int, micro_batches: int
) -> int:
    """Optimizer steps that visit every training sample once: the length buckets the loop builds
    of the training samples (`lengths` in tokens, all samples), `micro_batches` (world_size x
    grad_accum) of them a step."""
    buckets = length_buckets(lengths, batch_tokens, train_ids)
    return math.ceil(len(buckets) / micro_batches)


def epoch_steps(recipe: Recipe, epochs: float) -> EpochSteps:
    """`epochs` of the recipe's feature store as steps, with the settings `specctl train` runs
    (train.per_algo applied), under torchrun with its WORLD_SIZE ranks."""
    from specctl.features import open_features
    from specctl.train.loop import split_indices

    if epochs <= 0:
        raise UsageError(f"--epochs {epochs:g}: need a positive number of epochs (e.g. 1 or 0.5)")
    cfg = recipe.for_training().train
    if cfg.mode != "offline":
        raise UsageError(
            "--epochs counts the feature store's samples, and train.mode=online has none; pass --max-steps"
        )
    lengths = list(open_features(recipe.run_dir / "features", verify=False).lengths)
    train_ids, _ = split_indices(len(lengths), cfg.val_fraction, cfg.seed)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    micro = world_size * cfg.grad_accum
    return EpochSteps(
        epochs,
        steps_per_epoch(lengths, train_ids, cfg.batch_tokens, micro),
        len(train_ids),
        sum(lengths[i] for i in train_ids),
        cfg.batch_tokens,
        micro,
        world_size,
    )
