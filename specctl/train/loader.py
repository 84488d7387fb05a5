"""The training input pipeline: which micro-batches a rank trains on, in which order, padded and
read ahead of the step.

The stream of micro-batches is endless and depends only on (buckets, seed): epoch e visits every
bucket once in an order shuffled by (seed, e), and optimizer step s takes micro-batches
[s * W * A, (s + 1) * W * A) of it, rank r the A consecutive ones `rank_share` gives it. A
torch DataLoader walks this rank's share (`StepSampler`) from the run's cursor on: with
`train.data_workers` processes the samples are read and padded while the step computes, into
pinned memory on CUDA, so the copy to the GPU does not wait on pageable memory. The batches are
the same as building them in the loop, so a run (and a resumed run) gives the same figures with
any number of workers.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from functools import partial

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from specctl.batching import length_buckets
from specctl.distributed import DistContext, rank_share
from specctl.features import STORED_KEYS
from specctl.recipe import CUDA_DATA_WORKERS

PREFETCH_BATCHES = 2  # per worker: DataLoader's default, enough to hide one batch's read


def collate(samples: list[dict[str, torch.Tensor]], max_tokens: int) -> dict[str, torch.Tensor]:
    """Right-pad samples into a batch of the drafter contract, cropped to max_tokens.

    input_ids [B, T] int64, loss_mask / attention_mask [B, T] bool, and when the samples carry
    features, aux_hidden_states [B, T, n_aux, H] and last_hidden_state [B, T, H] (stored dtype),
    or for a top-k store topk_ids / topk_logprobs [B, T, k] and logsumexp [B, T]; rows as stored
    (`FeatureStore.row`) keep their dtypes and aux_scale [B, T, n_aux] (`decode_features` later).
    """
    T = min(max(len(s["input_ids"]) for s in samples), max_tokens)
    B = len(samples)
    batch = {
        "input_ids": torch.zeros(B, T, dtype=torch.long),
        "loss_mask": torch.zeros(B, T, dtype=torch.bool),
        "attention_mask": torch.zeros(B, T, dtype=torch.bool),
    }
    feature_keys = [k for k in STORED_KEYS if k in samples[0]]
    for k in feature_keys:
        batch[k] = samples[0][k].new_zeros(B, T, *samples[0][k].shape[1:])
    for b, s in enumerate(samples):
        n = min(len(s["input_ids"]), T)
        batch["input_ids"][b, :n] = s["input_ids"][:n]
        batch["loss_mask"][b, :n] = s["loss_mask"][:n].bool()
        batch["attention_mask"][b, :n] = True
        for k in feature_keys:
            batch[k][b, :n] = s[k][:n]
    return batch


def epoch_order(num_buckets: int, seed: int, epoch: int) -> list[int]:
    """The order in which epoch `epoch` of the stream visits the buckets."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_buckets, generator=generator).tolist()


def micro_batch_at(buckets: list[list[int]], cursor: int, seed: int) -> list[int]:
    """The cursor-th micro-batch of the endless stream: epoch e = cursor // len(buckets) visits
    every bucket once, in an order shuffled by (seed, e)."""
    epoch, index = divmod(cursor, len(buckets))
    return buckets[epoch_order(len(buckets), seed, epoch)[index]]


class StepSampler(Sampler[list[int]]):
    """This rank's micro-batches (sample indices), endless, in the order `train.optimizer_step`
    trains them, from global micro-batch `start` (a step boundary) on: for each step, this rank's
    `rank_share` of the step's world_size * grad_accum micro-batches of the stream, each as its
    `pieces` (train.micro_batch_tokens: one piece unless given `lengths` and a budget it exceeds)."""

    def __init__(
        self,
        buckets: list[list[int]],
        seed: int,
        world_size: int,
        grad_accum: int,
        rank: int,
        start: int,
        lengths: list[int] | None = None,
        micro_tokens: int | None = None,
    ):
        self.buckets, self.seed, self.start = buckets, seed, start
        self.world_size, self.grad_accum, self.rank = world_size, grad_accum, rank
        self.lengths, self.micro_tokens = lengths, micro_tokens

    def __iter__(self) -> Iterator[list[int]]:
        per_step = self.world_size * self.grad_accum
        n = len(self.buckets)
        cursor, epoch, order = self.start, -1, []
        while True:
            for c in rank_share(range(cursor, cursor + per_step), self.grad_accum, self.rank):
                if c // n != epoch:  # one shuffle per epoch, not one per micro-batch
                    epoch = c // n
                    order = epoch_order(n, self.seed, epoch)
                bucket = self.buckets[order[c % n]]
                if self.lengths is None:
                    yield bucket
                    continue
                for piece, _ in pieces(bucket, self.lengths, self.micro_tokens):
                    yield piece
            cursor += per_step


class Samples(Dataset):
    """The samples as a map-style dataset: `get(i)` runs where the batch is built (a worker)."""

    def __init__(self, get: Callable[[int], dict[str, torch.Tensor]]):
        self.get = get

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.get(i)


def data_workers(setting: int | None, device: torch.device, ranks_here: int = 1) -> int:
    """Loader processes per rank for `train.data_workers` (None: 0 on CPU, where the step itself
    uses the cores; on CUDA up to CUDA_DATA_WORKERS, within this rank's share of the machine's CPUs
    among `ranks_here` ranks, one left for the rank itself)."""
    if setting is not None:
        return setting
    if device.type != "cuda":
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(CUDA_DATA_WORKERS, cpus // max(1, ranks_here) - 1))


def pieces(indices: list[int], lengths: list[int], micro_tokens: int | None) -> list[tuple[list[int], float]]:
    """A micro-batch's samples split into forward/backward pieces of at most `micro_tokens` padded
    tokens (train.micro_batch_tokens), each with its share of the micro-batch's tokens as the weight
    of its loss: one piece of weight 1 when it fits whole (the step is then what it always was)."""
    if micro_tokens is None or len(indices) * max(lengths[i] for i in indices) <= micro_tokens:
        return [(indices, 1.0)]
    split = length_buckets(lengths, micro_tokens, indices)
    total = sum(lengths[i] for i in indices)
    return [(piece, sum(lengths[i] for i in piece) / total) for piece in split]


@contextlib.contextmanager
def micro_batches(
    get: Callable[[int], dict[str, torch.Tensor]],
    sampler: StepSampler,
    max_tokens: int,
    workers: int,
    ctx: DistContext,
) -> Iterator[Iterator[dict[str, torch.Tensor]]]:
    """This rank's padded micro-batches on the host (pinned on CUDA), in `sampler`'s order.

    The loader has a generator of its own: it never draws from the global torch RNG, which the
    loop reseeds per micro-batch. Its worker processes are stopped on the way out, an interrupted
    run's included (a traceback would otherwise keep them alive).
    """
    loader = DataLoader(
        Samples(get),
        batch_sampler=sampler,
        collate_fn=partial(collate, max_tokens=max_tokens),
        num_workers=workers,
        pin_memory=ctx.device.type == "cuda",
        prefetch_factor=PREFETCH_BATCHES if workers else None,
        persistent_workers=workers > 0,
        generator=torch.Generator(),
    )
    batches = iter(loader)
    try:
        yield batches
    finally:
        shutdown = getattr(batches, "_shutdown_workers", None)  # the multi-process iterator's
        if shutdown is not None:
            shutdown()
