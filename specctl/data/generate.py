"""The verifier writes its own training data.

Self-generation (Magpie, arXiv 2406.08464): an aligned chat model fed only the text its
template puts before a user's words (`<|im_start|>system ...<|im_end|>\\n<|im_start|>user\\n`)
writes a plausible user question; the same model then answers it. A team can train a
drafter with no dataset at all, and the answers are exactly the verifier's distribution.

Regeneration replaces a dataset's assistant turns with the verifier's own answers, so the
drafter learns what this verifier says rather than what another model said.

Generation is batched and left-padded HF `generate`; greedy at temperature 0, else sampled
with top_p. Each batch is seeded from (seed, stage, batch index) inside a forked RNG, so the
same recipe gives the same conversations and the caller's RNG state is untouched.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specctl.data.chat import Message, end_of_turn_ids, pre_query_prefix, render
from specctl.errors import DataError


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float  # 0 = greedy
    top_p: float
    batch_size: int
    seed: int


@dataclass
class GenerationStats:
    """Totals over one stage's generate calls (tokens/s for the progress line and the report)."""

    new_tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def stop_token_ids(tokenizer, model) -> list[int]:
    """Ids that end a turn: the model's eos ids, the tokenizer's eos, the template's end-of-turn tokens."""
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


def _model_vocab_size(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def _seed_for(seed: int, stage: int, batch: int) -> int:
    return (seed * 1_000_003 + stage * 10_007 + batch) % (2**63)


def sample_continuations(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    stage: int,
    stats: GenerationStats,
    progress=None,
    description: str = "generating",
) -> list[list[int]]:
    """New tokens for each prompt (up to, excluding, the first stop token).

    Prompts are batched by length (less padding) and left-padded so every row's last
    prompt token sits at the same position; ids the tokenizer cannot decode (model vocab
    padding) are suppressed.
    """
    device = next(model.parameters()).device
    stop_ids = stop_token_ids(tokenizer, model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    vocab = _model_vocab_size(model)
    suppress = list(range(len(tokenizer), vocab)) or None
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[list[int]] = [[] for _ in prompts]
    task = progress.add_task(description, total=len(prompts)) if progress is not None else None
    for b, lo in enumerate(range(0, len(order), params.batch_size)):
        idx = order[lo : lo + params.batch_size]
        width = max(len(prompts[i]) for i in idx)
        input_ids = torch.full((len(idx), width), pad_id, dtype=torch.long)  # [B, T] left-padded
        attention_mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            n = len(prompts[i])
            input_ids[r, width - n :] = torch.tensor(prompts[i], dtype=torch.long)
            attention_mask[r, width - n :] = 1
        greedy = params.temperature == 0
        kwargs = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=params.temperature)
        if not greedy and params.top_p < 1:
            kwargs["top_p"] = params.top_p
        start = time.perf_counter()
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            torch.manual_seed(_seed_for(params.seed, stage, b))
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                max_new_tokens=params.max_new_tokens,
                eos_token_id=stop_ids,
                pad_token_id=pad_id,
                suppress_tokens=suppress,
                top_k=None,
                **kwargs,
            )
        new = out[:, width:].tolist()  # [B, <=max_new_tokens]
        for r, i in enumerate(idx):
            cut = next((k for k, t in enumerate(new[r]) if t in stop_ids), len(new[r]))
            outputs[i] = new[r][:cut]
            stats.new_tokens += min(cut + 1, len(new[r]))
        stats.seconds += time.perf_counter() - start
        if task is not None:
            progress.update(
                task, advance=len(idx), description=f"{description} ({stats.tokens_per_s:.0f} tok/s)"
            )
    return outputs


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True).strip()


def answer(
    model,
    tokenizer,
    conversations: Sequence[Sequence[Message]],
    params: SamplingParams,
    stage: int,
    stats: GenerationStats,
    progress=None,
    description: str = "writing answers",
) -> list[str]:
    """The verifier's answer to each conversation (which ends with a user turn)."""
    prompts = [
        tokenizer(render(tokenizer, conv, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        for conv in conversations
    ]
    outs = sample_continuations(model, tokenizer, prompts, params, stage, stats, progress, description)
    return [_decode(tokenizer, ids) for ids in outs]


def self_generate(
    model,
    tokenizer,
    num_conversations: int,
    user: SamplingParams,
    assistant: SamplingParams,
    system_prompt: str | None,
    stats: GenerationStats,
    progress=None,
) -> list[list[Message]]:
    """Magpie: user turns sampled from the bare pre-query prefix, then answered by the same model.

    Empty user turns (the model ended the turn at once) are dropped and resampled, up to
    four rounds.
    """
    prefix = pre_query_prefix(tokenizer, system_prompt)
    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    questions: list[str] = []
    for attempt in range(4):
        need = num_conversations - len(questions)
        if need <= 0:
            break
        outs = sample_continuations(
            model, tokenizer, [prefix_ids] * need, user, 100 + attempt, stats, progress, "writing user turns"
        )
        questions.extend(q for q in (_decode(tokenizer, ids) for ids in outs) if q)
    if not questions:
        raise DataError(
            "self-generation: the verifier wrote only empty user turns; raise data.generate.user_temperature "
            "or use a chat/instruct verifier"
        )
    conversations = [[*system, {"role": "user", "content": q}] for q in questions[:num_conversations]]
    answers = answer(model, tokenizer, conversations, assistant, 0, stats, progress)
    return [
        [*conv, {"role": "assistant", "content": a}] for conv, a in zip(conversations, answers, strict=True)
    ]


def regenerate(
    model,
    tokenizer,
    conversations: Sequence[Sequence[Message]],
    params: SamplingParams,
    stats: GenerationStats,
    progress=None,
) -> list[list[Message]]:
    """Replace every assistant turn with the verifier's answer to the conversation before it.

    Turns are regenerated in order (all first answers, then all second answers, ...) so a
    later answer sees the verifier's own earlier answers, as it would when serving.
    """
    convs = [[dict(m) for m in conv] for conv in conversations]
    slots = [[j for j, m in enumerate(conv) if m["role"] == "assistant"] for conv in convs]
    depth = max((len(s) for s in slots), default=0)
    for k in range(depth):
        jobs = [(c, s[k]) for c, s in enumerate(slots) if len(s) > k]
        answers = answer(
            model,
            tokenizer,
            [convs[c][:j] for c, j in jobs],
            params,
            k,
            stats,
            progress,
            f"regenerating answers (turn {k + 1}/{depth})",
        )
        for (c, j), a in zip(jobs, answers, strict=True):
            convs[c][j] = {"role": "assistant", "content": a}
    return convs
