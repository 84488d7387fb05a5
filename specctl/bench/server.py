"""The vLLM server backend of `specctl bench`: one OpenAI-compatible server per configuration.

The server (specctl.vllm.server: started on 127.0.0.1 in its own process group, /health polled until
ready, stopped afterwards) gets the prompts as token ids to /v1/completions, streamed, with the
chosen concurrency (asking for the generated ids back, `return_token_ids`; specctl.bench.client),
and the spec-decode counters are read from /metrics before and after each group of prompts. The
server's log stays in the run directory; its tail is part of every failure message.
`measure_at(base_url, ...)` is the part that needs only a URL: the remote backend
(specctl.bench.remote, a server someone else runs) calls it without starting one.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace

import httpx

from specctl.bench.arrivals import arrival_offsets
from specctl.bench.client import RequestError, RequestSettings, Sent, complete_one, send_prompts
from specctl.bench.plan import Groups, Method, max_model_len
from specctl.bench.report import Measurement, MethodResult, Point, Unit
from specctl.bench.spec import BackendSpec, Opening
from specctl.bench.vllm import VllmSetup, announce, engine_args, open_vllm, run_label, to_measurement
from specctl.counters import SpecCounters
from specctl.errors import first_line
from specctl.http import get_text
from specctl.procs import free_port, on_cpu, vllm_env
from specctl.vllm import VllmError
from specctl.vllm.args import SERVED_NAME, server_argv
from specctl.vllm.metrics import MetricsSnapshot, parse_spec_decode_metrics
from specctl.vllm.server import Server, port_taken, requested_port, serve
from specctl.vllm.verifier import VllmVerifier


def server_command(method: Method, setup: VllmSetup, port: int, cpu: bool) -> list[str]:
    """The server's command line for one configuration (specctl.vllm.args)."""
    return server_argv(setup.python, port, engine_args(method, setup, cpu))


def request_settings(setup: VllmSetup) -> RequestSettings:
    """What every request to a server specctl started carries (its served name, vLLM's extensions)."""
    return RequestSettings(
        model=SERVED_NAME,
        sampling=setup.sampling,
        stop_token_ids=setup.stop_token_ids,
        timeout_s=setup.request_timeout_s,
    )


def fetch_metrics(base_url: str) -> MetricsSnapshot:
    return parse_spec_decode_metrics(get_text(base_url + "/metrics"))


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


Load = tuple[int, float | None]  # (requests in flight at most, Poisson requests/s or None: a closed loop)


def measure_at(
    base_url: str,
    settings: RequestSettings,
    groups: Groups,
    levels: Sequence[int],
    k: int,
    on_done: Callable[[int], None] | None = None,
    counters: bool = True,
    passes: int = 1,
) -> dict[int, dict[str, Measurement]]:
    """measure_loads at each concurrency level, closed loop (a request sent as one ends)."""
    loads = [(level, None) for level in levels]
    by_load = measure_loads(base_url, settings, groups, loads, k, on_done, counters, passes)
    return {level: m for (level, _), m in by_load.items()}


def measure_loads(
    base_url: str,
    settings: RequestSettings,
    groups: Groups,
    loads: Sequence[Load],
    k: int,
    on_done: Callable[[int], None] | None = None,
    counters: bool = True,
    passes: int = 1,
) -> dict[Load, dict[str, Measurement]]:
    """Every group of prompts at each load against a running server, streamed, `passes` times
    (bench.repeats: pass after pass over the groups, each group's pass one Unit); `k` is the
    server's num_speculative_tokens (the width of the per-position counts). A load with a request
    rate sends each group's requests at Poisson arrival times seeded by (seed, pass, first prompt):
    every method meets the same arrivals.

    A warm-up request comes first (not measured: first-request costs such as lazy allocations);
    with `counters` (a vLLM server) its stats land before the first /metrics snapshot and each
    group's settled snapshot starts the next. Without, acceptance is not counted.
    """
    first = next(p for g in groups.values() for p in g)
    start = fetch_metrics(base_url) if counters else None
    warm = complete_one(base_url, first[1], first[0], settings, max_tokens=4)
    before = settled_metrics(base_url, start, warm.tokens) if counters else None
    out: dict[Load, dict[str, Measurement]] = {}
    for load in loads:
        level, rate = load
        out[load] = {}
        for round_, (category, prompts) in ((r, g) for r in range(passes) for g in groups.items()):
            seed = [settings.sampling.seed, round_, prompts[0][0]]
            arrivals = arrival_offsets(len(prompts), rate, seed) if rate is not None else None
            sent = send_prompts(base_url, prompts, settings, level, on_done, arrivals)
            if len(sent.failed) == len(prompts):  # nothing measured: the method failed, not a request
                index = min(sent.failed)
                raise VllmError(f"all {len(prompts)} requests failed; prompt {index}: {sent.failed[index]}")
            delta = None
            if counters:
                after = settled_metrics(base_url, before, sent.output_tokens)
                delta, before = after - before, after
            m = streamed_measurement(delta, len(prompts) - len(sent.failed), sent, k)
            c = m.counters
            m.units = [
                Unit(
                    prompts[0][0],
                    round_,
                    m.num_prompts,
                    m.output_tokens,
                    m.wall_s,
                    c.num_drafts,
                    c.num_accepted_tokens,
                )
            ]
            out[load][category] = out[load][category] + m if category in out[load] else m
    return out


