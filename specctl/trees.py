"""Draft trees from a drafter's distributions: the pure functions of one tree step.

A parallel drafter (DFlash, DSpark, P-EAGLE) predicts a distribution for every position of its
block in one pass, but a chain verifies only the argmax at each position, and acceptance
collapses after position 1. A tree spends the same verify rows on the second and third most
likely tokens at the early positions instead (DDTree, SpecInfer, EAGLE-2):

- `build_tree`: the best tree of at most N nodes. Under the independence assumption a node's
  value -- the product of the probabilities on its root path -- is the probability that the
  verifier reaches and accepts it, and the expected number of accepted drafts is the sum of the
  values. Values shrink going down (child <= parent) and across (next sibling <= sibling), so the
  N highest-valued nodes form a tree, and greedy best-first expansion finds them: pop the best
  frontier node, push its best child and its next sibling.
- `select_top_nodes`: the best N nodes of a larger candidate tree (EAGLE-3's top-k expansion,
  `Eagle3Drafter.propose_tree`, whose candidates' values come from one drafter forward per depth).
- `tree_attention_mask`: what each row of the verify forward may see (ancestor-or-self).
- `greedy_tree_accept` / `tree_rejection_sample`: which root path the verifier keeps.

Nodes are numbered in the order they were added, so a parent always precedes its children and
siblings appear in rank order (the order `tree_rejection_sample` tries them). Parent -1 is the
root: the last verified token, whose row comes first in the verify forward.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from specctl.sampling import sample_categorical


@dataclass(frozen=True)
class DraftTree:
    """N nodes in expansion order (parents before children, siblings by rank)."""

    tokens: torch.Tensor  # [N] long: the node's token (the vocabulary of the log-probs it came from)
    parents: torch.Tensor  # [N] long: index of the parent node, -1 = child of the root
    depths: torch.Tensor  # [N] long: 1..K, the block position the token is drafted for
    log_values: torch.Tensor  # [N] float: log of the product of probabilities on the root path

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.numel())

    def expected_accepted(self) -> float:
        """Expected accepted drafts per pass under the independence assumption: the sum of the
        nodes' probabilities of being reached and accepted (the bonus token not counted)."""
        return float(self.log_values.exp().sum())


def build_tree(logprobs: torch.Tensor, max_nodes: int) -> DraftTree:
    """logprobs [K, V] (per block position, log-probabilities over the vocabulary) -> the tree of
    at most `max_nodes` nodes, depth <= K, maximising the expected accepted length.

    A frontier entry is (depth d, rank r, parent): the r-th most likely token at position d under
    that parent. Only the top min(N, V) tokens of each position can ever be used: a node of rank r
    needs its r better siblings in the tree first.
    """
    if logprobs.dim() != 2 or logprobs.shape[0] < 1:
        raise ValueError(f"build_tree needs log-probs [K >= 1, V], got {tuple(logprobs.shape)}")
    if max_nodes < 1:
        raise ValueError(f"a draft tree needs at least 1 node, got {max_nodes}")
    K, V = logprobs.shape
    top_lp, top_ids = logprobs.float().topk(min(max_nodes, V), dim=-1)  # [K, R] each, best first
    lp, ids = top_lp.tolist(), top_ids.tolist()  # one host copy; the heap works on floats
    R = len(lp[0])
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    values: list[float] = []
    # heap of (-log value, tie-break counter, depth index 0..K-1, rank, parent node, parent log value)
    frontier = [(-lp[0][0], 0, 0, 0, -1, 0.0)]
    pushed = 1
    while frontier and len(tokens) < max_nodes:
        neg, _, d, r, parent, parent_value = heapq.heappop(frontier)
        node = len(tokens)
        tokens.append(ids[d][r])
        parents.append(parent)
        depths.append(d + 1)
        values.append(-neg)
        if r + 1 < R:  # next sibling: same parent, next rank
            heapq.heappush(frontier, (-(parent_value + lp[d][r + 1]), pushed, d, r + 1, parent, parent_value))
            pushed += 1
        if d + 1 < K:  # best child
            heapq.heappush(frontier, (-(-neg + lp[d + 1][0]), pushed, d + 1, 0, node, -neg))
            pushed += 1
    device = logprobs.device
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        parents=torch.tensor(parents, dtype=torch.long, device=device),
        depths=torch.tensor(depths, dtype=torch.long, device=device),
        log_values=torch.tensor(values, dtype=torch.float32, device=device),
    )


