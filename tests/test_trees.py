"""Draft trees (specctl.trees): the builder, the mask, greedy acceptance and recursive rejection
sampling, each against a brute force that enumerates every case on a tiny vocabulary."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from test_sampling import chi_square_p_value

from specctl.trees import (
    DraftTree,
    build_tree,
    greedy_tree_accept,
    root_path,
    select_top_nodes,
    tree_attention_mask,
    tree_rejection_sample,
    verify_rows_mask,
)


def random_logprobs(K: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(K, V, generator=g) * 2, -1)  # [K, V], no ties


def all_nodes(K: int, V: int) -> list[tuple[int, ...]]:
    """Every token path of length 1..K: the nodes of the complete tree."""
    return [p for d in range(1, K + 1) for p in itertools.product(range(V), repeat=d)]


def path_value(lp: torch.Tensor, path: tuple[int, ...]) -> float:
    return math.exp(sum(float(lp[d, t]) for d, t in enumerate(path)))


def tree_paths(tree) -> set[tuple[int, ...]]:
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    return {tuple(toks[j] for j in root_path(pars, i)) for i in range(tree.num_nodes)}


@pytest.mark.parametrize(
    "K,V,N,seed", [(2, 3, n, s) for n in (1, 3, 5, 8) for s in range(3)] + [(3, 2, 6, 0)]
)
def test_build_tree_is_the_best_tree_of_every_prefix_closed_node_set(K, V, N, seed):
    """Exhaustive: over all prefix-closed sets of N nodes, none has a larger expected accepted length."""
    lp = random_logprobs(K, V, seed)
    tree = build_tree(lp, N)
    nodes = all_nodes(K, V)
    best = 0.0
    for subset in itertools.combinations(nodes, min(N, len(nodes))):
        chosen = set(subset)
        if all(len(p) == 1 or p[:-1] in chosen for p in chosen):
            best = max(best, sum(path_value(lp, p) for p in chosen))
    assert tree.num_nodes == min(N, len(nodes))
    assert tree.expected_accepted() == pytest.approx(best, rel=1e-5)


@pytest.mark.parametrize("K,V,N,seed", [(3, 4, 10, 0), (4, 3, 20, 1), (5, 5, 16, 2), (1, 6, 4, 3)])
def test_build_tree_holds_the_top_n_paths_in_expansion_order(K, V, N, seed):
    lp = random_logprobs(K, V, seed)
    tree = build_tree(lp, N)
    ranked = sorted(all_nodes(K, V), key=lambda p: -path_value(lp, p))
    assert tree_paths(tree) == set(ranked[:N])
    toks, pars, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    for i in range(N):
        path = [toks[j] for j in root_path(pars, i)]
        assert depths[i] == len(path) <= K
        assert pars[i] < i  # parents precede children
        assert math.exp(float(tree.log_values[i])) == pytest.approx(path_value(lp, tuple(path)), rel=1e-5)
    for parent in set(pars):  # siblings come best first
        sib = [i for i in range(N) if pars[i] == parent]
        assert sib == sorted(sib, key=lambda i: -float(tree.log_values[i]))


def test_build_tree_refuses_bad_input():
    with pytest.raises(ValueError, match="at least 1 node"):
        build_tree(torch.zeros(2, 3), 0)
    with pytest.raises(ValueError, match=r"\[K >= 1, V\]"):
        build_tree(torch.zeros(3), 4)


# ---------------------------------------------------------------- select_top_nodes


def random_pool(M: int, seed: int, ties: bool) -> DraftTree:
    """A candidate tree of M nodes as EAGLE-3's expansion makes one (breadth first, a node's
    children side by side in rank order, values falling down every path); `ties`: integer
    log-prob steps, 0 included, so children tie with parents and siblings with each other."""
    g = torch.Generator().manual_seed(seed)
    pars: list[int] = []
    depths: list[int] = []
    values: list[float] = []
    queue = [(-1, 0.0, 0)]  # (node, value, depth) waiting for children
    while len(pars) < M:
        node, value, depth = queue.pop(0)
        n = int(torch.randint(0 if queue else 1, 4, (), generator=g))
        if ties:
            steps = (-torch.randint(0, 3, (n,), generator=g)).float()
        else:
            steps = torch.log(torch.rand(n, generator=g))
        for step in sorted(steps.tolist(), reverse=True)[: M - len(pars)]:
            pars.append(node)
            depths.append(depth + 1)
            values.append(value + step)
            queue.append((len(pars) - 1, values[-1], depth + 1))
    return DraftTree(
        tokens=torch.arange(M) + 100,  # pool index + 100: which pool node a kept one is
        parents=torch.tensor(pars),
        depths=torch.tensor(depths),
        log_values=torch.tensor(values),
    )


@pytest.mark.parametrize(
    "M,N,seed,ties", [(9, n, s, t) for n in (1, 4, 7, 9, 12) for s in range(3) for t in (0, 1)]
)
def test_select_top_nodes_is_the_best_tree_of_every_parent_closed_subset(M, N, seed, ties):
    """Exhaustive over the pool's parent-closed subsets of N nodes: none holds more expected
    accepted length; the kept nodes are a DraftTree of the pool's root paths, best first."""
    pool = random_pool(M, seed, bool(ties))
    tree = select_top_nodes(pool, N)
    pars, values = pool.parents.tolist(), pool.log_values.tolist()
    best = max(
        sum(math.exp(values[i]) for i in subset)
        for subset in itertools.combinations(range(M), min(N, M))
        if all(pars[i] < 0 or pars[i] in subset for i in subset)
    )
    assert tree.num_nodes == min(N, M)
    assert tree.expected_accepted() == pytest.approx(best, rel=1e-6)
    kept = (tree.tokens - 100).tolist()
    new_pars = tree.parents.tolist()
    for j, i in enumerate(kept):
        assert new_pars[j] < j  # parents precede children
        assert new_pars[j] == (-1 if pars[i] < 0 else kept.index(pars[i]))  # the pool's parent
        assert tree.depths[j] == pool.depths[i] and tree.log_values[j] == pool.log_values[i]
    assert tree.log_values.tolist() == sorted(tree.log_values.tolist(), reverse=True)  # best first
    for p in set(new_pars):  # siblings keep their pool (rank) order
        sib = [kept[j] for j in range(len(kept)) if new_pars[j] == p]
        assert sib == sorted(sib)


