"""devices.local_device: which device a process takes, from the recipe's device, torchrun's
LOCAL_RANK and the visible GPU count (a real torchrun run: tests/test_collect_distributed.py)."""

from __future__ import annotations

import pytest
import torch

from specctl.devices import launcher_local_rank, local_device, resolve_device
from specctl.errors import UsageError


@pytest.mark.parametrize(
    "device, local_rank, gpus, want",
    [
        ("auto", None, 0, "cpu"),
        ("auto", None, 8, "cuda"),  # one process: the current GPU, as before torchrun support
        ("auto", 0, 8, "cuda:0"),
        ("auto", 5, 8, "cuda:5"),
        ("auto", 5, 0, "cpu"),  # torchrun on a CPU machine: CPU stays CPU
        ("cuda", 3, 8, "cuda:3"),
        ("cuda:0", 3, 8, "cuda:3"),  # ranks never share a GPU
        ("cuda:1", None, 8, "cuda:1"),  # one process: the GPU it names
        ("cpu", 3, 8, "cpu"),
    ],
)
def test_local_device(device, local_rank, gpus, want):
    assert local_device(device, local_rank, gpus) == torch.device(want)


def test_local_device_refuses_more_ranks_than_gpus():
    with pytest.raises(UsageError, match="LOCAL_RANK 2 but only 2 GPU\\(s\\) visible .*-node <= 2"):
        local_device("auto", 2, 2)
    # a verifier over 4 GPUs: local rank r starts at GPU 4r, and a node of 8 runs two such ranks
    assert local_device("auto", 1, 8, span=4) == torch.device("cuda", 4)
    with pytest.raises(UsageError, match="LOCAL_RANK 2 .* 8 GPU\\(s\\) visible for 4 .*-node <= 2"):
        local_device("cuda", 2, 8, span=4)
    with pytest.raises(UsageError, match="verifier.device 'gpu0': not a torch device"):
        local_device("gpu0", None, 0)


def test_launcher_local_rank(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert launcher_local_rank() is None
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert launcher_local_rank() == 3
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(UsageError, match="LOCAL_RANK='x'"):
        launcher_local_rank()


def test_srun_tasks_without_torchrun_are_refused_in_one_line(monkeypatch):
    """`srun --ntasks 8 specctl train ...` on an 8-GPU node: 8 single-process runs, each on cuda:0.
    Refused; a torchrun rank, a task with a GPU of its own and an sbatch script's shell go on."""
    for name in ("WORLD_SIZE", "LOCAL_RANK", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    gpus = [8]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus[0])
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setenv("SLURM_NTASKS", "8")  # an sbatch --ntasks 8 script's own shell: one process
    assert resolve_device("auto") == torch.device("cuda")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")  # srun's 8 tasks
    with pytest.raises(UsageError, match=r"srun started 8 tasks \(SLURM_STEP_NUM_TASKS\)") as e:
        resolve_device("auto")
    assert "\n" not in str(e.value) and "torchrun" in str(e.value)
    gpus[0] = 1  # srun --gpus-per-task 1: each task sees its own GPU
    assert resolve_device("auto") == torch.device("cuda")
    gpus[0] = 8
    monkeypatch.setenv("WORLD_SIZE", "16")  # srun --ntasks-per-node 1 torchrun ...: the ranks go on
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert resolve_device("auto") == torch.device("cuda", 5)
