"""Choosing the draft length: each allowed length priced in committed tokens per second.

`DraftPricing` holds the estimates (verifier and drafter cost, acceptance, refills, drafting
runs) and prices a step drafting g tokens per row as B * E(g) / cost(g); `choose` picks the
best length, a draft at batch > 1 only when it beats no draft by the margin. The reasoning is
in docs/adaptive.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_specdiff.adaptive.cost import ForgettingLine, VerifierCost
from vllm_specdiff.adaptive.estimators import (
    Acceptance,
    DraftingRuns,
    Refills,
    TailCredit,
    expected_tokens,
)
from vllm_specdiff.adaptive.params import PARAMS, AdaptiveParams


def choose(rates: dict[int, float], rows: int, margin: float = PARAMS.draft_margin,
           has_drafts: bool = False) -> int:
    """The g with the highest rate (ties: the shorter draft); at batch > 1 a draft only if it
    beats no draft by `margin`, unless the step has drafts anyway (`has_drafts`)."""
    g = max(rates, key=lambda n: (rates[n], -n))
    needed = 1.0 + (margin if rows > 1 and not has_drafts else 0.0)
    return g if g == 0 or rates[g] >= needed * rates[0] else 0


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


class DraftPricing:
    """The estimates a step is priced with, and the prices of each allowed draft length.

    `full_tokens`: verifier tokens per row of a full draft (gamma for chains; a trie's nodes for
    K > 1). `chain_choices`: whether lengths between 0 and gamma are allowed. `lookup`: rows
    may draft a prompt-lookup continuation, with its own acceptance estimate and length.
    `margin`: what a step with drafts must gain over one without at batch > 1 (None: the
    params'). `refill_ratio`: pins the refill ratio instead of measuring it.
    """

    def __init__(self, gamma: int, full_tokens: float | None = None,
                 chain_choices: bool = True, lookup: bool = False,
                 margin: float | None = None, refill_ratio: float | None = None,
                 params: AdaptiveParams = PARAMS) -> None:
        self.params = params
        self.gamma = gamma
        self.margin = params.draft_margin if margin is None else margin
        self.pinned_refill = refill_ratio  # None: measured (`Refills`)
        self.full_tokens = float(gamma if full_tokens is None else full_tokens)
        self.choices = list(range(gamma + 1)) if chain_choices else [0, gamma]
        self.verifier = VerifierCost(min_spread=params.min_spread_per_gamma2 * gamma * gamma,
                                     params=params)
        self.drafter = ForgettingLine(forget=params.forget, prior_weight=params.prior_weight)
        self.acceptance = Acceptance(gamma, forget=params.forget, params=params)
        self.lookup_acceptance = Acceptance(gamma, forget=params.lookup_forget, params=params) \
            if lookup else None
        self.refills = Refills(params=params)
        self.runs = DraftingRuns(params=params)
        # this step's context tokens per drafter row not yet encoded by the drafter, and the
        # probe row's (`plan`'s arguments; None: steady state, 1 + accepted tokens per row)
        self.catch_up: float | None = None
        self.probe_catch_up: float | None = None
        self.overhead = 0.0  # seconds of a proposer call that does not run the drafter

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
        average token: refill + (1 - refill) * (rho + (1 - rho) * credited), rho the verifier's
        marginal cost of the rows over the step's cost and `credited` the share of the extra
        tokens that are the back rows' (`TailCredit`). 1 at one row (its tokens end the batch
        sooner) or before the verifier is measured."""
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

    def probe_loss(self, rows: int, g: int, plan: Plan, rates: dict[int, float],
                   credited: float, interval: int) -> float | None:
        """Predicted seconds a probe step costs beyond its tokens' worth at the chosen rate
        (`credited`: the step's credited share; `interval`: steps since the last probe)."""
        if rates.get(g, 0.0) <= 0.0:
            return None
        alphas = self.acceptance.alphas()
        if plan.probe_rows == 0:  # every row drafts plan.gamma (0: a step without drafts)
            cost = self.step_cost(rows, plan.gamma, alphas)
            return None if cost is None or not math.isfinite(cost) else \
                cost - self.value(rows * expected_tokens(alphas, plan.gamma), rows,
                                  self.extra_value(rows, credited)) / rates[g]
        others = rows - plan.probe_rows
        verify = self.verifier.predict(rows, others * (1.0 + self.draft_tokens(g))
                                       + plan.probe_rows * (1.0 + self.full_tokens))
        # the probe row's own catch-up; else: when g = 0 it was last drafted about a probe
        # interval ago
        catch_up = self.probe_catch_up if self.probe_catch_up is not None else \
            interval if g == 0 else expected_tokens(alphas, g)
        encoded = plan.probe_rows * (catch_up + self.gamma)
        if g > 0:
            encoded += others * (expected_tokens(alphas, g) + g)
        draft = self.drafter.predict(encoded)
        if verify is None or draft is None:
            return None
        tokens = others * expected_tokens(alphas, g) \
            + plan.probe_rows * expected_tokens(alphas, self.gamma)
        worth = self.value(tokens, rows, self.extra_value(rows, credited))
        return verify + draft + self.overhead - worth / rates[g]
