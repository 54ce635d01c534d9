"""Serving-order replay: which windows greedy serving drafts, and the streaks it accepts there."""

import pytest
import torch

from vllm_specdiff_training.data import SequenceData
from vllm_specdiff_training.replay import accepted_streaks, replay_greedy, serving_order

GAMMA = 3
VOCAB = 16


def _data(seqs: list[list[int]], prompt_len: int) -> SequenceData:
    tokens = torch.tensor([t for s in seqs for t in s])
    offsets = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()])
    plens = torch.full((len(seqs),), prompt_len)
    gen = torch.tensor([0, *(offsets[1:] - plens.cumsum(0)).tolist()])
    return SequenceData(tokens, offsets, plens, torch.arange(len(seqs)), gen, None, None, {})


class Oracle:
    """Drafts the true next tokens except at the positions in `wrong` (then a token off by one)."""

    def __init__(self, sequence: torch.Tensor, wrong: set[int]) -> None:
        self.sequence, self.wrong = sequence, wrong

    def window_logits(self, input_ids, starts, gamma):
        pos = starts[..., None] + torch.arange(gamma)  # [B,M,G]: the positions drafted
        ids = self.sequence[pos.clamp(max=self.sequence.numel() - 1)]
        ids = torch.where(torch.isin(pos, torch.tensor(sorted(self.wrong) or [-1])),
                          (ids + 1) % VOCAB, ids)
        return torch.nn.functional.one_hot(ids, VOCAB).float()

    def to_verifier_vocab(self, logits):
        return logits


def test_serving_order_skips_what_each_step_committed():
    assert serving_order([3, 0, 0, 0, 1, 0, 2, 0, 0]) == [3, 1, 2]  # starts 0, 4, 6 (then 9)
    assert serving_order([0, 0, 0]) == [0, 0, 0]
    assert serving_order([]) == []


def test_replay_lands_on_the_hard_positions_that_uniform_windows_underweight():
    seq = list(range(1, 15))  # prompt 3 tokens, continuation 11
    data = _data([seq], prompt_len=3)
    hard = {8}  # one wrong draft position
    drafter = Oracle(torch.tensor(seq), hard)
    streaks = accepted_streaks(drafter, data, 0, GAMMA)
    # windows start at 4 (the first generated token, 3, comes from prefill) up to 14 - 3 = 11
    assert streaks == [3, 3, 2, 1, 0, 3, 3, 3]
    result = replay_greedy(drafter, data, GAMMA)
    assert result["replay_steps"] == 3  # starts 4 (accepts 3), 8 (rejects), 9 (accepts 3)
    assert result["replay_accepted_per_step"] == pytest.approx(2.0)
    assert result["replay_histogram"] == [1, 0, 0, 2]
    assert result["replay_accepted_per_step"] < sum(streaks) / len(streaks)  # 2.25 uniform


def test_replay_refuses_data_too_short_to_draft():
    data = _data([[1, 2, 3, 4, 5]], prompt_len=3)
    with pytest.raises(ValueError, match="nothing to replay"):
        replay_greedy(Oracle(torch.tensor([1, 2, 3, 4, 5]), set()), data, GAMMA)


class SecondChoiceOracle(Oracle):
    """Like Oracle, but sure of itself (logits x 10) and with the true token its second choice
    where it drafts wrong."""

    def window_logits(self, input_ids, starts, gamma):
        wrong = super().window_logits(input_ids, starts, gamma)
        right = Oracle(self.sequence, set()).window_logits(input_ids, starts, gamma)
        return 10 * torch.maximum(wrong, 0.9 * right)


def test_a_best_first_tree_recovers_the_second_choice_that_the_chain_misses():
    seq = list(range(1, 15))
    data = _data([seq], prompt_len=3)
    drafter = SecondChoiceOracle(torch.tensor(seq), {8})
    result = replay_greedy(drafter, data, GAMMA, tree_budgets=(2, 6))
    assert result["replay_accepted_per_step"] == pytest.approx(2.0)  # as the chain above
    # six nodes hold the chain and the true token's branch: every step accepts all three
    assert result["replay_tree6_accepted_per_step"] == pytest.approx(3.0)
    # two nodes: the chain of two, or the two first tokens, never more than two accepted
    assert result["replay_tree2_accepted_per_step"] <= 2.0
    assert result["replay_chain2_accepted_per_step"] <= 2.0
