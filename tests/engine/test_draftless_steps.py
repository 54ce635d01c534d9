"""The draftless-step fix (`plugin/patches/draftless_fix.py`) inside engines.

A speculative engine whose proposer drafts nothing gives a plain engine's seeded tokens and
logprobs at temperature 1 without one rejection-sampler call; with vLLM's own `_sample` back
every such step goes through the rejection sampler (and, as the semantics test in
tests/plugin/patches/test_draftless_fix.py says, still gives the same tokens); with real drafts
the rejection sampler still runs; the tree runner passes its draftless steps to the fix too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.tiny_models import CONDITIONED_GAMMA, speculative_args, word_prompt
from vllm_specdiff.plugin.patches.draftless_fix import (
    fix_draftless_steps,
    restore_vllm_sample,
)

pytestmark = pytest.mark.vllm
PROMPTS = [word_prompt(s, 6) for s in range(4)]
SEEDS = [101, 202, 303, 404]
TOKENS = 8


def _engine_kwargs(model) -> dict:  # noqa: ANN001
    return dict(model=str(model), max_model_len=128, max_num_seqs=4, seed=0,
                kv_cache_memory_bytes=2_000_000, dtype="float32", enforce_eager=True)


def _drafter(worker: Any) -> Any:  # runs inside the vLLM worker
    return getattr(worker, "worker", worker).model_runner.drafter


def _draft_nothing(worker: Any) -> bool:  # runs inside the vLLM worker
    """The proposer drafts nothing for any row (its own propose is kept for `_draft_again`)."""
    proposer = _drafter(worker)
    proposer.own_propose = getattr(proposer, "own_propose", proposer.propose)
    proposer.propose = lambda sampled, *a, **k: [[] for _ in sampled]
    return True


def _draft_again(worker: Any) -> bool:  # runs inside the vLLM worker
    proposer = _drafter(worker)
    proposer.propose = proposer.own_propose
    return True


@pytest.fixture(scope="module")
def engines(tiny_verifier, tiny_drafter):
    from vllm import LLM

    fix_draftless_steps()
    plain = LLM(**_engine_kwargs(tiny_verifier))
    spec = LLM(**_engine_kwargs(tiny_verifier),
               **speculative_args(tiny_drafter, gamma=4, adaptive=False))
    return plain, spec


@pytest.fixture
def counted(monkeypatch) -> dict[str, int]:
    """Calls of the rejection sampler and of vLLM's spec-decode metadata builder (one per
    speculative step), in this process: the engine runs in-process."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    counts = {"rejection": 0, "spec_steps": 0}
    forward, build = RejectionSampler.forward, GPUModelRunner._calc_spec_decode_metadata

    def counted_forward(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        counts["rejection"] += 1
        return forward(self, *args, **kwargs)

    def counted_build(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        counts["spec_steps"] += 1
        return build(self, *args, **kwargs)

    monkeypatch.setattr(RejectionSampler, "forward", counted_forward)
    monkeypatch.setattr(GPUModelRunner, "_calc_spec_decode_metadata", counted_build)
    return counts


@contextmanager
def _without_drafts(llm: Any) -> Iterator[Any]:
    assert llm.collective_rpc(_draft_nothing) == [True]
    try:
        yield llm
    finally:
        llm.collective_rpc(_draft_again)


@pytest.fixture
def drafting_nothing(engines) -> Iterator[Any]:
    with _without_drafts(engines[1]) as spec:
        yield spec


@pytest.fixture
def vllm_sample_restored() -> Iterator[None]:
    assert restore_vllm_sample(), "the fix was not installed"
    try:
        yield
    finally:
        assert fix_draftless_steps()


def _generate(llm: Any, logprobs: int | None = None) -> list[Any]:
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=s, ignore_eos=True,
                             logprobs=logprobs) for s in SEEDS]
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _logprobs(output: Any) -> list[dict[int, float]]:
    return [{t: lp.logprob for t, lp in step.items()} for step in output.logprobs]


def test_draftless_steps_sample_as_a_plain_engine_without_the_rejection_sampler(
        engines, drafting_nothing, counted):
    plain = _generate(engines[0], logprobs=2)
    counted.update(rejection=0, spec_steps=0)
    spec = _generate(drafting_nothing, logprobs=2)
    assert counted["spec_steps"] >= TOKENS  # speculative steps, each without a draft
    assert counted["rejection"] == 0
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert len({tuple(o.token_ids) for o in plain}) == len(SEEDS)  # the seeds matter
    for s, p in zip(spec, plain, strict=True):
        assert len(_logprobs(s)) == TOKENS
        for a, b in zip(_logprobs(s), _logprobs(p), strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-5 for t in a)


def test_without_the_fix_every_draftless_step_goes_through_the_rejection_sampler(
        engines, drafting_nothing, counted, vllm_sample_restored):
    plain = _generate(engines[0])
    counted.update(rejection=0, spec_steps=0)
    spec = _generate(drafting_nothing)
    assert counted["spec_steps"] >= TOKENS
    assert counted["rejection"] == counted["spec_steps"]
    # vLLM's rejection path draws a seeded row's bonus token as the plain sampler does: the
    # fix saves time, it does not change these tokens
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_steps_with_drafts_still_go_through_the_rejection_sampler(engines, counted):
    from vllm_specdiff.plugin.engine import specdiff_stats

    spec = engines[1]
    before = specdiff_stats(spec)["proposer"]["drafted_rows"]
    _generate(spec)
    assert specdiff_stats(spec)["proposer"]["drafted_rows"] > before
    # every step after the prefill has drafts (adaptive drafting off); the prefill has none
    assert 0 < counted["rejection"] < counted["spec_steps"]


