"""The collect stage and feature store on a tiny random verifier: exactness, resume, sharding, faults."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import error_lines
from reliability_matrix import fault

from specctl.batching import length_buckets
from specctl.collect import collect
from specctl.data import load_samples
from specctl.drafters.targets import batch_targets
from specctl.errors import FeatureStoreError, RecipeError, VerifierError
from specctl.features import (
    FP8_MAX,
    Layout,
    dequantize_fp8,
    layout_bytes_per_token,
    open_features,
    plan_shards,
    quantize_fp8,
    shard_done,
)
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


def test_length_buckets_longest_first_respect_budget():
    rng = random.Random(2)
    for _ in range(50):
        lengths = [rng.randint(1, 64) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(16, 256)
        batches = length_buckets(lengths, budget, longest_first=True)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for b in batches:
            assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget
            assert lengths[b[0]] == max(lengths[i] for i in b)  # the longest opens its batch
        flat = [i for b in batches for i in b]
        assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)  # longest (memory peak) first


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


@fault(
    stage="collect",
    fault="rerun into the same store with other aux_layer_ids",
    result="FeatureStoreError naming aux_layer_ids; a plain rerun rewrites nothing",
)
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
    """`--shard I/N` keeps to its part: worker 0/2 leaves 1/2's shards (unclaimed) alone."""
    single = load_recipe(make_recipe(tmp_path, tiny_verifier_dir, name="single"))
    collect(single, progress=False)
    split = load_recipe(make_recipe(tmp_path, tiny_verifier_dir, name="split"))
    first = collect(split, shard="0/2", progress=False)
    n = len(json.loads((split.run_dir / "features" / "plan.json").read_text())["shards"])
    mine = (n + 1) // 2  # shards 0, 2, 4, ...
    assert not first.complete and (first.shards_written, first.shards_skipped) == (mine, 0)
    with pytest.raises(FeatureStoreError, match=f"incomplete feature store \\({mine} of {n} shards\\)"):
        open_features(split.run_dir / "features")
    second = collect(split, shard="1/2", progress=False)
    assert second.complete and second.shards_written == n // 2
    assert store_bytes(split.run_dir / "features") == store_bytes(single.run_dir / "features")
    assert not (split.run_dir / "features" / "claims").exists()


