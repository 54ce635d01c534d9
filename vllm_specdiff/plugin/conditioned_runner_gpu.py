"""The conditioned drafter's worker on CUDA: `ConditionedRunner` on vLLM's GPU model runner."""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_specdiff.plugin.conditioned_runner import ConditionedRunner


class SpecDiffConditionedGPUModelRunner(ConditionedRunner, GPUModelRunner):
    """vLLM's GPU model runner that hands the verifier's tapped states to the proposer."""


class SpecDiffConditionedGPUWorker(Worker):
    """vLLM's GPU worker with `SpecDiffConditionedGPUModelRunner` (worker_cls on CUDA)."""

    def _make_model_runner(self) -> GPUModelRunner:
        if self.use_v2_model_runner:
            raise ValueError("a conditioned drafter needs vLLM's V1 model runner (unset "
                             "VLLM_USE_V2_MODEL_RUNNER)")
        return SpecDiffConditionedGPUModelRunner(self.vllm_config, self.device)
