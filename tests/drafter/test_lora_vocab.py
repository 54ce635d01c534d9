"""LoRA merge at load time, reduced draft vocabulary, and the build-vocab command."""

from __future__ import annotations

import argparse

import pytest
import torch
from peft import LoraConfig, get_peft_model

from vllm_specdiff.commands import build_vocab
from vllm_specdiff.drafter import (
    BlockCausalDrafter,
    apply_reduced_vocab,
    build_d2t,
    load_d2t,
    load_drafter,
    save_d2t,
    verifier_to_draft,
)
from vllm_specdiff.drafter.vocab import count_tokens

from .checkpoints import write_causal_lm, write_dream, write_word_tokenizer

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def block_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("ar")
    write_causal_lm(base, arch="qwen2", vocab=80, tie=False)
    out = tmp_path_factory.mktemp("block")
    BlockCausalDrafter.from_causal_lm(base, num_layers=2).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dream_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dream")
    write_dream(path)
    return path


def _adapter(drafter, path, targets, seed=0):
    torch.manual_seed(seed)
    peft_model = get_peft_model(drafter, LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                    init_lora_weights=False))
    peft_model.save_pretrained(path)
    return peft_model


@pytest.mark.parametrize("fmt", ["block", "dream"])
def test_merged_lora_equals_peft_unmerged(fmt, block_dir, dream_dir, tmp_path):
    path = block_dir if fmt == "block" else dream_dir
    targets = TARGETS + (["lm_head", "embed_tokens"] if fmt == "block" else [])
    peft_model = _adapter(load_drafter(path), tmp_path / "adapter", targets)
    ids = torch.randint(0, 60, (2, 10), generator=torch.Generator().manual_seed(0))
    starts = torch.tensor([[2, 7], [5, 10]])
    with torch.no_grad():
        expected = peft_model(ids, starts, 3)  # peft forward -> Drafter.forward
    merged = load_drafter(path, lora=tmp_path / "adapter")
    with torch.no_grad():
        got = merged.window_logits(ids, starts, 3)
        base = load_drafter(path).window_logits(ids, starts, 3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (got - base).abs().max() > 1e-2  # the adapter really changed the model


def test_lora_mismatch_errors(dream_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    _adapter(load_drafter(dream_dir), tmp_path / "adapter", ["q_proj"])
    base = tmp_path / "ar"
    write_causal_lm(base, arch="qwen2", vocab=80, layers=1)
    BlockCausalDrafter.from_causal_lm(base, num_layers=1).save_pretrained(tmp_path / "one")
    with pytest.raises(ValueError, match="does not match the base model.*layers.1"):
        load_drafter(tmp_path / "one", lora=tmp_path / "adapter")  # no second layer
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = next(k for k in tensors if k.endswith("lora_B.weight"))
    tensors[key] = tensors[key][:-4].contiguous()
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match="does not match the base model.*shape"):
        load_drafter(dream_dir, lora=tmp_path / "adapter")
    with pytest.raises(FileNotFoundError, match="adapter"):
        load_drafter(dream_dir, lora=tmp_path / "missing")


def test_lora_bias_adapter_is_refused_not_silently_dropped(dream_dir, tmp_path):
    import json

    torch.manual_seed(0)
    get_peft_model(load_drafter(dream_dir), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False,
        lora_bias=True)).save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match="lora_bias"):
        load_drafter(dream_dir, lora=tmp_path / "adapter")
    config = tmp_path / "adapter" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "lora_bias": False}))
    with pytest.raises(ValueError, match="LoRA bias"):  # the weights alone give it away
        load_drafter(dream_dir, lora=tmp_path / "adapter")


def test_d2t_round_trip_and_build():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 3, 7])
    d2t = build_d2t(counts, size=4, always_include=[1], exclude=[3])
    assert d2t.tolist() == [0, 1, 2, 7]  # 2 (9), 7 (7), 0 (5) by frequency, 1 forced, 3 excluded
    t2d = verifier_to_draft(d2t, 8)
    assert torch.equal(t2d[d2t], torch.arange(4))
    assert (t2d[[3, 4, 5, 6]] == -1).all()
    covered = t2d >= 0
    assert torch.equal(d2t[t2d[covered]], torch.arange(8)[covered])
    assert count_tokens([[0, 2, 2], [7]], 8).tolist() == [1, 0, 2, 0, 0, 0, 0, 1]
    with pytest.raises(ValueError, match="size"):
        build_d2t(counts, size=9)


