"""Best-first draft trees from one drafter forward (DDTree's construction).

A block drafter gives per-position marginals q_1..q_G of one forward. Scoring a prefix by the
product of its marginals, the `budget` best prefixes form a tree (a prefix never scores above
its parent, since every factor is at most 1): the nodes a verifier checks for the most expected
accepted tokens under the drafter's own belief. A chain of `budget` tokens is the special case
that spends every node on the argmax path; the tree spends them where the drafter is unsure.

The tree is enumerated with a heap over (node, next sibling) successors on the marginals
sorted per position: popping a node pushes its first child and its next sibling, so each pop
is the next best prefix and the work is O(budget log budget) after one top-k per position.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    """One request's best-first tree, without its root (the last committed token).

    tokens:  [N] token id of each node, in the order they were chosen (best first).
    parents: [N] index of each node's parent in this tree; -1 for the root's children.
    depths:  [N] 1 for the root's children, j for a j-th draft token.
    logprobs: [N] the node's prefix log-probability under the marginals.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    logprobs: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])


def best_first_tree(logprobs: torch.Tensor, budget: int) -> DraftTree:
    """The `budget` highest-probability prefixes of marginals `logprobs` [G, V] (log-softmaxed
    per position) as a tree."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [G, V], got shape {tuple(logprobs.shape)}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    gamma = logprobs.shape[0]
    width = min(budget, logprobs.shape[1])
    top = logprobs.float().topk(width, dim=-1)
    values, ids = top.values.tolist(), top.indices.tolist()
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    # heap entries: (-score, tie, parent node, depth (0-based position), rank at that position)
    heap = [(-values[0][0], 0, -1, 0, 0)]
    tie = 1
    while heap and len(tokens) < budget:
        neg, _, parent, pos, rank = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(ids[pos][rank])
        parents.append(parent)
        depths.append(pos + 1)
        scores.append(-neg)
        base = scores[parent] if parent >= 0 else 0.0
        if rank + 1 < width:  # next sibling: same parent, next-best token at this position
            heapq.heappush(heap, (-(base + values[pos][rank + 1]), tie, parent, pos, rank + 1))
            tie += 1
        if pos + 1 < gamma:  # first child: this path extended by the best next token
            heapq.heappush(heap, (-(-neg + values[pos + 1][0]), tie, node, pos + 1, 0))
            tie += 1
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths),
                     torch.tensor(scores))


def chain_tree(logprobs: torch.Tensor, length: int) -> DraftTree:
    """The argmax chain of `length` tokens, as a tree (the baseline a tree must beat)."""
    best = logprobs.float()[:length].max(dim=-1)
    n = best.indices.shape[0]
    return DraftTree(best.indices, torch.arange(-1, n - 1), torch.arange(1, n + 1),
                     best.values.cumsum(0))


def greedy_tree_accepted(tree: DraftTree, target: torch.Tensor) -> int:
    """Tokens accepted at T = 0: the depth of the deepest node on the verifier's greedy path
    `target` [G] (its j-th next token at depth j)."""
    children: dict[tuple[int, int], int] = {
        (int(p), int(t)): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens, strict=True))}
    node, accepted = -1, 0
    for token in target.tolist():
        node = children.get((node, int(token)), -2)
        if node == -2:
            break
        accepted += 1
    return accepted
