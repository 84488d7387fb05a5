"""The verifier writes its own training data, one conversation at a time, through any engine.

Self-generation (Magpie, arXiv 2406.08464): an aligned chat model fed only the text its
template puts before a user's words (`<|im_start|>system ...<|im_end|>\\n<|im_start|>user\\n`)
writes a plausible user question; the same model then answers it. Multi-turn: the next user turn
is written the same way from the conversation so far (rendered, plus the text before a user
message), then answered, `num_turns` times. A team can train a drafter with no dataset at all,
and the answers are exactly the verifier's distribution.

Regeneration replaces a dataset's assistant turns with the verifier's own answers, in order, so
a later answer sees the verifier's earlier ones, as it would when serving.

Steering (`data.generate.user_prefixes`): a conversation's first user turn may start from a given
text ("Write a Python function"), put after the pre-query prefix; the verifier writes the rest of
the question. Conversation i gets entry i mod n, so a list sets the mix of what the data is about
(chat, code, math) while the questions stay the verifier's own.

Each conversation is a small state machine (`MagpieConversation`, `RegeneratedConversation`)
that names its next request and takes the answer back. `run_conversations` keeps up to
`engine.capacity` conversations in flight per lane (vLLM worker): when a request finishes, its
conversation's next request is submitted at once, and a finished conversation is handed to
`on_finished` (the journal) straight away. Conversations stop growing near `limit` tokens
(data.max_length): what lies past it would be truncated away anyway.

What is reproducible: the requests and their order depend only on the conversations and on what
the engine returned, so an engine that computes the same ids for the same requests in the same
order (hf: per-batch seeds; vllm: a seeded engine stepped in lock-step) gives the same
conversations for the same recipe, engine and number of lanes. A resumed run starts from another
batch plan: its new sampled conversations differ from the ones an uninterrupted run would have
written (each is still a sample of the same recipe); the finished ones are kept as they are.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from specctl.data.chat import Message, next_user_prefix, render
from specctl.data.engines import (  # noqa: F401  (stop_token_ids: re-exported for bench)
    Completion,
    Engine,
    Request,
    Sampling,
    stop_token_ids,
)
from specctl.errors import DataError

MAX_USER_ATTEMPTS = 4  # an empty user turn (the model ended it at once) is resampled this often
MARGIN = 8  # tokens kept free below the limit: the template's text after an answer, re-encoding


@dataclass
class GenerationStats:
    """Totals over one stage's generation (tokens/s for the progress line and the report)."""

    new_tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class GenerationSpec:
    user: Sampling
    answer: Sampling
    num_turns: int
    system_prompt: str | None
    limit: int  # tokens a conversation may grow to (data.max_length, or the engine's context if less)
    user_prefixes: tuple[str, ...] = ()  # first user turn of conversation i starts with entry i mod n


def _known(tokenizer, ids: Sequence[int]) -> list[int]:
    """Ids past the tokenizer (model vocabulary padding) dropped: they decode to nothing."""
    n = len(tokenizer)
    return [t for t in ids if t < n]


def decode(tokenizer, ids: Sequence[int]) -> str:
    """Generated ids -> the turn's text, stripped."""
    return tokenizer.decode(_known(tokenizer, ids), skip_special_tokens=True).strip()


CONTEXT_IDS = 8  # prompt ids decoded with a continuation, so its first word keeps its leading space


def decode_continuation(tokenizer, prompt: Sequence[int], ids: Sequence[int]) -> str:
    """Generated ids -> their text as it reads after `prompt`, leading space kept, not stripped.

    A steered turn joins its prefix to this. Decoding the ids alone would drop the space that
    SentencePiece tokenizers fold into a word's first token ("Write a Python" + "function"), so the
    last prompt ids are decoded with them and cut off again, as incremental detokenizers do.
    """
    ids = _known(tokenizer, ids)
    tail = list(prompt[-CONTEXT_IDS:])
    before = tokenizer.decode(tail, skip_special_tokens=True)
    full = tokenizer.decode(tail + ids, skip_special_tokens=True)
    if full.startswith(before):
        return full[len(before) :]
    return tokenizer.decode(ids, skip_special_tokens=True)


