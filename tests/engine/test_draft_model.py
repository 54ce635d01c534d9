"""vLLM's own `draft_model` method with an AR drafter written by `training.causal` (the
baseline the bench compares SpecDiff with), on the CPU build: greedy output equals plain
decoding, a full-depth copy of the verifier has every draft token accepted (so the drafts
really are the draft model's greedy tokens, per request), and seeded sampling is reproducible."""

from __future__ import annotations

import pytest

from tests.tiny_models import LAYERS, word_prompt

pytestmark = pytest.mark.vllm

GAMMA = 4


def _engine_kwargs(model) -> dict:
    return dict(model=str(model), max_model_len=256, max_num_seqs=4, seed=0,
                kv_cache_memory_bytes=400_000, dtype="float32", enforce_eager=True,
                disable_log_stats=False)


def _counters(llm) -> dict:
    out: dict = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            out[metric.name.removeprefix("vllm:spec_decode_")] = \
                getattr(metric, "values", None) or getattr(metric, "value", 0)
    return out


def test_draft_model_greedy_equals_plain_and_full_depth_drafts_are_accepted(tiny_verifier,
                                                                             tmp_path):
    from vllm import LLM, SamplingParams

    from vllm_specdiff_training.causal import load_causal_drafter

    drafter = tmp_path / "ar-drafter"
    load_causal_drafter(tiny_verifier, num_layers=LAYERS).save_pretrained(drafter)
    prompts = [word_prompt(i, 5 + 13 * i) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    plain = LLM(**_engine_kwargs(tiny_verifier))
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    del plain
    spec = LLM(**_engine_kwargs(tiny_verifier), speculative_config={
        "method": "draft_model", "model": str(drafter), "num_speculative_tokens": GAMMA})
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    counters = _counters(spec)
    assert counters["num_drafts"] > 0
    assert counters["num_accepted_tokens_per_pos"] == [counters["num_drafts"]] * GAMMA
    # Temperature 1, seeded: reproducible only with the plugin's CPU expand_kernel fix
    # (installed for every engine by the general plugin; without it the verifier's logits are
    # divided by uninitialised memory and each run samples differently).
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=1)
    runs = [[o.outputs[0].token_ids for o in spec.generate(prompts[:2], seeded, use_tqdm=False)]
            for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
