"""vLLM's online acceptance estimator, mirrored for the embedded engine's adaptive verification.

vLLM (>= 0.32, V2 GPU model runner) cuts the drafts it verifies per step when the speculative
config sets `enable_adaptive_verification`: DSpark through its confidence head, every other
drafter through an estimate of each draft's acceptance read from the drafter's own logits
(vllm/v1/worker/gpu/spec_decode/acceptance_estimator.py in vLLM 0.32, lines cited):

    feature f_k = logit(max_v q_k(v)), clamped to +-40   (_predict_kernel l. 301; _MAX_LOG_ODDS l. 13)
    p_k = sigmoid(slope * f_k + intercept_k)              (l. 308; cold slope 0.5, intercepts -0.2: l. 19-20)
    survival_k = p_0 * ... * p_k                          (adaptive_verification.py l. 64 and 310)

and refits (slope, intercepts) every 100 steps (l. 330) by one damped Newton (IRLS) step on the
drafts the verifier graded since (`_accumulate_kernel` l. 24, `_refit_kernel` l. 92; damping 50
and ridge 1e-3, l. 336-338). vLLM divides the draft logits by a sampled request's temperature
first (l. 199-200); specctl's drafters draft greedily at every temperature, so their logits are
read as they are. The feature scores the draft distribution, not the drawn token, so a cut never
conditions on the token it drops and the output stays the verifier's. vLLM then admits the draft
slots that maximise expected accepted tokens per unit of measured step cost; the embedded engine,
one request at a time, cuts where survival falls below a threshold instead
(`specctl.sampling.confident_draft_length`), as it does with DSpark's confidence head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_LOG_ODDS = 40.0  # vLLM: the feature is clamped to +-this (a one-hot row is infinite)
INIT_SLOPE = 0.5  # vLLM's cold-start coefficients (median fit over five production models)
INIT_BIAS = -0.2
REFIT_INTERVAL = 100  # steps between refits
DAMPING_OBSERVATIONS = 50.0  # a round with this many observations moves a parameter half a Newton step
L2 = 1e-3  # ridge on the Newton solve


def confidence_feature(logits: torch.Tensor) -> torch.Tensor:
    """logits [K, V] of the drafter at each draft position -> [K] log-odds of its most likely
    token, log(q* / (1 - q*)) = -log(sum over the other tokens of exp(z - z*)), clamped."""
    z = logits.float()
    # log sum exp(z - z*) = lse - z*, and the top token contributes exactly exp(0) = 1: the other
    # tokens' mass is expm1(lse - z*) (one fused reduction, 5x faster than exp-and-sum on a CPU)
    others = torch.expm1(torch.logsumexp(z, -1) - z.amax(-1)).clamp(min=0.0)  # [K]
    return (-others.log()).clamp(-MAX_LOG_ODDS, MAX_LOG_ODDS)


def predicted_acceptance(features: torch.Tensor, slope: float, intercepts: torch.Tensor) -> torch.Tensor:
    """features [K], intercepts [>= K] -> [K] predicted per-position acceptance probabilities."""
    K = features.shape[0]
    return torch.sigmoid(slope * features + intercepts[:K])


@dataclass
class RefitStats:
    """The Newton (IRLS) sums of one round, per draft position k (vLLM's `info`, `grad`, `counts`):
    a = sum w f^2, b = sum w f, c = sum w, g0 = sum r f, g1 = sum r, n = observations; w = p(1-p),
    r = label - p over the observed drafts (the accepted ones and the first rejected one)."""

    a: torch.Tensor  # [K] float64
    b: torch.Tensor
    c: torch.Tensor
    g0: torch.Tensor
    g1: torch.Tensor
    n: torch.Tensor

    @classmethod
    def zeros(cls, K: int) -> RefitStats:
        return cls(*(torch.zeros(K, dtype=torch.float64) for _ in range(6)))

    def add(self, features: torch.Tensor, predictions: torch.Tensor, accepted: int) -> None:
        """One verified draft of len(features) tokens, `accepted` of them kept by the verifier."""
        k = features.shape[0]
        observed = min(accepted + 1, k)  # the accepted drafts and the first rejected one
        f = features[:observed].double()
        p = predictions[:observed].double()
        label = (torch.arange(observed) < accepted).double()
        w, r = p * (1 - p), label - p
        for name, value in (("a", w * f * f), ("b", w * f), ("c", w), ("g0", r * f), ("g1", r)):
            getattr(self, name)[:observed] += value
        self.n[:observed] += 1


def newton_step(
    stats: RefitStats,
    slope: float,
    intercepts: torch.Tensor,
    l2: float = L2,
    damping: float = DAMPING_OBSERVATIONS,
) -> tuple[float, torch.Tensor]:
    """One damped Newton step for (slope, intercepts [K]) from a round's sums, as vLLM's
    `_refit_kernel`: solve the arrowhead system (X'WX + l2 I) d = X'r for the shared slope and the
    per-position intercepts, damp the slope by N / (N + damping) (N all observations) and each
    intercept by n_k / (n_k + damping); a step that is NaN or would make the slope negative is 0."""
    c = stats.c + l2  # [K]
    a = stats.a.sum() + l2
    step_w = (stats.g0.sum() - (stats.b * stats.g1 / c).sum()) / (a - (stats.b**2 / c).sum())
    total = stats.n.sum()
    step_w = step_w * total / (total + damping) if damping else step_w
    step_w = step_w if bool(torch.isfinite(step_w)) and slope + float(step_w) >= 0 else torch.zeros(())
    step_b = (stats.g1 - stats.b * step_w) / c
    if damping:
        step_b = step_b * stats.n / (stats.n + damping)
    step_b = torch.where(torch.isnan(step_b), torch.zeros_like(step_b), step_b)
    return slope + float(step_w), (intercepts.double() + step_b).float()


@dataclass
class AcceptanceEstimator:
    """vLLM's estimator for one engine: predict each draft's acceptance from the drafter's logits,
    learn from what the verifier kept, refit every REFIT_INTERVAL verified drafts. The embedded
    backend keeps one per configuration for the whole run, as vLLM keeps one per engine."""

    num_positions: int
    slope: float = INIT_SLOPE
    intercepts: torch.Tensor = field(default=None)  # type: ignore[assignment]  # [K]
    refits: int = 0

    def __post_init__(self) -> None:
        if self.intercepts is None:
            self.intercepts = torch.full((self.num_positions,), INIT_BIAS)
        self.stats = RefitStats.zeros(self.num_positions)
        self.steps = 0

    def confidences(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [k, V] -> (features [k], predicted acceptances [k]) on the CPU."""
        features = confidence_feature(logits.detach()).cpu()
        return features, predicted_acceptance(features, self.slope, self.intercepts)

    def observe(self, features: torch.Tensor, predictions: torch.Tensor, accepted: int) -> None:
        """The verifier kept `accepted` of the len(features) drafts it verified."""
        if features.numel() == 0:
            return
        self.stats.add(features, predictions, accepted)
        self.steps += 1
        if self.steps % REFIT_INTERVAL == 0:
            self.slope, self.intercepts = newton_step(self.stats, self.slope, self.intercepts)
            self.stats = RefitStats.zeros(self.num_positions)
            self.refits += 1
