"""Data parallelism for the training loop: torchrun environment, DDP / FSDP2 wrapping, reductions.

`torchrun` sets WORLD_SIZE / RANK / LOCAL_RANK; without them everything here degrades to
single-process no-ops, so the loop has one code path. Every rank runs the same loop on its own
micro-batches; gradients are averaged (DDP all-reduce, or FSDP2 reduce-scatter when the drafter
is sharded), metrics are summed across ranks, and only rank 0 writes files.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from specctl.devices import launcher_local_rank, resolve_device
from specctl.errors import SpecctlError


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_group: bool  # this process initialised the process group, so it tears it down
    local_world_size: int = 1  # ranks on this machine (torchrun's LOCAL_WORLD_SIZE; 1 when unknown)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def setup(device: str = "auto", timeout: timedelta | None = None) -> DistContext:
    """Join the torchrun process group when WORLD_SIZE > 1 (nccl on CUDA, gloo on CPU).

    Each rank takes GPU LOCAL_RANK (devices.resolve_device, which collect's ranks use too); a
    process group created by the caller is reused as is. `timeout` bounds every collective
    (train.collective_timeout_minutes): torch's defaults are 10 minutes for NCCL and 30 for gloo,
    and a collective that waits on rank 0's minutes of checkpoint writing or hashing must not be
    aborted by them. None: torch's default.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    base = resolve_device(device)
    if world_size == 1:
        return DistContext(0, 1, 0, base, owns_group=False)
    local_rank = launcher_local_rank() or 0
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if base.type == "cuda" else "gloo", timeout=timeout)
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, base, owns, local_world_size)


def teardown(ctx: DistContext, together: bool = False) -> None:
    """Leave the process group. `together` (a run that finished): every rank first waits until all
    have finished. Rank 0 works on after the last collective (the summary, the learning curve); a
    rank that destroyed its gloo group and exited meanwhile was seen to abort ("terminate called
    without an active exception", exit -6), and torchrun then reports the whole job failed. After an
    error no rank waits: a peer may never come."""
    if ctx.owns_group and dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()


def wrap(model: nn.Module, ctx: DistContext, strategy: str = "ddp") -> nn.Module:
    """The module the loop calls: the drafter itself (one rank), DDP, or FSDP2-sharded.

    FSDP2 (`strategy="fsdp"`) shards parameters, gradients and optimizer state across ranks
    (ZeRO-3), for drafters whose training state does not fit one GPU; it also works with one
    rank. The whole drafter is one FSDP unit, gathered at its forward: drafters call into their
    blocks through helper methods (not only `block.forward`), so per-block units would see
    sharded weights. DDP looks for unused parameters because drafters legitimately skip some
    (e.g. a mask embedding when a micro-batch samples no deeper rows); it does not broadcast
    buffers, which are the verifier's frozen tensors, identical on every rank.
    """
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        if not dist.is_initialized():
            raise SpecctlError("FSDP2 needs a process group: launch with torchrun (even --nproc-per-node 1)")
        return fully_shard(model)
    if strategy != "ddp":
        raise SpecctlError(f"unknown parallelism {strategy!r}; use ddp or fsdp")
    if not ctx.distributed:
        return model
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(
        model, device_ids=ids, find_unused_parameters=True, broadcast_buffers=False
    )


