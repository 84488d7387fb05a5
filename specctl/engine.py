"""Embedded speculative-decoding engine: a KV-cached verifier, any drafter, lossless verification.

One request at a time (batch 1), pure PyTorch + transformers, CPU or GPU. A step is

    greedy_propose(drafter, tokens so far, aux features of the verified positions, K) -> K drafts
    verifier forward over [last token, K drafts] on its KV cache -> K+1 next-token distributions
    accept a prefix of the drafts (greedy or rejection sampling, specctl.sampling), append the
    verifier's own next token, crop the rejected drafts from the KV cache

so every step emits 1..K+1 tokens and the output is the verifier's (greedy: token for token;
sampling: in distribution). The forward that verifies also records the aux hidden states the
drafter reads (forward hooks, as in `verifier.capture_hidden_states`); those of accepted
positions are appended to a buffer, so the verified prefix is never recomputed. The drafter
gets one `state` dict per request to keep its own work on that prefix between proposals
(DFlash/DSpark: the context K/V; EAGLE-3: its context rows' K/V), as vLLM keeps a drafter KV
cache. With no
drafter the same loop feeds one token per step: plain decoding, the baseline of every speedup.

Counters (specctl.counters.SpecCounters, the type bench and vLLM's metrics share) mean what
vLLM's spec-decode metrics mean: a draft is one proposal that was verified, draft tokens are the
tokens it proposed, accepted tokens the drafts the verifier kept (counted before an EOS truncates
the output, as vLLM's scheduler does), and accepted_per_position[i] how many drafts had position i
accepted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from specctl.acceptance import AcceptanceEstimator
from specctl.counters import SpecCounters
from specctl.drafters.api import ConfidenceDrafter, Drafter, greedy_propose
from specctl.sampling import apply_temperature_top_p, confident_draft_length, greedy_accept, rejection_sample
from specctl.verifier import Verifier, record_layers


@dataclass
class GenerationResult:
    tokens: list[int]  # generated ids (prompt excluded; ends with the EOS token when one stopped it)
    counters: SpecCounters
    wall_s: float  # prefill + decode, device synchronised
    # seconds from the start at which each verifier step's tokens were known on the host (the
    # first: the prefill's token): the chunks a streaming server would send, for TTFT/ITL/TPOT
    step_times_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else 0.0


def default_num_speculative_tokens(drafter: Drafter) -> int:
    """K the drafter was exported for: `speculative_tokens` of its speculators config."""
    return drafter.export_config().speculative_tokens


@dataclass
class _Drafting:
    """How each step drafts: K, the aux layers the drafter reads, its propose function, and the cut.

    threshold None: every draft is verified. Else the drafts are cut where their survival (the
    running product of per-position acceptance confidences) falls below it: confidences from the
    drafter's head (`propose_with_confidence`, DSpark), or -- `estimator` set -- predicted from its
    logits (`propose_with_logits`, specctl.acceptance: vLLM's estimator), which then learns from
    what the verifier kept (`verified`)."""

    K: int
    aux_layer_ids: tuple[int, ...]
    propose: Callable[..., Any] | None  # (ids, aux, k, state=) -> drafts, or (drafts, confidences | logits)
    threshold: float | None = None
    estimator: AcceptanceEstimator | None = None
    scored: tuple[torch.Tensor, torch.Tensor] | None = None  # (features, predictions) of the last cut

    def drafts(self, ids: torch.Tensor, aux: torch.Tensor, k: int, state: dict[str, Any]) -> torch.Tensor:
        """The [<= k] drafts to verify after ids[-1]."""
        proposal = self.propose(ids, aux, k, state=state)
        if self.threshold is None:
            return proposal
        if self.estimator is not None:
            drafts, logits = proposal
            if logits is None:
                raise ValueError(
                    "adaptive_threshold needs a drafter that reports its logits (propose_with_logits)"
                )
            features, confidence = self.estimator.confidences(logits)  # [k], [k]
        else:
            drafts, confidence = proposal
            if confidence is None:
                raise ValueError("confidence_threshold: this drafter was built without its confidence head")
        n = confident_draft_length(confidence, self.threshold)
        if self.estimator is not None:
            self.scored = features[:n], confidence[:n]
        return drafts[:n]

    def verified(self, accepted: int) -> None:
        """The verifier kept `accepted` of the drafts `drafts` returned last."""
        if self.estimator is not None and self.scored is not None:
            self.estimator.observe(*self.scored, accepted)
            self.scored = None


def _proposer(
    drafter: Drafter | None,
    num_speculative_tokens: int | None,
    confidence_threshold: float | None,
    adaptive_threshold: float | None = None,
    estimator: AcceptanceEstimator | None = None,
) -> _Drafting:
    """How the drafter drafts (K 0 for plain decoding): its fixed K, DSpark's confidence cut, or
    adaptive verification (the confidence head where the drafter has one, else vLLM's estimator)."""
    if drafter is None:
        return _Drafting(0, (), None)
    if num_speculative_tokens is not None and num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    if confidence_threshold is not None and adaptive_threshold is not None:
        raise ValueError("pass confidence_threshold or adaptive_threshold, not both")
    K = num_speculative_tokens or default_num_speculative_tokens(drafter)
    aux = tuple(drafter.verifier.aux_layer_ids)
    confident = isinstance(drafter, ConfidenceDrafter)
    if adaptive_threshold is not None:
        if confident and drafter.confidence_head is not None:  # DSpark: its own head, as vLLM does
            return _Drafting(K, aux, drafter.propose_with_confidence, adaptive_threshold)
        if estimator is not None and estimator.num_positions < K:
            raise ValueError(f"the acceptance estimator covers {estimator.num_positions} positions, K is {K}")
        estimator = estimator or AcceptanceEstimator(K)
        return _Drafting(K, aux, drafter.propose_with_logits, adaptive_threshold, estimator)
    if confidence_threshold is not None:
        if not confident:
            raise ValueError("confidence_threshold needs a drafter with a confidence head (DSpark)")
        return _Drafting(K, aux, drafter.propose_with_confidence, confidence_threshold)
    return _Drafting(K, aux, partial(greedy_propose, drafter))


def _accept(
    drafts: torch.Tensor, logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> tuple[int, int]:
    """(drafts accepted, the verifier's next token): greedy, or lossless rejection sampling."""
    if temperature == 0:
        return greedy_accept(drafts, logits.argmax(-1))
    probs = apply_temperature_top_p(logits, temperature, top_p)
    return rejection_sample(drafts, None, probs, generator)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate(
    verifier: Verifier | Any,
    drafter: Drafter | None,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    num_speculative_tokens: int | None = None,
    eos_token_ids: Iterable[int] = (),
    confidence_threshold: float | None = None,
    adaptive_threshold: float | None = None,
    estimator: AcceptanceEstimator | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` tokens after `prompt_ids` with the verifier, speculating
    with `drafter` (None = plain decoding, one token per verifier pass).

    verifier: a `Verifier` or a transformers causal LM. temperature 0 = greedy. The drafter
    drafts K = `num_speculative_tokens` (default: its exported `speculative_tokens`) tokens
    per step, fewer when fewer tokens remain. `confidence_threshold` turns on the dynamic
    draft length of drafters that report per-position confidences (`propose_with_confidence`,
    DSpark): a block is cut where its survival probability falls below the threshold.
    `adaptive_threshold` is adaptive verification for any drafter: the same cut, with the
    confidence head where the drafter has one, else with acceptances predicted from the drafter's
    logits by `estimator` (specctl.acceptance, vLLM's online estimator; None: a fresh one for this
    request). Greedy outputs stay plain decoding's: a cut only shortens what is verified.
    """
    model = verifier.model if isinstance(verifier, Verifier) else verifier
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    apply_temperature_top_p(torch.zeros(1), temperature, top_p)  # validates both
    device = next(model.parameters()).device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().to(device)  # [P]
    if prompt.numel() == 0:
        raise ValueError("the prompt is empty: the verifier needs at least one token to continue")
    eos = {int(t) for t in eos_token_ids}
    drafting = _proposer(drafter, num_speculative_tokens, confidence_threshold, adaptive_threshold, estimator)
    K, aux_layer_ids = drafting.K, drafting.aux_layer_ids
    counters = SpecCounters(accepted_per_position=[0] * K)

    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if drafter is not None and not cache.is_croppable:
        raise ValueError("this verifier's KV cache cannot drop rejected drafts (not croppable)")
    generator = torch.Generator(device=device).manual_seed(seed)
    P = prompt.numel()
    ids = torch.empty(P + max_new_tokens, dtype=torch.long, device=device)  # [P + max_new] sequence so far
    ids[:P] = prompt
    aux_buffer: torch.Tensor | None = None  # [P + max_new, n_aux, H] verified positions' features
    draft_state: dict[str, Any] = {}  # the drafter's own cache of its work on the verified prefix
    out: list[int] = []
    marks: list[float] = []

    _sync(device)
    start = time.perf_counter()
    with record_layers(model, aux_layer_ids) as captured:
        n = P  # tokens in `ids`; the cache holds the first `n - len(pending)` of them
        pending = prompt  # verified tokens whose keys/values are not cached yet
        while len(out) < max_new_tokens:
            k = min(K, max_new_tokens - len(out) - 1) if len(pending) == 1 else 0  # never overshoot
            drafts = ids[:0]
            if k > 0:
                drafts = drafting.drafts(ids[:n], aux_buffer[: n - 1], k, draft_state).to(device)  # [<= k]
                k = drafts.numel()
            logits = model(
                input_ids=(torch.cat([pending, drafts]) if k else pending)[None],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=k + 1,
            ).logits[0]  # [k+1, V] after the last verified token and after each draft
            accepted, next_token = _accept(drafts, logits, temperature, top_p, generator)
            if k > 0:
                counters.record(k, accepted)
                drafting.verified(accepted)
            if accepted < k:
                cache.crop(-(k - accepted))  # negative = remove that many entries
            if aux_layer_ids:
                kept = len(pending) + accepted  # features of the pending tokens and accepted drafts
                features = torch.stack([captured[i][0, :kept] for i in aux_layer_ids], 1)  # [kept, n_aux, H]
                if aux_buffer is None:
                    aux_buffer = features.new_empty(P + max_new_tokens, *features.shape[1:])
                aux_buffer[n - len(pending) : n - len(pending) + kept] = features
            new = [*drafts[:accepted].tolist(), next_token] if accepted else [next_token]
            ids[n : n + accepted] = drafts[:accepted]
            ids[n + accepted] = next_token
            n += accepted + 1
            pending = ids[n - 1 : n]
            stop = next((i for i, t in enumerate(new) if t in eos), None)
            out += new if stop is None else new[: stop + 1]
            marks.append(time.perf_counter() - start)  # `new` is host ints: the step has synchronised
            if stop is not None:
                break
    _sync(device)
    return GenerationResult(
        tokens=out, counters=counters, wall_s=time.perf_counter() - start, step_times_s=marks
    )
