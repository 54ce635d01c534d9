"""A Llama/Qwen2 decoder stack driven by an explicit attention pattern.

All drafter formats are transformers' own Llama or Qwen2 decoder layers; only who-attends-to-whom
differs (full bidirectional, or causal context plus bidirectional mask blocks). Calling the layers
directly with a boolean pattern keeps the weights, names and numerics of the public checkpoints
(and keeps the nn.Linear names peft's LoRA targets) without copying any modeling code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import LlamaConfig, Qwen2Config
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2DecoderLayer,
    Qwen2RMSNorm,
    Qwen2RotaryEmbedding,
)

if TYPE_CHECKING:
    from .packed import PackedRows

ARCHS = {
    "llama": (LlamaConfig, LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding),
    "qwen2": (Qwen2Config, Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding),
}


# The drafters' attention: transformers' sdpa, except in a packed block-causal drafting step, whose
# layers get `packed_rows=` and attend row by row on the KV pool's storage (drafter/packed.py).
ATTENTION = "specdiff_sdpa_or_packed"


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any
               ) -> tuple[torch.Tensor, None]:
    rows: PackedRows | None = kwargs.pop("packed_rows", None)
    if rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return rows.attend(module.layer_idx, query, kwargs["scaling"]), None


ALL_ATTENTION_FUNCTIONS.register(ATTENTION, _attention)


def make_config(arch: str, config: dict) -> LlamaConfig | Qwen2Config:
    """Build a transformers config of the given base architecture from a plain dict."""
    if arch not in ARCHS:
        raise ValueError(f"unknown base architecture {arch!r}; expected one of {sorted(ARCHS)}")
    # layer_types is derived again from num_hidden_layers (which a drafter may have truncated);
    # drafters attend through explicit patterns, so sliding windows are not supported.
    skip = ("model_type", "auto_map", "layer_types", "architectures")
    cfg = ARCHS[arch][0](**{k: v for k, v in config.items() if k not in skip})
    cfg._attn_implementation = ATTENTION
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
        raise ValueError("drafters with sliding-window attention layers are not supported")
    return cfg


class DecoderStack(nn.Module):
    """embed_tokens -> N decoder layers -> final norm, named like HF's `model.*` submodule."""

    def __init__(self, arch: str, config: LlamaConfig | Qwen2Config) -> None:
        super().__init__()
        _, layer_cls, norm_cls, rope_cls = ARCHS[arch]
        self.arch = arch
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [layer_cls(config, i) for i in range(config.num_hidden_layers)])
        self.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = rope_cls(config=config)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                allowed: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [B,Q,H].

        allowed[B,Q,Q]: query q may attend key k; allowed[B,1,Q] is a key-only mask shared by
        all queries (bidirectional formats).
        Rows with no allowed key are padding; they get finite garbage, never NaN.
        """
        hidden = self.embed_tokens(input_ids)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        mask = torch.zeros(allowed.shape, dtype=hidden.dtype, device=hidden.device)
        mask = mask.masked_fill(~allowed, torch.finfo(hidden.dtype).min).unsqueeze(1)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids,
                           position_embeddings=position_embeddings)
        return self.norm(hidden)

    def forward_packed(self, input_ids: torch.Tensor, rows: PackedRows) -> torch.Tensor:
        """Final-normed hidden states [1,T,H] of a packed step (input_ids[1,T]); the layers'
        K/V go to, and attention reads from, the rows' KV entries."""
        hidden = self.embed_tokens(input_ids)
        position_embeddings = self.rotary_emb(hidden, rows.position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=None, position_ids=rows.position_ids,
                           past_key_values=rows, position_embeddings=position_embeddings,
                           packed_rows=rows)
        return self.norm(hidden)

    def reset_rotary(self) -> None:
        """Recompute the RoPE buffers in float32 on the current device.

        Needed after meta-device construction and after casting to bfloat16, which would otherwise
        round the inverse frequencies (HF keeps them in float32).
        """
        rope_cls = ARCHS[self.arch][3]
        self.rotary_emb = rope_cls(config=self.config).to(self.embed_tokens.weight.device)
