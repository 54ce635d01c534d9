"""Whether the adaptive controller prices batch-1 verifier steps right: per token count, what
its steps cost against what the controller predicted for them, and what it predicted for the
counts it was not using, by the length it chose.

    python -m vllm_specdiff_benchmarks.cost_calibration --out DIR/cost_calibration.json

One in-process engine with the default proposer (adaptive, prompt lookup) decodes held-out
chat prompts at batch 1 (T = 0): once to warm up, then once measured. Every plan records the
controller's predicted verifier cost of each token count (`VerifierCost.predict`, 1 to
gamma + 1 tokens) and the length it chose; every verifier observation
(`AdaptiveDrafting.observe_verifier`: the time between two proposer calls less the
proposer's own) is paired with the prediction made for its token count just before that step.
A count measured only by the controller's probes (`own_point_share` near 0) is priced by the line
or a stale point; the prediction for a count the controller is not using decides whether it
ever switches to it.
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

# (token count, seconds measured, seconds predicted, whether the count's own point priced it)
Step = tuple[int, float, float, bool]
# (chosen draft length, token count -> predicted seconds)
Choice = tuple[int, dict[int, float]]


def record(steps: list[Step], choices: list[Choice]) -> None:
    """Patch the controller: each one-row plan appends its choice and predictions to
    `choices`, each one-row verifier observation its measured and predicted cost to `steps`."""
    from vllm_specdiff.plugin.adaptive import AdaptiveDrafting, Plan

    plan, observe = AdaptiveDrafting.plan, AdaptiveDrafting.observe_verifier
    predicted: dict[int, tuple[float, bool]] = {}

    def planning(self: AdaptiveDrafting, rows: int, *args: Any, **kwargs: Any) -> Plan:  # noqa: ANN401
        chosen = plan(self, rows, *args, **kwargs)
        predicted.clear()
        if rows == 1:
            for tokens in range(1, self.gamma + 2):
                cost = self.verifier.predict(1, tokens)
                if cost is not None:
                    own = self.verifier.priced_by_point(1, tokens)
                    predicted[tokens] = (cost, own)
            if len(predicted) == self.gamma + 1:
                choices.append((chosen.gamma, {t: c for t, (c, _) in predicted.items()}))
        return chosen

    def observing(self: AdaptiveDrafting, rows: int, tokens: int, seconds: float) -> None:
        if rows == 1 and tokens in predicted:
            steps.append((tokens, seconds, *predicted[tokens]))
        observe(self, rows, tokens, seconds)

    AdaptiveDrafting.plan = planning  # type: ignore[method-assign]
    AdaptiveDrafting.observe_verifier = observing  # type: ignore[method-assign]


def calibration(steps: list[Step]) -> dict[int, dict[str, float]]:
    """Per token count: steps, measured mean and median ms, predicted mean ms, measured over
    predicted, and the share of steps its own point priced."""
    by_tokens: dict[int, list[Step]] = defaultdict(list)
    for step in steps:
        by_tokens[step[0]].append(step)
    out = {}
    for tokens, rows in sorted(by_tokens.items()):
        measured = [1000.0 * s for _, s, _, _ in rows]
        predicted = [1000.0 * p for _, _, p, _ in rows]
        out[tokens] = {
            "steps": len(rows),
            "measured_mean_ms": round(statistics.mean(measured), 2),
            "measured_median_ms": round(statistics.median(measured), 2),
            "predicted_mean_ms": round(statistics.mean(predicted), 2),
            "measured_over_predicted": round(statistics.mean(measured)
                                             / statistics.mean(predicted), 3),
            "own_point_share": round(sum(own for *_, own in rows) / len(rows), 2)}
    return out


def predictions_by_choice(choices: list[Choice]) -> dict[int, dict[str, Any]]:
    """Per chosen draft length: how many plans chose it, and the mean predicted ms of every
    token count over those plans."""
    by_gamma: dict[int, list[dict[int, float]]] = defaultdict(list)
    for gamma, predicted in choices:
        by_gamma[gamma].append(predicted)
    return {gamma: {"plans": len(rows),
                    "predicted_ms": {t: round(1000.0 * statistics.mean(r[t] for r in rows), 2)
                                     for t in sorted(rows[0])}}
            for gamma, rows in sorted(by_gamma.items())}


def main(argv: list[str] | None = None) -> int:
    parser = chat_parser(__doc__, prompts=16, max_tokens=96)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import SamplingParams

    command = invocation("vllm_specdiff_benchmarks.cost_calibration", argv)
    steps: list[Step] = []
    choices: list[Choice] = []
    record(steps, choices)
    llm = engine("specdiff2", max_num_seqs=1)
    chats = chat_prompts(args.prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.chat(chats, params, use_tqdm=False)
    steps.clear()
    choices.clear()
    llm.chat(chats, params, use_tqdm=False)
    report: dict[str, Any] = {
        "provenance": provenance(command), "batch_size": 1, "prompts": args.prompts,
        "max_tokens": args.max_tokens, "steps": len(steps),
        "by_token_count": {str(t): v for t, v in calibration(steps).items()},
        "predictions_by_chosen_gamma": {
            str(g): {"plans": v["plans"],
                     "predicted_ms": {str(t): ms for t, ms in v["predicted_ms"].items()}}
            for g, v in predictions_by_choice(choices).items()}}
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
