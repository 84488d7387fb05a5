"""devices.local_device: which device a process takes, from the recipe's device, torchrun's
LOCAL_RANK and the visible GPU count (a real torchrun run: tests/test_collect_distributed.py)."""

from __future__ import annotations

import pytest
import torch

from specctl.devices import launcher_local_rank, local_device
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
