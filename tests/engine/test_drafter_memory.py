"""The drafter's KV cache inside vLLM: a byte budget smaller than the running requests need,
and a context window shorter than the prompts. Greedy output must still equal plain decoding,
the pool must end under its budget, and with a window the cache must still serve most tokens.
"""

from __future__ import annotations

import pytest

from tests.tiny_models import speculative_args, word_prompt

pytestmark = pytest.mark.vllm

GAMMA = 4
# bytes: the tiny drafter needs 520 per token, so a 300-token request holds ~195 kB and the
# 10 requests ~1.7 MB without a budget (all fit the default cache_size of 16 entries)
BUDGET = 600_000
WINDOW = 64


def _engine_kwargs(model) -> dict:
    return dict(model=str(model), max_model_len=512, max_num_seqs=4, seed=0,
                kv_cache_memory_bytes=2_000_000, dtype="float32", enforce_eager=True,
                disable_log_stats=False)


def _prompts() -> list[str]:
    return [word_prompt(100 + i, 150 + 25 * i) for i in range(10)]  # 150..375 words


def _generate(llm) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    return [list(o.outputs[0].token_ids)
            for o in llm.generate(_prompts(), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected(tiny_verifier) -> list[list[int]]:
    from vllm import LLM

    plain = LLM(**_engine_kwargs(tiny_verifier))
    out = _generate(plain)
    del plain
    return out


def _cache_stats(llm) -> dict:
    from vllm_specdiff.plugin.engine import specdiff_stats

    stats = specdiff_stats(llm)
    assert stats["vllm"]["num_drafts"] > 0
    return stats["proposer"]["drafter_cache"]


def test_byte_budget_holds_through_vllm(tiny_verifier, tiny_drafter, expected):
    """Fixed gamma here and below: the cache figures assume a draft every step (adaptive
    drafting skips steps, which only leaves more to catch up on: test_adaptive_engine.py)."""
    from vllm import LLM

    spec = LLM(**_engine_kwargs(tiny_verifier),
               **speculative_args(tiny_drafter, gamma=GAMMA, cache_bytes=BUDGET, adaptive=False))
    assert _generate(spec) == expected
    cache = _cache_stats(spec)
    del spec
    assert cache["max_bytes"] == BUDGET
    assert 0 < cache["bytes"] <= BUDGET
    assert cache["evictions"] > 0
    assert cache["hit_tokens"] > 3 * cache["miss_tokens"]  # rows that fit kept hitting


def test_context_window_keeps_the_cache_useful_through_vllm(tiny_verifier, tiny_drafter,
                                                            expected):
    from vllm import LLM

    spec = LLM(**_engine_kwargs(tiny_verifier),
               **speculative_args(tiny_drafter, gamma=GAMMA, context_window=WINDOW,
                                  adaptive=False))
    assert _generate(spec) == expected
    cache = _cache_stats(spec)
    del spec
    # a window sliding one token per step re-encoded all WINDOW tokens every step (no hits)
    assert cache["hit_tokens"] > 2 * cache["miss_tokens"]
