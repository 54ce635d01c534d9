"""The probe schedule: steps that draft something other than the chosen length, so every
estimate stays measured.

Probes are spaced so their expected loss stays near `probe_budget` of the serving time, after
a ramp of 1, 8, 64, ... steps. At one row every other probe is a trial: `trial_steps` steps at
the neighbouring length with the higher predicted rate, the first (cold) not measured; the
others draft the least-measured length. docs/adaptive.md says why.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from vllm_specdiff.adaptive.cost import rows_bucket
from vllm_specdiff.adaptive.params import PARAMS, AdaptiveParams


def least_measured(g: int, choices: list[int], gamma: int, weight: Callable[[int], float]
                   ) -> int:
    """The allowed length other than g with the least `weight` (its cost's effective
    observations; ties: gamma first, then 0, 1, ...)."""
    others = [n for n in choices if n != g]
    order = sorted(others, key=lambda n: (n != gamma, n))
    return min(order, key=weight)


class ProbeSchedule:
    """When the next probe is due, and the state of a one-row trial."""

    def __init__(self, params: AdaptiveParams = PARAMS) -> None:
        self.params = params
        self.done = 0  # probes so far
        self.next_step = 1  # the step the next probe is due at
        self.interval = 1  # steps between the last two probes
        self.per_bucket: dict[int, int] = {}  # probes per batch-size bucket
        self.trial_gamma = 0  # a one-row trial's length and its steps still to come
        self.trial_left = 0
        self.skip_cold = False  # the next one-row step is a trial's first (cold): not measured

    def trial_step(self, rows: int) -> int | None:
        """This step's length when a one-row trial goes on (None: none; more rows end it)."""
        if rows != 1:
            self.trial_left = 0
        if self.trial_left > 0:
            self.trial_left -= 1
            return self.trial_gamma
        return None

    def due(self, step: int, rows: int, identified: bool) -> bool:
        """Whether step `step` probes: its time has come, or a batch size whose cost slope is
        not measured yet (`identified` False) gets its first `new_size_probes` probes at once."""
        new_size = not identified \
            and self.per_bucket.get(rows_bucket(rows), 0) < self.params.new_size_probes
        return rows > 0 and (step >= self.next_step or new_size)

    def count(self, rows: int) -> None:
        """A probe of this batch size starts."""
        bucket = rows_bucket(rows)
        self.per_bucket[bucket] = self.per_bucket.get(bucket, 0) + 1

    def one_row_length(self, g: int, rates: dict[int, float],
                       least: Callable[[int], int]) -> int:
        """One row's probe length: every other probe starts a trial of the neighbour of g
        (g - 1 or g + 1) with the higher predicted rate; the others probe `least(g)`."""
        neighbours = [n for n in (g - 1, g + 1) if n in rates]
        if self.done % 2 == 1 and neighbours:
            self.trial_gamma = max(neighbours, key=lambda n: rates[n])
            self.trial_left = self.params.trial_steps - 1
            self.skip_cold = True
            return self.trial_gamma
        return least(g)

    def schedule(self, step: int, loss: float | None, cost: float | None) -> None:
        """After the probe at `step`: the next one comes when its expected `loss` (seconds
        beyond its tokens' worth; a trial's for each of its steps) is about `probe_budget` of
        the serving time at the chosen step `cost`, capped by the ramp."""
        p = self.params
        self.done += 1
        interval = p.max_probe_interval
        if loss is not None and self.trial_left:
            loss *= p.trial_steps
        if loss is not None and cost and math.isfinite(cost):
            interval = math.ceil(loss / (p.probe_budget * cost)) if loss > 0 \
                else p.min_probe_interval
            interval = min(max(interval, p.min_probe_interval), p.max_probe_interval)
        interval = min(interval, p.ramp_base ** (self.done - 1))
        self.interval = interval
        self.next_step = step + interval
