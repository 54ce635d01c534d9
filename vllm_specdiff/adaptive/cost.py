"""The verifier's and the drafter's step costs, learned online from timed steps.

`ForgettingLine` is a least-squares line that forgets old data (the drafter's cost in the
tokens it encodes). `VerifierCost` prices a verifier step of (rows, tokens): a line per
batch-size bucket fitted to steps with drafts, each exact (rows, tokens) measured often enough
priced by its own mean, all relative to the host's speed. docs/adaptive.md says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_specdiff.adaptive.params import PARAMS, AdaptiveParams


@dataclass
class ForgettingLine:
    """Weighted least-squares line y = a + b * x with exponential forgetting and a fixed
    pseudo-observation at the origin (so one distinct x still gives a line: proportional)."""

    forget: float = PARAMS.forget
    prior_weight: float = PARAMS.prior_weight
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


@dataclass
class CostPoint:
    """The forgetting mean of the costs measured at one (batch size, token count); it forgets
    at the pace of its bucket's observations, so a count measured long ago loses its say."""

    mean: float = 0.0
    raw_weight: float = 0.0
    seen_at: int = 0  # the bucket's observation count when last updated
    forget: float = PARAMS.forget

    def weight(self, now: int) -> float:
        return self.raw_weight * self.forget ** (now - self.seen_at)

    def add(self, seconds: float, now: int) -> None:
        w = self.weight(now)
        self.mean = (w * self.mean + seconds) / (w + 1.0)
        self.raw_weight, self.seen_at = w + 1.0, now


def rows_bucket(rows: int) -> int:
    """Batch sizes that share one verifier line: 1, 2-3, 4-7, 8-15, 16-31, ..."""
    return max(rows, 1).bit_length()


class VerifierCost:
    """The verifier's step cost, one forgetting line in tokens per batch-size bucket (per-row
    costs, attention over each row's context, make one line across batch sizes wrong).

    Costs are kept relative to the host's speed (`speed`, seconds per unit of shape): a step
    measured at a well-known (batch size, token count) updates the speed, every step is stored
    divided by it, and predictions are multiplied by it, so a slow phase of the host raises the
    speed, not the cost of the draft length in use.

    The lines are fitted to steps with drafts only. A bucket whose draft steps all sit at one
    token count keeps their level and takes as slope the chord to its draft-free cost, else the
    slope of the nearest bucket that has one (none: proportional to tokens, pessimistic); a
    bucket without draft steps uses the nearest bucket's line.
    """

    def __init__(self, min_spread: float, speed_forget: float | None = None,
                 params: AdaptiveParams = PARAMS) -> None:
        self.params = params
        self.min_spread = min_spread
        # 1: the speed never moves (costs in seconds)
        self.speed_forget = params.speed_forget if speed_forget is None else speed_forget
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
            if self.point_weight(rows, tokens) >= self.params.point_weight else 0.0
        if shape > 0.0:  # a point measured only at 0 s (a clock that did not move) has no shape
            f = self.speed_forget
            self.speed = f * self.speed + (1.0 - f) * seconds / shape
        seconds /= self.speed
        bucket = rows_bucket(rows)
        self.observations[bucket] = self.observations.get(bucket, 0) + 1
        if tokens > rows:
            self.lines.setdefault(bucket, ForgettingLine(
                forget=self.params.forget, prior_weight=0.0)).add(tokens, seconds)
        key = (rows, round(tokens))
        self.points.setdefault(key, CostPoint(forget=self.params.forget)).add(
            seconds, self.observations[bucket])
        if len(self.points) > self.params.max_points:
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

    def _memoised(self, kind: str, rows: int, compute: Callable[[int], Any]) -> Any:
        """`compute(rows)`, computed once until the next measurement (`add` clears the memo)."""
        key = (kind, rows)
        if key not in self._memo:
            self._memo[key] = compute(rows)
        return self._memo[key]

    def priced_by_point(self, rows: int, tokens: float) -> bool:
        """Whether this exact (rows, tokens) is priced by its own measured mean: from
        `point_weight` effective observations, at one row from `one_row_point_weight`."""
        p = self.params
        needed = p.one_row_point_weight if rows == 1 else p.point_weight
        return self.point_weight(rows, tokens) >= needed

    def predict(self, rows: int, tokens: float) -> float | None:
        """The mean measured at exactly (rows, tokens) when it is `priced_by_point`, else the
        line; above one row never below this batch size's measured draft-free step plus the
        line's cost of the extra tokens (a bucket's line can price a step with drafts below
        the same batch size's step without, which made drafts look free). One row has its own
        bucket, and its draft-free steps are rare probes, dearer than in use, so they floor
        nothing there. Seconds at the current speed."""
        if self.priced_by_point(rows, tokens):
            return self.speed * max(self.points[(rows, round(tokens))].mean, 1e-6)
        coef = self._shape_coefficients(rows)
        if coef is None:
            return None
        cost = coef[0] + coef[1] * tokens
        if rows > 1 and tokens > rows and self.point_weight(rows, rows) >= self.params.point_weight:
            cost = max(cost, self.points[(rows, rows)].mean + coef[1] * (tokens - rows))
        return self.speed * max(cost, 1e-6)
