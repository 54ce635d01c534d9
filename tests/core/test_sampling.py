import math

import pytest
import torch

from vllm_specdiff.core.sampling import draft_marginals, filter_logits, sample_drafts, target_probs

NEG = float("-inf")


def test_temperature_scales_and_zero_leaves_rows_unscaled():
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    out = filter_logits(logits, torch.tensor([0.5, 0.0]))
    assert out.tolist() == [[4.0, 2.0, 0.0], [2.0, 1.0, 0.0]]


def test_top_k_keeps_ties_and_handles_inf():
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0, NEG], [0.0, 5.0, 4.0, 3.0, 2.0]])
    out = filter_logits(logits, 1.0, top_k=torch.tensor([2, 0]))
    assert out[0].tolist() == [3.0, 1.0, 1.0, NEG, NEG]
    assert out[1].tolist() == logits[1].tolist()  # k = 0 disables


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = filter_logits(probs.log(), 1.0, top_p=0.8)
    kept = torch.isfinite(out[0]).tolist()
    assert kept == [True, True, False, False]
    out = filter_logits(probs.log(), 1.0, top_p=0.81)
    assert torch.isfinite(out[0]).tolist() == [True, True, True, False]
    out = filter_logits(probs.log(), 1.0, top_p=0.1)
    assert torch.isfinite(out[0]).tolist() == [True, False, False, False]


def test_target_probs_greedy_rows_are_one_hot():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0]])
    probs = target_probs(logits, torch.tensor([0.0, 1.0]))
    assert probs[0].tolist() == [0.0, 1.0, 0.0]
    expected = torch.tensor([0.0, 3.0, 1.0]).softmax(-1)
    assert torch.allclose(probs[1], expected)


def test_target_probs_top_k_renormalises():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    probs = target_probs(logits, 1.0, top_k=2)
    assert probs[0, 0] == 0
    assert math.isclose(float(probs[0, 2] / probs[0, 1]), math.e, rel_tol=1e-5)


@pytest.mark.parametrize("bad", [{"temperature": -1.0}, {"temperature": float("nan")},
                                 {"top_p": 0.0}, {"top_p": 1.5}])
def test_bad_settings_raise(bad):
    kwargs = {"temperature": 1.0, **bad}
    with pytest.raises(ValueError):
        filter_logits(torch.zeros(1, 3), kwargs.pop("temperature"), **kwargs)


def test_per_row_settings_shape_checked():
    with pytest.raises(ValueError, match="temperature"):
        filter_logits(torch.zeros(2, 3), torch.ones(3))


def test_draft_marginals_temperature_and_greedy():
    logits = torch.tensor([[[0.0, 1.0, 2.0], [2.0, 0.0, 0.0]]])
    q = draft_marginals(logits, 2.0)
    assert torch.allclose(q[0, 0], (logits[0, 0] / 2).softmax(-1))
    assert draft_marginals(logits, 0.0)[0].argmax(-1).tolist() == [2, 0]
    assert draft_marginals(logits, 0.0)[0].sum(-1).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError):
        draft_marginals(logits, -0.1)


def test_sample_drafts_shape_determinism_and_frequencies():
    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([[[0.7, 0.2, 0.1], [0.0, 0.0, 1.0]]])
    drafts = sample_drafts(q, 4000, gen)
    assert drafts.shape == (1, 4000, 2)
    assert bool((drafts[0, :, 1] == 2).all())
    freq = torch.bincount(drafts[0, :, 0], minlength=3).float() / 4000
    assert torch.allclose(freq, q[0, 0], atol=0.03)
    again = sample_drafts(q, 4000, torch.Generator().manual_seed(0))
    assert torch.equal(drafts, again)
    with pytest.raises(ValueError):
        sample_drafts(q, 0)