def checkpoint_layers(model: nn.Module) -> int:
    """Recompute each of the drafter's decoder layers (`model.layers`) in the backward instead of
    keeping its activations (train.activation_checkpointing): a layer's saved tensors were most of a
    DFlash step's memory at 8B width (specctl plan). The layer's own `forward` is wrapped, not the
    module: state-dict names, checkpoints and exports stay as they are. Returns the layers wrapped."""
    import functools

    from torch.utils.checkpoint import checkpoint

    layers = getattr(model, "layers", None) or []
    for layer in layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    return len(layers)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Around forward + backward of a micro-batch: reduce gradients only on the last one of a step.

    Under FSDP2 the drafter is also gathered here, before its forward, rather than in it: FSDP2's
    own pre-forward gather keeps the flat all-gather buffer (a second whole copy of the float32
    parameters) until the forward ends, expecting a next unit's gather to overlap with, and the
    drafter is one unit. Gathered outside the forward, the buffer is freed once copied out: the
    same collective on every rank, a parameter-sized copy less at the forward's peak (17.9 GB for
    the 70B recipe's drafter, tests/test_fsdp_plan.py). The gathered weights stay for the step's
    next micro-batch (resharded only after the last one's backward): one all-gather a step instead
    of one a piece (16 of 17.9 GB each at the 70B recipe's micro-batching), at no cost in peak
    memory, since every piece's forward holds them anyway."""
    if isinstance(model, nn.parallel.DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
        return
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        model.set_reshard_after_backward(enabled)
        model.unshard()
    yield


def forwards_collective(model: nn.Module) -> bool:
    """Whether each forward/backward of `model` is itself collective, so every rank must run the
    same number of them in a step: FSDP2 all-gathers the weights at every forward (and again in
    the backward) whether or not gradients are synchronised, so a rank with fewer pieces would
    meet its peers' all-gathers with its reduce-scatter or the clip-norm all-reduce (a hang, or
    collectives paired wrongly). DDP communicates only on the synchronised backward."""
    return hasattr(model, "set_requires_gradient_sync")


def all_reduce_sum(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum over ranks (in place, and returned); identity on one rank."""
    if ctx.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_object(obj: Any, ctx: DistContext) -> Any:
    """Rank 0's `obj` on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not ctx.distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


_MAIN_FIRST = itertools.count()  # one store key per main_first; every rank enters them in the same order


@contextlib.contextmanager
def main_first(ctx: DistContext, what: str, poll_s: float = 2.0) -> Iterator[None]:
    """Rank 0 runs the block first; every other rank runs it once rank 0 has finished it.

    For rank-0 work that can take hours (downloading or converting the verifier into a shared
    cache, the online data stage's generation), so the waiting ranks are in no collective: a
    barrier there is aborted by the group's timeout (NCCL's default is 10 minutes). They poll a
    key that rank 0 sets in the process group's key-value store (the TCPStore of torchrun's
    rendezvous, new for each attempt, so no earlier run's key is seen). A marker file would need
    a run directory shared by every node and a name unique to the run; a barrier on a gloo group
    with a long timeout would still have to guess how long is long enough. Rank 0 shows the
    progress; when its block raises, the key says so and the others stop with one line (torchrun
    also stops them once rank 0 exits).
    """
    if not ctx.distributed:
        yield
        return
    store = dist.distributed_c10d._get_default_store()
    key = f"specctl/main_first/{next(_MAIN_FIRST)}"
    if ctx.is_main:
        try:
            yield
        except BaseException as e:
            store.set(key, "failed: " + (str(e).strip().splitlines() or [type(e).__name__])[0])
            raise
        store.set(key, "done")
        return
    outcome = _wait_for_key(store, key, poll_s)
    if outcome != "done":
        raise SpecctlError(f"rank 0 stopped while {what} ({outcome.removeprefix('failed: ')})")
    yield


def _wait_for_key(store: Any, key: str, poll_s: float) -> str:
    """The value rank 0 sets at `key`, checked every `poll_s` seconds at most (sooner at first:
    most waits are short). `check` returns at once, so no store timeout applies to the wait."""
    delay = 0.01
    while not store.check([key]):
        time.sleep(delay)
        delay = min(poll_s, delay * 2)
    return store.get(key).decode()


def rank_share(chunk: list, per_rank: int, rank: int) -> list:
    """Rank `rank`'s `per_rank` consecutive items of a step's chunk of `world_size * per_rank`.

    The union over ranks is the whole chunk, so one rank with `per_rank * W` micro-batches
    sees the same global batch as W ranks with `per_rank` each.
    """
    return chunk[rank * per_rank : (rank + 1) * per_rank]
