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
from specctl.drafters import DRAFTERS
from specctl.drafters.api import ConfidenceDrafter, Drafter, greedy_propose, propose_tree
from specctl.recipe import VerifyAttention
from specctl.sampling import apply_temperature_top_p, confident_draft_length, greedy_accept, rejection_sample
from specctl.trees import DraftTree, greedy_tree_accept, tree_rejection_sample, verify_rows_mask
from specctl.verifier import Verifier, record_layers, verify_kwargs


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
    # (ids, aux, depth k, state=) -> a draft tree of depth <= k (None: draft a chain)
    tree: Callable[..., DraftTree] | None = None

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
    tree_nodes: int | None = None,
) -> _Drafting:
    """How the drafter drafts (K 0 for plain decoding): its fixed K, DSpark's confidence cut,
    adaptive verification (the confidence head where the drafter has one, else vLLM's estimator),
    or a tree from its block distributions."""
    if drafter is None:
        if tree_nodes is not None:
            raise ValueError("tree_nodes needs a drafter: plain decoding verifies one token per pass")
        return _Drafting(0, (), None)
    if tree_nodes is not None:
        return _tree_proposer(
            drafter, num_speculative_tokens, confidence_threshold, adaptive_threshold, tree_nodes
        )
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


def _tree_proposer(
    drafter: Drafter, K: int | None, confidence: float | None, adaptive: float | None, tree_nodes: int
) -> _Drafting:
    """Trees of `tree_nodes` nodes, made as the drafter's spec says (`DrafterSpec.tree`: from a
    parallel drafter's block distributions, or EAGLE-3's top-k expansion); a drafter no spec
    registers (a test's) drafts from its block."""
    if tree_nodes < 1:
        raise ValueError(f"tree_nodes must be >= 1, got {tree_nodes}")
    if K is not None and K < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {K}")
    if confidence is not None or adaptive is not None:
        raise ValueError("tree_nodes replaces the draft-length cut: pass no confidence or adaptive threshold")
    spec = DRAFTERS.get(drafter.algo)
    style = "block" if spec is None else spec.tree
    if style is None:
        raise ValueError(f"tree_nodes: the {drafter.algo} drafter cannot draft a tree (its spec has no tree)")
    return _Drafting(
        K or default_num_speculative_tokens(drafter),
        tuple(drafter.verifier.aux_layer_ids),
        None,
        tree=lambda ids, aux, k, state: propose_tree(drafter, style, ids, aux, k, tree_nodes, state),
    )


def _accept(drafts: torch.Tensor, logits: torch.Tensor, sampling: _Sampling) -> tuple[int, int]:
    """(drafts accepted, the verifier's next token): greedy, or lossless rejection sampling."""
    if sampling.temperature == 0:
        return greedy_accept(drafts, logits.argmax(-1))
    probs = apply_temperature_top_p(logits, sampling.temperature, sampling.top_p)
    return rejection_sample(drafts, None, probs, sampling.generator)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Verified:
    """What one verifier pass kept: `num_drafted` draft tokens verified (a chain's K, a tree's
    nodes), the `accepted` draft tokens [a] in order, the verifier's `next_token`, and which rows
    of the forward's input the kept tokens were (`rows` [len(pending) + a]; None: the first ones)."""

    num_drafted: int
    accepted: torch.Tensor
    next_token: int
    rows: torch.Tensor | None = None


@dataclass(frozen=True)
class _Sampling:
    """How a verify decides: temperature (0 = greedy), top_p and the request's generator, and how
    its block's rows are attended (`generate`'s verify_attention)."""

    temperature: float
    top_p: float
    generator: Any
    attention: VerifyAttention = "exact"


def _verify_chain(
    model: Any, cache: Any, pending: torch.Tensor, drafts: torch.Tensor, sampling: _Sampling
) -> _Verified:
    """One forward over [pending, drafts] on the cache; the rejected drafts are cropped from it."""
    k = drafts.numel()
    logits = model(
        input_ids=(torch.cat([pending, drafts]) if k else pending)[None],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=k + 1,
        **verify_kwargs(sampling.attention),
    ).logits[0]  # [k+1, V] after the last verified token and after each draft
    accepted, next_token = _accept(drafts, logits, sampling)
    if accepted < k:
        cache.crop(-(k - accepted))  # negative = remove that many entries
    return _Verified(k, drafts[:accepted], next_token)


