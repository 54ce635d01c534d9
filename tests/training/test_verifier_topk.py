"""Soft targets the verifier computes by teacher forcing: the ones generation would have stored,
cached beside the data, and what a soft loss trains on when the data carry none."""

import pytest
import torch

from vllm_specdiff_training.data import load_sequences
from vllm_specdiff_training.trainer import Trainer
from vllm_specdiff_training.verifier_topk import attach_verifier_topk, topk_dir

from .test_conditioned_training import _cfg
from .test_pipeline import _generate


@pytest.fixture(scope="module")
def pair(tmp_path_factory, verifier3, prompts_file):
    """The same greedy continuations, once with generation's top-4 and once without."""
    root = tmp_path_factory.mktemp("pair")
    _generate(verifier3, prompts_file, root / "soft", num_samples=1, temperature=0.0,
              top_logprobs=4)
    _generate(verifier3, prompts_file, root / "hard", num_samples=1, temperature=0.0,
              top_logprobs=0)
    return load_sequences(root / "soft"), root / "hard"


def test_teacher_forced_top_k_equals_what_generation_stored(pair, verifier3):
    soft, hard_dir = pair
    hard = load_sequences(hard_dir)
    assert not hard.has_soft_targets
    torch.testing.assert_close(hard.tokens, soft.tokens)
    attach_verifier_topk(hard, verifier3, k=4)
    assert hard.has_soft_targets
    torch.testing.assert_close(hard.topk_logprobs, soft.topk_logprobs, rtol=0, atol=2e-3)
    # ties aside (equal log-probs may swap), the ids are generation's
    same = hard.topk_ids == soft.topk_ids
    assert same.float().mean() > 0.99
    # greedy data: each generated token is the verifier's top-1 at its position; an off-by-one
    # alignment (the logits of the token's own position) breaks this (negative control)
    generated = torch.cat([hard.sequence(i)[int(hard.prompt_lens[i]):] for i in range(len(hard))])
    assert torch.equal(hard.topk_ids[:, 0], generated)
    assert not torch.equal(hard.topk_ids[1:, 0], generated[:-1])
    # cached per shard beside the data; a second attach reads the cache
    cached = sorted(topk_dir(hard_dir, 4).glob("shard-*.safetensors"))
    assert len(cached) == len(hard.meta["_shards"])
    again = load_sequences(hard_dir)
    attach_verifier_topk(again, "/nonexistent/verifier", k=4)  # never loaded: all cached
    torch.testing.assert_close(again.topk_logprobs, hard.topk_logprobs)


def test_a_cache_that_does_not_match_the_data_is_refused(tmp_path, pair, verifier3):
    from safetensors.torch import load_file, save_file

    _, hard_dir = pair
    seqs = load_sequences(hard_dir)
    attach_verifier_topk(seqs, verifier3, k=4)
    first = sorted(topk_dir(hard_dir, 4).glob("shard-*.safetensors"))[0]
    saved = load_file(str(first))
    try:
        save_file({k: v[:-1].contiguous() for k, v in saved.items()}, str(first))
        with pytest.raises(ValueError, match="delete that folder"):
            attach_verifier_topk(load_sequences(hard_dir), verifier3, k=4)
    finally:
        save_file(saved, str(first))


def test_a_soft_loss_on_data_without_soft_targets_trains_on_the_verifiers(tmp_path, greedy_data,
                                                                          verifier3):
    summary = Trainer(_cfg(greedy_data, tmp_path / "kl", verifier3, loss="kl", steps=3)).run()
    assert summary["steps"] == 3
    assert list(topk_dir(greedy_data, 8).glob("shard-*.safetensors"))
    # a block-causal drafter has no verifier to ask: the error says how to get soft targets
    with pytest.raises(ValueError, match="--top-logprobs"):
        Trainer(_cfg(greedy_data, tmp_path / "bc", verifier3, arch="block-causal", loss="kl",
                     num_layers=1))
