"""EAGLE-3's draft tree (`Eagle3Drafter.propose_tree`, EAGLE-2's top-k expansion): every node's
value is the drafter's own log-probability of its root path, computed by brute force with the
chain (`propose_with_logits` forced along that path); a top-1 tree is the chain; the tree is the
expansion a node-by-node reference builds; the context cache in `state` gives what a fresh
proposal gives; greedy generation with EAGLE-3 trees is plain decoding's, token for token."""

from __future__ import annotations

import pytest
import torch
from test_engine import AUX_IDS, PROMPT, build_drafter, varied_verifier

from specctl.drafters.targets import target_to_draft
from specctl.engine import generate
from specctl.trees import root_path
from specctl.verifier import use_gqa_sdpa

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# llama layers; two qwen3 layers feeding back the normed output; a sliding window the context exceeds
CONFIGS = [
    {},
    {"num_layers": 2, "draft_layers": "qwen3", "norm_output": True},
    {"sliding_window": 9, "num_speculative_tokens": 4},
]


@pytest.fixture(scope="module")
def verifier():
    return varied_verifier()


def sharp_eagle3(verifier, d2t: torch.Tensor | None = None, **config):
    """A random EAGLE-3 with its matrices scaled up: distinct, confident proposals (no ties)."""
    drafter = build_drafter("eagle3", verifier, **config)
    if d2t is not None:  # the same drafter over a reduced draft vocabulary
        spec, cfg = drafter.verifier, drafter.config
        from specctl.drafters import DRAFTERS
        from specctl.drafters.api import VerifierWeights

        weights = VerifierWeights(drafter.embed_tokens, drafter.verifier_lm_head, drafter.verifier_norm)
        torch.manual_seed(0)
        drafter = DRAFTERS["eagle3"].build(cfg, spec, weights, d2t, "kl").eval()
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return drafter


def reduced_d2t(V: int, Vd: int) -> torch.Tensor:
    """d2t of a draft vocabulary of Vd verifier ids (every other id, then the rest)."""
    kept = torch.cat([torch.arange(0, V, 2), torch.arange(1, V, 2)])[:Vd].sort().values
    return kept - torch.arange(Vd)


def inputs(seed: int, N: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 300, (N + 1,), generator=g), torch.randn(N, len(AUX_IDS), 64, generator=g)


def forced_chain(drafter, ids, aux, path: list[int]) -> torch.Tensor:
    """The drafter's log-probs [len(path) + 1, Vd] at each step of its chain forced along `path`
    (draft ids): a hook on lm_head records each step's logits, then adds a large bonus to the
    forced token so the chain's argmax -- the token fed to the next step -- is that token."""
    seen: list[torch.Tensor] = []

    def force(module, args, output):
        seen.append(output.detach().clone())
        j = len(seen) - 1
        return (
            output
            if j >= len(path)
            else output.index_add(-1, torch.tensor([path[j]]), torch.full_like(output[..., :1], 1e4))
        )

    handle = drafter.lm_head.register_forward_hook(force)
    try:
        drafts, _ = drafter.propose_with_logits(ids, aux, len(path) + 1)
    finally:
        handle.remove()
    assert (
        drafts[: len(path)].tolist() == drafter.to_target_ids(torch.tensor(path, dtype=torch.long)).tolist()
    )
    return torch.log_softmax(torch.stack([s.reshape(-1) for s in seen]).float(), -1)


def draft_ids(drafter, tokens: torch.Tensor) -> list[int]:
    ids = target_to_draft(tokens, drafter.t2d)
    assert (ids >= 0).all()  # every tree token is in the draft vocabulary
    return ids.tolist()


def node_paths(drafter, tree) -> list[list[int]]:
    """Each node's root path in draft ids."""
    toks, pars = draft_ids(drafter, tree.tokens), tree.parents.tolist()
    return [[toks[j] for j in root_path(pars, i)] for i in range(tree.num_nodes)]


