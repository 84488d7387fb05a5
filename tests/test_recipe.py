from pathlib import Path

import pytest
from reliability_matrix import fault

from specctl.drafters import DRAFTERS
from specctl.errors import RecipeError
from specctl.recipe import dump_recipe, load_recipe, recipe_reference_markdown

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


@fault(
    stage="recipe",
    fault="a key given twice in one mapping (top level or in a section)",
    result="RecipeError (exit 2) naming the key and both line numbers; YAML merge keys stay allowed",
)
def test_duplicate_keys_name_both_lines(tmp_path):
    p = write(tmp_path, "name: a\ntrain:\n  lr: 0.1\n  max_steps: 3\n  lr: 0.2\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert str(e.value).startswith(f"{p}:5: duplicate key 'lr' (first at line 3)") and e.value.exit_code == 2
    top = write(tmp_path, "name: a\nname: b\n", "top.yaml")
    with pytest.raises(RecipeError, match="top.yaml:2: duplicate key 'name' \\(first at line 1\\)"):
        load_recipe(top)
    merged = write(tmp_path, "name: a\nbase: &b {lr: 0.1}\n", "m.yaml")
    merged.write_text("name: a\ntrain:\n  <<: {lr: 0.1, max_steps: 4}\n  lr: 0.3\n")
    r = load_recipe(merged)
    assert (r.train.lr, r.train.max_steps) == (0.3, 4)


def test_unknown_keys_suggest_and_set_errors_name_the_flag(tmp_path):
    p = write(tmp_path, "name: a\n")
    cases = {
        "train.learning_rate=1e-3": "--set train.learning_rate=1e-3: train.learning_rate: unknown key; "
        "did you mean train.lr?",
        "train.max_step=5": "--set train.max_step=5: train.max_step: unknown key; "
        "did you mean train.max_steps?",
        "trian.lr=1": "--set trian.lr=1: trian: unknown key; did you mean train?",
        "train.lr=fast": "--set train.lr=fast: train.lr:",
    }
    for assignment, needle in cases.items():
        with pytest.raises(RecipeError) as e:
            load_recipe(p, [assignment])
        assert str(e.value).startswith(needle) and str(p) not in str(e.value), str(e.value)
    bad_file = write(tmp_path, "name: a\ntrain:\n  gradient_accumulation_steps: 2\n", "f.yaml")
    with pytest.raises(RecipeError) as e:  # the file's own mistake is still blamed on the file
        load_recipe(bad_file, ["train.lr=1e-3"])
    assert (
        str(e.value)
        == f"{bad_file}: train.gradient_accumulation_steps: unknown key; did you mean train.grad_accum?"
    )
    with pytest.raises(
        RecipeError, match="recipe not found; did you mean quickstart\\? .* quickstart-dflash"
    ):
        load_recipe("quickstrat")


def test_per_algo_train_settings_apply_to_their_algorithm_only(tmp_path):
    text = "name: a\ntrain:\n  max_steps: 800\n  lr: 1.0e-3\n  per_algo:\n    dflash: {max_steps: 1400}\n"
    p = write(tmp_path, text)
    r = load_recipe(p)
    assert r.train.max_steps == 800  # the shared setting, as written
    dflash = load_recipe(p, ["drafter.algo=dflash"]).for_training()
    assert (dflash.train.max_steps, dflash.train.lr) == (1400, 1.0e-3)  # only what the entry sets
    eagle3 = load_recipe(p, ["drafter.algo=eagle3"]).for_training()
    assert (eagle3.train.max_steps, eagle3.train.lr) == (800, 1.0e-3)
    assert eagle3 == load_recipe(p, ["drafter.algo=eagle3"])
    # a dump shows only what the entry sets, and loads back to the same recipe
    text = dump_recipe(dflash)
    assert "  per_algo:\n    dflash:\n      max_steps: 1400\nexport:\n" in text
    assert load_recipe(write(tmp_path, text, "dumped.yaml")).for_training() == dflash


@pytest.mark.parametrize(
    "assignment, needle",
    [
        ("train.per_algo.medusa.max_steps=5", "train.per_algo: unknown algorithm 'medusa'"),
        ("train.per_algo.dflash.max_steps=0", "train.per_algo.dflash.max_steps: Input should be greater"),
        (
            "train.per_algo.dflash.max_step=5",
            "train.per_algo.dflash.max_step: unknown key; did you mean train.per_algo.dflash.max_steps?",
        ),
        ("train.per_algo.dflash.optimizer=sgd", "train.per_algo.dflash.optimizer:"),
    ],
)
def test_per_algo_entries_are_checked_like_the_settings_they_replace(tmp_path, assignment, needle):
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, "name: a\n"), [assignment])
    assert str(e.value).startswith(f"--set {assignment}: {needle}"), str(e.value)


