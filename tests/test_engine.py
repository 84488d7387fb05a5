"""The embedded engine: lossless with every drafter, counters with vLLM's meaning, KV-cache and
feature bookkeeping, sampling in distribution, DSpark's dynamic draft length, EOS and limits."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny_verifier
from test_sampling import chi_square_p_value

from specctl.counters import SpecCounters
from specctl.drafters import DRAFTERS
from specctl.drafters.api import ConfidenceDrafter, Drafter, VerifierWeights, greedy_propose
from specctl.engine import default_num_speculative_tokens, generate
from specctl.sampling import apply_temperature_top_p
from specctl.verifier import capture_hidden_states, spec_from_config

AUX_IDS = (1, 2, 3)  # of the 4-layer tiny verifier
PROMPT = [1, 40, 77, 250, 13, 9, 101, 202, 31, 64, 5, 128]
NEW = 40


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def varied_verifier(kind: str = "llama", vocab_size: int = 320, scale: float = 8.0):
    """A tiny random verifier with its matrices scaled up: sharper distributions whose greedy
    continuation does not collapse into a 4-token loop, so drafts are checked on varied text."""
    model = make_tiny_verifier(kind, vocab_size=vocab_size)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return model


@pytest.fixture(scope="module")
def verifier():
    return varied_verifier()


def hf_generate_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF generate(do_sample=False) without EOS. The explicit all-ones attention mask matters:
    without it HF infers one from pad_token_id and hides every prompt token equal to it (for
    SmolLM2, pad = <|im_end|>, which every chat prompt contains)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def hf_greedy(verifier) -> list[int]:
    return hf_generate_greedy(verifier, PROMPT, NEW)


@pytest.fixture(scope="module")
def reference(verifier) -> list[int]:
    """Plain greedy decoding with the engine (no drafter)."""
    return generate(verifier, None, PROMPT, NEW).tokens


def build_drafter(name: str, model, **config):
    spec = spec_from_config(model.config, "tiny", AUX_IDS, model.config.vocab_size - 1)
    weights = VerifierWeights(
        embed_tokens=model.get_input_embeddings().weight,
        lm_head=model.get_output_embeddings().weight,
        norm=model.model.norm.weight,
    )
    cls = DRAFTERS[name].config_cls
    if "num_layers" in cls.model_fields:
        config = {"num_layers": 1, **config}
    torch.manual_seed(0)
    return DRAFTERS[name].build(cls(**config), spec, weights, None, "kl").eval()


class ScriptedDrafter:
    """Test double: proposes the verifier's known greedy continuation, with the draft at
    (proposal step, position) replaced by another token wherever `wrong` says so. Checks what
    the engine hands it: the verified sequence and one feature row per verified position.
    A whole `ConfidenceDrafter` (without a head module: adaptive verification reads its logits);
    the members the engine never calls raise."""

    algo = "scripted"
    d2t = None  # drafts in the verifier's vocabulary
    confidence_head = None

    def __init__(self, sequence: list[int], vocab_size: int, wrong=lambda step, i: False, confidence=None):
        self.verifier = SimpleNamespace(aux_layer_ids=AUX_IDS)
        self.sequence = list(sequence)
        self.vocab_size = vocab_size
        self.wrong = wrong
        self.confidence = confidence  # [K] per-position confidences to report, or None
        self.features: list[torch.Tensor] = []  # aux_hidden_states of each call
        self.first_wrong: list[int] = []  # per call: index of the first wrong draft (= K when none)

    def drafts(
        self, input_ids: torch.Tensor, aux_hidden_states: torch.Tensor, num_tokens: int
    ) -> torch.Tensor:
        N = aux_hidden_states.shape[0]
        assert input_ids.tolist() == self.sequence[: N + 1]
        step = len(self.features)
        self.features.append(aux_hidden_states.clone())
        truth = self.sequence[N + 1 : N + 1 + num_tokens]
        assert len(truth) == num_tokens, "the engine drafted past max_new_tokens"
        wrong = [self.wrong(step, i) for i in range(num_tokens)]
        self.first_wrong.append(wrong.index(True) if True in wrong else num_tokens)
        return torch.tensor(
            [(t + 1) % self.vocab_size if w else t for t, w in zip(truth, wrong, strict=True)]
        )

    def propose_with_logits(self, input_ids, aux_hidden_states, num_tokens, state=None):
        drafts = self.drafts(input_ids, aux_hidden_states, num_tokens)
        return drafts, torch.nn.functional.one_hot(drafts, self.vocab_size).float()

    def propose_with_confidence(self, input_ids, aux_hidden_states, num_tokens, state=None):
        drafts = self.drafts(input_ids, aux_hidden_states, num_tokens)
        return drafts, None if self.confidence is None else torch.tensor(self.confidence[:num_tokens])

    def _unused(self, *args):
        raise NotImplementedError("a scripted drafter neither trains nor has a file")

    forward = export_state = export_config = load_export_state = adopt_embeddings = _unused


def scripted(verifier, reference, **kw) -> ScriptedDrafter:
    return ScriptedDrafter(PROMPT + reference, verifier.config.vocab_size, **kw)


# ---------------------------------------------------------------- plain decoding


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_plain_greedy_matches_hf_generate(kind):
    model = varied_verifier(kind)
    result = generate(model, None, PROMPT, NEW)
    assert result.tokens == hf_generate_greedy(model, PROMPT, NEW)
    assert len(set(result.tokens)) > 10  # varied text, not a loop
    assert result.counters.num_drafts == 0 and result.counters.acceptance_length == 1.0
    assert result.wall_s > 0 and result.tokens_per_s > 0


def test_generate_takes_a_loaded_verifier(tiny_verifier_dir):
    from specctl.recipe import VerifierSection
    from specctl.verifier import load_verifier

    loaded = load_verifier(
        VerifierSection(name_or_path=str(tiny_verifier_dir), device="cpu", dtype="float32")
    )
    assert generate(loaded, None, PROMPT, 8).tokens == generate(loaded.model, None, PROMPT, 8).tokens


def test_bad_arguments():
    model = make_tiny_verifier()
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, None, PROMPT, 0)
    with pytest.raises(ValueError, match="empty"):
        generate(model, None, [], 4)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, None, PROMPT, 4, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        generate(model, fixed_drafter([1]), PROMPT, 4, num_speculative_tokens=0)


# ---------------------------------------------------------------- greedy losslessness


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_greedy_is_lossless_with_every_registered_drafter(name, verifier, reference, hf_greedy):
    drafter = build_drafter(name, verifier)
    for k in (3, None):  # None: the K the drafter exports
        result = generate(verifier, drafter, PROMPT, NEW, num_speculative_tokens=k)
        assert result.tokens == reference == hf_greedy
        c = result.counters
        K = k or default_num_speculative_tokens(drafter)
        assert len(c.accepted_per_position) == K
        assert c.num_drafts > 0 and c.num_drafts <= c.num_draft_tokens <= K * c.num_drafts
        assert c.num_accepted_tokens == sum(c.accepted_per_position)
        # every pass emits accepted + 1 tokens; the first token comes from the prefill
        plain_steps = NEW - 1 - c.num_drafts - c.num_accepted_tokens
        assert plain_steps >= 0


def test_oracle_drafter_accepts_every_draft_and_gets_exact_features(verifier, reference):
    K, steps = 4, 7
    drafter = scripted(verifier, reference)
    result = generate(verifier, drafter, PROMPT, 1 + steps * (K + 1), num_speculative_tokens=K)
    assert result.tokens == reference[: 1 + steps * (K + 1)]
    c = result.counters
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (steps, steps * K, steps * K)
    assert c.accepted_per_position == [steps] * K and c.acceptance_length == K + 1
    # the features the drafter saw are the verifier's own hidden states of the verified prefix,
    # collected from the cached passes without recomputing it
    full, _ = capture_hidden_states(verifier, torch.tensor([PROMPT + reference]), None, AUX_IDS)
    assert [f.shape[0] for f in drafter.features] == [len(PROMPT) + s * (K + 1) for s in range(steps)]
    for f in drafter.features:
        torch.testing.assert_close(f, full[0, : f.shape[0]], rtol=1e-4, atol=1e-4)


def test_wrong_drafter_gets_tau_one(verifier, reference):
    K, n = 3, 20
    result = generate(
        verifier, scripted(verifier, reference, wrong=lambda s, i: True), PROMPT, n, num_speculative_tokens=K
    )
    assert result.tokens == reference[:n]
    c = result.counters
    assert c.acceptance_length == 1.0 and c.num_accepted_tokens == 0 and c.accepted_per_position == [0] * K
    assert c.num_drafts == n - 2  # one token per pass; no draft for the first and the last token
    assert c.num_draft_tokens == sum(min(K, n - 1 - i) for i in range(1, n - 1))


def test_counters_of_a_hand_computed_case(verifier, reference):
    """K=3, 10 tokens. Prefill: 1 token. Step 0 all right: 4 tokens. Step 1 draft 0 wrong: 1
    token. Step 2 draft 2 wrong: 3 tokens. 1 token left: a plain step, no draft."""
    pattern = {(1, 0), (2, 2)}
    drafter = scripted(verifier, reference, wrong=lambda s, i: (s, i) in pattern)
    result = generate(verifier, drafter, PROMPT, 10, num_speculative_tokens=3)
    assert result.tokens == reference[:10]
    c = result.counters
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (3, 9, 5)
    assert c.accepted_per_position == [2, 2, 1]
    assert c.acceptance_length == pytest.approx(1 + 5 / 3)
    assert c.acceptance_rate_per_position == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert len(drafter.features) == 3
    # one time per verifier step (prefill, 3 drafting steps, the plain last one), in order, within
    # the wall time: the chunks a streaming server would have sent (bench's TTFT / ITL / TPOT)
    times = result.step_times_s
    assert len(times) == 5 and times == sorted(times) and times[0] > 0 and times[-1] <= result.wall_s
    plain = generate(verifier, None, PROMPT, 6)
    assert len(plain.step_times_s) == 6  # plain decoding: a step per token


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_partial_acceptance_is_lossless(verifier, reference, seed):
    """Random rejections at every position: the KV cache is cropped by every possible amount."""
    rng = random.Random(seed)
    wrong_at = {(s, i) for s in range(NEW) for i in range(5) if rng.random() < 0.25}
    drafter = scripted(verifier, reference, wrong=lambda s, i: (s, i) in wrong_at)
    result = generate(verifier, drafter, PROMPT, NEW, num_speculative_tokens=5)
    assert result.tokens == reference
    assert result.counters.num_accepted_tokens == sum(drafter.first_wrong)
    full, _ = capture_hidden_states(verifier, torch.tensor([PROMPT + reference]), None, AUX_IDS)
    for f in drafter.features:
        torch.testing.assert_close(f, full[0, : f.shape[0]], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("max_new", [1, 2, 3, 7, 11])
def test_never_more_than_max_new_tokens(verifier, reference, max_new):
    K = 4
    result = generate(verifier, scripted(verifier, reference), PROMPT, max_new, num_speculative_tokens=K)
    assert result.tokens == reference[:max_new]
    left, drafts = max_new - 1, 0  # after the prefill token
    while left >= 2:  # a drafted pass needs room for a draft and the verifier's token
        left -= min(K + 1, left)
        drafts += 1
    assert result.counters.num_drafts == drafts


def test_eos_stops_generation(verifier, reference):
    eos = reference[9]
    stop = reference.index(eos)
    want = reference[: stop + 1]  # the EOS token is part of the output
    assert generate(verifier, None, PROMPT, NEW, eos_token_ids=[eos]).tokens == want
    # inside an accepted block: the accepted drafts after EOS are dropped
    oracle = generate(
        verifier,
        scripted(verifier, reference),
        PROMPT,
        NEW,
        num_speculative_tokens=6,
        eos_token_ids=[eos, 100_000],
    )
    assert oracle.tokens == want
    # counted as vLLM does, before EOS truncates: the whole last block was accepted
    assert oracle.counters.num_drafts == -(-stop // 7)
    assert oracle.counters.num_accepted_tokens == 6 * oracle.counters.num_drafts
    drafter = build_drafter("dflash", verifier) if "dflash" in DRAFTERS else None
    assert (
        generate(verifier, drafter, PROMPT, NEW, num_speculative_tokens=3, eos_token_ids=[eos]).tokens == want
    )


# ---------------------------------------------------------------- sampling


def fixed_drafter(tokens: list[int], aux_layer_ids: tuple[int, ...] = AUX_IDS) -> SimpleNamespace:
    """Test double that always proposes the same tokens (a one-hot q)."""
    return SimpleNamespace(
        verifier=SimpleNamespace(aux_layer_ids=aux_layer_ids),
        propose_with_logits=lambda ids, aux, k, state=None: (torch.tensor(tokens[:k]), None),
    )


def test_sampling_is_seeded():
    model = varied_verifier(scale=1.0)  # flat distributions: samples differ between seeds
    drafter = fixed_drafter([7, 8, 9])
    a, b, c = (
        generate(model, drafter, PROMPT, 24, temperature=1.0, top_p=0.9, seed=seed, num_speculative_tokens=3)
        for seed in (5, 5, 6)
    )
    assert a.tokens == b.tokens and a.counters == b.counters
    assert a.tokens != c.tokens


def test_near_zero_top_p_sampling_is_greedy_with_full_acceptance(verifier, reference):
    """top_p -> 0 leaves only the argmax: the rejection test then accepts exactly the greedy drafts."""
    K, steps = 4, 5
    n = 1 + steps * (K + 1)
    result = generate(
        verifier,
        scripted(verifier, reference),
        PROMPT,
        n,
        temperature=0.7,
        top_p=1e-6,
        num_speculative_tokens=K,
    )
    assert result.tokens == reference[:n] and result.counters.acceptance_length == K + 1
    wrong = generate(
        verifier,
        scripted(verifier, reference, wrong=lambda s, i: i == 1),
        PROMPT,
        n,
        temperature=0.7,
        top_p=1e-6,
        num_speculative_tokens=K,
    )
    assert wrong.tokens == reference[:n] and wrong.counters.accepted_per_position[1:] == [0] * (K - 1)


def sampled_counts(samples: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Counts of the first three tokens of `samples` seeded runs (V=4 one-layer verifier, T=1,
    top-p 0.95, a drafter that always proposes [2, 0]), their exact distribution under the
    verifier alone (full forwards, no cache), and the drafts accepted on the way."""
    model = make_tiny_verifier(num_layers=1, vocab_size=4)
    with torch.no_grad():  # sharp distributions that depend strongly on the previous token
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(6.0)
        model.get_input_embeddings().weight.mul_(20.0)
    drafter = fixed_drafter([2, 0], aux_layer_ids=(1,))
    prompt, T, top_p = [1, 3, 0, 2, 3], 1.0, 0.95
    counts, accepted = torch.zeros(4, 4, 4), 0
    for seed in range(samples):
        r = generate(
            model, drafter, prompt, 4, temperature=T, top_p=top_p, seed=seed, num_speculative_tokens=2
        )
        counts[tuple(r.tokens[:3])] += 1
        accepted += r.counters.num_accepted_tokens
    with torch.no_grad():
        p1 = apply_temperature_top_p(model(torch.tensor([prompt])).logits[0, -1], T, top_p)  # [a]
        logits = model(
            torch.tensor([prompt + [a, b] for a in range(4) for b in range(4)])
        ).logits  # [16, P+2, 4]
        p2 = apply_temperature_top_p(logits[:, -2], T, top_p).view(4, 4, 4)[:, 0]  # [a, b]
        p3 = apply_temperature_top_p(logits[:, -1], T, top_p).view(4, 4, 4)  # [a, b, c]
    return counts, p1[:, None, None] * p2[:, :, None] * p3, accepted


