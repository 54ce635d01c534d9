"""The proposer inside vLLM's offline engine (`LLM`), on a tiny random verifier.

One plain and one speculative engine are shared by the module. The KV cache is sized so that
more prompts than `max_num_seqs`, of different lengths, force vLLM to reorder and preempt rows;
the tests check that this really happened (vLLM's preemption counter) and that greedy outputs
are still identical to plain decoding.
"""

from __future__ import annotations

import pytest

from tests.tiny_models import (
    PREEMPTING_MAX_NUM_SEQS,
    preempting_engine_kwargs,
    speculative_args,
    word_prompt,
)

pytestmark = pytest.mark.vllm

MAX_NUM_SEQS = PREEMPTING_MAX_NUM_SEQS
GAMMA = 4


@pytest.fixture(scope="module")
def engines(tiny_verifier, tiny_drafter):
    from vllm import LLM

    plain = LLM(**preempting_engine_kwargs(tiny_verifier))
    # float32 drafter: the tests below rely on its first token being exactly the verifier's
    # (int8, the CPU default, has its own greedy-identity test in test_quantize_option.py);
    # fixed gamma: the counters below assume GAMMA tokens per draft (adaptive drafting has its
    # own engine tests in test_adaptive_engine.py); the drafter alone (prompt-lookup drafts, on by
    # default, have theirs in test_lookup_drafts.py and test_sampling_distribution.py)
    spec = LLM(**preempting_engine_kwargs(tiny_verifier),
               **speculative_args(tiny_drafter, gamma=GAMMA, quantize="none", adaptive=False,
                                  candidates=["argmax", "sample"]))
    return plain, spec


def _counter(llm, name: str):
    total = 0
    for metric in llm.get_metrics():
        if metric.name == name:
            total += getattr(metric, "value", 0) or 0
    return total


def _greedy_prompts() -> list[str]:
    return [word_prompt(i, 5 + 13 * i) for i in range(10)]  # 5..122 words


def test_greedy_identical_under_reordering_and_preemption(engines):
    from vllm import SamplingParams

    from vllm_specdiff.plugin.engine import specdiff_stats

    plain, spec = engines
    prompts = _greedy_prompts()
    assert len(prompts) > MAX_NUM_SEQS
    params = SamplingParams(temperature=0.0, max_tokens=64)
    preempted_before = _counter(spec, "vllm:num_preemptions")
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert _counter(spec, "vllm:num_preemptions") > preempted_before, "no preemption happened"
    stats = specdiff_stats(spec)
    counters = stats["vllm"]
    assert counters["num_drafts"] > 0
    assert counters["num_draft_tokens"] == GAMMA * counters["num_drafts"]
    # The full-depth drafter's first token is the verifier's greedy token, so every verify step
    # accepts it, unless a row's draft went to the wrong request.
    first_position = counters["num_accepted_tokens_per_pos"][0]
    assert first_position == counters["num_drafts"]
    assert stats["mean_accepted_length"] >= 1.0


def test_proposer_stats_agree_with_vllm_counters(engines):
    from vllm import SamplingParams

    from vllm_specdiff.plugin.engine import reset_specdiff_stats, specdiff_stats

    _, spec = engines
    before = specdiff_stats(spec)["vllm"]
    reset_specdiff_stats(spec)
    spec.generate(_greedy_prompts()[:6], SamplingParams(temperature=0.0, max_tokens=32),
                  use_tqdm=False)
    stats = specdiff_stats(spec)
    after = stats["vllm"]
    ours = stats["proposer"]
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert ours["verify_steps"] == drafts
    assert ours["mean_accepted_length"] == pytest.approx(accepted / drafts)
    assert ours["propose_calls"] > 0 and ours["drafter_ms_per_step"] > 0


def test_seeded_sampling_completes_and_is_reproducible(engines):
    from vllm import SamplingParams

    _, spec = engines
    prompts = _greedy_prompts()[:6]
    params = [SamplingParams(temperature=1.0, max_tokens=24, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    first = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    second = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert all(len(t) == 24 for t in first)
    assert first == second
    other = [SamplingParams(temperature=1.0, max_tokens=24, seed=999 + i, ignore_eos=True)
             for i in range(len(prompts))]
    third = [o.outputs[0].token_ids for o in spec.generate(prompts, other, use_tqdm=False)]
    assert third != first  # the seed really drives sampling


def test_drafter_cache_stays_bounded_over_many_requests(engines):
    from vllm import SamplingParams

    from vllm_specdiff.plugin.engine import specdiff_stats

    _, spec = engines
    prompts = [word_prompt(10_000 + i, 3 + i % 7) for i in range(1200)]
    spec.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                  use_tqdm=False)
    proposer = specdiff_stats(spec)["proposer"]
    cache = proposer["drafter_cache"]
    cache_size = max(16, 2 * MAX_NUM_SEQS)
    assert cache["entries"] <= cache_size
    # Rows whose context shares a prefix with a cached entry extend it instead of adding one,
    # so not every request creates an entry; most do, and old ones are evicted.
    assert cache["evictions"] > 600
    assert cache["cached_tokens"] <= cache_size * 256


def test_sampling_at_temperature_one_matches_plain_decoding(engines):
    """Lossless at T=1: the token after the first verified position has the same distribution
    with and without speculation (chi-square on 400 seeded samples each). vLLM 0.32's CPU
    `expand_kernel` bug (fixed by the plugin) fails this test: temperatures become garbage."""
    from scipy.stats import chi2_contingency
    from vllm import SamplingParams

    plain, spec = engines
    prompt = word_prompt(7, 12)
    samples = 400

    def second_tokens(llm, seed0: int) -> list[int]:
        params = [SamplingParams(temperature=1.0, max_tokens=2, seed=seed0 + i, ignore_eos=True)
                  for i in range(samples)]
        outs = llm.generate([prompt] * samples, params, use_tqdm=False)
        return [o.outputs[0].token_ids[1] for o in outs]

    a, b = second_tokens(plain, 0), second_tokens(spec, 50_000)
    tokens = sorted(set(a) | set(b))
    counts = [[a.count(t) for t in tokens], [b.count(t) for t in tokens]]
    # merge rare tokens into one category so every expected count is reasonable
    common = [i for i, t in enumerate(tokens) if counts[0][i] + counts[1][i] >= 10]
    rare = [i for i in range(len(tokens)) if i not in common]
    table = [[row[i] for i in common] + [sum(row[i] for i in rare)] for row in counts]
    if not rare:
        table = [row[:-1] for row in table]
    assert len(table[0]) >= 3, "distribution too peaked for a meaningful test"
    p_value = chi2_contingency(table).pvalue
    assert p_value > 1e-3, (p_value, table)
