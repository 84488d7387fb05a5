from pathlib import Path

import pytest
from reliability_matrix import fault

from specctl.drafters import DRAFTERS
from specctl.errors import RecipeError
from specctl.recipe import load_recipe, recipe_reference_markdown

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_minimal_recipe_gets_schema_defaults(tmp_path):
    r = load_recipe(write(tmp_path, "name: demo\n"))
    assert r.name == "demo"
    assert r.run_dir == Path("runs/demo")
    assert r.verifier.name_or_path == "smollm2-135m-instruct"
    assert r.features.aux_layer_ids is None
    assert set(DRAFTERS) <= set(r.drafter.model_dump())


@fault(
    stage="recipe",
    fault="unknown key, wrong type, missing name, bad list item, unknown algorithm, a list instead of a "
    "mapping, broken YAML",
    result="RecipeError (exit 2) on one line naming the file and the field path",
)
@pytest.mark.parametrize(
    "text, needle",
    [
        ("name: a\ntrain:\n  lrr: 1\n", "train.lrr: unknown key"),
        ("name: a\ntrain:\n  lr: fast\n", "train.lr:"),
        ("verifier: {}\n", "name: required field is missing"),
        ("name: a\nfeatures:\n  aux_layer_ids: [1, x]\n", "features.aux_layer_ids.1"),
        ("name: a\ndrafter:\n  algo: medusa\n", "unknown algorithm 'medusa'"),
        ("- just\n- a list\n", "mapping of sections"),
        ("name: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_recipes_name_file_and_key(tmp_path, text, needle):
    p = write(tmp_path, text)
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    msg = str(e.value)
    assert str(p) in msg and needle in msg
    assert "\n" not in msg
    assert e.value.exit_code == 2


@fault(stage="recipe", fault="a recipe file that does not exist", result="RecipeError `recipe not found`")
def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="recipe not found"):
        load_recipe(tmp_path / "nope.yaml")


@fault(
    stage="recipe",
    fault="`--set` with a value of the wrong type, without `=`, or for an unknown key",
    result="RecipeError naming the field or the `--set`",
)
def test_set_overrides_use_field_types(tmp_path):
    p = write(tmp_path, "name: a\n")
    r = load_recipe(p, ["train.lr=1e-3", "features.aux_layer_ids=[1,2]", "data.shuffle=false", "name=b"])
    assert r.train.lr == pytest.approx(1e-3) and isinstance(r.train.lr, float)
    assert r.features.aux_layer_ids == [1, 2]
    assert r.data.shuffle is False
    assert r.name == "b"
    with pytest.raises(RecipeError, match="train.max_steps"):
        load_recipe(p, ["train.max_steps=lots"])
    with pytest.raises(RecipeError, match="expected key=value"):
        load_recipe(p, ["train.lr"])
    with pytest.raises(RecipeError, match="unknown key"):
        load_recipe(p, ["train.nope=1"])


@fault(
    stage="recipe",
    fault="`extends:` chain that forms a cycle",
    result="RecipeError `extends forms a cycle`",
)
def test_extends_merges_sections(tmp_path):
    write(tmp_path, "name: base\ntrain:\n  lr: 0.01\n  max_steps: 7\n", "base.yaml")
    child = write(tmp_path, "extends: base.yaml\nname: child\ntrain:\n  lr: 0.02\n")
    r = load_recipe(child)
    assert (r.name, r.train.lr, r.train.max_steps) == ("child", 0.02, 7)
    loop = write(tmp_path, "extends: loop.yaml\nname: x\n", "loop.yaml")
    with pytest.raises(RecipeError, match="cycle"):
        load_recipe(loop)


def test_shipped_recipes_load():
    paths = sorted((ROOT / "recipes").glob("*.yaml"))
    assert any(p.name == "quickstart.yaml" for p in paths)
    for p in paths:
        load_recipe(p)


def test_builtin_recipe_by_name():
    assert load_recipe("quickstart").name == "quickstart"


def test_recipe_reference_doc_in_sync():
    doc = ROOT / "docs" / "recipe.md"
    assert doc.read_text() == recipe_reference_markdown(), "run `make docs` to regenerate docs/recipe.md"