def test_sampled_output_follows_the_verifier_distribution():
    """The first token is sampled after the prefill, the next ones by verification: row 0
    (accept or residual), row 1 after an accepted draft, or the bonus token. Their joint
    distribution must be the verifier's own (chi-square over 64 cells)."""
    samples = 1000
    counts, exact, accepted = sampled_counts(samples)
    assert accepted > 0.3 * samples  # drafts were accepted often enough to matter
    assert chi_square_p_value(counts, exact) > 1e-3


# ---------------------------------------------------------------- DSpark's dynamic draft length


def test_confidence_cut_with_scripted_confidences(verifier, reference):
    """Confidences [.9, .9, .1, ...] at threshold 0.5: survival .9, .81, .081 -> 2 drafts a pass."""
    K = 5
    drafter = scripted(verifier, reference, confidence=[0.9, 0.9, 0.1, 0.9, 0.9])
    full = generate(verifier, drafter, PROMPT, NEW, num_speculative_tokens=K)
    cut = generate(verifier, drafter, PROMPT, NEW, num_speculative_tokens=K, confidence_threshold=0.5)
    assert cut.tokens == full.tokens == reference
    assert cut.counters.num_draft_tokens == 2 * cut.counters.num_drafts
    assert cut.counters.acceptance_length == 3.0 and cut.counters.accepted_per_position[2:] == [0] * 3
    assert full.counters.acceptance_length > 5.0


