"""A request's chain-first trie (`core/trie.py`): candidate 0 first, truncation to a trie,
trailing candidates dropped over the node budget, each candidate's source kept."""

from __future__ import annotations

import pytest
import torch

from vllm_specdiff.core.trie import build_request_trie


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