@pytest.mark.parametrize("config", CONFIGS)
def test_a_top_1_tree_is_the_chain(verifier, config):
    drafter = sharp_eagle3(verifier, **config)
    ids, aux = inputs(0)
    for K in (1, 3, 4):
        drafts, logits = drafter.propose_with_logits(ids, aux, K)
        tree = drafter.propose_tree(ids, aux, K, K, top_k=1)
        assert tree.tokens.tolist() == drafts.tolist()
        assert tree.parents.tolist() == list(range(-1, K - 1))
        assert tree.depths.tolist() == list(range(1, K + 1))
        lp = torch.log_softmax(logits.float(), -1)[torch.arange(K), drafts]
        torch.testing.assert_close(tree.log_values, lp.cumsum(0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("reduced", [False, True])
def test_every_node_value_is_the_drafters_log_prob_of_its_path(verifier, config, reduced):
    """Brute force per node: the chain forced along the node's root path gives the same
    cumulative log-prob (draft vocabulary reduced or not: tokens come back as verifier ids)."""
    V = verifier.config.vocab_size
    drafter = sharp_eagle3(verifier, reduced_d2t(V, 200) if reduced else None, **config)
    ids, aux = inputs(1)
    tree = drafter.propose_tree(ids, aux, 3, 14, top_k=3)
    assert tree.num_nodes == 14 and set(tree.depths.tolist()) == {1, 2, 3}
    if reduced:
        assert drafter.t2d[tree.tokens].all()  # verifier ids of draft-vocabulary tokens
    for i, path in enumerate(node_paths(drafter, tree)):
        lp = forced_chain(drafter, ids, aux, path[:-1])  # [len(path), Vd]
        want = sum(float(lp[j, t]) for j, t in enumerate(path))
        assert float(tree.log_values[i]) == pytest.approx(want, abs=2e-4), (i, path)


def reference_tree(drafter, ids, aux, depth: int, max_nodes: int, top_k: int) -> dict[tuple, float]:
    """EAGLE-2's expansion one node at a time, each node's distribution from the forced chain:
    {root path (draft ids): cumulative log-prob} of the best max_nodes candidates."""
    frontier = {(): 0.0}
    pool: dict[tuple, float] = {}
    for _ in range(depth):
        children = {}
        for path, value in frontier.items():
            lp = forced_chain(drafter, ids, aux, list(path))[-1]
            top = lp.topk(top_k)
            children.update(
                {
                    (*path, t): value + v
                    for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True)
                }
            )
        pool.update(children)
        frontier = dict(sorted(children.items(), key=lambda kv: -kv[1])[:top_k])
    return dict(sorted(pool.items(), key=lambda kv: -kv[1])[:max_nodes])


@pytest.mark.parametrize("depth,max_nodes,top_k", [(3, 10, 4), (4, 31, 8), (2, 5, 5), (4, 12, 2)])
def test_the_tree_is_the_node_by_node_expansion(verifier, depth, max_nodes, top_k):
    drafter = sharp_eagle3(verifier)
    ids, aux = inputs(2)
    tree = drafter.propose_tree(ids, aux, depth, max_nodes, top_k=top_k)
    want = reference_tree(drafter, ids, aux, depth, max_nodes, top_k)
    got = {tuple(p): float(v) for p, v in zip(node_paths(drafter, tree), tree.log_values, strict=True)}
    assert got.keys() == want.keys()
    for path, value in want.items():
        assert got[path] == pytest.approx(value, abs=2e-4)
    pars = tree.parents.tolist()
    assert all(p < i for i, p in enumerate(pars))  # parents first
    first = [i for i, p in enumerate(pars) if p < 0]  # the root's children: the first distribution's best
    lp0 = forced_chain(drafter, ids, aux, [])[0]
    assert draft_ids(drafter, tree.tokens[first]) == lp0.topk(len(first)).indices.tolist()


@pytest.mark.parametrize("config", CONFIGS)
def test_the_cached_context_gives_the_fresh_tree_as_the_prefix_grows(verifier, config):
    """One state across proposals, trees and chains interleaved, as a request's steps use it."""
    drafter = sharp_eagle3(verifier, **config)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (64,), generator=g)
    aux = torch.randn(64, len(AUX_IDS), 64, generator=g)
    state: dict = {}
    N, seen = 5, set()
    while N < 60:
        if N % 3 == 0:
            cached = drafter.propose_with_logits(ids[: N + 1], aux[:N], 3, state=state)[0]
            assert cached.tolist() == drafter.propose_with_logits(ids[: N + 1], aux[:N], 3)[0].tolist()
        else:
            cached = drafter.propose_tree(ids[: N + 1], aux[:N], 3, 10, state=state)
            fresh = drafter.propose_tree(ids[: N + 1], aux[:N], 3, 10)
            assert cached.tokens.tolist() == fresh.tokens.tolist()
            assert cached.parents.tolist() == fresh.parents.tolist()
            torch.testing.assert_close(cached.log_values, fresh.log_values, rtol=1e-4, atol=1e-4)
            seen.add(tuple(cached.tokens.tolist()))
        N += int(torch.randint(1, 5, (1,), generator=g))
    assert len(seen) > 3 and state["context_rows"] > 50


