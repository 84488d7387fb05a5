"""Bad input, fuzzed: the recipe loader, `--set`, and the dataset and prompt readers either accept
an input or fail with specctl's own error, on one line that names the file, line or field.

Anything else (a TypeError, a RecursionError, an OSError) would reach the user as a traceback.
Hypothesis runs derandomized, without an example database, so CI tries the same inputs every
time; the input shapes stay close to real recipes and rows so the fuzzer reaches validation,
not only the parser.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from reliability_matrix import fault

from specctl.bench.prompts import PromptRow, load_prompt_rows, row_from_json
from specctl.data.sources import ROLE_ALIASES, local_path, normalize_row, read_json_rows
from specctl.errors import DataError, RecipeError
from specctl.recipe import BUILTIN_RECIPES, Recipe, dump_recipe, load_recipe, recipe_from_dict

FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
# Recipe-shaped inputs cost more to draw than to check: fewer of them keep the module near 15 s.
FUZZ_RECIPES = settings(FUZZ, max_examples=60)


def one_line_naming(error: Exception, *where: str) -> None:
    """The error's message is one non-empty line that mentions one of `where`."""
    msg = str(error)
    assert msg.strip(), f"empty message from {type(error).__name__}"
    assert len(msg.splitlines()) == 1, f"multi-line message: {msg!r}"
    assert any(w in msg for w in where), f"{msg!r} names none of {where}"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """One directory for every example's files (hypothesis runs many examples per test call),
    holding the shipped recipes so that their `extends:` resolve."""
    path = tmp_path_factory.mktemp("fuzz")
    for recipe in BUILTIN_RECIPES.glob("*.yaml"):
        (path / recipe.name).write_text(recipe.read_text())
    return path


# ---------------------------------------------------------------- input shapes


def _literals(model: type[BaseModel]) -> set[str]:
    """Every string a Literal field of the schema accepts: near-valid values reach deeper checks."""
    out: set[str] = set()
    for f in model.model_fields.values():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out |= _literals(ann)
            continue
        for arg in (ann, *typing.get_args(ann)):
            if typing.get_origin(arg) is typing.Literal:
                out |= {a for a in typing.get_args(arg) if isinstance(a, str)}
    return out


def _field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        out.append(prefix + name)
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _field_paths(ann, f"{prefix}{name}.")
    return out


FIELD_PATHS = _field_paths(Recipe)
NAMES = sorted({p.rsplit(".", 1)[-1] for p in FIELD_PATHS})
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 70_000),
    st.integers(),
    st.floats(),
    st.floats(0, 1),
    st.text(max_size=12),
    st.sampled_from(sorted(_literals(Recipe)) + ["demo", "[1, 2]", "3e-4", "~", "null", "yes"]),
)
KEYS = st.one_of(st.sampled_from(NAMES), st.text(max_size=8))
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=5,
)


def _tree(model: type[BaseModel]) -> st.SearchStrategy[dict]:
    """Mappings shaped like `model`: its own keys (values near-valid or arbitrary), sometimes a stray one."""
    optional: dict[str, st.SearchStrategy] = {}
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            optional[name] = st.deferred(lambda ann=ann: _tree(ann)) | VALUES
        else:
            optional[name] = VALUES
    known = st.fixed_dictionaries({}, optional=optional)
    stray = st.dictionaries(st.text(max_size=8), VALUES, max_size=1)
    return st.tuples(known, stray).map(lambda kv: {**kv[1], **kv[0]})


RECIPE_TREES = st.tuples(st.sampled_from(["demo", "run-1.b"]) | VALUES, _tree(Recipe)).map(
    lambda nt: {"name": nt[0], **nt[1]}
)


def _yaml_of(tree: dict) -> str:
    return yaml.safe_dump(tree, sort_keys=False, allow_unicode=True)


SHIPPED = sorted(p.read_text() for p in BUILTIN_RECIPES.glob("*.yaml"))


@st.composite
def mutated_recipe(draw) -> str:
    """A shipped recipe with a few characters inserted, deleted or replaced."""
    text = draw(st.sampled_from(SHIPPED))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(text)))
        cut = draw(st.integers(0, 3))
        text = (
            text[:i]
            + draw(st.sampled_from(["", ":", "-", "\t", " ", "[", "{", "'", "&a", "*a", "\n  x"]))
            + text[i + cut :]
        )
    return text


