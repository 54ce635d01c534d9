"""K > 1 with a drafter that reads the verifier: tree verification plus the verifier's states.

The tree-verifying runner (`tree_runner`) schedules a request's trie nodes as its rows; the
feature-capturing mixin (`conditioned_runner`) hands the proposer the states of the committed
positions. With a trie those are the root (row 0 of the request) and the nodes of the accepted
path, which need not be contiguous rows: a path through a later candidate skips candidate 0's
nodes. `_commit_kv` moves the accepted nodes' KV entries to their canonical slots, but the
hidden states stay where the forward put them, so this runner keeps each step's accepted path
and gathers those rows (`path_rows`). A wrong row would only lower acceptance (the output stays
the verifier's): `tests/engine/test_conditioned_tree.py` compares the accepted count with a
plain-torch reference and with a runner fed contiguous rows.

worker_cls: `SpecDiffConditionedTreeCPUWorker` (CPU, here) or
`conditioned_tree_runner_gpu.SpecDiffConditionedTreeGPUWorker` (CUDA); `workers.worker_engine_args`
picks it for a conditioned drafter with num_drafts > 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_specdiff.plugin.conditioned_runner import ConditionedRunner
from vllm_specdiff.plugin.tree_runner import (
    Selection,
    SpecDiffCPUModelRunner,
    TreeVerificationRunner,
)


def path_rows(start: int, path: Sequence[int], count: int) -> list[int]:
    """The rows of a trie request's `count` committed positions, in position order: its root
    (row `start`), then the first count - 1 nodes of the accepted path (node j is row
    start + j)."""
    if not 1 <= count <= len(path) + 1:
        raise ValueError(f"{count} committed positions from a path of {len(path)} nodes")
    return [start, *(start + int(node) for node in path[:count - 1])]


class ConditionedTreeRunner(ConditionedRunner, TreeVerificationRunner):
    """Trie verification that feeds the proposer the committed positions' states."""

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        self._accepted_paths: dict[int, list[int]] = {}  # batch index -> accepted nodes

    def _sample(self, logits: torch.Tensor | None, spec_decode_metadata: Any) -> Any:
        self._accepted_paths = {}  # a step without tries leaves none
        return super()._sample(logits, spec_decode_metadata)

    def _commit_kv(self, sampled: torch.Tensor, paths: dict[int, Selection]) -> None:
        accepted = ((sampled != -1).sum(dim=1) - 1).tolist()
        self._accepted_paths = {i: chosen.path[:accepted[i]].tolist()
                                for i, chosen in paths.items()}
        super()._commit_kv(sampled, paths)

    def _committed_row_index(self, batch_index: int, start: int, count: int
                             ) -> slice | list[int]:
        path = self._accepted_paths.get(batch_index)
        if path is None:  # verified as a chain (prefill, K = 1 fallback, truncated trie)
            return super()._committed_row_index(batch_index, start, count)
        return path_rows(start, path, count)


class SpecDiffConditionedTreeCPUModelRunner(ConditionedTreeRunner, SpecDiffCPUModelRunner):
    """vLLM's CPU model runner with trie verification and the verifier's tapped states."""


class SpecDiffConditionedTreeCPUWorker(CPUWorker):
    """vLLM's CPU worker with `SpecDiffConditionedTreeCPUModelRunner` (worker_cls for a
    conditioned drafter at num_drafts > 1); the runner `CPUWorker.init_device` built inline is
    replaced, as in `tree_runner.SpecDiffCPUWorker`."""

    def init_device(self) -> None:
        super().init_device()
        if self.use_v2_model_runner:
            raise ValueError("a conditioned drafter with num_drafts > 1 needs vLLM's V1 model "
                             "runner (unset VLLM_USE_V2_MODEL_RUNNER)")
        self.model_runner = SpecDiffConditionedTreeCPUModelRunner(self.vllm_config,
                                                                  torch.device("cpu"))
