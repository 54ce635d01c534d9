"""The proposer's statistics: what `specdiff_stats` returns, the periodic log line, and the
trie steps the tree-verifying runner reports back.

A mixin of `SpecDiffProposer`: the counters themselves are set in its `__init__` (one place to
read what a proposer holds); `propose` and the runner update them under `_lock`.
"""

from __future__ import annotations

import time
from typing import Any

from vllm_specdiff.core import SpecDecodeStats


def specdiff_logger() -> Any:
    from vllm.logger import init_logger

    return init_logger("vllm.specdiff")  # under "vllm", so vLLM's log handlers print it



class ProposerStats:
    """Acceptance, drafter time and self-selection counters, reported and reset."""

    gamma: int
    config: Any
    drafter: Any
    drafter_path: str | None
    adaptive: Any
    shape_choice: Any

    def record_tree_steps(self, accepted: list[int], selected: list[int], sources: list[str],
                          tau_chosen: list[float], tau_mean: list[float], walked: int = 0,
                          several_tried: int = 0) -> None:
        """The runner reports its trie verify steps: accepted length, k*, the source of k*, tau of
        k* and the mean tau of all candidates (per request); with selection "tree", how many of
        them the tree walk committed and how many of those tried several children at a node."""
        with self._lock:
            self.tree_walks += walked
            self.tree_walks_several += several_tried
            self.tree_stats.record(accepted, self.gamma, selected, self.config.num_drafts)
            for source in sources:
                self.chosen_sources[source] = self.chosen_sources.get(source, 0) + 1
            self.tau_chosen += sum(tau_chosen)
            self.tau_all += sum(tau_mean)


    def _count_step(self, drafted_rows: int, lookup_rows: int, retrieved_rows: int,
                    drafter_ran: bool, elapsed: float) -> None:
        """One `propose` call's counts and time. A step whose rows the drafter drafted none of
        is idle: its time (this call's and the states filed before it) is also kept apart, as
        what a step without a draft still costs."""
        with self._lock:
            self.propose_calls += 1
            self.drafted_rows += drafted_rows  # by the drafter or by lookup
            self.lookup_drafts += lookup_rows
            self.datastore_drafts += retrieved_rows
            self.drafter_seconds += elapsed
            if not drafter_ran:
                self.idle_steps += 1
                self.idle_seconds += elapsed + self._filed_seconds
            self._filed_seconds = 0.0

    def _new_stats(self) -> SpecDecodeStats:
        stats = SpecDecodeStats()
        stats.record([], self.gamma)  # size the per-position lists for gamma, whatever is drafted
        return stats

    def get_stats(self) -> dict[str, Any]:
        """Drafter time per step and acceptance, as the Python API and log line report them."""
        with self._lock:
            calls, rows, seconds = self.propose_calls, self.drafted_rows, self.drafter_seconds
            lookups, retrieved = self.lookup_drafts, self.datastore_drafts
            idle, idle_seconds = self.idle_steps, self.idle_seconds
            adaptive = {"enabled": False} if self.adaptive is None else self.adaptive.stats()
        out = {
            "gamma": self.gamma,
            "drafter": self.drafter_path,
            "propose_calls": calls,
            "drafted_rows": rows,
            "lookup_drafts": lookups,
            "datastore_drafts": retrieved,
            "drafter_seconds": seconds,
            "drafter_ms_per_step": 1000.0 * seconds / calls if calls else 0.0,
            "idle_steps": idle,  # steps whose rows the drafter drafted none of
            "idle_seconds": idle_seconds,
            "drafter_ms_per_idle_step": 1000.0 * idle_seconds / idle if idle else 0.0,
            "mean_accepted_length": self.stats.mean_accepted_length,
            "acceptance_rate": self.stats.acceptance_rate,
            "per_position_acceptance": self.stats.per_position_acceptance,
            "accepted_length_histogram": list(self.stats.accepted_length_histogram),
            "verify_steps": self.stats.steps,
            "drafted_tokens": self.stats.drafted_tokens,
            "adaptive": adaptive,
        }
        contexts = getattr(self, "contexts", None)
        if contexts is not None:  # a drafter that reads the verifier: its context store
            out["context_restarts"] = contexts.restarts
            out["context_bytes"] = contexts.nbytes
            out["context_prefix_hits"] = contexts.prefix_hits
            out["context_projected_rows"] = contexts.projected_rows  # deferred ones once drafted
        if self.config.verifies_trees:
            steps = self.tree_stats.steps
            out["tree"] = {**self.tree_stats.to_dict(),
                           "chosen_sources": dict(self.chosen_sources),
                           "mean_tau_chosen": self.tau_chosen / steps if steps else 0.0,
                           "mean_tau_all": self.tau_all / steps if steps else 0.0,
                           "tree_walk_steps": self.tree_walks,
                           "tree_walk_steps_trying_several_children": self.tree_walks_several,
                           "shapes": None if self.shape_choice is None
                           else self.shape_choice.stats()}
        if self.drafter is not None:
            out["drafter_cache"] = self.drafter.cache_stats()
            out["quantization"] = self.drafter.quantization
        return out

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = self._new_stats()
            if self.adaptive is not None:
                self.adaptive.reset_counters()
            self.propose_calls = 0
            self.drafted_rows = 0
            self.lookup_drafts = 0
            self.datastore_drafts = 0
            self.drafter_seconds = 0.0
            self.idle_steps, self.idle_seconds = 0, 0.0
            self._logged = (0, 0.0, 0)
            self.tree_stats = SpecDecodeStats()
            self.chosen_sources = {}
            self.tau_chosen = self.tau_all = 0.0
            self.tree_walks = self.tree_walks_several = 0

    def _maybe_log(self) -> None:
        interval = self.config.log_interval
        now = time.monotonic()
        if interval <= 0 or now - self._last_log < interval:
            return
        self._last_log = now
        calls, seconds, steps = self.propose_calls, self.drafter_seconds, self.stats.steps
        d_calls = calls - self._logged[0]
        d_secs = seconds - self._logged[1]
        self._logged = (calls, seconds, steps)
        specdiff_logger().info(
            "SpecDiff drafter: %.1f ms/step (last %d steps), mean accepted length %.2f of %d "
            "(%d verify steps), cache %s",
            1000.0 * d_secs / max(d_calls, 1), d_calls, self.stats.mean_accepted_length,
            self.gamma, steps, self.drafter.cache_stats() if self.drafter is not None else {})
        if self.config.verifies_trees:
            tree = self.tree_stats
            specdiff_logger().info(
                "SpecDiff self-selection (%s): %d trie steps, mean accepted length %.2f, "
                "chosen %s, mean tau chosen %.2f vs all %.2f",
                "best-first" if self.config.best_first else f"K={self.config.num_drafts}",
                tree.steps,
                tree.mean_accepted_length, self.chosen_sources,
                self.tau_chosen / max(tree.steps, 1), self.tau_all / max(tree.steps, 1))
        if self.adaptive is not None:
            specdiff_logger().info("SpecDiff adaptive drafting: %s", self.adaptive.summary())
