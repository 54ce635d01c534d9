"""How much a verifier step of the same shape drifts in cost while serving on a shared host:
the costs the adaptive controller measures, grouped by token count, in windows of steps.

    python -m vllm_specdiff_benchmarks.cost_drift --out DIR/cost_drift.json

One in-process engine with the default proposer (adaptive, prompt lookup) decodes held-out
chat prompts at batch 1 (T = 0), twice. Every verifier cost the controller observes is kept
(`AdaptiveDrafting.observe_verifier`: the time between two proposer calls less the proposer's
own). Per window of `--window` steps: the median milliseconds of each token count measured in
it; per token count: the spread of its window medians (windows with 10 steps of it or more),
max over min. The controller keeps costs relative to the host's speed (`VerifierCost.speed`)
because this spread exceeds what one draft length costs over another.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections import defaultdict
from typing import Any

from vllm_specdiff.provenance import provenance
from vllm_specdiff_benchmarks import chat_parser, emit_report, invocation
from vllm_specdiff_benchmarks.step_overhead import chat_prompts, engine

MIN_STEPS = 10  # steps of one token count in a window for its median to count in the spread


def record_costs() -> list[tuple[int, int, float]]:
    """Patch the controller to append (rows, tokens, seconds) of every verifier observation."""
    from vllm_specdiff.plugin.adaptive import AdaptiveDrafting

    costs: list[tuple[int, int, float]] = []
    observe = AdaptiveDrafting.observe_verifier

    def recording(self: AdaptiveDrafting, rows: int, tokens: int, seconds: float) -> None:
        costs.append((rows, tokens, seconds))
        observe(self, rows, tokens, seconds)

    AdaptiveDrafting.observe_verifier = recording  # type: ignore[method-assign]
    return costs


def windows(costs: list[tuple[int, int, float]], size: int) -> list[dict[int, tuple[float, int]]]:
    """Per window of `size` steps: token count -> (median ms, steps)."""
    out = []
    for start in range(0, len(costs), size):
        by_tokens: dict[int, list[float]] = defaultdict(list)
        for _, tokens, seconds in costs[start:start + size]:
            by_tokens[tokens].append(1000.0 * seconds)
        out.append({t: (round(statistics.median(ms), 2), len(ms))
                    for t, ms in sorted(by_tokens.items())})
    return out


def spreads(table: list[dict[int, tuple[float, int]]]) -> dict[int, float]:
    """Token count -> max over min of its window medians (windows with MIN_STEPS of it)."""
    medians: dict[int, list[float]] = defaultdict(list)
    for window in table:
        for tokens, (ms, steps) in window.items():
            if steps >= MIN_STEPS:
                medians[tokens].append(ms)
    return {t: round(max(ms) / min(ms), 3) for t, ms in sorted(medians.items()) if len(ms) > 1}


def main(argv: list[str] | None = None) -> int:
    parser = chat_parser(__doc__, prompts=8, max_tokens=96)
    parser.add_argument("--window", type=int, default=60, help="steps per window (default 60)")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import SamplingParams

    command = invocation("vllm_specdiff_benchmarks.cost_drift", argv)
    costs = record_costs()
    llm = engine("specdiff2", max_num_seqs=1)
    chats = chat_prompts(args.prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for _ in range(2):
        llm.chat(chats, params, use_tqdm=False)
    table = windows(costs, args.window)
    report: dict[str, Any] = {
        "provenance": provenance(command), "batch_size": 1, "prompts": args.prompts,
        "max_tokens": args.max_tokens, "steps": len(costs), "window": args.window,
        "spread_of_window_medians": spreads(table),
        "windows_ms": [{str(t): v for t, v in w.items()} for w in table]}
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