def _verify_tree(
    model: Any, cache: Any, pending: torch.Tensor, tree: DraftTree, sampling: _Sampling
) -> _Verified:
    """One forward over [pending token, N tree nodes] on the cache: node rows at position
    cached + depth, each attending the cache, the pending token and its own ancestors. The cache
    then keeps the pending token and the accepted path only, in order -- what plain decoding of
    those tokens would have cached."""
    cached = cache.get_seq_length()
    positions = cached + torch.cat([tree.depths.new_zeros(1), tree.depths])  # [1+N]
    mask = verify_rows_mask(tree.parents, cached)  # [1, 1, 1+N, cached+1+N] True = attend
    if getattr(model.config, "_attn_implementation", None) == "eager":  # eager attention adds its mask
        mask = torch.zeros(mask.shape, dtype=model.dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(model.dtype).min
        )
    logits = model(
        input_ids=torch.cat([pending, tree.tokens])[None],
        attention_mask=mask,
        position_ids=positions[None],
        past_key_values=cache,
        use_cache=True,
        **verify_kwargs(sampling.attention),
    ).logits[0]  # [1+N, V] after the pending token and after each node
    if sampling.temperature == 0:
        path, next_token = greedy_tree_accept(tree.tokens, tree.parents, logits.argmax(-1))
    else:
        probs = apply_temperature_top_p(logits, sampling.temperature, sampling.top_p)
        path, next_token = tree_rejection_sample(tree.tokens, tree.parents, probs, sampling.generator)
    rows = torch.tensor([0, *[1 + j for j in path]], device=pending.device)  # [1 + a]
    keep_cache_rows(cache, cached, rows)
    return _Verified(tree.num_nodes, tree.tokens[rows[1:] - 1], next_token, rows)


def keep_cache_rows(cache: Any, cached: int, rows: torch.Tensor) -> None:
    """Drop from every layer of a DynamicCache the entries after the first `cached` except the
    new ones at `rows` (ascending indices into the entries the last forward appended), keeping
    their order. The kept rows move down in place and the cache is cropped behind them: only the
    new entries are copied, not the whole cache (demo DFlash, 4-node trees, bf16 SmolLM2,
    2026-12-05: an index_select of every layer's whole cache took 0.94 ms of a 56.7 ms step; this,
    0.54 ms of 55.8)."""
    from transformers.cache_utils import DynamicLayer

    kept = rows.numel()
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise ValueError(
                f"draft trees need a full-attention KV cache; this verifier has {type(layer).__name__}"
            )
        new = cached + rows.to(layer.keys.device)  # [kept]; rows[i] >= i, so a row moves down or stays
        layer.keys[..., cached : cached + kept, :] = layer.keys.index_select(-2, new)
        layer.values[..., cached : cached + kept, :] = layer.values.index_select(-2, new)
    cache.crop(cached + kept)


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
    tree_nodes: int | None = None,
    verify_attention: VerifyAttention = "exact",
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
    `tree_nodes` N verifies a draft tree of at most N nodes (depth <= K) in each pass instead of
    one chain, made as the drafter's spec says (`DrafterSpec.tree`: a parallel drafter's block
    distributions, EAGLE-3's top-k expansion); counters then count the tree's nodes as draft
    tokens and the accepted path as accepted tokens. `verify_attention` "batched" attends each
    verify block in one call instead of row by row (specctl.verifier.gqa_sdpa_attention): cheaper,
    and greedy outputs may then leave plain decoding's at near-ties.
    """
    model = verifier.model if isinstance(verifier, Verifier) else verifier
    device = next(model.parameters()).device
    prompt = _checked_prompt(prompt_ids, max_new_tokens, temperature, top_p, device)  # [P]
    eos = {int(t) for t in eos_token_ids}
    drafting = _proposer(
        drafter, num_speculative_tokens, confidence_threshold, adaptive_threshold, estimator, tree_nodes
    )
    counters = SpecCounters(accepted_per_position=[0] * drafting.K)
    cache = _verifier_cache(model, speculating=drafter is not None)
    generator = torch.Generator(device=device).manual_seed(seed)
    sampling = _Sampling(temperature, top_p, generator, verify_attention)
    seq = _Sequence.start(prompt, max_new_tokens)
    out: list[int] = []
    marks: list[float] = []

    _sync(device)
    start = time.perf_counter()
    with record_layers(model, drafting.aux_layer_ids) as captured:
        while len(out) < max_new_tokens:
            k = seq.draft_length(drafting.K, max_new_tokens - len(out))
            step_fn = _tree_step if k > 0 and drafting.tree is not None else _chain_step
            step = step_fn(model, cache, drafting, seq, k, sampling)
            if step.num_drafted > 0:
                counters.record(step.num_drafted, step.accepted.numel())
                drafting.verified(step.accepted.numel())
            new = seq.extend(step, captured, drafting.aux_layer_ids)
            stop = next((i for i, t in enumerate(new) if t in eos), None)
            out += new if stop is None else new[: stop + 1]
            marks.append(time.perf_counter() - start)  # `new` is host ints: the step has synchronised
            if stop is not None:
                break
    del counters.accepted_per_position[drafting.K :]  # a tree's N nodes padded it to N; paths end by depth K
    _sync(device)
    return GenerationResult(
        tokens=out, counters=counters, wall_s=time.perf_counter() - start, step_times_s=marks
    )


def _checked_prompt(
    prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, temperature: float, top_p: float, device
) -> torch.Tensor:
    """The prompt as [P] ids on the device, after checking generate's arguments."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    apply_temperature_top_p(torch.zeros(1), temperature, top_p)  # validates both
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().to(device)  # [P]
    if prompt.numel() == 0:
        raise ValueError("the prompt is empty: the verifier needs at least one token to continue")
    return prompt


