"""What the suite counts per engine: vLLM's spec-decode counters (drafts, draft and accepted
tokens, per position) and the SpecDiff proposer's own (drafter time, rows, chosen lengths), with
the arithmetic of their differences and sums between snapshots."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _add_lists(a: list[int], b: list[int], sign: int = 1) -> list[int]:
    """a + sign * b element-wise; an empty list counts as zeros."""
    if not a or not b:
        return list(a) if a else [sign * v for v in b]
    return [x + sign * y for x, y in zip(a, b, strict=True)]


@dataclass
class ProposerCounts:
    """The SpecDiff proposer's own counters (all zero for other methods): drafter time and
    calls, rows drafted (by the drafter or by prompt lookup) and by lookup, and adaptive
    drafting's histograms of chosen drafter and lookup lengths ([] when it is off), and with
    best-first trees under adaptive drafting the steps that drafted each shape ({} otherwise),
    and the steps without a drafter call with their seconds (what a no-draft step costs)."""

    drafter_seconds: float = 0.0
    propose_calls: int = 0
    drafted_rows: int = 0
    lookup_drafts: int = 0
    gamma_histogram: list[int] = field(default_factory=list)
    lookup_gamma_histogram: list[int] = field(default_factory=list)
    shape_steps: dict[str, int] = field(default_factory=dict)
    idle_steps: int = 0  # steps the drafter drafted no row in, and their seconds
    idle_seconds: float = 0.0

    @classmethod
    def of(cls, proposer: dict[str, Any]) -> ProposerCounts:
        adaptive = proposer.get("adaptive") or {}
        shapes = (proposer.get("tree") or {}).get("shapes") or {}
        return cls(float(proposer.get("drafter_seconds", 0.0)),
                   int(proposer.get("propose_calls", 0)), int(proposer.get("drafted_rows", 0)),
                   int(proposer.get("lookup_drafts", 0)),
                   list(adaptive.get("chosen_gamma_histogram") or []),
                   list(adaptive.get("lookup_gamma_histogram") or []),
                   dict(shapes.get("steps") or {}), int(proposer.get("idle_steps", 0)),
                   float(proposer.get("idle_seconds", 0.0)))

    def plus(self, other: ProposerCounts, sign: int = 1) -> ProposerCounts:
        return ProposerCounts(
            self.drafter_seconds + sign * other.drafter_seconds,
            self.propose_calls + sign * other.propose_calls,
            self.drafted_rows + sign * other.drafted_rows,
            self.lookup_drafts + sign * other.lookup_drafts,
            _add_lists(self.gamma_histogram, other.gamma_histogram, sign),
            _add_lists(self.lookup_gamma_histogram, other.lookup_gamma_histogram, sign),
            {k: self.shape_steps.get(k, 0) + sign * other.shape_steps.get(k, 0)
             for k in {*self.shape_steps, *other.shape_steps}},
            self.idle_steps + sign * other.idle_steps,
            self.idle_seconds + sign * other.idle_seconds)


COUNTS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PER_POS = ("num_accepted_tokens_per_pos", "num_draft_tokens_per_pos")


class SpecCounters:
    """vLLM's spec-decode counts (drafts, draft and accepted tokens, accepted per position) of
    one engine, summed from the scheduler stats its logger manager receives every step.

    `LLM.get_metrics()` cannot be used with several engines: vLLM's Prometheus collectors are
    process-global and each new engine unregisters the previous ones, so only the engine built
    last would be counted.
    """

    def __init__(self, llm: Any) -> None:
        self.totals: dict[str, Any] = {**dict.fromkeys(COUNTS, 0),
                                       **{key: [] for key in PER_POS}}
        manager = llm.llm_engine.logger_manager
        if manager is None:
            raise ValueError("the bench needs vLLM's stats (engine built with "
                             "disable_log_stats=False)")
        record = manager.record

        def counted(scheduler_stats: Any, *args: Any, **kwargs: Any) -> Any:
            spec = getattr(scheduler_stats, "spec_decoding_stats", None)
            if spec is not None:
                self.observe(spec)
            return record(scheduler_stats, *args, **kwargs)

        manager.record = counted

    def observe(self, spec: Any) -> None:
        for key in COUNTS:
            self.totals[key] += getattr(spec, key)
        for key in PER_POS:
            per_pos = list(getattr(spec, key, None) or [])
            prev = self.totals[key] or [0] * len(per_pos)
            if per_pos:
                self.totals[key] = [a + b for a, b in zip(prev, per_pos, strict=True)]

    def snapshot(self) -> dict[str, Any]:
        return {**self.totals, **{key: list(self.totals[key]) for key in PER_POS}}


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """vLLM's counts of one engine between two snapshots."""
    out: dict[str, Any] = {}
    for key in (*COUNTS, *PER_POS):
        value, prev = after[key], before.get(key)
        if isinstance(value, list):
            prev = prev or [0] * len(value)
            out[key] = [a - b for a, b in zip(value, prev, strict=True)]
        else:
            out[key] = value - (prev or 0)
    return out


def accumulate(total: dict[str, Any], counts: dict[str, Any]) -> None:
    """Add counts (numbers and per-position lists) into total."""
    for key, value in counts.items():
        if isinstance(value, list):
            if value:
                prev = total.get(key) or [0] * len(value)
                total[key] = [a + b for a, b in zip(prev, value, strict=True)]
        else:
            total[key] = total.get(key, 0) + value