def test_a_plain_run_finishes_what_shard_workers_left(tmp_path, tiny_verifier_dir):
    """After `--shard 0/2` alone, a plain rerun (or torchrun) computes the other part."""
    recipe = load_recipe(make_recipe(tmp_path, tiny_verifier_dir))
    collect(recipe, shard="0/2", progress=False)
    n = len(json.loads((recipe.run_dir / "features" / "plan.json").read_text())["shards"])
    rest = collect(recipe, progress=False)
    assert rest.complete and (rest.shards_written, rest.shards_skipped) == (n // 2, (n + 1) // 2)


def test_spread_verifier_loads_its_weights_after_the_data_stage(tmp_path, tiny_verifier_dir, monkeypatch):
    """verifier.tensor_parallel_size 2 (two GPUs faked; the weights load on the CPU): collect reads
    the verifier's files, runs the data stage with no model in this process (its vLLM engines would
    need the GPUs), then loads the weights, only when a shard is left to compute, and writes the
    store a one-GPU run writes. A group the GPUs cannot hold is refused before the data stage."""
    import specctl.collect.capture as stage
    from specctl.verifier import load_verifier

    single = load_recipe(make_recipe(tmp_path, tiny_verifier_dir, name="single"))
    collect(single, progress=False)
    spread = load_recipe(
        make_recipe(tmp_path, tiny_verifier_dir, name="spread"), ["verifier.tensor_parallel_size=2"]
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the plan asks this process's GPU
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 << 30))
    events, prepare = [], stage.prepare_data

    def data(*args, model=None, **kwargs):
        events.append(("data", model))
        return prepare(*args, model=model, **kwargs)

    def weights(section):
        events.append(("weights", section.tensor_parallel_size))
        return load_verifier(section.model_copy(update={"tensor_parallel_size": 1, "device": "cpu"}))

    monkeypatch.setattr(stage, "prepare_data", data)
    monkeypatch.setattr(stage, "load_verifier", weights)
    collect(spread, progress=False)
    assert events == [("data", None), ("weights", 2)]
    assert store_bytes(spread.run_dir / "features") == store_bytes(single.run_dir / "features")
    collect(spread, progress=False)  # every shard done: the weights are not loaded at all
    assert events[2:] == [("data", None)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(
        RecipeError, match=r"verifier.tensor_parallel_size=2 from GPU 0 needs 2 GPU\(s\) but 1"
    ):
        collect(spread, progress=False)
    assert events[3:] == []


@fault(
    stage="collect",
    fault="a torn shard write (half the file)",
    result="the shard does not count as done; the rerun rewrites it byte-identically",
)
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


@fault(
    stage="collect",
    fault="a flipped byte in a feature shard",
    result="FeatureStoreError `shard-00000.safetensors: checksum mismatch` on first read",
)
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


@fault(
    stage="collect",
    fault="kill -9 during collect-hidden-states",
    result="the rerun finishes; the store is byte-identical to an uninterrupted run; no temporary files",
)
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


def collect_with_file_limit(recipe: Path, limit: int) -> subprocess.CompletedProcess:
    """`specctl collect-hidden-states RECIPE` with RLIMIT_FSIZE at `limit` bytes: a full disk."""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return run_cli("collect-hidden-states", str(recipe), preexec=cap)


def assert_rerun_completes(recipe: Path) -> None:
    """After a refused write, the same command with room on the disk finishes the store."""
    result = run_cli("collect-hidden-states", str(recipe))
    assert result.returncode == 0, result.stderr
    assert len(open_features(load_recipe(recipe).run_dir / "features")) == 24


@fault(
    stage="collect",
    fault="disk full (RLIMIT_FSIZE) mid-collect",
    result="exit 1 with one line `disk full ... rerun`; finished shards kept, no temporary files; the "
    "rerun completes",
)
def test_disk_full_keeps_finished_shards(tmp_path, tiny_verifier_dir):
    path = make_recipe(tmp_path, tiny_verifier_dir)
    recipe = load_recipe(path)
    # the data stage's files fit (small), one shard does not
    result = collect_with_file_limit(path, 150_000)
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert "disk full" in line and "rerun" in line
    features = recipe.run_dir / "features"
    assert not (features / "manifest.json").exists()
    assert not [p for p in features.iterdir() if ".tmp-" in p.name]
    assert_rerun_completes(path)


@fault(
    stage="collect",
    fault="disk full (RLIMIT_FSIZE) while the data stage writes tokens.safetensors",
    result="exit 1 with one line naming the disk; no data/ dir and no temporary dir left; the rerun "
    "completes",
)
def test_disk_full_in_the_data_stage_leaves_nothing_half_written(tmp_path, tiny_verifier_dir):
    """data/ is what every later stage trusts by its manifest: a refused write must leave none of it."""
    path = make_recipe(tmp_path, tiny_verifier_dir)
    recipe = load_recipe(path)
    # below tokens.safetensors (24 tokenized conversations), above the empty lock file
    result = collect_with_file_limit(path, 1000)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and len(error_lines(result.stderr)) == 1, result.stderr
    assert "disk full" in result.stderr
    data = recipe.run_dir / "data"
    assert not data.exists()
    assert not [p.name for p in recipe.run_dir.iterdir() if p.name.startswith(".data.")]
    assert_rerun_completes(path)
    assert (data / "manifest.json").is_file()


@fault(stage="collect", fault="verifier directory missing", result="exit 1 and one line `no such directory`")
def test_missing_verifier_dir_is_one_line(tmp_path):
    path = make_recipe(tmp_path, tmp_path / "no-such-model")
    result = run_cli("collect-hidden-states", str(path))
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0
    assert "no such directory" in result.stderr


@fault(
    stage="collect",
    fault="hub verifier unreachable (offline)",
    result="VerifierError suggesting a local HF directory or the built-in alias",
)
def test_unreachable_hub_verifier_says_what_to_pass(monkeypatch):
    import huggingface_hub.constants

    from specctl.recipe import VerifierSection
    from specctl.verifier import load_verifier

    # huggingface_hub reads HF_HUB_OFFLINE once, at import: set the flag it reads, not only the
    # environment (which, after the import, left each lookup retrying the network for ~45 s)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(VerifierError, match="local HF directory or the built-in alias"):
        load_verifier(VerifierSection(name_or_path="someorg/definitely-not-cached-model"))


# ---------------------------------------------------------------- compact layouts (fp8 aux, top-k targets)

COMPACT = {"aux_dtype": "fp8", "target": "topk", "topk": 16}
E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E4M3 = E4M3[E4M3.isfinite()]  # every finite float8_e4m3fn value (254 of them)


def fp8_error_bound(x: torch.Tensor) -> torch.Tensor:
    """|x - dequantize(quantize(x))| <= |x| / 16 + scale / 1024 (+ float32 rounding), per element."""
    scale = x.abs().amax(-1, keepdim=True) / FP8_MAX
    return x.abs() / 16 + scale / 1024 + 1e-6 * x.abs().amax(-1, keepdim=True)


def test_quantize_fp8_is_the_nearest_e4m3_value_of_each_row_scaled_to_448():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 40, generator=g) * torch.logspace(-3, 3, 40)  # [..., H], tiny to huge
    x[0, 0, 7] = 2.5e4  # a massive-activation channel in one row only
    x[1, 2] = 0.0  # an all-zero row
    q, scale = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (5, 3)
    assert scale.dtype == torch.float32 and scale[1, 2] == 1 and (q[1, 2].float() == 0).all()
    y = x / scale[..., None]  # brute force: nearest of all finite e4m3 values, element by element
    nearest = E4M3[(y[..., None] - E4M3).abs().argmin(-1)]
    assert torch.equal(q.float(), nearest)
    assert (q.float().abs().amax(-1)[scale != 1] == FP8_MAX).all()  # each row's largest |x| -> 448
    back = dequantize_fp8(q, scale)
    assert back.dtype == torch.float32
    assert ((back - x).abs() <= fp8_error_bound(x)).all()
    assert dequantize_fp8(q, scale, torch.bfloat16).dtype == torch.bfloat16