def _verifier_cache(model: Any, speculating: bool) -> Any:
    """An empty KV cache for the verifier; speculation needs one that can drop rejected drafts."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if speculating and not cache.is_croppable:
        raise ValueError("this verifier's KV cache cannot drop rejected drafts (not croppable)")
    return cache


@dataclass
class _Sequence:
    """One request's tokens so far: ids [P + max_new] of which the first `n` are verified,
    `pending` the verified ones whose K/V the verifier's cache lacks yet (the prompt, then the
    last step's own token), aux [P + max_new, n_aux, H] the features of the verified positions
    whose K/V are cached, and the drafter's own cache of its work on that prefix."""

    ids: torch.Tensor
    n: int
    pending: torch.Tensor
    aux: torch.Tensor | None = None
    draft_state: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(cls, prompt: torch.Tensor, max_new_tokens: int) -> _Sequence:
        P = prompt.numel()
        ids = torch.empty(P + max_new_tokens, dtype=torch.long, device=prompt.device)
        ids[:P] = prompt
        return cls(ids, P, prompt)

    def draft_length(self, K: int, left: int) -> int:
        """Drafts this step: K, fewer when fewer tokens are left (never overshoot), 0 on the
        prefill (several pending tokens: the drafter has no features of them yet)."""
        return min(K, left - 1) if len(self.pending) == 1 else 0

    def context(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the drafter drafts from: ids [n] and the features [n - 1, n_aux, H] of all but the last."""
        return self.ids[: self.n], self.aux[: self.n - 1]

    def extend(
        self, step: _Verified, captured: dict[int, torch.Tensor], aux_layer_ids: tuple[int, ...]
    ) -> list[int]:
        """Append what `step` kept (its accepted drafts and next token, returned as host ints)
        and the features of the rows it verified."""
        accepted = step.accepted.numel()
        if aux_layer_ids:
            self.aux = _keep_features(
                captured, aux_layer_ids, step, len(self.pending), self.aux, self.n, self.ids.numel()
            )
        n = self.n
        self.ids[n : n + accepted] = step.accepted
        self.ids[n + accepted] = step.next_token
        self.n = n + accepted + 1
        self.pending = self.ids[self.n - 1 : self.n]
        return self.ids[n : self.n].tolist()


def _chain_step(
    model: Any, cache: Any, drafting: _Drafting, seq: _Sequence, k: int, sampling: _Sampling
) -> _Verified:
    """Draft k tokens as a chain (none: a plain decoding or prefill pass) and verify them."""
    drafts = drafting.drafts(*seq.context(), k, seq.draft_state).to(seq.ids.device) if k else seq.ids[:0]
    return _verify_chain(model, cache, seq.pending, drafts, sampling)


def _tree_step(
    model: Any, cache: Any, drafting: _Drafting, seq: _Sequence, k: int, sampling: _Sampling
) -> _Verified:
    """Draft a tree of depth <= k and verify it in one pass."""
    tree = drafting.tree(*seq.context(), k, seq.draft_state)
    return _verify_tree(model, cache, seq.pending, tree, sampling)


def _keep_features(
    captured: dict[int, torch.Tensor],
    aux_layer_ids: tuple[int, ...],
    step: _Verified,
    num_pending: int,
    aux_buffer: torch.Tensor | None,
    n: int,
    length: int,
) -> torch.Tensor:
    """Write the aux features of the pending tokens and accepted drafts -- the rows of the last
    forward `step` kept -- into aux_buffer [length, n_aux, H] after the n - num_pending verified ones."""
    kept = num_pending + step.accepted.numel()
    rows = [captured[i][0] for i in aux_layer_ids]  # per layer [rows of the forward, H]
    if step.rows is not None:
        rows = [r.index_select(0, step.rows.to(r.device)) for r in rows]
    features = torch.stack([r[:kept] for r in rows], 1)  # [kept, n_aux, H]
    if aux_buffer is None:
        aux_buffer = features.new_empty(length, *features.shape[1:])
    aux_buffer[n - num_pending : n - num_pending + kept] = features
    return aux_buffer
