"""Tree verification in the embedded engine (`generate(..., tree_nodes=N)`): greedy outputs are
plain decoding's, token for token, on tiny random verifiers and on SmolLM2; the KV cache and the
drafter's features after a partially accepted tree are those of plain decoding of the kept
tokens; sampled outputs follow the verifier's distribution."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny_verifier
from test_engine import AUX_IDS, NEW, PROMPT, build_drafter, varied_verifier
from test_sampling import chi_square_p_value

from specctl.engine import _Sampling, _verify_tree, generate
from specctl.sampling import apply_temperature_top_p
from specctl.trees import DraftTree
from specctl.verifier import capture_hidden_states, use_gqa_sdpa

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def verifier():
    model = varied_verifier()
    use_gqa_sdpa(model)
    return model


@pytest.fixture(scope="module")
def reference(verifier) -> list[int]:
    return generate(verifier, None, PROMPT, NEW).tokens


class RankedBlockDrafter:
    """Test double of a parallel drafter: block logits [k, V] that put the verifier's known
    greedy continuation at rank `rank(step, i)` at block position i (None: not in the top 3), so
    a tree finds it off the argmax. Records the features the engine hands it.

    strict (the default) asserts that the engine's context is the known sequence. With
    strict=False a context that left it (a bf16 near-tie on a CPU without AMX: the verifier's own
    argmax moved) gets a block of arbitrary guesses, so the run goes on to its end and the test
    can judge the first divergence instead of stopping inside the drafter."""

    algo = "ranked-block"  # not a registered algorithm: the engine takes its block as parallel
    d2t = None  # drafts in the verifier's vocabulary

    def __init__(
        self, sequence: list[int], vocab_size: int, rank=lambda step, i: 0, aux_layer_ids=AUX_IDS, strict=True
    ):
        self.verifier = SimpleNamespace(aux_layer_ids=aux_layer_ids)
        self.sequence, self.vocab_size, self.rank, self.strict = list(sequence), vocab_size, rank, strict
        self.features: list[torch.Tensor] = []

    def propose_with_logits(self, input_ids, aux_hidden_states, num_tokens, state=None):
        N = aux_hidden_states.shape[0]
        on_sequence = input_ids.tolist() == self.sequence[: N + 1]
        assert on_sequence or not self.strict
        step = len(self.features)
        self.features.append(aux_hidden_states.clone())
        logits = torch.zeros(num_tokens, self.vocab_size)
        guesses = [(int(input_ids[-1]) + 1 + i) % self.vocab_size for i in range(num_tokens)]
        for i, truth in enumerate(self.sequence[N + 1 : N + 1 + num_tokens] if on_sequence else guesses):
            others = [(truth + j) % self.vocab_size for j in range(1, 4)]  # ranks 0..2 when truth is not
            r = self.rank(step, i)
            ranked = others[:r] + [truth] + others[r:] if r is not None else others
            for j, t in enumerate(ranked[:3]):
                logits[i, t] = 6.0 - j  # rank j
        return logits.argmax(-1), logits

    def propose(self, input_ids, aux_hidden_states, num_tokens, state=None):
        """The block's argmax chain: what chain verification drafts from the same logits."""
        return self.propose_with_logits(input_ids, aux_hidden_states, num_tokens, state)[0]


def ranked(verifier, reference, **kw) -> RankedBlockDrafter:
    return RankedBlockDrafter(PROMPT + reference, verifier.config.vocab_size, **kw)


@pytest.mark.parametrize("nodes", [1, 4, 12, 31])
def test_tree_greedy_equals_plain_decoding_when_the_truth_is_off_the_argmax(verifier, reference, nodes):
    """The truth sits at rank 0, 1 or 2 by position and step: the accepted path leaves the argmax
    chain, the cache keeps an off-chain path, and the output is still plain decoding's."""
    drafter = ranked(verifier, reference, rank=lambda s, i: (s + i) % 3)
    result = generate(verifier, drafter, PROMPT, NEW, num_speculative_tokens=4, tree_nodes=nodes)
    assert result.tokens == reference
    c = result.counters
    assert c.num_draft_tokens == nodes * c.num_drafts  # the block has mass on every token: full trees
    assert len(c.accepted_per_position) == 4 and c.num_accepted_tokens == sum(c.accepted_per_position)
    chain = generate(
        verifier,
        ranked(verifier, reference, rank=lambda s, i: (s + i) % 3),
        PROMPT,
        NEW,
        num_speculative_tokens=4,
    )
    assert chain.tokens == reference
    if nodes >= 4:  # the same block as a tree with siblings accepts more per pass than as a chain
        assert c.acceptance_length > chain.counters.acceptance_length


