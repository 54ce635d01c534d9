"""The `quantize` drafter option inside an engine: an int8 drafter keeps greedy output
identical to plain decoding."""


def test_int8_drafter_keeps_greedy_output_identical(tiny_verifier, tiny_drafter):
    """The CPU default (int8 linears) changes which drafts are proposed, never the output."""
    from vllm import LLM, SamplingParams

    from tests.tiny_models import speculative_args, word_prompt
    from vllm_specdiff.plugin.engine import specdiff_stats

    common = dict(model=str(tiny_verifier), max_model_len=256, max_num_seqs=4, seed=0,
                  kv_cache_memory_bytes=200_000, dtype="float32", enforce_eager=True,
                  disable_log_stats=False)
    prompts = [word_prompt(i, 6 + 9 * i) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    plain = LLM(**common)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    del plain
    # quantize: auto; drafting every step, so the int8 drafter's drafts are verified
    spec = LLM(**common, **speculative_args(tiny_drafter, gamma=4, adaptive=False))
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    stats = specdiff_stats(spec)
    assert stats["proposer"]["quantization"] == "int8"
    assert stats["mean_accepted_length"] > 0.5  # the int8 drafter still drafts useful tokens
