"""The typed hand-off between the model runner and the proposer (no engine): the runner tells the
proposer what it serves (`RunnerSupport`, once), and the proposer refuses at load what that
runner cannot serve, naming the worker that can; per step the tree runner sets the rows that
may get a trie and takes the tries back."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.vllm


def _tree_proposer(drafter, **options):  # noqa: ANN001, ANN202
    from tests.plugin.test_options import _proposer

    return _proposer(drafter, 256, gamma=4, num_drafts=2, drafter_temperature=1.5,
                     adaptive=False, **options)


@pytest.mark.parametrize("support", [None, {"features": True}])
def test_tries_without_a_tree_runner_are_refused_naming_the_tree_worker(tiny_drafter, support):
    from vllm_specdiff.plugin.workers import CPU_TREE_WORKER, RunnerSupport

    proposer = _tree_proposer(tiny_drafter)
    if support is not None:  # None: vLLM's own runner, which attaches nothing
        proposer.attach_runner(RunnerSupport(**support))
    with pytest.raises(ValueError, match=f"needs the tree-verifying worker: add "
                                         f"worker_cls='{CPU_TREE_WORKER}'"):
        proposer.load_model(None)


def test_a_drafter_that_reads_the_verifier_needs_a_feature_runner(tiny_drafter, monkeypatch):
    from vllm_specdiff.plugin import proposer as proposer_module
    from vllm_specdiff.plugin.workers import CPU_CONDITIONED_TREE_WORKER, RunnerSupport

    monkeypatch.setattr(proposer_module, "reads_verifier", lambda drafter: True)
    proposer = _tree_proposer(tiny_drafter)
    proposer.attach_runner(RunnerSupport(trees=True))
    with pytest.raises(ValueError, match="needs the worker that captures them: add "
                                         f"worker_cls='{CPU_CONDITIONED_TREE_WORKER}'"):
        proposer.load_model(None)


def test_the_tree_runner_sets_rows_and_takes_each_steps_tries_once(tiny_drafter):
    from vllm_specdiff.plugin.workers import RunnerSupport

    proposer = _tree_proposer(tiny_drafter)
    proposer.attach_runner(RunnerSupport(trees=True))
    proposer.load_model(None)
    assert proposer.verifier_taps() == ()  # a drafter of token ids: nothing to capture
    with pytest.raises(RuntimeError, match="after load_model"):
        proposer.attach_runner(RunnerSupport())
    tokens = np.zeros((2, 64), dtype=np.int64)
    tokens[:, :12] = np.arange(3, 15)

    def step(rows):  # noqa: ANN001, ANN202
        if rows is not None:
            proposer.set_tree_rows(np.array(rows))
        drafts = proposer.propose([[int(tokens[0, 11])], [int(tokens[1, 11])]],
                                  np.array([12, 12]), tokens)
        return drafts, proposer.take_tries()

    drafts, tries = step([True, False])
    assert tries[0] is not None and tries[0].draft_tokens() == drafts[0]
    assert tries[1] is None and len(drafts[1]) == 4  # not allowed: the argmax chain
    assert proposer.take_tries() == []  # handed over once
    _, tries = step(None)  # rows hold for one propose only: then every row may get a trie
    assert all(trie is not None for trie in tries)


def test_each_runner_hands_over_what_it_serves():
    from vllm_specdiff.plugin.proposer import SpecDiffProposer
    from vllm_specdiff.plugin.tree_runner import SpecDiffRunner
    from vllm_specdiff.plugin.workers import RunnerSupport
    from vllm_specdiff.plugin.workers_cpu import (
        SpecDiffConditionedCPUModelRunner,
        SpecDiffConditionedTreeCPUModelRunner,
        SpecDiffCPUModelRunner,
    )
    from vllm_specdiff.plugin.workers_cuda import (
        SpecDiffConditionedGPUModelRunner,
        SpecDiffConditionedTreeGPUModelRunner,
        SpecDiffGPUModelRunner,
    )

    for runner in (SpecDiffCPUModelRunner, SpecDiffGPUModelRunner):
        assert runner.runner_support == RunnerSupport(trees=True)
    for runner in (SpecDiffConditionedCPUModelRunner, SpecDiffConditionedGPUModelRunner):
        assert runner.runner_support == RunnerSupport(features=True)
    for runner in (SpecDiffConditionedTreeCPUModelRunner, SpecDiffConditionedTreeGPUModelRunner):
        assert runner.runner_support == RunnerSupport(trees=True, features=True)

    class VllmRunner:  # vLLM's runner builds the proposer named by speculative_config.model
        def __init__(self, drafter: object, device: object) -> None:
            self.drafter = drafter

    class TreeRunner(SpecDiffRunner, VllmRunner):
        runner_support = RunnerSupport(trees=True)

    class FeatureRunner(SpecDiffRunner, VllmRunner):
        runner_support = RunnerSupport(features=True)

    attached = []
    proposer = SpecDiffProposer.__new__(SpecDiffProposer)  # no config: only the hand-off
    proposer.drafter = None
    proposer.attach_runner = attached.append
    TreeRunner(proposer, None)
    FeatureRunner(proposer, None)
    assert attached == [RunnerSupport(trees=True), RunnerSupport(features=True)]
    FeatureRunner(object(), None)  # another proposer: nothing to hand over, nothing refused
    with pytest.raises(ValueError, match="TreeRunner .* needs speculative_config.model = "
                                         "'vllm_specdiff.SpecDiffProposer'"):
        TreeRunner(object(), None)