def _runner_class(worker: Any) -> str:  # runs inside the vLLM worker
    return type(getattr(worker, "worker", worker).model_runner).__name__


def test_the_tree_runner_passes_draftless_steps_to_the_fix(tiny_verifier, tiny_drafter, engines,
                                                           counted):
    """K = 2: the tree runner's `_sample` hands steps without tries to `super()._sample`, which
    is the wrapped one; with drafts its tree path still verifies through the rejection
    sampler."""
    from vllm import LLM

    from vllm_specdiff.plugin.workers import CPU_TREE_WORKER

    tree = LLM(**_engine_kwargs(tiny_verifier), worker_cls=CPU_TREE_WORKER,
               async_scheduling=False,
               **speculative_args(tiny_drafter, gamma=4, num_drafts=2, max_tree_tokens=9,
                                  adaptive=False))
    assert tree.collective_rpc(_runner_class) == ["SpecDiffCPUModelRunner"]
    plain = _generate(engines[0])
    with _without_drafts(tree):
        counted.update(rejection=0, spec_steps=0)
        assert [o.token_ids for o in _generate(tree)] == [o.token_ids for o in plain]
        assert counted["spec_steps"] >= TOKENS and counted["rejection"] == 0
    counted.update(rejection=0, spec_steps=0)
    outputs = _generate(tree)
    assert all(len(o.token_ids) == TOKENS for o in outputs)
    assert 0 < counted["rejection"] < counted["spec_steps"]


def _set_max_backlog(worker: Any, rows: int) -> bool:  # runs inside the vLLM worker
    _drafter(worker).contexts.max_backlog = rows
    return True


def test_a_conditioned_drafter_catching_up_after_skipped_drafts_drafts_the_same(
        cycle_verifier, conditioned_run, monkeypatch):
    """The adaptive controller drafts nothing on most steps (and one row on a probe step): the
    conditioned drafter files those steps' states unprojected and projects them when it next
    drafts. Greedy output is plain decoding's, and every accepted count equals that of the same
    engine projecting every step (max_backlog 0), so the drafts were the same; the deferred run
    projected fewer positions (requests that finished between drafts never project their last
    ones)."""
    from vllm import LLM, SamplingParams

    from tests.engine.test_adaptive_engine import _cycling_plans
    from vllm_specdiff.adaptive import AdaptiveDrafting, Plan
    from vllm_specdiff.drafter.conditioned_state import DEFAULT_MAX_BACKLOG
    from vllm_specdiff.plugin.engine import (
        reset_specdiff_stats,
        specdiff_engine_args,
        specdiff_stats,
    )

    gamma = CONDITIONED_GAMMA
    common = dict(model=str(cycle_verifier), dtype="float32", max_model_len=128, seed=0,
                  kv_cache_memory_bytes=2_000_000, enforce_eager=True,
                  enable_prefix_caching=False)  # both runs feed every request from position 0
    prompts = [{"prompt_token_ids": [5 + (7 * i + 3 * j) % 300 for j in range(6 + 5 * i)]}
               for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def generate(llm: Any) -> list[list[int]]:
        return [list(o.outputs[0].token_ids)
                for o in llm.generate(prompts, params, use_tqdm=False)]

    want = generate(LLM(**common))
    spec = LLM(**common, **specdiff_engine_args(
        gamma, drafter=str(conditioned_run[1]), quantize="none", log_interval=0,
        candidates=["argmax", "sample"]))
    pattern = [Plan(0), Plan(0), Plan(0), Plan(gamma),
               Plan(0, probe_rows=1, probe_gamma=gamma), Plan(0), Plan(2)]
    runs, projected = {}, {}
    for rows in (DEFAULT_MAX_BACKLOG, 0):
        assert spec.collective_rpc(_set_max_backlog, args=(rows,)) == [True]
        monkeypatch.setattr(AdaptiveDrafting, "plan", _cycling_plans(pattern))
        reset_specdiff_stats(spec)
        before = specdiff_stats(spec)["proposer"]["context_projected_rows"]
        assert generate(spec) == want
        runs[rows] = specdiff_stats(spec)["proposer"]
        projected[rows] = runs[rows]["context_projected_rows"] - before
    deferred, eager = runs[DEFAULT_MAX_BACKLOG], runs[0]
    assert deferred["verify_steps"] > 10 and deferred["mean_accepted_length"] > 0
    for key in ("accepted_length_histogram", "per_position_acceptance", "verify_steps",
                "drafted_tokens", "idle_steps"):
        assert deferred[key] == eager[key], key
    assert deferred["idle_steps"] > 0
    assert 0 < projected[DEFAULT_MAX_BACKLOG] < projected[0]
    assert eager["context_restarts"] == 0
