"""Features prove their origin (specctl/origin.py): collect records the verifier, its weights,
tokenizer, data and layout; train refuses a store of another; checkpoints, exports and model
cards carry the record. The tiny world: random Llama verifiers saved as HF directories."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_tokenizer, make_tiny_verifier
from reliability_matrix import fault

from specctl import checkpoint as ckpt
from specctl.collect import collect
from specctl.drafters import DRAFTERS
from specctl.errors import FeatureStoreError
from specctl.export import export_drafter
from specctl.export.hub import model_card
from specctl.origin import (
    ORIGIN_FILE,
    SAMPLE_BYTES,
    FeatureOrigin,
    file_fingerprint,
    mismatch,
    read_origin,
    sample_offsets,
)
from specctl.recipe import Recipe, recipe_from_dict
from specctl.speculators.validate import validate_export
from specctl.train import run_training

AUX = (1, 2, 3)

# ---------------------------------------------------------------- pure parts


@pytest.mark.parametrize(
    "start,end", [(0, 0), (8, 9), (100, 100 + 3 * SAMPLE_BYTES + 5), (24, 10**9), (0, 8 * 4096)]
)
def test_sample_offsets_spread_evenly_over_the_range(start, end):
    """Against the brute-force reading of "evenly": consecutive gaps differ by at most one byte, the
    first block starts at `start`, the last ends at `end`, every block inside; a range of at most
    SAMPLES blocks is read whole."""
    got = sample_offsets(start, end)
    span, block = end - start, SAMPLE_BYTES
    if span <= 0:
        assert got == []
        return
    if span <= 8 * block:
        assert got == list(range(start, end, block))  # every byte covered, once
        return
    assert len(got) == 8 and got[0] == start and got[-1] + block == end
    gaps = [b - a for a, b in zip(got, got[1:], strict=False)]
    assert max(gaps) - min(gaps) <= 1 and min(gaps) >= block  # no overlap: 8 distinct blocks


def test_file_fingerprint_sees_a_sampled_byte_and_reads_little(tmp_path):
    """A byte flipped in a sampled block (or the header) changes the fingerprint; a sparse 8 GiB
    file is fingerprinted in milliseconds (it never reads the whole file)."""
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(200_000, dtype=torch.float32)}, str(path))
    before = file_fingerprint(path)
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    for offset in (start, sample_offsets(start, len(data))[3] + 17, len(data) - 1, 20):
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        path.write_bytes(changed)
        assert file_fingerprint(path) != before, offset
    path.write_bytes(data)
    assert file_fingerprint(path) == before

    big = tmp_path / "big.safetensors"
    with open(big, "wb") as f:
        f.truncate(8 << 30)
    t = time.perf_counter()
    file_fingerprint(big)
    assert time.perf_counter() - t < 0.5


def _origin(**changes) -> FeatureOrigin:
    base = FeatureOrigin(
        verifier="org/model",
        hub_id="org/model",
        revision="abc",
        weights_index="i1",
        weights={"a.safetensors": "1", "b.safetensors": "2"},
        tokenizer="t",
        data="d",
        config="c",
        hidden_size=64,
        num_layers=4,
        aux_layer_ids=(1, 2, 3),
        features={"target": "hidden"},
    )
    return FeatureOrigin(**{**base.to_json(), "aux_layer_ids": (1, 2, 3), **changes})


def test_mismatch_names_the_first_field_and_compares_only_what_both_know():
    have = _origin()
    assert mismatch(have, _origin()) is None
    assert mismatch(have, _origin(verifier="/moved/dir")) is None  # a path is recorded, not compared
    assert mismatch(have, _origin(hub_id=None, revision=None, weights_index="")) is None  # unknown here
    assert mismatch(have, _origin(weights={"b.safetensors": "2"})) is None  # only b downloaded here
    assert mismatch(have, _origin(weights={"b.safetensors": "9"}))[0] == "weights (b.safetensors)"
    assert mismatch(have, _origin(hub_id="org/other", tokenizer="x"))[0] == "hub_id"
    assert mismatch(have, _origin(revision="def"))[0] == "revision"
    assert mismatch(have, _origin(tokenizer="x", data="y"))[0] == "tokenizer"
    assert mismatch(have, _origin(data="y")) == ("data", "d", "y")
    assert mismatch(have, _origin(aux_layer_ids=(0, 1)))[0] == "aux_layer_ids"
    assert FeatureOrigin.from_json(json.loads(json.dumps(have.to_json()))) == have


# ---------------------------------------------------------------- the pipeline


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """Verifier directories -- a base, a fine-tune of it (same architecture and tokenizer, every
    weight moved a little), the base with another chat template -- and two data files."""
    root = tmp_path_factory.mktemp("origin-world")
    out = {}
    base = make_tiny_verifier()
    tokenizer = make_tiny_tokenizer()
    for name in ("base", "finetune", "template"):
        model = base
        if name == "finetune":
            model = make_tiny_verifier()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 1e-3)
        out[name] = root / name
        model.save_pretrained(out[name])
        if name == "template":
            tokenizer.chat_template = tokenizer.chat_template.replace("\n", "\n\n", 1)
        tokenizer.save_pretrained(out[name])
    g = torch.Generator().manual_seed(1)
    for name in ("rows", "other-rows"):
        lines = []
        for _ in range(12 if name == "rows" else 13):
            T = int(torch.randint(12, 30, (1,), generator=g))
            ids = torch.randint(3, 40, (T,), generator=g).tolist()
            lines.append(json.dumps({"input_ids": ids, "loss_mask": [0] * (T // 3) + [1] * (T - T // 3)}))
        out[name] = root / f"{name}.jsonl"
        out[name].write_text("\n".join(lines) + "\n")
    return out


def recipe(tmp_path: Path, name: str, verifier: Path, data: Path) -> Recipe:
    return recipe_from_dict(
        {
            "name": name,
            "output_dir": str(tmp_path),
            "verifier": {"name_or_path": str(verifier), "device": "cpu"},
            "data": {"source": str(data)},
            "features": {"aux_layer_ids": list(AUX), "dtype": "float32"},
            "drafter": {"algo": "dflash", "dflash": DRAFTERS["dflash"].tiny, "draft_vocab_size": 64},
            "train": {
                "max_steps": 2,
                "batch_tokens": 160,
                "val_fraction": 0,
                "save_every": 2,
                "log_every": 1,
                "precision": "float32",
                "lr": 1e-3,
                "warmup_steps": 1,
            },
        }
    )


def copy_features(tmp_path: Path, into: str) -> None:
    """The base run's features (and its data, which the draft vocabulary is counted from) copied."""
    for part in ("features", "data"):
        shutil.copytree(tmp_path / "base" / part, tmp_path / into / part)