def streamed_measurement(delta: MetricsSnapshot | None, answered: int, sent: Sent, k: int) -> Measurement:
    """`answered` prompts' figures with their latencies; the counter delta over them (None: the
    server has no vLLM counters, acceptance not counted)."""
    m = to_measurement(
        delta or MetricsSnapshot(SpecCounters()),
        answered,
        sent.output_tokens,
        sent.wall_s,
        k,
        sent.outputs,
        sent.failed,
    )
    m.ttft_s, m.tpot_s, m.itl_s = list(sent.ttft_s), list(sent.tpot_s), list(sent.itl_s)
    if delta is None:
        m.counted, m.server_generation_tokens = False, None
    return m


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
    loads = [(level, None) for level in levels]
    by_load = measure_server_loads(method, groups, setup, loads, on_done, cpu, command, label)
    return {level: m for (level, _), m in by_load.items()}


def measure_server_loads(
    method: Method,
    groups: Groups,
    setup: VllmSetup,
    loads: Sequence[Load],
    on_done: Callable[[int], None] | None = None,
    cpu: bool | None = None,
    command: Callable[[int], list[str]] | None = None,
    label: str | None = None,
) -> dict[Load, dict[str, Measurement]]:
    """measure_server_levels for any loads: concurrency levels, or request rates (Poisson
    arrivals, `bench --request-rate`) each with its cap on requests in flight."""
    cpu = on_cpu() if cpu is None else cpu
    log_path = setup.log_path(label or method.name, "server")
    fixed = requested_port(setup.extra_args)  # --vllm-arg=--port=N
    for attempt in range(2):
        port = fixed or free_port()
        argv = command(port) if command else server_command(method, setup, port, cpu)
        try:
            with serve(argv, port, log_path, method.name, vllm_env(cpu), setup.ready_timeout_s) as server:
                return _measure_loads(server, method, groups, setup, loads, on_done)
        except VllmError as e:
            if "address already in use" not in str(e).lower():
                raise
            if fixed:  # taken between the check and vLLM's bind
                raise port_taken(port) from None
            # another process may take the free port between the check and vLLM's bind: retry once
            if attempt == 0:
                continue
            raise
    raise AssertionError("unreachable")


def _measure_loads(
    server: Server,
    method: Method,
    groups: Groups,
    setup: VllmSetup,
    loads: Sequence[Load],
    on_done: Callable[[int], None] | None,
) -> dict[Load, dict[str, Measurement]]:
    settings = request_settings(setup)
    try:
        k, passes = method.num_speculative_tokens, setup.repeats
        return measure_loads(server.base_url, settings, groups, loads, k, on_done, passes=passes)
    except (VllmError, RequestError) as e:
        raise server.failure(f"vLLM server for {method.name}: {e}") from None
    except (httpx.HTTPError, OSError) as e:
        raise server.failure(f"vLLM server for {method.name} stopped answering ({first_line(e)})") from None


class ServerBackend:
    """measure(method, prompts): a vLLM server with the method, every prompt at each concurrency level
    (or request rate)."""

    def __init__(
        self,
        verifier: VllmVerifier,
        setup: VllmSetup,
        levels: Sequence[int],
        max_k: int,
        sweeping: bool,
        on_done: Callable[[int], None] | None,
        say: Callable[..., None],
        rates: Sequence[float] = (),
    ):
        self.tokenizer, self.verifier, self.setup = verifier.tokenizer, verifier, setup
        self.levels, self.max_k, self.sweeping, self.on_done, self.say = (
            tuple(levels),
            max_k,
            sweeping,
            on_done,
            say,
        )
        self.rates = tuple(rates)  # bench --request-rate: one level per rate, at the first level's cap
        self.started: Counter[Method] = Counter()  # servers started per configuration (log names)

    def measure(self, method: Method, groups: Groups) -> list[Point]:
        length = max_model_len(
            groups, self.setup.sampling.max_new_tokens, self.max_k, self.verifier.max_positions
        )
        setup = replace(self.setup, max_model_len=length)
        label = run_label(method, self.sweeping, self.started[method])
        self.started[method] += 1
        announce(self.say, method, self.sweeping, "server", setup.log_path(label, "server"))
        if self.rates:
            loads = [(self.levels[0], rate) for rate in self.rates]
            by_load = measure_server_loads(method, groups, setup, loads, self.on_done, label=label)
            return [Point(c, MethodResult(method, m), rate) for (c, rate), m in by_load.items()]
        by_level = measure_server_levels(method, groups, setup, self.levels, self.on_done, label=label)
        return [Point(level, MethodResult(method, categories)) for level, categories in by_level.items()]


def open_server(o: Opening) -> ServerBackend:
    verifier, setup, max_k = open_vllm(o, SPEC.name)
    rates = o.settings.request_rate
    return ServerBackend(verifier, setup, o.levels, max_k, o.sweeping, o.on_done, o.say, rates)


SPEC = BackendSpec(
    name="vllm",
    title="vLLM (server)",
    open=open_server,
    interleave=False,  # a server start per configuration (per round: bench --engine-rounds)
    counts_passes=True,  # measure_loads calls on_done for each prompt of each pass
    latency="streamed requests",
    levels=True,
    request_rates=True,
    engine_rounds=True,
    adaptive="vllm",
    ngram=True,
    vllm_drafters=True,
    vllm_measured=True,
)
