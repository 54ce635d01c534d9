import math

import torch

from vllm_specdiff.core.scoring import (
    draft_logprob_streak_torch,
    expected_streak,
    score_drafts,
)
from vllm_specdiff.core.tree import build_token_tree

NEG = float("-inf")


def _brute_force_tau(p_of, drafts):
    """tau for each draft from an explicit p(token | prefix) function."""
    taus = []
    for draft in drafts:
        prod, tau = 1.0, 0.0
        for j, token in enumerate(draft):
            prod *= p_of(tuple(draft[:j]))[token]
            tau += prod
        taus.append(tau)
    return taus


def test_tau_matches_hand_computation():
    # verifier over 3 tokens; distribution depends on the path
    table = {(): [0.5, 0.3, 0.2], (0,): [0.1, 0.8, 0.1], (1,): [0.6, 0.2, 0.2],
             (0, 1): [0.3, 0.3, 0.4], (0, 0): [1 / 3] * 3, (1, 0): [0.9, 0.05, 0.05]}
    drafts = [[0, 1, 2], [1, 0, 0], [0, 0, 1]]
    tree = build_token_tree(torch.tensor([2]), torch.tensor([drafts]))
    paths = {}
    for k, draft in enumerate(drafts):
        for j in range(3):
            paths[int(tree.draft_nodes[0, k, j])] = tuple(draft[: j + 1])
    rows = []
    for node in range(tree.num_nodes):
        path = () if node == 0 else paths[node]
        rows.append(torch.tensor(table.get(path, [1 / 3] * 3)).log())
    scores = score_drafts(torch.stack(rows), tree, 1.0)
    expected = _brute_force_tau(lambda prefix: table[prefix], drafts)
    assert torch.allclose(scores.tau[0], torch.tensor(expected), atol=1e-6)
    # a_kj explicitly for draft 0: 0.5, 0.8, 0.4
    assert torch.allclose(scores.log_a[0, 0].exp(), torch.tensor([0.5, 0.8, 0.4]), atol=1e-6)
    assert expected[0] == max(expected)
    assert scores.selected.tolist() == [0]


def test_ties_select_lowest_draft():
    drafts = torch.tensor([[[1, 1], [0, 0], [1, 1]]])
    tree = build_token_tree(torch.tensor([0]), drafts)
    logits = torch.zeros(tree.num_nodes, 2)  # uniform everywhere: all tau equal
    scores = score_drafts(logits, tree, 1.0)
    assert torch.allclose(scores.tau, torch.full((1, 3), 0.75))
    assert scores.selected.tolist() == [0]


def test_greedy_rows_score_zero_or_minus_inf():
    drafts = torch.tensor([[[2, 0], [2, 1]]])
    tree = build_token_tree(torch.tensor([0]), drafts)
    logits = torch.tensor([[0.0, 1.0, 3.0], [0.0, 5.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    scores = score_drafts(logits, tree, 0.0)
    assert scores.log_a[0].tolist() == [[0.0, NEG], [0.0, 0.0]]
    assert scores.tau[0].tolist() == [1.0, 2.0]
    assert scores.selected.tolist() == [1]


def test_top_k_filtered_token_gets_zero_probability():
    drafts = torch.tensor([[[0], [2]]])
    tree = build_token_tree(torch.tensor([1]), drafts)
    logits = torch.tensor([[0.0, 1.0, 2.0, NEG], [0.0] * 4, [0.0] * 4])
    scores = score_drafts(logits, tree, 1.0, top_k=2)
    assert scores.log_a[0, 0, 0] == NEG
    expected = torch.tensor([1.0, 2.0]).softmax(-1)[1]
    assert math.isclose(float(scores.log_a[0, 1, 0].exp()), float(expected), rel_tol=1e-6)
    assert scores.selected.tolist() == [1]


def test_per_request_temperatures_in_a_ragged_batch():
    gen = torch.Generator().manual_seed(3)
    drafts = torch.randint(0, 5, (3, 4, 3), generator=gen)
    tree = build_token_tree(torch.tensor([0, 1, 2]), drafts)
    logits = torch.randn(tree.num_nodes, 5, generator=gen)
    temps = torch.tensor([0.5, 1.0, 2.0])
    log_a, tau, selected = draft_logprob_streak_torch(
        logits, temps[tree.request_index()], tree.tokens, tree.parents, tree.draft_nodes)
    for b in range(3):
        for k in range(4):
            for j in range(3):
                node = tree.draft_nodes[b, k, j]
                parent = tree.parents[node]
                want = (logits[parent] / temps[b]).log_softmax(-1)[tree.tokens[node]]
                assert math.isclose(float(log_a[b, k, j]), float(want), rel_tol=1e-5)
    assert torch.equal(selected, tau.argmax(-1))


def test_expected_streak_no_underflow_at_gamma_32():
    log_a = torch.full((2, 32), -30.0)
    log_a[1, 0] = float("-inf")
    tau = expected_streak(log_a)
    assert tau[0] > 0 and math.isfinite(float(tau[0]))
    assert math.isclose(float(tau[0]), math.exp(-30.0), rel_tol=1e-5)
    assert tau[1] == 0.0
    half = torch.full((1, 32), math.log(0.5))
    assert math.isclose(float(expected_streak(half)), 1 - 0.5 ** 32, rel_tol=1e-6)
