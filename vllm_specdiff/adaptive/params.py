"""Every tuning constant of adaptive drafting, in one frozen object.

The reasons, with what was measured, are in docs/adaptive.md; each field keeps a one-line
summary. Tests build variants with `dataclasses.replace(PARAMS, ...)` (negative controls).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptiveParams:
    """Constants of the cost model, the estimators, the decision and the probe schedule."""

    # Forgetting per observation: memory of ~200 steps (costs) or drafted rows (acceptance).
    forget: float = 0.995
    # Weight of the pseudo-observation (0, 0): one token count alone gives a proportional line.
    prior_weight: float = 0.05
    # Beta prior of each position's acceptance: its mean ...
    prior_acceptance: float = 0.5
    # ... and its pseudo-count.
    prior_count: float = 2.0
    # Expected share of serving time the probes may cost.
    probe_budget: float = 0.005
    # Fewest steps between two probes once the ramp is over.
    min_probe_interval: int = 8
    # Most steps between two probes: estimates never go unmeasured for longer.
    max_probe_interval: int = 256
    # The first probes come after 1, 8, 64, ... steps: a fresh engine learns its costs at once.
    ramp_base: int = 8
    # A cost sample above this multiple of its prediction is clipped to it (pauses, GC).
    clip_factor: float = 3.0
    # Observations behind a prediction before a sample can be clipped.
    clip_after: float = 5.0
    # Effective observations at one exact (rows, tokens) before its own mean replaces the line.
    point_weight: float = 1.0
    # At one row a count's own mean prices it this long (~600 steps): probes return rarely.
    one_row_point_weight: float = 0.05
    # Host speed forgetting per well-known step (memory ~10): slow phases move every cost alike.
    speed_forget: float = 0.9
    # A one-row trial's steps at a neighbouring length, the first (cold) not measured.
    trial_steps: int = 3
    # Measured (rows, tokens) points kept; beyond, the least-weighted half is dropped.
    max_points: int = 1024
    # Share a step with drafts must gain over one without at batch > 1 (rows finish apart).
    draft_margin: float = 0.1
    # Prompt lookup's acceptance forgetting per lookup row (memory ~50): it follows the text.
    lookup_forget: float = 0.98
    # Refill evidence forgetting per step where rows left or arrived (memory ~20 such steps).
    refill_forget: float = 0.95
    # Prior departures and refills: a fresh engine values tokens as a server would.
    prior_refills: float = 1.0
    # Drafting-run evidence forgetting per step, so a verdict of short runs fades.
    run_forget: float = 0.99
    # Prior expected drafting-run length in steps ...
    prior_run: float = 20.0
    # ... worth this many observations.
    prior_run_weight: float = 2.0
    # Longest drafting run counted: a catch-up is never spread thinner.
    max_run: float = 100.0
    # Weight of a new sample in the proposer-overhead and full-draft-size running means.
    smoothing: float = 0.1
    # Token-count spread a batch bucket's draft steps need for a slope of their own, per gamma^2.
    min_spread_per_gamma2: float = 0.25
    # Probes a batch size without a measured slope gets at once, before the schedule.
    new_size_probes: int = 2


PARAMS = AdaptiveParams()
# The `draft_margin` option's default (read by the plugin's config).
DRAFT_MARGIN = PARAMS.draft_margin
