"""Each loss (value and gradient) against an explicit, loop-written formula in float64."""

import math

import pytest
import torch

from vllm_specdiff_training.losses import (
    DPACE_ALPHA,
    LOSSES,
    Targets,
    expected_streak_of,
    get_loss,
)


def _case(n=3, g=5, v=11, k=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, g, v, generator=gen) * 2
    tokens = torch.randint(0, v, (n, g), generator=gen)
    perms = [torch.randperm(v, generator=gen)[:k] for _ in range(n * g)]
    topk_ids = torch.stack(perms).view(n, g, k)
    topk_lps = torch.randn(n, g, k, generator=gen).log_softmax(-1) - 0.3  # top-k mass < 1
    return logits, Targets(tokens, topk_ids, topk_lps)


def _reference(name, logits, t, temp):
    """The formulas of ALGORITHM.md section 4 written out with explicit products and sums."""
    n, g, _ = logits.shape
    out = []
    for b in range(n):
        q = (logits[b] / (temp if name in ("streak", "streak-soft", "position-avg") else 1.0)
             ).softmax(-1)
        if name in ("streak", "position-avg"):
            a = [q[j, t.tokens[b, j]] if t.tokens[b, j] >= 0 else q.new_zeros(()) for j in range(g)]
        elif name == "streak-soft":
            a = [sum((q[j, t.topk_ids[b, j, r]] * t.topk_logprobs[b, j, r].exp()
                      for r in range(t.topk_ids.shape[-1]) if t.topk_ids[b, j, r] >= 0),
                     q.new_zeros(()))
                 for j in range(g)]
        if name in ("streak", "streak-soft"):
            out.append(-sum(torch.prod(torch.stack(a[:j + 1])) for j in range(g)))
        elif name == "position-avg":
            out.append(-sum(a) / g)
        elif name == "mdm":
            cov = [j for j in range(g) if t.tokens[b, j] >= 0]
            out.append(-sum(q[j, t.tokens[b, j]].log() for j in cov) / max(len(cov), 1))
        elif name == "ce-decay":  # weight exp(-(k-1)/(g/2)) at position k
            cov = [j for j in range(g) if t.tokens[b, j] >= 0]
            w = [math.exp(-j / (g / 2)) for j in cov]
            out.append(-sum(wj * q[j, t.tokens[b, j]].log() for wj, j in zip(w, cov, strict=True))
                       / max(sum(w), 1e-6))
        elif name == "dpace":  # w_j = sum_{m>=j} prod_{i<=m} ((1-a) q_i + a), detached
            a = DPACE_ALPHA
            qt = [q[j, t.tokens[b, j]].detach() if t.tokens[b, j] >= 0 else q.new_zeros(())
                  for j in range(g)]
            reach = [math.prod((1 - a) * float(qt[i]) + a for i in range(m + 1)) for m in range(g)]
            w = [sum(reach[j:]) if t.tokens[b, j] >= 0 else 0.0 for j in range(g)]
            cov = [j for j in range(g) if t.tokens[b, j] >= 0]
            out.append(-sum(w[j] * q[j, t.tokens[b, j]].log() for j in cov) / max(sum(w), 1e-6))
        elif name == "kl":
            total, rows = 0.0, 0
            for j in range(g):
                keep = t.topk_ids[b, j] >= 0
                if not keep.any():
                    continue
                p = t.topk_logprobs[b, j][keep].softmax(-1)
                total = total - (p * q[j, t.topk_ids[b, j][keep]].log()).sum()
                rows += 1
            out.append(total / max(rows, 1))
    return torch.stack(out)


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("uncovered", [False, True])
def test_loss_and_gradient_match_explicit_formula(name, uncovered):
    logits, t = _case()
    if uncovered:  # a reduced drafter vocabulary: some verifier tokens have no drafter id
        t.tokens[0, 1] = -1
        t.topk_ids[1, 2, :2] = -1
        t.topk_ids[2, 0, :] = -1
    temp = 1.5
    x = logits.clone().requires_grad_(True)
    ours = get_loss(name)(x, t, temp)
    ours.sum().backward()
    x64 = logits.double().requires_grad_(True)
    t64 = Targets(t.tokens, t.topk_ids, t.topk_logprobs.double())
    ref = _reference(name, x64, t64, temp)
    ref.sum().backward()
    assert ours.shape == (3,)
    torch.testing.assert_close(ours.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["streak", "streak-soft"])
