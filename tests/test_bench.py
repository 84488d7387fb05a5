"""`specctl bench`: report figures, thresholds, prompt sets, and the orchestration (with a fake
engine injected, then with the real embedded engine on a tiny random verifier)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from specctl.bench.prompts import (
    BUILTIN,
    BenchPrompt,
    PromptRow,
    builtin_rows,
    encode_prompt,
    load_prompt_rows,
    load_prompts,
    select_rows,
)
from specctl.bench.report import (
    BenchReport,
    Measurement,
    Method,
    MethodResult,
    RequirementError,
    check_requirements,
    markdown,
    parse_requirement,
    report_dict,
    write_report,
)
from specctl.bench.run import BenchInterrupted, group_prompts, plan_methods, run_bench
from specctl.errors import DataError, SpecctlError
from specctl.recipe import recipe_from_dict

# ---------------------------------------------------------------- report figures


def _m(prompts, tokens, wall, drafts=0, accepted_per_pos=(), k=0):
    per_pos = list(accepted_per_pos) + [0] * (k - len(accepted_per_pos))
    return Measurement(prompts, tokens, wall, drafts, drafts * k, sum(per_pos), per_pos)


def _report(**kw) -> BenchReport:
    plain = Method("no-spec", "none")
    eagle = Method("eagle3", "eagle3", 3, Path("/e"))
    dflash = Method("dflash", "dflash", 4, Path("/d"))
    r = BenchReport(
        "tiny", "embedded", "builtin", 4, 0.0, 1.0, 32, 0, 1, baseline="eagle3", complete=True, **kw
    )
    r.results = [
        MethodResult(plain, {"chat": _m(2, 64, 4.0), "code": _m(2, 64, 4.0)}),
        MethodResult(
            eagle, {"chat": _m(2, 64, 2.0, 20, (16, 10, 6), 3), "code": _m(2, 64, 2.0, 20, (18, 12, 8), 3)}
        ),
        MethodResult(
            dflash,
            {"chat": _m(2, 64, 1.0, 10, (9, 8, 7, 6), 4), "code": _m(2, 64, 2.0, 12, (10, 8, 6, 4), 4)},
        ),
    ]
    return r


def test_measurement_sum_and_figures():
    a = _m(1, 10, 1.0, 4, (4, 2), 2)
    b = _m(2, 30, 3.0, 6, (5, 3, 1), 3)
    s = a + b
    assert (s.num_prompts, s.output_tokens, s.wall_s, s.num_drafts) == (3, 40, 4.0, 10)
    assert s.accepted_per_position == [9, 5, 1] and s.num_accepted_tokens == 15
    assert s.acceptance_length == pytest.approx(1 + 15 / 10)
    assert s.per_position_acceptance == pytest.approx([0.9, 0.5, 0.1])
    assert s.output_tokens_per_s == 10.0
    assert Measurement().acceptance_length == 1.0 and Measurement().output_tokens_per_s == 0.0


def test_report_fields_speedup_and_ratio():
    d = report_dict(_report())
    assert {
        k: d[k] for k in ("verifier", "backend", "dataset", "num_prompts", "temperature", "max_new_tokens")
    } == {
        "verifier": "tiny",
        "backend": "embedded",
        "dataset": "builtin",
        "num_prompts": 4,
        "temperature": 0.0,
        "max_new_tokens": 32,
    }
    plain, eagle, dflash = d["results"]
    assert plain["algo"] == "none" and plain["speedup"] == 1.0 and plain["acceptance_length"] == 1.0
    assert plain["output_tokens_per_s"] == 128 / 8.0
    assert eagle["speedup"] == pytest.approx((128 / 4.0) / (128 / 8.0))
    assert eagle["acceptance_length"] == pytest.approx(1 + (16 + 10 + 6 + 18 + 12 + 8) / 40)
    assert eagle["per_position_acceptance"] == pytest.approx([34 / 40, 22 / 40, 14 / 40])
    assert dflash["num_speculative_tokens"] == 4 and dflash["num_drafts"] == 22
    assert dflash["speedup"] == pytest.approx((128 / 3.0) / 16.0)
    assert dflash["ratio_vs_baseline"] == pytest.approx((128 / 3.0) / 32.0)
    assert dflash["acceptance_ratio_vs_baseline"] == pytest.approx(
        dflash["acceptance_length"] / eagle["acceptance_length"]
    )
    assert eagle["ratio_vs_baseline"] == 1.0
    for key in (
        "name",
        "algo",
        "num_speculative_tokens",
        "acceptance_length",
        "per_position_acceptance",
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "output_tokens",
        "wall_s",
        "output_tokens_per_s",
        "speedup",
    ):
        assert key in dflash
    # per category, speedup is against no-spec on the same category
    assert d["categories"] == ["chat", "code"]
    assert dflash["categories"]["chat"]["speedup"] == pytest.approx((64 / 1.0) / (64 / 4.0))
    assert dflash["categories"]["code"]["acceptance_length"] == pytest.approx(1 + 28 / 12)


def test_no_plain_or_baseline_means_no_ratio():
    r = _report()
    r.results = r.results[2:]
    r.baseline = None
    d = report_dict(r)
    assert d["results"][0]["speedup"] is None and d["results"][0]["ratio_vs_baseline"] is None
    single = _report()
    for res in single.results:
        res.categories = {"": res.total}
    assert "categories" not in report_dict(single)["results"][0] and report_dict(single)["categories"] == []


def test_write_report_files(tmp_path):
    r = _report(
        requirements=["dflash.acceptance_length>=9"], failures=["dflash.acceptance_length>=9: got 3.24"]
    )
    paths = write_report(r, tmp_path / "out")
    assert json.loads(paths["json"].read_text()) == report_dict(r)
    md = paths["md"].read_text()
    assert "| dflash | 4 |" in md and "| no-spec | - | 1.00 |" in md and "## chat" in md
    assert "FAIL `dflash.acceptance_length>=9`" in md and "![" in md
    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    partial = _report()
    partial.complete = False
    assert "INCOMPLETE" in markdown(partial)
    only_json = write_report(partial, tmp_path / "partial", figures=False)
    assert set(only_json) == {"json", "outputs"} and not (tmp_path / "partial" / "acceptance.png").exists()


def test_measurement_outputs_merge():
    a = Measurement(1, 3, 1.0, outputs={0: [5, 6, 2]})
    b = Measurement(2, 5, 1.0, outputs={1: [7], 2: [8, 9, 9, 2]})
    s = a + b
    assert s.outputs == {0: [5, 6, 2], 1: [7], 2: [8, 9, 9, 2]}
    assert a.outputs == {0: [5, 6, 2]} and Measurement().outputs == {}  # operands untouched


def _with_outputs(report: BenchReport, changed: dict[str, dict[int, list[int]]] | None = None) -> BenchReport:
    """Give every method of `report` the same ids per prompt (chat: 0, 1; code: 2, 3), then
    replace the prompts named in `changed` for that method."""
    base = {0: [5, 6, 2], 1: [7, 8], 2: [9, 9, 9], 3: [4, 2]}
    for r in report.results:
        ids = {**base, **(changed or {}).get(r.method.name, {})}
        for cat, m in r.categories.items():
            keys = (0, 1) if cat == "chat" else (2, 3)
            m.outputs = {k: ids[k] for k in keys}
    return report


def test_outputs_match_plain():
    d = report_dict(_with_outputs(_report()))
    assert [(r["outputs_match_plain"], r["outputs_compared"]) for r in d["results"]] == [(1.0, 4)] * 3
    # one prompt of dflash leaves plain decoding (a token changed): 3 of 4 match
    d = report_dict(_with_outputs(_report(), {"dflash": {2: [9, 9, 1]}}))
    plain, eagle, dflash = d["results"]
    assert eagle["outputs_match_plain"] == 1.0 and dflash["outputs_match_plain"] == 0.75
    assert "| dflash | 4 |" in markdown(d) and "| 3/4 |" in markdown(d) and "| 4/4 |" in markdown(d)
    # a method without ids for a prompt is compared on the prompts both have
    r = _with_outputs(_report())
    del r.results[2].categories["code"].outputs[3]
    missing = report_dict(r)["results"][2]
    assert (missing["outputs_match_plain"], missing["outputs_compared"]) == (1.0, 3)
    # sampling: different draws are expected, nothing is compared
    sampled = _with_outputs(_report())
    sampled.temperature = 0.7
    assert all(e["outputs_match_plain"] is None for e in report_dict(sampled)["results"])
    # no ids recorded, or no plain run: not comparable
    assert all(e["outputs_match_plain"] is None for e in report_dict(_report())["results"])
    no_plain = _with_outputs(_report())
    no_plain.results = no_plain.results[1:]
    assert all(e["outputs_match_plain"] is None for e in report_dict(no_plain)["results"])
    assert "| - |\n" in markdown(_report())


def test_outputs_jsonl(tmp_path):
    r = _with_outputs(_report(), {"dflash": {2: [9, 9, 1]}})
    paths = write_report(r, tmp_path / "out", figures=False)
    lines = [json.loads(line) for line in paths["outputs"].read_text().splitlines()]
    assert len(lines) == 3 * 4 and set(lines[0]) == {"method", "prompt_index", "token_ids"}
    assert lines[:4] == [
        {"method": "no-spec", "prompt_index": i, "token_ids": ids}
        for i, ids in enumerate(([5, 6, 2], [7, 8], [9, 9, 9], [4, 2]))
    ]
    assert {"method": "dflash", "prompt_index": 2, "token_ids": [9, 9, 1]} in lines
    empty = write_report(_report(), tmp_path / "empty", figures=False)
    assert empty["outputs"].read_text() == ""


def test_rich_table_renders():
    from rich.console import Console

    from specctl.bench.report import rich_table

    console = Console(record=True, width=200)
    console.print(rich_table(_report()))
    text = console.export_text()
    assert "dflash" in text and "vs eagle3" in text and "0.86 0.73 0.59 0.45" in text
    assert "= plain" in text
    console = Console(record=True, width=200)
    console.print(rich_table(_with_outputs(_report(), {"dflash": {0: [1]}})))
    assert "3/4" in console.export_text()


# ---------------------------------------------------------------- thresholds


@pytest.mark.parametrize(
    "text, expected",
    [
        ("dflash.acceptance_length>=2.5", ("dflash", None, "acceptance_length", ">=", 2.5)),
        (" peagle.speedup > 1.1 ", ("peagle", None, "speedup", ">", 1.1)),
        ("dflash-2.code.output_tokens_per_s<1e3", ("dflash-2", "code", "output_tokens_per_s", "<", 1000.0)),
        ("no-spec.num_drafts==0", ("no-spec", None, "num_drafts", "==", 0.0)),
    ],
)
def test_parse_requirement(text, expected):
    r = parse_requirement(text)
    assert (r.method, r.category, r.field, r.op, r.value) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("dflash.acceptance_length", "expected METHOD"),
        ("acceptance_length>=2", "name a method and a figure"),
        ("dflash.tau>=2", "unknown figure 'tau'"),
        ("dflash.speedup>=fast", "'fast' is not a number"),
        ("dflash.speedup=>2", "expected METHOD"),
        ("dflash.speedup>=nan", "NaN"),
    ],
)
def test_parse_requirement_errors(text, message):
    with pytest.raises(RequirementError, match=message) as e:
        parse_requirement(text)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)


def test_check_requirements():
    d = report_dict(_report())
    reqs = [
        parse_requirement(t)
        for t in (
            "dflash.acceptance_length>=2.5",  # 1 + 58/22 = 3.64: met
            "eagle3.acceptance_length>=2.5",  # 1 + 70/40 = 2.75: met
            "dflash.speedup>=3",  # 2.67: short
            "dflash.chat.speedup>=3",  # 4.0: met
            "dflash.code.acceptance_length>3.5",  # 3.33: short
            "medusa.speedup>1",
            "dflash.math.speedup>1",
        )
    ]
    failures = check_requirements(d, reqs)
    assert failures == [
        "dflash.speedup>=3: got 2.67",
        "dflash.code.acceptance_length>3.5: got 3.33",
        "medusa.speedup>1: no method 'medusa' in this run (no-spec, eagle3, dflash)",
        "dflash.math.speedup>1: no category 'math' (chat, code)",
    ]
    r = _report()
    r.results = r.results[1:]
    r.baseline = None
    assert check_requirements(
        report_dict(r),
        [parse_requirement("dflash.speedup>1"), parse_requirement("dflash.ratio_vs_baseline>1")],
    ) == [
        "dflash.speedup>1: dflash.speedup was not measured (no no-spec run)",
        "dflash.ratio_vs_baseline>1: dflash.ratio_vs_baseline was not measured (no baseline run)",
    ]


# ---------------------------------------------------------------- prompts


def test_builtin_set_has_three_categories():
    rows = builtin_rows()
    cats = [r.category for r in rows]
    assert len(rows) == 36 and {c: cats.count(c) for c in set(cats)} == {"chat": 12, "code": 12, "math": 12}
    assert all(r.messages[-1]["role"] == "user" for r in rows)


def test_select_rows_spreads_categories_and_is_seeded():
    rows = builtin_rows()
    picked = select_rows(rows, 8, seed=0)
    cats = [r.category for r in picked]
    assert len(picked) == 8 and sorted(cats.count(c) for c in ("chat", "code", "math")) == [2, 3, 3]
    assert select_rows(rows, 8, seed=0) == picked
    assert select_rows(rows, 8, seed=1) != picked
    assert (
        len({r.messages[-1]["content"] for r in select_rows(rows, 36, seed=3)}) == 36
        and len(select_rows(rows, 100, seed=3)) == 36
    )
    # one category only: a plain seeded sample
    one = [PromptRow(({"role": "user", "content": str(i)},)) for i in range(10)]
    assert len(select_rows(one, 4, 0)) == 4


def test_local_jsonl_both_styles_and_categories(tmp_path, tiny_tokenizer):
    f = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "What is 2+2?", "category": "math"},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
            ],
            "category": "chat",
        },
        {"conversations": [{"from": "human", "value": "Write a loop."}]},
        {"turns": ["First turn", "Second turn"], "category": "writing"},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    loaded, desc = load_prompt_rows(str(f))
    assert desc == str(f) and [r.category for r in loaded] == ["math", "chat", None, "writing"]
    # a trailing assistant answer is dropped: the prompt ends with the user's turn
    assert [m["role"] for m in loaded[1].messages] == ["system", "user"]
    assert loaded[3].messages == ({"role": "user", "content": "First turn"},)
    prompts, _ = load_prompts(str(f), tiny_tokenizer, num_prompts=10)
    assert len(prompts) == 4
    p = next(p for p in prompts if p.category == "math")
    assert p.text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert list(p.prompt_ids) == tiny_tokenizer(p.text, add_special_tokens=False)["input_ids"]
    assert p.prompt_ids[0] == tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "ok"}\n{"prompt": "broken"\n', r"p.jsonl:2: not valid JSON"),
        ('{"question": "no known key"}\n', r"row 1: row has keys \['question'\]; a prompt row holds"),
        ('{"messages": [{"role": "assistant", "content": "hi"}]}\n', "has no user turn"),
        ('{"messages": [{"role": "robot", "content": "hi"}]}\n', "bad role 'robot'"),
        ("", "the file is empty"),
    ],
)
def test_bad_prompt_file_is_one_line_error(tmp_path, content, message):
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    with pytest.raises(DataError, match=message) as e:
        load_prompt_rows(str(f))
    assert "\n" not in str(e.value)


def test_unknown_dataset_and_offline_hub(monkeypatch):
    with pytest.raises(DataError, match="no such file and not a known set; use one of builtin, mt-bench"):
        load_prompt_rows("nope.jsonl")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        DataError,
        match="--dataset mt-bench needs the Hugging Face hub; offline, use --dataset "
        "builtin or a local .jsonl",
    ):
        load_prompt_rows("mt-bench")


def test_hub_sets_map_rows(monkeypatch):
    import datasets

    calls = []

    def fake_load(path, subset=None, split=None, data_files=None):
        calls.append((path, subset, split, data_files))
        if path == "HuggingFaceH4/mt_bench_prompts":
            return [{"prompt": ["Write a poem.", "Now shorter."], "category": "writing"}]
        if path == "openai/gsm8k":
            return [{"question": "2+3?", "answer": "5"}]
        if path == "openai/openai_humaneval":
            return [{"prompt": "def f():\n", "task_id": "HumanEval/0"}]
        if path == "json":
            return [{"question_id": 1, "category": "translation", "turns": ["Translate: hallo"]}]
        raise ConnectionError("Couldn't reach the hub")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    mt, _ = load_prompt_rows("mt-bench")
    assert mt == [PromptRow(({"role": "user", "content": "Write a poem."},), "writing")]
    assert load_prompt_rows("gsm8k")[0][0].category == "math"
    assert "```python\ndef f():\n```" in load_prompt_rows("humaneval")[0][0].messages[0]["content"]
    assert load_prompt_rows("spec-bench")[0][0].category == "translation"
    assert calls[1][:3] == ("openai/gsm8k", "main", "test") and calls[3][3].endswith("question.jsonl")
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: [{"problem": "2+3?"}])
    with pytest.raises(DataError, match="rows of openai/gsm8k lack the expected field 'question'"):
        load_prompt_rows("gsm8k")
    monkeypatch.setattr(
        datasets, "load_dataset", lambda *a, **k: (_ for _ in ()).throw(ConnectionError("down"))
    )
    with pytest.raises(
        DataError, match=r"offline, use --dataset builtin or a local .jsonl \(ConnectionError: down\)"
    ):
        load_prompt_rows("gsm8k")


def test_encode_without_chat_template(tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = None
    p = encode_prompt(tok, PromptRow(({"role": "user", "content": "abc"},), None))
    assert p.text == "abc" and list(p.prompt_ids) == tok("abc")["input_ids"]


def test_group_prompts():
    ps = [BenchPrompt((1,), "b", ""), BenchPrompt((2,), None, ""), BenchPrompt((3,), "a", "")]
    assert {k: [i for i, _ in v] for k, v in group_prompts(ps).items()} == {
        "a": [2],
        "b": [0],
        "uncategorized": [1],
    }
    assert list(group_prompts([BenchPrompt((1,), None, "")])) == [""]


# ---------------------------------------------------------------- orchestration with a fake engine


def _write_drafter(path: Path, algo: str, k: int, verifier: str | None) -> Path:
    path.mkdir(parents=True)
    config = {
        "speculators_model_type": algo,
        "architectures": ["X"],
        "speculators_config": {
            "algorithm": algo,
            "proposal_methods": [{"speculative_tokens": k}],
            "verifier": {"name_or_path": verifier},
        },
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


ACCEPT = {"eagle3": 1, "dflash": 3, "peagle": 2}  # tokens each fake drafter gets accepted per draft
TOKEN_COST, DRAFT_COST = 0.01, 0.012  # seconds per verifier step, plain / speculative


def fake_load_drafter(path, verifier):
    algo = json.loads((Path(path) / "config.json").read_text())["speculators_model_type"]
    return SimpleNamespace(accept=ACCEPT[algo]), {}


def fake_generate(
    verifier,
    drafter,
    prompt_ids,
    max_new_tokens,
    temperature,
    top_p,
    seed,
    num_speculative_tokens,
    eos_token_ids,
):
    """Deterministic counters: `accept` drafts kept per step, so tau = 1 + accept exactly."""
    n = max_new_tokens
    fake_generate.calls.append((drafter, tuple(prompt_ids), n, seed, tuple(eos_token_ids)))
    if drafter is None:
        counters = SimpleNamespace(
            num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0, accepted_per_position=[]
        )
        return SimpleNamespace(tokens=[7] * n, counters=counters, wall_s=n * TOKEN_COST)
    k, a = num_speculative_tokens, drafter.accept
    steps = math.ceil(n / (a + 1))
    counters = SimpleNamespace(
        num_drafts=steps,
        num_draft_tokens=steps * k,
        num_accepted_tokens=steps * a,
        accepted_per_position=[steps] * a + [0] * (k - a),
    )
    return SimpleNamespace(tokens=[7] * n, counters=counters, wall_s=steps * DRAFT_COST)


@pytest.fixture
def fake_engine():
    fake_generate.calls = []
    return {"generate_fn": fake_generate, "load_drafter_fn": fake_load_drafter, "progress": False}


def _recipe(tmp_path, verifier, **bench):
    return recipe_from_dict(
        {
            "name": "t",
            "output_dir": str(tmp_path / "runs"),
            "verifier": {"name_or_path": str(verifier)},
            "bench": bench,
        }
    )


def test_run_bench_recipe_drafters(tmp_path, tiny_verifier_dir, fake_engine):
    run = tmp_path / "runs" / "t" / "drafters"
    _write_drafter(run / "dflash" / "export", "dflash", 4, "somewhere/else")
    _write_drafter(run / "eagle3" / "export", "eagle3", 3, str(tiny_verifier_dir))
    (run / "peagle" / "checkpoints").mkdir(parents=True)  # trained, never exported: not benchmarked
    recipe = _recipe(
        tmp_path,
        tiny_verifier_dir,
        num_prompts=5,
        max_new_tokens=12,
        seed=3,
        require=["dflash.acceptance_length>=4"],
    )
    report = run_bench(recipe, requires=["dflash.speedup>=99"], **fake_engine)
    d = json.loads((tmp_path / "runs" / "t" / "bench" / "report.json").read_text())
    assert d == report.to_dict() and d["complete"] is True
    assert [r["name"] for r in d["results"]] == ["no-spec", "eagle3", "dflash"] and d["baseline"] == "eagle3"
    assert d["num_prompts"] == 5 and d["max_new_tokens"] == 12 and d["dataset"] == BUILTIN
    plain, eagle, dflash = d["results"]
    steps = math.ceil(12 / 4)
    assert dflash["acceptance_length"] == 4.0 and dflash["per_position_acceptance"] == [1.0, 1.0, 1.0, 0.0]
    assert dflash["num_drafts"] == 5 * steps and dflash["output_tokens"] == 60
    assert dflash["speedup"] == pytest.approx((12 * TOKEN_COST) / (steps * DRAFT_COST))
    assert dflash["ratio_vs_baseline"] == pytest.approx(math.ceil(12 / 2) / steps)
    assert eagle["acceptance_length"] == 2.0 and plain["speedup"] == 1.0
    assert d["categories"] == ["chat", "code", "math"]
    # the recipe's bench.require and --require are both checked; only the unmet one fails
    assert d["requirements"] == ["dflash.acceptance_length>=4", "dflash.speedup>=99"]
    assert report.failures == [f"dflash.speedup>=99: got {dflash['speedup']:.2f}"] and not report.ok
    # every method saw the same prompts with the same per-prompt seeds (warm-up excluded)
    measured = [c for c in fake_generate.calls if c[2] == 12]
    by_method = [measured[i * 5 : (i + 1) * 5] for i in range(3)]
    assert [sorted((c[1], c[3]) for c in m) for m in by_method].count(
        sorted((c[1], c[3]) for c in by_method[0])
    ) == 3
    assert sorted(c[3] for c in by_method[0]) == [3, 4, 5, 6, 7]
    assert all(2 in c[4] for c in measured)  # the tokenizer's <|im_end|> stops generation
    # each prompt's generated ids are recorded (the fake emits n 7s), so greedy outputs compare
    assert [r.total.outputs for r in report.results] == [{i: [7] * 12 for i in range(5)}] * 3
    assert [(r["outputs_match_plain"], r["outputs_compared"]) for r in d["results"]] == [(1.0, 5)] * 3
    outputs = (tmp_path / "runs" / "t" / "bench" / "outputs.jsonl").read_text().splitlines()
    assert len(outputs) == 15 and json.loads(outputs[-1]) == {
        "method": "dflash",
        "prompt_index": 4,
        "token_ids": [7] * 12,
    }
    for name in ("report.md", "acceptance.png"):
        assert (tmp_path / "runs" / "t" / "bench" / name).is_file()


def test_recipe_drafters_with_an_outside_baseline(tmp_path, tiny_verifier_dir, fake_engine):
    _write_drafter(tmp_path / "runs" / "t" / "drafters" / "dflash" / "export", "dflash", 4, None)
    base = _write_drafter(tmp_path / "eagle3-hub", "eagle3", 3, None)
    report = run_bench(
        _recipe(tmp_path, tiny_verifier_dir, num_prompts=1, max_new_tokens=4), baseline=base, **fake_engine
    )
    assert [(r.method.name, r.method.drafter) for r in report.results] == [
        ("no-spec", None),
        ("eagle3", base),
        ("dflash", tmp_path / "runs" / "t" / "drafters" / "dflash" / "export"),
    ]
    assert report.baseline == "eagle3"


def test_run_bench_drafter_dirs_use_recorded_verifier(tmp_path, tiny_verifier_dir, fake_engine):
    d1 = _write_drafter(tmp_path / "a", "dflash", 4, str(tiny_verifier_dir))
    d2 = _write_drafter(tmp_path / "b", "dflash", 2, str(tiny_verifier_dir))
    base = _write_drafter(tmp_path / "e", "eagle3", 3, str(tiny_verifier_dir))
    out = tmp_path / "out"
    report = run_bench(
        drafters=[d1, d2, base],
        baseline=base,
        output=out,
        num_prompts=2,
        max_new_tokens=6,
        dataset=BUILTIN,
        **fake_engine,
    )
    d = report.to_dict()
    assert d["verifier"] == str(tiny_verifier_dir)
    assert [(r["name"], r["num_speculative_tokens"]) for r in d["results"]] == [
        ("no-spec", 0),
        ("eagle3", 3),
        ("dflash", 4),
        ("dflash-2", 2),
    ]
    assert d["baseline"] == "eagle3" and report.ok and (out / "report.json").is_file()


def test_drafters_for_different_verifiers_need_an_override(tmp_path, tiny_verifier_dir, fake_engine):
    a = _write_drafter(tmp_path / "a", "dflash", 4, str(tiny_verifier_dir))
    b = _write_drafter(tmp_path / "b", "eagle3", 3, "meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises(SpecctlError, match="trained for different verifiers .* pass --verifier"):
        run_bench(drafters=[a, b], output=tmp_path / "o", **fake_engine)
    report = run_bench(
        drafters=[a, b],
        verifier=str(tiny_verifier_dir),
        output=tmp_path / "o",
        num_prompts=1,
        max_new_tokens=4,
        **fake_engine,
    )
    assert report.verifier == str(tiny_verifier_dir)


def test_no_drafter_says_which_command_makes_one(tmp_path, tiny_verifier_dir, fake_engine, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecctlError) as e:
        run_bench(**fake_engine)  # no argument: the built-in quickstart recipe
    msg = str(e.value)
    assert "\n" not in msg and "runs/quickstart/drafters/*/export" in msg
    assert "specctl train quickstart --algo dflash" in msg and "specctl export runs/quickstart" in msg


def test_bad_inputs_fail_before_any_work(tmp_path, tiny_verifier_dir, fake_engine):
    d = _write_drafter(tmp_path / "a", "dflash", 4, str(tiny_verifier_dir))
    with pytest.raises(RequirementError, match="no method 'peagle'; this run has no-spec, dflash"):
        run_bench(drafters=[d], requires=["peagle.speedup>1"], output=tmp_path / "o", **fake_engine)
    with pytest.raises(SpecctlError, match="--backend 'tpu': choose one of embedded, vllm, vllm-offline"):
        run_bench(drafters=[d], backend="tpu", **fake_engine)
    with pytest.raises(SpecctlError, match="bench.num_prompts: Input should be greater than or equal to 1"):
        run_bench(drafters=[d], num_prompts=0, **fake_engine)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(SpecctlError, match="no speculators_config.proposal_methods"):
        run_bench(drafters=[empty], **fake_engine)
    with pytest.raises(SpecctlError, match="ngram speculation runs in vLLM only"):
        run_bench(drafters=[d], ngram=3, **fake_engine)
    assert fake_generate.calls == [] and not (tmp_path / "o").exists()


def test_interrupt_writes_partial_report(tmp_path, tiny_verifier_dir, fake_engine):
    d = _write_drafter(tmp_path / "a", "dflash", 4, str(tiny_verifier_dir))
    e = _write_drafter(tmp_path / "e", "eagle3", 3, str(tiny_verifier_dir))

    def interrupted(verifier, drafter, *args, **kw):
        if drafter is not None and drafter.accept == ACCEPT["dflash"]:
            raise KeyboardInterrupt
        return fake_generate(verifier, drafter, *args, **kw)

    with pytest.raises(BenchInterrupted, match=r"partial report \(2 of 3 methods\)") as err:
        run_bench(
            drafters=[e, d],
            output=tmp_path / "o",
            num_prompts=2,
            max_new_tokens=4,
            **{**fake_engine, "generate_fn": interrupted},
        )
    assert err.value.exit_code == 130
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["complete"] is False and [r["name"] for r in report["results"]] == ["no-spec", "eagle3"]
    assert "INCOMPLETE" in (tmp_path / "o" / "report.md").read_text()


def test_plan_methods_baseline_dedup(tmp_path):
    e = _write_drafter(tmp_path / "e", "eagle3", 3, "v")
    d = _write_drafter(tmp_path / "d", "dflash", 4, "v")
    methods, base = plan_methods([d, e], e)
    assert [m.name for m in methods] == ["no-spec", "eagle3", "dflash"] and base == "eagle3"
    methods, base = plan_methods([d], None, ngram=3)
    assert [m.name for m in methods] == ["no-spec", "dflash", "ngram"] and base is None


# ---------------------------------------------------------------- the real embedded engine


def test_run_bench_with_the_embedded_engine(tmp_path, tiny_verifier_dir):
    """A random DFlash drafter, exported and benchmarked end to end: greedy outputs are the
    verifier's (lossless), so both methods emit the same tokens; counters are consistent."""
    import torch

    from specctl.drafters import DRAFTERS
    from specctl.export import save_drafter
    from specctl.recipe import VerifierSection
    from specctl.verifier import load_verifier, resolve_mask_token_id, verifier_spec, verifier_weights

    verifier = load_verifier(VerifierSection(name_or_path=str(tiny_verifier_dir)))
    mask = resolve_mask_token_id(verifier.tokenizer, verifier.config, None)
    torch.manual_seed(0)
    spec = DRAFTERS["dflash"]
    drafter = spec.build(
        spec.config_cls(num_layers=1, block_size=4),
        verifier_spec(verifier, (1, 2, 3), mask),
        verifier_weights(verifier),
        None,
        "kl",
    )
    export = save_drafter(drafter, tmp_path / "dflash", dtype="float32")
    report = run_bench(
        drafters=[export], output=tmp_path / "bench", num_prompts=3, max_new_tokens=10, progress=False
    )
    plain, dflash = report.to_dict()["results"]
    assert report.ok and report.verifier == str(tiny_verifier_dir.resolve())
    assert plain["output_tokens"] == dflash["output_tokens"] > 0
    # token for token: greedy speculation reproduces plain decoding on every prompt
    assert dflash["outputs_match_plain"] == 1.0 and dflash["outputs_compared"] == 3
    assert sum(len(ids) for ids in report.results[1].total.outputs.values()) == dflash["output_tokens"]
    assert dflash["num_drafts"] > 0 and dflash["num_speculative_tokens"] == 3
    assert dflash["num_draft_tokens"] <= 3 * dflash["num_drafts"]
    assert len(dflash["per_position_acceptance"]) == 3
    assert dflash["acceptance_length"] == pytest.approx(
        1 + dflash["num_accepted_tokens"] / dflash["num_drafts"]
    )
    assert plain["acceptance_length"] == 1.0 and plain["num_drafts"] == 0
