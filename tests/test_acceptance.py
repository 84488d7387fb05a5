"""vLLM's online acceptance estimator as the embedded engine mirrors it (specctl.acceptance): the
feature, the prediction, the Newton sums and step, each against a brute-force reference, and the
adaptive cut they feed (specctl.sampling.confident_draft_length) on drafter logits."""

from __future__ import annotations

import math

import pytest
import torch

from specctl.acceptance import (
    INIT_BIAS,
    INIT_SLOPE,
    MAX_LOG_ODDS,
    REFIT_INTERVAL,
    AcceptanceEstimator,
    RefitStats,
    confidence_feature,
    newton_step,
    predicted_acceptance,
)
from specctl.sampling import confident_draft_length


def test_feature_is_the_log_odds_of_the_top_token():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * torch.tensor([0.1, 1, 3, 6, 10, 20])[:, None]
    got = confidence_feature(logits)
    for k in range(6):
        q = [math.exp(x) for x in logits[k].double().tolist()]
        top = max(q) / sum(q)
        want = math.log(top / (1 - top)) if top < 1 else MAX_LOG_ODDS
        assert got[k].item() == pytest.approx(max(-MAX_LOG_ODDS, min(MAX_LOG_ODDS, want)), rel=1e-4, abs=1e-4)
    one_hot = torch.full((1, 8), -1e9)
    one_hot[0, 3] = 0.0
    assert confidence_feature(one_hot).item() == MAX_LOG_ODDS  # infinite odds, clamped as vLLM does
    assert confidence_feature(torch.zeros(1, 5)).item() == pytest.approx(math.log(0.2 / 0.8), rel=1e-5)


def test_prediction_and_cold_start_cut():
    """Cold start (vLLM's slope 0.5, intercepts -0.2): confident logits keep drafts, flat ones cut."""
    features = torch.tensor([6.0, 4.0, -1.0, 5.0])
    p = predicted_acceptance(features, INIT_SLOPE, torch.full((4,), INIT_BIAS))
    want = [1 / (1 + math.exp(-(0.5 * f - 0.2))) for f in features.tolist()]
    assert p.tolist() == pytest.approx(want, rel=1e-6)
    survival = [math.prod(want[: i + 1]) for i in range(4)]
    for threshold in (0.05, 0.3, 0.6, 0.8, 0.95):
        brute = next((i for i, s in enumerate(survival) if s < threshold), 4)
        assert confident_draft_length(p, threshold) == brute


def brute_sums(rows: list[tuple[list[float], list[float], int]], K: int) -> dict[str, list[float]]:
    out = {name: [0.0] * K for name in ("a", "b", "c", "g0", "g1", "n")}
    for features, predictions, accepted in rows:
        for i, (f, p) in enumerate(zip(features, predictions, strict=True)):
            if i > accepted:  # observed: the accepted drafts and the first rejected one
                break
            w, r = p * (1 - p), (1.0 if i < accepted else 0.0) - p
            for name, v in (("a", w * f * f), ("b", w * f), ("c", w), ("g0", r * f), ("g1", r), ("n", 1)):
                out[name][i] += v
    return out


def test_refit_sums_match_brute_force():
    g = torch.Generator().manual_seed(1)
    K = 5
    stats = RefitStats.zeros(K)
    rows = []
    for _ in range(40):
        k = int(torch.randint(1, K + 1, (1,), generator=g))
        f = torch.randn(k, generator=g) * 3
        p = torch.rand(k, generator=g)
        accepted = int(torch.randint(0, k + 1, (1,), generator=g))
        stats.add(f, p, accepted)
        rows.append((f.double().tolist(), p.double().tolist(), accepted))
    want = brute_sums(rows, K)
    for name, values in want.items():
        assert getattr(stats, name).tolist() == pytest.approx(values, rel=1e-9, abs=1e-9), name


def test_undamped_newton_step_solves_the_full_system():
    """With no damping the step is the solution of (X'WX + l2 I) d = X'r, the arrowhead system
    solved densely here; damping scales the slope by N/(N+D) and each intercept by n/(n+D)."""
    g = torch.Generator().manual_seed(2)
    K = 4
    stats = RefitStats.zeros(K)
    for _ in range(60):
        f, p = torch.randn(K, generator=g) * 2, torch.rand(K, generator=g) * 0.8 + 0.1
        stats.add(f, p, int(torch.randint(0, K + 1, (1,), generator=g)))
    slope, intercepts, l2 = 0.5, torch.full((K,), -0.2), 1e-3
    A = torch.zeros(K + 1, K + 1, dtype=torch.float64)
    A[0, 0] = stats.a.sum() + l2
    A[0, 1:] = A[1:, 0] = stats.b
    A[1:, 1:] = torch.diag(stats.c + l2)
    d = torch.linalg.solve(A, torch.cat([stats.g0.sum()[None], stats.g1]))
    new_slope, new_b = newton_step(stats, slope, intercepts, l2, damping=0.0)
    assert new_slope - slope == pytest.approx(float(d[0]), rel=1e-6)
    assert (new_b - intercepts).tolist() == pytest.approx(d[1:].tolist(), rel=1e-5, abs=1e-7)
    damped_slope, damped_b = newton_step(stats, slope, intercepts, l2, damping=50.0)
    N = float(stats.n.sum())
    step_w = float(d[0]) * N / (N + 50)
    assert damped_slope - slope == pytest.approx(step_w, rel=1e-6)
    want_b = (stats.g1 - stats.b * step_w) / (stats.c + l2) * stats.n / (stats.n + 50)
    assert (damped_b - intercepts).tolist() == pytest.approx(want_b.tolist(), rel=1e-5, abs=1e-7)


def test_a_step_that_would_make_the_slope_negative_is_dropped():
    stats = RefitStats.zeros(1)
    for _ in range(200):  # confident features, always rejected: the fit wants a negative slope
        stats.add(torch.tensor([5.0]), torch.tensor([0.9]), 0)
    slope, _ = newton_step(stats, 0.01, torch.zeros(1), damping=0.0)
    assert slope == 0.01


def test_estimator_learns_from_what_the_verifier_keeps():
    """Drafts at position 0 always accepted, at position 1 never, whatever the feature: after a
    refit the intercepts move apart (position 0 up, position 1 down), as vLLM's fit would."""
    est = AcceptanceEstimator(2)
    logits = torch.tensor([[4.0, 0.0, 0.0], [4.0, 0.0, 0.0]])
    for _ in range(REFIT_INTERVAL):
        features, predictions = est.confidences(logits)
        est.observe(features, predictions, 1)
    assert est.refits == 1
    assert est.intercepts[0] > INIT_BIAS > est.intercepts[1]
    after = est.confidences(logits)[1]
    assert after[0] > 0.5 > after[1]
