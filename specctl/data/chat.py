"""Chat templates -> input_ids + loss_mask, for any HF chat template.

Every template spells role headers and end-of-turn markers its own way (ChatML, Llama-3,
Gemma, ...). Rather than knowing them, we render growing prefixes of a conversation and
read each assistant span off the difference between "everything before it, plus the
generation prompt" and "everything up to and including it", then check that both are
prefixes of the full rendering. Templates that render history differently from the last
turn (Qwen3 drops `<think>` blocks from earlier turns) fail that check; for those turns we
locate the assistant content inside the full rendering instead.

The loss mask covers what the verifier *generates*: the assistant content and its
end-of-turn token, not the role header (part of the prompt) and not whitespace the
template writes after the end-of-turn token (never generated: serving stops at it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specctl.errors import DataError, first_line

Message = dict[str, str]

SENTINEL = "SPECCTLSENTINEL7f3a9c"


def render(tokenizer, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
    """The chat template applied to `messages`, as text (special tokens spelled out)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template; use an instruct/chat "
            "model's tokenizer or pre-tokenized rows (`input_ids` + `loss_mask`)"
        )
    try:
        text = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # jinja raises its own errors (e.g. "roles must alternate")
        why = f"{type(e).__name__}: {first_line(e)}" if str(e).strip() else type(e).__name__
        raise DataError(f"the chat template rejected the conversation ({why})") from None
    if not isinstance(text, str):
        raise DataError(f"apply_chat_template returned {type(text).__name__}, expected text")
    return text


def special_token_strings(tokenizer) -> tuple[str, ...]:
    """Spellings of the tokenizer's added/special tokens (`<|im_end|>`, `<|eot_id|>`, ...)."""
    return tuple(sorted(tokenizer.get_added_vocab(), key=len, reverse=True))


def _trim_after_end_of_turn(text: str, start: int, end: int, specials: tuple[str, ...]) -> int:
    """Drop whitespace a template writes after the end-of-turn token (ChatML's `\\n`)."""
    kept = text[start:end].rstrip()
    if len(kept) < end - start and any(kept.endswith(s) for s in specials):
        return start + len(kept)
    return end


def _render_before(tokenizer, messages: Sequence[Message], i: int) -> str:
    """Rendering of messages[:i] plus the generation prompt ('' when the template rejects an empty list)."""
    if i == 0:
        try:
            return render(tokenizer, [], add_generation_prompt=True)
        except DataError:
            return ""
    return render(tokenizer, messages[:i], add_generation_prompt=True)


def assistant_char_spans(tokenizer, messages: Sequence[Message], text: str) -> list[tuple[int, int]]:
    """[start, end) character spans of the assistant turns inside `text` = render(messages)."""
    specials = special_token_strings(tokenizer)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render_before(tokenizer, messages, i)
        through = text if i == len(messages) - 1 else render(tokenizer, messages[: i + 1])
        before_ok = text.startswith(before) and len(before) >= cursor
        if before_ok and text.startswith(through) and len(through) > len(before):
            start, end = len(before), len(through)
        else:
            start, end = _locate_content(text, message["content"], before, through, cursor, before_ok, i)
        end = _trim_after_end_of_turn(text, start, end, specials)
        spans.append((start, end))
        cursor = end
    return spans


def _locate_content(
    text: str, content: str, before: str, through: str, cursor: int, before_ok: bool, i: int
) -> tuple[int, int]:
    """Fallback for templates that render this turn differently once later turns follow it."""
    content = content.strip()
    search_from = len(before) if before_ok else cursor
    pos = text.find(content, search_from) if content else search_from
    if pos < 0:
        raise DataError(
            f"message {i}: cannot find the assistant turn in the chat template's rendering; "
            "pass pre-tokenized rows (`input_ids` + `loss_mask`) for this template"
        )
    # The end-of-turn marker is what the template writes after the content when the turn is last.
    diff = through[len(before) :] if through.startswith(before) else through
    k = diff.rfind(content) if content else -1
    marker = diff[k + len(content) :] if k >= 0 else ""
    end = pos + len(content)
    if marker and text.startswith(marker, end):
        end += len(marker)
    return (len(before) if before_ok else pos), end


