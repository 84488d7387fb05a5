"""`specctl bench --tree N,...`: each drafter measured with draft trees beside its chain
on the embedded engine, with the tree's node count and its verify rows per token in the report."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import bench_with_flags
from test_bench import _write_drafter
from typer.testing import CliRunner

from specctl.bench.intervals import Estimate
from specctl.bench.plan import Method, chain_name, plan_methods, plan_trees
from specctl.bench.render import markdown, ratio_text, recommendation_lines, write_report
from specctl.bench.report import (
    BenchReport,
    Measurement,
    MethodResult,
    Point,
    Unit,
    best_results,
    chain_or_tree,
    point_figures,
)
from specctl.counters import SpecCounters
from specctl.errors import UsageError

pytestmark = pytest.mark.usefixtures("one_thread")


def test_plan_trees_adds_a_tree_method_per_node_count_to_drafters_that_make_trees(tmp_path, monkeypatch):
    from dataclasses import replace

    from specctl.drafters import DRAFTERS

    d = _write_drafter(tmp_path / "d", "dflash", 3, "v")
    e = _write_drafter(tmp_path / "e", "eagle3", 3, "v")
    methods, _ = plan_methods([d, e], None)
    assert plan_trees(methods, []) == (methods, [])
    configs, notes = plan_trees(methods, [8, 4, 8])
    assert [(m.name, m.tree_nodes) for m in configs] == [
        ("no-spec", None),
        ("eagle3", None),  # the baseline comes first, with its own top-k expansion trees
        ("eagle3-tree4", 4),
        ("eagle3-tree8", 8),
        ("dflash", None),
        ("dflash-tree4", 4),
        ("dflash-tree8", 8),
    ]
    assert notes == []
    with_ngram, _ = plan_methods([d, e], None, ngram=3)
    cut = [*with_ngram, replace(methods[2], name="dflash-adaptive", adaptive=True)]
    monkeypatch.setitem(DRAFTERS, "eagle3", replace(DRAFTERS["eagle3"], tree=None))  # a spec without trees
    configs, notes = plan_trees(cut, [4])
    assert [m.name for m in configs] == [m.name for m in cut[:3]] + ["dflash-tree4"] + [
        m.name for m in cut[3:]
    ]
    assert notes == [
        "eagle3: --tree does not apply (no drafter model that makes draft trees)",
        f"{cut[3].name}: --tree does not apply (no drafter model that makes draft trees)",  # ngram
        "dflash-adaptive: --tree does not apply (its draft length is cut; a tree replaces the cut)",
    ]


def test_bench_tree_on_the_embedded_engine(tmp_path, tiny_verifier_dir):
    """A random DFlash (block 4) and EAGLE-3 on the real engine, --tree 4,8: the trees (DFlash's
    from its block, EAGLE-3's by top-k expansion) are methods of their own with their node count,
    greedy outputs equal plain decoding's, and verify rows per token are what the counters say
    (1 + N rows per drafting pass)."""
    from specctl.drafters import DRAFTERS
    from specctl.export import save_drafter
    from specctl.recipe import VerifierSection
    from specctl.verifier import load_verifier, resolve_mask_token_id, verifier_spec, verifier_weights

    verifier = load_verifier(VerifierSection(name_or_path=str(tiny_verifier_dir)))
    spec = verifier_spec(
        verifier, (1, 2, 3), resolve_mask_token_id(verifier.tokenizer, verifier.config, None)
    )
    exports = []
    for algo, fields in (("dflash", {"block_size": 4}), ("eagle3", {"num_speculative_tokens": 2})):
        torch.manual_seed(0)
        cls = DRAFTERS[algo]
        drafter = cls.build(
            cls.config_cls(num_layers=1, **fields), spec, verifier_weights(verifier), None, "kl"
        )
        exports.append(save_drafter(drafter, tmp_path / algo, dtype="float32"))
    report = bench_with_flags(
        drafters=exports,
        output=tmp_path / "bench",
        num_prompts=2,
        max_new_tokens=8,
        tree_nodes=[8, 4],
        progress=False,
    )
    d = report.to_dict()
    assert report.ok and d["complete"]
    by_name = {r["name"]: r for r in d["results"]}
    trees = ("dflash-tree4", "dflash-tree8", "eagle3-tree4", "eagle3-tree8")
    assert {"no-spec", "dflash", "eagle3", *trees} == set(by_name)
    assert [by_name[n]["tree_nodes"] for n in ("dflash", "eagle3", *trees)] == [None, None, 4, 8, 4, 8]
    for name in trees:
        r = by_name[name]
        assert r["outputs_match_plain"] == 1.0
        assert r["num_draft_tokens"] == r["tree_nodes"] * r["num_drafts"]
        rows = (r["num_drafts"] + r["num_draft_tokens"]) / (r["num_drafts"] + r["num_accepted_tokens"])
        assert r["verify_rows_per_token"] == pytest.approx(rows)
    assert report.sweep_skipped == []
    # a tree is a setting of its drafter: the recommendation groups each drafter's chain and trees
    recommended = d["sweep"]["recommended"]
    assert set(recommended) == {"dflash", "eagle3"}
    for name in ("dflash", "eagle3"):
        versus = recommended[name]["1"]["tree_vs_chain"]
        chain_k = by_name[name]["num_speculative_tokens"]  # the drafter's exported K (one chain measured)
        assert versus["chain_num_speculative_tokens"] == chain_k and versus["tree_nodes"] in (4, 8)
    refusal = "--tree with --backend vllm: tree drafting .* needs a vLLM that has it .0.32-0.34 do not"
    with pytest.raises(UsageError, match=refusal):
        bench_with_flags(
            drafters=exports[:1], output=tmp_path / "v", backend="vllm", tree_nodes=[4], progress=False
        )


def test_cli_tree_option_reaches_run_bench(monkeypatch):
    import specctl.bench.run
    from specctl.cli import app

    seen = {}

    def fake_run_bench(recipe, settings, **kw):
        seen["tree_nodes"] = settings.tree_nodes
        raise UsageError("stop here")

    monkeypatch.setattr(specctl.bench.run, "run_bench", fake_run_bench)
    CliRunner().invoke(app, ["bench", "--drafter", "x", "--tree", "16,4"])
    assert seen["tree_nodes"] == [16, 4]  # as given: plan_trees sorts them
    CliRunner().invoke(app, ["bench", "--drafter", "x"])
    assert not seen["tree_nodes"]


# ---------------------------------------------------------------- chain or tree in the recommendation

PROMPTS, ROUNDS = 6, 3
# each (prompt, round) cell's wall seconds for the chain: prompts of different lengths, rounds that
# drift; the tree's cells are these over a speed ratio, times a per-cell noise
CHAIN_WALL = np.array(
    [[1.0, 1.1, 0.9], [2.0, 2.3, 1.9], [1.5, 1.4, 1.6], [0.8, 0.9, 0.85], [3.0, 3.2, 2.9], [1.2, 1.0, 1.1]]
)


def _measured(walls: np.ndarray, k: int, nodes: int | None) -> Measurement:
    """A configuration's cells: 32 tokens per prompt and round; with K > 0, 10 drafting passes
    accepting 6 (plain decoding, K 0, drafts nothing)."""
    drafts, accepted = (10, 6) if k else (0, 0)
    units = [
        Unit(p, r, 1, 32, float(walls[p, r]), drafts, accepted) for r in range(ROUNDS) for p in range(PROMPTS)
    ]
    n = len(units)
    per_position = [accepted * n] + [0] * (k - 1) if k else []
    counters = SpecCounters(drafts * n, (nodes or k) * drafts * n, accepted * n, per_position)
    m = Measurement(n, 32 * n, float(walls.sum()), counters)
    m.units = units
    return m


def _tree_report(ratio: float, noise: float) -> BenchReport:
    """dflash at K 3 as a chain and as trees of 4 and 8 nodes, one level: tree 8 runs `ratio` x the
    chain's tok/s, each cell off by +-`noise` (alternating, so the point ratio stays `ratio`)."""
    r = BenchReport("tiny", "embedded", "builtin", PROMPTS, 0.0, 1.0, 32, 0, 1, repeats=ROUNDS, complete=True)
    r.sweep, r.sweep_levels = [], [1]
    sign = np.where((np.arange(PROMPTS)[:, None] + np.arange(ROUNDS)[None, :]) % 2 == 0, 1.0, -1.0)
    chain = Method("dflash", "dflash", 3, Path("/d"))
    configs = [
        (Method("no-spec", "none"), CHAIN_WALL * 1.3, 0),
        (chain, CHAIN_WALL, None),
        (Method("dflash-tree4", "dflash", 3, Path("/d"), tree_nodes=4), CHAIN_WALL / 1.0, 4),
        (
            Method("dflash-tree8", "dflash", 3, Path("/d"), tree_nodes=8),
            CHAIN_WALL / ratio * (1 + noise * sign),
            8,
        ),
    ]
    for method, walls, nodes in configs:
        r.sweep.append(
            Point(1, MethodResult(method, {"": _measured(walls, method.num_speculative_tokens, nodes)}))
        )
    r.results = best_results(r.sweep, 1)
    return r


def test_chain_name_is_what_plan_trees_named_the_tree_after():
    chain = Method("dflash-2", "dflash", 3, Path("/d"))
    configs, _ = plan_trees([chain], [4])
    assert [chain_name(m) for m in configs] == ["dflash-2", "dflash-2"]


def test_chain_or_tree_gives_a_tie_to_the_chain():
    chain, tree = object(), object()  # the rule reads only the comparison
    assert chain_or_tree(chain, tree, Estimate(1.20, 1.05, 1.31)) is tree  # interval wholly above 1
    assert chain_or_tree(chain, tree, Estimate(1.08, 0.97, 1.19)) is chain  # holds 1: a tie
    assert chain_or_tree(chain, tree, Estimate(0.90, 0.85, 0.95)) is chain
    assert chain_or_tree(chain, tree, Estimate(1.01, math.nan, math.nan)) is tree  # no interval: the point
    assert chain_or_tree(chain, tree, Estimate(1.00, math.nan, math.nan)) is chain
    assert chain_or_tree(None, tree, None) is tree and chain_or_tree(chain, None, None) is chain
    with pytest.raises(ValueError):
        chain_or_tree(None, None, None)


def test_a_tree_clearly_faster_than_its_chain_is_recommended_with_what_vllm_serves(tmp_path):
    report = _tree_report(ratio=1.3, noise=0.02)
    f = report.figures()
    assert set(f.recommended) == {"dflash"}  # the trees are settings of dflash, not drafters of their own
    rec = f.recommended["dflash"]["1"]
    assert rec.point.method.name == "dflash-tree8" and rec.chain.method.name == "dflash"
    assert rec.versus.low > 1.0 and rec.versus.value == pytest.approx(1.3, rel=0.02)
    text = recommendation_lines(report, f)[0][0]
    assert text.startswith(
        "concurrency 1, dflash: tree of 8 nodes, depth 3, measured on specctl's embedded engine"
    )
    assert "the tok/s of its fastest chain (K=3)" in text
    assert (
        "tree drafting (speculative_config speculative_token_tree) needs a vLLM that has it (0.32-0.34"
        in text
    )
    assert text.endswith("so serve the chain K=3 in vLLM today")
    # the tables keep a row per tree; the sweep table stars the tree, not the chain at its K
    md = markdown(report, image=None, figures=f)
    assert "| 1 | dflash-tree8 | 3 |" in md and "| 1 | dflash-tree4 | 3 |" in md
    starred = [line for line in md.splitlines() if line.startswith("| 1 |") and line.endswith("| * |")]
    assert [line.split(" | ")[1] for line in starred] == ["dflash-tree8"]
    # report.json round-trip: the recommendation names the tree and what it was compared with
    paths = write_report(report, tmp_path / "out")
    saved = json.loads(paths["json"].read_text())["sweep"]["recommended"]
    assert set(saved) == {"dflash"}
    back = saved["dflash"]["1"]
    assert (
        back["method"] == "dflash-tree8" and back["tree_nodes"] == 8 and back["num_speculative_tokens"] == 3
    )
    assert back["speculative_config"] is None
    versus = back["tree_vs_chain"]
    assert versus["tree_nodes"] == 8 and versus["chain_num_speculative_tokens"] == 3
    assert versus["ratio"] == pytest.approx(rec.versus.value) and versus["interval"][0] > 1.0
    assert paths["sweep_png"].read_bytes()[:4] == b"\x89PNG"


def test_a_tree_faster_only_within_noise_leaves_the_chain_recommended():
    report = _tree_report(ratio=1.04, noise=0.15)
    points = {p.name: p for p in point_figures(report)}
    # the tree's point figure is the higher one: the fastest-point rule alone would have taken it
    assert points["dflash-tree8"].figures.output_tokens_per_s > points["dflash"].figures.output_tokens_per_s
    f = report.figures()
    rec = f.recommended["dflash"]["1"]
    assert rec.point.method.name == "dflash" and rec.tree.method.name == "dflash-tree8"
    assert rec.versus.low <= 1.0 <= rec.versus.high
    text = recommendation_lines(report, f)[0][0]
    assert text.startswith("concurrency 1, dflash: chain K=3, measured on")
    assert re.search(
        r"its fastest tree of 8 nodes, depth 3, runs at 1\.\d\dx \[0\.\d\d-1\.\d\d\] the chain's", text
    )
    assert text.endswith("not faster beyond noise, so the chain") and "vLLM today" not in text
    d = report.to_dict()["sweep"]["recommended"]["dflash"]["1"]
    assert d["tree_nodes"] is None and d["tree_vs_chain"]["interval"][0] <= 1.0


def test_a_ratio_interval_near_one_shows_which_side_of_one_it_is():
    """The tree is recommended when the interval's low bound is above 1: a bound that rounds to
    1.00 is printed with a third decimal, so two lines never both read `[1.00-1.05]` with opposite
    verdicts (a dev run printed exactly that for EAGLE-3's tree, taken, and DFlash's, not)."""
    from specctl.bench.intervals import Estimate

    assert ratio_text(Estimate(1.02, 1.003, 1.05)) == "1.02x [1.003-1.050]"
    assert ratio_text(Estimate(1.02, 0.998, 1.05)) == "1.02x [0.998-1.050]"
    assert ratio_text(Estimate(1.12, 1.09, 1.16)) == "1.12x [1.09-1.16]"
    assert ratio_text(Estimate(1.12, float("nan"), float("nan"))) == "1.12x"
