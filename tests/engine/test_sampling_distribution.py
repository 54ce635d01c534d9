"""Lossless sampling through vLLM, with negative controls that show the tests can fail.

The statistic is the one of `test_offline.py::test_sampling_at_temperature_one_matches_plain_
decoding`: the token after the first verified position, 400 seeded samples with and without
speculation, chi-square on the contingency table (rare tokens merged). Its negative control
puts vLLM's CPU `expand_kernel` bug back, made deterministic (the per-token temperatures of
verification come out wrong), and asserts that the same statistic rejects. The filtered case
(temperature 0.7, top-p 0.9, top-k 5) must pass, and must reject plain decoding at the same
temperature without the filters.
Prompt-lookup drafts (K = 1 with the "ngram" candidate, the default) go through the same rule:
on a prompt after which every likely token continues a lookup match, every sample (top-k 3) is
verified against a lookup draft; its negative control is plain decoding at a lower
temperature (vLLM's broken kernel crashes the engine under top-k instead of sampling wrong).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.tiny_models import speculative_args, word, word_prompt
from vllm_specdiff.plugin.patches.cpu_fixes import KERNEL, expand_any_dtype

pytestmark = pytest.mark.vllm

SAMPLES = 400
PASS_P, REJECT_P = 1e-3, 1e-6
FILTERED = {"temperature": 0.7, "top_p": 0.9, "top_k": 5}
# For this prompt the filters matter: 8 tokens carry the filtered second-token distribution and
# it is 0.2 in total variation from the unfiltered one at T = 0.7 (the prompt of the T = 1 test
# gives 0.02, too close for the power control).
FILTERED_PROMPT = word_prompt(36, 12)


def _engine_kwargs(model) -> dict:
    # Many short requests at once: 400 samples take a few batches, not a hundred.
    return dict(model=str(model), max_model_len=256, max_num_seqs=64, seed=0,
                kv_cache_memory_bytes=4_000_000, dtype="float32", enforce_eager=True)


@pytest.fixture(scope="module")
def engines(tiny_verifier, tiny_drafter):
    from vllm import LLM

    plain = LLM(**_engine_kwargs(tiny_verifier))
    # adaptive drafting off: every request's second token goes through verification; the
    # drafter's drafts only (lookup drafts: `lookup_engine`)
    spec = LLM(**_engine_kwargs(tiny_verifier),
               **speculative_args(tiny_drafter, gamma=4, adaptive=False,
                                  candidates=["argmax", "sample"]))
    return plain, spec


def second_tokens(llm, prompt: str, seed0: int, batch: int = SAMPLES,
                  **sampling: float) -> list[int]:
    """The second generated token of SAMPLES seeded requests, submitted `batch` at a time."""
    from vllm import SamplingParams

    tokens: list[int] = []
    for lo in range(0, SAMPLES, batch):
        params = [SamplingParams(max_tokens=2, seed=seed0 + i, ignore_eos=True, **sampling)
                  for i in range(lo, min(lo + batch, SAMPLES))]
        outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
        tokens += [o.outputs[0].token_ids[1] for o in outs]
    return tokens


@pytest.fixture(scope="module")
def filtered_spec_samples(engines) -> list[int]:
    """Speculative samples of the filtered case, shared by its test and its power control.
    Every request drafted (adaptive drafting off), so the second tokens went through
    verification: a test of plain sampling in disguise would prove nothing."""
    from vllm_specdiff.plugin.engine import specdiff_stats

    before = specdiff_stats(engines[1])["proposer"]["drafted_rows"]
    samples = second_tokens(engines[1], FILTERED_PROMPT, 50_000, **FILTERED)
    drafted = specdiff_stats(engines[1])["proposer"]["drafted_rows"] - before
    assert drafted >= SAMPLES, drafted
    return samples


def contingency_pvalue(a: list[int], b: list[int]) -> float:
    """Chi-square p-value that two samples share one distribution; tokens with fewer than 10
    draws in total are merged into one category."""
    from scipy.stats import chi2_contingency

    tokens = sorted(set(a) | set(b))
    counts = [[a.count(t) for t in tokens], [b.count(t) for t in tokens]]
    common = [i for i, _ in enumerate(tokens) if counts[0][i] + counts[1][i] >= 10]
    rare = [i for i in range(len(tokens)) if i not in common]
    table = [[row[i] for i in common] + ([sum(row[i] for i in rare)] if rare else [])
             for row in counts]
    assert len(table[0]) >= 3, f"distribution too peaked for a meaningful test: {table}"
    return float(chi2_contingency(table).pvalue)


# The negative control's verification temperatures, as a multiple of the requested ones. Hotter,
# not colder: the second token mostly follows from the first (sampled in the prefill, which does
# not use the kernel), and a colder verifier only sharpens the few spread cases (0.03x: p 7e-7;
# 3x: p 3e-49, measured 2026-12-04).
WRONG_TEMPERATURE_SCALE = 3.0


def expand_with_wrong_temperatures(output_ptr: torch.Tensor, input_ptr: torch.Tensor,
                                   cu_num_tokens_ptr: torch.Tensor, replace_from: float,
                                   replace_to: float,
                                   MAX_NUM_TOKENS: int | None = None) -> None:  # noqa: N803
    """vLLM's CPU `expand_kernel` bug made deterministic: a float output (the per-token
    temperatures) is wrong. vLLM's own kernel leaves it uninitialised, so a control built on it
    depended on what the allocator handed back: alone it rejected with p < 1e-22, within the
    full suite p was 1e-5 twice, above REJECT_P."""
    expand_any_dtype(output_ptr, input_ptr, cu_num_tokens_ptr, replace_from, replace_to,
                     MAX_NUM_TOKENS)
    if output_ptr.is_floating_point():
        output_ptr.mul_(WRONG_TEMPERATURE_SCALE)


@pytest.fixture
def wrong_verification_temperatures() -> Iterator[None]:
    """The engines verify with `expand_with_wrong_temperatures` while the test runs, with the
    plugin's fix (checked to be the kernel registered before) again afterwards."""
    from vllm.triton_utils import dispatcher

    assert dispatcher._registry[KERNEL][1] is expand_any_dtype, "the CPU fix is not installed"
    dispatcher.register_kernels({KERNEL: expand_with_wrong_temperatures})
    try:
        yield
    finally:
        dispatcher.register_kernels({KERNEL: expand_any_dtype})