def test_si_bytes_names_the_largest_power_of_1000_below_at_three_figures():
    from specctl.estimate import si_bytes

    assert [si_bytes(n) for n in (0, 950, 999, 1000, 12_400, 999_499, 5.08e12, 3e18)] == [
        "0 B",
        "950 B",
        "999 B",
        "1 kB",
        "12.4 kB",
        "999 kB",
        "5.08 TB",
        "3e+03 PB",
    ]
    units = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "PB": 1e15}
    for n in [int(1.37**k) for k in range(120)]:  # 1 B to ~2.5e16 B
        value, unit = si_bytes(n).split()
        # the unit the reference picks: the largest power of 1000 not above n (PB at most)
        expected = max((u for u, size in units.items() if size <= n), key=units.get, default="B")
        assert unit == expected, (n, si_bytes(n))
        assert float(value) * units[unit] == pytest.approx(n, rel=5e-3 if unit != "B" else 0), n


def test_layout_bytes_per_token():
    full, compact = Layout(), Layout("bfloat16", "fp8", "topk", 16)
    # SmolLM2-135M (H 576, vocab 49152: ids fit uint16) and Llama-3.1-8B (H 4096, vocab 128256), 3 aux layers
    assert layout_bytes_per_token(full, 576, 3, 49152) == 4 * 576 * 2 + 5 == 4613
    assert layout_bytes_per_token(compact, 576, 3, 49152) == 3 * 580 + 16 * 4 + 4 + 5 == 1813
    assert layout_bytes_per_token(full, 4096, 3, 128256) == 32773
    assert layout_bytes_per_token(compact, 4096, 3, 128256) == 3 * 4100 + 16 * 6 + 4 + 5 == 12405
    assert 1813 / 4613 <= 0.4 and 12405 / 32773 <= 0.4
    assert layout_bytes_per_token(Layout("float32", "float32"), 64, 2, 320) == 3 * 64 * 4 + 5
    assert layout_bytes_per_token(Layout("float32", "fp8", "topk", 16), 64, 2, 10) == 2 * 68 + 10 * 4 + 9