@fault(
    stage="train",
    fault="a feature store copied into a run whose verifier is a fine-tune of its own (same "
    "architecture and tokenizer), whose chat template differs, or whose data differs",
    result="FeatureStoreError before a step, one line naming the field (verifier weights and the file, "
    "tokenizer, data) and what to do; no checkpoint written",
)
def test_train_refuses_features_of_another_verifier_tokenizer_or_data(tmp_path, world):
    collect(recipe(tmp_path, "base", world["base"], world["rows"]), progress=False)
    manifest = json.loads((tmp_path / "base" / "features" / "manifest.json").read_text())
    origin = FeatureOrigin.from_json(manifest["origin"])
    assert origin.weights.keys() == {"model.safetensors"} and origin.aux_layer_ids == AUX
    assert (
        origin.data == json.loads((tmp_path / "base" / "data" / "manifest.json").read_text())["fingerprint"]
    )
    cases = {
        "finetune": (
            world["finetune"],
            world["rows"],
            r"recipe's verifier weight file is not the one .* \(model.safetensors: recorded ",
        ),
        "template": (world["template"], world["rows"], r"recipe's tokenizer \(or chat template\) is not"),
        "data": (
            world["base"],
            world["other-rows"],
            r"recipe's data \(the data\.\* settings or the data\.source file\) is not",
        ),
    }
    for name, (verifier, data, field) in cases.items():
        copy_features(tmp_path, name)
        with pytest.raises(FeatureStoreError, match=field) as refused:
            run_training(recipe(tmp_path, name, verifier, data), progress=False)
        assert "\n" not in str(refused.value) and "collect-hidden-states" in str(refused.value)
        assert str(tmp_path / name / "features") in str(refused.value)
        assert not (tmp_path / name / "drafters" / "dflash" / "checkpoints").exists(), name


