"""The reference decoder against plain decoding with tiny random models (vocabulary 8)."""

import pytest
import torch
from scipy.stats import chisquare

from tests.conftest import make_tiny_llama
from vllm_specdiff.reference import (
    ReferenceDecoder,
    chi_square_pvalue,
    exact_first_three,
    first_three_counts,
    plain_generate,
)

V = 8
PROMPT = [1, 5, 2]


def noisy_oracle_drafter(verifier, noise: float, seed: int = 0):
    """Drafter that looks ahead with the verifier's greedy path plus noise: it is right often
    enough to exercise multi-token acceptance and wrong often enough to exercise rejection."""
    gen = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def draft(context: torch.Tensor, gamma: int) -> torch.Tensor:
        ids = context.clone()
        rows = []
        for _ in range(gamma):
            logits = verifier(input_ids=ids.unsqueeze(0)).logits[0, -1]
            rows.append(logits + noise * torch.randn(V, generator=gen))
            ids = torch.cat([ids, logits.argmax().view(1)])
        return torch.stack(rows)

    return draft


def table_drafter(seed: int, scale: float = 2.0):
    """A cheap drafter: fixed random logits per (last token, position); no forward pass."""
    table = torch.randn(V, 8, V, generator=torch.Generator().manual_seed(seed)) * scale

    def draft(context: torch.Tensor, gamma: int) -> torch.Tensor:
        return table[int(context[-1]), :gamma]

    return draft


@pytest.mark.parametrize("gamma,num_drafts,rule", [
    (1, 1, "point-mass"), (3, 1, "point-mass"), (5, 4, "point-mass"),
    (3, 4, "tree"), (6, 2, "tree"), (4, 1, "standard"),
])
def test_greedy_is_token_identical(gamma, num_drafts, rule):
    verifier = make_tiny_llama(V, seed=1)
    expected = plain_generate(verifier, PROMPT, 30)
    decoder = ReferenceDecoder(verifier, noisy_oracle_drafter(verifier, 2.0), gamma=gamma,
                               num_drafts=num_drafts, rule=rule, drafter_temperature=1.0)
    result = decoder.generate(PROMPT, 30, generator=torch.Generator().manual_seed(0))
    assert result.tokens == expected
    assert result.stats.steps < 30 or gamma == 1
    assert result.stats.accepted_tokens > 0


def test_sampled_first_three_tokens_match_plain_sampling():
    """Chi-square (p > 1e-3) of 2000 speculative samples against the verifier's exact joint."""
    verifier = make_tiny_llama(V, seed=2, logit_scale=10.0)
    exact = exact_first_three(verifier, PROMPT)
    decoder = ReferenceDecoder(verifier, table_drafter(3), gamma=2, num_drafts=3,
                               temperature=1.0, drafter_temperature=1.0)
    trials = 2000
    counts, accepted = first_three_counts(decoder, PROMPT, trials,
                                          torch.Generator().manual_seed(11))
    pvalue = chi_square_pvalue(counts, exact)
    assert pvalue > 1e-3, f"p-value {pvalue:.2e}"
    assert accepted > trials // 4  # drafts really were accepted


def test_exact_joint_sums_to_one():
    joint = exact_first_three(make_tiny_llama(V, seed=2), PROMPT)
    assert torch.isclose(joint.sum(), torch.tensor(1.0, dtype=torch.float64), atol=1e-4)


def test_chi_square_refuses_counts_too_few_for_the_test():
    probs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    assert chi_square_pvalue(torch.tensor([5.0, 3.0, 2.0]), probs) == 1.0  # two cells: a test
    with pytest.raises(ValueError, match="too few counts"):
        chi_square_pvalue(torch.tensor([3.0, 1.0, 0.0]), probs)  # one pooled cell: none


def test_chi_square_matches_scipy_with_pooled_cells():
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(50, generator=gen, dtype=torch.float64)
    probs /= probs.sum()
    counts = torch.multinomial(probs.float(), 300, replacement=True,
                               generator=gen).bincount(minlength=50).double()
    expected = probs * counts.sum()
    keep = expected >= 5
    assert not keep.all()  # some cells are pooled
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    assert chi_square_pvalue(counts, probs) == pytest.approx(chisquare(obs.numpy(),
                                                                       exp.numpy()).pvalue)


def test_bad_configuration_is_rejected():
    verifier = make_tiny_llama(V)
    drafter = noisy_oracle_drafter(verifier, 1.0)
    with pytest.raises(ValueError, match="num_drafts=1"):
        ReferenceDecoder(verifier, drafter, gamma=2, num_drafts=2, rule="standard")
    with pytest.raises(ValueError, match="rule"):
        ReferenceDecoder(verifier, drafter, gamma=2, rule="nope")
    with pytest.raises(ValueError, match="gamma"):
        ReferenceDecoder(verifier, drafter, gamma=0)
    decoder = ReferenceDecoder(verifier, lambda ctx, g: torch.zeros(g, V + 1), gamma=2)
    with pytest.raises(ValueError, match="vocabulary"):
        decoder.generate(PROMPT, 3)
