"""Is a bench prompt in the training data? Shared n-token spans between training text and prompts.

A drafter trained on text that contains a bench prompt has seen that prompt's continuation's
context and accepts more on it than on traffic it never saw, so a report on such a prompt overstates
what a user gets. The check is the usual contamination test (GPT-3's and Llama's 13-gram, here 8):
two texts overlap when they share a span of `SPAN` consecutive tokens. Tokens are words and single
punctuation marks, lower-cased, so the check needs no tokenizer and reads the same for every
verifier; a word is at least one BPE token, so 8 of them are at least 8 of the verifier's tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

SPAN = 8  # tokens a shared span needs to count as a copy (issue 44: "an 8-token span")
_TOKEN = re.compile(r"\w+|[^\w\s]")


def tokens(text: str) -> list[str]:
    """Words and single punctuation marks, lower-cased: `Don't!` -> ["don", "'", "t", "!"]."""
    return _TOKEN.findall(text.lower())


def spans(text: str, n: int = SPAN) -> set[tuple[str, ...]]:
    """Every run of `n` consecutive tokens of `text` (none when it has fewer)."""
    t = tokens(text)
    return {tuple(t[i : i + n]) for i in range(len(t) - n + 1)}


def shared_span(a: str, b: str, n: int = SPAN) -> str | None:
    """One span of `n` tokens that `a` and `b` both contain, as text, or None."""
    common = spans(a, n) & spans(b, n)
    return " ".join(min(common)) if common else None


def opens_with(text: str, prefix: str) -> bool:
    """Does `text` start with the tokens of `prefix` (a steer copied as a prompt's opening)?"""
    p = tokens(prefix)
    return bool(p) and tokens(text)[: len(p)] == p


def contaminated(training: Iterable[str], prompts: Sequence[str], n: int = SPAN) -> dict[int, str]:
    """prompt index -> a span it shares with some training text, for the prompts that share one.

    One pass over the training texts against the prompts' spans, so a data set of thousands of
    conversations is checked in seconds."""
    wanted: dict[tuple[str, ...], int] = {}
    for i, prompt in enumerate(prompts):
        for s in spans(prompt, n):
            wanted.setdefault(s, i)
    found: dict[int, tuple[str, ...]] = {}
    for text in training:
        for s in spans(text, n) & wanted.keys():
            i = wanted[s]
            found[i] = min(found.get(i, s), s)  # the same span named whatever the set order
    return {i: " ".join(s) for i, s in sorted(found.items())}
