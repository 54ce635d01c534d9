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