RECIPE_TEXTS = st.one_of(
    st.text(max_size=200),
    RECIPE_TREES.map(_yaml_of),
    mutated_recipe(),
    st.sampled_from(["a: &x [*x, *x]\nname: d\n", "name: d\ntrain: &t {lr: *t}\n"]),
    # nesting past Python's recursion limit (PyYAML recurses per level; built lazily: short reprs)
    st.integers(400, 600).map(lambda n: "name: " + "[" * n + "]" * n),
    st.integers(100, 300).map(lambda n: "name: d\n" + "".join(f"{' ' * 2 * i}x{i}:\n" for i in range(n))),
)


# ---------------------------------------------------------------- the recipe loader


def _load_or_error(path: Path, overrides: list[str] = ()) -> Recipe | None:
    """The recipe, or None after checking the error names the recipe, a recipe it extends
    (both in the scratch directory) or the `--set` at fault."""
    try:
        return load_recipe(path, overrides)
    except RecipeError as e:
        assert e.exit_code == 2
        one_line_naming(e, str(path.parent), "--set")
        return None


@fault(
    stage="recipe",
    fault="fuzzed recipe text: arbitrary text, schema-shaped YAML, shipped recipes with edits, deep nesting",
    result="loads, or RecipeError (exit 2) on one line naming the file (line:column for YAML errors)",
)
@FUZZ_RECIPES
@given(text=RECIPE_TEXTS)
def test_recipe_text_loads_or_fails_on_one_line(scratch, text):
    path = scratch / "recipe.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    recipe = _load_or_error(path)
    if recipe is not None:  # what loads, dumps and loads back to the same recipe
        again = scratch / "again.yaml"
        again.write_text(dump_recipe(recipe))
        assert load_recipe(again) == recipe


@fault(
    stage="recipe",
    fault="a recipe file of arbitrary bytes (binary, other encodings)",
    result="RecipeError on one line naming the file, or loads when the bytes happen to be UTF-8 YAML",
)
@FUZZ
@given(data=st.binary(max_size=200))
def test_recipe_bytes_load_or_fail_on_one_line(scratch, data):
    path = scratch / "bytes.yaml"
    path.write_bytes(data)
    _load_or_error(path)


@fault(
    stage="recipe",
    fault="a recipe built in code from an arbitrary mapping (wrong types, unknown keys, NaN/inf, bad algo)",
    result="RecipeError on one line: `<recipe>: section.field: problem (got value)`",
)
@FUZZ_RECIPES
@given(tree=RECIPE_TREES)
def test_recipe_mapping_validates_or_fails_on_one_line(tree):
    try:
        recipe_from_dict(tree)
    except RecipeError as e:
        one_line_naming(e, "<recipe>: ")


SET_KEYS = st.one_of(
    st.sampled_from(FIELD_PATHS),
    st.sampled_from(FIELD_PATHS).map(lambda p: p + ".x"),
    st.text(max_size=12),
)
SET_VALUES = st.one_of(
    VALUES.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()),
    st.text(max_size=20),
    st.integers(400, 600).map(lambda n: "[" * n),
)
ASSIGNMENTS = st.one_of(st.tuples(SET_KEYS, SET_VALUES).map("=".join), st.text(max_size=20))


@fault(
    stage="recipe",
    fault="fuzzed `--set key=value` overrides (unknown keys, non-sections, empty names, bad YAML values)",
    result="RecipeError on one line naming `--set key` or the recipe field",
)
@FUZZ_RECIPES
@given(overrides=st.lists(ASSIGNMENTS, max_size=4))
def test_set_overrides_apply_or_fail_on_one_line(scratch, overrides):
    path = scratch / "base.yaml"
    path.write_text("name: base\n")
    _load_or_error(path, overrides)


# ---------------------------------------------------------------- dataset rows

TURN_KEYS = st.sampled_from(["role", "content", "from", "value"]) | st.text(max_size=6)
TURNS = st.lists(
    st.dictionaries(TURN_KEYS, st.sampled_from([*ROLE_ALIASES, "robot", "User"]) | VALUES, max_size=3)
    | VALUES,
    max_size=4,
)
TOKEN_LISTS = st.lists(st.integers(-2, 400) | st.booleans() | VALUES, max_size=6)
ROW_KEYS = st.sampled_from(
    ["messages", "conversations", "input_ids", "loss_mask", "prompt", "turns", "category"]
)
ROWS = st.dictionaries(
    ROW_KEYS | st.text(max_size=6), TURNS | TOKEN_LISTS | st.text(max_size=10) | VALUES, max_size=4
)


def _jsonl(rows: list) -> str:
    return "\n".join(json.dumps(r) for r in rows)


