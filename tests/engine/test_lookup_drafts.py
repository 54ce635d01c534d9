"""Prompt-lookup and datastore drafts (K = 1, `candidates: ["argmax", "ngram"]`) inside an
engine: only the drafts change, so greedy output stays identical to plain decoding.
"""

from __future__ import annotations

import pytest

from tests.plugin.test_lookup_drafts import _datastore
from tests.tiny_models import speculative_args, word, word_prompt


@pytest.mark.vllm
def test_lookup_drafts_keep_greedy_output_identical(tiny_verifier, tiny_drafter):
    import gc

    from vllm import LLM, SamplingParams

    from vllm_specdiff.plugin.engine import specdiff_stats

    kwargs = dict(model=str(tiny_verifier), max_model_len=256, max_num_seqs=4, seed=0,
                  kv_cache_memory_bytes=200_000, dtype="float32", enforce_eager=True)
    # repeating prompts give lookup matches; the others leave rows to the drafter
    prompts = [" ".join(word(j % 3) for j in range(12)) if i % 2 else word_prompt(i, 12)
               for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(**kwargs)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    del plain
    gc.collect()
    spec = LLM(**kwargs, **speculative_args(tiny_drafter, gamma=4, adaptive=False,
                                            candidates=["argmax", "ngram"]))
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    stats = specdiff_stats(spec)["proposer"]
    del spec
    gc.collect()
    assert got == expected
    assert 0 < stats["lookup_drafts"] < stats["drafted_rows"]  # both sources drafted


@pytest.mark.vllm
def test_datastore_drafts_keep_greedy_output_identical(tiny_verifier, tiny_drafter, tmp_path):
    import gc

    from vllm import LLM, SamplingParams

    from vllm_specdiff.plugin.engine import specdiff_stats

    kwargs = dict(model=str(tiny_verifier), max_model_len=256, max_num_seqs=4, seed=0,
                  kv_cache_memory_bytes=200_000, dtype="float32", enforce_eager=True)
    prompts = [word_prompt(i, 12) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(**kwargs)
    outputs = plain.generate(prompts, params, use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in outputs]
    # the datastore: the verifier's own continuations of half the prompts, so the others'
    # drafts come from it wherever their suffixes recur, right or wrong
    path = _datastore(tmp_path, [(list(o.prompt_token_ids) + list(o.outputs[0].token_ids),
                                  len(o.prompt_token_ids)) for o in outputs[:2]])
    del plain
    gc.collect()
    spec = LLM(**kwargs, **speculative_args(tiny_drafter, gamma=4, adaptive=False,
                                            datastore=str(path)))
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    stats = specdiff_stats(spec)["proposer"]
    del spec
    gc.collect()
    assert got == expected
    assert stats["datastore_drafts"] > 0  # retrieval drafted, and verification decided
