"""Counters every speculative loop reports the same way (reference decoder, vLLM, benchmarks)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


def _grow(counts: list[int], size: int) -> None:
    if len(counts) < size:
        counts.extend([0] * (size - len(counts)))


@dataclass
class SpecDecodeStats:
    """Accumulates verify steps: accepted lengths, per-position acceptance, chosen drafts.

    Per-position acceptance gamma_j = P(token j accepted | tokens 1..j-1 were), estimated as
    (steps that accepted >= j) / (steps that accepted >= j-1 and drafted >= j tokens).
    """

    steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_length_histogram: list[int] = field(default_factory=list)
    position_reached: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    chosen_draft_histogram: list[int] = field(default_factory=list)

    def record(self, num_accepted: torch.Tensor | Sequence[int], gamma: int,
               selected: torch.Tensor | Sequence[int] | None = None, num_drafts: int = 1) -> None:
        """Record one verify step of a batch: accepted draft tokens per request (0..gamma)."""
        accepted = [int(x) for x in (num_accepted.tolist() if isinstance(num_accepted, torch.Tensor)
                                     else num_accepted)]
        if any(a < 0 or a > gamma for a in accepted):
            raise ValueError(f"accepted lengths must be in [0, {gamma}], got {accepted}")
        _grow(self.accepted_length_histogram, gamma + 1)
        _grow(self.position_reached, gamma)
        _grow(self.position_accepted, gamma)
        for a in accepted:
            self.steps += 1
            self.drafted_tokens += gamma
            self.accepted_tokens += a
            self.accepted_length_histogram[a] += 1
            for j in range(min(a + 1, gamma)):
                self.position_reached[j] += 1
            for j in range(a):
                self.position_accepted[j] += 1
        if selected is not None:
            chosen = selected.tolist() if isinstance(selected, torch.Tensor) else selected
            # a best-first tree has as many candidates as leaves
            _grow(self.chosen_draft_histogram, max([num_drafts, *(int(k) + 1 for k in chosen)]))
            for k in chosen:
                self.chosen_draft_histogram[int(k)] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Draft tokens accepted per verify step (the paper's TokensDraft)."""
        return self.accepted_tokens / self.steps if self.steps else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        """Accepted tokens plus the bonus/replacement token, per verify step."""
        return self.mean_accepted_length + 1.0 if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [acc / reached if reached else 0.0
                for acc, reached in zip(self.position_accepted, self.position_reached, strict=True)]

    def merge(self, other: SpecDecodeStats) -> SpecDecodeStats:
        """Add another accumulator's counts into this one (e.g. from several workers)."""
        self.steps += other.steps
        self.drafted_tokens += other.drafted_tokens
        self.accepted_tokens += other.accepted_tokens
        for mine, theirs in ((self.accepted_length_histogram, other.accepted_length_histogram),
                             (self.position_reached, other.position_reached),
                             (self.position_accepted, other.position_accepted),
                             (self.chosen_draft_histogram, other.chosen_draft_histogram)):
            _grow(mine, len(theirs))
            for i, value in enumerate(theirs):
                mine[i] += value
        return self

    def to_dict(self) -> dict[str, object]:
        return {
            "steps": self.steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "mean_accepted_length": self.mean_accepted_length,
            "mean_tokens_per_step": self.mean_tokens_per_step,
            "acceptance_rate": self.acceptance_rate,
            "accepted_length_histogram": list(self.accepted_length_histogram),
            "per_position_acceptance": self.per_position_acceptance,
            "chosen_draft_histogram": list(self.chosen_draft_histogram),
        }
