"""T_d = 0: the proposer takes the drafter's argmax directly; it must equal sampling from the
one-hot marginals, ties and -inf entries (reduced heads) included."""

import torch

from vllm_specdiff.core import draft_marginals, sample_drafts


def test_argmax_equals_sampling_the_one_hot_marginals():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 8, 50, generator=gen).round(decimals=1)  # rounding makes ties
    logits[:, :, 30:] = float("-inf")  # ids a reduced head does not cover
    logits[0, 0, :] = 0.0  # an all-tie row: the lowest id
    logits[0, 0, 30:] = float("-inf")
    drafts = sample_drafts(draft_marginals(logits, 0.0), 1, generator=gen)[:, 0]
    assert torch.equal(drafts, logits.argmax(-1))
    assert int(drafts[0, 0]) == 0
