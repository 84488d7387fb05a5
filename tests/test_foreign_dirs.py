"""A run name or an --output can never cost a user's files (issue 45 item 3): run names that leave
output_dir are refused at validation, and no stage replaces or deletes a directory it cannot prove
it wrote (its manifest or marker), whatever path it was given."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from reliability_matrix import fault

from specctl.checkpoint import META_FILE, check_checkpoint_dirs, prune
from specctl.cli import main
from specctl.data import prepare_data
from specctl.durable import Owner, replace_dir
from specctl.errors import ForeignDirError, RecipeError
from specctl.features import StorePlan, init_store
from specctl.recipe import DataSection, load_recipe
from specctl.verifier import materialize_builtin

ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """`specctl ARGS` in this process: (exit code, stderr)."""
    monkeypatch.setattr(sys, "argv", ["specctl", *args])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err


def user_dir(path: Path) -> dict[str, bytes]:
    """A directory of the user's (a nested one too), and its content to compare against."""
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("my notes")
    (path / "sub" / "results.csv").write_text("a,b\n1,2\n")
    return snapshot(path)


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- run names


@fault(
    stage="recipe",
    fault="run name `.`, `..`, `.hidden`, `a/b`, `../x`, `/abs`, `a\\b` or empty (file or --set)",
    result="exit 2: one line naming the name field and what a run name may hold",
)
@pytest.mark.parametrize("name", [".", "..", ".hidden", "a/b", "../x", "/abs", "a\\b", ""])
def test_bad_run_names_are_refused(tmp_path, name):
    with pytest.raises(RecipeError, match=r"--set name=.*: name: run name .* not allowed: use letters"):
        load_recipe("quickstart", [f"name={name}"])
    path = tmp_path / "r.yaml"
    path.write_text(json.dumps({"name": name}))
    with pytest.raises(RecipeError, match=rf"^{path}: name: run name .* not starting with '\.'") as e:
        load_recipe(path)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["a", "run.v2", "x-1_2", "8B", "_tmp"])
def test_run_names_with_dots_inside_are_allowed(name):
    assert load_recipe("quickstart", [f"name={name}"]).run_dir == Path("runs") / name