def test_reduced_vocab_drafter(dream_dir, tmp_path):
    full = load_drafter(dream_dir, verifier_vocab_size=96)
    d2t = torch.tensor([0, 3, 4, 10, 50, 95])
    reduced = load_drafter(dream_dir, verifier_vocab_size=96)
    apply_reduced_vocab(reduced, d2t)
    assert reduced.lm_head.out_features == 6
    ctx = [torch.tensor([3, 4, 5]), torch.tensor([9])]
    a, b = reduced.draft_logits(ctx, 3), full.draft_logits(ctx, 3)
    assert a.shape == b.shape == (2, 3, 96)
    torch.testing.assert_close(a[..., d2t], b[..., d2t])
    others = torch.ones(96, dtype=torch.bool)
    others[d2t] = False
    assert torch.isneginf(a[..., others]).all()
    with pytest.raises(ValueError, match="mask"):
        apply_reduced_vocab(load_drafter(dream_dir), torch.tensor([1, 97]))
    # stored beside the weights, it is applied at load time
    copy = tmp_path / "dream_reduced"
    copy.mkdir()
    for f in dream_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    save_d2t(copy, d2t)
    assert torch.equal(load_d2t(copy), d2t)
    auto = load_drafter(copy, verifier_vocab_size=96)
    torch.testing.assert_close(auto.draft_logits(ctx, 3), a)


def test_block_causal_reduced_vocab_save_load(tmp_path):
    base = tmp_path / "ar"
    write_causal_lm(base, arch="llama", vocab=64)
    d2t = torch.tensor([1, 2, 5, 8, 13, 21, 34, 55])
    drafter = BlockCausalDrafter.from_causal_lm(base, num_layers=1, draft_to_verifier=d2t)
    full = BlockCausalDrafter.from_causal_lm(base, num_layers=1)
    ctx = [torch.tensor([7, 8, 9])]
    torch.testing.assert_close(drafter.draft_logits(ctx, 2)[..., d2t],
                               full.draft_logits(ctx, 2)[..., d2t])
    drafter.save_pretrained(tmp_path / "saved")
    loaded = load_drafter(tmp_path / "saved")
    assert torch.equal(loaded.draft_to_verifier, d2t)
    torch.testing.assert_close(loaded.draft_logits(ctx, 2), drafter.draft_logits(ctx, 2))
    assert loaded.window_logits(torch.tensor([[7, 8, 9]]), torch.tensor([[3]]), 2).shape \
        == (1, 1, 2, 8)


def test_build_vocab_command(tmp_path):
    words = ["<eos>", "the", "cat", "sat", "on", "mat", "dog", "ran", "<unk>"]
    write_word_tokenizer(tmp_path / "tok", words)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "the cat sat on the mat"}\n{"text": "the dog sat"}\n')
    parser = argparse.ArgumentParser()
    build_vocab.register(parser.add_subparsers())
    args = parser.parse_args(["build-vocab", "--tokenizer", str(tmp_path / "tok"), "--corpus",
                              str(corpus), "--size", "4", "--out", str(tmp_path / "drafter")])
    assert args.func(args) == 0
    # the(3) sat(2) forced: <eos>, <unk>; then cat(1) wins the tie with on/mat/dog by lower id
    assert load_d2t(tmp_path / "drafter").tolist() == [0, 1, 3, 8]


def test_tokenizer_match_check(tmp_path):
    words = ["<eos>", "<unk>"] + [f"w{i}" for i in range(62)]
    base = tmp_path / "ar"
    write_causal_lm(base, arch="llama", vocab=64)
    write_word_tokenizer(base, words)
    BlockCausalDrafter.from_causal_lm(base, num_layers=1).save_pretrained(tmp_path / "drafter")
    assert (tmp_path / "drafter" / "tokenizer.json").is_file()  # copied from the source model
    load_drafter(tmp_path / "drafter", verifier_tokenizer=base)
    write_word_tokenizer(tmp_path / "shorter", words[:50])  # a prefix of the vocab is fine
    load_drafter(tmp_path / "drafter", verifier_tokenizer=tmp_path / "shorter")
    swapped = list(words)
    swapped[10], swapped[11] = swapped[11], swapped[10]
    write_word_tokenizer(tmp_path / "other", swapped)
    with pytest.raises(ValueError, match="vocab mismatch with the verifier tokenizer.*id 10"):
        load_drafter(tmp_path / "drafter", verifier_tokenizer=tmp_path / "other")