def select_top_nodes(pool: DraftTree, max_nodes: int) -> DraftTree:
    """The best `max_nodes` nodes of a candidate tree, as a tree: pool [M] nodes (parents before
    children, siblings by rank, child log value <= parent's) -> [min(M, max_nodes)] nodes.

    The highest-valued nodes form a tree because a parent is worth at least its child; ties go
    to the earlier pool node (a stable sort), so a parent beats an equal-valued child and an
    earlier sibling a later one. Kept nodes come best first: parents still precede children and
    siblings keep their rank order, as a DraftTree needs.
    """
    M = pool.num_nodes
    if max_nodes < 1:
        raise ValueError(f"a draft tree needs at least 1 node, got {max_nodes}")
    kept = torch.sort(pool.log_values, descending=True, stable=True).indices[:max_nodes]  # [N]
    slot = torch.full((M + 1,), -1, dtype=torch.long, device=kept.device)  # pool index + 1 -> kept index
    slot[kept + 1] = torch.arange(kept.numel(), device=kept.device)
    pool_parents = pool.parents[kept]  # [N]
    parents = slot[pool_parents + 1]  # [N]; -1 for children of the root
    order = torch.arange(kept.numel(), device=kept.device)
    orphans = (pool_parents >= 0) & ((parents < 0) | (parents >= order))  # a kept child without its parent
    if bool(orphans.any()):
        raise ValueError("select_top_nodes: a child is worth more than its parent; log values must not grow")
    return DraftTree(
        tokens=pool.tokens[kept], parents=parents, depths=pool.depths[kept], log_values=pool.log_values[kept]
    )


def tree_attention_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [N] (parent before child, -1 = root) -> [N, N] bool: mask[i, j] = node j is node i
    or one of its ancestors (what row i of the verify forward may attend among the nodes)."""
    N = parents.numel()
    mask = torch.eye(N, dtype=torch.bool, device=parents.device)  # [N, N]
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            if p >= i:
                raise ValueError(f"tree node {i} has parent {p}: parents must precede their children")
            mask[i] |= mask[p]
    return mask


def verify_rows_mask(parents: torch.Tensor, cached: int) -> torch.Tensor:
    """The verify forward's mask over [root, N nodes] on a cache of `cached` entries:
    [1, 1, 1+N, cached+1+N] bool. Every row sees the whole cache and the root; node rows add
    their ancestors and themselves -- the keys a one-token decode of that path would see."""
    N = parents.numel()
    mask = torch.ones(1 + N, cached + 1 + N, dtype=torch.bool, device=parents.device)
    mask[0, cached + 1 :] = False  # the root sees only the cache and itself
    mask[1:, cached + 1 :] = tree_attention_mask(parents)
    return mask[None, None]


def root_path(parents: list[int], node: int) -> list[int]:
    """Indices of the nodes from the root's child down to `node` (empty for the root, -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def greedy_tree_accept(
    tokens: torch.Tensor, parents: torch.Tensor, target_argmax: torch.Tensor
) -> tuple[list[int], int]:
    """tokens [N], parents [N], target_argmax [1+N] (the verifier's argmax after the root, then
    after each node) -> (accepted node indices root to leaf, the verifier's next token).

    A node is accepted when its token is the verifier's argmax after its parent and its parent
    was accepted; the deepest accepted node ends the kept path (with distinct sibling tokens the
    accepted nodes are exactly one path)."""
    toks, pars, target = tokens.tolist(), parents.tolist(), target_argmax.tolist()  # one sync each
    ok: list[bool] = []
    best, best_depth = -1, 0
    depth: list[int] = []
    for i, (t, p) in enumerate(zip(toks, pars, strict=True)):
        good = (p < 0 or ok[p]) and t == target[p + 1]
        ok.append(good)
        depth.append(1 if p < 0 else depth[p] + 1)
        if good and depth[i] > best_depth:
            best, best_depth = i, depth[i]
    return root_path(pars, best), target[best + 1]


def tree_rejection_sample(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Lossless multi-candidate verification of deterministic (top-k) drafts.

    tokens [N], parents [N], p [1+N, V] the verifier's (temperature/top-p applied) distributions
    after the root and after each node -> (accepted node indices root to leaf, next token).
    At a node, its children are tried in order: child c is accepted with probability
    p(c) / sum(p) (a one-hot draft's min(1, p/q)); on rejection c is removed from p (the residual
    norm(max(p - onehot(c), 0))) and the next child is tried; when all fail, the next token is
    drawn from the residual; after an accepted leaf, from the leaf's row. Every emitted token is
    then distributed as the verifier's p (SpecInfer / EAGLE-2 recursive rejection sampling).
    """
    toks, pars = tokens.tolist(), parents.tolist()
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(pars):
        children.setdefault(parent, []).append(i)
    node, path = -1, []
    while True:
        residual = p[node + 1].clone()  # [V]
        for c in children.get(node, []):
            mass = residual.sum()
            u = torch.rand((), generator=generator, device=p.device, dtype=residual.dtype)
            if bool(u * mass < residual[toks[c]]):  # u < p(c) / sum(p), multiplied out
                node = c
                path.append(c)
                break
            residual[toks[c]] = 0
        else:
            # all children failed (or a leaf): the residual keeps mass, as a rejected child had p < 1
            dist = torch.where(residual.sum() > 0, residual, p[node + 1])
            return path, int(sample_categorical(dist, generator))