@pytest.mark.skipif("dspark" not in DRAFTERS, reason="dspark drafter not in this checkout")
def test_dspark_dynamic_cut_reduces_draft_tokens_not_output(verifier, reference):
    drafter = build_drafter("dspark", verifier)
    K = 5
    full = generate(verifier, drafter, PROMPT, NEW, num_speculative_tokens=K)
    same = generate(verifier, drafter, PROMPT, NEW, num_speculative_tokens=K, confidence_threshold=0.0)
    cut = generate(verifier, drafter, PROMPT, NEW, num_speculative_tokens=K, confidence_threshold=0.3)
    assert full.tokens == same.tokens == cut.tokens == reference
    assert same.counters == full.counters
    assert cut.counters.num_draft_tokens < full.counters.num_draft_tokens
    without_head = build_drafter("dspark", verifier, enable_confidence_head=False)
    with pytest.raises(ValueError, match="confidence head"):
        generate(verifier, without_head, PROMPT, 8, num_speculative_tokens=K, confidence_threshold=0.3)


def test_confidence_cut_needs_a_confidence_drafter(verifier, reference):
    with pytest.raises(ValueError, match="confidence"):
        generate(
            verifier, fixed_drafter([1, 2]), PROMPT, 8, num_speculative_tokens=2, confidence_threshold=0.5
        )