@fault(
    stage="recipe",
    fault="`--set name=..` in a directory whose ./data holds a user's file",
    result="exit 2 before any work, one line naming the name; the file is intact",
)
def test_set_name_dotdot_keeps_the_users_data(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    before = user_dir(tmp_path / "data")
    code, err = run_main(monkeypatch, capsys, "collect-hidden-states", "quickstart", "--set", "name=..")
    assert code == 2
    assert "--set name=..: name: run name '..' not allowed" in err and err.strip().count("\n") == 0
    assert snapshot(tmp_path / "data") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


# ---------------------------------------------------------------- stages


@fault(
    stage="data",
    fault="output_dir + name that put runs/<name>/data on a user's non-empty directory",
    result="exit 2 before loading the verifier, one line naming the directory; its files intact",
)
def test_collect_refuses_a_users_directory_at_data(monkeypatch, capsys, tmp_path):
    scratch = tmp_path / "project"
    scratch.mkdir()
    monkeypatch.chdir(scratch)
    before = user_dir(scratch / "data")
    # output_dir may be any path: here it and the name make the run directory the cwd itself
    args = ("--set", "output_dir=..", "--set", "name=project")
    code, err = run_main(monkeypatch, capsys, "collect-hidden-states", "quickstart", *args)
    assert code == 2 and err.strip().count("\n") == 0
    assert f"{Path('..') / 'project' / 'data'}: holds files the data stage did not write" in err
    assert "refusing to replace them" in err and "choose another run name" in err
    assert snapshot(scratch / "data") == before
    assert sorted(p.name for p in scratch.iterdir()) == ["data"]


@fault(
    stage="collect",
    fault="a user's non-empty directory at runs/<name>/features",
    result="exit 2 before loading the verifier, one line naming the directory; its files intact",
)
def test_collect_refuses_a_users_directory_at_features(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    before = user_dir(tmp_path / "runs" / "mine" / "features")
    code, err = run_main(monkeypatch, capsys, "collect-hidden-states", "quickstart", "--set", "name=mine")
    assert code == 2 and err.strip().count("\n") == 0
    wrote = "collect-hidden-states did not write (no plan.json or manifest.json)"
    assert f"runs/mine/features: holds files {wrote}" in err
    assert snapshot(tmp_path / "runs" / "mine" / "features") == before
    assert sorted(p.name for p in (tmp_path / "runs" / "mine").iterdir()) == ["features"]


@fault(
    stage="data",
    fault="the data stage at a non-empty directory without its manifest, or with a user's manifest.json",
    result="ForeignDirError before the source is read, the directory intact; its own directory is rebuilt",
)
@pytest.mark.parametrize("manifest", [None, '{"version": 3}', "not json"])
def test_data_stage_replaces_only_its_own_directory(tmp_path, tiny_tokenizer, manifest):
    source = tmp_path / "chat.jsonl"
    source.write_text(json.dumps(ROW) + "\n")
    out = tmp_path / "data"
    before = user_dir(out)
    if manifest is not None:
        (out / "manifest.json").write_text(manifest)
        before = snapshot(out)
    missing = DataSection(source=str(tmp_path / "absent.jsonl"))  # refused before the source is read
    with pytest.raises(ForeignDirError, match=f"^{out}: holds files the data stage did not write"):
        prepare_data(missing, tiny_tokenizer, out, progress=False)
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl", "data"]

    own = tmp_path / "own"
    first = prepare_data(DataSection(source=str(source)), tiny_tokenizer, own, progress=False)
    again = prepare_data(DataSection(source=str(source), max_length=64), tiny_tokenizer, own, progress=False)
    assert not first.reused and not again.reused  # another recipe: its own directory replaced
    assert json.loads((own / "manifest.json").read_text())["data"]["max_length"] == 64


def test_feature_store_writes_nothing_into_a_users_directory(tmp_path):
    path = tmp_path / "features"
    before = user_dir(path)
    (path / f".notes.txt.tmp-{2**30 - 1}").write_text("a leftover name, but the user's")
    before = snapshot(path)
    plan = StorePlan("v", "cfg", 2, 4, [0], "float32", "data", lengths=[3], shards=[[0, 1]])
    with pytest.raises(ForeignDirError, match="collect-hidden-states did not write"):
        init_store(path, plan)
    assert snapshot(path) == before
    store = tmp_path / "store"
    init_store(store, plan)
    init_store(store, plan)  # its own store: plan.json proves it
    assert (store / "plan.json").is_file()


@fault(
    stage="train",
    fault="a step-N directory in checkpoints/ that train did not write (no meta.json)",
    result="train refuses to start naming it; pruning never deletes it; a save of that step refuses",
)
def test_checkpoints_never_replace_or_prune_a_users_step_dir(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 3, 4):  # train's own: meta.json, as every version wrote
        (root / f"step-{step}").mkdir(parents=True)
        (root / f"step-{step}" / META_FILE).write_text("{}")
    before = user_dir(root / "step-2")
    (root / "latest").write_text("step-4\n")
    with pytest.raises(ForeignDirError, match=f"^{root / 'step-2'}: holds files train did not write"):
        check_checkpoint_dirs(root)
    prune(root, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-2", "step-4"]
    assert snapshot(root / "step-2") == before
    owner = Owner("train", (META_FILE,), "move it")
    with pytest.raises(ForeignDirError):
        replace_dir(root / "step-2", lambda tmp: (tmp / META_FILE).write_text("{}"), owner)
    assert snapshot(root / "step-2") == before
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no temp dir left


@fault(
    stage="train",
    fault="SPECCTL_CACHE pointed at a directory holding a user's models/<alias>/",
    result="the built-in verifier's conversion refuses before converting; the files intact",
)
def test_builtin_conversion_never_replaces_a_users_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECCTL_CACHE", str(tmp_path))
    before = user_dir(tmp_path / "models" / "smollm2-135m-instruct")
    with pytest.raises(ForeignDirError, match="built-in verifier's conversion did not write"):
        materialize_builtin("smollm2-135m-instruct")
    assert snapshot(tmp_path / "models" / "smollm2-135m-instruct") == before


def test_owner_check_cases(tmp_path):
    owner = Owner("the test", ("manifest.json",), "use another path")
    owner.check(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    owner.check(tmp_path / "empty")
    leftovers = tmp_path / "leftovers"  # a concurrent worker of the stage mid-write: not foreign
    leftovers.mkdir()
    (leftovers / f".plan.json.tmp-host-{os.getpid()}").write_text("")
    owner.check(leftovers)
    proven = tmp_path / "proven"
    proven.mkdir()
    (proven / "manifest.json").write_text("{}")
    (proven / "x").write_text("")
    owner.check(proven)
    (tmp_path / "file").write_text("a user's file")
    with pytest.raises(ForeignDirError, match="exists and is not a directory, the test will not replace it"):
        owner.check(tmp_path / "file")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ForeignDirError, match="not a directory"):
        owner.check(tmp_path / "dangling")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x").write_text("")
    with pytest.raises(
        ForeignDirError, match=r"no manifest.json\); refusing to replace them: use another path$"
    ):
        owner.check(foreign)
