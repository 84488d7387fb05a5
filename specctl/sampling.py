"""Lossless verification of drafts: the pure functions the engine calls once per verifier pass.

Greedy verification keeps the longest prefix of drafts that equals the verifier's argmax and
then takes the verifier's own next token (the "bonus" token when every draft was accepted).
Sampled verification is speculative sampling (Leviathan et al. 2023, arXiv 2211.17192): draft
x_i drawn from q_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection the next token is drawn from norm(max(p_i - q_i, 0)); after K acceptances the bonus
token is drawn from p_K. Every emitted token is then distributed exactly as the verifier's p.
Drafters here propose greedily (a deterministic draft is a one-hot q), which turns the ratio
test into "accept with probability p_i(x_i)" and the residual into p_i with x_i removed.
"""

from __future__ import annotations

import torch


def greedy_accept(draft: torch.Tensor, target_argmax: torch.Tensor) -> tuple[int, int]:
    """draft [K], target_argmax [K+1] (the verifier's argmax after the last accepted token and
    after each draft) -> (n_accepted, next_token): drafts 0..n-1 match, next = target_argmax[n]."""
    K = draft.shape[0]
    if K == 0:
        return 0, int(target_argmax[0])
    n = (draft == target_argmax[:K]).int().cumprod(0).sum()  # [] leading matches
    n_accepted, next_token = torch.stack([n, target_argmax[n]]).tolist()  # one host sync
    return n_accepted, next_token


def rejection_sample(
    draft: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Speculative sampling of one verifier pass.

    draft [K] token ids, q [K, V] the distributions they were drawn from (None = greedy drafts,
    q one-hot at the draft), p [K+1, V] the verifier's (temperature/top-p applied) distributions
    after the last accepted token and after each draft -> (n_accepted, next_token).
    Randomness, in order: K uniforms for the ratio tests, then V exponentials for the next token.
    """
    K = draft.shape[0]
    rows = torch.arange(K, device=p.device)
    p_draft = p[rows, draft]  # [K] p_i(x_i)
    u = torch.rand(K, generator=generator, device=p.device, dtype=p.dtype)  # [K]
    # u < p/q with u ~ U[0, 1) has probability min(1, p/q); multiplied out so q = 0 never divides
    accepted = u < p_draft if q is None else u * q[rows, draft].to(p.dtype) < p_draft  # [K]
    n = int(accepted.int().cumprod(0).sum()) if K else 0
    if n == K:
        dist = p[K]  # [V] bonus token
    else:
        if q is None:  # max(p - onehot(x), 0) is p without x
            residual = p[n].clone()
            residual[draft[n]] = 0
        else:
            residual = (p[n] - q[n].to(p.dtype)).clamp_min(0)  # [V]
        # max(p - q, 0) sums to 0 only when p == q, where rejection has probability 0
        dist = torch.where(residual.sum() > 0, residual, p[n])
    return n, int(sample_categorical(dist, generator))


def sample_categorical(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw from weights [V] (>= 0, any positive sum): argmax of w_v / E_v with E_v ~ Exp(1)
    picks v with probability w_v / sum(w) (exponential race, as vLLM samples). Cheaper than
    torch.multinomial and free of host syncs on GPU."""
    race = torch.empty_like(weights, dtype=torch.float32).exponential_(generator=generator)
    return (weights.float() / race.clamp_min_(torch.finfo(torch.float32).tiny)).argmax(-1)


def apply_temperature_top_p(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] the verifier samples from.

    Temperature first, then nucleus: keep the most likely tokens until their mass reaches
    top_p (a token stays when the mass strictly above it is < top_p, so at least one stays),
    as HF's and vLLM's samplers do. temperature 0 is greedy: one-hot at the argmax.
    """
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    logits = logits.float()
    if temperature == 0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p >= 1:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [..., V]
    mass_above = sorted_probs.cumsum(-1) - sorted_probs  # [..., V] mass of more likely tokens
    keep_sorted = mass_above < top_p
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    probs = probs.masked_fill(~keep, 0)
    return probs / probs.sum(-1, keepdim=True)


def confident_draft_length(confidence: torch.Tensor, threshold: float) -> int:
    """confidence [K] (per-position probability that the verifier accepts draft i given it
    accepted drafts before it) -> how many leading drafts to verify: those whose survival
    probability (the running product of confidences) stays >= threshold. Drafts unlikely to
    survive only cost verifier compute, so the block is cut before them (DSpark's dynamic
    draft length); the cut never changes the output, only the work."""
    survival = torch.cumprod(confidence.float(), 0)  # [K]
    return int((survival >= threshold).int().cumprod(0).sum())