def test_temperature_one_test_rejects_wrong_verification_temperatures(
        engines, wrong_verification_temperatures):
    """The negative control of the temperature-1 test: same prompt, seeds and statistic, with
    verification at 3 times the requested temperature (plain decoding does not use the
    kernel)."""
    plain, spec = engines
    prompt = word_prompt(7, 12)
    p_value = contingency_pvalue(second_tokens(plain, prompt, 0, temperature=1.0),
                                 second_tokens(spec, prompt, 50_000, temperature=1.0))
    assert p_value < REJECT_P, p_value


def test_filtered_sampling_matches_plain_decoding(engines, filtered_spec_samples):
    p_value = contingency_pvalue(second_tokens(engines[0], FILTERED_PROMPT, 0, **FILTERED),
                                 filtered_spec_samples)
    assert p_value > PASS_P, p_value


def test_filtered_test_rejects_plain_decoding_without_the_filters(engines,
                                                                 filtered_spec_samples):
    """Power: speculation with top-k/top-p against plain decoding at the same temperature
    without them is told apart."""
    p_value = contingency_pvalue(second_tokens(engines[0], FILTERED_PROMPT, 0, temperature=0.7),
                                 filtered_spec_samples)
    assert p_value < REJECT_P, p_value


# Sampling of the lookup tests: top-k 3 at temperature 1, so that a prompt can make every
# likely first token continue a lookup match (`lookup_prompt`).
LOOKUP_SAMPLING = {"temperature": 1.0, "top_k": 3}


@pytest.fixture(scope="module")
def lookup_prompt(engines) -> str:
    """A short prompt after which prompt lookup matches whatever token is sampled first: it ends
    with the word A, and "A t" occurs earlier for each of the verifier's three likeliest next
    tokens t, the only ones top-k 3 samples (found by adding "A t" pairs for them until they stop
    changing). Short: 64 long prompts at once would make vLLM chunk their prefills, and on CPU
    vLLM's runner then fails on seeded requests ("CPU Generator does not use offset")."""
    from vllm import SamplingParams

    plain = engines[0]
    tokenizer = plain.get_tokenizer()
    anchor, base = word(5), word_prompt(11, 4)
    k = LOOKUP_SAMPLING["top_k"]
    pairs: list[str] = []
    prompt = f"{base} {anchor}"
    for _ in range(8):
        out = plain.generate([prompt], SamplingParams(max_tokens=1, logprobs=k, temperature=1.0),
                             use_tqdm=False)
        ranked = sorted(out[0].outputs[0].logprobs[0].items(), key=lambda kv: -kv[1].logprob)
        top = [tokenizer.decode([t]).strip() for t, _ in ranked[:k]]
        if all(t in pairs for t in top):
            return prompt
        pairs += [t for t in top if t and t not in pairs]
        prompt = " ".join(f"{anchor} {t}" for t in pairs) + f" {base} {anchor}"
    raise AssertionError(f"no prompt found whose next tokens all follow {anchor} earlier")


@pytest.fixture(scope="module")
def lookup_engine(tiny_verifier, tiny_drafter):
    from vllm import LLM

    return LLM(**_engine_kwargs(tiny_verifier),
               **speculative_args(tiny_drafter, gamma=4, adaptive=False))  # lookup by default


def lookup_second_tokens(engine, prompt: str, seed0: int, batch: int = SAMPLES) -> list[int]:
    """Second tokens of SAMPLES requests whose one verified step had a lookup draft (checked:
    a test of drafter drafts in disguise would prove nothing about lookup)."""
    from vllm_specdiff.plugin.engine import specdiff_stats

    before = specdiff_stats(engine)["proposer"]["lookup_drafts"]
    samples = second_tokens(engine, prompt, seed0, batch=batch, **LOOKUP_SAMPLING)
    assert specdiff_stats(engine)["proposer"]["lookup_drafts"] - before == SAMPLES
    return samples


def test_lookup_drafts_sample_as_plain_decoding(engines, lookup_engine, lookup_prompt):
    p_value = contingency_pvalue(
        second_tokens(engines[0], lookup_prompt, 0, **LOOKUP_SAMPLING),
        lookup_second_tokens(lookup_engine, lookup_prompt, 50_000))
    assert p_value > PASS_P, p_value


def test_lookup_test_rejects_a_sharper_distribution(engines, lookup_engine, lookup_prompt):
    """The lookup test's negative control. vLLM's broken CPU kernel cannot be it: with top-k its
    garbage k crashes the engine ("selected index k out of range") instead of sampling wrong.
    So, as for the filtered test: the same speculative samples against plain decoding at
    temperature 0.5 (same top-k) must be told apart."""
    sharper = {**LOOKUP_SAMPLING, "temperature": 0.5}
    p_value = contingency_pvalue(second_tokens(engines[0], lookup_prompt, 0, **sharper),
                                 lookup_second_tokens(lookup_engine, lookup_prompt, 50_000))
    assert p_value < REJECT_P, p_value
