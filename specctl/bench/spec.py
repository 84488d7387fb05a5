"""The contract between `specctl bench` and its backends: what one is and can do (`BackendSpec`),
what opening one takes (`Opening`), and what an open one offers (`Backend`).

Each backend module (embedded.py, server.py, offline.py, remote.py) exports its spec as a
module-level `SPEC`, as a drafter module does; specctl.bench.backends collects them. Shared code
(the settings checks, the run, the report's rendering) asks the spec of the run's backend what it
can do, and its usage errors list the backends whose spec can, so a fifth backend is one module
and a line in the registry, not an edit of every check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from specctl.bench.plan import Groups, Method
from specctl.bench.report import Point
from specctl.recipe import BenchSection, VerifierSection

# How --adaptive (adaptive verification) is measured: "engine" the backend's own cut, nothing to
# check; "vllm" vLLM's enable_adaptive_verification, checked against the installed vLLM before any
# engine starts; "server" not set from here: a running server adapts as it was started.
Adaptive = Literal["engine", "vllm", "server"]


class Backend(Protocol):
    """An open backend: `measure` decodes the prompts (grouped by category) with one configuration
    and returns one `Point` per concurrency level (or request rate) it covers."""

    name: str
    levels: tuple[int, ...]  # the concurrency levels one measure() covers
    tokenizer: Any

    def measure(self, method: Method, groups: Groups) -> list[Point]: ...


@dataclass(frozen=True)
class Opening:
    """What `BackendSpec.open` gets: the run's verifier, settings and configurations, and the
    callbacks it reports through. `section` None: a --base-url run tokenizing with the server's model."""

    section: VerifierSection | None
    settings: BenchSection
    levels: Sequence[int]
    configs: Sequence[Method]
    log_dir: Path
    vllm_args: Sequence[str] = ()
    sweeping: bool = False
    on_done: Callable[[int], None] | None = None
    say: Callable[..., None] = print
    generate_fn: Callable[..., Any] | None = None  # the embedded engine's, replaced in tests
    load_drafter_fn: Callable[..., Any] | None = None
    warn: Callable[[str], None] = print


@dataclass(frozen=True)
class BackendSpec:
    """Everything backend-specific that shared code may ask. The defaults are what a backend
    cannot do, so a spec lists its capabilities and nothing else."""

    name: str  # bench.backend's value and report.json's "backend"
    title: str  # the engine as the report names it ("measured on ...")
    open: Callable[[Opening], Backend]
    interleave: bool  # methods take turns prompt by prompt (cheap to switch), not engine by engine
    counts_passes: bool  # on_done fires once per prompt per pass (bench.repeats), not once in all
    latency: str  # where its TTFT / TPOT / ITL come from (the latency table's title)
    base_url: bool = False  # picked by --base-url (a server already running), not by --backend
    levels: bool = False  # several concurrency levels in one run (a server takes any load)
    why_one_level: str = ""  # why it measures a single level (the usage errors say it)
    fixed_level: int | None = None  # the one level it always measures at, whatever was asked
    request_rates: bool = False  # requests arrive at a rate (a server's queue has arrivals to time)
    engine_rounds: bool = False  # the prompts split into rounds, an engine per configuration per round
    why_no_engine_rounds: str = ""  # why --engine-rounds does not apply (the usage error says it)
    confidence_thresholds: bool = False  # cuts drafts where their confidence falls (--confidence-threshold)
    adaptive: Adaptive = "engine"
    trees: bool = False  # verifies draft trees (--tree)
    verify_attention: bool = False  # its verify attention can be batched (--verify-attention)
    ngram: bool = False  # vLLM's n-gram speculation (--ngram)
    vllm_drafters: bool = False  # serves drafters through vLLM: each needs a vLLM speculative_config
    vllm_measured: bool = False  # its figures are the installed vLLM's (its defects apply; the
    # report recommends a --speculative-config)
    as_it_runs: bool = False  # measures a server as it runs: one method, nothing configured from
    # here (no drafters, no sweep), no verifier here to explain divergences with

    @property
    def flag(self) -> str:
        """How a user picks it on the command line."""
        return "--base-url" if self.base_url else f"--backend {self.name}"
