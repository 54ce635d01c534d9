"""Adaptive drafting inside vLLM: only the amount of drafting changes (greedy outputs stay
identical to plain decoding), drafts skipped for some steps do not break the drafter's KV cache,
and `adaptive: false` drafts num_speculative_tokens every step as before."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.tiny_models import (
    PREEMPTING_MAX_NUM_SEQS,
    preempting_engine_kwargs,
    speculative_args,
    word_prompt,
)
from vllm_specdiff.adaptive import AdaptiveDrafting, Plan, TailCredit

DRAFTER_ONLY = ["argmax", "sample"]  # candidates without prompt lookup (on by default)
MAX_NUM_SEQS = PREEMPTING_MAX_NUM_SEQS
ENGINE_GAMMA = 4


@pytest.fixture(scope="module")
def plain_engine(tiny_verifier):
    from vllm import LLM

    return LLM(**preempting_engine_kwargs(tiny_verifier))


@pytest.fixture(scope="module")
def adaptive_engine(tiny_verifier, tiny_drafter):
    """The default: adaptive on; the drafter alone (no lookup drafts, whose first token need
    not be the verifier's). float32, so the full-depth drafter's first token is exactly the
    verifier's. Tests request it after `plain_outputs`: vLLM's Prometheus counters read in this
    process are those of the engine built last."""
    from vllm import LLM

    return LLM(**preempting_engine_kwargs(tiny_verifier),
               **speculative_args(tiny_drafter, gamma=ENGINE_GAMMA, quantize="none",
                                  candidates=DRAFTER_ONLY))


@pytest.fixture(scope="module")
def fixed_engine(tiny_verifier, tiny_drafter):
    """adaptive: false (built by the last test, see `adaptive_engine`)."""
    from vllm import LLM

    return LLM(**preempting_engine_kwargs(tiny_verifier),
               **speculative_args(tiny_drafter, gamma=ENGINE_GAMMA, quantize="none",
                                  adaptive=False))


def _prompts() -> list[str]:
    return [word_prompt(500 + i, 5 + 13 * i) for i in range(10)]


@pytest.fixture(scope="module")
def plain_outputs(plain_engine):
    return _generate(plain_engine)


def _generate(llm) -> list:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=48)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]


def _fresh_stats(llm) -> tuple[dict, dict]:
    """(vLLM's spec-decode counters, the proposer's stats) of one greedy run of _prompts()."""
    from vllm_specdiff.plugin.engine import (
        reset_specdiff_stats,
        specdiff_stats,
        vllm_spec_decode_counters,
    )

    before = vllm_spec_decode_counters(llm)
    reset_specdiff_stats(llm)
    outputs = _generate(llm)
    stats = specdiff_stats(llm)
    counters = {k: v - before.get(k, 0) for k, v in stats["vllm"].items()
                if isinstance(v, int | float)}
    return {"outputs": outputs, **counters}, stats["proposer"]


def _preemptions(llm) -> float:
    return sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics()
               if m.name == "vllm:num_preemptions")


def test_adaptive_greedy_outputs_identical(plain_outputs, adaptive_engine):
    preempted = _preemptions(adaptive_engine)
    counters, ours = _fresh_stats(adaptive_engine)
    assert counters["outputs"] == plain_outputs
    assert _preemptions(adaptive_engine) > preempted, "no preemption happened"
    adaptive = ours["adaptive"]
    assert adaptive["enabled"] is True
    assert sum(adaptive["chosen_gamma_histogram"]) == adaptive["steps"] > 0
    assert adaptive["verifier_ms"]["per_token"] >= 0
    # our accepted counts still agree with vLLM's whatever the draft lengths were
    assert ours["verify_steps"] == counters["num_drafts"]
    assert ours["drafted_tokens"] == counters["num_draft_tokens"]


def _cycling_plans(pattern: list[Plan]) -> Callable:
    state = {"step": 0}

    def plan(self: AdaptiveDrafting, rows: int, lookup_rows: int | None = None,
             credit: TailCredit | None = None, *catch_up: float | None) -> Plan:
        state["step"] += 1
        return pattern[state["step"] % len(pattern)]

    return plan


def test_skipped_and_shortened_drafts_keep_outputs_and_drafter_cache_exact(plain_outputs,
                                                                           adaptive_engine,
                                                                           monkeypatch):
    """Steps with no draft, shorter drafts and one-row probes: the drafter's KV pool catches up
    on the context it did not see, so the full-depth drafter's first token stays the verifier's
    greedy token on every drafted step (a stale or misaligned cache would break that)."""
    pattern = [Plan(0), Plan(0), Plan(ENGINE_GAMMA), Plan(0), Plan(2),
               Plan(0, probe_rows=1, probe_gamma=ENGINE_GAMMA), Plan(1), Plan(0), Plan(0)]
    monkeypatch.setattr(AdaptiveDrafting, "plan", _cycling_plans(pattern))
    counters, ours = _fresh_stats(adaptive_engine)
    assert counters["outputs"] == plain_outputs
    assert counters["num_drafts"] > 20
    assert 0 < counters["num_draft_tokens"] < ENGINE_GAMMA * counters["num_drafts"]
    assert counters["num_accepted_tokens"] >= counters["num_drafts"]
    assert ours["per_position_acceptance"][0] == 1.0
    assert ours["verify_steps"] == counters["num_drafts"]
    assert ours["drafted_tokens"] == counters["num_draft_tokens"]
    assert ours["accepted_length_histogram"][0] == 0
    assert len(ours["accepted_length_histogram"]) == ENGINE_GAMMA + 1


def test_adaptive_off_drafts_gamma_every_step(plain_outputs, fixed_engine):
    counters, ours = _fresh_stats(fixed_engine)
    assert counters["outputs"] == plain_outputs
    assert ours["adaptive"] == {"enabled": False}
    assert counters["num_drafts"] > 0
    assert counters["num_draft_tokens"] == ENGINE_GAMMA * counters["num_drafts"]
    assert ours["verify_steps"] == counters["num_drafts"]


def test_tries_with_skipped_steps_keep_greedy_outputs(plain_outputs, tiny_verifier, tiny_drafter,
                                                      monkeypatch):
    """K = 2: steps with no draft, full tries and one-row probes; outputs stay plain decoding's
    and the trie steps are verified (adaptive with K > 1 chooses only 0 or the full trie)."""
    from vllm import LLM

    from vllm_specdiff.plugin.workers import CPU_TREE_WORKER

    pattern = [Plan(0), Plan(ENGINE_GAMMA), Plan(0, probe_rows=1, probe_gamma=ENGINE_GAMMA),
               Plan(0), Plan(ENGINE_GAMMA), Plan(ENGINE_GAMMA)]
    monkeypatch.setattr(AdaptiveDrafting, "plan", _cycling_plans(pattern))
    llm = LLM(**preempting_engine_kwargs(tiny_verifier), worker_cls=CPU_TREE_WORKER,
              async_scheduling=False,
              **speculative_args(tiny_drafter, gamma=ENGINE_GAMMA, quantize="none", K=2,
                                 drafter_temperature=1.5, max_tree_tokens=2 * ENGINE_GAMMA + 1))
    assert _generate(llm) == plain_outputs
    stats = llm.collective_rpc(_proposer_stats)[0]
    assert stats["tree"]["steps"] > 10
    assert stats["adaptive"]["enabled"] is True
    # the measured trie size (shared prefixes merge), moved from its start at max_tree_tokens - 1
    assert ENGINE_GAMMA < stats["adaptive"]["full_draft_tokens"] < 2 * ENGINE_GAMMA


def _proposer_stats(worker) -> dict:
    return getattr(worker, "worker", worker).model_runner.drafter.get_stats()
