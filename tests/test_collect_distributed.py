"""collect under torchrun: each rank on its own device, two ranks build one store.

Which device a rank takes is `devices.local_device`, a pure function of (the recipe's device,
LOCAL_RANK, the visible GPU count), tested on every case in test_devices.py. The torchrun run
(2 ranks, CPU: collect needs no process group) checks that real ranks get their own LOCAL_RANK's
GPU from `resolve_device`, and that they build a store byte-identical to a one-process run, every
shard written once. Then workers that die, hang, or run on another machine (shard claims).

Run as a script (`torchrun --nproc-per-node 2 tests/test_collect_distributed.py RECIPE OUT`),
this file is the worker.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from reliability_matrix import fault
from test_claims import DEAD, OTHER, age, write_claim
from test_collect import make_recipe, store_bytes

from specctl.collect import collect
from specctl.collect.claims import Claim, ShardClaims
from specctl.devices import resolve_device
from specctl.durable import host_name
from specctl.features import finalize_store, shard_done
from specctl.recipe import load_recipe
from specctl.verifier import load_verifier

REPO = Path(__file__).resolve().parent.parent


def on_8_gpus(device: str) -> tuple[str, list]:
    """What `resolve_device` (the verifier's and training's) gives this process on a machine with 8
    GPUs, and the GPUs it made current: torch.cuda answers as such a machine would."""
    from unittest import mock

    current: list = []
    with (
        mock.patch.object(torch.cuda, "is_available", lambda: True),
        mock.patch.object(torch.cuda, "device_count", lambda: 8),
        mock.patch.object(torch.cuda, "set_device", current.append),
    ):
        return str(resolve_device(device)), [str(d) for d in current]


def worker(recipe_path: Path, out: Path) -> None:
    """One rank: the device it would take on an 8-GPU machine, then a real collect (CPU)."""
    summary = collect(load_recipe(recipe_path), progress=False)
    report = {
        "rank": int(os.environ["RANK"]),
        "on_8_gpus": on_8_gpus("auto"),
        "device": summary.device,
        "written": summary.shards_written,
        "complete": summary.complete,
    }
    (out / f"rank-{report['rank']}.json").write_text(json.dumps(report))


def test_two_ranks_under_torchrun_build_one_store(tmp_path, tiny_verifier_dir):
    single = load_recipe(make_recipe(tmp_path, tiny_verifier_dir, name="single"))
    collect(single, progress=False)
    recipe_path = make_recipe(tmp_path, tiny_verifier_dir, name="ranks")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*launcher, "--log-dir", str(tmp_path / "torchrun-logs"), __file__, str(recipe_path), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [r["on_8_gpus"] for r in ranks] == [["cuda:0", ["cuda:0"]], ["cuda:1", ["cuda:1"]]]
    assert [r["device"] for r in ranks] == ["cpu", "cpu"]
    assert all(r["complete"] for r in ranks)
    features = load_recipe(recipe_path).run_dir / "features"
    shards = len(json.loads((features / "plan.json").read_text())["shards"])
    assert sum(r["written"] for r in ranks) == shards  # every shard once: no duplicate work
    assert store_bytes(features) == store_bytes(single.run_dir / "features")
    assert sorted(p.name for p in features.iterdir() if not p.suffix) == []  # no claims/, no temp dirs
    assert not [p for p in features.iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------- workers that die, hang, or live elsewhere


def collected(tmp_path: Path, verifier_dir: Path, name: str, *overrides: str):
    """A complete store for a recipe (with `overrides`), its bytes and its shard count."""
    recipe = load_recipe(make_recipe(tmp_path, verifier_dir, name=name), list(overrides))
    collect(recipe, progress=False)
    features = recipe.run_dir / "features"
    shards = json.loads((features / "plan.json").read_text())["shards"]
    return recipe, features, store_bytes(features), len(shards)


def drop(features: Path, *shards: int) -> None:
    """Shards that were never finished, and so no manifest."""
    (features / "manifest.json").unlink()
    for j in shards:
        (features / f"shard-{j:05d}.safetensors").unlink()
        (features / f"shard-{j:05d}.json").unlink()


def clean(features: Path) -> bool:
    """Nothing beside the store's files: no claims/, no temp file of any worker."""
    return not [p.name for p in features.iterdir() if p.name.startswith(".") or p.is_dir()]


@fault(
    stage="collect",
    fault="workers died holding shard claims: one on this machine (pid gone), one on another (lease expired)",
    result="a rerun takes both shards over at once and completes the store byte-identically; their temp "
    "files are removed",
)
def test_a_rerun_takes_over_dead_workers_shards(tmp_path, tiny_verifier_dir):
    recipe, features, before, n = collected(tmp_path, tiny_verifier_dir, "dead")
    drop(features, 1, 2)
    claims = ShardClaims(features, recipe.features.claim_lease_s)
    write_claim(claims, 1, host_name(), DEAD, 60)
    write_claim(claims, 2, OTHER, 4242, -1)
    killed_here = f".shard-00001.safetensors.tmp-{host_name()}-{DEAD}"
    for name in (killed_here, f".shard-00002.safetensors.tmp-{OTHER}-4242"):
        (features / name).write_bytes(b"half")
        age(features / name, 3600)
    start = time.monotonic()
    summary = collect(recipe, progress=False)
    assert time.monotonic() - start < 60  # no wait for the local claim's 60 s lease
    assert summary.complete and (summary.shards_written, summary.shards_skipped) == (2, n - 2)
    assert store_bytes(features) == before and clean(features)