# ---------------------------------------------------------------- adaptive verification


class LogitsDrafter(ScriptedDrafter):
    """Scripted drafts with the logits a drafter would report: sharp (10 on the draft, 0 elsewhere)
    where the draft is right, flat where it is wrong -- what the estimator can tell apart."""

    def propose_with_logits(self, input_ids, aux_hidden_states, num_tokens, state=None):
        drafts = self.drafts(input_ids, aux_hidden_states, num_tokens)
        logits = torch.zeros(num_tokens, self.vocab_size)
        for i in range(self.first_wrong[-1]):
            logits[i, drafts[i]] = 10.0
        return drafts, logits


def test_adaptive_cut_drafts_fewer_tokens_per_accepted_token(verifier, reference):
    """Right for 2 positions (sharp logits), wrong after (flat): fixed K=5 verifies 5 drafts to keep
    2; the estimator's cold-start survival .87, .76, .03 cuts at 2 (threshold .5), same output."""
    K = 5
    make = lambda: LogitsDrafter(PROMPT + reference, verifier.config.vocab_size, wrong=lambda s, i: i >= 2)  # noqa: E731
    fixed = generate(verifier, make(), PROMPT, NEW, num_speculative_tokens=K)
    adaptive = generate(verifier, make(), PROMPT, NEW, num_speculative_tokens=K, adaptive_threshold=0.5)
    assert adaptive.tokens == fixed.tokens == reference
    f, a = fixed.counters, adaptive.counters
    assert f.acceptance_length == a.acceptance_length == 3.0 and f.num_drafts == a.num_drafts
    assert a.accepted_per_position[:2] == [a.num_drafts] * 2  # every verified draft was kept
    assert a.num_draft_tokens == a.num_accepted_tokens  # 1 drafted token per accepted one
    assert f.num_draft_tokens >= 2 * f.num_accepted_tokens  # fixed K: 5 drafted per 2 accepted


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_adaptive_is_lossless_with_every_registered_drafter(name, verifier, reference):
    drafter = build_drafter(name, verifier)
    full = generate(verifier, drafter, PROMPT, NEW, num_speculative_tokens=3)
    cut = generate(verifier, drafter, PROMPT, NEW, num_speculative_tokens=3, adaptive_threshold=0.3)
    assert cut.tokens == full.tokens == reference
    assert cut.counters.num_draft_tokens <= full.counters.num_draft_tokens
    ids, aux = torch.tensor(PROMPT), torch.randn(len(PROMPT) - 1, len(AUX_IDS), 64)
    drafts, logits = drafter.propose_with_logits(ids, aux, 3)
    assert torch.equal(greedy_propose(drafter, ids, aux, 3), drafts) and logits.shape[0] == 3
    assert isinstance(drafter, Drafter)  # the contract, checked at runtime
    if isinstance(drafter, ConfidenceDrafter):  # its confidence path drafts the same greedy tokens
        assert torch.equal(drafter.propose_with_confidence(ids, aux, 3)[0], drafts)
    if name == "dspark":  # its confidence head decides, as in vLLM
        head = generate(verifier, drafter, PROMPT, NEW, num_speculative_tokens=3, confidence_threshold=0.3)
        assert head.counters == cut.counters