def test_select_top_nodes_breaks_ties_toward_parents_and_earlier_siblings():
    pool = DraftTree(
        tokens=torch.tensor([5, 6, 7, 8]),
        parents=torch.tensor([-1, 0, 0, -1]),
        depths=torch.tensor([1, 2, 2, 1]),
        log_values=torch.tensor([-1.0, -1.0, -1.0, -2.0]),  # both children tie with their parent
    )
    assert select_top_nodes(pool, 2).tokens.tolist() == [5, 6]
    assert select_top_nodes(pool, 3).parents.tolist() == [-1, 0, 0]
    grows = DraftTree(pool.tokens, pool.parents, pool.depths, torch.tensor([-2.0, -1.0, -3.0, -4.0]))
    with pytest.raises(ValueError, match="worth more than its parent"):
        select_top_nodes(grows, 1)
    with pytest.raises(ValueError, match="at least 1 node"):
        select_top_nodes(pool, 0)


def test_tree_mask_is_ancestor_or_self_and_the_verify_mask_adds_cache_and_root():
    lp = random_logprobs(4, 3, 5)
    tree = build_tree(lp, 12)
    pars = tree.parents.tolist()
    mask = tree_attention_mask(tree.parents)
    for i in range(12):
        assert set(torch.nonzero(mask[i])[:, 0].tolist()) == set(root_path(pars, i))
    full = verify_rows_mask(tree.parents, cached=7)[0, 0]  # [13, 20]
    assert full.shape == (13, 20)
    assert full[:, :8].all()  # the cache and the root
    assert not full[0, 8:].any()
    assert torch.equal(full[1:, 8:], mask)
    with pytest.raises(ValueError, match="precede"):
        tree_attention_mask(torch.tensor([-1, 2, 0]))


