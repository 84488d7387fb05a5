"""Lossless verification: greedy acceptance, rejection sampling, temperature/top-p, each against
a brute-force reference; rejection sampling also by its output distribution (chi-square)."""

from __future__ import annotations

import bisect
import functools
import itertools
import random

import pytest
import torch

from specctl.sampling import (
    apply_temperature_top_p,
    confident_draft_length,
    greedy_accept,
    rejection_sample,
    sample_categorical,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---------------------------------------------------------------- greedy


def brute_greedy_accept(draft: list[int], target_argmax: list[int]) -> tuple[int, int]:
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return n, target_argmax[n]


def test_greedy_accept_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    for K in range(0, 6):
        for _ in range(100):
            target = torch.randint(0, 3, (K + 1,), generator=g)  # small vocab: many prefix matches
            draft = torch.randint(0, 3, (K,), generator=g)
            assert greedy_accept(draft, target) == brute_greedy_accept(draft.tolist(), target.tolist())


def test_greedy_accept_all_and_none():
    target = torch.tensor([5, 6, 7, 8])
    assert greedy_accept(torch.tensor([5, 6, 7]), target) == (3, 8)  # all accepted: bonus token
    assert greedy_accept(torch.tensor([4, 6, 7]), target) == (0, 5)  # first wrong: later matches don't count
    assert greedy_accept(torch.tensor([], dtype=torch.long), target[:1]) == (0, 5)  # plain decoding


# ---------------------------------------------------------------- rejection sampling, exact checks


def random_probs(rows: int, vocab: int, g: torch.Generator, scale: float = 1.5) -> torch.Tensor:
    return torch.softmax(torch.randn(rows, vocab, generator=g) * scale, -1)


def brute_rejection_sample(draft, q, p, generator) -> tuple[int, int]:
    """Leviathan et al. Algorithm 1 written out token by token. It consumes randomness as the
    implementation documents (K uniforms, then V exponentials raced for the next token), so the
    same seed must give the same result."""
    K, V = p.shape[0] - 1, p.shape[1]
    u = torch.rand(K, generator=generator, dtype=p.dtype).tolist()
    n, weights = K, p[K].tolist()
    for i in range(K):
        x = int(draft[i])
        qi = [1.0 if v == x else 0.0 for v in range(V)] if q is None else q[i].tolist()
        if u[i] < p[i, x].item() / qi[x]:
            continue
        n, weights = i, [max(p[i, v].item() - qi[v], 0.0) for v in range(V)]
        break
    race = torch.empty(V).exponential_(generator=generator).tolist()
    return n, max(range(V), key=lambda v: weights[v] / race[v])


@pytest.mark.parametrize("full_q", [False, True])
def test_rejection_sample_matches_brute_force(full_q):
    g = torch.Generator().manual_seed(1)
    for K in range(0, 5):
        for trial in range(40):
            p = random_probs(K + 1, 6, g)
            q = random_probs(K, 6, g) if full_q else None
            draft = (
                torch.multinomial(q, 1, generator=g)[:, 0]
                if full_q
                else torch.randint(0, 6, (K,), generator=g)
            )
            got = rejection_sample(draft, q, p, torch.Generator().manual_seed(trial))
            want = brute_rejection_sample(draft, q, p, torch.Generator().manual_seed(trial))
            assert got == want, (K, trial)


def test_sample_categorical_follows_the_weights():
    weights = torch.tensor([0.0, 1.0, 2.0, 3.0, 0.0, 4.0])  # unnormalised, with impossible tokens
    draws = sample_categorical(weights.expand(20_000, 6), torch.Generator().manual_seed(0))  # [20000]
    counts = torch.bincount(draws, minlength=6)
    assert counts[0] == 0 and counts[4] == 0
    assert chi_square_p_value(counts[[1, 2, 3, 5]], weights[[1, 2, 3, 5]] / weights.sum()) > 1e-3


def test_rejection_sample_certain_cases():
    g = torch.Generator().manual_seed(0)
    draft = torch.tensor([3, 1, 4])
    sure = torch.zeros(4, 6)
    sure[0, 3] = sure[1, 1] = sure[2, 4] = 1.0
    sure[3] = torch.tensor([0, 0, 0, 0, 0, 1.0])
    for _ in range(20):  # the verifier is certain of every draft: all accepted, bonus from p[K]
        assert rejection_sample(draft, None, sure, g) == (3, 5)
    never = random_probs(4, 6, g)
    never[0, 3] = 0
    never[0] /= never[0].sum()
    for _ in range(50):  # p(x) = 0: always rejected, and the replacement is never x
        n, token = rejection_sample(draft, None, never, g)
        assert n == 0 and token != 3


# ---------------------------------------------------------------- rejection sampling, distribution


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test; cells with an expected count under 5 are pooled into one."""
    n = counts.sum()
    expected = expected_probs.double().flatten() * n
    counts = counts.double().flatten()
    small = expected < 5
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
    stat = ((counts - expected) ** 2 / expected).sum()
    df = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def toy_tables(V: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    T = torch.softmax(torch.randn(V, V, generator=g), -1)  # verifier
    Q = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)  # drafter: a different distribution
    return T, Q


def toy_counts(full_q: bool, samples: int, verify=rejection_sample) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative decoding on a toy Markov-chain verifier (next-token table T [V, V]) with a toy
    drafter (table Q [V, V]) proposing K=3 tokens: greedy drafts (argmax of Q, one-hot q) or
    sampled drafts (x ~ Q, full q). Counts the first two emitted tokens of `samples` runs and
    returns them with their exact distribution p(a) p(b | a) under the verifier alone."""
    V, K, start = 8, 3, 0
    T, Q = toy_tables(V)
    g, rng = torch.Generator().manual_seed(1234), random.Random(1234)
    Q_cdf, Q_argmax = Q.double().cumsum(-1).tolist(), Q.argmax(-1).tolist()

    @functools.cache
    def pass_inputs(prev: int, drafts: tuple[int, ...]):
        p = T[[prev, *drafts]]  # [K+1, V]: the verifier after prev and after each draft
        q = Q[[prev, *drafts[:-1]]] if full_q else None  # [K, V]: what each draft was drawn from
        return torch.tensor(drafts), q, p

    counts = torch.zeros(V, V)
    for _ in range(samples):
        out, prev = [], start
        while len(out) < 2:
            drafts, ctx = [], prev
            for _ in range(K):
                ctx = min(bisect.bisect_right(Q_cdf[ctx], rng.random()), V - 1) if full_q else Q_argmax[ctx]
                drafts.append(ctx)
            n, nxt = verify(*pass_inputs(prev, tuple(drafts)), g)
            out += drafts[:n] + [nxt]
            prev = out[-1]
        counts[out[0], out[1]] += 1
    return counts, T[start][:, None] * T


@pytest.mark.parametrize("full_q", [False, True], ids=["one-hot-q", "full-q"])
def test_rejection_sampling_output_is_the_verifier_distribution(full_q):
    counts, exact = toy_counts(full_q, 20_000)
    assert chi_square_p_value(counts, exact) > 1e-3


def test_the_distribution_test_can_fail():
    """Accepting every draft (no ratio test) is not lossless: the same test must reject it."""

    def accept_all(draft, q, p, g):
        return draft.shape[0], int(sample_categorical(p[-1], g))

    counts, exact = toy_counts(False, 2_000, verify=accept_all)
    assert chi_square_p_value(counts, exact) < 1e-3


# ---------------------------------------------------------------- temperature / top-p


def brute_temperature_top_p(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    V = logits.shape[0]
    if temperature == 0:
        out = torch.zeros(V)
        out[int(logits.argmax())] = 1
        return out
    probs = torch.softmax(logits.double() / temperature, -1)
    order = sorted(range(V), key=lambda i: -probs[i].item())
    kept, mass = [], 0.0
    for i in order:  # most likely first, until the kept mass reaches top_p
        if mass >= top_p:
            break
        kept.append(i)
        mass += probs[i].item()
    out = torch.zeros(V, dtype=torch.float64)
    out[kept] = probs[kept] / probs[kept].sum()
    return out.float()


def test_temperature_top_p_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 10, generator=g) * 2
    for temperature, top_p in itertools.product([0.0, 0.5, 1.0, 1.7], [0.1, 0.5, 0.9, 1.0]):
        got = apply_temperature_top_p(logits, temperature, top_p)  # [30, 10]
        want = torch.stack([brute_temperature_top_p(row, temperature, top_p) for row in logits])
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert (got.sum(-1) - 1).abs().max() < 1e-5


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert (apply_temperature_top_p(logits, 1.0, 0.5) > 0).tolist() == [True, False, False, False]
    assert (apply_temperature_top_p(logits, 1.0, 0.6) > 0).tolist() == [True, True, False, False]
    assert (apply_temperature_top_p(logits, 1.0, 0.95) > 0).tolist() == [True, True, True, False]
    with pytest.raises(ValueError):
        apply_temperature_top_p(logits, -1.0, 1.0)
    with pytest.raises(ValueError):
        apply_temperature_top_p(logits, 1.0, 0.0)


# ---------------------------------------------------------------- dynamic draft length


def test_confident_draft_length_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        K = int(torch.randint(1, 8, (1,), generator=g))
        confidence = torch.rand(K, generator=g) ** 0.3
        threshold = float(torch.rand(1, generator=g))
        survival, want = 1.0, 0
        for c in confidence.tolist():
            survival *= c
            if survival < threshold:
                break
            want += 1
        assert confident_draft_length(confidence, threshold) == want
    assert confident_draft_length(torch.tensor([0.9, 0.9, 0.9]), 0.0) == 3
    assert confident_draft_length(torch.tensor([0.2, 0.9]), 0.5) == 0