def completion_text(tokenizer, request: Request, completion: Completion) -> str:
    """The whole turn's text: the engine's ids decoded (or a server's own text), stripped; a steered
    turn (`request.continues`) gets the text it continues in front, spaced as the tokenizer reads it."""
    if completion.text is not None:
        raw = completion.text
    elif request.continues:
        raw = decode_continuation(tokenizer, request.prompt, completion.token_ids)
    else:
        return decode(tokenizer, completion.token_ids)
    return (request.continues + raw).strip()


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class Conversation(ABC):
    """One conversation being generated: `next_request` names what it needs, `accept` takes the answer.
    The two kinds (Magpie self-generation, regenerated answers) implement the three abstract methods."""

    key: int
    messages: list[Message]  # the conversation so far
    done: bool = False
    skipped: str | None = None
    new_tokens: int = 0
    seconds: float = 0.0  # from its first request to its last answer (set by run_conversations)

    def __init__(self, key: int, spec: GenerationSpec):
        self.key, self.spec, self.step = key, spec, 0

    def _request(
        self, tokenizer, text: str, sampling: Sampling, kind: str, continues: str = ""
    ) -> Request | None:
        prompt = _encode(tokenizer, text + continues)
        budget = self.spec.limit - len(prompt) - MARGIN
        if budget <= 0:
            return None
        self.step += 1
        return Request(
            f"{self.key}:{self.step}",
            prompt,
            min(sampling.max_new_tokens, budget),
            sampling,
            kind,
            continues=continues,
        )

    def record(self) -> dict[str, Any]:
        """The journal line of a finished conversation."""
        if self.skipped is not None:
            return {"key": self.key, "skipped": self.skipped}
        return {"key": self.key, "messages": self.messages, "new_tokens": self.new_tokens}

    @abstractmethod
    def next_request(self, tokenizer) -> Request | None:
        """What it needs next; None when it is finished (`done` is then set)."""

    @abstractmethod
    def accept(self, text: str, num_tokens: int) -> None:
        """The text of the turn its last request wrote (`completion_text`), and the tokens the engine
        generated for it."""

    @abstractmethod
    def max_new_tokens(self) -> int:
        """An upper bound of the tokens generating it takes (for the plan)."""


class MagpieConversation(Conversation):
    """Self-generated: user turn from the bare prefix (or its steer), answer, next user turn from the
    conversation so far..."""

    def __init__(self, key: int, spec: GenerationSpec):
        super().__init__(key, spec)
        system = spec.system_prompt
        self.messages = [{"role": "system", "content": system}] if system is not None else []
        self.turn, self.phase, self.attempts = 0, "user", 0
        prefixes = spec.user_prefixes
        self.steer = prefixes[key % len(prefixes)].strip() if prefixes else ""

    def _continues(self) -> str:
        """What the user turn being written starts with: the steer, on the first turn only."""
        return self.steer if self.turn == 0 else ""

    def next_request(self, tokenizer) -> Request | None:
        if self.phase == "user":
            text, sampling = next_user_prefix(tokenizer, self.messages), self.spec.user
            request = self._request(tokenizer, text, sampling, "user", continues=self._continues())
        else:
            text = render(tokenizer, self.messages, add_generation_prompt=True)
            request = self._request(tokenizer, text, self.spec.answer, "answer")
        if request is None:
            self._end("overlong")
        return request

    def accept(self, text: str, num_tokens: int) -> None:
        self.new_tokens += num_tokens
        if self.phase == "user":
            if not text or text == self._continues():  # nothing written (past the steer): resample
                self.attempts += 1
                if self.attempts >= MAX_USER_ATTEMPTS:
                    self._end("empty user turn")
                return
            self.messages.append({"role": "user", "content": text})
            self.phase, self.attempts = "answer", 0
            return
        self.messages.append({"role": "assistant", "content": text})
        self.turn += 1
        if self.turn >= self.spec.num_turns:
            self.done = True
        else:
            self.phase = "user"

    def _end(self, why: str) -> None:
        """Stop here: keep the turns answered so far (a question without its answer is dropped)."""
        self.done = True
        if self.phase == "answer":
            self.messages.pop()
        if not any(m["role"] == "assistant" for m in self.messages):
            self.skipped = why

    def max_new_tokens(self) -> int:
        return self.spec.num_turns * (self.spec.user.max_new_tokens + self.spec.answer.max_new_tokens)


