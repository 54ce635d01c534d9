"""Serving a verifier-conditioned drafter: the runner mixins that hand the proposer the
verifier's states (the default drafter reads them).

vLLM gives a `custom_class` proposer token ids only. A conditioned drafter
(vllm_specdiff/drafter/conditioned.py) reads the outputs of a few verifier layers, so its runner
(`ConditionedRunner`):
- turns on vLLM's EAGLE-3 auxiliary-state capture for the layers the proposer asks for
  (`SpecDiffProposer.verifier_taps`; vLLM records the residual stream before layer L + 1 for
  DFlash's tap L: `tests/engine/test_conditioned_serving` checks the indexing against vLLM's own
  `dflash` method, where an off-by-one would change the accepted count);
- after each verifier step, passes each request's newly committed positions' states to the
  proposer (`observe_features`): all scheduled tokens of a prefill chunk, and of a decode step
  the last committed token plus the accepted drafts (rejected drafts never enter the context).

Verified as tries, `ConditionedTreeRunner` puts it on the tree-verifying runner
(`tree_runner`), which schedules a request's trie nodes as its rows. The committed positions are
then the root (row 0 of the request) and the nodes of the accepted path, which need not be
contiguous rows: a path through a later candidate skips candidate 0's nodes. `_commit_kv` moves
the accepted nodes' KV entries to their canonical slots, but the hidden states stay where the
forward put them, so this runner keeps each step's accepted path and gathers those rows
(`path_rows`). A wrong row would only lower acceptance (the output stays the verifier's):
`tests/engine/test_conditioned_tree.py` compares the accepted count with a plain-torch reference
and with a runner fed contiguous rows.

The workers built from them are in `workers_cpu` and `workers_cuda`
(`SpecDiffConditioned[Tree]{CPU,GPU}Worker`); `specdiff_engine_args` and
`vllm-specdiff serve/generate/bench` add the right one (`workers.worker_engine_args`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vllm_specdiff.plugin.proposer import SpecDiffProposer
from vllm_specdiff.plugin.tree_runner import Selection, SpecDiffRunner, TreeVerificationRunner
from vllm_specdiff.plugin.workers import RunnerSupport

# vLLM records the residual stream *before* the layer index it is given: DFlash's tap L (the
# output of layer L, Hugging Face's hidden_states[L + 1]) is vLLM's auxiliary layer L + 1.
AUX_LAYER_OFFSET = 1


def committed_rows(query_start: np.ndarray, sampled: list[list[int]],
                   num_draft_tokens: list[int] | None) -> list[int]:
    """Per request (batch order), how many of its scheduled rows are committed tokens: every
    row of a step without drafts (prefill chunks), else the rows up to the last accepted draft
    (the previous step's token plus the accepted drafts)."""
    counts = []
    for i in range(len(query_start) - 1):
        scheduled = int(query_start[i + 1] - query_start[i])
        drafts = num_draft_tokens[i] if num_draft_tokens is not None else 0
        if drafts == 0 or not sampled[i]:
            counts.append(scheduled)
        else:
            counts.append(scheduled - drafts + len(sampled[i]) - 1)
    return counts


def path_rows(start: int, path: Sequence[int], count: int) -> list[int]:
    """The rows of a trie request's `count` committed positions, in position order: its root
    (row `start`), then the first count - 1 nodes of the accepted path (node j is row
    start + j)."""
    if not 1 <= count <= len(path) + 1:
        raise ValueError(f"{count} committed positions from a path of {len(path)} nodes")
    return [start, *(start + int(node) for node in path[:count - 1])]


class ConditionedRunner(SpecDiffRunner):
    """Mixin placed before vLLM's model runner (CPU or GPU), or before the tree-verifying one
    (`ConditionedTreeRunner`)."""

    runner_support = RunnerSupport(features=True)
    feature_taps: tuple[int, ...] = ()  # the proposer's verifier layers, read at load_model

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        proposer = getattr(self, "drafter", None)
        if isinstance(proposer, SpecDiffProposer):
            self.feature_taps = proposer.verifier_taps()
        if self.feature_taps:
            self.use_aux_hidden_state_outputs = True
            self.model.set_aux_hidden_state_layers(
                tuple(t + AUX_LAYER_OFFSET for t in self.feature_taps))

    def _committed_row_index(self, batch_index: int, start: int, count: int
                             ) -> slice | list[int]:
        """The rows of a request's `count` committed positions, in position order: a chain
        commits its first scheduled rows; a trie's accepted path is not contiguous
        (`ConditionedTreeRunner` overrides this)."""
        return slice(start, start + count)

    def propose_draft_token_ids(self, scheduler_output: Any, sampled_token_ids: Any,
                                sampling_metadata: Any, hidden_states: torch.Tensor,
                                sample_hidden_states: torch.Tensor,
                                aux_hidden_states: list[torch.Tensor] | None,
                                spec_decode_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        proposer = self.drafter
        if aux_hidden_states and self.feature_taps:
            num_reqs = self.input_batch.num_reqs
            query_start = self.query_start_loc.np[:num_reqs + 1]
            total = int(query_start[-1])
            features = torch.cat([h[:total] for h in aux_hidden_states], dim=-1)
            starts = query_start[:-1].astype(np.int64)
            # each request's first scheduled position (only these leave the device)
            first = self.positions[torch.from_numpy(starts).to(self.positions.device)].tolist()
            counts = committed_rows(query_start, sampled_token_ids,
                                    None if spec_decode_metadata is None
                                    else spec_decode_metadata.num_draft_tokens)
            updates = [(req_id, features[self._committed_row_index(i, lo, n)], pos)
                       for i, (req_id, lo, n, pos) in enumerate(zip(
                           self.input_batch.req_ids[:num_reqs], starts.tolist(), counts, first,
                           strict=True))]
            proposer.observe_features(updates, getattr(scheduler_output, "finished_req_ids", ()))
        return super().propose_draft_token_ids(  # type: ignore[misc]
            scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
            sample_hidden_states, aux_hidden_states, spec_decode_metadata, *args, **kwargs)


class ConditionedTreeRunner(ConditionedRunner, TreeVerificationRunner):
    """Trie verification that feeds the proposer the committed positions' states."""

    runner_support = RunnerSupport(trees=True, features=True)

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
