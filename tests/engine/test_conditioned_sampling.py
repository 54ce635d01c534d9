"""Lossless sampling at temperature 1 through the verifier-conditioned drafter's worker, with its
negative control.

`test_conditioned_serving.py` checks that worker under greedy decoding only, where a rejection
sampler that verified with wrong probabilities would still emit plain decoding's tokens. Here
the statistic of `test_sampling_distribution.py` (the second generated token of 400 seeded
requests, with and without speculation, chi-square on the contingency table) is applied to
conftest's trained conditioned drafter served by the plugin (`SpecDiffConditionedCPUWorker`):
every request drafts (adaptive drafting off, no prompt-lookup candidate), some drafts are
accepted, and the samples must still follow the verifier's distribution. Its negative control
verifies at 3 times the requested temperature (`wrong_verification_temperatures`) and the same
statistic must reject.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_sampling_distribution import (  # noqa: F401 - the fixture, by name
    PASS_P,
    REJECT_P,
    SAMPLES,
    _engine_kwargs,
    contingency_pvalue,
    second_tokens,
    wrong_verification_temperatures,
)
from tests.tiny_models import CONDITIONED_GAMMA

pytestmark = pytest.mark.vllm

# The cycle verifier is flat at temperature 1, not peaked: its logits span a few units, so after
# most prompts the second token is spread over ~300 tokens, the chi-square table is mostly the
# merged rare category, and the 3x-hotter control (flatter still) is hard to tell apart (median
# p ~1e-7 for a random 12-word prompt, above REJECT_P for some seeds). The drafter, trained
# briefly on greedy text, also rarely drafts a likely token after random words (expected
# acceptance ~0.01 or less). This prompt is 3 random words and the verifier's 2 greedy tokens
# after them, like the drafter's training text: the first token is w27 with probability 0.38
# (w22 0.09), the second token's distribution is less flat (w27 0.18, w22 0.05, w23 0.02, ...),
# and the drafter's first draft is accepted with probability 0.16. In 200 simulated runs of
# the statistic (exact marginals from the transformers verifier) the table always had 3 or more
# categories, the control's p-value was at most 1e-12 and the null's at least 0.015. Found among
# ~600 random prompts (some ending in greedy tokens) by expected acceptance and control power.
PROMPT = "w205 w278 w288 w16 w27"
TEMPERATURE = 1.0


def _engine_with_stats(verifier: Path) -> dict:
    """The sampling tests' engine settings, with stat logging on for vLLM's accepted-token
    counter."""
    return {**_engine_kwargs(verifier), "disable_log_stats": False}


@pytest.fixture(scope="module")
def plain(cycle_verifier):
    """The cycle verifier without speculation."""
    from vllm import LLM

    return LLM(**_engine_with_stats(cycle_verifier))


@pytest.fixture(scope="module")
def conditioned(cycle_verifier, conditioned_run):
    """The cycle verifier with conftest's conditioned drafter, served by the plugin through the
    worker that captures the verifier's states. Adaptive drafting off and candidates without
    "ngram": every request's second token is verified against a drafter draft."""
    from vllm import LLM

    from vllm_specdiff.plugin.engine import specdiff_engine_args
    from vllm_specdiff.plugin.workers import CPU_CONDITIONED_WORKER

    args = specdiff_engine_args(CONDITIONED_GAMMA, drafter=str(conditioned_run[1]),
                                adaptive=False, candidates=["argmax", "sample"], log_interval=0)
    assert args["worker_cls"] == CPU_CONDITIONED_WORKER
    return LLM(**_engine_with_stats(cycle_verifier), **args)


@pytest.fixture(scope="module")
def plain_samples(plain) -> list[int]:
    """Plain decoding's second tokens, shared by the test and its negative control."""
    return second_tokens(plain, PROMPT, 0, temperature=TEMPERATURE)


def conditioned_second_tokens(llm) -> tuple[list[int], int]:
    """(second tokens of SAMPLES speculative requests, seeds 50 000 on; draft tokens vLLM
    accepted meanwhile). Checked: every request had a drafter draft, none a lookup draft (a test
    of plain sampling in disguise would prove nothing)."""
    from vllm_specdiff.plugin.engine import specdiff_stats

    before = specdiff_stats(llm)
    samples = second_tokens(llm, PROMPT, 50_000, temperature=TEMPERATURE)
    after = specdiff_stats(llm)
    drafted = after["proposer"]["drafted_rows"] - before["proposer"]["drafted_rows"]
    assert drafted >= SAMPLES, drafted
    assert after["proposer"]["lookup_drafts"] == before["proposer"]["lookup_drafts"]
    accepted = after["vllm"]["num_accepted_tokens"] - before["vllm"].get("num_accepted_tokens", 0)
    return samples, accepted


def test_conditioned_sampling_at_temperature_one_matches_plain_decoding(plain_samples,
                                                                       conditioned):
    samples, accepted = conditioned_second_tokens(conditioned)
    assert accepted > 0  # drafts were accepted: verification, not plain sampling
    p_value = contingency_pvalue(plain_samples, samples)
    assert p_value > PASS_P, p_value


@pytest.mark.usefixtures("wrong_verification_temperatures")
def test_conditioned_test_rejects_wrong_verification_temperatures(plain_samples, conditioned):
    """The negative control: same prompt, seeds and statistic, with the conditioned worker
    verifying at 3 times the requested temperature (plain decoding does not use the kernel)."""
    samples, _ = conditioned_second_tokens(conditioned)
    p_value = contingency_pvalue(plain_samples, samples)
    assert p_value < REJECT_P, p_value
