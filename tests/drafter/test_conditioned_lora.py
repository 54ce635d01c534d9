"""A LoRA adapter of a verifier-conditioned drafter, merged at load time like the other formats'."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_specdiff.drafter import load_drafter
from vllm_specdiff.drafter.conditioned import ConditionedConfig, ConditionedDrafter

from .checkpoints import write_causal_lm

H, VOCAB, GAMMA = 32, 96, 4
# the conditioned layers' projections and the feature projection
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "fc"]


def _cfg(layers: int = 2) -> ConditionedConfig:
    return ConditionedConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=8, intermediate_size=64, vocab_size=VOCAB,
                             target_layer_ids=(0, 1), num_hidden_layers=layers,
                             block_size=GAMMA + 1, max_position_embeddings=64,
                             verifier_num_layers=3)


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    path = tmp_path_factory.mktemp("verifier")
    write_causal_lm(path, vocab=VOCAB, layers=3)
    return path


def _drafter_dir(verifier, path, layers: int = 2):
    model = ConditionedDrafter.from_verifier(verifier, _cfg(layers), seed=3)
    with torch.no_grad():  # larger weights: the adapter's update visibly moves the logits
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name and "lm_head" not in name:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def drafter_dir(verifier, tmp_path_factory):
    return _drafter_dir(verifier, tmp_path_factory.mktemp("conditioned"))


def _adapter(drafter, path, targets, seed=0):
    """A peft adapter with random (non-zero) A and B; returns the wrapped, unmerged model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(drafter, LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                    init_lora_weights=False))
    peft_model.save_pretrained(path, save_embedding_layers=False)  # lm_head: its LoRA only
    return peft_model


def _inputs():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
    feats = torch.randn(2, 16, 2 * H, generator=gen)
    return ids, torch.tensor([[3, 9], [6, 12]]), feats


def test_merged_weights_are_base_plus_scaled_b_a_and_match_peft(verifier, drafter_dir, tmp_path):
    peft_model = _adapter(load_drafter(drafter_dir, verifier=verifier), tmp_path / "adapter",
                          TARGETS)
    ids, starts, feats = _inputs()
    with torch.no_grad():  # peft's unmerged forward (LoRA layers injected into the drafter)
        expected = peft_model.base_model.model.window_logits(ids, starts, GAMMA, feats)
    base = load_drafter(drafter_dir, verifier=verifier)
    merged = load_drafter(drafter_dir, verifier=verifier, lora=tmp_path / "adapter")

    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    prefix = "base_model.model."
    modules = sorted(k[len(prefix):-len(".lora_A.weight")] for k in tensors
                     if k.endswith(".lora_A.weight"))
    # every projection of both layers, and fc
    assert len(modules) == 2 * 7 + 1 and "fc" in modules
    scale = 8 / 4  # lora_alpha / r
    own, merged_params = dict(base.named_parameters()), dict(merged.named_parameters())
    for name in modules:
        a, b = tensors[f"{prefix}{name}.lora_A.weight"], tensors[f"{prefix}{name}.lora_B.weight"]
        torch.testing.assert_close(merged_params[f"{name}.weight"],
                                   own[f"{name}.weight"] + scale * b @ a, msg=name)
    untouched = [n for n in own if not any(n == f"{m}.weight" for m in modules)]
    assert "lm_head.weight" in untouched and "mask_embedding" in untouched
    for name in untouched:
        assert torch.equal(merged_params[name], own[name]), name

    with torch.no_grad():
        got = merged.window_logits(ids, starts, GAMMA, feats)
        plain = base.window_logits(ids, starts, GAMMA, feats)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (got - plain).abs().max() > 1e-2  # the adapter really changed the drafts

    # bfloat16 serving: merged in float32, then cast once
    half = load_drafter(drafter_dir, verifier=verifier, lora=tmp_path / "adapter",
                        dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert torch.equal(half.fc.weight, merged.fc.weight.to(torch.bfloat16))


def test_an_adapter_that_does_not_fit_is_refused_naming_its_file(verifier, drafter_dir,
                                                                  tmp_path):
    from vllm_specdiff.drafter.loading import check_lora_for

    adapter = tmp_path / "adapter"
    weights = str(adapter / "adapter_model.safetensors")
    _adapter(load_drafter(drafter_dir, verifier=verifier), adapter, ["q_proj"])
    one = _drafter_dir(verifier, tmp_path / "one", layers=1)
    with pytest.raises(ValueError, match=f"{weights}.*does not match the base model.*layers.1"):
        check_lora_for(one, adapter)  # the option check: file headers only
    with pytest.raises(ValueError, match="does not match the base model.*layers.1"):
        load_drafter(one, verifier=verifier, lora=adapter)  # no second layer

    tensors = load_file(weights)
    key = next(k for k in tensors if k.endswith("lora_B.weight"))
    tensors[key] = tensors[key][:-4].contiguous()
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=f"{weights}.*does not match the base model.*shape"):
        load_drafter(drafter_dir, verifier=verifier, lora=adapter)

    # the verifier's head, shared and frozen, is not the drafter's to adapt
    head = tmp_path / "head"
    _adapter(load_drafter(drafter_dir, verifier=verifier), head, ["lm_head"])
    with pytest.raises(ValueError, match="adapter_model.safetensors.*'lm_head'.*shares with the "
                                         "verifier"):
        load_drafter(drafter_dir, verifier=verifier, lora=head)
    with pytest.raises(FileNotFoundError, match="adapter"):
        load_drafter(drafter_dir, verifier=verifier, lora=tmp_path / "missing")


def test_the_options_accept_an_adapter_with_a_conditioned_drafter(verifier, drafter_dir,
                                                                   tmp_path):
    from vllm_specdiff.plugin.config import parse_specdiff_config
    from vllm_specdiff.plugin.engine import specdiff_engine_args
    from vllm_specdiff.plugin.workers import CPU_CONDITIONED_WORKER

    _adapter(load_drafter(drafter_dir, verifier=verifier), tmp_path / "adapter", TARGETS)
    section = {"drafter": str(drafter_dir), "lora": str(tmp_path / "adapter")}
    assert parse_specdiff_config({"specdiff": section}, gamma=GAMMA).lora == section["lora"]
    args = specdiff_engine_args(GAMMA, **section)
    assert args["worker_cls"] == CPU_CONDITIONED_WORKER
    assert args["additional_config"]["specdiff"]["lora"] == section["lora"]
    # a wrong adapter still fails there, named by its option
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    tensors = {k.replace("layers.1.", "layers.5."): v for k, v in tensors.items()}
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match="'lora'.*layers.5"):
        parse_specdiff_config({"specdiff": section}, gamma=GAMMA)
