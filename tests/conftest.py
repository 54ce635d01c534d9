"""Shared fixtures: tiny random models built in memory or written once per session (never
downloaded)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from tests.tiny_models import write_tiny_drafter, write_tiny_verifier  # noqa: E402


def make_tiny_llama(vocab_size: int = 12, seed: int = 0, hidden_size: int = 16,
                    num_layers: int = 1, logit_scale: float = 20.0) -> torch.nn.Module:
    """A random LlamaForCausalLM whose next-token distributions are far from uniform.

    Default random init gives near-uniform logits, which would make distribution tests weak;
    scaling the LM head gives peaked, context-dependent distributions.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         attn_implementation="eager")
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


@pytest.fixture
def tiny_llama() -> torch.nn.Module:
    return make_tiny_llama()


@pytest.fixture(scope="session")
def tiny_verifier(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_verifier(tmp_path_factory.mktemp("tiny") / "verifier")


@pytest.fixture(scope="session")
def tiny_drafter(tiny_verifier, tmp_path_factory: pytest.TempPathFactory):
    """Full-depth drafter: draft token 1 equals the verifier's greedy token."""
    return write_tiny_drafter(tiny_verifier, tmp_path_factory.mktemp("tiny") / "drafter")
