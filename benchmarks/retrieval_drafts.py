"""Greedy acceptance of drafts retrieved from the verifier's own continuations of the training
prompts (`vllm_specdiff.core.datastore`), against prompt lookup, on the benchmark prompts'
verifier continuations: what a retrieval candidate would add before it is wired into the
proposer.

    python -m vllm_specdiff_benchmarks.retrieval_drafts --train DATA[,DATA] \
        --bench chat=DIR --bench humaneval=DIR --out FILE.json

At every position of every continuation of a benchmark set (greedy verifier data, as
`scripts/generalization_curve.sh` writes), each source drafts gamma tokens from the context
(the prompt and the continuation so far); its accepted length is the prefix that matches the
verifier's own next tokens, which is exactly the greedy acceptance. Sources: `lookup` (prompt
lookup, the default's candidate), `datastore` (retrieval) and `lookup+datastore` (lookup where
the context repeats, else retrieval). The datastore holds the training split of `--train`
(the trainer's held-out prompts left out), and, for the scaling figure, its first fractions.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from vllm_specdiff.core.candidates import lookup_continuation
from vllm_specdiff.core.datastore import Datastore
from vllm_specdiff.provenance import provenance
from vllm_specdiff_benchmarks import emit_report

SOURCES = ("lookup", "datastore", "lookup+datastore")


def _sequences(data: Any, indices: range | list[int]) -> list[tuple[np.ndarray, int]]:
    return [(data.sequence(i).numpy(), int(data.prompt_lens[i])) for i in indices]


def accepted(draft: np.ndarray | None, truth: np.ndarray) -> int:
    """Length of the draft's prefix that equals the verifier's own tokens."""
    if draft is None:
        return 0
    n = min(draft.shape[0], truth.shape[0])
    miss = np.flatnonzero(draft[:n] != truth[:n])
    return int(miss[0]) if miss.shape[0] else n


def score(store: Datastore, bench: list[tuple[np.ndarray, int]], gamma: int
          ) -> dict[str, Any]:
    """Mean accepted length per source over every continuation position, and how often each
    source had a draft at all."""
    totals = {s: 0 for s in SOURCES}
    hits = {s: 0 for s in SOURCES}
    positions = 0
    for tokens, prompt_len in bench:
        for i in range(prompt_len, tokens.shape[0]):
            context, truth = tokens[:i], tokens[i:i + gamma]
            lookup = lookup_continuation(context, gamma)
            retrieved = store.draft(context, gamma)
            both = lookup if lookup is not None and lookup.shape[0] else retrieved
            for name, draft in zip(SOURCES, (lookup, retrieved, both), strict=True):
                totals[name] += accepted(draft, truth)
                hits[name] += draft is not None and draft.shape[0] > 0
            positions += 1
    return {"positions": positions,
            "mean_accepted": {s: totals[s] / max(positions, 1) for s in SOURCES},
            "draft_rate": {s: hits[s] / max(positions, 1) for s in SOURCES}}


def main(argv: list[str] | None = None) -> int:
    from vllm_specdiff_training.data import load_sequences, split_heldout

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", required=True, help="training data directories (comma list)")
    parser.add_argument("--bench", action="append", required=True, metavar="NAME=DIR",
                        help="a benchmark set's greedy verifier data (repeatable)")
    parser.add_argument("--gamma", type=int, default=8)
    parser.add_argument("--heldout-fraction", type=float, default=0.05,
                        help="the trainer's held-out split, left out of the datastore")
    parser.add_argument("--fractions", default="0.25,0.5,1",
                        help="datastore sizes scored, as fractions of the training split")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    train, _ = split_heldout(load_sequences(args.train), args.heldout_fraction)
    benches = {}
    for item in args.bench:
        name, _, path = item.partition("=")
        if not path:
            parser.error(f"--bench {item}: expected NAME=DIR")
        data = load_sequences(path)
        benches[name] = _sequences(data, range(len(data)))
    fractions = [float(f) for f in args.fractions.split(",")]
    results = []
    for fraction in fractions:
        count = max(int(round(len(train) * fraction)), 1)
        start = time.perf_counter()
        store = Datastore.from_sequences(_sequences(train, range(count)))
        built = time.perf_counter() - start
        row = {"fraction": fraction, "sequences": count, "datastore_tokens": len(store),
               "build_s": round(built, 2), "sets": {}}
        for name, bench in benches.items():
            start = time.perf_counter()
            row["sets"][name] = score(store, bench, args.gamma)
            row["sets"][name]["ms_per_position"] = round(
                (time.perf_counter() - start) * 1e3 / max(row["sets"][name]["positions"], 1), 3)
        results.append(row)
        print(f"datastore {fraction:.2f} ({count} sequences, {len(store)} tokens): " + "; ".join(
            f"{name} " + ", ".join(f"{s} {v:.3f}" for s, v in r["mean_accepted"].items())
            for name, r in row["sets"].items()), file=sys.stderr)
    report = {"settings": {"train": args.train, "bench": args.bench, "gamma": args.gamma,
                           "heldout_fraction": args.heldout_fraction},
              "results": results, **provenance()}
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
