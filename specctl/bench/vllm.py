"""What the two vLLM backends of `specctl bench` (server.py, offline.py) share on the bench's side:
the run's settings, a counter delta as a `Measurement`, and what names a configuration's log.
Everything that talks to vLLM itself is in specctl.vllm (args, server, worker, metrics).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specctl.bench.plan import PLAIN, Method, display_name, speculative_config
from specctl.bench.report import Measurement
from specctl.recipe import Sampling
from specctl.vllm.args import engine_argv
from specctl.vllm.metrics import MetricsSnapshot


@dataclass(frozen=True)
class VllmSetup:
    """Everything a vLLM run needs besides the method and the prompts."""

    verifier: str  # a local HF directory or a hub id
    sampling: Sampling  # the run's bench settings'
    concurrency: int
    stop_token_ids: tuple[int, ...]
    log_dir: Path
    ready_timeout_s: float  # how long vLLM may take to start (bench.ready_timeout_s)
    repeats: int  # passes per configuration in its engine, each one a round (bench.repeats)
    max_model_len: int | None = None
    extra_args: tuple[str, ...] = ()
    request_timeout_s: float = 3600.0
    python: str = sys.executable

    def log_path(self, label: str, mode: str) -> Path:
        return self.log_dir / f"vllm-{mode}-{label}.log"


def engine_args(method: Method, setup: VllmSetup, cpu: bool) -> list[str]:
    """A configuration's engine options, shared by server and offline mode (specctl.vllm.args;
    the verifier's and the user's extra args last, so they win)."""
    spec = speculative_config(method)
    return engine_argv(
        setup.verifier,
        seed=setup.sampling.seed,
        max_model_len=setup.max_model_len,
        cpu=cpu,
        speculative_config=spec,
        extra=setup.extra_args,
    )


def to_measurement(
    delta: MetricsSnapshot,
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
    return Measurement(
        num_prompts,
        output_tokens,
        wall_s,
        delta.counters.padded(num_speculative_tokens),
        dict(outputs or {}),
        dict(failed or {}),
        delta.generation_tokens,
    )


def run_label(method: Method, sweeping: bool, started: int = 0) -> str:
    """What names a configuration's log: a sweep starts one engine per K (and per fixed K or
    adaptive verification), the K keeps each log;
    a configuration whose engine `started` before (bench --engine-rounds) gets -round<N>, so
    no round's log is written over another's."""
    label = (
        f"{method.name}-k{method.num_speculative_tokens}"
        if sweeping and method.algo != PLAIN
        else method.name
    )
    label += "-adaptive" if method.adaptive else ""  # beside its fixed-K twin (bench --adaptive both)
    return f"{label}-round{started + 1}" if started else label


def announce(say: Callable[..., None], method: Method, sweeping: bool, mode: str, log: Path) -> None:
    say(
        f"{display_name(method, sweeping)}: starting vLLM ({mode}; log {log})",
        highlight=False,
        soft_wrap=True,
    )