@pytest.mark.parametrize("vocab", [300, 70_000])
def test_store_round_trip_of_the_compact_layout(tmp_path, vocab):
    """write_shard -> open_features: ids exact (uint16 up to 65536 ids, int32 beyond), log-probs to
    float16, logsumexp exact, aux = dequantize(q, scale); a masked (-inf) logit reads as finite."""
    from safetensors import safe_open

    from specctl.drafters.targets import topk_compact
    from specctl.features import StorePlan, finalize_store, init_store, write_shard

    g = torch.Generator().manual_seed(vocab)
    lengths = [5, 1, 9]
    layout = Layout("bfloat16", "fp8", "topk", 6)
    samples = []
    for T in lengths:
        logits = torch.randn(T, vocab, generator=g) * 4
        logits[:, vocab // 2 :] += 8.0  # the top ids are large ones: int32 for the big vocabulary
        logits[0, :-4] = float("-inf")  # a row with only 4 finite logits: 2 of its top 6 are masked
        ids, logprobs, lse = topk_compact(logits, 6)
        q, scale = quantize_fp8(torch.randn(T, 2, 8, generator=g))
        samples.append(
            {
                "input_ids": torch.randint(0, 300, (T,), generator=g),
                "loss_mask": torch.rand(T, generator=g) < 0.5,
                "aux_hidden_states": q,
                "aux_scale": scale,
                "topk_ids": ids,
                "topk_logprobs": logprobs,
                "logsumexp": lse,
            }
        )
    plan = StorePlan(
        verifier="v",
        verifier_config_hash="h",
        num_layers=2,
        hidden_size=8,
        aux_layer_ids=[1, 2],
        dtype="bfloat16",
        data_hash="d",
        lengths=lengths,
        shards=[[0, 2], [2, 3]],
        aux_dtype="fp8",
        target="topk",
        topk=6,
    )
    init_store(tmp_path, plan)
    write_shard(tmp_path, 0, samples[:2], layout)
    write_shard(tmp_path, 1, samples[2:], layout)
    finalize_store(tmp_path)
    with safe_open(str(tmp_path / "shard-00000.safetensors"), "pt") as f:
        assert f.get_slice("topk_ids").get_dtype() == ("U16" if vocab <= 2**16 else "I32")
        assert f.get_slice("aux_hidden_states").get_dtype() == "F8_E4M3"
    store = open_features(tmp_path)
    assert store.layout == layout
    for want, row in zip(samples, store, strict=True):
        assert torch.equal(row["input_ids"], want["input_ids"]) and torch.equal(
            row["topk_ids"], want["topk_ids"]
        )
        assert torch.equal(
            row["aux_hidden_states"], dequantize_fp8(want["aux_hidden_states"], want["aux_scale"])
        )
        assert torch.equal(row["logsumexp"], want["logsumexp"])
        lp, got = want["topk_logprobs"], row["topk_logprobs"]
        assert got.isfinite().all()
        finite = lp.isfinite()
        assert ((got - lp)[finite].abs() <= lp[finite].abs() * 2**-11).all()
        assert (got[~finite] == torch.finfo(torch.float16).min).all() and (~finite).sum() == 2


@pytest.fixture(scope="module")
def two_stores(tmp_path_factory, tiny_verifier_dir):
    """The same 24 conversations collected twice: full precision (float32) and compact (fp8 + top-16)."""
    tmp = tmp_path_factory.mktemp("layouts")
    full = load_recipe(make_recipe(tmp, tiny_verifier_dir, name="full", dtype="float32"))
    compact = load_recipe(make_recipe(tmp, tiny_verifier_dir, name="compact", **COMPACT))
    collect(full, progress=False)
    collect(compact, progress=False)
    return tmp, full, compact


def test_compact_store_records_its_layout_and_matches_hf(two_stores, tiny_verifier_dir):
    _, full, compact = two_stores
    store = open_features(compact.run_dir / "features")
    assert store.layout == Layout("bfloat16", "fp8", "topk", 16)
    manifest = json.loads((compact.run_dir / "features" / "manifest.json").read_text())
    assert (manifest["aux_dtype"], manifest["target"], manifest["topk"]) == ("fp8", "topk", 16)
    assert open_features(full.run_dir / "features").layout == Layout("float32", "float32", target_stats=True)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_verifier_dir, dtype=torch.float32).eval()
    for i in (0, 7, 23):
        row = store[i]
        T = row["input_ids"].numel()
        assert "last_hidden_state" not in row
        assert (
            row["aux_hidden_states"].shape == (T, 3, 64) and row["aux_hidden_states"].dtype == torch.float32
        )
        assert row["topk_ids"].shape == row["topk_logprobs"].shape == (T, 16) and row["logsumexp"].shape == (
            T,
        )
        with torch.no_grad():
            out = model(row["input_ids"][None], output_hidden_states=True)
        hs, logits = out.hidden_states, out.logits[0]
        for j, layer in enumerate([1, 2, 3]):
            want = hs[layer][0]
            assert ((row["aux_hidden_states"][:, j] - want).abs() <= fp8_error_bound(want) + 1e-4).all()
        assert torch.equal(row["topk_ids"][:, 0], logits.argmax(-1))
        torch.testing.assert_close(row["logsumexp"], torch.logsumexp(logits, -1), atol=1e-4, rtol=1e-5)
        want_lp = torch.log_softmax(logits, -1).gather(1, row["topk_ids"])
        assert ((row["topk_logprobs"] - want_lp).abs() <= want_lp.abs() * 2**-11 + 1e-4).all()
        rest = torch.log_softmax(logits, -1).scatter(1, row["topk_ids"], float("-inf"))
        assert (rest.amax(-1) <= want_lp[:, -1] + 1e-4).all()  # nothing outside the stored k is larger


