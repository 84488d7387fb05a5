"""The vLLM offline backend of `specctl bench`: vLLM's `LLM` per configuration, in a worker process.

The worker is specctl's one vLLM worker (specctl.vllm.worker: its own process group, the same
lifecycle as a server, specctl.procs). The measuring loop (`run_offline_job`) runs here and asks it
for each pass's generation and for the spec-decode counters of its in-process Prometheus registry
before and after (its "generate" and "metrics" requests).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from specctl.bench.plan import Groups, Method, max_model_len
from specctl.bench.report import Measurement, MethodResult, Point, Unit
from specctl.bench.spec import BackendSpec, Opening
from specctl.bench.vllm import VllmSetup, announce, engine_args, open_vllm, run_label, to_measurement
from specctl.counters import SpecCounters
from specctl.procs import on_cpu, vllm_env
from specctl.vllm import VllmError
from specctl.vllm.metrics import MetricsSnapshot, parse_spec_decode_metrics
from specctl.vllm.verifier import VllmVerifier
from specctl.vllm.worker import Worker, WorkerSpec, open_workers


def offline_job(method: Method, groups: Groups, setup: VllmSetup, cpu: bool) -> dict[str, Any]:
    """What the worker subprocess needs, as JSON-ready data (groups: category -> [[index, ids]]).

    The worker hands vLLM a category's prompts at once, so `--max-num-seqs` is the run's
    concurrency: without it vLLM batched all of them, and "concurrency 1" was measured at up to
    four sequences in flight (on a 2-core CPU plain decoding ran 3.4x faster that way, and the
    speedups were a batch's, not a single request's). A user's own --max-num-seqs comes later
    and wins."""
    seqs = ("--max-num-seqs", str(setup.concurrency))
    return {
        "engine_args": engine_args(method, replace(setup, extra_args=(*seqs, *setup.extra_args)), cpu),
        "groups": {c: [[i, list(p.prompt_ids)] for i, p in g] for c, g in groups.items()},
        **asdict(setup.sampling),  # max_new_tokens, temperature, top_p, seed
        "stop_token_ids": list(setup.stop_token_ids),
        "repeats": setup.repeats,
    }


def measure_offline(
    method: Method,
    groups: Groups,
    setup: VllmSetup,
    cpu: bool | None = None,
    label: str | None = None,
) -> dict[str, Measurement]:
    """Run vLLM's offline `LLM` in a worker process (own process group, log kept; `label` names the
    log, default the method's name) and measure `run_offline_job`'s passes with it."""
    cpu = on_cpu() if cpu is None else cpu
    label = label or method.name
    job = offline_job(method, groups, setup, cpu)
    spec = WorkerSpec(method.name, setup.log_path(label, "offline"), vllm_env(cpu), setup.python)
    start = {"argv": job["engine_args"], "log_stats": True}
    with open_workers(start, [spec], VllmError) as (worker,):
        generate, counters = _worker_calls(worker, job)
        result = run_offline_job(job, generate, counters)
    return offline_measurements(result, method.num_speculative_tokens)


def _worker_calls(
    worker: Worker, job: dict[str, Any]
) -> tuple[OfflineGenerate, Callable[[], MetricsSnapshot]]:
    """`run_offline_job`'s generate and counters, as requests to the worker."""
    keys = ("temperature", "top_p", "seed", "stop_token_ids")
    sampling = {k: job[k] for k in keys}

    def generate(prompts: list[tuple[int, list[int]]], max_tokens: int) -> tuple[list[list[int]], float]:
        message = {"op": "generate", "prompts": prompts, "max_tokens": max_tokens, "sampling": sampling}
        reply = worker.request(message, "generating")
        return reply["outputs"], reply["wall_s"]

    def counters() -> MetricsSnapshot:
        return parse_spec_decode_metrics(worker.request({"op": "metrics"}, "reading its counters")["text"])

    return generate, counters


def offline_measurements(result: dict[str, Any], num_speculative_tokens: int) -> dict[str, Measurement]:
    """`run_offline_job`'s result as measurements per category: every pass
    summed, each pass one Unit (the category's prompts timed together: vLLM's offline generate
    returns no per-request wall time, and its counters are engine-wide), named by the category's
    first prompt index, its round the pass."""
    out = {}
    for category, r in result.items():
        total = Measurement()
        for round_, p in enumerate(r["passes"]):
            drafts, draft_tokens, accepted, per_pos, generated = p["counters"]
            delta = MetricsSnapshot(SpecCounters(drafts, draft_tokens, accepted, list(per_pos)), generated)
            outputs = {int(i): [int(t) for t in ids] for i, ids in p.get("outputs", {}).items()}
            m = to_measurement(
                delta, p["num_prompts"], p["output_tokens"], p["wall_s"], num_speculative_tokens, outputs
            )
            m.units = [
                Unit(
                    p["first_prompt"],
                    round_,
                    p["num_prompts"],
                    p["output_tokens"],
                    p["wall_s"],
                    drafts,
                    accepted,
                )
            ]
            total = total + m
        out[category] = total
    return out


