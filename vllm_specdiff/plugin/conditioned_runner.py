"""Serving a verifier-conditioned drafter: the worker that hands the proposer the verifier's states.

vLLM gives a `custom_class` proposer token ids only. A conditioned drafter
(vllm_specdiff/drafter/conditioned.py) reads the outputs of a few verifier layers, so its runner:
- turns on vLLM's EAGLE-3 auxiliary-state capture for the drafter's taps (vLLM records the
  residual stream before layer L + 1 for DFlash's tap L: `tests/engine/test_conditioned_serving`
  checks the indexing against vLLM's own `dflash` method, where an off-by-one would change the
  accepted count);
- after each verifier step, passes each request's newly committed positions' states to the
  proposer (`observe_features`): all scheduled tokens of a prefill chunk, and of a decode step
  the last committed token plus the accepted drafts (rejected drafts never enter the context).

worker_cls: `SpecDiffConditionedCPUWorker` (CPU, here) or `SpecDiffConditionedGPUWorker` (CUDA,
`conditioned_runner_gpu.py`) for num_drafts = 1; for num_drafts > 1 the mixin also sits on the
tree-verifying runner (`conditioned_tree_runner.py`, `conditioned_tree_runner_gpu.py`), where a
step's committed rows are the root and the accepted path through the trie.
`specdiff_engine_args` and `vllm-specdiff serve/generate/bench` add the right one when the drafter
reads the verifier (`workers.worker_engine_args`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

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


class ConditionedRunner:
    """Mixin placed before vLLM's model runner (CPU or GPU), or before the tree-verifying one
    (`conditioned_tree_runner`)."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        proposer = getattr(self, "drafter", None)
        if proposer is not None:
            proposer.feature_runner = True  # without it, the proposer refuses such a drafter
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        taps = tuple(getattr(proposer, "feature_taps", ()) or ())
        if taps:
            self.use_aux_hidden_state_outputs = True
            self.model.set_aux_hidden_state_layers(tuple(t + AUX_LAYER_OFFSET for t in taps))

    def _committed_row_index(self, batch_index: int, start: int, count: int
                             ) -> slice | list[int]:
        """The rows of a request's `count` committed positions, in position order: a chain
        commits its first scheduled rows; a trie's accepted path is not contiguous
        (`conditioned_tree_runner` overrides this)."""
        return slice(start, start + count)

    def propose_draft_token_ids(self, scheduler_output: Any, sampled_token_ids: Any,
                                sampling_metadata: Any, hidden_states: torch.Tensor,
                                sample_hidden_states: torch.Tensor,
                                aux_hidden_states: list[torch.Tensor] | None,
                                spec_decode_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        proposer = self.drafter
        if aux_hidden_states and getattr(proposer, "feature_taps", None):
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


class SpecDiffConditionedCPUModelRunner(ConditionedRunner, CPUModelRunner):
    """vLLM's CPU model runner that hands the verifier's tapped states to the proposer."""


class SpecDiffConditionedCPUWorker(CPUWorker):
    """vLLM's CPU worker with `SpecDiffConditionedCPUModelRunner` (worker_cls for a conditioned
    drafter). `CPUWorker.init_device` builds its runner inline, so the runner it built (cheap:
    no model is loaded yet) is replaced by ours right after."""

    def init_device(self) -> None:
        super().init_device()
        if self.use_v2_model_runner:
            raise ValueError("a conditioned drafter needs vLLM's V1 model runner (unset "
                             "VLLM_USE_V2_MODEL_RUNNER)")
        self.model_runner = SpecDiffConditionedCPUModelRunner(self.vllm_config,
                                                              torch.device("cpu"))
