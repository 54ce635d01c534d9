"""`"selection": "tree"`: the pieces of the multi-candidate tree walk that need no engine (which
candidate a walk is attributed to, children tried, which requests the walk may serve, the
option). The engine runs are tests/engine/test_tree_selection.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.vllm


# ---- pieces (no engine) ---------------------------------------------------------------------
def _trie():
    from vllm_specdiff.core.trie import build_request_trie

    # root -> 5 -> 6 -> 7 (candidate 0), 5 -> 8 -> 9 (candidate 1), 4 -> 6 -> 7 (candidate 2)
    return build_request_trie(1, torch.tensor([[5, 6, 7], [5, 8, 9], [4, 6, 7]]), 16)


def test_walk_is_attributed_to_the_lowest_candidate_holding_its_path():
    from vllm_specdiff.plugin.tree_runner import walk_candidate

    trie = _trie()
    c0, c1, c2 = (trie.draft_nodes[k] for k in range(3))
    assert walk_candidate(trie, c0[:0]) == 0
    assert walk_candidate(trie, c1[:1]) == 0  # "5" is shared by candidates 0 and 1
    assert walk_candidate(trie, c1[:2]) == 1
    assert walk_candidate(trie, c2) == 2
    cut = trie.truncated(8)  # candidate 2 dropped, its first two nodes kept
    assert cut.num_drafts == 2 and walk_candidate(cut, c2[:2]) == 0
    assert walk_candidate(cut, c1) == 1


def test_several_children_tried_is_read_off_the_path():
    from vllm_specdiff.plugin.tree_runner import tried_several_children

    trie = _trie()
    c0, c1, c2 = (trie.draft_nodes[k] for k in range(3))
    assert not tried_several_children(trie, c0)  # first child everywhere, full path
    assert tried_several_children(trie, c0[:0])  # the root's two children both rejected
    assert not tried_several_children(trie, c0[:2])  # node "6" has one child
    assert tried_several_children(trie, c1[:2])  # "8" is the second child of "5"
    assert tried_several_children(trie, c2[:1])


def test_tree_rule_eligibility_names_what_needs_vllms_chain():
    from vllm import SamplingParams

    from vllm_specdiff.plugin.tree_runner import tree_rule_eligible

    assert tree_rule_eligible(SamplingParams(temperature=0.7, top_k=3, top_p=0.9, seed=4))
    for settings in ({"logprobs": 2}, {"logprob_token_ids": [1]}, {"min_p": 0.1},
                     {"logit_bias": {3: 1.0}}, {"allowed_token_ids": [3, 4]},
                     {"min_tokens": 2}, {"thinking_token_budget": 8}):
        assert not tree_rule_eligible(SamplingParams(**settings)), settings


def test_tree_selection_parses():
    from vllm_specdiff.plugin.config import parse_specdiff_config

    assert parse_specdiff_config({"specdiff": {"num_drafts": 2, "selection": "tree"}},
                                 4).selection == \
        "tree"