def _mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """A token is an assistant token when its first character lies inside an assistant span."""
    if not spans or not offsets:
        return [False] * len(offsets)
    starts = np.asarray(offsets, dtype=np.int64)[:, 0]  # [T]
    span = np.asarray(spans, dtype=np.int64)  # [S, 2], sorted, disjoint
    j = np.searchsorted(span[:, 1], starts, side="right")  # first span ending after the token starts
    inside = j < len(span)
    inside[inside] &= span[j[inside], 0] <= starts[inside]
    return inside.tolist()


def tokenize_conversations(
    tokenizer, conversations: Sequence[Sequence[Message]]
) -> list[tuple[list[int], list[bool]]]:
    """(input_ids, loss_mask) per conversation; one batched tokenizer call for fast tokenizers.

    input_ids is the tokenization of the full rendering (what the verifier sees), so the
    mask is mapped through character offsets rather than built from separately tokenized
    pieces (which would differ at piece boundaries for SentencePiece tokenizers).
    """
    if not conversations:
        return []
    texts = [render(tokenizer, conv) for conv in conversations]
    spans = [
        assistant_char_spans(tokenizer, conv, text) for conv, text in zip(conversations, texts, strict=True)
    ]
    if not getattr(tokenizer, "is_fast", False):
        return [_tokenize_pieces(tokenizer, text, sp) for text, sp in zip(texts, spans, strict=True)]
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return [
        (list(ids), _mask_from_offsets(offsets, sp))
        for ids, offsets, sp in zip(enc["input_ids"], enc["offset_mapping"], spans, strict=True)
    ]


def tokenize_conversation(tokenizer, messages: Sequence[Message]) -> tuple[list[int], list[bool]]:
    return tokenize_conversations(tokenizer, [messages])[0]


def _tokenize_pieces(tokenizer, text: str, spans: Sequence[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """Slow-tokenizer path: tokenize prompt and assistant pieces separately and concatenate."""
    ids: list[int] = []
    mask: list[bool] = []
    pos = 0
    for a, b in [*spans, (len(text), len(text))]:
        for piece, flag in ((text[pos:a], False), (text[a:b], True)):
            if piece:
                piece_ids = tokenizer.encode(piece, add_special_tokens=False)
                ids.extend(piece_ids)
                mask.extend([flag] * len(piece_ids))
        pos = b
    return ids, mask


def pre_query_prefix(tokenizer, system_prompt: str | None = None) -> str:
    """The text a template writes before a user's words (Magpie): render a sentinel user turn, cut there.

    With system_prompt None the template adds its own default system turn, if it has one.
    """
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    return next_user_prefix(tokenizer, messages)


def next_user_prefix(tokenizer, messages: Sequence[Message]) -> str:
    """The conversation so far, rendered, plus what the template writes before the next user's words.

    Multi-turn Magpie: the verifier continues this text with the next user turn, so it sees the
    conversation exactly as its template shows it (earlier answers included).
    """
    text = render(tokenizer, [*messages, {"role": "user", "content": SENTINEL}])
    if text.count(SENTINEL) != 1:
        raise DataError(
            f"cannot derive the pre-query prefix from {tokenizer.name_or_path!r}'s chat template "
            "(the user message does not appear once); use a dataset source instead of `self-generated`"
        )
    return text[: text.index(SENTINEL)]


def end_of_turn_ids(tokenizer) -> list[int]:
    """Special tokens a template writes right after user and assistant content (`<|im_end|>`, ...)."""
    added = tokenizer.get_added_vocab()
    ids: list[int] = []
    for role in ("user", "assistant"):
        messages = [{"role": "user", "content": SENTINEL}]
        if role == "assistant":
            messages.append({"role": "assistant", "content": SENTINEL + "A"})
        try:
            text = render(tokenizer, messages)
        except DataError:
            continue
        tail = text[text.rindex(SENTINEL) + len(SENTINEL) + (1 if role == "assistant" else 0) :]
        token_ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
        first = next((t for t in token_ids if tokenizer.convert_ids_to_tokens(t) in added), None)
        if first is not None and first not in ids:
            ids.append(first)
    return ids
