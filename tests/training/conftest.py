"""Tiny models the tests write themselves: a word-level tokenizer and a random Llama verifier."""

import json

import pytest
import torch

VOCAB = 64


def make_tokenizer(path, words=None, seed_word="w"):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<eos>", "<pad>"]
    words = words or [f"{seed_word}{i}" for i in range(VOCAB - len(specials))]
    vocab = {t: i for i, t in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                   pad_token="<pad>")
    fast.save_pretrained(path)
    return fast


def make_verifier(path, seed=0, layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=256, eos_token_id=1, pad_token_id=2,
                      bos_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # peaked next-token distributions, so continuations are learnable
        model.lm_head.weight.mul_(20.0)
        model.lm_head.weight[1] = 0.0  # rare EOS: long continuations
    model.save_pretrained(path)
    make_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def verifier_dir(tmp_path_factory):
    return make_verifier(tmp_path_factory.mktemp("verifier"))


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    gen = torch.Generator().manual_seed(0)
    lines = []
    for i in range(24):
        words = " ".join(f"w{int(t)}" for t in torch.randint(0, 60, (3 + i % 4,), generator=gen))
        lines.append(json.dumps({"prompt": words} if i % 2 else words))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def verifier3(tmp_path_factory):
    """A 3-layer tiny verifier (the conditioned drafters' tests tap two of its layers)."""
    return make_verifier(tmp_path_factory.mktemp("verifier3"), layers=3)


@pytest.fixture(scope="session")
def greedy_data(tmp_path_factory, verifier3, prompts_file):
    """verifier3's greedy continuations of the prompts, without soft targets."""
    from vllm_specdiff_training.generate import GenerateConfig, run_generate

    out = tmp_path_factory.mktemp("greedy")
    run_generate(GenerateConfig(verifier=str(verifier3), prompts=str(prompts_file),
                                output=str(out), num_samples=1, max_new_tokens=24,
                                temperature=0.0, top_logprobs=0, chunk_size=8, batch_size=8,
                                backend="transformers", chat_template=False))
    return out
