"""Streaming requests to an OpenAI-compatible server: what every server-backed bench sends.

Each prompt goes to /v1/completions through the `openai` client (AsyncOpenAI, no retries: a
retried request would be measured twice), streamed, with at most `concurrency` requests in flight,
each sent at its arrival offset when there are any (`bench --request-rate`, specctl.bench.arrivals;
TTFT is timed from the send, as `vllm bench serve` times it). From
the stream's chunk arrival times come the latency figures `vllm bench serve` reports:

    TTFT  time to first token: request sent -> first chunk with output
    TPOT  time per output token after the first: (latency - TTFT) / (output tokens - 1), per request
    ITL   inter-token latency: the gap between consecutive chunks. With speculative decoding a
          chunk carries every token one engine step accepted, so ITL is the time per step and
          ITL > TPOT when drafts are accepted.

The prompt is token ids (the same ids for every method and backend); on a vLLM server the request
also carries vLLM's `stop_token_ids` and `return_token_ids`, and the streamed ids are kept, so
greedy outputs can be compared token for token. A server that returns no ids still counts
(usage.completion_tokens) and is left out of that comparison; one that refuses token-id prompts
gets the rendered prompt text (`prompt_text`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specctl.bench.prompts import BenchPrompt
from specctl.errors import SpecctlError, first_line

if TYPE_CHECKING:
    from specctl.recipe import Sampling


class RequestError(SpecctlError):
    """One request failed (an HTTP error status, a dropped connection, an unusable answer)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status  # the HTTP status, when the server answered with an error


@dataclass(frozen=True)
class RequestSettings:
    """What every request of a run carries besides its prompt."""

    model: str  # the served model name
    sampling: Sampling  # the run's bench settings' (prompt i is sampled with seed + i)
    stop_token_ids: tuple[int, ...] = ()
    vllm: bool = True  # send vLLM's extensions: stop_token_ids, return_token_ids
    prompt_text: bool = False  # the rendered text instead of the ids (a server that refuses ids)
    timeout_s: float = 3600.0
    api_key: str | None = None


@dataclass
class Answer:
    """One streamed completion: its tokens (and ids when the server returned them) and timings."""

    tokens: int
    ids: list[int] | None
    ttft_s: float
    latency_s: float
    itl_s: list[float]  # gaps between consecutive chunks with output

    @property
    def tpot_s(self) -> float | None:
        return (self.latency_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass
class Sent:
    """A batch of prompts sent: the answered ones' tokens, ids and timings, the failed ones' reasons."""

    output_tokens: int = 0
    wall_s: float = 0.0
    outputs: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> generated ids
    failed: dict[int, str] = field(default_factory=dict)  # prompt index -> why its request failed
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)

    def add(self, index: int, answer: Answer) -> None:
        self.output_tokens += answer.tokens
        if answer.ids is not None:
            self.outputs[index] = answer.ids
        self.ttft_s.append(answer.ttft_s)
        if answer.tpot_s is not None:
            self.tpot_s.append(answer.tpot_s)
        self.itl_s += answer.itl_s


