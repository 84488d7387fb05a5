"""Why a greedy speculative output differs from plain decoding's: the first differing token and
the verifier's logit margins there.

A greedy speculative engine emits the verifier's argmax, so its output can leave plain decoding's
only where the verifier's own forward, computed over a block of rows instead of one row, picks
another token: a genuine numerical near-tie, where the top two logits sit within the dtype's
rounding of each other. Anything wider is a bug. For each output that differs, the bench finds the
first differing token index j and recomputes, with the HF verifier in the bench's dtype:

- the plain margin: the logits at j from a one-token-at-a-time KV-cached decode of plain
  decoding's tokens, the forward plain decoding ran (exactly, on the embedded engine);
- the verify margin: row 0 of a block forward over [token j-1, the method's tokens j..j+K-1] on
  the same cache, i.e. a verify at j with the method's own continuation as its drafts. A
  reconstruction: the engine's cache at j came from its own earlier blocks, and a vLLM backend
  ran vLLM's kernels, not these.

A divergence is a near-tie when plain decoding preferred its token over the method's by less
than `near_tie_limit` (NEAR_TIE_ULPS units of the dtype at the top logit's magnitude).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where the margins are computed: report.py reads this module
    import torch

    from specctl.recipe import VerifyAttention

# A near-tie: the two tokens' logits lie within this many units in the last place of the dtype
# at the top logit's magnitude (bf16 logits of 16-32: 8 x 0.125 = 1.0 logit). One rounding step
# of one attention output in a bf16 SmolLM2 forward moved its logits by up to 0.78 (6 units).
NEAR_TIE_ULPS = 8


@dataclass(frozen=True)
class Divergence:
    """One output that left plain decoding's, at its first differing token."""

    prompt_index: int
    token_index: int  # j: outputs agree on tokens 0..j-1
    plain_token: int | None  # None: that output ended before j
    method_token: int | None
    plain_margin: float  # top-2 logit margin at j, one-token forward (what plain decoding ran)
    verify_margin: float  # top-2 logit margin at j, block forward (the verify reconstruction)
    pair_margin: float | None  # one-token forward: logit[plain_token] - logit[method_token]
    limit: float  # near_tie_limit at j
    near_tie: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where the id lists differ (a missing token counts), None if equal."""
    for j, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return j
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_margin(logits: torch.Tensor) -> float:
    """[V] -> the top logit minus the runner-up (0.0 at an exact tie), in float64."""
    top = logits.double().topk(2).values  # [2]
    return float(top[0] - top[1])


def near_tie_limit(top_logit: float, dtype: torch.dtype) -> float:
    """NEAR_TIE_ULPS spacings of `dtype` at |top_logit| (the logits' own resolution there)."""
    import torch

    exponent = math.floor(math.log2(abs(top_logit))) if top_logit else 0
    return NEAR_TIE_ULPS * torch.finfo(dtype).eps * 2.0**exponent


def margin_logits(
    model: Any,
    prompt: Sequence[int],
    tokens: Sequence[int],
    j: int,
    block: Sequence[int],
    attention: VerifyAttention = "exact",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(one-token logits at j, block logits at j), both [V] float32.

    The cache holds `prompt` (one prefill, as the engine does) and tokens[:j-1] fed one at a
    time; the one-token forward then feeds tokens[j-1]; the block forward feeds [tokens[j-1],
    *block] on the same cache (the one-token entry cropped first), its rows attended as the
    engine's verify was (`attention`). j == 0: the prefill's last row is the logits for both (no
    verify precedes the first token)."""
    import torch
    from transformers import DynamicCache

    from specctl.verifier import verify_kwargs

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)

    def forward(ids: Sequence[int], keep: int = 1, **kw: Any) -> torch.Tensor:
        """[keep, V] logits of the last `keep` rows, as the engine keeps them."""
        x = torch.tensor([list(ids)], dtype=torch.long, device=device)
        with torch.inference_mode():
            out = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=keep, **kw)
        return out.logits[0]

    context = [*prompt, *tokens[: max(j - 1, 0)]]
    first = forward(prompt)[-1]
    if j == 0:
        return first.float(), first.float()
    for t in context[len(prompt) :]:
        forward([t])
    one = forward([tokens[j - 1]])[-1]
    cache.crop(-1)
    rows = forward([tokens[j - 1], *block], keep=len(block) + 1, **verify_kwargs(attention))
    return one.float(), rows[0].float()


def classify(
    prompt_index: int,
    j: int,
    plain: Sequence[int],
    output: Sequence[int],
    one: torch.Tensor,
    block: torch.Tensor,
    dtype: torch.dtype,
) -> Divergence:
    """A Divergence from the logits at j ([V] each) under both forwards."""
    plain_token = plain[j] if j < len(plain) else None
    method_token = output[j] if j < len(output) else None
    pair = None
    if plain_token is not None and method_token is not None:
        pair = float(one[plain_token].double() - one[method_token].double())
    limit = near_tie_limit(float(one.max()), dtype)
    return Divergence(
        prompt_index,
        j,
        plain_token,
        method_token,
        top2_margin(one),
        top2_margin(block),
        pair,
        limit,
        pair is not None and abs(pair) < limit,
    )


def find_divergences(
    model: Any,
    dtype: torch.dtype,
    prompts: Mapping[int, Sequence[int]],
    plain: Mapping[int, Sequence[int]],
    outputs: Mapping[int, Sequence[int]],
    k: int,
    attention: VerifyAttention = "exact",
) -> list[Divergence]:
    """Every prompt whose output differs from plain decoding's, classified (see module doc); the
    verify reconstruction drafts the method's next `k` tokens (fewer where its output ends) and
    attends them as the engine did (`attention`, bench.verify_attention)."""
    found = []
    for i in sorted(outputs.keys() & plain.keys()):
        j = first_difference(plain[i], outputs[i])
        if j is None:
            continue
        output = outputs[i]  # agrees with plain[i] on 0..j-1, the context both forwards read
        one, block = margin_logits(model, prompts[i], plain[i], j, output[j : j + k], attention)
        found.append(classify(i, j, plain[i], output, one, block, dtype))
    return found


def summary_line(divergences: Mapping[str, Sequence[Divergence]]) -> str:
    """The report's line: "n of n divergences at a near-tie (margin < m)" (m: the largest limit
    among them) or which are not, or that no output differs."""
    every = [(name, d) for name, ds in divergences.items() for d in ds]
    if not every:
        return "no output differs from plain decoding"
    ties = sum(d.near_tie for _, d in every)
    limit = max(d.limit for _, d in every)
    line = f"{ties} of {len(every)} divergences from plain decoding at a near-tie (margin < {limit:.3g})"
    wide = [(name, d) for name, d in every if not d.near_tie]
    if wide:
        shown = ", ".join(
            f"{name} prompt {d.prompt_index} token {d.token_index} "
            f"(margin {'-' if d.pair_margin is None else f'{d.pair_margin:.3g}'})"
            for name, d in wide[:3]
        )
        line += f"; not a near-tie: {shown}{' ...' if len(wide) > 3 else ''}"
    return line
