"""A ledger of one rank's collectives, for the simulated cluster (tests/test_cluster.py).

Every `torch.distributed.<collective>` called through the module namespace (what specctl's own
code and FSDP2's all-gathers and reduce-scatters call) is wrapped to append (kind, shape, dtype)
before it runs. Ranks that agree write equal ledgers; a rank that runs one forward fewer under
FSDP2 writes a shorter one, or meets its peers' all-gather with its reduce-scatter. DDP's bucket
all-reduces run inside the C++ reducer, which calls no Python, so for them the worker registers
torch's own hook (`record_ddp_buckets`), whose all-reduce goes through the
namespace like any other. Entries are appended to a JSON-lines file as they happen, so a rank that
hangs leaves its ledger up to the collective it hangs in.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

KINDS = (
    "all_reduce",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "broadcast",
    "barrier",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
)


def describe(kind: str, args: tuple, kwargs: dict) -> list[Any]:
    """[kind, shape, dtype] of a call: its first tensor argument (the second for the *_single and
    *_into_tensor forms, whose first is the output), or [kind] for object and barrier calls."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if kind.endswith(("_single", "_into_tensor", "_tensor")) and len(tensors) > 1:
        tensors = tensors[1:]
    if not tensors:
        return [kind]
    return [kind, list(tensors[0].shape), str(tensors[0].dtype).removeprefix("torch.")]


class Ledger:
    """This process's collectives in call order, each line [job, kind, shape, dtype] of `path`."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", buffering=1)  # line-buffered: a hung rank's lines are on disk
        self.job: str | None = None

    def start(self, job: str) -> None:
        self.job = job

    def install(self) -> None:
        for kind in KINDS:
            setattr(dist, kind, self._wrap(kind, getattr(dist, kind)))

    def _wrap(self, kind: str, real):
        @functools.wraps(real)
        def recorded(*args, **kwargs):
            if self.job is not None:
                self.file.write(json.dumps([self.job, *describe(kind, args, kwargs)]) + "\n")
            return real(*args, **kwargs)

        return recorded


def read(path: Path) -> dict[str, list[list[Any]]]:
    """A ledger file's entries by job, in call order."""
    jobs: dict[str, list[list[Any]]] = {}
    for line in path.read_text().splitlines():
        job, *entry = json.loads(line)
        jobs.setdefault(job, []).append(entry)
    return jobs


def record_ddp_buckets(model: torch.nn.Module) -> torch.nn.Module:
    """Route a DDP model's bucket all-reduces through `dist.all_reduce` (torch's default hook, the
    same averaging), so the ledger sees them; other models are returned as they are."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model.register_comm_hook(None, allreduce_hook)
    return model
