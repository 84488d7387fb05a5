"""`specctl plan` and the checks stages make with it: the fit logic, the refusal line, the JSON, the
shipped GPU recipes at their published widths, and training's micro-batch pieces and activation
checkpointing (the settings the plan tells a user to change)."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from test_train import offline, read_metrics, tiny_recipe, train_lines  # noqa: F401  (fixture)

from specctl import resources
from specctl.batching import length_buckets
from specctl.recipe import load_recipe
from specctl.resources import GIB, Cluster, PlanError, plan_recipe, refusal
from specctl.train import run_training
from specctl.train.loader import pieces

RECIPES_8B = [
    f"recipes/{algo}-{model}.yaml"
    for algo in ("dflash", "dspark", "peagle", "eagle3")
    for model in ("llama", "qwen3")
]


# ---------------------------------------------------------------- pieces of a micro-batch


def test_pieces_cover_the_micro_batch_within_the_budget():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 300) for _ in range(40)]
        budget = rng.randint(300, 2000)
        indices = length_buckets(lengths, budget)[0]
        micro = rng.choice([None, rng.randint(1, budget)])
        split = pieces(indices, lengths, micro)
        assert sorted(i for piece, _ in split for i in piece) == sorted(indices)
        assert math.isclose(sum(w for _, w in split), 1.0)
        for piece, weight in split:
            assert math.isclose(weight, sum(lengths[i] for i in piece) / sum(lengths[i] for i in indices))
            if micro is not None and len(piece) > 1:
                assert len(piece) * max(lengths[i] for i in piece) <= micro
        if micro is None or len(indices) * max(lengths[i] for i in indices) <= micro:
            assert split == [(indices, 1.0)]


def test_a_micro_batch_budget_it_fits_leaves_training_bit_identical(tmp_path, offline):  # noqa: F811
    a = tiny_recipe(tmp_path / "a", "eagle3", max_steps=3)
    b = tiny_recipe(tmp_path / "b", "eagle3", max_steps=3, micro_batch_tokens=160)
    run_training(a, progress=False)
    run_training(b, progress=False)
    assert [r["loss"] for r in train_lines(read_metrics(a))] == [
        r["loss"] for r in train_lines(read_metrics(b))
    ]


def test_split_micro_batches_see_the_same_tokens_and_train(tmp_path, offline):  # noqa: F811
    whole = tiny_recipe(tmp_path / "a", "dflash", max_steps=4)
    split = tiny_recipe(tmp_path / "b", "dflash", max_steps=4, micro_batch_tokens=40)
    run_training(whole, progress=False)
    run_training(split, progress=False)
    a, b = train_lines(read_metrics(whole)), train_lines(read_metrics(split))
    assert [r["tokens_seen"] for r in a] == [r["tokens_seen"] for r in b]
    assert all(math.isfinite(r["loss"]) for r in b)
    assert b[-1]["loss"] < b[0]["loss"] * 1.5  # it trains, not diverges


@pytest.mark.parametrize("algo", ["dflash", "eagle3"])
def test_activation_checkpointing_changes_memory_not_results(tmp_path, offline, algo):  # noqa: F811
    plain = tiny_recipe(tmp_path / "a", algo, max_steps=3)
    ckpt = tiny_recipe(tmp_path / "b", algo, max_steps=3, activation_checkpointing=True)
    run_training(plain, progress=False)
    run_training(ckpt, progress=False)
    a, b = train_lines(read_metrics(plain)), train_lines(read_metrics(ckpt))
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-5)


def test_activation_checkpointing_lowers_the_traced_peak():
    recipe = load_recipe("recipes/dflash-llama.yaml", ["train.micro_batch_tokens=2048"])
    x = resources.inputs(recipe.for_training(), Cluster("cuda", 8, 80 * GIB))
    plain = resources.trace_train_step(x.recipe, x.spec, 2048, "cuda")
    on = x.recipe.model_copy(
        update={"train": x.recipe.train.model_copy(update={"activation_checkpointing": True})}
    )
    checkpointed = resources.trace_train_step(on, x.spec, 2048, "cuda")
    assert checkpointed.peak < plain.peak
    assert checkpointed.flops > plain.flops  # the layers run twice


# ---------------------------------------------------------------- the plan


def test_vllm_stages_split_the_weights_over_tensor_parallel_ranks():
    recipe = load_recipe("recipes/dflash-llama.yaml")
    one = plan_recipe(recipe, Cluster("cuda", 8, 80 * GIB), ("data",)).stages[0]
    four = plan_recipe(
        load_recipe("recipes/dflash-llama.yaml", ["verifier.tensor_parallel_size=4"]),
        Cluster("cuda", 8, 80 * GIB),
        ("data",),
    ).stages[0]
    assert one.terms[0].bytes == pytest.approx(4 * four.terms[0].bytes, rel=1e-6)
    assert one.terms[0].bytes == pytest.approx(8.03e9 * 2, rel=0.01)  # Llama-3.1-8B in bf16


def test_an_hf_collect_over_a_device_map_is_timed_on_the_gpus_that_compute():
    """HF collect with verifier.tensor_parallel_size 4 runs its layers on one GPU of the four at a
    time: the 8-GPU node computes as 2 GPUs, so the stage takes 4x the time of tp 1 (issue 56 item 7:
    the plan divided by all 8)."""

    def collect(tp: int):
        sets = ["features.backend=hf", f"verifier.tensor_parallel_size={tp}"]
        recipe = load_recipe("recipes/dflash-llama.yaml", sets)
        return plan_recipe(recipe, Cluster("cuda", 8, 80 * GIB), ("collect",)).stages[0]

    one, four = collect(1), collect(4)
    assert four.seconds == pytest.approx(4 * one.seconds, rel=0.05)
    assert any("one computes at a time (2 at once" in a for a in four.assumptions)


def test_a_stage_that_does_not_fit_is_refused_with_what_to_change(tmp_path):
    recipe = tiny_recipe(tmp_path, "dflash")
    plan = plan_recipe(recipe, Cluster("cpu", 1, 4 * 1024 * 1024), ("train",))
    line = refusal(plan)
    assert line is not None and line.startswith("train does not fit")
    assert "\n" not in line
    assert "train." in line  # names the setting to change


def test_the_refusal_finds_the_largest_micro_batch_that_fits():
    recipe = load_recipe("recipes/dflash-llama.yaml", ["train.micro_batch_tokens=32768"])
    plan = plan_recipe(recipe, Cluster("cuda", 8, 80 * GIB), ("train",))
    stage = plan.stages[0]
    assert not stage.fits
    assert "train.micro_batch_tokens=" in stage.fix
    suggested = int(stage.fix.split("train.micro_batch_tokens=")[1].split()[0])
    fixed = load_recipe("recipes/dflash-llama.yaml", [f"train.micro_batch_tokens={suggested}"])
    assert plan_recipe(fixed, Cluster("cuda", 8, 80 * GIB), ("train",)).stages[0].fits


def test_stages_refuse_at_start_and_force_goes_on(tmp_path, monkeypatch, offline):  # noqa: F811
    recipe = tiny_recipe(tmp_path, "dflash", max_steps=1)
    monkeypatch.setattr(resources, "this_machine", lambda *args: Cluster("cpu", 1, 1 << 20))
    with pytest.raises(PlanError, match=r"train does not fit: .* \(or pass --force\)"):
        run_training(recipe, progress=False)
    assert not (recipe.run_dir / "drafters").exists() or not any(
        (recipe.run_dir / "drafters").rglob("step-*")
    )
    assert run_training(recipe, progress=False, force=True).steps == 1


@pytest.mark.parametrize(
    ("stages", "tensor_parallel", "local_rank", "own"),
    [("train", 2, 3, 3), (("data", "collect"), 2, 1, 2), (("data", "collect"), 1, 3, 3)],
)
def test_a_rank_asks_only_its_own_gpu(tmp_path, monkeypatch, stages, tensor_parallel, local_rank, own):
    """The plan train and collect check at their start, on torchrun local rank `local_rank` of 8 on
    an 8-GPU node: asking any GPU but the rank's own would make a CUDA context there (issue 56), so
    torch.cuda raises for them here. A train rank takes one GPU; a collect rank its group of
    verifier.tensor_parallel_size. The node's GPUs are taken to be like the rank's own."""
    from types import SimpleNamespace

    from specctl.resources import check_stage

    asked = []

    def only_own(device=None):
        index = torch.cuda.current_device() if device is None else torch.device("cuda", device).index
        if index != own:
            raise RuntimeError(f"local rank {local_rank} asked GPU {index}: a CUDA context there")
        asked.append(index)
        return True

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # before the rank sets its own
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: only_own(d) and (80 * GIB, 80 * GIB))
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda d=None: only_own(d) and SimpleNamespace(total_memory=80 * GIB),
    )
    for name, value in (
        ("LOCAL_RANK", local_rank),
        ("RANK", local_rank),
        ("WORLD_SIZE", 8),
        ("LOCAL_WORLD_SIZE", 8),
    ):
        monkeypatch.setenv(name, str(value))
    recipe = tiny_recipe(tmp_path, "dflash")
    recipe = recipe.model_copy(
        update={
            "verifier": recipe.verifier.model_copy(
                update={"device": "auto", "tensor_parallel_size": tensor_parallel}
            )
        }
    )
    plan = check_stage(recipe, stages, force=True)
    assert plan is not None and (plan.cluster.gpus, plan.cluster.memory) == (8, 80 * GIB)
    assert asked and set(asked) == {own}


@pytest.mark.slow
@pytest.mark.parametrize("path", [*RECIPES_8B, "recipes/dflash-llama-70b.yaml"])
def test_shipped_gpu_recipes_fit_the_one_node_of_80_gib_they_are_written_for(path):
    plan = plan_recipe(load_recipe(path), Cluster("cuda", 8, 80 * GIB))
    assert refusal(plan) is None, refusal(plan)
    assert {s.stage for s in plan.stages} == {"data", "collect", "train", "export", "bench"}


def test_the_cli_prints_the_plan_and_refuses_a_small_gpu(specctl_cli):
    ok = specctl_cli("plan", "recipes/dflash-llama.yaml", "--json")
    assert ok.returncode == 0, ok.stderr
    plan = json.loads(ok.stdout)
    assert plan["fits"] and [s["stage"] for s in plan["stages"]] == [
        "data",
        "collect",
        "train",
        "export",
        "bench",
    ]
    assert all(s["peak_bytes"] <= 80 * GIB for s in plan["stages"])
    small = specctl_cli("plan", "recipes/dflash-llama.yaml", "--gpu-memory", "8")
    assert small.returncode == 1
    errors = [line for line in small.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "does not fit" in errors[0] and "tensor_parallel_size" in errors[0]
    bad = specctl_cli("plan", "recipes/dflash-llama.yaml", "--gpus", "0")
    assert bad.returncode == 2


@pytest.fixture
def specctl_cli():
    import subprocess
    import sys

    def run(*args):
        return subprocess.run([sys.executable, "-m", "specctl", *args], capture_output=True, text=True)

    return run


def test_a_trace_of_the_recipes_step_is_cheap_in_memory():
    """The plan traces an 8B-width step without holding it: this process's peak resident memory
    grows by a small fraction of the step's traced peak."""
    from pathlib import Path

    def status(key: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key))
        return int(line.split()[1]) * 1024

    recipe = load_recipe("recipes/dflash-llama.yaml")
    x = resources.inputs(recipe.for_training(), Cluster("cuda", 8, 80 * GIB))
    before = status("VmRSS:")
    Path("/proc/self/clear_refs").write_text("5")
    st = resources.trace_train_step(x.recipe, x.spec, 2048, "cuda")
    grown = status("VmHWM:") - before
    assert st.peak > 20 * GIB  # an 8B-width DFlash step with a 1.1B-parameter drafter
    assert grown < 2 * GIB


def _tiny(cls, **extra):
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    return cls(**common, num_attention_heads=4, num_key_value_heads=2, **extra)


def test_parameter_count_by_hand_is_the_built_models():
    """The plan sums a dense decoder's parameters from its config (training must not build the
    verifier); the sum is the parameter count of the model transformers builds from it."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    from specctl.model_configs import PUBLISHED, published_config

    configs = [published_config(name) for name in PUBLISHED] + [
        _tiny(LlamaConfig, tie_word_embeddings=True),
        _tiny(LlamaConfig, attention_bias=True),
        _tiny(Qwen3Config, head_dim=32),
        _tiny(Qwen2Config),
        _tiny(MistralConfig),
    ]
    for config in configs:
        with torch.device("meta"):
            built = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        assert resources.count_parameters(config) == built, config.model_type
