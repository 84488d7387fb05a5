"""Rank-0-only work longer than the process group's collective timeout (issue 56, item 3).

Under torchrun rank 0 alone prepares the online data (hours of generation) or downloads the
verifier while the other ranks wait. Waiting in a barrier, they were aborted by the group's
timeout (NCCL's default: 10 minutes). Here 2 real gloo ranks run `online_source` with a 2-second
collective timeout while rank 0's data preparation takes 6 s: the others must wait it out, the
group must still work after, and a failure on rank 0 must reach them as one line.

Run as a script (`torchrun --nproc-per-node 2 tests/test_collective_timeout.py OUT`), this file is
the worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parent.parent
TINY_TIMEOUT = timedelta(seconds=2)  # the group's collective timeout in the worker
SLOW_S = 6.0  # rank 0's data preparation: three times the timeout


def online_source_on(ctx, out: Path, prepare) -> str:
    """`loop.online_source` with `prepare` as rank 0's data preparation (samples faked, no verifier):
    "ok", or the error this rank stopped with."""
    from specctl.train import loop

    sample = {"input_ids": torch.arange(4), "loss_mask": torch.ones(4, dtype=torch.bool)}
    loop.prepare_data = prepare
    loop.load_samples = lambda data_dir: [sample]
    loop.verifier_weights = lambda verifier: None
    recipe = SimpleNamespace(run_dir=out, data=None)
    verifier = SimpleNamespace(tokenizer=None, model=None)
    try:
        loop.online_source(recipe, ctx, verifier, SimpleNamespace(aux_layer_ids=[0]), progress=False)
        return "ok"
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"


def worker(out: Path) -> None:
    """Both cases on this rank; its answers in out/rank<R>.json."""
    import torch.distributed as dist

    from specctl import distributed

    # a generous timeout for the rendezvous (the ranks import at different speeds), then the tiny one
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    dist.barrier()
    dist.distributed_c10d._set_pg_timeout(TINY_TIMEOUT)
    ctx = distributed.setup("cpu")  # reuses the group, as when the caller made it

    def slow(*args, **kwargs):
        time.sleep(SLOW_S)

    start = time.monotonic()
    report = {"slow": online_source_on(ctx, out, slow), "slow_s": time.monotonic() - start}
    total = torch.ones(1)
    dist.all_reduce(total)  # the group still works after the wait
    report["all_reduce"] = total.item()

    def fails(*args, **kwargs):
        raise OSError("disk full while writing tokens.safetensors")

    report["failed"] = online_source_on(ctx, out, fails)
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def test_ranks_wait_out_rank0_work_longer_than_the_collective_timeout(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*launcher, "--log-dir", str(tmp_path / "torchrun-logs"), __file__, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["slow"] == rank1["slow"] == "ok"
    assert rank1["slow_s"] >= SLOW_S - 0.5  # it did wait for rank 0, past the 2 s timeout
    assert rank0["all_reduce"] == rank1["all_reduce"] == 2.0
    assert rank0["failed"] == "OSError: disk full while writing tokens.safetensors"
    assert rank1["failed"] == (
        "SpecctlError: rank 0 stopped while preparing the data (disk full while writing tokens.safetensors)"
    )


def test_setup_passes_the_configured_timeout(monkeypatch):
    """setup() gives init_process_group the timeout it is handed; run_training hands it the recipe's
    train.collective_timeout_minutes (NCCL's own default, 10 minutes, is not used)."""
    import torch.distributed as dist

    from specctl import distributed
    from specctl.recipe import Recipe
    from specctl.train import loop

    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    ctx = distributed.setup("cpu", timedelta(minutes=90))
    assert calls == [("gloo", {"timeout": timedelta(minutes=90)})]
    assert (ctx.world_size, ctx.owns_group) == (2, True)

    handed = []
    monkeypatch.setattr(loop.distributed, "setup", lambda device, timeout: handed.append(timeout) or ctx)
    monkeypatch.setattr(loop.distributed, "teardown", lambda ctx, together=False: None)
    monkeypatch.setattr(loop, "train", lambda *args: None)
    recipe = Recipe.model_validate({"name": "t", "train": {"collective_timeout_minutes": 240}})
    loop.run_training(recipe, progress=False)
    assert handed == [timedelta(hours=4)]
    assert Recipe.model_validate({"name": "t"}).train.collective_timeout_minutes == 60


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