def completion_body(
    prompt: BenchPrompt, index: int, settings: RequestSettings, max_tokens: int | None = None
) -> dict[str, Any]:
    """The arguments of one /v1/completions request (vLLM's extensions under extra_body)."""
    body: dict[str, Any] = {
        "model": settings.model,
        "prompt": prompt.text if settings.prompt_text else list(prompt.prompt_ids),
        "max_tokens": max_tokens or settings.sampling.max_new_tokens,
        "temperature": settings.sampling.temperature,
        "top_p": settings.sampling.top_p,
        "seed": settings.sampling.prompt_seed(index),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.vllm:
        body["extra_body"] = {"stop_token_ids": list(settings.stop_token_ids), "return_token_ids": True}
    return body


def _chunk_ids(choice: Any) -> list[int] | None:
    ids = getattr(choice, "token_ids", None)
    if isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return ids
    return None


def failure_text(e: BaseException, url: str) -> str:
    """One line saying why a request failed: the HTTP status and the server's reason, or the
    connection error underneath the client's."""
    import openai

    if isinstance(e, RequestError):
        return str(e)
    if isinstance(e, openai.APIStatusError):
        body = e.body if isinstance(e.body, dict) else {}
        detail = body.get("error", body) if isinstance(body.get("error", body), dict) else {}
        reason = detail.get("message") or body.get("message") or e.message
        return f"{url}: HTTP {e.status_code} ({first_line(str(reason), 200)})"
    if isinstance(e, openai.APIConnectionError) and e.__cause__ is not None:
        e = e.__cause__
    text = first_line(str(e), 200)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


async def stream_completion(client: Any, body: dict[str, Any], url: str) -> Answer:
    """Send one streamed completion; its answer with the chunk timings."""
    start = time.perf_counter()
    stream = await client.completions.create(**body)
    first = last = None
    itl: list[float] = []
    ids: list[int] | None = []
    pieces = usage = 0
    async for chunk in stream:
        now = time.perf_counter()
        if getattr(chunk, "usage", None) is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices or ():
            piece = _chunk_ids(choice)
            if not (choice.text or piece):
                continue
            if first is None:
                first = now
            else:
                itl.append(now - last)
            last = now
            pieces += 1
            if piece is None:
                ids = None  # the server did not return this chunk's ids: none for the answer
            elif ids is not None:
                ids.extend(piece)
    end = time.perf_counter()
    tokens = usage or (len(ids) if ids else 0)
    if not tokens and pieces:
        raise RequestError(
            f"{url}: the stream had output but no usage.completion_tokens and no token ids; "
            "the server must honour stream_options.include_usage"
        )
    return Answer(tokens, ids if ids else None, (first or end) - start, end - start, itl)


def send_prompts(
    base_url: str,
    prompts: Sequence[tuple[int, BenchPrompt]],
    settings: RequestSettings,
    concurrency: int,
    on_done: Callable[[int], None] | None = None,
    arrivals: Sequence[float] | None = None,
) -> Sent:
    """All prompts with `concurrency` requests in flight at most; with `arrivals` (seconds from
    the start, one per prompt) each request waits for its arrival first.

    A failed request is recorded and the others go on: under load one 500 or dropped
    connection must not throw away the answers already counted, and every prompt ends up
    either answered or failed with its reason.
    """
    if arrivals is not None and len(arrivals) != len(prompts):
        raise ValueError(f"{len(arrivals)} arrival times for {len(prompts)} prompts")
    return asyncio.run(_send_all(base_url, prompts, settings, concurrency, on_done, arrivals))


def _client(base_url: str, settings: RequestSettings) -> Any:
    import openai

    return openai.AsyncOpenAI(
        base_url=base_url + "/v1",
        api_key=settings.api_key or "EMPTY",
        max_retries=0,
        timeout=settings.timeout_s,
    )


async def _send_all(
    base_url: str,
    prompts: Sequence[tuple[int, BenchPrompt]],
    settings: RequestSettings,
    concurrency: int,
    on_done: Callable[[int], None] | None,
    arrivals: Sequence[float] | None = None,
) -> Sent:
    url = base_url + "/v1/completions"
    sent = Sent()
    gate = asyncio.Semaphore(concurrency)
    offsets = list(arrivals) if arrivals is not None else [0.0] * len(prompts)
    async with _client(base_url, settings) as client:

        async def one(index: int, prompt: BenchPrompt, offset: float) -> None:
            wait = start + offset - time.perf_counter()
            if wait > 0:  # not yet arrived
                await asyncio.sleep(wait)
            async with gate:
                try:
                    answer = await stream_completion(client, completion_body(prompt, index, settings), url)
                except Exception as e:  # whatever one request fails with, the others go on
                    sent.failed[index] = failure_text(e, url)
                    answer = None
            if answer is not None:
                sent.add(index, answer)
            if on_done:
                on_done(answer.tokens if answer else 0)

        start = time.perf_counter()
        await asyncio.gather(*(one(i, p, t) for (i, p), t in zip(prompts, offsets, strict=True)))
        sent.wall_s = time.perf_counter() - start
    return sent


def complete_one(
    base_url: str, prompt: BenchPrompt, index: int, settings: RequestSettings, max_tokens: int
) -> Answer:
    """One request, outside a batch (the warm-up); raises RequestError when it fails."""
    url = base_url + "/v1/completions"

    async def run() -> Answer:
        async with _client(base_url, settings) as client:
            try:
                body = completion_body(prompt, index, settings, max_tokens)
                return await stream_completion(client, body, url)
            except RequestError:
                raise
            except Exception as e:
                import openai

                status = e.status_code if isinstance(e, openai.APIStatusError) else None
                raise RequestError(failure_text(e, url), status) from None

    return asyncio.run(run())