class OfflineBackend:
    """measure(method, prompts): vLLM's offline LLM with the method, a category's prompts handed over
    at once and run at most `concurrency` at a time."""

    def __init__(
        self,
        verifier: VllmVerifier,
        setup: VllmSetup,
        max_k: int,
        sweeping: bool,
        say: Callable[..., None],
        on_done: Callable[[int], None] | None = None,
    ):
        self.tokenizer, self.verifier, self.setup = verifier.tokenizer, verifier, setup
        self.levels, self.max_k, self.sweeping, self.say = (setup.concurrency,), max_k, sweeping, say
        self.on_done = on_done  # once per prompt, with its tokens, when its configuration is done
        self.started: Counter[Method] = Counter()  # engines started per configuration (log names)

    def measure(self, method: Method, groups: Groups) -> list[Point]:
        length = max_model_len(
            groups, self.setup.sampling.max_new_tokens, self.max_k, self.verifier.max_positions
        )
        setup = replace(self.setup, max_model_len=length)
        label = run_label(method, self.sweeping, self.started[method])
        self.started[method] += 1
        announce(self.say, method, self.sweeping, "offline", setup.log_path(label, "offline"))
        categories = measure_offline(method, groups, setup, label=label)
        if self.on_done:  # the worker answers once per configuration: its prompts count then
            for ids in (ids for m in categories.values() for ids in m.outputs.values()):
                self.on_done(len(ids))
        return [Point(self.levels[0], MethodResult(method, categories))]


# ---------------------------------------------------------------- the measuring loop

# (prompts as (index, token ids), max_tokens) -> (each prompt's generated ids, in order; the wall
# time of the generation alone, taken in the engine's process: a request's trip to the worker and
# back, two process wake-ups, added 80-90 ms to each 60 ms pass on a loaded 2-core machine)
OfflineGenerate = Callable[[list[tuple[int, list[int]]], int], tuple[list[list[int]], float]]


def run_offline_job(
    job: dict[str, Any], generate: OfflineGenerate, counters: Callable[[], MetricsSnapshot]
) -> dict[str, Any]:
    """The measuring loop, apart from vLLM so tests can drive it with fakes: a warm-up,
    then `repeats` passes over every category's prompts (pass after pass, so a slow spell hits one
    pass of every category rather than every pass of one), each kept whole: its counter delta,
    wall time and each prompt's generated ids (JSON keys are strings: the prompt index). The ids
    are vLLM's token_ids, stop token included, so their lengths add up to output_tokens as on the
    server."""
    first = next(p for g in job["groups"].values() for p in g)
    generate([(first[0], first[1])], 4)  # warm-up, not measured
    result: dict[str, Any] = {category: {"passes": []} for category in job["groups"]}
    for _ in range(job["repeats"]):
        for category, prompts in job["groups"].items():
            result[category]["passes"].append(_one_pass(prompts, job["max_new_tokens"], generate, counters))
    return result


def _one_pass(
    prompts: list[list[Any]],
    max_new_tokens: int,
    generate: OfflineGenerate,
    counters: Callable[[], MetricsSnapshot],
) -> dict[str, Any]:
    """One category's prompts handed over at once: the counter delta, the wall time, the ids."""
    before = counters()
    outs, wall = generate([(i, ids) for i, ids in prompts], max_new_tokens)
    delta = counters() - before
    d = delta.counters
    return {
        "first_prompt": prompts[0][0],  # names the pass's Unit
        "num_prompts": len(prompts),
        "output_tokens": sum(len(ids) for ids in outs),
        "wall_s": wall,
        "counters": [
            d.num_drafts,
            d.num_draft_tokens,
            d.num_accepted_tokens,
            list(d.accepted_per_position),
            delta.generation_tokens,
        ],
        "outputs": {str(i): list(ids) for (i, _), ids in zip(prompts, outs, strict=True)},
    }


def open_offline(o: Opening) -> OfflineBackend:
    verifier, setup, max_k = open_vllm(o, SPEC.name)
    return OfflineBackend(verifier, setup, max_k, o.sweeping, o.say, o.on_done)


SPEC = BackendSpec(
    name="vllm-offline",
    title="vLLM (offline engine)",
    open=open_offline,
    interleave=False,  # an engine start per configuration (per round: bench --engine-rounds)
    counts_passes=False,  # the worker answers once per configuration, its passes inside
    latency="streamed requests",
    why_one_level="starts one engine per configuration, at one level",
    engine_rounds=True,
    adaptive="vllm",
    ngram=True,
    vllm_drafters=True,
    vllm_measured=True,
)
