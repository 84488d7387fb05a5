"""`make demo-trees`: the demo's drafters, trees chosen on dev and measured against the chain on test."""

from __future__ import annotations

import json

import pytest

from benchmarks.demo_trees import DRAFTERS, tree_stages


@pytest.fixture
def run(tmp_path):
    run = tmp_path / "runs" / "demo"
    for algo in DRAFTERS:
        (run / "drafters" / algo / "export").mkdir(parents=True)
        (run / "drafters" / algo / "export" / "config.json").write_text("{}")
    return run


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_dev_chooses_the_tree_and_test_measures_the_choice_beside_the_chain(run):
    dev, test = tree_stages("recipes/demo.yaml", run, "4,8,16")
    assert dev.args[:2] == ["bench", "recipes/demo.yaml"] and test.args[:2] == dev.args[:2]
    assert _value(dev.args, "--dataset-split") == "dev" and _value(dev.args, "--tree") == "4,8,16"
    assert _value(test.args, "--dataset-split") == "test" and "--tree" not in test.args  # read late
    assert int(_value(test.args, "--repeats")) > 1  # a ratio with an interval, not one pass
    for stage in (dev, test):  # both drafters, at their exported K, EAGLE-3 with its own trees
        assert [a for a in stage.args if a.startswith("--drafter=")] == [
            f"--drafter={run / 'drafters' / a / 'export'}" for a in DRAFTERS
        ]
    assert _value(dev.args, "--output") != _value(test.args, "--output")
    with pytest.raises(SystemExit, match="chose no tree"):  # the dev bench has not run
        test.late()
    versus = lambda n: {"tree_nodes": n, "ratio": 1.0, "interval": [0.9, 1.1]}  # noqa: E731
    recommended = {
        "dflash": {"1": {"num_speculative_tokens": 3, "tree_nodes": None, "tree_vs_chain": versus(8)}},
        "eagle3": {"1": {"num_speculative_tokens": 3, "tree_nodes": 4, "tree_vs_chain": versus(4)}},
    }
    (run / "bench-trees-dev").mkdir()
    (run / "bench-trees-dev" / "report.json").write_text(json.dumps({"sweep": {"recommended": recommended}}))
    # the fastest tree of each drafter, whether dev recommended it over the chain or not
    assert test.late() == ["--tree=4,8"]


def test_without_the_demos_exports_it_says_to_run_the_demo_first(run):
    (run / "drafters" / "eagle3" / "export" / "config.json").unlink()
    with pytest.raises(SystemExit, match=r"eagle3/export; run `make demo` first"):
        tree_stages("recipes/demo.yaml", run, "4,8,16")