def test_tree_features_are_the_verifier_hidden_states_of_the_kept_path(verifier, reference):
    drafter = ranked(verifier, reference, rank=lambda s, i: [1, 0, 2, None][(s + i) % 4])
    result = generate(verifier, drafter, PROMPT, NEW, num_speculative_tokens=4, tree_nodes=10)
    assert result.tokens == reference
    assert result.counters.num_accepted_tokens > 0
    full, _ = capture_hidden_states(verifier, torch.tensor([PROMPT + reference]), None, AUX_IDS)
    assert len(drafter.features) == result.counters.num_drafts
    for f in drafter.features:
        torch.testing.assert_close(f, full[0, : f.shape[0]], rtol=1e-4, atol=1e-4)


def plain_cache(model, tokens: list[int]):
    """The cache plain decoding leaves after `tokens`: a prefill of the first, then one token a pass."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([tokens[:-3]]), past_key_values=cache, use_cache=True)
        for t in tokens[-3:]:
            model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
    return cache


def test_cache_after_a_tree_step_is_plain_decodings_cache_of_the_kept_tokens(verifier, reference):
    """A hand-made tree: root children [wrong, truth0], under truth0 [wrong, truth1, wrong],
    under truth1 a wrong leaf. Greedy keeps truth0, truth1; the cache keeps the pending token and
    those two, and equals plain decoding's cache of the same tokens."""
    from transformers import DynamicCache

    t0, t1 = reference[1], reference[2]
    w = lambda t: (t + 7) % 320  # noqa: E731
    tree = DraftTree(
        tokens=torch.tensor([w(t0), t0, w(t1), t1, w(t1) + 1, w(reference[3])]),
        parents=torch.tensor([-1, -1, 1, 1, 1, 3]),
        depths=torch.tensor([1, 1, 2, 2, 2, 3]),
        log_values=torch.zeros(6),
    )
    prefix = PROMPT + reference[:1]
    cache = DynamicCache(config=verifier.config)
    with torch.inference_mode():
        verifier(input_ids=torch.tensor([prefix[:-1]]), past_key_values=cache, use_cache=True)
        step = _verify_tree(verifier, cache, torch.tensor(prefix[-1:]), tree, _Sampling(0.0, 1.0, None))
    assert step.accepted.tolist() == [t0, t1] and step.next_token == reference[3]
    assert step.rows.tolist() == [0, 2, 4]
    want = plain_cache(verifier, prefix + [t0, t1])
    assert cache.get_seq_length() == want.get_seq_length() == len(prefix) + 2
    for got, ref in zip(cache.layers, want.layers, strict=True):
        torch.testing.assert_close(got.keys, ref.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.values, ref.values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("algo", ["dflash", "peagle", "dspark"])
def test_tree_greedy_is_lossless_with_parallel_drafters_built_in_code(algo, verifier, reference):
    drafter = build_drafter(algo, verifier)
    for nodes in (3, 16):
        result = generate(verifier, drafter, PROMPT, NEW, num_speculative_tokens=4, tree_nodes=nodes)
        assert result.tokens == reference
        assert result.counters.num_draft_tokens == nodes * result.counters.num_drafts


def test_tree_refuses_a_drafter_without_trees_plain_decoding_and_a_draft_length_cut(verifier, monkeypatch):
    from specctl.drafters import DRAFTERS

    monkeypatch.setitem(DRAFTERS, "eagle3", replace(DRAFTERS["eagle3"], tree=None))  # a spec without trees
    with pytest.raises(ValueError, match="cannot draft a tree"):
        generate(verifier, build_drafter("eagle3", verifier), PROMPT, 4, tree_nodes=4)
    with pytest.raises(ValueError, match="needs a drafter"):
        generate(verifier, None, PROMPT, 4, tree_nodes=4)
    with pytest.raises(ValueError, match=">= 1"):
        generate(verifier, build_drafter("dflash", verifier), PROMPT, 4, tree_nodes=0)
    with pytest.raises(ValueError, match="draft-length cut"):
        generate(verifier, build_drafter("dflash", verifier), PROMPT, 4, tree_nodes=4, adaptive_threshold=0.5)


# ---------------------------------------------------------------- sampling


class FixedBlockDrafter:
    """Always the same block logits [2, 4]: position 0 prefers 2 then 1, position 1 prefers 0."""

    algo, d2t = "fixed-block", None

    def __init__(self):
        self.verifier = SimpleNamespace(aux_layer_ids=(1,))

    def propose_with_logits(self, input_ids, aux_hidden_states, num_tokens, state=None):
        logits = torch.tensor([[0.0, 2.0, 3.0, -1.0], [3.0, 1.0, 0.5, 0.0]])[:num_tokens]
        return logits.argmax(-1), logits


def test_tree_sampled_output_follows_the_verifier_distribution():
    """As the chain's test (test_engine.sampled_counts): the joint distribution of the first
    three tokens over seeded runs, chi-square against the verifier's own (64 cells)."""
    samples, T, top_p = 1000, 1.0, 0.95
    model = make_tiny_verifier(num_layers=1, vocab_size=4)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(6.0)
        model.get_input_embeddings().weight.mul_(20.0)
    use_gqa_sdpa(model)
    prompt, counts, accepted = [1, 3, 0, 2, 3], torch.zeros(4, 4, 4), 0
    for seed in range(samples):
        r = generate(
            model,
            FixedBlockDrafter(),
            prompt,
            4,
            temperature=T,
            top_p=top_p,
            seed=seed,
            num_speculative_tokens=2,
            tree_nodes=4,
        )
        counts[tuple(r.tokens[:3])] += 1
        accepted += r.counters.num_accepted_tokens
    with torch.no_grad():
        p1 = apply_temperature_top_p(model(torch.tensor([prompt])).logits[0, -1], T, top_p)
        logits = model(torch.tensor([prompt + [a, b] for a in range(4) for b in range(4)])).logits
        p2 = apply_temperature_top_p(logits[:, -2], T, top_p).view(4, 4, 4)[:, 0]
        p3 = apply_temperature_top_p(logits[:, -1], T, top_p).view(4, 4, 4)
    exact = p1[:, None, None] * p2[:, :, None] * p3
    assert accepted > 0.3 * samples
    assert chi_square_p_value(counts, exact) > 1e-3


# ---------------------------------------------------------------- SmolLM2


@pytest.mark.integration
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tree_greedy_equals_plain_decoding_on_smollm2(dtype):
    """The real verifier on three built-in prompts: a drafter that puts plain decoding's own
    continuation at rank 0-2 (so accepted paths leave the argmax chain) and a DFlash drafter built
    in code, 16-node trees. float32: token for token. bf16: every divergence a near-tie, none on
    a CPU with AMX (whose bf16 F.linear gives a row the same bits at 1 and 17 rows)."""
    from specctl.bench.divergence import find_divergences
    from specctl.bench.prompts import load_prompts
    from specctl.devices import cpu_bf16_kind
    from specctl.recipe import VerifierSection
    from specctl.verifier import load_verifier

    verifier = load_verifier(VerifierSection(name_or_path="smollm2-135m-instruct", dtype=dtype, device="cpu"))
    model = verifier.model
    prompts, _ = load_prompts("builtin", verifier.tokenizer, 8, 0)
    chosen = {i: list(prompts[i].prompt_ids) for i in (2, 4, 6)}
    dflash = build_drafter("dflash", model)
    plain, by_rank, by_dflash, accepted = {}, {}, {}, 0
    for i, ids in chosen.items():
        plain[i] = generate(verifier, None, ids, 32).tokens
        truth = RankedBlockDrafter(
            ids + plain[i], model.config.vocab_size, rank=lambda s, j: (s + j) % 3, strict=dtype == "float32"
        )
        out = generate(verifier, truth, ids, 32, num_speculative_tokens=4, tree_nodes=16)
        by_rank[i], accepted = out.tokens, accepted + out.counters.num_accepted_tokens
        by_dflash[i] = generate(verifier, dflash, ids, 32, num_speculative_tokens=4, tree_nodes=16).tokens
    assert accepted > 20  # off-argmax paths were accepted and cached
    for spec in (by_rank, by_dflash):
        if dtype == "float32" or cpu_bf16_kind() == "amx":
            assert spec == plain
        else:
            found = find_divergences(model, torch.bfloat16, chosen, plain, spec, k=4)
            assert all(d.near_tie for d in found), found


@pytest.mark.parametrize("seed", range(5))
def test_visible_runs_are_the_runs_of_each_rows_causal_span(seed):
    from specctl.verifier import _visible_runs

    g = torch.Generator().manual_seed(seed)
    rows, keys = 6, 15
    mask = torch.rand(1, 1, rows, keys, generator=g) < 0.6
    runs = _visible_runs(mask, rows, keys)
    for i in range(rows):
        seen = keys - rows + i + 1
        want = [j for j in range(seen) if mask[0, 0, i, j]]
        assert [j for a, b in runs[i] for j in range(a, b)] == want
        assert all(b < c for (_, b), (c, _) in zip(runs[i], runs[i][1:], strict=False))  # maximal runs
