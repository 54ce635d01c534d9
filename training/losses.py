"""Distillation losses on the drafter's window logits (ALGORITHM.md section 4).

Every loss takes logits [N, G, V] for N windows (in the drafter's own vocabulary), plus hard targets
[N, G] and/or the verifier's top-k soft targets [N, G, k], and returns one loss per window [N].
Target ids that the drafter's vocabulary does not cover are -1: their drafter probability is 0.

The acceptance-based losses (`streak`, `streak-soft`, `position-avg`) use the drafter softmax at the
drafting temperature T_d used at inference, because that is the distribution drafts are sampled
from; the cross-entropy baselines (`mdm`, `kl`) use the raw logits (T = 1), as MDM training does.
Products of per-position factors are `exp(cumsum(log a))` in float32 (core `expected_streak`), so
gamma = 32 never underflows to NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_specdiff.core.scoring import expected_streak

NEG_INF = float("-inf")


@dataclass
class Targets:
    """What the verifier says about N windows, in drafter vocabulary ids (-1 = uncovered)."""

    tokens: torch.Tensor  # [N, G] long: the verifier's tokens x_1..x_G
    topk_ids: torch.Tensor | None = None  # [N, G, k] long
    topk_logprobs: torch.Tensor | None = None  # [N, G, k] float: log p_j(x) of those ids


def _gather(log_q: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log q at ids, -inf where id < 0; no log(0) anywhere, so the gradient is never NaN."""
    picked = log_q.gather(-1, ids.clamp(min=0))
    return torch.where(ids >= 0, picked, torch.full_like(picked, NEG_INF))


def drafter_log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T_d) in float32; T_d must be > 0 (a point mass has no gradient)."""
    if temperature <= 0:
        raise ValueError(f"--drafter-temperature must be > 0 for training, got {temperature}")
    return (logits.float() / temperature).log_softmax(dim=-1)


def hard_log_accept(logits: torch.Tensor, targets: Targets, temperature: float) -> torch.Tensor:
    """[N, G] log q_j(x_j): the per-position log acceptance factor on the verifier's tokens."""
    return _gather(drafter_log_probs(logits, temperature), targets.tokens.unsqueeze(-1)).squeeze(-1)


def soft_log_accept(logits: torch.Tensor, targets: Targets, temperature: float) -> torch.Tensor:
    """[N, G] log sum_x q_j(x) p_j(x) over the stored top-k (a lower bound on the full sum)."""
    if targets.topk_ids is None or targets.topk_logprobs is None:
        raise ValueError("this loss needs soft targets: generate the data with --top-logprobs K")
    log_q = drafter_log_probs(logits, temperature)
    terms = _gather(log_q, targets.topk_ids) + targets.topk_logprobs.float()
    return terms.logsumexp(dim=-1)


def streak_loss(logits: torch.Tensor, targets: Targets, temperature: float = 1.0) -> torch.Tensor:
    """-sum_j prod_{k<=j} q_k(x_k): minus the expected accepted length of the verifier's tokens."""
    return -expected_streak(hard_log_accept(logits, targets, temperature))


def streak_soft_loss(logits: torch.Tensor, targets: Targets, temperature: float = 1.0
                     ) -> torch.Tensor:
    """The streak loss with each factor replaced by E_{x~p_j}[q_j(x)] (lower variance)."""
    return -expected_streak(soft_log_accept(logits, targets, temperature))


def position_avg_loss(logits: torch.Tensor, targets: Targets, temperature: float = 1.0
                      ) -> torch.Tensor:
    """DistillSpec-style baseline -(1/G) sum_j q_j(x_j): ignores that acceptance stops at a miss."""
    return -hard_log_accept(logits, targets, temperature).exp().mean(dim=-1)