class RegeneratedConversation(Conversation):
    """A dataset conversation whose assistant turns are replaced by the verifier's, first to last."""

    def __init__(self, key: int, messages: Sequence[Message], spec: GenerationSpec):
        super().__init__(key, spec)
        self.messages = [dict(m) for m in messages]
        self.slots = [j for j, m in enumerate(self.messages) if m["role"] == "assistant"]
        self.k = 0

    def next_request(self, tokenizer) -> Request | None:
        if self.k >= len(self.slots):
            self.done = True
            return None
        j = self.slots[self.k]
        text = render(tokenizer, self.messages[:j], add_generation_prompt=True)
        request = self._request(tokenizer, text, self.spec.answer, "answer")
        if request is None:  # this turn starts past the limit: keep what was answered before it
            self.done = True
            kept = self.messages[:j]
            while kept and kept[-1]["role"] != "assistant":
                kept.pop()
            self.messages = kept
            if not kept:
                self.skipped = "overlong"
        return request

    def accept(self, text: str, num_tokens: int) -> None:
        self.new_tokens += num_tokens
        self.messages[self.slots[self.k]] = {"role": "assistant", "content": text}
        self.k += 1

    def max_new_tokens(self) -> int:
        return len(self.slots) * self.spec.answer.max_new_tokens


def split_lanes(n: int, lanes: int) -> list[list[int]]:
    """Conversation positions 0..n-1 dealt round-robin to `lanes` lanes (vLLM workers): lane l gets
    l, l + lanes, ...; counts differ by at most one, and a conversation never changes lane."""
    return [list(range(lane, n, lanes)) for lane in range(lanes)]


def run_conversations(
    engine: Engine,
    tokenizer,
    conversations: Sequence[Conversation],
    on_finished: Callable[[list[Conversation], GenerationStats], None],
    stats: GenerationStats | None = None,
    on_progress: Callable[[GenerationStats], None] | None = None,
) -> GenerationStats:
    """Generate every conversation through `engine`; `on_finished(batch, stats)` gets each batch of
    finished conversations as soon as their last answer is in (see the module docstring), and
    `on_progress(stats)` the totals after every turn the engine returns: with many conversations in
    flight the first one finishes late, while turns finish all along."""
    stats = stats or GenerationStats()
    queues = [deque(conversations[i] for i in lane) for lane in split_lanes(len(conversations), engine.lanes)]
    active = [0] * engine.lanes
    in_flight: dict[str, tuple[Conversation, int, Request]] = {}
    finished: list[Conversation] = []
    start = time.perf_counter()

    def start_more() -> list[Request]:
        new = []
        for lane, waiting in enumerate(queues):
            while active[lane] < engine.capacity and waiting:
                conv = waiting.popleft()
                conv.seconds = -time.perf_counter()  # its latency, completed when it finishes
                request = conv.next_request(tokenizer)
                if request is None:
                    finished.append(conv)
                    continue
                request = replace(request, lane=lane)
                new.append(request)
                in_flight[request.id] = (conv, lane, request)
                active[lane] += 1
        return new

    engine.submit(start_more())
    while in_flight or finished:
        if finished:
            now = time.perf_counter()
            for conv in finished:
                conv.seconds += now
            stats.seconds = now - start
            on_finished(finished, stats)
            finished = []
            continue
        completions = engine.poll()
        if not completions:
            raise RuntimeError(
                f"the {engine.name} engine returned nothing with {len(in_flight)} requests in flight"
            )
        follow = []
        for c in completions:
            conv, lane, asked = in_flight.pop(c.id)
            conv.accept(completion_text(tokenizer, asked, c), c.num_tokens)
            stats.new_tokens += c.num_tokens
            request = None if conv.done else conv.next_request(tokenizer)
            if request is None:
                finished.append(conv)
                active[lane] -= 1
            else:
                request = replace(request, lane=lane)
                follow.append(request)
                in_flight[request.id] = (conv, lane, request)
        engine.submit(follow + start_more())
        if on_progress is not None:
            stats.seconds = time.perf_counter() - start
            on_progress(stats)
    stats.seconds = time.perf_counter() - start
    return stats


def check_self_generated(records: Sequence[dict[str, Any]]) -> None:
    """DataError when self-generation wrote no usable conversation at all."""
    if records and all("skipped" in r for r in records):
        reasons = sorted({r["skipped"] for r in records})
        raise DataError(
            f"self-generation: every conversation was dropped ({', '.join(reasons)}); raise "
            "data.generate.user_temperature or data.max_length, or use a chat/instruct verifier"
        )
