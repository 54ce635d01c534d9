"""Best-first draft trees: the budget best prefixes under the product of marginals, checked
against brute-force enumeration, and their greedy acceptance against the verifier's path."""

import itertools

import pytest
import torch

from vllm_specdiff.core.best_first import best_first_tree, chain_tree, greedy_tree_accepted


def _paths(tree) -> set[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for p, t in zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True):
        paths.append((paths[p] if p >= 0 else ()) + (t,))
    return set(paths)


def _brute_force(logprobs: torch.Tensor, budget: int) -> list[tuple[float, tuple[int, ...]]]:
    gamma, vocab = logprobs.shape
    prefixes = []
    for depth in range(1, gamma + 1):
        for path in itertools.product(range(vocab), repeat=depth):
            prefixes.append((sum(logprobs[d, t].item() for d, t in enumerate(path)), path))
    return sorted(prefixes, reverse=True)[:budget]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget", [1, 3, 8, 20])
def test_the_tree_is_the_budget_best_prefixes(seed, budget):
    g = torch.Generator().manual_seed(seed)
    logprobs = (torch.randn(3, 4, generator=g) * 2).log_softmax(-1)
    tree = best_first_tree(logprobs, budget)
    best = _brute_force(logprobs, budget)
    assert tree.num_nodes == budget
    assert _paths(tree) == {p for _, p in best}
    # chosen best first, and a node's parent is chosen before it, one level up
    assert tree.logprobs.tolist() == pytest.approx(sorted(tree.logprobs.tolist(), reverse=True))
    for i, (p, d) in enumerate(zip(tree.parents.tolist(), tree.depths.tolist(), strict=True)):
        assert p < i and d == (tree.depths[p].item() + 1 if p >= 0 else 1)


def test_a_confident_drafter_spends_the_budget_on_its_chain():
    logprobs = torch.full((4, 6), -9.0)
    logprobs[torch.arange(4), torch.tensor([1, 2, 3, 4])] = 0.0
    tree = best_first_tree(logprobs.log_softmax(-1), 4)
    assert tree.tokens.tolist() == [1, 2, 3, 4] and tree.depths.tolist() == [1, 2, 3, 4]


def test_an_unsure_first_position_gets_siblings():
    logprobs = torch.full((3, 5), -9.0)
    logprobs[0, 1] = logprobs[0, 2] = 0.0  # two tokens equally likely first
    logprobs[1, 3] = logprobs[2, 4] = 0.0
    tree = best_first_tree(logprobs.log_softmax(-1), 4)
    assert sorted(tree.tokens[tree.depths == 1].tolist()) == [1, 2]
    chain = chain_tree(logprobs.log_softmax(-1), 3)
    # the verifier takes the second first token: the chain accepts nothing, the tree two
    target = torch.tensor([2, 3, 4])
    assert greedy_tree_accepted(chain, target) == 0
    assert greedy_tree_accepted(tree, target) >= 2


def test_greedy_acceptance_of_a_chain_is_its_argmax_streak():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logprobs = torch.randn(6, 5, generator=g).log_softmax(-1)
        target = torch.randint(0, 5, (6,), generator=g)
        streak = int((logprobs.argmax(-1) == target).int().cumprod(0).sum())
        assert greedy_tree_accepted(chain_tree(logprobs, 6), target) == streak
        # a best-first tree that holds the chain never accepts less
        tree = best_first_tree(logprobs, 64)
        if _paths(chain_tree(logprobs, 6)) <= _paths(tree):
            assert greedy_tree_accepted(tree, target) >= streak


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="budget"):
        best_first_tree(torch.zeros(2, 3), 0)
    with pytest.raises(ValueError, match=r"\[G, V\]"):
        best_first_tree(torch.zeros(3), 2)
