"""The backend registry (specctl.bench.backends): every backend module's SPEC is registered and
the recipe names exactly those, and shared code asks the spec -- a spec changed in a test is what
the settings checks, the run and the report then follow, and the usage errors list the backends
whose spec can."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import replace
from typing import get_args

import pytest
from test_bench import _write_drafter, fake_generate, fake_load_drafter

import specctl.bench
from specctl.bench.backends import BACKENDS, able, backend_spec, open_backend, run_backend, selectable
from specctl.bench.spec import BackendSpec, Opening
from specctl.errors import UsageError
from specctl.recipe import VLLM_BACKENDS, BenchSection


def test_every_backend_module_spec_is_registered_once():
    found = {}
    for info in pkgutil.iter_modules(specctl.bench.__path__):
        module = importlib.import_module(f"specctl.bench.{info.name}")
        spec = getattr(module, "SPEC", None)
        if isinstance(spec, BackendSpec):
            found[spec.name] = spec
    assert found == BACKENDS and list(BACKENDS) == ["embedded", "vllm", "vllm-offline", "remote"]
    assert all(BACKENDS[name] is spec for name, spec in found.items())
    assert [s.name for s in BACKENDS.values() if s.base_url] == ["remote"]  # --base-url picks one


def test_the_recipe_names_the_registry():
    """recipe.py sits below bench: its backend Literal and VLLM_BACKENDS (what the report model and
    the resource plan read) are written there, and held equal to the specs here."""
    assert set(get_args(BenchSection.model_fields["backend"].annotation)) == set(selectable())
    assert set(VLLM_BACKENDS) == {s.name for s in BACKENDS.values() if s.vllm_measured}
    with pytest.raises(UsageError, match="^--backend 'tpu': choose one of embedded, vllm, vllm-offline$"):
        backend_spec("tpu")


def test_run_backend_is_the_base_url_spec_or_the_named_one():
    assert run_backend(BenchSection()) is BACKENDS["embedded"]
    assert run_backend(BenchSection(backend="vllm-offline")) is BACKENDS["vllm-offline"]
    assert run_backend(BenchSection(base_url="http://127.0.0.1:9")) is BACKENDS["remote"]


def test_able_lists_the_flags_of_the_specs_that_can(monkeypatch):
    assert able(lambda s: s.levels) == "--backend vllm or --base-url"
    assert able(lambda s: s.trees) == "--backend embedded"
    assert able(lambda s: False) == ""
    monkeypatch.setitem(BACKENDS, "remote", replace(BACKENDS["remote"], trees=True))
    assert able(lambda s: s.trees) == "--backend embedded or --base-url"


def test_the_checks_follow_a_changed_spec(tmp_path, tiny_verifier_dir, monkeypatch):
    """A backend whose spec can draw trees, sweep levels or split engine rounds passes the check
    that refused it, and the others' errors then name it."""
    from conftest import plan_with_flags

    from specctl.bench.settings import backend_levels, bench_settings

    d = _write_drafter(tmp_path / "d", "dflash", 4, str(tiny_verifier_dir))
    cite = "needs a vLLM that has it .0.32-0.34 do not.*: measure trees with "  # capabilities.py's row
    refused = f"^--tree with --backend vllm-offline: .*{cite}--backend embedded and"
    with pytest.raises(UsageError, match=refused):
        plan_with_flags([d], tmp_path / "o", backend="vllm-offline", tree_nodes=[4])
    tree_offline = replace(BACKENDS["vllm-offline"], trees=True, vllm_drafters=False, vllm_measured=False)
    monkeypatch.setitem(BACKENDS, "vllm-offline", tree_offline)
    plan = plan_with_flags([d], tmp_path / "o", backend="vllm-offline", tree_nodes=[4])
    assert plan.backend is tree_offline
    assert [m.name for m in plan.configs] == ["no-spec", "dflash", "dflash-tree4"]
    with pytest.raises(UsageError, match=f"{cite}--backend embedded or --backend vllm-offline and serve"):
        plan_with_flags([d], tmp_path / "o", backend="vllm", tree_nodes=[4])

    assert backend_levels(BACKENDS["embedded"], [4], 1) == [1]  # a fixed level, whatever was asked
    with pytest.raises(UsageError, match="--concurrency 1,4: the vllm-offline backend starts one engine"):
        backend_levels(BACKENDS["vllm-offline"], [1, 4], 1)
    monkeypatch.setitem(BACKENDS, "vllm-offline", replace(tree_offline, levels=True))
    assert backend_levels(BACKENDS["vllm-offline"], [1, 4], 1) == [1, 4]
    monkeypatch.setitem(BACKENDS, "embedded", replace(BACKENDS["embedded"], why_one_level="is a test"))
    with pytest.raises(UsageError, match="the embedded backend is a test; sweep concurrency levels with "):
        backend_levels(BACKENDS["embedded"], [1, 2], 1)

    with pytest.raises(UsageError, match="--engine-rounds 3: the remote backend starts no engine"):
        bench_settings(None, base_url="http://127.0.0.1:9", engine_rounds=3)
    monkeypatch.setitem(BACKENDS, "remote", replace(BACKENDS["remote"], engine_rounds=True))
    assert bench_settings(None, base_url="http://127.0.0.1:9", engine_rounds=3)[0].engine_rounds == 3
    with pytest.raises(
        UsageError,
        match="drop --engine-rounds or use --backend vllm or --backend vllm-offline or --base-url$",
    ):
        bench_settings(None, backend="embedded", engine_rounds=2)


