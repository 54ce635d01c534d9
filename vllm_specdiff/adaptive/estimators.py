"""What the workload looks like: acceptance per draft position, whether freed slots are
refilled, how long drafting runs last, and which rows are at the back of the batch.

Each is a small online estimate with exponential forgetting; docs/adaptive.md says why each
exists and how it enters the decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_specdiff.adaptive.params import PARAMS, AdaptiveParams


def expected_tokens(alphas: list[float], g: int) -> float:
    """Committed tokens per row when drafting g: 1 + sum_{j<=g} prod_{i<=j} alpha_i."""
    total, run = 1.0, 1.0
    for alpha in alphas[:g]:
        run *= alpha
        total += run
    return total


@dataclass
class Acceptance:
    """Per-position acceptance alpha_j = P(position j accepted | 1..j-1 accepted), with a Beta
    prior and forgetting per drafted row."""

    depth: int
    forget: float = PARAMS.forget
    params: AdaptiveParams = field(default=PARAMS, repr=False)
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reached = [0.0] * self.depth
        self.accepted = [0.0] * self.depth

    def add(self, accepted: int, drafted: int) -> None:
        """One verified row: `accepted` of its `drafted` tokens (positions reached: accepted + 1,
        capped by drafted)."""
        f = self.forget
        self.reached = [f * r for r in self.reached]
        self.accepted = [f * a for a in self.accepted]
        for j in range(min(accepted + 1, drafted, self.depth)):
            self.reached[j] += 1.0
        for j in range(min(accepted, self.depth)):
            self.accepted[j] += 1.0

    def alphas(self) -> list[float]:
        count, mean = self.params.prior_count, self.params.prior_acceptance
        return [(a + count * mean) / (r + count)
                for a, r in zip(self.accepted, self.reached, strict=True)]


@dataclass
class Refills:
    """Requests that arrived while others kept decoding, per request that left meanwhile,
    forgetting old steps: ~1 under continuous batching with a queue, 0 in a static batch.

    An arrival counts against the departures of its step and the step before (the
    replacement's prefill may come a step after the slot freed). Steps where no row continues
    (the rows ended together; the next batch starts) are no evidence: no row waited for
    another. They end an epoch; when that epoch refilled slots, the departures after its last
    refill were the end of the workload (a job's last requests, a server going idle), not a
    static batch, and are taken back.
    """

    params: AdaptiveParams = field(default=PARAMS, repr=False)
    departed: float = field(init=False)
    refilled: float = field(init=False)
    _last_departed: int = 0
    _epoch_refills: float = 0.0
    _tail: float = 0.0  # departures since the epoch's last refill, as counted (forgetting)

    def __post_init__(self) -> None:
        self.departed = self.refilled = self.params.prior_refills

    def add(self, continuing: int, departed: int, arrived: int) -> None:
        if continuing == 0:
            if self._epoch_refills > 0:
                self.departed = max(self.departed - self._tail, self.refilled)
            self._epoch_refills = self._tail = 0.0
            self._last_departed = departed
            return
        if departed == 0 and arrived == 0:
            self._last_departed = 0
            return
        f = self.params.refill_forget
        matched = min(arrived, departed + self._last_departed)
        self.departed = f * self.departed + departed
        self.refilled = f * self.refilled + matched
        self._epoch_refills += matched
        self._tail = 0.0 if matched else f * self._tail + departed
        self._last_departed = departed

    def ratio(self) -> float:
        return min(self.refilled / self.departed, 1.0) if self.departed > 0 else 1.0


@dataclass
class DraftingRuns:
    """How many steps in a row the drafter is called once it is. A row's catch-up (the context
    it was not drafted from: a new request's whole prompt) is encoded once per run, so a run's
    steps share it."""

    params: AdaptiveParams = field(default=PARAMS, repr=False)
    continued: float = 0.0  # drafter steps followed by another (forgetting per step)
    seen: float = 0.0  # drafter steps followed by any step
    last_called: bool = False

    def add(self, calls_drafter: bool) -> None:
        """One step's choice: whether it calls the drafter."""
        self.continued *= self.params.run_forget
        self.seen *= self.params.run_forget
        if self.last_called:
            self.continued += float(calls_drafter)
            self.seen += 1.0
        self.last_called = calls_drafter

    def length(self) -> float:
        """Expected steps of a drafting run (1 / (1 - p)), at most `max_run`."""
        p = self.params
        share = (self.continued + p.prior_run_weight * (1.0 - 1.0 / p.prior_run)) \
            / (self.seen + p.prior_run_weight)
        return p.max_run if 1.0 - share <= 1.0 / p.max_run else 1.0 / (1.0 - share)


@dataclass(frozen=True)
class TailCredit:
    """Rows at the back of the batch, summed as credits over the rows with a lookup match
    (`matched`) and the others: a row with the fewest output tokens since it arrived counts 1,
    one `slack` tokens or more ahead of it 0, linearly between; and how many rows are exactly
    at the back, with a match and without (the batch's end moves only when every one of them
    gains)."""

    matched: float
    others: float
    back_matched: int
    back_others: int

    @classmethod
    def of(cls, progress: list[int], matched: list[bool], slack: float) -> TailCredit:
        """From each row's output tokens since it arrived and whether it has a lookup match."""
        if not progress:
            return cls(0.0, 0.0, 0, 0)
        back = min(progress)
        credit = [max(1.0 - (n - back) / slack, 0.0) if slack > 0 else float(n == back)
                  for n in progress]
        rows = list(zip(progress, credit, matched, strict=True))
        return cls(sum(c for _, c, m in rows if m), sum(c for _, c, m in rows if not m),
                   sum(1 for n, _, m in rows if m and n == back),
                   sum(1 for n, _, m in rows if not m and n == back))

    @classmethod
    def together(cls, rows: int, matched: int) -> TailCredit:
        """Every row at the back (no progress known: a batch that started together)."""
        return cls(float(matched), float(rows - matched), matched, rows - matched)

    def share(self, lookup_extra: float, drafter_extra: float, rows: int, matched: int
              ) -> float:
        """Share of a plan's extra tokens credited: each row's credit times its extra tokens
        (`lookup_extra` for the `matched` rows, `drafter_extra` for the others), over all of
        them; 0 when a row at the back gains nothing (the batch's end does not move)."""
        extra = matched * lookup_extra + (rows - matched) * drafter_extra
        if extra <= 0.0:
            return 1.0
        if (self.back_matched and lookup_extra <= 0.0) or \
                (self.back_others and drafter_extra <= 0.0):
            return 0.0
        return (self.matched * lookup_extra + self.others * drafter_extra) / extra
