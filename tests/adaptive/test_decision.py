"""The draft length chosen from the estimates (`vllm_specdiff.adaptive.decision`)."""

from __future__ import annotations

import pytest

from tests.adaptive.simulate import (
    DRAFTER,
    FLAT,
    GAMMA,
    STEEP,
    feed,
    feed_jump,
    feed_lookup,
    plan_steps,
    static_batch_ends,
)
from vllm_specdiff.adaptive import PARAMS, AdaptiveDrafting, TailCredit, choose, expected_tokens


def test_no_draft_under_steep_verifier_cost_and_low_acceptance():
    ctrl = AdaptiveDrafting(GAMMA)
    feed(ctrl, STEEP, DRAFTER, alpha=0.25, rows=16)
    g, rates = ctrl.best(16)
    assert g == 0
    assert rates[0] > 1.2 * rates[GAMMA]


def test_full_gamma_under_flat_cost_and_decent_acceptance():
    ctrl = AdaptiveDrafting(GAMMA)
    feed(ctrl, FLAT, DRAFTER, alpha=0.7, rows=1)
    g, rates = ctrl.best(1)
    assert g == GAMMA
    assert rates[GAMMA] > 2 * rates[0]


def test_steep_cost_and_high_acceptance_picks_a_middle_length():
    ctrl = AdaptiveDrafting(GAMMA)
    feed(ctrl, lambda t: 0.036 + 0.0015 * t, DRAFTER, alpha=0.5, rows=4)
    assert 0 < ctrl.best(4)[0] < GAMMA


def test_at_batch_above_one_a_draft_must_beat_no_draft_by_the_margin():
    margin = PARAMS.draft_margin
    small, large = {0: 100.0, 2: 100.0 * (1 + margin / 2)}, {0: 100.0, 2: 100.0 * (1 + 2 * margin)}
    assert choose(small, rows=16) == 0 and choose(large, rows=16) == 2
    assert choose(small, rows=1) == 2  # one row: no rows to fall apart
    assert choose(small, rows=16, has_drafts=True) == 2  # the step has drafts anyway
    assert choose({0: 100.0, 2: 90.0}, rows=1) == 0


def test_lookup_drafts_get_their_own_acceptance_and_length():
    """A weak drafter and a strong lookup (code): the drafter's length stays short while lookup
    rows draft (nearly) the full gamma (the lookup estimate keeps ~50 rows, so its deepest
    positions are noisy); the lookup observations leave the drafter's estimate alone."""
    ctrl = AdaptiveDrafting(GAMMA, lookup=True)
    feed(ctrl, lambda t: 0.036 + 0.0015 * t, DRAFTER, alpha=0.2, rows=4)
    drafter_alphas = ctrl.acceptance.alphas()
    feed_lookup(ctrl, alpha=0.9, rows=4)
    assert ctrl.acceptance.alphas() == drafter_alphas
    plan = ctrl.plan(4)
    assert plan.gamma < GAMMA // 2 and plan.lookup_gamma >= GAMMA - 1
    assert ctrl.stats()["lookup_gamma_histogram"][plan.lookup_gamma] == 1


def test_lookup_length_drops_to_zero_when_lookup_is_rarely_accepted():
    ctrl = AdaptiveDrafting(GAMMA, lookup=True)
    feed(ctrl, STEEP, DRAFTER, alpha=0.25, rows=16)
    feed_lookup(ctrl, alpha=0.05, rows=16)
    assert ctrl.lookup_length(16) == 0
    assert ctrl.lookup_length(16) < AdaptiveDrafting(GAMMA, lookup=True).lookup_length(16)


def test_lookup_length_keeps_the_margin_at_batch_16():
    """Lookup acceptances whose best length gains less than the margin draft nothing at batch
    16 (the plain argmax would draft); those that gain more still draft."""
    seen = set()
    for alpha in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
        ctrl = AdaptiveDrafting(GAMMA, lookup=True)
        feed_jump(ctrl)
        feed_lookup(ctrl, alpha=alpha, rows=16)
        alphas = ctrl.lookup_acceptance.alphas()
        rates = {g: (16 + 16 * (expected_tokens(alphas, g) - 1))
                 / (ctrl.verifier.predict(16, 16 + 16 * g) + ctrl.overhead) for g in ctrl.choices}
        g = max(rates, key=rates.get)
        gain = rates[g] / rates[0] - 1
        length = ctrl.lookup_length(16)
        if 0 < gain < PARAMS.draft_margin:
            assert length == 0, (alpha, gain)
            seen.add("below")
        elif gain >= PARAMS.draft_margin:
            assert length == g, (alpha, gain)
            seen.add("above")
    assert seen == {"below", "above"}