def test_propose_tree_refuses_an_empty_tree(verifier):
    drafter = sharp_eagle3(verifier)
    ids, aux = inputs(4)
    with pytest.raises(ValueError, match="max_nodes >= 1"):
        drafter.propose_tree(ids, aux, 3, 0)
    with pytest.raises(ValueError, match="depth >= 1"):
        drafter.propose_tree(ids, aux, 0, 4)


# ---------------------------------------------------------------- in the engine


@pytest.fixture(scope="module")
def small_vocab():
    """A verifier of 24 tokens: an EAGLE-3 tree's 8 candidates a depth often hold its next token,
    so accepted paths leave the drafter's argmax chain and go deeper than one node."""
    model = varied_verifier(vocab_size=24)
    use_gqa_sdpa(model)
    return model


@pytest.mark.parametrize("nodes", [1, 4, 16, 31])
def test_greedy_generate_with_eagle3_trees_is_plain_decoding(small_vocab, nodes):
    prompt = [t % 24 for t in PROMPT]
    plain = generate(small_vocab, None, prompt, 40).tokens
    drafter = sharp_eagle3(small_vocab)
    calls: list[tuple] = []
    propose = drafter.propose_tree

    def recorded(ids, aux, depth, max_nodes, state=None):
        tree = propose(ids, aux, depth, max_nodes, state=state)
        calls.append((ids.clone(), aux.clone(), depth, max_nodes, tree))
        return tree

    drafter.propose_tree = recorded  # the engine asks the spec ("expand") and calls this
    result = generate(small_vocab, drafter, prompt, 40, num_speculative_tokens=3, tree_nodes=nodes)
    assert result.tokens == plain
    c = result.counters
    assert c.num_drafts == len(calls) and c.num_draft_tokens == sum(t.num_nodes for *_, t in calls)
    assert all(t.num_nodes <= nodes and int(t.depths.max()) <= d for _, _, d, _, t in calls)
    assert len(c.accepted_per_position) == 3 and c.num_accepted_tokens == sum(c.accepted_per_position)
    if nodes >= 4:
        assert c.accepted_per_position[1] > 0  # paths of two nodes and more were accepted
    for ids, aux, depth, max_nodes, tree in calls[::5]:  # the engine's state gave the fresh trees
        fresh = propose(ids, aux, depth, max_nodes)
        assert fresh.tokens.tolist() == tree.tokens.tolist()


@pytest.mark.parametrize("algo,nodes", [("eagle3", None), ("eagle3", 6), ("eagle3", 16), ("dflash", 8)])
def test_the_acceptance_replay_is_what_generate_counts(small_vocab, algo, nodes):
    """benchmarks.trees --acceptance replays speculation along plain decoding's output without
    verifier passes: its per-pass counts must add up to generate's counters, chain or tree."""
    from benchmarks.trees import replay_acceptance

    prompt = [t % 24 for t in PROMPT]
    plain = generate(small_vocab, None, prompt, 40).tokens
    drafter = sharp_eagle3(small_vocab) if algo == "eagle3" else build_drafter(algo, small_vocab)
    K = 3
    passes = replay_acceptance(small_vocab, drafter, prompt, plain, K, nodes, AUX_IDS)
    c = generate(small_vocab, drafter, prompt, 40, num_speculative_tokens=K, tree_nodes=nodes).counters
    assert len(passes) == c.num_drafts
    assert sum(a for a, _ in passes) == c.num_accepted_tokens > 0
    assert sum(d for _, d in passes) == c.num_draft_tokens
