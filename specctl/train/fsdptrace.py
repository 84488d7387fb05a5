"""A real FSDP2 training step at world size N, traced on this CPU: the plan's FSDP2 terms, checked.

`specctl plan` predicts a sharded drafter's peak by arithmetic on a one-process trace
(resources.fsdp_terms). This runs the step itself, as rank 0 of `world`: a fake process group
(torch.testing's "fake" backend and FakeStore: every collective returns at once, with no data), the
recipe's drafter at real width with fake weights (specctl.memtrace), wrapped by the project's own
`distributed.wrap(..., "fsdp")`, and the loop's step: pieces with gradient sync off then on
(`distributed.gradient_sync`), then `train.loop.apply_gradients` (norm, clip, optimizer and
scheduler step), twice, the second with optimizer state. The peak per rank is FSDPMemTracker's
(torch.distributed._tools.fsdp2_mem_tracker): it follows FSDP2's storage resizes (the gathered
parameters freed after a backward), which MemoryTrace's live count does not see; MemoryTrace only
runs the step (real ids and masks, fake floating-point tensors). The tensors are fake CPU ones:
FSDP2 on a fake CUDA device wants CUDA streams, which a CPU-only build has not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from specctl.errors import SpecctlError


@dataclass(frozen=True)
class FsdpTrace:
    """One rank's peak over a traced FSDP2 step, and its parts (FSDPMemTracker's categories)."""

    world: int
    peak: int  # bytes
    parts: dict[str, int]  # category -> bytes at the peak: Unsharded Param, Unsharded Grad, ...
    pieces: int  # forwards per step traced (2: sync off, then on; 1 when a step has one piece)
    sequences: int
    length: int


@contextlib.contextmanager
def fake_process_group(world: int) -> Iterator[None]:
    """This process as rank 0 of `world` ranks that exchange nothing (torch's fake backend)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise SpecctlError("a process group is already initialised; trace FSDP2 in a process of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def trace_fsdp_step(
    recipe: Any, spec: Any, micro_tokens: int, world: int = 8, device: str = "cuda"
) -> FsdpTrace:
    """Rank 0's peak over two optimizer steps of the recipe's drafter under FSDP2 at `world` ranks,
    each over the worst piece of `micro_tokens` (resources.synthetic_batch); `device` picks the
    autocast dtype as resources.trace_train_step does."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from specctl import distributed, resources
    from specctl.attention_kernels import cuda_attention_form
    from specctl.memtrace import MemoryTrace
    from specctl.optim import build_scheduler

    cfg = recipe.train
    length = min(recipe.data.max_length, cfg.batch_tokens)
    sequences = max(1, min(micro_tokens, cfg.batch_tokens) // length)
    pieces = 2 if resources.accumulates(recipe, micro_tokens) else 1
    ctx = distributed.DistContext(0, world, 0, torch.device("cpu"), False, world)
    with fake_process_group(world), MemoryTrace() as t:
        model = distributed.wrap(resources.build_traced_drafter(recipe, spec, t, device), ctx, "fsdp")
        optimizer = resources.traced_optimizer(recipe, spec, model)
        step = SimpleNamespace(model=model, optimizer=optimizer, scheduler=build_scheduler(optimizer, cfg))
        batch = resources.synthetic_batch(recipe, spec, sequences, length, t.heavy())
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((batch,))
        # attention in its CUDA form, as resources.trace_train_step traces it (K/V repeated where
        # a mask needs the memory-efficient kernel)
        with tracker, cuda_attention_form() if device == "cuda" else contextlib.nullcontext():
            for _ in range(2):
                run_step(step, batch, pieces, cfg, resources.devices_autocast(cfg, device), tracker)
        snapshot = tracker.get_tracker_snapshot("peak")
    parts: dict[str, int] = {}
    for by_kind in snapshot.values():
        for kind, nbytes in by_kind.items():
            name = str(getattr(kind, "value", kind))  # an _FSDPRefType, or "Total"
            parts[name] = parts.get(name, 0) + nbytes
    return FsdpTrace(world, parts.pop("Total"), parts, pieces, sequences, length)


def run_step(step: Any, batch: dict[str, Any], pieces: int, cfg: Any, autocast: Any, tracker: Any) -> None:
    """One optimizer step as train.loop.optimizer_step runs it: `pieces` forwards and backwards,
    gradients synchronised on the last, then apply_gradients. The tracker forgets each piece's
    module statistics (it refuses a root module's second forward otherwise), not its peak."""
    from specctl import distributed
    from specctl.train.loop import apply_gradients

    for n in range(pieces):
        with distributed.gradient_sync(step.model, enabled=n == pieces - 1):
            with autocast:
                loss, _ = step.model(batch)
            (loss / cfg.grad_accum).backward()
        tracker.reset_mod_stats()
    apply_gradients(step, cfg.grad_clip)