def test_shard_sizes_follow_the_layout(two_stores):
    """Real shard files: layout bytes per token x tokens, plus offsets and a header per shard."""
    _, full, compact = two_stores
    for recipe in (full, compact):
        store = open_features(recipe.run_dir / "features")
        per_token = layout_bytes_per_token(store.layout, 64, 3, 320)
        for info, (a, b) in zip(store.manifest.shard_files, store.manifest.shards, strict=True):
            tokens = sum(store.lengths[a:b])
            overhead = info["bytes"] - tokens * per_token - 8 * (b - a + 1)
            assert 0 < overhead < 1024, (recipe.name, overhead)
    assert layout_bytes_per_token(open_features(compact.run_dir / "features").layout, 64, 3, 320) == 277


def test_compact_and_full_stores_give_the_same_training_targets(two_stores, tiny_verifier_dir):
    """Store -> train's collate -> batch_targets: argmax and logsumexp as from the full hidden state,
    the kept top-k logits up to float16 rounding, aux states within the fp8 bound."""
    from transformers import AutoModelForCausalLM

    from specctl.train.loader import collate

    _, full, compact = two_stores
    a, b = open_features(full.run_dir / "features"), open_features(compact.run_dir / "features")
    model = AutoModelForCausalLM.from_pretrained(tiny_verifier_dir, dtype=torch.float32).eval()
    norm, lm_head, eps = model.model.norm.weight, model.lm_head.weight, model.config.rms_norm_eps
    t2d = torch.zeros(320, dtype=torch.bool)
    t2d[torch.randperm(320, generator=torch.Generator().manual_seed(0))[:200]] = True
    for indices in ([0, 1, 2, 3], [9, 17, 23]):
        batch_a = collate([a[i] for i in indices], 1024)
        batch_b = collate([b[i] for i in indices], 1024)
        assert set(batch_b) == {"input_ids", "loss_mask", "attention_mask", "aux_hidden_states"} | {
            "topk_ids",
            "topk_logprobs",
            "logsumexp",
        }
        assert torch.equal(batch_a["input_ids"], batch_b["input_ids"])
        x = batch_a["aux_hidden_states"]
        assert ((batch_b["aux_hidden_states"] - x).abs() <= fp8_error_bound(x)).all()
        for kept in (None, t2d):
            ta = batch_targets(batch_a, norm, lm_head, eps, kept)
            tb = batch_targets(batch_b, norm, lm_head, eps, kept)
            assert torch.equal(ta.index, tb.index) and ta.targets.argmax.numel() > 0
            assert torch.equal(ta.targets.argmax, tb.targets.argmax)
            torch.testing.assert_close(ta.targets.logsumexp, tb.targets.logsumexp)
            inside = tb.targets.kept_logits.isfinite()
            want = ta.targets.kept_logits[inside]
            got = tb.targets.kept_logits[inside]
            lp = want - ta.targets.logsumexp[:, None].expand_as(inside)[inside]
            assert ((got - want).abs() <= lp.abs() * 2**-11 + 1e-4).all()


@fault(
    stage="collect",
    fault="a store read or resumed with another features layout (target, topk, aux_dtype)",
    result="FeatureStoreError naming both values, before anything is written",
)
def test_recipe_and_store_layouts_must_agree(two_stores):
    tmp, _, compact = two_stores
    path = compact.run_dir / "features"
    with pytest.raises(FeatureStoreError) as err:
        open_features(path, layout=Layout())
    msg = str(err.value)
    assert "\n" not in msg
    assert "collected with features.target=topk but the recipe has features.target=hidden" in msg
    with pytest.raises(FeatureStoreError, match="features.topk=16 but the recipe has features.topk=8"):
        open_features(path, layout=Layout("bfloat16", "fp8", "topk", 8))
    with pytest.raises(
        FeatureStoreError, match="features.aux_dtype=fp8 but the recipe has features.aux_dtype=bf"
    ):
        open_features(path, layout=Layout("bfloat16", "bfloat16", "topk", 16))
    with pytest.raises(
        FeatureStoreError, match="features.dtype=float32 but the recipe has features.dtype=bfloat16"
    ):
        open_features(two_stores[1].run_dir / "features", layout=Layout())
    # dtype stores nothing in a top-k + fp8 store: a different one is no mismatch
    assert len(open_features(path, layout=Layout("float32", "fp8", "topk", 16))) == 24
    # resuming with another layout is refused before anything is written
    recipe_file = tmp / "compact.yaml"
    with pytest.raises(FeatureStoreError, match="different target"):
        collect(load_recipe(recipe_file, ["features.target=hidden"]), progress=False)
    with pytest.raises(FeatureStoreError, match="different aux_dtype"):
        collect(load_recipe(recipe_file, ["features.aux_dtype=null"]), progress=False)


