"""The collect stage and feature store on a tiny random verifier: exactness, resume, sharding, faults."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from specctl.collect import collect, token_budget_batches
from specctl.data import load_samples
from specctl.errors import FeatureStoreError, VerifierError
from specctl.features import open_features, plan_shards, shard_done
from specctl.recipe import load_recipe

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "dogs",
    "ran",
    "far",
    "away",
    "from",
    "big",
    "red",
    "houses",
    "near",
    "blue",
    "lakes",
]


def write_conversations(path: Path, n: int = 24, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            q = " ".join(rng.choices(WORDS, k=rng.randint(3, 12)))
            a = " ".join(rng.choices(WORDS, k=rng.randint(5, 40)))
            f.write(
                json.dumps(
                    {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                )
            )
            f.write("\n")
    return path


def make_recipe(tmp_path: Path, verifier_dir: Path, name: str = "t", **features) -> Path:
    data = write_conversations(tmp_path / "chats.jsonl")
    recipe = {
        "name": name,
        "output_dir": str(tmp_path / "runs"),
        "verifier": {"name_or_path": str(verifier_dir)},
        "data": {"source": str(data), "max_length": 256},
        "features": {"aux_layer_ids": [1, 2, 3], "shard_tokens": 600, "batch_tokens": 512, **features},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_cli(*args: str, env: dict | None = None, preexec=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specctl", *args],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=preexec,
        timeout=300,
    )


def store_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.suffix in (".safetensors", ".json")}


def test_plan_shards_covers_everything_in_order():
    rng = random.Random(1)
    for _ in range(50):
        lengths = [rng.randint(1, 50) for _ in range(rng.randint(0, 30))]
        budget = rng.randint(1, 120)
        shards = plan_shards(lengths, budget)
        assert [i for a, b in shards for i in range(a, b)] == list(range(len(lengths)))
        for a, b in shards:
            assert b > a
            assert b - a == 1 or sum(lengths[a:b]) <= budget


def test_token_budget_batches_respect_budget():
    rng = random.Random(2)
    for _ in range(50):
        lengths = [rng.randint(1, 64) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(16, 256)
        batches = token_budget_batches(lengths, budget)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for b in batches:
            assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget


def test_collect_matches_hf_output_hidden_states(tmp_path, tiny_verifier_dir):
    recipe = load_recipe(make_recipe(tmp_path, tiny_verifier_dir))
    summary = collect(recipe, progress=False)
    assert summary.complete and summary.shards_written > 1
    store = open_features(recipe.run_dir / "features")
    samples = load_samples(recipe.run_dir / "data")
    assert len(store) == len(samples) == 24
    assert store.manifest.aux_layer_ids == [1, 2, 3] and store.manifest.hidden_size == 64

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_verifier_dir, dtype=torch.float32).eval()
    for i in (0, 7, 23):
        row = store[i]
        assert torch.equal(row["input_ids"], samples[i]["input_ids"])
        assert torch.equal(row["loss_mask"], samples[i]["loss_mask"])
        with torch.no_grad():
            hs = model(row["input_ids"][None], output_hidden_states=True).hidden_states
        T = row["input_ids"].numel()
        assert row["aux_hidden_states"].shape == (T, 3, 64)
        assert row["aux_hidden_states"].dtype == torch.bfloat16
        for j, layer in enumerate([1, 2, 3]):
            torch.testing.assert_close(
                row["aux_hidden_states"][:, j].float(), hs[layer][0], atol=2e-2, rtol=2e-2
            )
        # last_hidden_state is the residual stream before the final norm: norm(last) == HF's last entry
        normed = model.model.norm(row["last_hidden_state"].float())
        torch.testing.assert_close(normed, hs[-1][0], atol=5e-2, rtol=2e-2)


def test_rerun_skips_done_shards_and_refuses_other_layers(tmp_path, tiny_verifier_dir):
    path = make_recipe(tmp_path, tiny_verifier_dir)
    recipe = load_recipe(path)
    collect(recipe, progress=False)
    before = store_bytes(recipe.run_dir / "features")
    again = collect(recipe, progress=False)
    assert again.shards_written == 0 and again.complete
    assert store_bytes(recipe.run_dir / "features") == before
    with pytest.raises(FeatureStoreError, match="aux_layer_ids"):
        collect(load_recipe(path, ["features.aux_layer_ids=[1,2]"]), progress=False)
    assert store_bytes(recipe.run_dir / "features") == before


def test_shard_workers_build_one_store_identical_to_single_run(tmp_path, tiny_verifier_dir):
    single = load_recipe(make_recipe(tmp_path, tiny_verifier_dir, name="single"))
    collect(single, progress=False)
    split = load_recipe(make_recipe(tmp_path, tiny_verifier_dir, name="split"))
    first = collect(split, shard="0/2", progress=False)
    assert not first.complete
    with pytest.raises(FeatureStoreError, match="incomplete feature store"):
        open_features(split.run_dir / "features")
    second = collect(split, shard="1/2", progress=False)
    assert second.complete
    assert store_bytes(split.run_dir / "features") == store_bytes(single.run_dir / "features")


def test_half_written_shard_is_not_done(tmp_path, tiny_verifier_dir):
    recipe = load_recipe(make_recipe(tmp_path, tiny_verifier_dir))
    collect(recipe, progress=False)
    path = recipe.run_dir / "features"
    shard = path / "shard-00001.safetensors"
    good = shard.read_bytes()
    shard.write_bytes(good[: len(good) // 2])  # a torn write
    assert not shard_done(path, 1)
    (path / "manifest.json").unlink()
    collect(recipe, progress=False)
    assert shard.read_bytes() == good


def test_flipped_byte_is_named(tmp_path, tiny_verifier_dir):
    recipe = load_recipe(make_recipe(tmp_path, tiny_verifier_dir))
    collect(recipe, progress=False)
    shard = recipe.run_dir / "features" / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    store = open_features(recipe.run_dir / "features")
    with pytest.raises(FeatureStoreError, match="shard-00000.safetensors: checksum mismatch"):
        store[0]


def test_kill_9_then_rerun_gives_identical_store(tmp_path, tiny_verifier_dir):
    reference = load_recipe(make_recipe(tmp_path, tiny_verifier_dir, name="ref"))
    collect(reference, progress=False)
    victim_path = make_recipe(tmp_path, tiny_verifier_dir, name="victim")
    victim = load_recipe(victim_path)
    features = victim.run_dir / "features"
    proc = subprocess.Popen(
        [sys.executable, "-m", "specctl", "collect-hidden-states", str(victim_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while time.time() < deadline and not (features / "shard-00000.json").exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (features / "manifest.json").exists(), "too late to test the kill: the run finished"
    result = run_cli("collect-hidden-states", str(victim_path))
    assert result.returncode == 0, result.stderr
    assert store_bytes(features) == store_bytes(reference.run_dir / "features")
    assert not [p for p in features.iterdir() if ".tmp-" in p.name]


def test_disk_full_keeps_finished_shards(tmp_path, tiny_verifier_dir):
    import resource

    path = make_recipe(tmp_path, tiny_verifier_dir)
    recipe = load_recipe(path)
    # first, the data stage alone (small files), then cap file size below one shard's size
    collect_limit = 150_000

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (collect_limit, collect_limit))

    result = run_cli("collect-hidden-states", str(path), preexec=cap)
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert "disk full" in line and "rerun" in line
    features = recipe.run_dir / "features"
    assert not (features / "manifest.json").exists()
    assert not [p for p in features.iterdir() if ".tmp-" in p.name]
    result = run_cli("collect-hidden-states", str(path))
    assert result.returncode == 0, result.stderr
    assert len(open_features(features)) == 24


def test_missing_verifier_dir_is_one_line(tmp_path):
    path = make_recipe(tmp_path, tmp_path / "no-such-model")
    result = run_cli("collect-hidden-states", str(path))
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0
    assert "no such directory" in result.stderr


def test_unreachable_hub_verifier_says_what_to_pass(tmp_path, tiny_verifier_dir):
    from specctl.recipe import VerifierSection
    from specctl.verifier import load_verifier

    env_before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        with pytest.raises(VerifierError, match="local HF directory or the built-in alias"):
            load_verifier(VerifierSection(name_or_path="someorg/definitely-not-cached-model"))
    finally:
        if env_before is None:
            os.environ.pop("HF_HUB_OFFLINE")
        else:
            os.environ["HF_HUB_OFFLINE"] = env_before
