"""The data stage: sources, chat-template loss masks, token frequencies, on-disk store, generation.

Everything runs on the byte-level tiny tokenizer (one token per byte, so expected token
sequences can be built by hand) and the tiny random verifier; no hub access.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_tokenizer, make_tiny_verifier
from reliability_matrix import fault

from specctl.data import load_samples, load_token_freq, prepare_data, tokenize_conversation
from specctl.data.chat import end_of_turn_ids, pre_query_prefix
from specctl.errors import DataError
from specctl.recipe import DataSection

SYSTEM = "You are terse."
CONVS = [
    [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "Six, of course. Ünïcode ok."},
    ],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue"},
    ],
    [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "hi hi"},
    ],
]
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


def sharegpt(conv):
    return {"conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in conv]}


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cfg(source, **kw) -> DataSection:
    return DataSection(source=str(source), shuffle=kw.pop("shuffle", False), **kw)


def prepare(c: DataSection, tok, out: Path, **kw):
    return prepare_data(c, tok, out, progress=False, **kw)


def chatml_reference(tok, conv):
    """Expected (ids, mask) by hand: ChatML pieces, only assistant content + <|im_end|> masked."""
    ids, mask = [], []

    def add(text, flag):
        piece = tok.encode(text, add_special_tokens=False)
        ids.extend(piece)
        mask.extend([flag] * len(piece))

    for m in conv:
        add(f"<|im_start|>{m['role']}\n", False)
        is_assistant = m["role"] == "assistant"
        add(m["content"] + "<|im_end|>", is_assistant)
        add("\n", False)
    return ids, mask


def masked_runs(tok, ids, mask) -> list[str]:
    """Decoded text of each maximal run of loss-masked tokens."""
    runs, cur = [], []
    for t, m in zip(list(ids), list(mask), strict=True):
        if m:
            cur.append(int(t))
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


def assistant_texts(conv, end="<|im_end|>"):
    return [m["content"] + end for m in conv if m["role"] == "assistant"]


def dir_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


# ---------------------------------------------------------------- chat template + loss mask


def test_mask_from_offsets_matches_brute_force():
    from specctl.data.chat import _mask_from_offsets

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        cuts = sorted(torch.randint(0, 60, (6,), generator=g).tolist())
        spans = [(a, b) for a, b in zip(cuts[::2], cuts[1::2], strict=True) if a < b]
        starts = sorted(torch.randint(0, 64, (20,), generator=g).tolist())
        offsets = [(s, s + 1) for s in starts]
        expected = [any(a <= s < b for a, b in spans) for s in starts]
        assert _mask_from_offsets(offsets, spans) == expected


def test_loss_mask_matches_hand_built_chatml(tiny_tokenizer):
    for conv in CONVS:
        assert tokenize_conversation(tiny_tokenizer, conv) == chatml_reference(tiny_tokenizer, conv)


def test_loss_mask_decodes_to_assistant_turns_multi_turn_with_system(tiny_tokenizer):
    ids, mask = tokenize_conversation(tiny_tokenizer, CONVS[0])
    assert masked_runs(tiny_tokenizer, ids, mask) == assistant_texts(CONVS[0])
    assert tiny_tokenizer.decode(ids) == tiny_tokenizer.apply_chat_template(CONVS[0], tokenize=False)
    assert SYSTEM not in "".join(masked_runs(tiny_tokenizer, ids, mask))


def _tokenizer_with(template: str, extra_special: list[str] = ()):
    tok = make_tiny_tokenizer()
    if extra_special:
        tok.add_special_tokens({"additional_special_tokens": list(extra_special)})
    tok.chat_template = template
    return tok


LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen3's rule: the assistant turn after the last user query carries a <think> block; earlier ones do not.
QWEN3_STYLE = (
    "{%- set ns = namespace(last_query_index=messages|length - 1) %}"
    "{%- for m in messages[::-1] %}{%- if m.role == 'user' and ns.last_query_index == messages|length - 1 %}"
    "{%- set ns.last_query_index = (messages|length - 1) - loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and loop.index0 > ns.last_query_index and loop.last %}"
    "{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + m.content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def test_loss_mask_generic_llama3_style_template():
    tok = _tokenizer_with(LLAMA3_STYLE, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    conv = [*CONVS[0][:4], {"role": "assistant", "content": "  padded answer  "}]
    ids, mask = tokenize_conversation(tok, conv)
    assert masked_runs(tok, ids, mask) == ["It is 4.<|eot_id|>", "padded answer<|eot_id|>"]
    assert ids[0] == tok.bos_token_id and not mask[0]
    assert end_of_turn_ids(tok) == [tok.convert_tokens_to_ids("<|eot_id|>")]
    assert pre_query_prefix(tok) == "<|im_start|><|start_header_id|>user<|end_header_id|>\n\n"


def test_loss_mask_template_that_rewrites_history_qwen3_style():
    tok = _tokenizer_with(QWEN3_STYLE)
    ids, mask = tokenize_conversation(tok, CONVS[0])
    text = tok.apply_chat_template(CONVS[0], tokenize=False)
    assert text.count("<think>") == 1  # only the last turn carries it: prefix rendering differs
    runs = masked_runs(tok, ids, mask)
    assert runs == ["It is 4.<|im_end|>", "<think>\n\n</think>\n\n" + CONVS[0][-1]["content"] + "<|im_end|>"]
    assert tok.decode(ids) == text


def test_pre_query_prefix_default_and_custom_system(tiny_tokenizer):
    assert pre_query_prefix(tiny_tokenizer) == "<|im_start|>user\n"
    assert (
        pre_query_prefix(tiny_tokenizer, "Be kind.")
        == "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\n"
    )
    assert end_of_turn_ids(tiny_tokenizer) == [2]


@fault(
    stage="data",
    fault="a verifier tokenizer without a chat template",
    result="DataError `no chat template`",
)
def test_tokenizer_without_chat_template_is_a_data_error(tmp_path):
    tok = make_tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        prepare(cfg(write_jsonl(tmp_path / "a.jsonl", [{"messages": CONVS[1]}])), tok, tmp_path / "out")


# ---------------------------------------------------------------- local sources


@pytest.mark.parametrize("style", ["json-messages", "jsonl-messages", "json-sharegpt", "jsonl-sharegpt"])
def test_local_text_styles(tmp_path, tiny_tokenizer, style):
    fmt, kind = style.split("-")
    rows = (
        [{"messages": c, "prompt": "ignored"} for c in CONVS]
        if kind == "messages"
        else [sharegpt(c) for c in CONVS]
    )
    path = tmp_path / f"data.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps(rows, indent=1))
    else:
        write_jsonl(path, rows)
    s = prepare(cfg(path), tiny_tokenizer, tmp_path / "out")
    samples = load_samples(tmp_path / "out")
    assert s.num_samples == len(CONVS) == len(samples)
    for sample, conv in zip(samples, CONVS, strict=True):
        ids, mask = chatml_reference(tiny_tokenizer, conv)
        assert sample["input_ids"].dtype == torch.int64 and sample["loss_mask"].dtype == torch.bool
        assert sample["input_ids"].tolist() == ids and sample["loss_mask"].tolist() == mask
    assert s.num_tokens == sum(len(x["input_ids"]) for x in samples)
    assert s.num_loss_tokens == sum(int(x["loss_mask"].sum()) for x in samples)
    lines = (tmp_path / "out" / "conversations.jsonl").read_text().splitlines()
    assert [json.loads(line)["messages"] for line in lines] == CONVS


def test_jsonl_content_in_a_json_file_is_accepted(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "data.json", [{"messages": c} for c in CONVS])
    assert prepare(cfg(path), tiny_tokenizer, tmp_path / "out").num_samples == 3


def test_pretokenized_rows(tmp_path, tiny_tokenizer):
    rows = [
        {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 1]},
        {"input_ids": [10, 11], "loss_mask": [1, 0]},
    ]
    s = prepare(cfg(write_jsonl(tmp_path / "tok.jsonl", rows)), tiny_tokenizer, tmp_path / "out")
    samples = load_samples(tmp_path / "out")
    assert s.num_samples == 2 and s.num_loss_tokens == 4
    assert samples[0]["input_ids"].tolist() == [5, 6, 7, 8, 9]
    assert samples[0]["loss_mask"].tolist() == [False, False, True, True, True]
    assert samples[1]["loss_mask"].tolist() == [True, False]


def test_token_freq_equals_brute_force_count(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVS])
    prepare(cfg(path), tiny_tokenizer, tmp_path / "out")
    freq = load_token_freq(tmp_path / "out")
    expected = Counter()
    for conv in CONVS:
        ids, mask = chatml_reference(tiny_tokenizer, conv)
        expected.update(t for t, m in zip(ids, mask, strict=True) if m)
    assert freq.dtype == torch.int64 and freq.shape == (len(tiny_tokenizer),)
    assert {i: int(c) for i, c in enumerate(freq.tolist()) if c} == dict(expected)
    assert load_token_freq(tmp_path / "out", vocab_size=400).shape == (400,)


def test_token_freq_length_is_the_larger_of_tokenizer_and_model_vocab(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVS])
    model = make_tiny_verifier(num_layers=2, vocab_size=320)
    prepare(cfg(path), tiny_tokenizer, tmp_path / "out", model=model)
    assert load_token_freq(tmp_path / "out").shape == (320,)


def test_rows_without_assistant_are_skipped_and_counted(tmp_path, tiny_tokenizer):
    rows = [{"messages": CONVS[1]}, {"messages": [{"role": "user", "content": "alone"}]}, {"messages": []}]
    s = prepare(cfg(write_jsonl(tmp_path / "d.jsonl", rows)), tiny_tokenizer, tmp_path / "out")
    assert (s.num_samples, s.skipped_no_assistant) == (1, 2)
    pre = [{"input_ids": [5, 6], "loss_mask": [0, 0]}, {"input_ids": [5, 6], "loss_mask": [0, 1]}]
    s = prepare(cfg(write_jsonl(tmp_path / "p.jsonl", pre)), tiny_tokenizer, tmp_path / "out2")
    assert (s.num_samples, s.skipped_no_assistant) == (1, 1)


def test_overlong_truncate_vs_skip(tmp_path, tiny_tokenizer):
    long_conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x" * 60}]
    header_only = [{"role": "user", "content": "y" * 60}, {"role": "assistant", "content": "z"}]
    rows = [{"messages": c} for c in (CONVS[1], long_conv, header_only)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    short_len = len(chatml_reference(tiny_tokenizer, CONVS[1])[0])
    limit = 40
    assert short_len <= limit
    s = prepare(cfg(path, max_length=limit, overlong="truncate"), tiny_tokenizer, tmp_path / "t")
    # long_conv is cut to `limit` tokens; header_only would keep no assistant token, so it is dropped.
    assert (s.num_samples, s.truncated, s.skipped_overlong) == (2, 1, 1)
    samples = load_samples(tmp_path / "t")
    assert [len(x["input_ids"]) for x in samples] == [short_len, limit]
    assert samples[1]["input_ids"].tolist() == chatml_reference(tiny_tokenizer, long_conv)[0][:limit]
    s = prepare(cfg(path, max_length=limit, overlong="skip"), tiny_tokenizer, tmp_path / "s")
    assert (s.num_samples, s.truncated, s.skipped_overlong) == (1, 0, 2)


def test_max_samples_and_seeded_shuffle(tmp_path, tiny_tokenizer):
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(20)
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)

    def answers(out, **kw):
        prepare(cfg(path, **kw), tiny_tokenizer, out)
        lines = (out / "conversations.jsonl").read_text().splitlines()
        return [json.loads(line)["messages"][1]["content"] for line in lines]

    assert answers(tmp_path / "a", max_samples=5) == [f"a{i}" for i in range(5)]
    shuffled = answers(tmp_path / "b", max_samples=5, shuffle=True, seed=1)
    assert len(shuffled) == 5 and shuffled != [f"a{i}" for i in range(5)]
    assert answers(tmp_path / "c", max_samples=5, shuffle=True, seed=1) == shuffled
    assert answers(tmp_path / "d", max_samples=5, shuffle=True, seed=2) != shuffled


# ---------------------------------------------------------------- determinism, reuse, atomicity


def test_same_recipe_gives_same_bytes(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVS * 3])
    prepare(cfg(path, shuffle=True, seed=3), tiny_tokenizer, tmp_path / "a")
    prepare(cfg(path, shuffle=True, seed=3), make_tiny_tokenizer(), tmp_path / "b")
    assert dir_bytes(tmp_path / "a") == dir_bytes(tmp_path / "b")
    assert set(dir_bytes(tmp_path / "a")) == {
        ".specctl-data",
        "manifest.json",
        "tokens.safetensors",
        "token_freq.safetensors",
        "conversations.jsonl",
    }


def test_complete_dir_is_reused_and_changes_rebuild(tmp_path, tiny_tokenizer, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVS])
    out = tmp_path / "out"
    first = prepare(cfg(path), tiny_tokenizer, out)
    before = dir_bytes(out)

    import specctl.data.prepare as prep

    def boom(*a, **k):
        raise AssertionError("reuse must not tokenize")

    monkeypatch.setattr(prep, "tokenize_conversations", boom)
    again = prepare(cfg(path), tiny_tokenizer, out)
    assert again.reused and not first.reused
    assert (again.num_samples, again.num_tokens, again.num_loss_tokens) == (
        first.num_samples,
        first.num_tokens,
        first.num_loss_tokens,
    )
    assert dir_bytes(out) == before
    # A field that matters, or new file content, forces a rebuild.
    with pytest.raises(AssertionError, match="reuse must not tokenize"):
        prepare(cfg(path, max_length=100), tiny_tokenizer, out)
    write_jsonl(path, [{"messages": c} for c in CONVS[:2]])
    with pytest.raises(AssertionError, match="reuse must not tokenize"):
        prepare(cfg(path), tiny_tokenizer, out)
    assert dir_bytes(out) == before  # the failed rebuild left the complete dir in place


@fault(
    stage="data",
    fault="data dir interrupted mid-write: no manifest, truncated tokens file, missing token frequencies",
    result="not reused: the next run rebuilds it",
)
@pytest.mark.parametrize("damage", ["no-manifest", "short-tokens", "missing-freq"])
def test_half_written_dir_is_not_reused(tmp_path, tiny_tokenizer, damage):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVS])
    out = tmp_path / "out"
    prepare(cfg(path), tiny_tokenizer, out)
    good = dir_bytes(out)
    if damage == "no-manifest":
        (out / "manifest.json").unlink()
    elif damage == "short-tokens":
        data = (out / "tokens.safetensors").read_bytes()
        (out / "tokens.safetensors").write_bytes(data[: len(data) // 2])
    else:
        (out / "token_freq.safetensors").unlink()
    with pytest.raises(DataError, match="no complete prepared data"):
        load_samples(out)
    s = prepare(cfg(path), tiny_tokenizer, out)
    assert not s.reused and dir_bytes(out) == good
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no temp dirs left behind


@fault(
    stage="data",
    fault="kill -9 between the two renames of the data dir swap (data/ moved aside, new one not in)",
    result="the next run puts the complete old dir back and reuses it: nothing regenerated",
)
def test_data_dir_stranded_mid_swap_is_recovered_and_reused(tmp_path, tiny_tokenizer, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVS])
    out = tmp_path / "out"
    prepare(cfg(path), tiny_tokenizer, out)
    good = dir_bytes(out)
    dead = 2**30 - 1  # above any Linux pid_max: the killed writer, no longer running
    out.rename(tmp_path / f".out.old-{dead}")

    import specctl.data.prepare as prep

    def boom(*a, **k):
        raise AssertionError("recovery must not tokenize again")

    monkeypatch.setattr(prep, "tokenize_conversations", boom)
    again = prepare(cfg(path), tiny_tokenizer, out)
    assert again.reused and dir_bytes(out) == good
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


# ---------------------------------------------------------------- errors


def _bad_json(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": CONVS[1]}) + "\n\n" + '{"messages": [oops]}\n')
    return cfg(path), r"bad\.jsonl:3: not valid JSON"


def _bad_json_document(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"messages": []},\n  {"messages": ]\n]')
    return cfg(path), r"bad\.json:3:\d+: not valid JSON"


def _unknown_style(tmp_path):
    return cfg(write_jsonl(tmp_path / "x.jsonl", [{"text": "hello", "meta": 1}])), (
        r"keys \['meta', 'text'\].*accepted styles: `messages`.*`conversations`.*`input_ids` \+ `loss_mask`"
    )


def _empty_list(tmp_path):
    (tmp_path / "e.json").write_text("[]")
    return cfg(tmp_path / "e.json"), "empty"


def _empty_file(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n")
    return cfg(tmp_path / "e.jsonl"), "empty"


def _no_assistant(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}]}] * 2
    return cfg(write_jsonl(tmp_path / "n.jsonl", rows)), r"no row has an assistant turn \(2"


def _bad_role(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "beep"}]}]
    return cfg(write_jsonl(tmp_path / "r.jsonl", rows)), r"row 0.*\[1\]: bad role 'robot'.*accepted roles"


def _missing_file(tmp_path):
    return cfg(tmp_path / "nope.jsonl"), r"nope\.jsonl.*file not found"


def _pretokenized_mismatch(tmp_path):
    rows = [{"input_ids": [1, 2, 3], "loss_mask": [1, 0]}]
    return cfg(write_jsonl(tmp_path / "m.jsonl", rows)), "input_ids has 3 tokens but loss_mask 2"


def _pretokenized_out_of_vocab(tmp_path):
    rows = [{"input_ids": [1, 99999], "loss_mask": [1, 1]}]
    return cfg(write_jsonl(tmp_path / "v.jsonl", rows)), r"token id 99999 outside the vocabulary"


def _self_generated_without_model(tmp_path):
    return DataSection(source="self-generated"), "needs the verifier model"


def _regenerate_without_model(tmp_path):
    return cfg(
        write_jsonl(tmp_path / "g.jsonl", [{"messages": CONVS[1]}]), regenerate=True
    ), "needs the verifier"


def _all_overlong(tmp_path):
    return cfg(write_jsonl(tmp_path / "o.jsonl", [{"messages": CONVS[0]}]), max_length=8, overlong="skip"), (
        "longer than data.max_length=8"
    )


def _unreadable_dir(tmp_path):
    (tmp_path / "emptydir").mkdir()
    return cfg(tmp_path / "emptydir"), r"emptydir.*`datasets` cannot read this local file/directory"


ERRORS = [
    _unreadable_dir,
    _missing_file,
    _bad_json,
    _bad_json_document,
    _unknown_style,
    _empty_list,
    _empty_file,
    _no_assistant,
    _bad_role,
    _pretokenized_mismatch,
    _pretokenized_out_of_vocab,
    _self_generated_without_model,
    _regenerate_without_model,
    _all_overlong,
]


@fault(
    stage="data",
    fault="broken JSON, unknown row style, empty file or list, no assistant turn, bad role, missing file, "
    "pre-tokenized length mismatch or ids outside the vocabulary, generation without a model, every "
    "row overlong, an unreadable directory",
    result="DataError on one line naming the file and row; the previous complete data dir stays "
    "byte-identical",
)
@pytest.mark.parametrize("case", ERRORS, ids=lambda f: f.__name__.strip("_"))
def test_errors_are_one_line_and_keep_previous_data(tmp_path, tiny_tokenizer, case):
    out = tmp_path / "out"
    prepare(cfg(write_jsonl(tmp_path / "good.jsonl", [{"messages": c} for c in CONVS])), tiny_tokenizer, out)
    before = dir_bytes(out)
    bad_cfg, pattern = case(tmp_path)
    with pytest.raises(DataError, match=pattern) as err:
        prepare(bad_cfg, tiny_tokenizer, out)
    assert "\n" not in str(err.value)
    assert dir_bytes(out) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@fault(
    stage="data",
    fault="hub dataset unreachable (offline)",
    result="DataError suggesting a local .json/.jsonl or self-generated; nothing written",
)
def test_hub_dataset_unreachable_offline(tmp_path, tiny_tokenizer, monkeypatch):
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        DataError, match=r"unknown hub dataset or hub unreachable.*local \.json/\.jsonl.*self-generated"
    ):
        prepare(cfg("no-such-org/no-such-dataset"), tiny_tokenizer, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------ datasets route (hub ids, local dataset dirs)


def test_datasets_saved_to_disk_with_splits(tmp_path, tiny_tokenizer):
    datasets = pytest.importorskip("datasets")
    ds = datasets.DatasetDict(
        {
            "train_sft": datasets.Dataset.from_list(
                [{"messages": c, "prompt_id": str(i)} for i, c in enumerate(CONVS)]
            ),
            "test_sft": datasets.Dataset.from_list([{"messages": CONVS[1], "prompt_id": "t"}]),
        }
    )
    ds.save_to_disk(str(tmp_path / "ultrachat"))
    s = prepare(cfg(tmp_path / "ultrachat", split="train_sft"), tiny_tokenizer, tmp_path / "out")
    assert s.num_samples == 3
    for sample, conv in zip(load_samples(tmp_path / "out"), CONVS, strict=True):
        assert sample["input_ids"].tolist() == chatml_reference(tiny_tokenizer, conv)[0]
    with pytest.raises(DataError, match=r"no split 'train'.*\['test_sft', 'train_sft'\]"):
        prepare(cfg(tmp_path / "ultrachat", split="train"), tiny_tokenizer, tmp_path / "out2")


def test_datasets_load_dataset_route_sharegpt_and_pretokenized(tmp_path, tiny_tokenizer):
    pytest.importorskip("datasets")
    # A directory of data files goes through datasets.load_dataset(id_or_dir, subset, split=...):
    # the same call a hub id makes.
    repo = tmp_path / "sharegpt_repo"
    repo.mkdir()
    write_jsonl(repo / "train.jsonl", [sharegpt(c) for c in CONVS])
    s = prepare(cfg(repo, split="train"), tiny_tokenizer, tmp_path / "out")
    assert s.num_samples == 3
    assert [x["loss_mask"].tolist() for x in load_samples(tmp_path / "out")] == [
        chatml_reference(tiny_tokenizer, c)[1] for c in CONVS
    ]
    pre = tmp_path / "pre_repo"
    pre.mkdir()
    write_jsonl(pre / "train.jsonl", [{"input_ids": [3, 4, 5], "loss_mask": [0, 1, 1]}])
    s = prepare(cfg(pre), tiny_tokenizer, tmp_path / "out_pre")
    assert (s.num_samples, s.num_loss_tokens) == (1, 2)


# ---------------------------------------------------------------- self-generation and regeneration


@pytest.fixture(scope="module")
def tiny_model():
    return make_tiny_verifier(num_layers=2)


def _check_generated(tok, out: Path, n: int, system: str | None):
    convs = [json.loads(line)["messages"] for line in (out / "conversations.jsonl").read_text().splitlines()]
    samples = load_samples(out)
    assert len(convs) == len(samples) == n
    for conv, sample in zip(convs, samples, strict=True):
        roles = [m["role"] for m in conv]
        assert roles == (["system"] if system else []) + ["user", "assistant"]
        assert conv[-2]["content"].strip()  # a non-empty question
        ids, mask = tokenize_conversation(tok, conv)
        assert sample["input_ids"].tolist() == ids and sample["loss_mask"].tolist() == mask
        assert masked_runs(tok, sample["input_ids"], sample["loss_mask"]) == assistant_texts(conv)
    return convs


def test_self_generated_conversations_are_well_formed(tmp_path, tiny_tokenizer, tiny_model):
    gen = dict(num_conversations=5, user_max_new_tokens=8, batch_size=2)
    c = DataSection(source="self-generated", max_new_tokens=8, temperature=0.7, generate=gen)
    s = prepare_data(c, tiny_tokenizer, tmp_path / "a", model=tiny_model, progress=True)
    assert s.source == "self-generated" and s.num_samples == 5 and s.generation_tokens_per_s > 0
    convs = _check_generated(tiny_tokenizer, tmp_path / "a", 5, None)
    assert len({conv[0]["content"] for conv in convs}) > 1  # sampled questions differ
    # Same recipe, same bytes; reuse with the model passed again does no work.
    prepare(c, tiny_tokenizer, tmp_path / "b", model=tiny_model)
    assert dir_bytes(tmp_path / "a") == dir_bytes(tmp_path / "b")
    assert prepare(c, tiny_tokenizer, tmp_path / "a", model=tiny_model).reused
    assert prepare(c, tiny_tokenizer, tmp_path / "a").reused  # no model needed to reuse
    # A different verifier regenerates instead of reusing another model's conversations.
    other = make_tiny_verifier(num_layers=2, seed=1)
    other.name_or_path = "another-verifier"
    assert not prepare(c, tiny_tokenizer, tmp_path / "a", model=other).reused


def test_self_generated_with_system_prompt_and_max_samples(tmp_path, tiny_tokenizer, tiny_model):
    gen = dict(num_conversations=6, user_max_new_tokens=6, system_prompt="Ask about cats.", batch_size=4)
    c = DataSection(source="self-generated", max_samples=3, max_new_tokens=6, generate=gen)
    s = prepare(c, tiny_tokenizer, tmp_path / "out", model=tiny_model)
    assert s.num_samples == 3
    convs = _check_generated(tiny_tokenizer, tmp_path / "out", 3, "Ask about cats.")
    assert all(conv[0] == {"role": "system", "content": "Ask about cats."} for conv in convs)


def test_regenerate_replaces_assistant_turns_greedy_deterministic(tmp_path, tiny_tokenizer, tiny_model):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVS])
    c = cfg(path, regenerate=True, max_new_tokens=6, temperature=0.0, batch_size=2)
    prepare(c, tiny_tokenizer, tmp_path / "a", model=tiny_model)
    convs = [
        json.loads(line)["messages"]
        for line in (tmp_path / "a" / "conversations.jsonl").read_text().splitlines()
    ]
    for new, old in zip(convs, CONVS, strict=True):
        assert [m["role"] for m in new] == [m["role"] for m in old]
        assert [m["content"] for m in new if m["role"] != "assistant"] == [
            m["content"] for m in old if m["role"] != "assistant"
        ]
        assert [m["content"] for m in new if m["role"] == "assistant"] != [
            m["content"] for m in old if m["role"] == "assistant"
        ]
    for sample, conv in zip(load_samples(tmp_path / "a"), convs, strict=True):
        assert masked_runs(tiny_tokenizer, sample["input_ids"], sample["loss_mask"]) == assistant_texts(conv)
    # Greedy: the same bytes again, and batching (left padding) does not change the answers.
    prepare(c, tiny_tokenizer, tmp_path / "b", model=tiny_model)
    assert dir_bytes(tmp_path / "a") == dir_bytes(tmp_path / "b")
    prepare(
        cfg(path, regenerate=True, max_new_tokens=6, batch_size=1),
        tiny_tokenizer,
        tmp_path / "c",
        model=tiny_model,
    )
    assert (tmp_path / "c" / "conversations.jsonl").read_bytes() == (
        tmp_path / "a" / "conversations.jsonl"
    ).read_bytes()


def test_regenerate_sampled_is_seeded(tmp_path, tiny_tokenizer, tiny_model):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVS])

    def run(out, seed):
        c = cfg(path, regenerate=True, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=seed)
        prepare(c, tiny_tokenizer, tmp_path / out, model=tiny_model)
        return (tmp_path / out / "conversations.jsonl").read_bytes()

    assert run("a", 0) == run("b", 0)
    assert run("c", 1) != run("a", 0)


def test_regenerate_rejects_pretokenized_rows(tmp_path, tiny_tokenizer, tiny_model):
    path = write_jsonl(tmp_path / "p.jsonl", [{"input_ids": [3, 4], "loss_mask": [0, 1]}])
    with pytest.raises(DataError, match="regenerate needs text conversations"):
        prepare(cfg(path, regenerate=True), tiny_tokenizer, tmp_path / "out", model=tiny_model)


@fault(
    stage="data",
    fault="the chat template raises on a conversation (roles not alternating)",
    result="DataError naming the file and row",
)
def test_template_rejecting_a_conversation_names_the_row(tmp_path):
    strict = (
        "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
        "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    tok = _tokenizer_with(strict)
    doubled = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, *CONVS[1][1:]]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVS[1]}, {"messages": doubled}])
    with pytest.raises(DataError, match=r"d\.jsonl row 1: the chat template rejected.*roles must alternate"):
        prepare(cfg(path), tok, tmp_path / "out")


@fault(
    stage="data",
    fault="several collect workers start on the same data dir at once",
    result="one builds it under a file lock, the others reuse it",
)
def test_concurrent_workers_build_the_data_once(tmp_path, tiny_tokenizer, monkeypatch):
    """Collect workers started together (--shard I/N, torchrun ranks) must not each build the data
    (with self-generation that would be N times the generation): one builds, the rest reuse."""
    import threading
    import time

    import specctl.data.prepare as prep

    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVS])
    out = tmp_path / "out"
    calls = []
    real = prep._conversations

    def slow_conversations(*args, **kwargs):
        calls.append(threading.get_ident())
        time.sleep(0.5)  # the others arrive while this one is still building
        return real(*args, **kwargs)

    monkeypatch.setattr(prep, "_conversations", slow_conversations)
    results = []
    workers = [
        threading.Thread(target=lambda: results.append(prepare(cfg(path), tiny_tokenizer, out)))
        for _ in range(3)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(calls) == 1
    assert sorted(r.reused for r in results) == [False, True, True]
    assert len({(r.num_samples, r.num_tokens) for r in results}) == 1
