"""torchrun: 2 ranks (gloo, CPU) train like 1 rank with the same global batch, under DDP and FSDP2,
and a checkpoint resumes on a different world size.

Global batch: W ranks x grad_accum A = W*A micro-batches per step, so 2 ranks x A=1 must match
1 rank x A=2 (allclose: the order of floating-point sums differs). The real DFlash drafter samples
random anchors, so this also checks that the loop's per-micro-batch seeding makes the draws
independent of which rank runs a micro-batch.

Run as a script (`torchrun --nproc-per-node 2 tests/test_distributed.py OUT`), this file is
the worker: it runs the 2-rank jobs on the in-memory tiny world of tests/test_train.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from reliability_matrix import fault

REPO = Path(__file__).resolve().parent.parent
# ce + a high LR: losses move within 4 steps, so different anchor draws would show (KL to the
# random verifier's near-uniform distribution barely depends on them)
STEPS = dict(max_steps=4, eval_every=2, save_every=2, keep_checkpoints=4, loss="ce", lr=1e-2)


def recipe(out: Path, name: str, grad_accum: int, optimizer: str = "adamw", parallelism: str = "ddp"):
    from test_train import tiny_recipe

    train = dict(grad_accum=grad_accum, optimizer=optimizer, parallelism=parallelism, **STEPS)
    return tiny_recipe(out, name=name, **train)


def float32_newton_schulz() -> None:
    """Every Muon run of this module (both sides of each comparison) orthogonalises in float32.

    torch.optim.Muon runs its Newton-Schulz iteration in bfloat16, and on FSDP2's DTensor shards
    its reductions (norm, X @ X.T) run in another order than on one rank, so bf16 rounding alone
    moved a 1536x576 update by 6.5e-4 (of 3.3e-2) between them. What these tests check is that
    sharding and resharding leave the math alone, so the iteration is torch's, step for step, in
    float32 (on a CPU that emulates bf16 specctl's Float32Muon runs it in float32 anyway). The
    bf16 iteration itself is compared with float32 in `python -m benchmarks.perf --only optim`
    (within 1.1 %).
    """
    from torch.optim import _muon

    from specctl.optim import newton_schulz_fp32

    def zeropower_float32(grad, ns_coefficients, ns_steps, eps):  # _muon._zeropower_via_newtonschulz
        return newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps).to(grad.dtype)

    _muon._zeropower_via_newtonschulz = zeropower_float32  # where bf16 is native torch's Muon runs


def use_tiny_world():
    """Train on the in-memory samples (the store/verifier are exercised in test_train.py), with
    Muon's iteration in float32 (float32_newton_schulz)."""
    float32_newton_schulz()
    from test_train import tiny_source

    from specctl.train import loop as train_mod

    source = tiny_source()
    train_mod.open_source = lambda recipe, ctx, progress: source


def point_latest(run_dir: Path, step: int) -> None:
    """Pretend the run stopped after `step`: `latest` names that (kept) checkpoint."""
    (run_dir / "drafters" / "dflash" / "checkpoints" / "latest").write_text(f"step-{step}\n")


def worker(out: Path) -> None:
    """The 2-rank jobs, in one launch (a process joins a torchrun process group only once)."""
    from specctl import distributed
    from specctl.train import train

    use_tiny_world()
    ctx = distributed.setup("cpu")  # what run_training does: the group from torchrun's env
    assert (ctx.world_size, ctx.owns_group, ctx.device.type) == (2, True, "cpu")
    summary = train(recipe(out, "ddp", grad_accum=1), ctx, resume=False, progress=False)
    assert (summary is None) == (ctx.rank != 0)  # rank 0 reports, the others stay quiet
    train(recipe(out, "fsdp", grad_accum=1, optimizer="muon", parallelism="fsdp"), ctx, False, False)
    # a 1-rank run's checkpoint, resumed on 2 ranks (sharded, with Muon state)
    train(recipe(out, "muon-resumed", grad_accum=1, optimizer="muon", parallelism="fsdp"), ctx, True, False)
    rank0_disk_full(out, ctx)
    store_checks(out, ctx)
    distributed.teardown(ctx, together=True)


def rank0_disk_full(out: Path, ctx) -> None:
    """Rank 0's disk fills up while it writes a checkpoint: each rank writes the error it stopped
    with to out/disk-full-rank<R>.txt. A rank that hangs instead fails the launch by its timeout."""
    import errno

    from specctl import checkpoint
    from specctl.errors import CheckpointError
    from specctl.train import train

    def full_disk(obj, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    real = checkpoint._torch_save
    if ctx.rank == 0:
        checkpoint._torch_save = full_disk
    try:
        train(recipe(out, "disk-full", grad_accum=1), ctx, resume=False, progress=False)
        message = "no error"
    except CheckpointError as e:
        message = str(e)
    finally:
        checkpoint._torch_save = real
    (out / f"disk-full-rank{ctx.rank}.txt").write_text(message)


def write_store(path: Path, corrupt: int) -> None:
    """A 4-shard feature store of the tiny world's samples, one byte of shard `corrupt` flipped."""
    from test_train import AUX, HIDDEN, LAYERS, tiny_world

    from specctl.features import StorePlan, finalize_store, init_store, write_shard

    _, _, samples = tiny_world()
    lengths = [len(s["input_ids"]) for s in samples[:8]]
    shards = [[0, 2], [2, 4], [4, 6], [6, 8]]
    init_store(
        path, StorePlan("tiny-llama", "h", LAYERS, HIDDEN, list(AUX), "bfloat16", "d", lengths, shards)
    )
    for j, (a, b) in enumerate(shards):
        write_shard(path, j, samples[a:b], "bfloat16")
    finalize_store(path)
    victim = path / f"shard-{corrupt:05d}.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))


def store_checks(out: Path, ctx) -> None:
    """train.verify_store on 2 ranks over out/store: each rank writes the shards it hashed and the
    error it stopped with to out/store-rank<R>.json."""
    import json

    from specctl import features
    from specctl.errors import FeatureStoreError
    from specctl.train.loop import verify_store

    hashed: list[str] = []
    real = features.sha256_file
    features.sha256_file = lambda path: hashed.append(Path(path).name) or real(path)
    try:
        verify_store(features.open_features(out / "store"), ctx)
        message = "no error"
    except FeatureStoreError as e:
        message = str(e)
    finally:
        features.sha256_file = real
    (out / f"store-rank{ctx.rank}.json").write_text(json.dumps({"hashed": hashed, "error": message}))


# ---------------------------------------------------------------- the tests (pytest side)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
RUNS = ("ref-adamw", "ref-muon", "ddp", "fsdp", "muon-resumed", "ddp-resumed")


@pytest.fixture(scope="module")
def dist_out(tmp_path_factory) -> Path:
    """All runs, 1-rank references first (the torchrun jobs resume from one of them)."""
    import torch

    from specctl.distributed import DistContext
    from specctl.train import loop as train_mod

    out = tmp_path_factory.mktemp("dist")
    one = DistContext(0, 1, 0, torch.device("cpu"), owns_group=False)
    real_open_source = train_mod.open_source
    use_tiny_world()
    try:
        for name, optimizer in (("ref-adamw", "adamw"), ("ref-muon", "muon")):
            train_mod.train(recipe(out, name, grad_accum=2, optimizer=optimizer), one, False, False)
        shutil.copytree(out / "ref-muon", out / "muon-resumed")
        point_latest(out / "muon-resumed", 2)
        write_store(out / "store", corrupt=3)  # rank 1's to hash

        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
        proc = subprocess.run(
            # --log-dir: torchrun's own logs in the test's directory, not a torchelastic_* left in /tmp
            [*TORCHRUN, "--log-dir", str(out / "torchrun-logs"), __file__, str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]

        # the 2-rank DDP run's step-2 checkpoint, resumed on 1 rank
        shutil.copytree(out / "ddp", out / "ddp-resumed")
        point_latest(out / "ddp-resumed", 2)
        train_mod.train(recipe(out, "ddp-resumed", grad_accum=2), one, True, False)
    finally:
        train_mod.open_source = real_open_source
    return out


@pytest.fixture(scope="module")
def runs(dist_out: Path) -> dict[str, list[dict]]:
    from test_train import read_metrics

    return {name: read_metrics(recipe(dist_out, name, 1)) for name in RUNS}


def losses(records):
    return [r["loss"] for r in records if "loss" in r]


def val_losses(records):
    return [r["val_loss"] for r in records if "val_loss" in r]


def test_ddp_two_ranks_match_one_rank_with_the_same_global_batch(runs):
    ref, ddp = runs["ref-adamw"], runs["ddp"]
    assert len(losses(ddp)) == 4
    assert losses(ddp) == pytest.approx(losses(ref), rel=1e-5)
    assert val_losses(ddp) == pytest.approx(val_losses(ref), rel=1e-5)
    assert [r["lr"] for r in ddp if "lr" in r] == pytest.approx([r["lr"] for r in ref if "lr" in r])


def test_fsdp2_with_muon_matches_one_rank(runs):
    assert losses(runs["fsdp"]) == pytest.approx(losses(runs["ref-muon"]), rel=1e-5)
    assert val_losses(runs["fsdp"]) == pytest.approx(val_losses(runs["ref-muon"]), rel=1e-5)


@fault(
    stage="train",
    fault="resume on another number of ranks (1 to 2 with FSDP2 and Muon, 2 to 1 with DDP)",
    result="the same losses as the uninterrupted run",
)
def test_resume_on_a_different_world_size(runs):
    # 1 rank -> 2 ranks (FSDP2, Muon state resharded) and 2 ranks (DDP) -> 1 rank
    for resumed, ref, rel in (
        ("muon-resumed", "ref-muon", 1e-5),
        ("ddp-resumed", "ref-adamw", 1e-5),
    ):
        assert [r["step"] for r in runs[resumed] if "loss" in r] == [1, 2, 3, 4]
        assert losses(runs[resumed]) == pytest.approx(losses(runs[ref]), rel=rel)
        assert val_losses(runs[resumed]) == pytest.approx(val_losses(runs[ref]), rel=rel)


@fault(
    stage="train",
    fault="torchrun, 2 ranks: rank 0's disk fills up while it writes a checkpoint",
    result="both ranks stop with a CheckpointError at once (rank 0: the disk-full line; rank 1: "
    "`step-N: rank 0 could not save the checkpoint: ...`); no rank waits for the collective timeout",
)
def test_rank0_checkpoint_failure_stops_every_rank(dist_out):
    rank0 = (dist_out / "disk-full-rank0.txt").read_text()
    rank1 = (dist_out / "disk-full-rank1.txt").read_text()
    assert "optimizer.pt: disk full, checkpoint step-2 not saved" in rank0, rank0
    assert rank1.startswith("step-2: rank 0 could not save the checkpoint: "), rank1
    assert "disk full" in rank1


@fault(
    stage="train",
    fault="torchrun, 2 ranks: a feature-store shard that only rank 1 hashes is corrupted",
    result="every shard is hashed once on the machine, split over its ranks, before training; both "
    "ranks stop with the same FeatureStoreError naming the shard",
)
def test_store_checksums_are_split_over_ranks_and_a_bad_shard_stops_every_rank(dist_out):
    import json

    rank0, rank1 = (json.loads((dist_out / f"store-rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["hashed"] == ["shard-00000.safetensors", "shard-00002.safetensors"]
    assert rank1["hashed"] == ["shard-00001.safetensors", "shard-00003.safetensors"]
    assert rank0["error"] == rank1["error"]
    assert "shard-00003.safetensors: checksum mismatch (corrupted)" in rank0["error"]


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
