"""SpecDiff's vLLM workers on CUDA: the three runners the mixins make of vLLM's GPU model runner,
and one worker factory (`_SpecDiffGPUWorker`) that builds each.

- `SpecDiffGPUWorker`: tree verification (`tree_runner.TreeVerificationRunner`), for tries;
- `SpecDiffConditionedGPUWorker`: the verifier's tapped states for a drafter that reads them
  (`conditioned_runner.ConditionedRunner`), verified as a chain;
- `SpecDiffConditionedTreeGPUWorker`: both (`conditioned_runner.ConditionedTreeRunner`).

The trie scheduling, candidate selection and KV commit are the mixin's, shared with the CPU
runner (`workers_cpu`); the CUDA part is the attention wrapper (`tree_attention_cuda`: the
project's Triton tree-attention kernel over the FlashAttention / Triton-attention paged cache)
and two start-up checks. On the GPU runner `positions` is a device tensor, `query_start_loc` and
the block table's `slot_mapping` are `CpuGpuBuffer`s whose `.gpu` half the forward reads: the
mixin writes the trie positions into `positions` after vLLM filled it, and keeps the nodes'
slots from `slot_mapping.gpu`, so the same code serves both platforms.

`workers.worker_engine_args` names the one a configuration needs (`--worker-cls`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_specdiff.plugin.conditioned_runner import ConditionedRunner, ConditionedTreeRunner
from vllm_specdiff.plugin.tree_attention_cuda import PagedKVLayout, install_cuda_tree_attention
from vllm_specdiff.plugin.tree_runner import TreeVerificationRunner

PIECEWISE_FLAG = """--compilation-config '{"cudagraph_mode": "PIECEWISE"}'"""


def check_attention_outside_cuda_graphs(compilation_config: Any) -> None:
    """The trie rows are recomputed in Python around each attention call; a CUDA graph that
    captured attention replays the causal kernel alone, so the trie's logits (and the output)
    would be wrong. Piecewise graphs (attention between the pieces) and eager mode are fine."""
    mode = getattr(compilation_config, "cudagraph_mode", None)
    if mode is None or not mode:
        return
    if mode.has_full_cudagraphs() or not compilation_config.splitting_ops_contain_attention():
        raise ValueError(f"tree verification (K > 1) on CUDA needs attention outside CUDA "
                         f"graphs, but cudagraph_mode={mode} captures it: pass {PIECEWISE_FLAG} "
                         "(specdiff_engine_args and vllm-specdiff serve add it) or "
                         "--enforce-eager")


def check_parallel_config(parallel_config: Any) -> None:
    """Micro-batching splits the query rows the trie requests index; decode context
    parallelism shards the prefix KV across ranks. Neither is supported with tries."""
    if getattr(parallel_config, "use_ubatching", False):
        raise ValueError("tree verification (K > 1) does not support micro-batching "
                         "(--enable-dbo / ubatch_size > 1)")
    if getattr(parallel_config, "decode_context_parallel_size", 1) > 1:
        raise ValueError("tree verification (K > 1) does not support decode context "
                         "parallelism (--decode-context-parallel-size > 1)")


class SpecDiffGPUModelRunner(TreeVerificationRunner, GPUModelRunner):
    """vLLM's GPU model runner plus trie verification (tree rows by the Triton kernel)."""

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        check_attention_outside_cuda_graphs(vllm_config.compilation_config)
        check_parallel_config(vllm_config.parallel_config)
        super().__init__(vllm_config, device)

    def _install_tree_attention(self, layers: dict[str, Any]) -> PagedKVLayout:
        return install_cuda_tree_attention(layers, self.tree_context)


class SpecDiffConditionedGPUModelRunner(ConditionedRunner, GPUModelRunner):
    """vLLM's GPU model runner that hands the verifier's tapped states to the proposer."""


class SpecDiffConditionedTreeGPUModelRunner(ConditionedTreeRunner, SpecDiffGPUModelRunner):
    """vLLM's GPU model runner with trie verification and the verifier's tapped states (the
    CUDA tree runner's start-up checks and Triton tree attention included)."""


class _SpecDiffGPUWorker(Worker):
    """vLLM's GPU worker with the runner `runner` (what it serves: `serves`)."""

    runner: ClassVar[type[GPUModelRunner]]
    serves: ClassVar[str]  # for the error naming what needs vLLM's V1 runner

    def _make_model_runner(self) -> GPUModelRunner:
        if self.use_v2_model_runner:
            raise ValueError(f"{self.serves} needs vLLM's V1 model runner (unset "
                             "VLLM_USE_V2_MODEL_RUNNER)")
        return self.runner(self.vllm_config, self.device)


class SpecDiffGPUWorker(_SpecDiffGPUWorker):
    """worker_cls for tries (num_drafts > 1, best-first trees) on CUDA."""

    runner = SpecDiffGPUModelRunner
    serves = "tree verification (K > 1)"


class SpecDiffConditionedGPUWorker(_SpecDiffGPUWorker):
    """worker_cls for a drafter that reads the verifier, verified as a chain, on CUDA."""

    runner = SpecDiffConditionedGPUModelRunner
    serves = "a conditioned drafter"


class SpecDiffConditionedTreeGPUWorker(_SpecDiffGPUWorker):
    """worker_cls for a drafter that reads the verifier, verified as tries, on CUDA."""

    runner = SpecDiffConditionedTreeGPUModelRunner
    serves = "a conditioned drafter with num_drafts > 1"
