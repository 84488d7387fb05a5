"""The simulated cluster, part 1: ranks agree. Two real gloo ranks (torchrun) train every
algorithm under DDP and FSDP2 with train.micro_batch_tokens, validation and a checkpoint resume, on
data that is unequal across ranks on purpose: sequence lengths that split into different numbers of
pieces on each rank, and short sequences whose only loss-masked token leaves P-EAGLE no deep rows.
Each rank keeps a ledger of its collectives (tests/cluster_ledger.py); the ranks' ledgers must be
equal, and the launch must finish within its timeout. A launch with the padding turned off shows
the ledger catching what used to hang (issue 56: FSDP2 + micro_batch_tokens sat at step 0).

Run as a script (`torchrun --nproc-per-node 2 tests/test_cluster.py OUT MODE`), this file is the
worker.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
ALGOS = ("dflash", "dspark", "eagle3", "peagle")
STRATEGIES = ("ddp", "fsdp")
# 48 padded tokens a piece against micro-batches of up to 160 (train.batch_tokens): 1 to 5 pieces
# by the lengths that meet in a micro-batch, so two ranks rarely split a step alike
MICRO_TOKENS = 48
STEPS = dict(max_steps=4, eval_every=2, save_every=2, keep_checkpoints=4, loss="ce", lr=1e-2)


def unequal_samples():
    """The tiny world's 24 sequences (10-40 tokens), those under 20 tokens loss-masked on their last
    token only: a micro-batch of them counts a prediction or two and samples no P-EAGLE deep row."""
    from test_train import tiny_world

    samples = [dict(s) for s in tiny_world()[2]]
    for s in samples:
        if len(s["input_ids"]) < 20:
            mask = s["loss_mask"].clone()
            mask[:-1] = False
            s["loss_mask"] = mask
    return samples


def cluster_recipe(out: Path, algo: str, parallelism: str, grad_accum: int = 1, name: str | None = None):
    from test_train import tiny_recipe

    train = dict(parallelism=parallelism, micro_batch_tokens=MICRO_TOKENS, grad_accum=grad_accum, **STEPS)
    return tiny_recipe(out, algo=algo, name=name or f"{algo}-{parallelism}", **train)


def record_pieces(log: list) -> None:
    """Wrap train.loop.step_work so each call's (rank asked about, cursor, pieces) is logged: the
    test checks that the data really split unequally."""
    from specctl.train import loop

    real = loop.step_work

    def logged(p, cfg, cursor, rank):
        work = real(p, cfg, cursor, rank)
        log.append([rank, cursor, len(work)])
        return work

    loop.step_work = logged


def regathering(gradient_sync):
    """gradient_sync as it was before issue 56: FSDP2 reshards after every piece's backward, so
    every piece's forward gathers the weights again (a collective per piece)."""
    import contextlib

    @contextlib.contextmanager
    def old(model, enabled):
        with gradient_sync(model, enabled):
            if hasattr(model, "set_reshard_after_backward"):
                model.set_reshard_after_backward(True)
            yield

    return old


def worker(out: Path, mode: str) -> None:
    """Every algorithm x strategy: train 4 steps, then resume a copy from step 2 to step 4. Mode
    "unpadded": only FSDP2 DFlash, with every rank running its own piece count (the old step)."""
    from cluster_ledger import Ledger, record_ddp_buckets
    from test_train import tiny_source

    from specctl import distributed
    from specctl.train import loop

    source = tiny_source(unequal_samples())
    loop.open_source = lambda recipe, ctx, progress: source
    pieces_log: list = []
    record_pieces(pieces_log)
    wrap = distributed.wrap
    loop.distributed.wrap = lambda model, ctx, strategy="ddp": record_ddp_buckets(wrap(model, ctx, strategy))
    ctx = distributed.setup("cpu")
    ledger = Ledger(out / f"ledger-{mode}-rank{ctx.rank}.jsonl")
    ledger.install()
    jobs = [(a, s) for a in ALGOS for s in STRATEGIES] if mode == "agree" else [("dflash", "fsdp")]
    if mode == "unpadded":  # the old step: each rank its own piece count, a gather per piece
        distributed.forwards_collective = lambda model: False
        distributed.gradient_sync = regathering(distributed.gradient_sync)
    try:
        for algo, strategy in jobs:
            recipe = cluster_recipe(out, algo, strategy)
            ledger.start(recipe.name)
            loop.train(recipe, ctx, resume=False, progress=False)
            with distributed.main_first(ctx, "copying the run to resume"):
                if ctx.is_main:
                    resumed = out / f"{recipe.name}-resumed"
                    shutil.copytree(recipe.run_dir, resumed)
                    (resumed / "drafters" / algo / "checkpoints" / "latest").write_text("step-2\n")
            ledger.start(f"{recipe.name}-resumed")
            loop.train(cluster_recipe(out, algo, strategy, name=f"{recipe.name}-resumed"), ctx, True, False)
    finally:
        (out / f"pieces-{mode}-rank{ctx.rank}.json").write_text(json.dumps(pieces_log))
    distributed.teardown(ctx, together=True)  # as run_training leaves a finished run


