"""Fused draft log-prob + streak kernel (interpreted) against the core's torch reference."""

import pytest
import torch

from vllm_specdiff.core.scoring import draft_logprob_streak_torch
from vllm_specdiff.core.tree import build_token_tree
from vllm_specdiff_kernels import dispatch
from vllm_specdiff_kernels.draft_logprobs_triton import draft_logprob_streak_triton

# Triton's interpreter converts arrays to index scalars the way NumPy >= 1.25 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

NEG_INF = float("-inf")


def make_case(vocab, temperatures, num_drafts=3, gamma=4, dtype=torch.float32, seed=0):
    """Random tree; logits with -inf holes, and some drafted tokens made the parent's argmax."""
    gen = torch.Generator().manual_seed(seed)
    b = len(temperatures)
    drafts = torch.randint(0, 4, (b, num_drafts, gamma), generator=gen)
    tree = build_token_tree(torch.zeros(b, dtype=torch.long), drafts)
    logits = torch.randn(tree.num_nodes, vocab, generator=gen) * 3
    logits[torch.rand(tree.num_nodes, vocab, generator=gen) < 0.3] = NEG_INF
    scored = torch.nonzero(tree.parents >= 0).squeeze(1)
    hits = scored[torch.rand(scored.shape[0], generator=gen) < 0.6]
    logits[tree.parents[hits], tree.tokens[hits]] = 12.0 + torch.rand(hits.shape[0], generator=gen)
    temp = torch.tensor(temperatures, dtype=torch.float32)[tree.request_index()]
    return (logits.to(dtype), temp, tree.tokens, tree.parents, tree.draft_nodes)


def assert_same_scores(got, want):
    log_a, tau, selected = got
    ref_log_a, ref_tau, ref_selected = want
    assert log_a.dtype == torch.float32 and selected.dtype == torch.int64
    assert torch.equal(torch.isneginf(log_a), torch.isneginf(ref_log_a))
    finite = torch.isfinite(ref_log_a)
    torch.testing.assert_close(log_a[finite], ref_log_a[finite], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tau, ref_tau, atol=1e-5, rtol=1e-5)
    assert torch.equal(selected, ref_selected)


@pytest.mark.parametrize("vocab,block_v,splits,dtype", [
    (333, 128, 1, torch.float32),
    (1000, 256, 3, torch.float16),
    (517, 512, 2, torch.bfloat16),
])
def test_matches_core_reference(vocab, block_v, splits, dtype):
    args = make_case(vocab, [0.7, 0.0, 1.3], dtype=dtype, seed=vocab)
    want = draft_logprob_streak_torch(*args)
    finite = torch.isfinite(want[0])
    assert finite.any() and (~finite).any()  # the case exercises both kinds of entries
    assert (want[0][1] == 0).any()  # some greedy hits
    assert_same_scores(draft_logprob_streak_triton(*args, block_v=block_v, num_splits=splits),
                       want)


def test_vocab_of_256k_not_a_multiple_of_the_block():
    args = make_case(262_147, [1.0], num_drafts=2, gamma=2, seed=4)
    assert_same_scores(draft_logprob_streak_triton(*args, block_v=4096, num_splits=2),
                       draft_logprob_streak_torch(*args))


def _single_step_case(tokens, row, temperature):
    """B = 1, K = len(tokens), gamma = 1: every draft is one child of the root."""
    drafts = torch.tensor(tokens).view(1, len(tokens), 1)
    tree = build_token_tree(torch.zeros(1, dtype=torch.long), drafts)
    logits = row.expand(tree.num_nodes, -1).clone()
    temp = torch.full((tree.num_nodes,), temperature)
    return logits, temp, tree.tokens, tree.parents, tree.draft_nodes


@pytest.mark.parametrize("splits", [1, 3])
def test_greedy_argmax_ties_take_the_lowest_index(splits):
    row = torch.zeros(400)
    row[[5, 7, 300]] = 2.0  # tied maxima inside one block and across blocks/splits
    for tokens, expected_selected in (([7, 5, 300], 1), ([5, 300], 0), ([300, 7], 0)):
        args = _single_step_case(tokens, row, 0.0)
        log_a, tau, selected = draft_logprob_streak_triton(*args, block_v=128, num_splits=splits)
        expected = torch.tensor([0.0 if t == 5 else NEG_INF for t in tokens]).view(1, -1, 1)
        assert torch.equal(log_a, expected)
        assert torch.equal(tau, expected.exp().sum(-1))
        assert int(selected) == expected_selected
        assert_same_scores((log_a, tau, selected), draft_logprob_streak_torch(*args))


def test_tau_ties_select_the_lowest_draft_and_values_are_exact():
    vocab = 50
    row = torch.linspace(-2.0, 3.0, vocab)
    args = _single_step_case([10, 40, 40, 20], row, 0.5)
    log_a, tau, selected = draft_logprob_streak_triton(*args, block_v=16, num_splits=2)
    expected = torch.log_softmax(row / 0.5, dim=0)[[10, 40, 40, 20]]
    torch.testing.assert_close(log_a.view(-1), expected, atol=1e-5, rtol=1e-5)
    assert tau[0, 1] == tau[0, 2]
    assert int(selected) == 1


def test_fully_masked_row_scores_minus_inf_not_nan():
    row = torch.full((300,), NEG_INF)
    args = _single_step_case([3, 4], row, 1.0)
    log_a, tau, selected = draft_logprob_streak_triton(*args, block_v=128)
    assert torch.isneginf(log_a).all()
    assert torch.equal(tau, torch.zeros(1, 2))
    assert int(selected) == 0


def test_dispatch_routes_by_env(monkeypatch):
    args = make_case(300, [1.0, 0.0], seed=8)
    want = draft_logprob_streak_torch(*args)
    got = dispatch.draft_logprob_streak(*args)  # auto on CPU: the core's torch reference
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    monkeypatch.setenv("SPECDIFF_KERNELS", "triton")
    assert_same_scores(dispatch.draft_logprob_streak(*args), want)


def test_bad_inputs_are_rejected():
    logits, temp, tokens, parents, draft_nodes = make_case(64, [1.0], seed=1)
    with pytest.raises(ValueError, match="node_temperature"):
        draft_logprob_streak_triton(logits, temp[:-1], tokens, parents, draft_nodes)
    with pytest.raises(ValueError, match="draft_nodes"):
        draft_logprob_streak_triton(logits, temp, tokens, parents, draft_nodes[0])
    with pytest.raises(ValueError, match="block_v"):
        draft_logprob_streak_triton(logits, temp, tokens, parents, draft_nodes, block_v=100)
