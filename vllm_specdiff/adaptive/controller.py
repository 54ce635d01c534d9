"""`AdaptiveDrafting`: the object the proposer asks, every step, how many tokens to draft.

It is a `DraftPricing` (the estimates and the price of each length) that takes the proposer's
measurements (`observe_*`), plans each step (`plan`: the best length, a probe when one is due,
prompt lookup's own length) and reports what it learned (`summary`, `stats`). docs/adaptive.md
describes the whole.
"""

from __future__ import annotations

from dataclasses import replace

from vllm_specdiff.adaptive.cost import ForgettingLine
from vllm_specdiff.adaptive.decision import DraftPricing, Plan
from vllm_specdiff.adaptive.estimators import TailCredit
from vllm_specdiff.adaptive.params import PARAMS, AdaptiveParams
from vllm_specdiff.adaptive.probes import ProbeSchedule, least_measured


class AdaptiveDrafting(DraftPricing):
    """Chooses the draft length per step; the arguments are `DraftPricing`'s."""

    def __init__(self, gamma: int, full_tokens: float | None = None,
                 chain_choices: bool = True, lookup: bool = False,
                 margin: float | None = None, refill_ratio: float | None = None,
                 params: AdaptiveParams = PARAMS) -> None:
        super().__init__(gamma, full_tokens, chain_choices, lookup, margin, refill_ratio,
                         params)
        self.probes = ProbeSchedule(params)
        self.steps = 0
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
        trial's first step is not measured: see `ProbeSchedule`)."""
        if self.probes.skip_cold:  # only the step right after the plan (the batch may have grown)
            self.probes.skip_cold = False
            if rows == 1:
                return
        predicted = self.verifier.predict(rows, tokens) \
            if self.verifier.weight(rows) >= self.params.clip_after else None
        if predicted is not None:
            seconds = min(seconds, self.params.clip_factor * predicted)
        self.verifier.add(rows, float(tokens), seconds)

    def observe_drafter(self, tokens: int, seconds: float) -> None:
        """One proposer call that ran the drafter over `tokens` tokens (context + draft); the
        call's own overhead (`observe_overhead`) is not the drafter's."""
        seconds = max(seconds - self.overhead, 0.0)
        self.drafter.add(float(tokens), self._clipped(self.drafter, tokens, seconds))

    def observe_overhead(self, seconds: float) -> None:
        """One proposer call that did not run the drafter (its bookkeeping, paid every step)."""
        w = self.params.smoothing
        self.overhead = seconds if self.overhead == 0.0 else \
            (1.0 - w) * self.overhead + w * seconds

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
        w = self.params.smoothing
        self.full_tokens = (1.0 - w) * self.full_tokens + w * tokens

    def observe_rows(self, continuing: int, departed: int, arrived: int) -> None:
        """One step's rows: `continuing` decoded on from the last step, `departed` left since
        (finished or preempted), `arrived` are new (their prefill just ran)."""
        self.refills.add(continuing, departed, arrived)

    def _clipped(self, line: ForgettingLine, x: float, y: float) -> float:
        predicted = line.predict(x) if line.weight >= self.params.clip_after else None
        return y if predicted is None else min(y, self.params.clip_factor * predicted)

    # ---- decisions ------------------------------------------------------------------------------
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
        identified = self.verifier.identified(rows)
        trial = self.probes.trial_step(rows)
        if trial is not None:
            plan = Plan(trial)
        elif self.probes.due(self.steps, rows, identified):
            self.probes.count(rows)
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

    def _one_row_probe(self, g: int, rates: dict[int, float]) -> int:
        """One row's probe length: a trial of a neighbour of g, or the least-measured length
        (`ProbeSchedule.one_row_length`)."""
        return self.probes.one_row_length(g, rates, self._least_measured)

    def _least_measured(self, g: int) -> int:
        """The allowed length other than g whose verifier cost at batch 1 has the fewest
        effective observations (ties: gamma first, then 0, 1, ...)."""
        return least_measured(g, self.choices, self.gamma, lambda n: self.verifier.point_weight(
            1, 1.0 + self.draft_tokens(n)))

    def _schedule_next_probe(self, rows: int, g: int, plan: Plan,
                             rates: dict[int, float]) -> None:
        self.probe_steps += 1
        loss = self.probe_loss(rows, g, plan, rates, self.last_credited, self.probes.interval)
        cost = self.step_cost(rows, g, self.acceptance.alphas())
        self.probes.schedule(self.steps, loss, cost)

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
                f"{self.probe_steps} probes (every {self.probes.interval}), {fit}, "
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
            "probe_interval": self.probes.interval,
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