def test_the_run_opens_and_reports_what_the_spec_says(tmp_path, tiny_verifier_dir, monkeypatch):
    """`vllm` replaced by a stand-in spec (the embedded engine under vLLM's name, not interleaved,
    not vLLM-measured, its own title): the run opens it through spec.open, takes its rounds
    engine by engine, and the report names the stand-in's title and recommends no
    --speculative-config."""
    fake_generate.calls = []
    opened: list[Opening] = []
    embedded = BACKENDS["embedded"]

    def open_stand_in(o: Opening):
        opened.append(o)
        return embedded.open(o)

    stand_in = replace(
        embedded,
        name="vllm",
        title="a stand-in engine",
        open=open_stand_in,
        interleave=False,
    )
    monkeypatch.setitem(BACKENDS, "vllm", stand_in)
    from conftest import bench_with_flags

    d = _write_drafter(tmp_path / "d", "dflash", 4, str(tiny_verifier_dir))
    report = bench_with_flags(
        drafters=[d],
        output=tmp_path / "o",
        backend="vllm",
        sweep_k=[1, 2],
        num_prompts=2,
        repeats=2,
        generate_fn=fake_generate,
        load_drafter_fn=fake_load_drafter,
        progress=False,
    )
    assert report.ok and report.backend == "vllm"
    assert [o.levels for o in opened] == [[1]] and [m.name for m in opened[0].configs] == [
        "no-spec",
        "dflash",
        "dflash",
    ]
    md = (tmp_path / "o" / "report.md").read_text()
    assert "2 rounds over the prompts, in each engine" in md  # interleave False, from the spec
    assert "### Recommended K (measured on a stand-in engine)" in md
    assert "--speculative-config '" not in md


def test_open_backend_passes_the_opening_to_the_spec(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setitem(
        BACKENDS, "vllm", replace(BACKENDS["vllm"], open=lambda o: seen.append(o) or "opened")
    )
    got = open_backend("vllm", None, BenchSection(), [2, 8], [], log_dir=tmp_path, vllm_args=("--x",))
    assert got == "opened" and seen[0].levels == [2, 8] and seen[0].vllm_args == ("--x",)
    assert seen[0].log_dir == tmp_path and seen[0].settings == BenchSection()


def test_the_docs_table_is_the_specs(monkeypatch):
    """docs/benchmarking.md's backend table is `markdown()` (`make docs` rewrites it), and a spec
    that changes changes its column."""
    from pathlib import Path

    from specctl.bench.backends import markdown, with_table

    doc = Path(__file__).resolve().parents[1] / "docs" / "benchmarking.md"
    text = doc.read_text()
    assert with_table(text) == text, (
        "docs/benchmarking.md is stale: python -m specctl.bench.backends --update"
    )
    assert text.count(markdown()) == 1
    row = next(line for line in markdown().splitlines() if line.startswith("| `--tree` |"))
    assert row == "| `--tree` | yes | no | no | no |"
    monkeypatch.setitem(BACKENDS, "remote", replace(BACKENDS["remote"], trees=True))
    assert "| `--tree` | yes | no | no | yes |" in markdown()
    with pytest.raises(UsageError, match="no <!-- bench-backends"):
        with_table("# a page without the block\n")
