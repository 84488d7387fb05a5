"""`specctl bench --tree N,...`: each drafter measured with draft trees beside its chain
on the embedded engine, with the tree's node count and its verify rows per token in the report."""

from __future__ import annotations

import pytest
import torch
from conftest import bench_with_flags
from test_bench import _write_drafter
from typer.testing import CliRunner

from specctl.bench.plan import plan_methods, plan_trees
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
    with pytest.raises(UsageError, match="--tree is measured with --backend embedded$"):
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