def test_adaptive_estimator_lives_across_requests(verifier, reference):
    from specctl.acceptance import AcceptanceEstimator

    est = AcceptanceEstimator(4)
    drafter = LogitsDrafter(PROMPT + reference, verifier.config.vocab_size, wrong=lambda s, i: i >= 1)
    generate(verifier, drafter, PROMPT, 20, num_speculative_tokens=4, adaptive_threshold=0.5, estimator=est)
    assert est.steps > 0 and est.stats.n[0] == est.steps  # every verified draft was graded
    with pytest.raises(ValueError, match="not both"):
        generate(verifier, drafter, PROMPT, 4, adaptive_threshold=0.5, confidence_threshold=0.5)
    with pytest.raises(ValueError, match="logits"):
        generate(verifier, fixed_drafter([1, 2]), PROMPT, 4, num_speculative_tokens=2, adaptive_threshold=0.5)
    with pytest.raises(ValueError, match="positions"):
        generate(
            verifier,
            drafter,
            PROMPT,
            4,
            num_speculative_tokens=5,
            adaptive_threshold=0.1,
            estimator=est,
        )


# ---------------------------------------------------------------- counters


def test_counters_merge_and_report():
    a = SpecCounters(2, 6, 3, [2, 1, 0])
    b = SpecCounters(1, 2, 2, [1, 1])
    m = SpecCounters.merge([a, b])
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens, m.accepted_per_position) == (
        3,
        8,
        5,
        [3, 2, 0],
    )
    assert m.acceptance_length == pytest.approx(1 + 5 / 3)
    assert SpecCounters.merge([]).acceptance_length == 1.0
    assert m.to_dict()["acceptance_length"] == m.acceptance_length
    c = SpecCounters(accepted_per_position=[0, 0])
    c.record(2, 1)
    c.record(4, 3)  # a longer draft widens the per-position list
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, c.accepted_per_position) == (
        2,
        6,
        4,
        [2, 1, 1, 0],
    )


