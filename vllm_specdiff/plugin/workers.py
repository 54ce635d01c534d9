"""Which vLLM worker a SpecDiff configuration needs, on which platform: the one place that decides
for `specdiff_engine_args`, `vllm-specdiff serve/generate/bench` and the start-up errors; and
`RunnerSupport`, what a worker's model runner tells the proposer it serves.

vLLM's own worker serves a drafter of token ids verified as a chain; tries (num_drafts > 1 or
best-first trees) need the tree-verifying worker, a drafter that reads the verifier's hidden
states needs the worker that captures them, and such a drafter verified as tries needs one that
does both. Each platform's three workers are in one module (`workers_cpu`, `workers_cuda`),
built from the runner mixins `tree_runner.TreeVerificationRunner`,
`conditioned_runner.ConditionedRunner` and `conditioned_runner.ConditionedTreeRunner`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True)
class RunnerSupport:
    """What the model runner serving a `SpecDiffProposer` does beyond vLLM's own runner, handed
    to the proposer once (`SpecDiffProposer.attach_runner`); the proposer refuses at load a
    configuration its runner cannot serve, naming the worker it needs. vLLM's own runner hands
    nothing: the default, neither.

    trees: verifies tries (`tree_runner.TreeVerificationRunner`): before each `propose` it says
        which rows may get one (`set_tree_rows`) and after it reads them back (`take_tries`).
    features: captures the verifier layers the proposer asks for (`verifier_taps`) and hands
        their committed states over (`observe_features`, `conditioned_runner.ConditionedRunner`).
    """

    trees: bool = False
    features: bool = False


class WorkerSettings(Protocol):
    """What decides the worker (config.SpecDiffConfig has it)."""

    drafter: str | None

    @property
    def verifies_trees(self) -> bool: ...

CPU_TREE_WORKER = "vllm_specdiff.plugin.workers_cpu.SpecDiffCPUWorker"
GPU_TREE_WORKER = "vllm_specdiff.plugin.workers_cuda.SpecDiffGPUWorker"
# a drafter that reads the verifier's hidden states needs the worker that captures them
CPU_CONDITIONED_WORKER = "vllm_specdiff.plugin.workers_cpu.SpecDiffConditionedCPUWorker"
GPU_CONDITIONED_WORKER = "vllm_specdiff.plugin.workers_cuda.SpecDiffConditionedGPUWorker"
# ... and verified as tries, the worker that verifies tries and captures them
CPU_CONDITIONED_TREE_WORKER = "vllm_specdiff.plugin.workers_cpu.SpecDiffConditionedTreeCPUWorker"
GPU_CONDITIONED_TREE_WORKER = \
    "vllm_specdiff.plugin.workers_cuda.SpecDiffConditionedTreeGPUWorker"
# CUDA: the tree rows are recomputed around each attention call, so attention must stay out of
# CUDA graphs (piecewise graphs keep it between the pieces).
TREE_CUDA_COMPILATION_CONFIG = {"cudagraph_mode": "PIECEWISE"}
NUM_DRAFTS = "additional_config['specdiff']['num_drafts']"  # the options, as errors name them
DRAFTER = "additional_config['specdiff']['drafter']"


def _for_platform(platform: Any, cpu: str, cuda: str, what: str) -> str:
    """The worker of this vLLM platform (default: vLLM's current one), or why there is none."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    if platform.is_cpu():
        return cpu
    if platform.is_cuda():
        return cuda
    raise ValueError(f"{what} supports vLLM's CPU and CUDA platforms, not "
                     f"{getattr(platform, 'device_name', platform)!r}")


def tree_worker(platform: Any = None) -> str:
    """worker_cls for num_drafts > 1 on this vLLM platform."""
    return _for_platform(platform, CPU_TREE_WORKER, GPU_TREE_WORKER,
                         f"{NUM_DRAFTS} > 1 (tree verification; use num_drafts = 1 elsewhere)")


def conditioned_tree_worker(platform: Any = None) -> str:
    """worker_cls for a drafter that reads the verifier at num_drafts > 1."""
    return _for_platform(platform, CPU_CONDITIONED_TREE_WORKER, GPU_CONDITIONED_TREE_WORKER,
                         f"a conditioned {DRAFTER} with {NUM_DRAFTS} > 1")


def tree_engine_args(platform: Any = None, conditioned: bool = False) -> dict[str, Any]:
    """The engine arguments num_drafts > 1 needs on this platform: the tree-verifying worker
    (for a drafter that reads the verifier, the one that also captures its states), async
    scheduling off and, on CUDA, attention outside CUDA graphs."""
    worker = conditioned_tree_worker(platform) if conditioned else tree_worker(platform)
    args: dict[str, Any] = {"worker_cls": worker, "async_scheduling": False}
    if worker in (GPU_TREE_WORKER, GPU_CONDITIONED_TREE_WORKER):
        args["compilation_config"] = dict(TREE_CUDA_COMPILATION_CONFIG)
    return args


def reads_verifier(drafter: str | None) -> bool:
    """Whether a drafter directory reads the verifier's hidden states (`specdiff_conditioned`
    or a published DFlash drafter).

    None is the default drafter (`models.default_drafter_dir()`, so `models.DEFAULT_DRAFTER_KIND`
    decides the worker too). The served model is not known here; None is assumed to mean the
    default verifier, as `config.check_drafter_for` refuses None for any other model (unless
    `$SPECDIFF_DRAFTER` names the drafter, which this resolves to as the proposer does)."""
    from vllm_specdiff import models
    from vllm_specdiff.drafter.loading import reads_verifier_states

    if drafter is None:
        drafter = str(models.default_drafter_dir())
    try:
        return reads_verifier_states(json.loads((Path(drafter) / "config.json").read_text()))
    except (OSError, ValueError, AttributeError):
        return False  # check_paths names what is wrong with the directory


def conditioned_worker(platform: Any = None) -> str:
    """worker_cls for a drafter that reads the verifier, on this vLLM platform."""
    return _for_platform(platform, CPU_CONDITIONED_WORKER, GPU_CONDITIONED_WORKER,
                         f"a conditioned {DRAFTER}")


def worker_engine_args(config: WorkerSettings, platform: Any = None) -> dict[str, Any]:
    """The engine arguments these settings need beyond the two dicts: for tries (num_drafts > 1
    or best-first trees) the tree-verifying worker (feature-capturing too for a conditioned
    drafter) and its settings, for a conditioned drafter verified as a chain the
    feature-capturing worker, else none."""
    conditioned = reads_verifier(config.drafter)
    if config.verifies_trees:
        return tree_engine_args(platform, conditioned=conditioned)
    if conditioned:
        return {"worker_cls": conditioned_worker(platform)}
    return {}
