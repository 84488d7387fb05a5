"""A fifth algorithm joins from one file under tests/ (drafter_variant.py) with no other change:
discovered through SPECCTL_DRAFTERS, it trains, exports and benchmarks through the CLI like the
four built in, and everything shared (recipe schema, K limit, vLLM method) comes from its spec."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_collect import write_conversations

from specctl.collect import collect
from specctl.drafters import DRAFTERS
from specctl.recipe import recipe_from_dict

VARIANT = Path(__file__).with_name("drafter_variant.py")
TRAIN = ["--set", "train.max_steps=3", "--set", "train.batch_tokens=256", "--set", "train.eval_every=3"]


def cli(cwd: Path, *args: str, plugin: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if plugin:
        env["SPECCTL_DRAFTERS"] = str(VARIANT)
    else:
        env.pop("SPECCTL_DRAFTERS", None)
    return subprocess.run(
        [sys.executable, "-m", "specctl", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_verifier_dir) -> tuple[Path, Path]:
    """A recipe that does not mention the variant, and its features (collected in this process:
    the features do not depend on the algorithm)."""
    cwd = tmp_path_factory.mktemp("fifth")
    tree = {
        "name": "five",
        "output_dir": str(cwd / "runs"),
        "verifier": {"name_or_path": str(tiny_verifier_dir), "device": "cpu"},
        "data": {"source": str(write_conversations(cwd / "chats.jsonl", n=12)), "max_length": 256},
        "features": {"aux_layer_ids": [1, 2, 3], "shard_tokens": 4000},
        "train": {"lr": 3e-3, "warmup_steps": 1, "val_fraction": 0.2, "save_every": 3, "log_every": 1},
        "bench": {"num_prompts": 2, "max_new_tokens": 8},
    }
    recipe = cwd / "recipe.yaml"
    recipe.write_text(json.dumps(tree))
    assert collect(recipe_from_dict(tree), progress=False).complete
    return cwd, recipe


def test_a_fifth_algorithm_trains_exports_and_benchmarks_from_one_file(run):
    cwd, recipe = run
    assert "blockwise" not in DRAFTERS  # only the subprocesses below load the variant
    unknown = cli(cwd, "train", str(recipe), "--algo", "blockwise", *TRAIN, plugin=False)
    assert unknown.returncode == 2 and "unknown algorithm 'blockwise'" in unknown.stderr

    trained = cli(cwd, "train", str(recipe), "--algo", "blockwise", *TRAIN)
    assert trained.returncode == 0, trained.stderr[-2000:]
    exported = cli(cwd, "export", "runs/five", "--dtype", "fp32")
    assert exported.returncode == 0, exported.stderr[-2000:]
    export = cwd / "runs" / "five" / "drafters" / "blockwise" / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["speculators_model_type"] == "blockwise" and config["architectures"] == [
        "BlockwiseDraftModel"
    ]
    assert (
        config["block_size"] == 5
        and config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    )

    out = cwd / "bench"
    benched = cli(
        cwd, "bench", str(recipe), "--drafter", str(export), "--sweep-k", "all", "--output", str(out)
    )
    assert benched.returncode == 0, benched.stdout[-2000:] + benched.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    points = [(p["name"], p["num_speculative_tokens"]) for p in report["sweep"]["points"]]
    assert points == [("no-spec", 0), *(("blockwise", k) for k in range(1, 5))]  # K limit: its block
    for p in report["sweep"]["points"]:
        assert p["outputs_match_plain"] == 1.0 and p["outputs_compared"] == 2  # greedy: lossless
    assert all(p["num_drafts"] > 0 for p in report["sweep"]["points"] if p["name"] == "blockwise")
    assert report["sweep"]["recommended"]["blockwise"]["1"]["speculative_config"] is None  # no vLLM method

    refused = cli(cwd, "bench", str(recipe), "--drafter", str(export), "--backend", "vllm-offline")
    assert refused.returncode != 0
    assert "vLLM has no method for speculators_model_type 'blockwise'" in refused.stderr


def test_registering_a_clashing_name_is_refused(monkeypatch):
    import dataclasses

    from specctl.drafters import register

    monkeypatch.setattr("specctl.drafters.DRAFTERS", dict(DRAFTERS))
    spec = DRAFTERS["dflash"]
    assert register(spec) is spec  # the same module imported again: nothing changes
    twin = dataclasses.replace(spec, format_cls=type("Other", (spec.format_cls,), {}))
    with pytest.raises(ValueError, match="clashes with the registered 'dflash'"):
        register(twin)


def test_a_module_joins_by_exporting_its_spec():
    """The variant calls no register function: discovery collects the SPEC it exports (and nothing
    from a module without one)."""
    script = "import specctl.drafters as d; print(sorted(d.DRAFTERS))"
    env = {**os.environ, "SPECCTL_DRAFTERS": f"{VARIANT},specctl.drafters.vocab"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[0] == str(sorted([*DRAFTERS, "blockwise"]))


def test_a_build_that_returns_no_module_is_refused_in_one_line():
    import torch

    from specctl.drafters.api import as_module
    from specctl.errors import SpecctlError

    with pytest.raises(SpecctlError, match="returned a dict, not a torch nn.Module"):
        as_module({})
    module = torch.nn.Linear(2, 2)
    assert as_module(module) is module
