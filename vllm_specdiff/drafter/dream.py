"""Dream / DiffuCoder checkpoints: Qwen2 weights, full bidirectional attention, shifted logits.

The public checkpoints (model_type "Dream", architectures ["DreamModel"]) ship their own modeling
code; we never run it. Their config keys are Qwen2's plus `mask_token_id`, and their weight names
are exactly Qwen2ForCausalLM's (`model.embed_tokens`, `model.layers.N.self_attn.q_proj`, ...,
`model.norm`, `lm_head`), so transformers' Qwen2 layers load them unchanged.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .bidirectional import BidirectionalDrafter
from .checkpoint import read_config, read_weights

DREAM_TYPES = ("Dream", "dream")


class DreamDrafter(BidirectionalDrafter):
    """Dream-style drafter: hidden state at i-1 predicts token i."""

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype | str = torch.float32,
                        context_window: int | None = None) -> DreamDrafter:
        cfg = read_config(path)
        if cfg.get("model_type") not in DREAM_TYPES:
            raise ValueError(f"{str(path)!r} is not a Dream checkpoint "
                             f"(model_type={cfg.get('model_type')!r})")
        if cfg.get("mask_token_id") is None:
            raise ValueError(f"config.json of {str(path)!r} has no mask_token_id")
        if cfg.get("use_sliding_window"):
            raise ValueError("Dream checkpoints with use_sliding_window=true are not supported")
        state = read_weights(path)
        if "lm_head.weight" not in state:
            if not cfg.get("tie_word_embeddings", False):
                raise ValueError(f"{str(path)!r} has no lm_head.weight and does not tie "
                                 "embeddings")
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        drafter = cls._build("qwen2", cfg, state, str(path), dtype, context_window,
                             mask_token_id=int(cfg["mask_token_id"]), shifted=True)
        drafter.source_config = cfg
        return drafter

    def _export_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.source_config.get("tie_word_embeddings", False):
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        return state
