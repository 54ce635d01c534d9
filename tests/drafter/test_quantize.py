"""Drafter quantisation: int8 linears on CPU, the choice per device, and what it refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_specdiff.drafter import BlockCausalDrafter, load_drafter
from vllm_specdiff.drafter.quantize import quantize_drafter, resolve_quantize

from .checkpoints import write_causal_lm

VOCAB = 96


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("qbase")
    write_causal_lm(base, arch="llama", vocab=VOCAB, tie=True)
    out = tmp_path_factory.mktemp("qdrafter")
    BlockCausalDrafter.from_causal_lm(base, num_layers=2).save_pretrained(out)
    return out


def test_auto_is_int8_on_cpu_only():
    assert resolve_quantize("auto", "cpu") == "int8"
    assert resolve_quantize("auto", "cuda") == "none"
    assert resolve_quantize("none", "cpu") == "none"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantize("int8", "cuda:0")
    with pytest.raises(ValueError, match="quantize must be one of"):
        resolve_quantize("int4", "cpu")


def test_int8_replaces_every_linear_and_keeps_the_drafts_close(drafter_dir):
    plain = load_drafter(drafter_dir, quantize="none")
    quant = load_drafter(drafter_dir, quantize="int8")
    assert quant.quantization == "int8" and plain.quantization == "none"
    assert not any(type(m) is nn.Linear for m in quant.modules())
    assert any(type(m) is nn.Linear for m in plain.modules())
    gen = torch.Generator().manual_seed(0)
    contexts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (9, 4)]
    a, b = plain.draft_logits(contexts, 4), quant.draft_logits(contexts, 4)
    cos = torch.nn.functional.cosine_similarity(a.flatten(1), b.flatten(1), dim=-1)
    assert bool((cos > 0.99).all()), cos
    assert not torch.equal(a, b)  # it really runs other kernels


def test_int8_needs_a_float32_cpu_drafter(drafter_dir):
    bf16 = load_drafter(drafter_dir, dtype="bfloat16", quantize="none")
    with pytest.raises(ValueError, match="float32 CPU drafter"):
        quantize_drafter(bf16, "int8")


MASSIVE = 3  # the feature channel with a massive activation


def _conditioned(tmp_path):
    from vllm_specdiff.drafter.conditioned import ConditionedConfig, ConditionedDrafter

    verifier = tmp_path / "verifier"
    write_causal_lm(verifier, vocab=VOCAB, layers=3)
    cfg = ConditionedConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, intermediate_size=64, vocab_size=VOCAB,
                            target_layer_ids=(0, 1), num_hidden_layers=2, block_size=5,
                            max_position_embeddings=64, verifier_num_layers=3)
    drafter = ConditionedDrafter.from_verifier(verifier, cfg, seed=1)
    with torch.no_grad():  # trained drafters learn to damp the massive channel
        drafter.fc.weight[:, MASSIVE] = 0
        drafter.fc.weight.mul_(10)
    out = tmp_path / "drafter"
    drafter.save_pretrained(out)
    return out, verifier


def _window_logits(drafter, features):
    ids = torch.arange(features.shape[1])[None] % VOCAB
    with torch.no_grad():
        return drafter.window_logits(ids, torch.tensor([[features.shape[1] - 5]]),
                                     features=features)


def test_int8_keeps_a_conditioned_drafters_feature_projection_in_float(tmp_path):
    """The verifier's residual streams carry a few massive channels (~10^4 against ~2 in
    SmolLM2): per-tensor int8 activations of `fc` would round every other channel away."""
    path, verifier = _conditioned(tmp_path)
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(1, 24, 64, generator=gen)
    features[..., MASSIVE] = 2e4  # one massive channel, as in the real verifier's taps
    plain = load_drafter(path, verifier=verifier, quantize="none")
    quant = load_drafter(path, verifier=verifier, quantize="int8")
    assert type(quant.fc) is nn.Linear  # kept float
    assert type(quant.layers[0].mlp["gate_proj"]) is not nn.Linear  # the rest is int8
    want = _window_logits(plain, features)
    err = (_window_logits(quant, features) - want).abs().max() / want.abs().max()
    # negative control: an int8 fc loses the ordinary channels
    everything = load_drafter(path, verifier=verifier, quantize="none")
    everything.float_linears = ()
    quantize_drafter(everything, "int8")
    control = (_window_logits(everything, features) - want).abs().max() / want.abs().max()
    assert err < 0.05 and control > 4 * err, (err, control)
