"""The backends of `specctl bench`, one `BackendSpec` each (specctl.bench.spec), and the factory
that opens one.

    backend.measure(method, groups) -> [Point per concurrency level, or per request rate]

A backend decodes the prompts (grouped by category) with one configuration and returns what it
measured: output tokens, time, the generated ids and the acceptance counters (specctl.counters,
the engine's type), one `Point` per concurrency level it covers.

    embedded      specctl.bench.embedded: the engine, batch 1, in this process
    vllm          specctl.bench.server: a vLLM OpenAI server per configuration (several levels each),
                  started by specctl.vllm.server
    vllm-offline  specctl.bench.offline: vLLM's offline LLM per configuration, in specctl.vllm.worker
    remote        specctl.bench.remote: a running OpenAI-compatible server (--base-url), built on
                  `server.measure_loads`: nothing started, the server's own configuration measured

The server-backed ones stream every request (specctl.bench.client): their points carry TTFT,
TPOT and ITL besides the counters.

Each module exports its spec as `SPEC`; this module imports them and nothing imports it back, so
registration runs one way. `BACKENDS` keeps their order: the usage errors list backends in it,
and docs/benchmarking.md's backend table (`markdown`, `make docs`) has a column per spec.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specctl import doc_tables
from specctl.bench import embedded, offline, remote, server
from specctl.bench.plan import Method
from specctl.bench.spec import Backend, BackendSpec, Opening
from specctl.errors import UsageError
from specctl.recipe import BenchSection, VerifierSection

BACKENDS: dict[str, BackendSpec] = {m.SPEC.name: m.SPEC for m in (embedded, server, offline, remote)}


def backend_spec(name: str) -> BackendSpec:
    """The spec of the backend `name` (bench.backend, or the --base-url one)."""
    spec = BACKENDS.get(name)
    if spec is None:
        raise UsageError(f"--backend {name!r}: choose one of {', '.join(selectable())}")
    return spec


def selectable() -> list[str]:
    """The names --backend takes (the --base-url backend is picked by its flag)."""
    return [s.name for s in BACKENDS.values() if not s.base_url]


def able(can: Callable[[BackendSpec], bool]) -> str:
    """The flags that pick a backend which `can`: what a usage error tells the user to use
    ("--backend vllm or --base-url")."""
    return " or ".join(s.flag for s in BACKENDS.values() if can(s))


def run_backend(settings: BenchSection) -> BackendSpec:
    """The backend a run uses: the --base-url one when bench.base_url names a running server,
    else bench.backend's."""
    if settings.base_url:
        return next(s for s in BACKENDS.values() if s.base_url)
    return backend_spec(settings.backend)


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
    opening = Opening(
        section,
        settings,
        levels,
        configs,
        log_dir=log_dir,
        vllm_args=vllm_args,
        sweeping=sweeping,
        on_done=on_done,
        say=say,
        generate_fn=generate_fn,
        load_drafter_fn=load_drafter_fn,
        warn=warn,
    )
    return backend_spec(name).open(opening)


# ---------------------------------------------------------------- the docs' table

ADAPTIVE = {
    "engine": "its own cut",
    "vllm": "vLLM's, where the installed vLLM has it",
    "server": "as the server was started",
}


def _drafters(s: BackendSpec) -> str:
    if s.as_it_runs:
        return "none: the server as it runs"
    return "those vLLM serves" if s.vllm_drafters else "every registered one"


ROWS: tuple[tuple[str, Callable[[BackendSpec], str | bool]], ...] = (
    ("drafters", _drafters),
    ("several `--concurrency` levels", lambda s: s.levels),
    ("`--request-rate`", lambda s: s.request_rates),
    ("`--engine-rounds`", lambda s: s.engine_rounds),
    ("methods take turns prompt by prompt", lambda s: s.interleave),
    ("`--confidence-threshold`", lambda s: s.confidence_thresholds),
    ("`--adaptive`", lambda s: ADAPTIVE[s.adaptive]),
    ("`--tree`", lambda s: s.trees),
    ("`--verify-attention batched`", lambda s: s.verify_attention),
    ("`--ngram`", lambda s: s.ngram),
    ("recommends a `--speculative-config`", lambda s: s.vllm_measured),
    ("TTFT, TPOT, ITL from", lambda s: s.latency),
)


def markdown() -> str:
    """docs/benchmarking.md's backend table: a column per spec, a row per capability."""
    specs = list(BACKENDS.values())
    lines = ["| | " + " | ".join(f"`{s.flag}`" for s in specs) + " |", "|---|" + "---|" * len(specs)]
    for what, cell in ROWS:
        values = [cell(s) for s in specs]
        lines.append(
            f"| {what} | "
            + " | ".join(("yes" if v else "no") if isinstance(v, bool) else v for v in values)
            + " |"
        )
    return "\n".join(lines) + "\n"


BEGIN = "<!-- bench-backends: python -m specctl.bench.backends --update docs/benchmarking.md -->"
END = "<!-- end bench-backends -->"


def with_table(text: str) -> str:
    """`text` (a markdown page) with the table between its BEGIN and END lines replaced."""
    return doc_tables.splice(text, markdown(), BEGIN, END, "the backend table")


def main(argv: Sequence[str]) -> int:
    """--markdown: print the table; --update PAGE: rewrite the table in PAGE."""
    return doc_tables.main(argv, "specctl.bench.backends", with_table, markdown)


__all__ = [
    "BACKENDS",
    "Backend",
    "BackendSpec",
    "Opening",
    "able",
    "backend_spec",
    "markdown",
    "open_backend",
    "run_backend",
    "selectable",
    "with_table",
]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
