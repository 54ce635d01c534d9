"""SpecDiff's vLLM workers on the CPU platform: the three runners the mixins make of vLLM's CPU
model runner, and one worker factory (`_SpecDiffCPUWorker`) that builds each.

- `SpecDiffCPUWorker`: tree verification (`tree_runner.TreeVerificationRunner`, tree rows
  recomputed in torch by `tree_attention`), for tries (num_drafts > 1 or best-first trees);
- `SpecDiffConditionedCPUWorker`: the verifier's tapped states for a drafter that reads them
  (`conditioned_runner.ConditionedRunner`), verified as a chain;
- `SpecDiffConditionedTreeCPUWorker`: both (`conditioned_runner.ConditionedTreeRunner`).

`workers.worker_engine_args` names the one a configuration needs (`--worker-cls`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_specdiff.plugin.conditioned_runner import ConditionedRunner, ConditionedTreeRunner
from vllm_specdiff.plugin.tree_attention import CacheLayout, install_tree_attention
from vllm_specdiff.plugin.tree_runner import TreeVerificationRunner


class SpecDiffCPUModelRunner(TreeVerificationRunner, CPUModelRunner):
    """vLLM's CPU model runner plus trie verification (tree rows recomputed in torch)."""

    def _install_tree_attention(self, layers: dict[str, Any]) -> CacheLayout:
        return install_tree_attention(layers, self.tree_context)


class SpecDiffConditionedCPUModelRunner(ConditionedRunner, CPUModelRunner):
    """vLLM's CPU model runner that hands the verifier's tapped states to the proposer."""


class SpecDiffConditionedTreeCPUModelRunner(ConditionedTreeRunner, SpecDiffCPUModelRunner):
    """vLLM's CPU model runner with trie verification and the verifier's tapped states."""


class _SpecDiffCPUWorker(CPUWorker):
    """vLLM's CPU worker with the runner `runner` (what it serves: `serves`).

    `CPUWorker.init_device` builds its runner inline, so the runner it built (cheap: no model is
    loaded yet) is replaced by ours right after.
    """

    runner: ClassVar[type[CPUModelRunner]]
    serves: ClassVar[str]  # for the error naming what needs vLLM's V1 runner

    def init_device(self) -> None:
        super().init_device()
        if self.use_v2_model_runner:
            raise ValueError(f"{self.serves} needs vLLM's V1 model runner (unset "
                             "VLLM_USE_V2_MODEL_RUNNER)")
        self.model_runner = self.runner(self.vllm_config, torch.device("cpu"))


class SpecDiffCPUWorker(_SpecDiffCPUWorker):
    """worker_cls for tries (num_drafts > 1, best-first trees) on CPU."""

    runner = SpecDiffCPUModelRunner
    serves = "tree verification (K > 1)"


class SpecDiffConditionedCPUWorker(_SpecDiffCPUWorker):
    """worker_cls for a drafter that reads the verifier, verified as a chain, on CPU."""

    runner = SpecDiffConditionedCPUModelRunner
    serves = "a conditioned drafter"


class SpecDiffConditionedTreeCPUWorker(_SpecDiffCPUWorker):
    """worker_cls for a drafter that reads the verifier, verified as tries, on CPU."""

    runner = SpecDiffConditionedTreeCPUModelRunner
    serves = "a conditioned drafter with num_drafts > 1"
