"""A request's chain-first trie (`core/trie.py`): candidate 0 first, truncation to a trie,
trailing candidates dropped over the node budget, each candidate's source kept; best-first trees
as tries of their leaves, candidates of different lengths."""

from __future__ import annotations

import pytest
import torch

from vllm_specdiff.core.best_first import best_first_tree
from vllm_specdiff.core.scoring import streak_within
from vllm_specdiff.core.trie import best_first_trie, build_request_trie


def test_trie_puts_candidate_zero_first_and_truncates_to_a_trie():
    drafts = torch.tensor([[5, 6, 7], [5, 8, 9], [4, 6, 7]])
    trie = build_request_trie(1, drafts, max_nodes=16)
    assert trie.draft_nodes[0].tolist() == [1, 2, 3]
    assert trie.tokens.tolist()[:4] == [1, 5, 6, 7]
    assert trie.num_nodes == 1 + 3 + 2 + 3  # shared "5" prefix merged
    # every parent comes before its child, and depth = parent's depth + 1
    for node in range(1, trie.num_nodes):
        parent = int(trie.parents[node])
        assert 0 <= parent < node
        assert int(trie.depths[node]) == int(trie.depths[parent]) + 1
    for k in range(3):
        assert trie.tokens[trie.draft_nodes[k]].tolist() == drafts[k].tolist()
    assert trie.is_chain(4) and not trie.is_chain(5)
    # nodes after the chain go by depth: 4, 8, 6 (depth 1-2) then 9, 7 (depth 3)
    assert trie.truncated(6).num_drafts == 1
    cut = trie.truncated(8)
    assert cut.num_drafts == 2 and int(cut.draft_nodes.max()) < 8
    assert cut.tokens[cut.draft_nodes[1]].tolist() == [5, 8, 9]


def test_trie_drops_trailing_candidates_over_the_budget():
    drafts = torch.tensor([[1, 2], [3, 4], [5, 6]])
    trie = build_request_trie(0, drafts, max_nodes=5)
    assert trie.num_drafts == 2 and trie.num_nodes == 5
    with pytest.raises(ValueError, match="cannot hold one draft"):
        build_request_trie(0, drafts, max_nodes=2)


def test_trie_keeps_each_candidates_source_through_truncation():
    drafts = torch.tensor([[5, 6, 7], [5, 8, 9], [4, 6, 7]])
    trie = build_request_trie(1, drafts, 16, ("argmax", "ngram", "sample"))
    assert trie.sources == ("argmax", "ngram", "sample")
    assert trie.truncated(8).sources == ("argmax", "ngram")
    assert build_request_trie(1, drafts, 6, ("argmax", "ngram", "sample")).sources == \
        ("argmax", "ngram")


def _root_paths(trie) -> set[tuple[int, ...]]:
    """Every node's token path from the root (root excluded)."""
    out = set()
    for node in range(1, trie.num_nodes):
        path, n = [], node
        while n > 0:
            path.append(int(trie.tokens[n]))
            n = int(trie.parents[n])
        out.add(tuple(path[::-1]))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 3, 8, 16])
def test_a_best_first_tree_becomes_a_chain_first_trie_of_its_leaves(seed, budget):
    gen = torch.Generator().manual_seed(seed)
    logprobs = (torch.randn(6, 12, generator=gen) * 2).log_softmax(-1)
    tree = best_first_tree(logprobs, budget)
    trie = best_first_trie(7, tree)
    assert trie.num_nodes == budget + 1 and int(trie.tokens[0]) == 7
    tree_paths = set()
    for node in range(tree.num_nodes):
        path, n = [], node
        while n >= 0:
            path.append(int(tree.tokens[n]))
            n = int(tree.parents[n])
        tree_paths.add(tuple(path[::-1]))
    assert _root_paths(trie) == tree_paths  # the same tree, re-ordered
    for node in range(1, trie.num_nodes):
        parent = int(trie.parents[node])
        assert 0 <= parent < node
        assert int(trie.depths[node]) == int(trie.depths[parent]) + 1
    # candidate 0 is the argmax chain as deep as the tree grew it, nodes 1..L0
    length0 = trie.candidate_length(0)
    assert trie.path(0).tolist() == list(range(1, length0 + 1))
    assert trie.tokens[trie.path(0)].tolist() == logprobs[:length0].argmax(-1).tolist()
    assert trie.is_chain(length0 + 1)
    # one candidate per leaf, each a root-to-leaf path, padding repeating the leaf
    has_child = set(trie.parents.tolist())
    leaves = {n for n in range(1, trie.num_nodes) if n not in has_child}
    assert trie.num_drafts == len(leaves) == len(trie.sources)
    assert {int(trie.path(k)[-1]) for k in range(trie.num_drafts)} == leaves
    for k in range(trie.num_drafts):
        path = trie.path(k).tolist()
        assert [int(trie.parents[n]) for n in path] == [0, *path[:-1]]
        assert set(trie.draft_nodes[k, len(path):].tolist()) <= {path[-1]}
    assert int(trie.lengths.max()) == length0 == trie.gamma


def test_a_cut_best_first_trie_keeps_each_candidates_length():
    # position 1 unsure between 3 tokens, position 2 sure: candidates of lengths 3, 1, 1
    logprobs = torch.log(torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.95, 0.05, 0.0, 0.0],
                                       [0.95, 0.05, 0.0, 0.0]]).clamp_min(1e-9))
    trie = best_first_trie(3, best_first_tree(logprobs, 5))
    assert trie.lengths.tolist() == [3, 1, 1]
    assert trie.tokens.tolist() == [3, 0, 0, 0, 1, 2]
    cut = trie.truncated(5)  # drops the last sibling
    assert cut.lengths.tolist() == [3, 1] and cut.sources == ("argmax", "best_first")
    assert cut.path(1).tolist() == [4]


def test_tau_of_candidates_of_different_lengths_ignores_their_padding():
    log_a = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.9, 0.9, 0.9]]))
    tau = streak_within(log_a, torch.tensor([3, 1]))
    assert torch.allclose(tau, torch.tensor([0.5 + 0.25 + 0.125, 0.9]))
