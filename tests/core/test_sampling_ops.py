"""`core.sampling.filter_logits` keeps exactly the tokens vLLM's own sampler keeps.

Lossless is only lossless against the distribution plain decoding samples from, so the core's
temperature -> top-k -> top-p must agree with vLLM's `apply_top_k_top_p` (the function both its
sampler and its rejection sampler call) token for token, on random logits with ties, per-row
settings and every combination of the two filters. The one freedom: where top-p cuts through
equal logits, the two keep the same number of them but may pick different members.
"""

from __future__ import annotations

import pytest
import torch

from vllm_specdiff.core.sampling import filter_logits, target_probs

pytestmark = pytest.mark.vllm

ROWS, VOCAB = 96, 50


def _logits(seed: int) -> torch.Tensor:
    """Peaked random logits; a third of the rows are rounded so that values tie."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, VOCAB, generator=gen) * 3
    logits[::3] = logits[::3].round()
    return logits


def _settings(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row temperature, top-k (0 = off) and top-p (1 = off), off in some rows."""
    gen = torch.Generator().manual_seed(seed + 1)
    temperature = torch.tensor([0.3, 0.7, 1.0, 1.5])[torch.randint(0, 4, (ROWS,), generator=gen)]
    top_k = torch.tensor([0, 1, 5, 20, VOCAB])[torch.randint(0, 5, (ROWS,), generator=gen)]
    top_p = torch.tensor([1.0, 0.95, 0.9, 0.5, 0.1])[torch.randint(0, 5, (ROWS,), generator=gen)]
    return temperature, top_k, top_p


def _vllm_filter(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's path: logits / temperature, then its top-k/top-p (k = vocab size means off)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    k = None if top_k is None else torch.where(top_k > 0, top_k, VOCAB).to(torch.int32)
    return apply_top_k_top_p(logits / temperature.unsqueeze(1), k, top_p)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("filters", ["top_k", "top_p", "both"])
def test_filter_logits_keeps_what_vllm_keeps(seed, filters):
    logits = _logits(seed)
    temperature, top_k, top_p = _settings(seed)
    k = top_k if filters in ("top_k", "both") else None
    p = top_p if filters in ("top_p", "both") else None
    ours = filter_logits(logits, temperature, k, p)
    theirs = _vllm_filter(logits.clone(), temperature, k, p)
    scaled = logits / temperature.unsqueeze(1)
    _assert_same_up_to_ties_at_the_cut(scaled, ours, theirs)
    kept = torch.isfinite(ours)
    assert torch.allclose(ours[kept], scaled[kept])
    # the filters really removed tokens in this test (else it would prove nothing)
    assert int((~kept).sum()) > ROWS


def _assert_same_up_to_ties_at_the_cut(scaled: torch.Tensor, ours: torch.Tensor,
                                       theirs: torch.Tensor) -> None:
    """Same number of tokens kept per row, and the same tokens except among those whose value
    equals the smallest kept one: top-p may cut through a group of equal logits, and which
    members survive is the sort's arbitrary order (vLLM sorts ascending, the core descending),
    not a different distribution's choice."""
    kept_ours, kept_theirs = torch.isfinite(ours), torch.isfinite(theirs)
    assert torch.equal(kept_ours.sum(-1), kept_theirs.sum(-1))
    cut = scaled.masked_fill(~kept_ours, float("inf")).min(dim=-1, keepdim=True).values
    differ = kept_ours != kept_theirs
    assert bool((scaled[differ] == cut.expand_as(scaled)[differ]).all())


def test_target_probs_equal_vllms_filtered_softmax():
    """Without ties, the distributions are equal (to float rounding)."""
    logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(5)) * 3
    temperature, top_k, top_p = _settings(5)
    ours = target_probs(logits, temperature, top_k, top_p)
    theirs = _vllm_filter(logits.clone(), temperature, top_k, top_p).softmax(dim=-1)
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert int((ours == 0).sum()) > ROWS
