"""bench --request-rate: the arrival times of a level (a seeded Poisson process), the rate list,
and a request-rate sweep against the fake OpenAI/vLLM server of test_bench_vllm.py (as a server
the user runs, and as the servers specctl starts)."""

from __future__ import annotations

import json
import math
import random
import sys

import pytest
from test_bench_vllm import FAKE_SERVER, _running_fake

from specctl.bench.arrivals import arrival_offsets, parse_rate_list, rate_label
from specctl.errors import UsageError


def test_arrivals_are_a_seeded_poisson_process():
    rate, n = 4.0, 20000
    times = arrival_offsets(n, rate, seed=7)
    assert len(times) == n and times[0] == 0.0
    assert times == arrival_offsets(n, rate, seed=7)  # seeded: every method meets the same arrivals
    assert times != arrival_offsets(n, rate, seed=8)
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
    assert min(gaps) >= 0
    # Kolmogorov-Smirnov against the exponential CDF 1 - exp(-rate t): the gaps' largest distance
    # stays under the 99.9% critical value 1.95 / sqrt(m)
    m = len(gaps)
    ks = max(
        max((i + 1) / m - (1 - math.exp(-rate * g)), (1 - math.exp(-rate * g)) - i / m)
        for i, g in enumerate(gaps)
    )
    assert ks < 1.95 / math.sqrt(m)
    assert abs(sum(gaps) / m - 1 / rate) < 0.03 / rate  # mean gap 1/rate (sd of the mean ~0.007/rate)


def test_arrivals_count_in_a_window_is_poisson():
    """The brute-force reference: count arrivals per one-second window over many seeds and compare
    the mean and variance with a Poisson law's (both = rate)."""
    rate = 3.0
    counts = []
    for seed in range(400):
        times = arrival_offsets(60, rate, seed)  # 60 requests reach well past t = 11 s
        counts += [sum(k <= t < k + 1 for t in times[1:]) for k in range(1, 11)]
    mean = sum(counts) / len(counts)
    var = sum((c - mean) ** 2 for c in counts) / (len(counts) - 1)
    assert abs(mean - rate) < 0.1 and abs(var - rate) < 0.3
    # the same windows counted from a process built by hand with the standard library
    rng, brute = random.Random(0), []
    for _ in range(400):
        t, times = 0.0, [0.0]
        while len(times) < 60:
            t += rng.expovariate(rate)
            times.append(t)
        brute += [sum(k <= t < k + 1 for t in times[1:]) for k in range(1, 11)]
    assert abs(mean - sum(brute) / len(brute)) < 0.15


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, math.inf, seed=0) == [0.0] * 5
    assert arrival_offsets(0, 2.0, seed=0) == []
    assert arrival_offsets(1, 2.0, seed=0) == [0.0]
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, seed=0)


def test_parse_rate_list():
    assert parse_rate_list("4,1,inf,1") == [1.0, 4.0, math.inf]
    assert parse_rate_list("0.5") == [0.5]
    assert [rate_label(r) for r in parse_rate_list("1,0.5,inf")] == ["0.5", "1", "inf"]
    for bad in ("0", "-1", "nan", "fast", "1,,2"):
        with pytest.raises(UsageError, match="--request-rate"):
            parse_rate_list(bad)


def test_recipe_takes_rates_and_refuses_bad_ones():
    from pydantic import ValidationError

    from specctl.recipe import BenchSection

    assert BenchSection.model_validate({"request_rate": [1, "inf", 0.5]}).request_rate == [1.0, math.inf, 0.5]
    for bad in ([0], ["nan"], [-2]):
        with pytest.raises(ValidationError):
            BenchSection.model_validate({"request_rate": bad})


@pytest.fixture
def fake_server(tmp_path):
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_SERVER)
    return script


