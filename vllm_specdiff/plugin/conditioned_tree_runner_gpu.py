"""The conditioned drafter at num_drafts > 1 on CUDA: `ConditionedTreeRunner` on the CUDA
tree-verifying runner (its start-up checks and Triton tree attention included)."""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_specdiff.plugin.conditioned_tree_runner import ConditionedTreeRunner
from vllm_specdiff.plugin.tree_runner_gpu import SpecDiffGPUModelRunner


class SpecDiffConditionedTreeGPUModelRunner(ConditionedTreeRunner, SpecDiffGPUModelRunner):
    """vLLM's GPU model runner with trie verification and the verifier's tapped states."""


class SpecDiffConditionedTreeGPUWorker(Worker):
    """vLLM's GPU worker with `SpecDiffConditionedTreeGPUModelRunner` (worker_cls on CUDA)."""

    def _make_model_runner(self) -> GPUModelRunner:
        if self.use_v2_model_runner:
            raise ValueError("a conditioned drafter with num_drafts > 1 needs vLLM's V1 model "
                             "runner (unset VLLM_USE_V2_MODEL_RUNNER)")
        return SpecDiffConditionedTreeGPUModelRunner(self.vllm_config, self.device)
