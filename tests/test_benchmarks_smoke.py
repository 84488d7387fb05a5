"""The developer tooling in benchmarks/ held by `make test`: each command run as `make` runs it, in
its seconds-long smoke mode on tiny random models, so an import or signature change breaks a test
instead of the next `make bench-perf` / `make rehearse` / `make results` (issue 48: `--only data`
failed on an import for days and nothing noticed).

Benchmarks are not tests: nothing here asserts a speed, only that every section runs and writes its
figures. `make gpu-check`'s CPU dry run (train, plan and engine checks) is held by
tests/test_perf.py::test_gpu_check_dry_run_end_to_end_without_datasets_or_gguf.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specctl.drafters import DRAFTERS

ROOT = Path(__file__).resolve().parents[1]


def run_module(module: str, *args: str, cwd: Path = ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m <module> ARGS`, with the checkout importable from any working directory."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.slow  # 38 s on 2 shared cores (load 6): scheduled early by tests/conftest.py
def test_bench_perf_smoke_runs_every_section(tmp_path):
    out = tmp_path / "perf.json"
    done = run_module("benchmarks.perf", "--smoke", "--output", str(out))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert all(isinstance(v, int | float) for v in figures.values())  # one flat JSON object
    per_section = {
        "collect": ["collect_ratio_vs_hf_forward", "feature_bytes_per_token"],
        "train": [f"train_tokens_per_s.{a}" for a in DRAFTERS] + ["train_verifier_forward_tokens_per_s"],
        "seq": [f"train_time_ratio_seq64_vs_32.{a}" for a in DRAFTERS],
        # every drafter's export decoded by the engine, its proposals timed
        "engine": ["engine_nospec_ratio_vs_hf_generate", "engine_speedup_best"]
        + [f"engine_propose_ratio_vs_verify.{a}" for a in DRAFTERS],
        "verify": ["verify_cost_ratio_8_vs_1", "verify_cost_ratio_16_vs_1"],
        "features": ["feature_bytes_ratio_compact_vs_bf16", "tau_hat_ratio_compact_vs_bf16"],
        "data": ["generate_tokens_per_s_hf", "generate_stage_s_hf"],
        "optim": ["lr_max_deviation_torch_schedulers", "muon_step_s_torch.8x12"],
    }
    missing = {name: [k for k in keys if k not in figures] for name, keys in per_section.items()}
    assert {name: keys for name, keys in missing.items() if keys} == {}
    for name in per_section:
        assert f"{name}: done in" in done.stdout
    assert figures["generate_tokens_per_s_hf"] > 0 and figures["collect_ratio_vs_hf_forward"] > 0


def test_bench_perf_refuses_an_unknown_section(tmp_path):
    done = run_module("benchmarks.perf", "--only", "colect", "--output", str(tmp_path / "p.json"))
    assert done.returncode == 2 and "unknown section(s) ['colect']" in done.stderr
    assert not (tmp_path / "p.json").exists()


def test_rehearse_smoke_runs_collect_train_and_export(tmp_path):
    done = run_module("benchmarks.rehearse", "--smoke", "--output", "rehearse.json", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "rehearse.json").read_text())
    assert report["smoke"] is True
    rows = report["rows"]
    assert [(r["stage"], r["algo"]) for r in rows] == [
        ("collect", None),
        ("train", "dflash"),
        ("export", "dflash"),
    ]
    for row in rows:
        assert row["predicted_peak_bytes"] > 0 and row["measured_peak_bytes"] >= 0 and row["seconds"] > 0
        assert row["ratio"] == row["measured_peak_bytes"] / row["predicted_peak_bytes"]
    assert (tmp_path / "runs" / "rehearse" / "llama" / "recipe.yaml").is_file()


def test_results_render_only_rewrites_the_page_from_its_committed_files(tmp_path):
    """`make results`'s last step as the CLI runs it, on a copy: the page it writes is the committed one."""
    shutil.copytree(ROOT / "docs" / "results", tmp_path / "docs" / "results")
    (tmp_path / "docs" / "results" / "learning-curves.png").unlink()  # the render draws it again
    page = tmp_path / "docs" / "results.md"
    done = run_module("benchmarks.results", "--render-only", "--doc", str(page))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert page.read_text() == (ROOT / "docs" / "results.md").read_text()
    assert (tmp_path / "docs" / "results" / "learning-curves.png").is_file()


def test_results_render_only_renders_chain_against_tree_from_a_run_with_trees(tmp_path):
    """The same command on the committed run plus a tree dev bench and a test bench with trees (as
    `make results` writes them now): the page gains its chain-against-tree section."""
    from test_bench_trees import _tree_report

    from specctl.bench.render import write_report

    shutil.copytree(ROOT / "docs" / "results", tmp_path / "docs" / "results")
    run = tmp_path / "docs" / "results" / "run"
    write_report(_tree_report(ratio=1.3, noise=0.02), run / "bench-trees-dev", figures=False)
    write_report(_tree_report(ratio=1.3, noise=0.02), run / "bench", figures=False)
    page = tmp_path / "docs" / "results.md"
    done = run_module("benchmarks.results", "--render-only", "--doc", str(page))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    text = page.read_text()
    section = text[text.index("## Draft trees against the chain (embedded engine)") :]
    assert "| dflash-tree8 | tree 8, depth 3 |" in section
    assert "- dflash: dev recommended the tree of 8 nodes; on test" in section
    assert "the chain's tok/s: the tree is faster." in section