def test_gamma_32_products_do_not_underflow(name):
    # Per-position probabilities ~0.05: the full product is ~1e-42, below float32's normal range.
    g, v = 32, 20
    logits = torch.zeros(2, g, v)
    t = Targets(torch.zeros(2, g, dtype=torch.long), torch.arange(3).expand(2, g, 3).clone(),
                torch.full((2, g, 3), -1.2))
    x = logits.clone().requires_grad_(True)
    ours = get_loss(name)(x, t, 1.0)
    ours.sum().backward()
    x64 = logits.double().requires_grad_(True)
    ref = _reference(name, x64, Targets(t.tokens, t.topk_ids, t.topk_logprobs.double()), 1.0)
    ref.sum().backward()
    assert torch.isfinite(ours).all() and torch.isfinite(x.grad).all()
    torch.testing.assert_close(ours.double(), ref.detach(), rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-10)
    # The first position's factor matters most: its gradient is the largest.
    assert x.grad[0, 0].abs().max() > x.grad[0, 5].abs().max() > x.grad[0, 20].abs().max()


def test_streak_is_minus_expected_streak_and_rewards_leading_positions():
    logits, t = _case()
    tau = expected_streak_of(logits, t, 1.0)
    torch.testing.assert_close(get_loss("streak")(logits, t, 1.0), -tau)
    # Making position 1 certain raises the streak more than making the last position certain.
    first, last = logits.clone(), logits.clone()
    first[:, 0].scatter_(-1, t.tokens[:, :1], 50.0)
    last[:, -1].scatter_(-1, t.tokens[:, -1:], 50.0)
    assert (expected_streak_of(first, t, 1.0) > expected_streak_of(last, t, 1.0)).all()


def test_soft_loss_without_soft_targets_is_a_clear_error():
    logits, t = _case()
    with pytest.raises(ValueError, match="--top-logprobs"):
        get_loss("streak-soft")(logits, Targets(t.tokens), 1.0)
    with pytest.raises(ValueError, match="--loss must be one of"):
        get_loss("nope")
    with pytest.raises(ValueError, match="drafter-temperature"):
        get_loss("streak")(logits, t, 0.0)


def test_dpace_weights_follow_what_the_drafter_gets_right():
    """A position counts while the draft can reach it: once the drafter is sure of position 1
    and wrong at position 2, position 3 weighs less than under a drafter right at both (and
    ce-decay, whose weights are fixed, does not tell the two apart: the negative control)."""
    g, v = 4, 6
    tokens = torch.zeros(1, g, dtype=torch.long)
    right = torch.full((1, g, v), -20.0)
    right[..., 0] = 20.0  # certain of every verifier token
    wrong_2 = right.clone()
    wrong_2[0, 1, 0], wrong_2[0, 1, 1] = -20.0, 20.0  # certain of another token at position 2

    def weight_of_position_3(loss: str, logits: torch.Tensor) -> float:
        x = logits.clone()
        x[0, 2] = 0.0  # position 3 uniform in both, so it has a gradient to compare
        x.requires_grad_(True)
        get_loss(loss)(x, Targets(tokens), 1.0).sum().backward()
        return float(x.grad[0, 2].abs().sum())

    # a = 0.5 smooths q: weights 0.58 of 4.0 against 1.17 of 7.1, a ratio of 0.87
    assert weight_of_position_3("dpace", wrong_2) < 0.9 * weight_of_position_3("dpace", right)
    decay_wrong, decay_right = (weight_of_position_3("ce-decay", x) for x in (wrong_2, right))
    assert decay_wrong == pytest.approx(decay_right, rel=0.05)