def brute_greedy(tokens: list[int], parents: list[int], target: list[int]) -> tuple[int, list[int], int]:
    """Longest root path whose every token is the verifier's argmax after the node before it."""
    best: list[int] = []
    for i in range(len(tokens)):
        path = root_path(parents, i)
        if all(tokens[j] == target[(parents[j]) + 1] for j in path) and len(path) > len(best):
            best = path
    nxt = target[best[-1] + 1] if best else target[0]
    return len(best), [tokens[j] for j in best], nxt


@pytest.mark.parametrize("seed", range(40))
def test_greedy_tree_accept_takes_the_longest_matching_root_path(seed):
    g = torch.Generator().manual_seed(seed)
    tree = build_tree(random_logprobs(4, 3, seed), int(torch.randint(1, 16, (), generator=g)))
    N = tree.num_nodes
    target = torch.randint(0, 3, (1 + N,), generator=g)
    accepted, nxt = greedy_tree_accept(tree.tokens, tree.parents, target)
    length, toks, want_next = brute_greedy(tree.tokens.tolist(), tree.parents.tolist(), target.tolist())
    assert len(accepted) == length
    assert [tree.tokens.tolist()[j] for j in accepted] == toks
    assert accepted == root_path(tree.parents.tolist(), accepted[-1]) if accepted else True
    assert nxt == want_next


def toy_tree_run(T: torch.Tensor, tokens, parents, first: int, want: int, g: torch.Generator) -> list[int]:
    """Decode `want` tokens after `first` from the Markov verifier T [V, V] by tree verification:
    every step drafts the same (token, parent) tree after the last emitted token."""
    out = [first]
    while len(out) < want + 1:
        p = torch.stack([T[out[-1]], *[T[t] for t in tokens.tolist()]])  # [1+N, V]
        path, nxt = tree_rejection_sample(tokens, parents, p, g)
        out += [int(tokens[j]) for j in path] + [nxt]
    return out[1 : want + 1]


def test_tree_rejection_sampling_follows_the_verifier_distribution():
    """The first three emitted tokens, over many runs: chi-square against the verifier's own
    joint distribution T[r, a] T[a, b] T[b, c] (64 cells). The drafted tree has two children at
    the root and a chain under the first, so every rule -- accept, sibling retry, residual,
    accepted leaf -- is exercised."""
    V, samples = 4, 3000
    g = torch.Generator().manual_seed(0)
    T = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    tokens = torch.tensor([int(T[0].argmax()), 3, 2, 1])
    parents = torch.tensor([-1, -1, 0, 2])
    counts = torch.zeros(V, V, V)
    accepted = 0
    for _ in range(samples):
        a, b, c = toy_tree_run(T, tokens, parents, 0, 3, g)
        counts[a, b, c] += 1
        accepted += a in tokens[:2].tolist()
    exact = T[0][:, None, None] * T[:, :, None] * T[None, :, :]
    assert accepted > 0.3 * samples
    assert chi_square_p_value(counts, exact) > 1e-3


def test_tree_rejection_sampling_with_a_one_hot_verifier_takes_the_matching_branch():
    tokens, parents = torch.tensor([1, 2, 0]), torch.tensor([-1, -1, 1])
    p = torch.zeros(4, 3)
    p[0, 2] = p[2, 0] = p[3, 1] = 1.0  # root -> 2 (node 1), node 1 -> 0 (node 2), then 1
    p[1, 0] = 1.0
    assert tree_rejection_sample(tokens, parents, p, torch.Generator().manual_seed(0)) == ([1, 2], 1)