@fault(
    stage="collect",
    fault="a worker on another machine holds a shard (unexpired lease; its pid does not exist here)",
    result="its shard and temp file are left alone while the lease runs; the other worker waits, then "
    "takes the shard over once the lease expires and completes the store",
)
def test_a_live_worker_on_another_host_is_left_alone_until_its_lease_expires(tmp_path, tiny_verifier_dir):
    lease = "features.claim_lease_s=0.5"
    recipe, features, before, n = collected(tmp_path, tiny_verifier_dir, "shared", lease)
    drop(features, 1, 3)
    claims = ShardClaims(features, recipe.features.claim_lease_s)
    held = write_claim(claims, 1, OTHER, DEAD, 8)
    theirs = features / f".shard-00001.safetensors.tmp-{OTHER}-{DEAD}"
    theirs.write_bytes(b"being written on the other machine")
    age(theirs, 3600)  # an old file: only the claim says its writer lives
    result: list = []
    thread = threading.Thread(target=lambda: result.append(collect(recipe, progress=False)))
    thread.start()
    try:
        deadline = time.time() + 60
        while not shard_done(features, 3) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # about 10 of the waiting worker's polls
        assert time.time() < held.expires, "too slow to test: the other host's lease ran out already"
        assert thread.is_alive() and theirs.exists() and not shard_done(features, 1)
        assert Claim.decode(claims.path(1).read_bytes()) == held
    finally:
        thread.join(timeout=120)
    summary = result[0]
    assert summary.complete and summary.shards_written == 2
    assert store_bytes(features) == before and clean(features)  # its temp file went with its lease


class TakenOverMidShard:
    """The verifier, but as the worker finishes computing shard 1 another machine takes its claim
    over (as if this worker's lease had run out, for 2 s): the worker must drop shard 1 and compute
    it again once that lease expires."""

    def __init__(self, inner, claims: ShardClaims):
        self.inner, self.claims = inner, claims
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @contextmanager
    def feature_forward(self, *args, **kwargs):
        with self.inner.feature_forward(*args, **kwargs) as forward:

            def wrapped(samples, on_batch):
                self.calls += 1
                rows = forward(samples, on_batch)
                if self.calls == 2:  # shard 1's first pass (one worker: shards in order)
                    write_claim(self.claims, 1, OTHER, DEAD, 2)
                return rows

            yield wrapped


@fault(
    stage="collect",
    fault="a worker's claim is taken over while it computes the shard (its lease ran out)",
    result="it drops that shard without writing it, goes on, and writes it once the taker's lease expires",
)
def test_a_worker_whose_claim_was_taken_over_drops_the_shard(tmp_path, tiny_verifier_dir):
    recipe, features, before, n = collected(tmp_path, tiny_verifier_dir, "lost", "features.claim_lease_s=0.5")
    drop(features, *range(n))
    claims = ShardClaims(features, recipe.features.claim_lease_s)
    verifier = TakenOverMidShard(load_verifier(recipe.verifier), claims)
    summary = collect(recipe, progress=False, verifier=verifier)
    assert verifier.calls == n + 1  # shard 1 computed twice: dropped once, then taken back
    assert summary.complete and summary.shards_written == n
    assert store_bytes(features) == before and clean(features)


def _finalize(barrier, queue, store: str) -> None:
    from specctl import features as features_mod

    created, rewrites = [], []
    real_create, real_write = features_mod.create_once, features_mod.write_atomic
    features_mod.create_once = lambda path, data: created.append(real_create(path, data)) or created[-1]
    features_mod.write_atomic = lambda path, data: rewrites.append(path) or real_write(path, data)
    barrier.wait()
    manifest = finalize_store(Path(store))
    queue.put((manifest is not None, created, len(rewrites)))
    barrier.wait()


def test_the_manifest_is_written_once(tmp_path, tiny_verifier_dir):
    """6 workers finish at once: one writes the manifest, the others leave it; a rerun too."""
    recipe, features, before, n = collected(tmp_path, tiny_verifier_dir, "once")
    (features / "manifest.json").unlink()
    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(6), ctx.Queue()
    procs = [ctx.Process(target=_finalize, args=(barrier, queue, str(features))) for _ in range(6)]
    for p in procs:
        p.start()
    answers = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(done for done, _, _ in answers)
    assert sorted(created for _, created, _ in answers) == [[False]] * 5 + [[True]]
    assert sum(rewrites for _, _, rewrites in answers) == 0
    assert store_bytes(features) == before
    stat = (features / "manifest.json").stat()
    assert collect(recipe, progress=False).complete
    again = (features / "manifest.json").stat()
    assert (again.st_ino, again.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)


if __name__ == "__main__":
    worker(Path(sys.argv[1]), Path(sys.argv[2]))