def mdm_loss(logits: torch.Tensor, targets: Targets, temperature: float = 1.0) -> torch.Tensor:
    """Masked cross-entropy -(1/G') sum_j log q_j(x_j) over the G' positions the vocab covers."""
    del temperature  # cross-entropy baselines train the raw logits
    log_q = logits.float().log_softmax(dim=-1)
    covered = targets.tokens >= 0
    picked = log_q.gather(-1, targets.tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    total = torch.where(covered, picked, torch.zeros_like(picked)).sum(dim=-1)
    return -total / covered.sum(dim=-1).clamp(min=1)


def ce_decay_loss(logits: torch.Tensor, targets: Targets, temperature: float = 1.0
                  ) -> torch.Tensor:
    """Cross-entropy weighted by exp(-(k-1)/g), g = gamma/2 (DFlash: 4 at block 8, ~7 at 16):
    later positions matter less because a draft rarely survives to them."""
    del temperature
    gamma = targets.tokens.shape[-1]
    log_q = logits.float().log_softmax(dim=-1)
    covered = targets.tokens >= 0
    picked = log_q.gather(-1, targets.tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    weight = torch.exp(-torch.arange(gamma, device=logits.device) / max(gamma / 2, 1.0))
    weight = weight * covered
    total = (torch.where(covered, picked, torch.zeros_like(picked)) * weight).sum(dim=-1)
    return -total / weight.sum(dim=-1).clamp(min=1e-6)


DPACE_ALPHA = 0.5  # D-PACE's smoothing: 0 gives the streak loss's weights, 1 a linear decay


def dpace_loss(logits: torch.Tensor, targets: Targets, temperature: float = 1.0) -> torch.Tensor:
    """Cross-entropy weighted by D-PACE (speculators): position j counts by the expected streak
    from j on, w_j = sum_{m>=j} prod_{i<=m} q~_i with q~ = (1-a) q + a and q the drafter's
    probability of the verifier's token, weights detached. Unlike `ce-decay`'s fixed decay,
    the weights follow what the drafter already gets right: a position counts while the draft
    can still reach it."""
    del temperature
    log_q = logits.float().log_softmax(dim=-1)
    covered = targets.tokens >= 0
    picked = log_q.gather(-1, targets.tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(covered, picked, torch.zeros_like(picked))
    with torch.no_grad():
        q = torch.where(covered, picked.exp(), torch.zeros_like(picked))
        reach = ((1 - DPACE_ALPHA) * q + DPACE_ALPHA).cumprod(dim=-1)
        weight = reach.flip(-1).cumsum(-1).flip(-1) * covered
    return -(picked * weight).sum(dim=-1) / weight.sum(dim=-1).clamp(min=1e-6)


def kl_loss(logits: torch.Tensor, targets: Targets, temperature: float = 1.0) -> torch.Tensor:
    """Soft cross-entropy to the verifier's top-k, renormalised over the ids the drafter covers.

    Equal to KL(p_topk || q) up to a constant (the entropy of p), hence the name.
    """
    del temperature
    if targets.topk_ids is None or targets.topk_logprobs is None:
        raise ValueError("--loss kl needs soft targets: generate the data with --top-logprobs K")
    log_q = logits.float().log_softmax(dim=-1)
    covered = targets.topk_ids >= 0
    lp = targets.topk_logprobs.float().masked_fill(~covered, NEG_INF)
    any_covered = covered.any(dim=-1)
    p = torch.where(any_covered.unsqueeze(-1), lp.softmax(dim=-1), torch.zeros_like(lp))
    picked = log_q.gather(-1, targets.topk_ids.clamp(min=0))
    ce = -(p * torch.where(covered, picked, torch.zeros_like(picked))).sum(dim=-1)
    return ce.sum(dim=-1) / any_covered.sum(dim=-1).clamp(min=1)


LossFn = Callable[[torch.Tensor, Targets, float], torch.Tensor]

LOSSES: dict[str, LossFn] = {
    "streak": streak_loss,
    "streak-soft": streak_soft_loss,
    "position-avg": position_avg_loss,
    "mdm": mdm_loss,
    "ce-decay": ce_decay_loss,
    "dpace": dpace_loss,
    "kl": kl_loss,
}
SOFT_LOSSES = frozenset({"streak-soft", "kl"})


def get_loss(name: str) -> LossFn:
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"--loss must be one of {', '.join(LOSSES)}, got {name!r}") from None


def expected_streak_of(logits: torch.Tensor, targets: Targets, temperature: float) -> torch.Tensor:
    """[N] sum_j prod q_k(x_k) on the verifier's tokens: an unbiased estimate of the expected
    accepted length of a draft sampled at T_d (ALGORITHM.md sections 2 and 4 agree in expectation).
    """
    with torch.no_grad():
        return expected_streak(hard_log_accept(logits, targets, temperature))


def greedy_accepted_of(logits: torch.Tensor, targets: Targets) -> torch.Tensor:
    """[N] leading positions where the drafter's argmax is the verifier's token: the accepted
    length of the greedy draft against greedy verifier data (uncovered targets, -1, never match).
    """
    with torch.no_grad():
        return (logits.argmax(dim=-1) == targets.tokens).long().cumprod(dim=-1).sum(dim=-1)