# ---------------------------------------------------------------- the tests (pytest side)


def launch(out: Path, mode: str, timeout: float) -> subprocess.CompletedProcess | None:
    """The 2-rank worker; None when it ran past `timeout` (killed: a hang)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}",
    }
    cmd = [*TORCHRUN, "--log-dir", str(out / f"torchrun-{mode}"), __file__, str(out), mode]
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def ledgers(out: Path, mode: str) -> list[dict[str, list]]:
    from cluster_ledger import read

    return [read(out / f"ledger-{mode}-rank{r}.jsonl") for r in (0, 1)]


@pytest.fixture(scope="module")
def agree(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cluster")
    proc = launch(out, "agree", timeout=300)
    assert proc is not None, "the 2-rank cluster run hung (killed after 300 s)"
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    reference_runs(out)
    return out


def reference_runs(out: Path) -> None:
    """Each algorithm on one rank with the same global batch (grad_accum 2), in this process."""
    import torch
    from test_train import tiny_source

    from specctl.distributed import DistContext
    from specctl.train import loop

    one = DistContext(0, 1, 0, torch.device("cpu"), owns_group=False)
    real, source = loop.open_source, tiny_source(unequal_samples())
    loop.open_source = lambda recipe, ctx, progress: source
    try:
        for algo in ALGOS:
            loop.train(
                cluster_recipe(out, algo, "ddp", grad_accum=2, name=f"{algo}-one-rank"), one, False, False
            )
    finally:
        loop.open_source = real


def test_the_data_splits_into_different_piece_counts_on_each_rank(agree):
    """The precondition: some step gave the two ranks different numbers of pieces."""
    log = json.loads((agree / "pieces-agree-rank0.json").read_text())
    by_step: dict[int, dict[int, int]] = {}
    for rank, cursor, count in log:
        by_step.setdefault(cursor, {})[rank] = count
    assert any(len(set(c.values())) > 1 for c in by_step.values() if len(c) == 2), by_step


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_rank_runs_the_same_collectives(agree, algo, strategy):
    rank0, rank1 = ledgers(agree, "agree")
    for job in (f"{algo}-{strategy}", f"{algo}-{strategy}-resumed"):
        assert rank0[job], job
        assert rank0[job] == rank1[job], job
        if strategy == "fsdp":  # the weights were gathered at every forward
            assert any(entry[0] == "all_gather_single" for entry in rank0[job])


@pytest.mark.parametrize("algo", ALGOS)
def test_fsdp_gathers_the_weights_once_a_step_not_once_a_piece(agree, algo):
    """Issue 56 item 7: the gathered weights stay across a step's micro-batches, so the all-gathers
    that lead up to each step's reduce-scatter are one, whatever the step's piece count (3-4 here;
    16 at the 70B recipe's micro-batching, 17.9 GB each)."""
    rank0, _ = ledgers(agree, "agree")
    for job in (f"{algo}-fsdp", f"{algo}-fsdp-resumed"):
        runs, run = [], 0
        for entry in rank0[job]:
            if entry[0] == "all_gather_single":
                run += 1
            elif entry[0] == "reduce_scatter_single":
                runs.append(run)
                run = 0
            else:
                run = 0
        assert runs and runs == [1] * len(runs), (job, runs)


def test_trained_and_resumed_runs_finish_with_the_same_losses(agree):
    """The resumed copy's steps 3-4 are the uninterrupted run's (a resume under padding changes
    nothing), and every run logged 4 finite steps."""
    from test_train import read_metrics

    for algo in ALGOS:
        for strategy in STRATEGIES:
            whole = read_metrics(cluster_recipe(agree, algo, strategy))
            resumed = read_metrics(
                cluster_recipe(agree, algo, strategy).model_copy(
                    update={"name": f"{algo}-{strategy}-resumed"}
                )
            )
            losses = [r["loss"] for r in whole if "loss" in r]
            assert len(losses) == 4
            assert [r["loss"] for r in resumed if "loss" in r][-2:] == pytest.approx(losses[-2:], rel=1e-5)


def test_without_padding_the_ranks_disagree(tmp_path):
    """The old step (each rank its own piece count) under FSDP2: the launch fails or hangs, and the
    ledgers part ways: what the padded step is tested against."""
    proc = launch(tmp_path, "unpadded", timeout=45)
    assert proc is None or proc.returncode != 0
    rank0, rank1 = ledgers(tmp_path, "unpadded")
    assert rank0 != rank1


if __name__ == "__main__":
    worker(Path(sys.argv[1]), sys.argv[2])


@pytest.mark.parametrize("algo", ALGOS)
def test_a_piece_with_nothing_to_train_on_still_gives_every_parameter_a_gradient(algo, monkeypatch):
    """FSDP2 reduce-scatters the gradients of the parameters that have one: a rank whose piece left
    a parameter out (P-EAGLE's mask_hidden when it samples no deep rows) would reduce-scatter fewer
    bytes than its peers. Checked with no loss-masked token at all and, for P-EAGLE, with the deep
    rows' sampling forced empty: every parameter still gets a (zero) gradient."""
    import torch
    from test_train import tiny_recipe, tiny_world

    from specctl.drafters import DRAFTERS
    from specctl.drafters.peagle import PEagleDrafter
    from specctl.train.loader import collate
    from specctl.train.loop import as_module

    spec, weights, samples = tiny_world()
    recipe = tiny_recipe(Path("unused"), algo=algo)
    drafter = as_module(DRAFTERS[algo].build(getattr(recipe.drafter, algo), spec, weights, None, "ce"))
    drafter.train()
    real_rows = PEagleDrafter.sample_rows

    def no_deep_rows(self, valid, keep_all):
        anchor, depth, present = real_rows(self, valid, keep_all)
        return anchor[:, :0], depth[:, :0], present[:, :0]  # [B, 0]

    monkeypatch.setattr(PEagleDrafter, "sample_rows", no_deep_rows)
    nothing = [{**s, "loss_mask": torch.zeros_like(s["loss_mask"])} for s in samples[:3]]
    for batch in (collate(samples[:3], max_tokens=4096), collate(nothing, max_tokens=4096)):
        drafter.zero_grad(set_to_none=True)
        loss, _ = drafter(batch)
        loss.backward()
        assert [n for n, q in drafter.named_parameters() if q.requires_grad and q.grad is None] == []


def test_a_requeue_does_not_hash_the_feature_store_again(tmp_path, monkeypatch):
    """verify_store hashes each shard once: a second start reads only the records, a shard whose
    file changed since (size or mtime) is hashed again, and a corruption is still found then."""
    from test_distributed import write_store

    import specctl.features as features
    from specctl.distributed import DistContext
    from specctl.errors import FeatureStoreError
    from specctl.train.loop import verify_store

    write_store(tmp_path / "store", corrupt=3)
    victim = tmp_path / "store" / "shard-00003.safetensors"
    corrupted = victim.read_bytes()
    data = bytearray(corrupted)
    data[len(data) // 2] ^= 0xFF  # write_store flipped this byte: flip it back
    victim.write_bytes(bytes(data))
    hashed: list[str] = []
    real = features.sha256_file
    monkeypatch.setattr(features, "sha256_file", lambda path: hashed.append(Path(path).name) or real(path))
    one = DistContext(0, 1, 0, torch_cpu(), owns_group=False)
    verify_store(features.open_features(tmp_path / "store"), one)
    assert len(hashed) == 4
    verify_store(features.open_features(tmp_path / "store"), one)
    assert len(hashed) == 4  # the requeue: nothing read again
    victim.write_bytes(corrupted)  # rewritten by a bad copy: its mtime moved
    os.utime(victim, ns=(victim.stat().st_atime_ns, victim.stat().st_mtime_ns + 10**9))
    with pytest.raises(FeatureStoreError, match="shard-00003.safetensors: checksum mismatch"):
        verify_store(features.open_features(tmp_path / "store"), one)
    assert hashed[4:] == ["shard-00003.safetensors"]


def torch_cpu():
    import torch

    return torch.device("cpu")