def test_recipe_show_prints_a_recipe_that_loads_back(tmp_path, monkeypatch, capsys):
    """`specctl recipe show`: extends merged, --set applied, defaults filled in; the output is a
    recipe that loads to the same settings."""
    import yaml
    from test_cli import run_main

    write(tmp_path, "name: base\ntrain:\n  lr: 0.01\n  max_steps: 7\n", "base.yaml")
    child = write(tmp_path, "extends: base.yaml\nname: child\ntrain:\n  lr: 0.02\n")
    code, out, _ = run_main(
        monkeypatch, capsys, "recipe", "show", str(child), "--set", "train.warmup_steps=3"
    )
    assert code == 0
    shown = yaml.safe_load(out)
    assert shown["name"] == "child" and shown["train"]["lr"] == 0.02 and shown["train"]["max_steps"] == 7
    assert shown["train"]["warmup_steps"] == 3 and shown["bench"]["num_prompts"] == 16  # a default
    saved = write(tmp_path, out, "saved.yaml")
    assert load_recipe(saved) == load_recipe(child, ["train.warmup_steps=3"])
    code, _, err = run_main(monkeypatch, capsys, "recipe", "show", "quickstart", "--set", "train.lrr=1")
    assert code == 2 and "did you mean train.lr?" in err


def test_an_unknown_key_is_named_before_the_missing_field_it_hides(tmp_path):
    """`nme: foo` used to read `name: required field is missing (+1 more)`, hiding the typo."""
    p = write(tmp_path, "nme: foo\ntrain:\n  lr: 0.01\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert str(e.value) == f"{p}: nme: unknown key; did you mean name? (+1 more)"
    nested = write(tmp_path, "train:\n  max_step: 3\n", "nested.yaml")
    with pytest.raises(RecipeError, match=r"train\.max_step: unknown key; did you mean train\.max_steps\?"):
        load_recipe(nested)


def test_extends_takes_a_builtin_name_as_the_cli_does(tmp_path):
    child = write(tmp_path, "extends: quickstart\nname: mine\ntrain:\n  max_steps: 5\n")
    r = load_recipe(child)
    base = load_recipe("quickstart")
    assert (r.name, r.train.max_steps) == ("mine", 5)
    assert r.data == base.data and r.train.lr == base.train.lr  # the rest from the built-in
    dotted = write(tmp_path, "extends: llama-3.1-8b\nname: x\n", "dotted.yaml")  # a dot, no suffix
    assert load_recipe(dotted).verifier == load_recipe("llama-3.1-8b").verifier
    write(tmp_path, "name: local\ntrain:\n  lr: 0.5\n", "quickstart.yaml")
    beside = write(tmp_path, "extends: quickstart.yaml\nname: x\n", "beside.yaml")
    assert load_recipe(beside).train.lr == 0.5  # a file beside the recipe comes first
    missing = write(tmp_path, "extends: quikstart\nname: x\n", "missing.yaml")
    with pytest.raises(RecipeError) as e:
        load_recipe(missing)
    msg = str(e.value)
    assert msg.startswith(f"{missing}: extends: {tmp_path / 'quikstart'} not found") and "quickstart" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("name", ["quickstart", "results", "dspark-qwen3", "demo"])
def test_recipe_diff_is_a_short_recipe_that_loads_back_to_the_same_settings(tmp_path, name):
    import yaml

    from specctl.recipe import dump_recipe_diff

    overrides = ["train.lr=5e-4", "drafter.dflash.block_size=4", "bench.num_prompts=16"]  # last: a default
    full = load_recipe(name, overrides)
    diff = dump_recipe_diff(full)
    assert load_recipe(write(tmp_path, diff, "diff.yaml")) == full
    tree = yaml.safe_load(diff)
    assert tree["train"]["lr"] == 5e-4 and tree["drafter"]["dflash"]["block_size"] == 4
    assert "num_prompts" not in tree.get("bench", {})  # set to its default: nothing to say
    assert len(diff.splitlines()) < len(dump_recipe(full).splitlines()) / 2


def test_recipe_diff_of_a_default_recipe_is_its_name(tmp_path):
    from specctl.recipe import dump_recipe_diff

    assert dump_recipe_diff(load_recipe(write(tmp_path, "name: bare\n"))) == "name: bare\n"


def test_recipe_list_and_show_diff_on_the_command_line(monkeypatch, capsys):
    from test_cli import run_main

    from specctl.recipe import BUILTIN_RECIPES, builtin_recipe_names

    code, out, _ = run_main(monkeypatch, capsys, "recipe", "list")
    assert code == 0
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == builtin_recipe_names()
    for line in lines:  # each with its header's first comment line, whole
        name, description = line.split(maxsplit=1)
        header = (BUILTIN_RECIPES / f"{name}.yaml").read_text().splitlines()[0]
        assert header.startswith("# ") and description == header[2:].strip()
    code, out, _ = run_main(monkeypatch, capsys, "recipe", "show", "quickstart", "--diff")
    assert code == 0 and out.startswith("name: quickstart\n") and "bench:\n  num_prompts: 4\n" in out