@pytest.fixture
def one_category(tmp_path):
    """Six prompts of one category: one group, prompt indices 0..5 in the order sent."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"Tell me about the number {i}."}) + "\n" for i in range(6))
    )
    return path


def _ordered(p, name):
    figures = [p[f"{stat}_{name}_ms"] for stat in ("median", "p90", "p99")]
    return None not in figures and figures == sorted(figures)


def test_request_rate_sweep_against_a_running_server(tmp_path, fake_server, tiny_verifier_dir, one_category):
    """`--base-url URL --request-rate 2,inf`: one level per rate, each with TTFT / TPOT / ITL
    percentiles (p50 <= p90 <= p99); at 2 req/s the server receives the requests at the seeded
    Poisson arrival times, at inf all at once; every prompt may be in flight (no --concurrency)."""
    from conftest import bench_with_flags

    from specctl.bench.render import latency_rows, markdown

    out = tmp_path / "bench"
    fake = ("--k", "3", "--ttft-ms", "20", "--itl-ms", "5", "--chunk", "2")
    with _running_fake(fake_server, tmp_path, *fake) as (url, requests, _):
        report = bench_with_flags(
            base_url=url,
            verifier=str(tiny_verifier_dir),
            dataset=str(one_category),
            num_prompts=6,
            max_new_tokens=8,
            request_rate=[math.inf, 2.0],
            output=out,
            progress=False,
            repeats=1,
        )
    assert report.ok, report.errors
    d = json.loads((out / "report.json").read_text())
    assert d["sweep"]["request_rate"] == [2.0, "inf"] and d["concurrency"] == 6
    points = d["sweep"]["points"]
    assert [(p["concurrency"], p["request_rate"]) for p in points] == [(6, 2.0), (6, "inf")]
    for p in points:
        assert p["output_tokens"] == 6 * 8 and p["acceptance_length"] == 3.0
        assert all(_ordered(p, name) for name in ("ttft", "tpot", "itl"))
        assert p["median_ttft_ms"] >= 20
    sent = [json.loads(line) for line in requests.read_text().splitlines()]
    measured = [b for b in sent if b["max_tokens"] == 8]
    assert len(measured) == 12  # each prompt once per rate, after the warm-up
    by_rate = {2.0: measured[:6], math.inf: measured[6:]}
    at_two = sorted(by_rate[2.0], key=lambda b: b["seed"])
    want = arrival_offsets(6, 2.0, [0, 0, 0])  # (seed, pass, the group's first prompt)
    got = [b["received_s"] - at_two[0]["received_s"] for b in at_two]
    assert want[-1] > 0.5 and max(abs(g - w) for g, w in zip(got, want, strict=True)) < 0.3
    burst = [b["received_s"] for b in by_rate[math.inf]]
    assert max(burst) - min(burst) < 0.3
    assert [row[0] for row in latency_rows(report)] == ["2", "inf"]
    md = markdown(report)
    assert (
        "| request rate (req/s) |" in md
        and "Poisson process at 2, inf req/s (seed 0), at most 6 in flight" in md
    )
    assert "TTFT ms p50 / p90 / p99" in md and (out / "latency.png").is_file()


def test_request_rate_sweep_on_servers_specctl_starts(
    tmp_path, fake_server, tiny_verifier_dir, one_category, monkeypatch
):
    """`--backend vllm --ngram 3 --request-rate 4,inf --concurrency 2`: one server per method,
    each measured at both rates with at most 2 requests in flight; the K sweep's points,
    recommendations and tables are per rate."""
    import importlib.util

    from conftest import bench_with_flags

    import specctl.bench.server
    from specctl.bench.render import markdown, recommendation_lines

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a)
    )
    servers = []
    real = specctl.bench.server.measure_server_loads

    def fake_loads(method, groups, setup, loads, on_done=None, label=None):
        servers.append((label, list(loads)))
        k = str(method.num_speculative_tokens)
        argv = [sys.executable, str(fake_server), "--k", k, "--ttft-ms", "10"]
        command = lambda port: [*argv, "--port", str(port)]  # noqa: E731
        return real(method, groups, setup, loads, on_done, cpu=True, command=command, label=label)

    monkeypatch.setattr(specctl.bench.server, "measure_server_loads", fake_loads)
    out = tmp_path / "bench"
    report = bench_with_flags(
        verifier=str(tiny_verifier_dir),
        backend="vllm",
        ngram=3,
        dataset=str(one_category),
        num_prompts=4,
        max_new_tokens=6,
        concurrency=2,
        request_rate=[4.0, math.inf],
        output=out,
        progress=False,
        ready_timeout_s=30.0,
        repeats=1,
    )
    assert report.ok, report.errors
    loads = [(2, 4.0), (2, math.inf)]
    assert servers == [("no-spec", loads), ("ngram-k3", loads)]  # a sweep names each log by its K
    d = json.loads((out / "report.json").read_text())
    s = d["sweep"]
    assert s["concurrency"] == [2] and s["request_rate"] == [4.0, "inf"]
    assert [(p["name"], p["request_rate"]) for p in s["points"]] == [
        ("no-spec", 4.0),
        ("no-spec", "inf"),
        ("ngram", 4.0),
        ("ngram", "inf"),
    ]
    assert all(_ordered(p, name) for p in s["points"] for name in ("ttft", "tpot", "itl"))
    assert sorted(s["recommended"]["ngram"]) == ["4 req/s", "inf req/s"]
    assert [r["name"] for r in d["results"]] == ["no-spec", "ngram"]  # at the lowest rate
    lines = [text for text, _ in recommendation_lines(report)]
    assert lines[0].startswith("request rate 4 req/s, ngram: K=3")
    md = markdown(report)
    assert "K sweep" in md and "request rate 4.0" not in md
    assert md.count("| request rate (req/s) |") == 2  # the latency table and the K sweep's
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert {o["request_rate"] for o in outputs} == {4.0, "inf"}


def test_request_rate_needs_a_server_backend(tmp_path):
    from conftest import bench_with_flags

    with pytest.raises(
        UsageError, match=r"^--request-rate 1,4: the embedded backend has no request arrivals"
    ):
        bench_with_flags(backend="embedded", request_rate=[4.0, 1.0], output=tmp_path / "o", progress=False)
    with pytest.raises(UsageError, match="--request-rate 1 with --concurrency 1,4: sweep one of them"):
        bench_with_flags(
            base_url="http://127.0.0.1:9",
            request_rate=[1.0],
            concurrency=[1, 4],
            output=tmp_path / "o",
            progress=False,
        )


class _Bar:
    """Stands in for specctl.progress.progress_bar: keeps the task's total and count."""

    def __init__(self, **_):
        self.total, self.completed = None, 0

    def add_task(self, description, total=None):
        self.total = total
        return 0

    def reset(self, task, total=None):
        self.total, self.completed = total, 0

    def advance(self, task, n=1):
        self.completed += n

    def update(self, task, **_):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_server_progress_counts_every_pass(
    tmp_path, fake_server, tiny_verifier_dir, one_category, monkeypatch
):
    """A server answers each prompt once per pass (bench.repeats): the bar's total counts the passes,
    so it ends at N/N (it showed 144/48 at three passes)."""
    from conftest import bench_with_flags

    import specctl.progress

    bars = []
    monkeypatch.setattr(specctl.progress, "progress_bar", lambda **kw: bars.append(_Bar(**kw)) or bars[-1])
    with _running_fake(fake_server, tmp_path, "--k", "3") as (url, _, _):
        report = bench_with_flags(
            base_url=url,
            verifier=str(tiny_verifier_dir),
            dataset=str(one_category),
            num_prompts=4,
            max_new_tokens=4,
            output=tmp_path / "bench",
            repeats=3,
        )
    assert report.ok, report.errors
    (bar,) = bars
    assert bar.total == 4 * 3 and bar.completed == bar.total