# ---------------------------------------------------------------- drafter state between proposals


@pytest.mark.parametrize("algo", sorted(DRAFTERS))
def test_propose_with_state_equals_recomputing_the_context(verifier, algo):
    """The per-request `state` lets a drafter keep its work on the verified prefix (DFlash/DSpark:
    context K/V, EAGLE-3/P-EAGLE: their context rows' K/V); drafts must be what a from-scratch proposal
    gives at every step, as the prefix grows by 1..4 tokens (accepted drafts + bonus)."""
    drafter = build_drafter(algo, verifier, num_layers=2)
    with torch.no_grad():  # untrained drafters propose varied tokens once their weights are scaled
        for p in drafter.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (64,), generator=g)
    aux = torch.randn(64, len(AUX_IDS), 64, generator=g)
    K = min(3, default_num_speculative_tokens(drafter))
    state: dict = {}
    N, drafts = 5, []
    while N < 60:
        cached = greedy_propose(drafter, ids[: N + 1], aux[:N], K, state=state)
        fresh = greedy_propose(drafter, ids[: N + 1], aux[:N], K)
        assert cached.tolist() == fresh.tolist(), (algo, N)
        drafts.append(cached.tolist())
        N += int(torch.randint(1, 5, (1,), generator=g))
    assert len({tuple(d) for d in drafts}) > 3  # the check saw varied drafts, not one repeated block
    assert state["context_rows"] > 50  # the cache followed the prefix


def test_a_state_from_a_longer_prefix_is_refused(verifier):
    drafter = build_drafter("dflash", verifier)
    ids, aux = torch.randint(0, 300, (20,)), torch.randn(19, len(AUX_IDS), 64)
    state: dict = {}
    greedy_propose(drafter, ids, aux, 2, state=state)
    with pytest.raises(ValueError, match="new state per request"):
        greedy_propose(drafter, ids[:10], aux[:9], 2, state=state)