def test_store_without_layout_fields_reads_and_resumes_as_full_precision(tmp_path, tiny_verifier_dir):
    """Stores written before layouts existed: no aux_dtype / target / topk in plan or manifest."""
    recipe = load_recipe(make_recipe(tmp_path, tiny_verifier_dir))
    collect(recipe, progress=False)
    path = recipe.run_dir / "features"
    before = store_bytes(path)
    for name in ("plan.json", "manifest.json"):
        old = {
            k: v
            for k, v in json.loads((path / name).read_text()).items()
            if k not in ("aux_dtype", "target", "topk", "target_stats")
        }
        (path / name).write_text(json.dumps(old, indent=1))
    store = open_features(path, layout=Layout())
    assert store.layout == Layout("bfloat16", "bfloat16", "hidden", 0)
    row = store[3]
    assert row["aux_hidden_states"].dtype == row["last_hidden_state"].dtype == torch.bfloat16
    again = collect(recipe, progress=False)  # the old plan is the same plan: nothing to redo
    assert again.shards_written == 0 and again.complete
    after = store_bytes(path)
    assert {k: v for k, v in after.items() if k.endswith(".safetensors")} == {
        k: v for k, v in before.items() if k.endswith(".safetensors")
    }


TRAIN_SETTINGS = [
    "train.max_steps=2",
    "train.warmup_steps=1",
    "train.batch_tokens=256",
    "train.val_fraction=0.25",
    "train.eval_every=2",
    "train.save_every=2",
    "train.log_every=1",
    "drafter.draft_vocab_size=64",
    "verifier.device=cpu",
]


@pytest.mark.parametrize(
    "algo, settings",
    [
        (
            "dflash",
            ["drafter.dflash.num_layers=1", "drafter.dflash.block_size=4", "drafter.dflash.max_anchors=8"],
        ),
        (
            "dspark",
            ["drafter.dspark.num_layers=1", "drafter.dspark.block_size=4", "drafter.dspark.markov_rank=8"],
        ),
    ],
)
def test_drafters_train_from_the_compact_store_like_from_the_full_one(two_stores, algo, settings):
    """Same data, same seed, ce loss: the first training loss (before any update) from the compact
    store is the full store's up to fp8 rounding of the aux states (DSpark's loss also has a TV term,
    which top-k targets overestimate by the tail mass, so it is not compared); kl trains on the top-k
    targets; a recipe that disagrees with the store is refused."""
    from specctl.train import run_training

    tmp, _, _ = two_stores
    overrides = [*TRAIN_SETTINGS, f"drafter.algo={algo}", *settings]
    if algo != "dspark":
        first = {}
        for name in ("full", "compact"):
            summary = run_training(
                load_recipe(tmp / f"{name}.yaml", [*overrides, "train.loss=ce"]), progress=False
            )
            lines = [json.loads(x) for x in (summary.output_dir / "metrics.jsonl").read_text().splitlines()]
            first[name] = next(r["loss"] for r in lines if "loss" in r)
        assert first["compact"] == pytest.approx(first["full"], rel=2e-2)
    kl_recipe = load_recipe(tmp / "compact.yaml", [*overrides, "train.loss=kl"])
    kl = run_training(kl_recipe, progress=False, restart=True)  # the ce run above is replaced
    assert kl.loss is not None and kl.loss == kl.loss  # not NaN
    assert kl.tau_hat is not None and kl.val_loss == kl.val_loss
    with pytest.raises(
        FeatureStoreError, match="features.target=topk but the recipe has features.target=hidden"
    ):
        run_training(
            load_recipe(tmp / "compact.yaml", [*overrides, "features.target=hidden"]), progress=False
        )
