"""The bench's per-engine proposer counters: read from `specdiff_stats`, differenced between
snapshots (what one cell's steps did)."""

from __future__ import annotations

import pytest

from vllm_specdiff.bench.counters import ProposerCounts


def _stats(calls: int, idle: int, idle_s: float, shapes: dict[str, int] | None) -> dict:
    return {"drafter_seconds": 0.1 * calls, "propose_calls": calls, "drafted_rows": calls,
            "lookup_drafts": 0, "idle_steps": idle, "idle_seconds": idle_s,
            "adaptive": {"chosen_gamma_histogram": [idle, calls - idle]},
            "tree": None if shapes is None else {"shapes": {"steps": shapes}}}


def test_idle_steps_and_shapes_are_counted_per_cell():
    before = ProposerCounts.of(_stats(10, 4, 0.008, {"chain": 5, "tree": 1}))
    after = ProposerCounts.of(_stats(30, 14, 0.028, {"chain": 15, "tree": 5}))
    cell = after.plus(before, -1)
    assert (cell.propose_calls, cell.idle_steps) == (20, 10)
    assert cell.idle_seconds == pytest.approx(0.020)  # 2 ms a step without a draft
    assert cell.shape_steps == {"chain": 10, "tree": 4}
    assert cell.gamma_histogram == [10, 10]


def test_a_proposer_without_trees_or_idle_counters_reads_as_zero():
    counts = ProposerCounts.of({"propose_calls": 3})
    assert (counts.idle_steps, counts.idle_seconds, counts.shape_steps) == (0, 0.0, {})