@st.composite
def broken_json(draw) -> str:
    """Valid JSON/JSONL text with a few characters cut out or doubled."""
    text = draw(st.sampled_from([json.dumps, _jsonl]))(draw(st.lists(ROWS | VALUES, max_size=4)))
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(text)))
        text = text[:i] + draw(st.sampled_from(["", "{", "]", ",", '"', "\n"])) + text[i + 1 :]
    return text


FILE_TEXTS = st.one_of(
    st.lists(ROWS, max_size=4).map(_jsonl),
    st.lists(ROWS | VALUES, max_size=4).map(json.dumps),
    broken_json(),
    st.text(max_size=100),
    st.sampled_from(["\ufeff[{}]", "[]", "{}", "null", '"text"']),
    # nesting past Python's recursion limit, as a document and as line 2 of a JSONL file
    st.integers(50_000, 100_000).map(lambda n: "[" * n + "]" * n),
    st.integers(50_000, 100_000).map(lambda n: '{"messages": []}\n' + '{"a":' * n + "1" + "}" * n),
)
FILE_BYTES = FILE_TEXTS.map(lambda t: t.encode("utf-8", "surrogatepass")) | st.binary(max_size=100)


@fault(
    stage="data",
    fault="fuzzed .json/.jsonl data files: arbitrary bytes, broken JSON, non-object rows, deep nesting",
    result="rows, or DataError on one line naming the file (and line for JSONL)",
)
@FUZZ
@given(data=FILE_BYTES, suffix=st.sampled_from([".jsonl", ".json"]))
def test_data_file_reads_or_fails_on_one_line(scratch, data, suffix):
    path = scratch / f"rows{suffix}"
    path.write_bytes(data)
    try:
        rows = read_json_rows(path)
    except DataError as e:
        one_line_naming(e, str(path))
        return
    assert isinstance(rows, list) and all(isinstance(r, dict) for r in rows)


@fault(
    stage="data",
    fault="fuzzed rows: messages/conversations/input_ids/loss_mask of every type, bad roles, bad turns",
    result="a normalized row, or DataError on one line naming the file and row",
)
@FUZZ
@given(row=ROWS)
def test_rows_normalize_or_fail_on_one_line(row):
    where = "chats.jsonl row 7"
    try:
        out = normalize_row(row, where)
    except DataError as e:
        one_line_naming(e, where)
        return
    if "messages" in out:
        assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in out["messages"])
        assert {m["role"] for m in out["messages"]} <= {"system", "user", "assistant"}
    else:
        ids, mask = out["input_ids"], out["loss_mask"]
        assert len(ids) == len(mask)
        assert all(type(t) is int for t in ids) and all(type(m) is bool for m in mask)


@fault(
    stage="data",
    fault="fuzzed `data.source` strings (too long for the OS, `~nosuchuser/...`, NUL bytes, missing files)",
    result="a local path, a hub id, or DataError on one line quoting data.source",
)
@FUZZ
@given(
    source=st.text(max_size=20)
    | st.text(min_size=300, max_size=400)
    | st.sampled_from(["~nosuchuser/x.jsonl", "./a\0.json"])
)
def test_data_source_names_resolve_or_fail_on_one_line(source):
    try:
        local_path(source)
    except DataError as e:
        one_line_naming(e, "data.source=")


# ---------------------------------------------------------------- bench prompt files


@fault(
    stage="bench",
    fault="fuzzed `--dataset FILE.jsonl` prompt files: arbitrary bytes, broken JSON, rows of every shape",
    result="prompt rows, or DataError on one line naming the file (and row)",
)
@FUZZ
@given(data=FILE_BYTES)
def test_prompt_file_loads_or_fails_on_one_line(scratch, data):
    path = scratch / "prompts.jsonl"
    path.write_bytes(data)
    try:
        rows, description = load_prompt_rows(str(path))
    except DataError as e:
        one_line_naming(e, str(path))
        return
    assert description == str(path) and rows
    assert all(isinstance(r, PromptRow) and r.messages[-1]["role"] == "user" for r in rows)


@fault(
    stage="bench",
    fault="fuzzed prompt rows: messages without a user turn, non-text prompts, odd categories",
    result="a prompt ending in a user turn, or DataError on one line naming the file and row",
)
@FUZZ
@given(row=ROWS)
def test_prompt_rows_convert_or_fail_on_one_line(row):
    where = "prompts.jsonl: row 3"
    try:
        out = row_from_json(row, where)
    except DataError as e:
        one_line_naming(e, where)
        return
    assert out.messages and out.messages[-1]["role"] == "user"
    assert out.category is None or isinstance(out.category, str)
