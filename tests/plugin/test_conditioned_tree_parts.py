"""Pieces of the worker for a conditioned drafter at num_drafts > 1 that run without an engine:
the rows it gathers per trie, the worker chosen per platform and settings, its classes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from .fake_platforms import CPU, CUDA, ROCM

pytestmark = pytest.mark.vllm




def test_path_rows_are_the_root_then_the_accepted_nodes():
    from vllm_specdiff.plugin.conditioned_runner import path_rows

    # a trie at rows 10..: candidate 0 is nodes 1-4, the accepted path left it after node 1
    assert path_rows(10, [1, 5, 6, 7], 4) == [10, 11, 15, 16]
    assert path_rows(10, [1, 5, 6, 7], 5) == [10, 11, 15, 16, 17]
    assert path_rows(3, [1, 2], 1) == [3]  # nothing accepted: the root alone
    assert path_rows(0, [], 1) == [0]  # the walk's path holds only the accepted nodes
    with pytest.raises(ValueError, match="3 committed positions from a path of 1 nodes"):
        path_rows(0, [4], 3)


def test_the_runner_keeps_each_tries_accepted_path_for_the_states(monkeypatch):
    from vllm_specdiff.plugin.conditioned_runner import ConditionedTreeRunner
    from vllm_specdiff.plugin.tree_runner import Selection, TreeVerificationRunner

    committed = []
    monkeypatch.setattr(TreeVerificationRunner, "_commit_kv",
                        lambda self, sampled, paths: committed.append(paths))
    monkeypatch.setattr(TreeVerificationRunner, "_sample", lambda self, logits, meta: "out")
    runner = ConditionedTreeRunner.__new__(ConditionedTreeRunner)  # no engine
    # batch 0: verified as a chain; 1: a trie, 3 accepted through candidate 1's branch;
    # 2: a trie, nothing accepted (only the bonus token)
    sampled = torch.tensor([[7, 8, -1, -1, -1], [1, 2, 3, 4, -1], [9, -1, -1, -1, -1]])
    taus = torch.zeros(2)
    paths = {1: Selection(1, "sample", torch.tensor([1, 5, 6, 7]), taus),
             2: Selection(0, "argmax", torch.tensor([1, 2, 3, 4]), taus)}
    runner._commit_kv(sampled, paths)
    assert committed == [paths]  # the KV commit still runs
    assert runner._committed_row_index(0, 0, 2) == slice(0, 2)
    assert runner._committed_row_index(1, 10, 4) == [10, 11, 15, 16]
    assert runner._committed_row_index(2, 20, 1) == [20]
    assert runner._sample(None, None) == "out"
    assert runner._committed_row_index(1, 10, 4) == slice(10, 14)  # a new step forgets them


def test_the_worker_is_chosen_by_drafter_num_drafts_and_platform(monkeypatch):
    from vllm_specdiff.plugin import workers
    from vllm_specdiff.plugin.config import SpecDiffConfig

    monkeypatch.setattr(workers, "reads_verifier", lambda drafter: drafter == "conditioned")

    def args(drafter, k, platform, best_first=False):
        return workers.worker_engine_args(
            SpecDiffConfig(drafter=drafter, num_drafts=k, best_first=best_first), platform)

    assert args("conditioned", 1, CPU, best_first=True) == {  # a best-first tree is a trie
        "worker_cls": workers.CPU_CONDITIONED_TREE_WORKER, "async_scheduling": False}
    assert args("plain", 1, CUDA, best_first=True)["worker_cls"] == workers.GPU_TREE_WORKER

    assert args("conditioned", 2, CPU) == {
        "worker_cls": workers.CPU_CONDITIONED_TREE_WORKER, "async_scheduling": False}
    assert args("conditioned", 3, CUDA) == {
        "worker_cls": workers.GPU_CONDITIONED_TREE_WORKER, "async_scheduling": False,
        "compilation_config": workers.TREE_CUDA_COMPILATION_CONFIG}
    assert args("conditioned", 1, CPU) == {"worker_cls": workers.CPU_CONDITIONED_WORKER}
    assert args("conditioned", 1, CUDA) == {"worker_cls": workers.GPU_CONDITIONED_WORKER}
    assert args("plain", 2, CPU)["worker_cls"] == workers.CPU_TREE_WORKER
    assert args("plain", 2, CUDA)["worker_cls"] == workers.GPU_TREE_WORKER
    assert args(None, 1, CPU) == {}
    with pytest.raises(ValueError, match="CPU and CUDA platforms, not 'rocm'"):
        args("conditioned", 2, ROCM)


def test_worker_names_resolve_and_the_mixins_come_in_order():
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from vllm_specdiff.plugin.conditioned_runner import ConditionedRunner, ConditionedTreeRunner
    from vllm_specdiff.plugin.tree_runner import TreeVerificationRunner
    from vllm_specdiff.plugin.workers import (
        CPU_CONDITIONED_TREE_WORKER,
        GPU_CONDITIONED_TREE_WORKER,
    )
    from vllm_specdiff.plugin.workers_cpu import (
        SpecDiffConditionedTreeCPUModelRunner,
        SpecDiffConditionedTreeCPUWorker,
        SpecDiffCPUModelRunner,
    )
    from vllm_specdiff.plugin.workers_cuda import (
        SpecDiffConditionedTreeGPUModelRunner,
        SpecDiffConditionedTreeGPUWorker,
        SpecDiffGPUModelRunner,
    )

    assert resolve_obj_by_qualname(CPU_CONDITIONED_TREE_WORKER) is SpecDiffConditionedTreeCPUWorker
    assert resolve_obj_by_qualname(GPU_CONDITIONED_TREE_WORKER) is SpecDiffConditionedTreeGPUWorker
    for runner, platform_runner in ((SpecDiffConditionedTreeCPUModelRunner,
                                     SpecDiffCPUModelRunner),
                                    (SpecDiffConditionedTreeGPUModelRunner,
                                     SpecDiffGPUModelRunner)):
        # the states are handed over before the tree runner reads back the proposer's tries;
        # the platform runner's attention hook (and, on CUDA, start-up checks) stay
        mro = runner.__mro__
        assert mro[1:5] == (ConditionedTreeRunner, ConditionedRunner, platform_runner,
                            TreeVerificationRunner)
        assert runner._install_tree_attention is platform_runner._install_tree_attention
    assert SpecDiffConditionedTreeCPUWorker.runner is SpecDiffConditionedTreeCPUModelRunner
    assert SpecDiffConditionedTreeGPUWorker.runner is SpecDiffConditionedTreeGPUModelRunner


def test_gpu_worker_builds_the_combined_runner_and_refuses_the_v2_runner():
    from vllm_specdiff.plugin.workers_cuda import SpecDiffConditionedTreeGPUWorker as Worker

    built = []
    worker = SimpleNamespace(use_v2_model_runner=False, vllm_config="cfg",
                             device=torch.device("cuda", 1), serves=Worker.serves,
                             runner=lambda config, device: built.append((config, device))
                             or "runner")
    make = Worker._make_model_runner
    assert make(worker) == "runner"
    assert built == [("cfg", torch.device("cuda", 1))]
    worker.use_v2_model_runner = True
    with pytest.raises(ValueError, match="num_drafts > 1 needs vLLM's V1 model runner"):
        make(worker)
