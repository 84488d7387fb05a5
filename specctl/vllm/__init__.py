"""Everything specctl knows about vLLM, in one package: nothing outside it imports vLLM
(tests/test_architecture.py checks it), so a change in vLLM is found here.

  args          the `vllm.LLM(...)` kwargs and engine/server command lines, from the recipe
  worker        the one worker process running `vllm.LLM` (data generation, collect, offline bench)
  verifier      the verifier as vLLM loads it: tokenizer, config, stop ids, no weights
  collect       collect's hidden-state capture (vLLM's KV connector) over the worker
  server        launching an OpenAI-compatible vLLM server and waiting for it
  metrics       vLLM's spec-decode counters from a Prometheus exposition
  support       whether vLLM can run a verifier here (imports vLLM, answer cached)
  capabilities  what each vLLM version has, from package metadata
  defects       known vLLM defects that change what an exported drafter computes
  check         `specctl export --check`, vLLM's own speculators parser

This module itself imports nothing heavy: `available()` asks the import system, not vLLM.
"""

from __future__ import annotations

import importlib.util

from specctl.errors import SpecctlError


class VllmError(SpecctlError):
    """vLLM failed to start, answer or report its counters; the message ends with its log tail."""


def available() -> bool:
    """Whether a `vllm` package is installed (found, not imported: importing it costs seconds)."""
    return importlib.util.find_spec("vllm") is not None
