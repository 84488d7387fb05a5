"""The simulated cluster, part 2: the device is the rank's. A training step of every algorithm runs
as LOCAL_RANK 1 with the loop's device cuda:1 (tests/cluster_devices.py: CPU tensors, the CUDA
path's bookkeeping beside them): nothing mixes host and GPU tensors, nothing names another GPU,
the drafters copy nothing to the GPU themselves, everything the step keeps (weights, gradients,
optimizer state) is on the rank's GPU, and the host waits for the GPU a bounded number of times
a piece, however many sequences the piece holds (issue 56 item 7: P-EAGLE copied its rows to the
host once a sample; DFlash copied inv_freq to the GPU at every forward)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from cluster_devices import OnGPU, on_gpu

ALGOS = ("dflash", "dspark", "eagle3", "peagle")
# host waits a step of one piece: the rows a loss scores are gathered by value (nonzero), as are
# DFlash's anchors, EAGLE-3's TTT rows and P-EAGLE's rows of each depth (3 in the tiny recipe) after
# one copy of its valid rows to the host; the step adds its figures (.tolist()) and the gradient
# norm (float). Measured at this commit: DFlash/DSpark 7, EAGLE-3 6, P-EAGLE 9.
SYNCS_PER_PIECE = 10


def step_on_gpu(algo: str, out: Path, batch_tokens: int, loss: str = "kl") -> tuple[OnGPU, object]:
    """The second optimizer step of a tiny run on simulated cuda:1 (the first builds optimizer
    state): the mode with that step's counts, and the run's pieces."""
    from test_train import tiny_recipe, tiny_source

    from specctl.distributed import DistContext
    from specctl.train import loop
    from specctl.train.loader import collate, pieces

    recipe = tiny_recipe(out, algo=algo, loss=loss, batch_tokens=batch_tokens)
    cfg, source = recipe.train, tiny_source()
    ctx = DistContext(0, 1, 1, torch.device("cuda", 1), owns_group=False)
    real, loop.open_source = loop.open_source, lambda r, c, p: source
    mode = OnGPU(local_rank=1)
    try:
        with mode:
            p = loop.build_pieces(recipe, ctx, progress=False)

            def host_batches(cursor: int):  # what the loader yields: padded host batches
                for i in range(cfg.grad_accum):
                    for piece, _ in pieces(
                        loop.micro_batch_at(p.buckets, cursor + i, cfg.seed), source.lengths, None
                    ):
                        yield collate([source.sample(j) for j in piece], 10**6)

            for step in range(2):
                mode.syncs.clear()
                mode.uploads.clear()
                loop.optimizer_step(p, cfg, ctx, step, host_batches(step))
    finally:
        loop.open_source = real
    return mode, p


@pytest.mark.parametrize("algo", ALGOS)
def test_a_training_step_stays_on_the_ranks_gpu(algo, tmp_path):
    mode, p = step_on_gpu(algo, tmp_path, batch_tokens=160)
    drafter_uploads = {where: n for where, n in mode.uploads.items() if where.startswith("drafters/")}
    # P-EAGLE samples its deep rows on the host (sample_draft_blocks): one copy of them a forward
    assert sum(drafter_uploads.values()) == (algo == "peagle"), drafter_uploads
    kept = [*p.model.parameters(), *(q.grad for q in p.model.parameters() if q.grad is not None)]
    kept += [
        t
        for state in p.optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim()
    ]
    assert kept and all(on_gpu(t) for t in kept)


@pytest.mark.parametrize("algo", ALGOS)
def test_the_host_waits_a_bounded_number_of_times_a_step(algo, tmp_path):
    """One sequence a piece or seven: the same waits, within the budget."""
    one = step_on_gpu(algo, tmp_path / "one", batch_tokens=40)[0].syncs
    many = step_on_gpu(algo, tmp_path / "many", batch_tokens=280)[0].syncs
    assert sum(one.values()) <= SYNCS_PER_PIECE, one
    assert Counter({w: n for w, n in many.items()}) == one, (one, many)


def test_the_simulation_catches_a_host_tensor_a_foreign_gpu_and_a_read():
    """The checks themselves: a mask made without device= mixed with GPU data raises, naming
    another rank's GPU raises, and reading a GPU value counts one wait."""
    from cluster_devices import DeviceMismatch

    with OnGPU(local_rank=1) as mode:
        x = torch.ones(3, device="cuda:1")
        with pytest.raises(DeviceMismatch, match="mixes the GPU with a host tensor"):
            x * torch.ones(3)
        with pytest.raises(DeviceMismatch, match="cuda:3 asked for"):
            torch.zeros(2, device="cuda:3")
        assert x.device == torch.device("cuda", 1)
        int(x.sum())
    assert sum(mode.syncs.values()) == 1