def test_unrefilled_slots_make_tokens_of_rows_ahead_worth_the_marginal_cost_of_a_row():
    """At batch 16 with 100 ms steps and 1.5 ms per token, a token of a row already ahead of
    the batch's last row saves 1.5 ms when slots stay empty, not the step's 100 / 16 ms: lookup
    drafts for rows ahead that pay in a served batch do not pay in a static one, while drafts
    for every row, which keep the batch together, still do (the whole batch ends sooner)."""
    ctrl = AdaptiveDrafting(GAMMA, lookup=True)
    feed_jump(ctrl)
    ahead = TailCredit.of([GAMMA] * 15 + [0], [True] * 15 + [False], slack=GAMMA)
    assert ahead == TailCredit(matched=0.0, others=1.0, back_matched=0, back_others=1)
    assert ctrl.extra_value(16, credited=0.0) == 1.0  # the prior: slots refilled
    assert ctrl.lookup_length(16, lookup_rows=15, credit=ahead) > 0
    static_batch_ends(ctrl)
    slope = ctrl.verifier.coefficients(16)[1]
    refill = ctrl.refills.ratio()
    rho = 16 * slope / ctrl.verifier.predict(16, 16)
    assert refill < 0.1
    assert ctrl.extra_value(16, credited=0.0) == pytest.approx(refill + (1 - refill) * rho)
    assert ctrl.extra_value(16, credited=0.5) == pytest.approx(
        refill + (1 - refill) * (rho + (1 - rho) * 0.5))
    assert ctrl.extra_value(16, credited=0.0) < 0.35
    assert ctrl.lookup_length(16, lookup_rows=15, credit=ahead) == 0
    assert ctrl.plan(16, lookup_rows=15, credit=ahead).lookup_gamma == 0
    assert ctrl.stats()["credited_share"] == pytest.approx(1 / 16)
    assert ctrl.lookup_length(16) > 0  # every row matching, together
    # together, but one row at the back without a match: the batch's end does not move
    assert ctrl.lookup_length(16, lookup_rows=15, credit=TailCredit.together(16, 15)) == 0
    assert ctrl.extra_value(1, credited=0.0) == 1.0  # one row: its tokens end the batch sooner
    for _ in range(40):  # served again: every departure refilled
        ctrl.observe_rows(continuing=15, departed=1, arrived=1)
    assert ctrl.extra_value(16, credited=0.0) > 0.9
    assert ctrl.lookup_length(16, lookup_rows=15, credit=ahead) > 0


def test_a_catch_up_is_paid_by_a_lone_drafter_step_and_shared_by_a_run():
    """Rows the drafter has not seen for a while (200 tokens each) make a drafter step dear;
    when drafting runs on, the run's steps share that cost, when drafter steps come alone
    (batch 16 on a CPU, steps without drafts between), each pays all of it."""
    ctrl = AdaptiveDrafting(GAMMA)
    feed(ctrl, FLAT, DRAFTER, alpha=0.7, rows=16)
    assert ctrl.best(16)[0] > 0  # steady state: drafting pays
    ctrl.catch_up = 200.0
    for _ in range(300):
        ctrl.runs.add(True)
    assert ctrl.best(16)[0] > 0  # long runs: the catch-up is spread thin
    for step in range(300):
        ctrl.runs.add(step % 2 == 0)
    assert ctrl.best(16)[0] == 0  # lone drafter steps: each pays the whole catch-up
    ctrl.catch_up = None  # negative control: without the catch-up the lone step looks cheap
    assert ctrl.best(16)[0] > 0


def test_tries_choose_between_no_draft_and_the_full_trie():
    ctrl = AdaptiveDrafting(GAMMA, full_tokens=16, chain_choices=False)
    feed(ctrl, FLAT, DRAFTER, alpha=0.6, rows=1)
    assert set(ctrl.rates(1)) == {0, GAMMA}
    assert all(p.gamma in (0, GAMMA) for p in plan_steps(ctrl, 1, 300))
