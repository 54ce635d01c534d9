"""Acceptance, refills, drafting runs and tail credit (`vllm_specdiff.adaptive.estimators`)."""

from __future__ import annotations

import random

import pytest

from tests.adaptive.simulate import GAMMA, draw_accepted, feed_jump, feed_lookup
from vllm_specdiff.adaptive import (
    PARAMS,
    Acceptance,
    AdaptiveDrafting,
    DraftingRuns,
    Refills,
    TailCredit,
    expected_tokens,
)


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 2) == pytest.approx(1.75)
    assert expected_tokens([1.0] * 8, 8) == 9.0


def test_acceptance_counts_only_positions_that_were_drafted():
    acc = Acceptance(4)
    prior = acc.alphas()
    for _ in range(200):
        acc.add(2, 2)  # drafted 2, accepted both: positions 3, 4 were never verified
    alphas = acc.alphas()
    assert alphas[0] > 0.98 and alphas[1] > 0.98
    assert alphas[2:] == prior[2:]
    for _ in range(2000):
        acc.add(0, 4)
    assert acc.alphas()[0] < 0.02


def _lookup_steps_after_code(forget: float, seed: int) -> int:
    """Batch 16 with the step-cost jump, lookup rates learned on code (0.95 per position), then
    chat: 5 rows with a match per step, accepted at chat's rates; the steps (of 100) on which
    those rows draft lookup tokens, the estimate forgetting `forget` per lookup row."""
    chat = [0.6, 0.55, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4]
    ctrl = AdaptiveDrafting(GAMMA, lookup=True)
    feed_jump(ctrl)
    assert ctrl.lookup_acceptance is not None
    ctrl.lookup_acceptance.forget = forget
    feed_lookup(ctrl, alpha=0.95, rows=16)
    rng, drafting = random.Random(seed), 0
    for _ in range(100):
        g = ctrl.lookup_length(16, lookup_rows=5)
        if g:
            drafting += 1
            ctrl.observe_accepted([draw_accepted(rng, chat, g) for _ in range(5)], [g] * 5,
                                  lookup=[True] * 5)
    return drafting


def test_lookup_rates_learned_on_code_fade_within_a_few_chat_steps():
    """Five matching rows of chat do not pay for a step with drafts at batch 16, but code's
    lookup rates say they do until the estimate has seen enough chat rows: with LOOKUP_FORGET
    those rows draft on 8-13 of 100 steps (the first few, then a retry now and then as the
    estimate drifts back to the prior); with the drafter's forgetting (the negative control,
    the controller before `lookup_forget`) on about 40."""
    assert PARAMS.lookup_forget < PARAMS.forget
    for seed in (1, 2, 3):
        assert 0 < _lookup_steps_after_code(PARAMS.lookup_forget, seed) < 16
        assert _lookup_steps_after_code(PARAMS.forget, seed) > 30


def test_refills_tell_a_static_batch_from_continuous_batching():
    served = Refills()
    for step in range(40):  # a replacement arrives one step after each departure
        served.add(continuing=15, departed=step % 2, arrived=(step + 1) % 2)
    assert served.ratio() > 0.9  # the last departure waits for its replacement
    static = Refills()
    for left in range(15, 0, -1):
        static.add(continuing=left, departed=1, arrived=0)
    assert static.ratio() < 0.1
    for left in range(15, 0, -1):  # served's queue runs dry: its last requests end apart
        served.add(continuing=left, departed=1, arrived=0)
    assert served.ratio() < 0.6  # the end of a workload looks like a static batch ...
    served.add(continuing=0, departed=1, arrived=16)  # ... until the next one starts
    assert served.ratio() > 0.9
    static.add(continuing=0, departed=1, arrived=16)  # a static batch's end stays evidence
    assert static.ratio() < 0.1
    together = Refills()  # a batch ending all at once, the next arriving: no row waited
    together.add(continuing=0, departed=16, arrived=16)
    together.add(continuing=16, departed=0, arrived=0)
    assert together.ratio() == 1.0 and together.departed == PARAMS.prior_refills


def test_tail_credit_counts_the_rows_at_the_back_of_the_batch():
    credit = TailCredit.of([10, 14, 18, 30], [True, False, True, False], slack=8)
    # 18 and 30 are a full draft ahead of the back (10); 14 half of one
    assert credit == TailCredit(matched=1.0, others=0.5, back_matched=1, back_others=0)
    assert credit.share(2.0, 0.0, rows=4, matched=2) == 0.5  # the back row drafts: half counts
    together = TailCredit.of([5] * 4, [True] * 3 + [False], slack=8)
    assert together == TailCredit.together(4, 3)
    assert together.share(2.0, 0.0, rows=4, matched=3) == 0.0  # one back row gains nothing
    assert together.share(2.0, 1.0, rows=4, matched=3) == 1.0  # every row drafts
    assert TailCredit.of([], [], slack=8) == TailCredit(0.0, 0.0, 0, 0)


def test_drafting_runs_measure_how_long_the_drafter_keeps_being_called():
    runs = DraftingRuns()
    assert runs.length() == pytest.approx(PARAMS.prior_run)  # no evidence yet
    for _ in range(300):
        runs.add(True)
    assert runs.length() == PARAMS.max_run
    for step in range(300):  # one drafter step, then one without: runs of one step
        runs.add(step % 2 == 0)
    assert runs.length() < 1.5
    for _ in range(1000):  # no drafter step: the verdict fades back to the prior
        runs.add(False)
    assert runs.length() > 0.9 * PARAMS.prior_run