@fault(
    stage="train",
    fault="features whose origin matches the recipe, then exported and given a model card",
    result="trains; the checkpoint's meta.json, the export's origin.json and the model card carry "
    "the store's origin",
)
def test_the_origin_travels_to_checkpoint_export_and_card(tmp_path, world):
    r = recipe(tmp_path, "base", world["base"], world["rows"])
    collect(r, progress=False)
    stored = FeatureOrigin.from_json(
        json.loads((tmp_path / "base" / "features" / "manifest.json").read_text())["origin"]
    )
    done = run_training(r, progress=False)
    assert FeatureOrigin.from_json(ckpt.read_meta(done.checkpoint)["features_origin"]) == stored
    export = export_drafter(done.checkpoint).output
    assert read_origin(export) == stored and (export / ORIGIN_FILE).is_file()
    card = model_card(validate_export(export), "me/drafter")
    assert f"| features collected from | {stored.short()} (origin.json) |" in card


@fault(
    stage="train",
    fault="a feature store collected before stores recorded their origin (no `origin` in manifest.json)",
    result="trains, with one warning line saying its verifier weights, tokenizer and data are not "
    "checked and to recollect; the checkpoint records no origin",
)
def test_a_store_without_origin_trains_with_a_warning(tmp_path, world, capfd):
    collect(recipe(tmp_path, "base", world["base"], world["rows"]), progress=False)
    copy_features(tmp_path, "old")
    for file in ("manifest.json", "plan.json"):
        path = tmp_path / "old" / "features" / file
        d = json.loads(path.read_text())
        del d["origin"]
        path.write_text(json.dumps(d, indent=1))
    capfd.readouterr()
    done = run_training(recipe(tmp_path, "old", world["finetune"], world["rows"]), progress=False)
    warned = [line for line in capfd.readouterr().err.splitlines() if "records no origin" in line]
    assert len(warned) == 1 and "rerun collect-hidden-states" in warned[0]
    assert ckpt.read_meta(done.checkpoint)["features_origin"] is None


def test_collect_into_a_store_of_another_verifier_names_the_weights(tmp_path, world):
    """The verifier directory's weights replaced (by a fine-tune's) between two runs of collect on
    a half-done store: the rerun is refused by the origin, naming the weight file; nothing written."""
    verifier = tmp_path / "verifier"
    shutil.copytree(world["base"], verifier)
    collect(recipe(tmp_path, "base", verifier, world["rows"]), progress=False)
    store = tmp_path / "base" / "features"
    (store / "manifest.json").unlink()  # as if not finished yet
    (store / "shard-00000.json").unlink()
    plan = (store / "plan.json").read_bytes()
    shutil.copy(world["finetune"] / "model.safetensors", verifier / "model.safetensors")
    with pytest.raises(
        FeatureStoreError, match=r"verifier weight file is not the one .* \(model.safetensors: "
    ):
        collect(recipe(tmp_path, "base", verifier, world["rows"]), progress=False)
    assert (store / "plan.json").read_bytes() == plan
    assert not (store / "shard-00000.json").exists()  # nothing computed
