"""LLaDA checkpoints: a Llama-style block under OLMo-style names, unshifted logits.

The public config (model_type "llada") uses OLMo keys (d_model, n_heads, n_kv_heads, n_layers,
mlp_hidden_size, max_sequence_length, ...) and weights under `model.transformer.*`
(wte, blocks.N.{q,k,v}_proj / attn_out / ff_proj (gate) / up_proj / ff_out (down) / attn_norm /
ff_norm, ln_f, ff_out). We rename them onto transformers' Llama layers; options the Llama block
cannot express raise a clear error rather than computing something else.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .bidirectional import BidirectionalDrafter
from .checkpoint import read_config, read_weights

LLADA_TYPES = ("llada", "LLaDA")

_BLOCK_NAMES = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj", "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ff_norm": "post_attention_layernorm",
}
# option -> value the Llama block requires
_REQUIRED = {"block_type": "llama", "layer_norm_type": "rms", "alibi": False, "rope": True,
             "attention_layer_norm": False, "input_emb_norm": False, "scale_logits": False,
             "include_bias": False, "include_qkv_bias": False, "multi_query_attention": None,
             "clip_qkv": None}


def llama_config(cfg: dict) -> dict:
    """Translate a LLaDA config dict to Llama config keys."""
    for key, want in _REQUIRED.items():
        if key in cfg and cfg[key] != want and not (want is None and cfg[key] is False):
            raise ValueError(f"unsupported LLaDA option {key}={cfg[key]!r} (need {want!r})")
    if cfg.get("activation_type", "silu") != "silu":
        raise ValueError(f"unsupported LLaDA activation_type {cfg['activation_type']!r}")
    return {
        "hidden_size": cfg["d_model"],
        "num_attention_heads": cfg["n_heads"],
        "num_key_value_heads": cfg.get("n_kv_heads") or cfg["n_heads"],
        "num_hidden_layers": cfg["n_layers"],
        "intermediate_size": cfg["mlp_hidden_size"],
        "vocab_size": cfg.get("embedding_size") or cfg["vocab_size"],
        "max_position_embeddings": cfg["max_sequence_length"],
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5),
        "rope_theta": cfg.get("rope_theta", 10000.0),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": bool(cfg.get("weight_tying", False)),
    }


def rename_weights(state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """Map LLaDA parameter names onto Llama names (embed_tokens/layers/norm/lm_head)."""
    out = {}
    block = re.compile(r"^model\.transformer\.blocks\.(\d+)\.(\w+)\.(weight|bias)$")
    for name, tensor in state.items():
        if name == "model.transformer.wte.weight":
            out["model.embed_tokens.weight"] = tensor
        elif name == "model.transformer.ln_f.weight":
            out["model.norm.weight"] = tensor
        elif name == "model.transformer.ff_out.weight":
            out["lm_head.weight"] = tensor
        elif (m := block.match(name)) and m.group(2) in _BLOCK_NAMES:
            out[f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"] = tensor
        else:
            raise ValueError(f"unexpected LLaDA weight {name!r}")
    if "lm_head.weight" not in out and tied and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


class LLaDADrafter(BidirectionalDrafter):
    """LLaDA-style drafter: hidden state at i predicts token i."""

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype | str = torch.float32,
                        context_window: int | None = None) -> LLaDADrafter:
        cfg = read_config(path)
        if cfg.get("model_type") not in LLADA_TYPES:
            raise ValueError(f"{str(path)!r} is not a LLaDA checkpoint "
                             f"(model_type={cfg.get('model_type')!r})")
        if cfg.get("mask_token_id") is None:
            raise ValueError(f"config.json of {str(path)!r} has no mask_token_id")
        base = llama_config(cfg)
        state = rename_weights(read_weights(path), base["tie_word_embeddings"])
        drafter = cls._build("llama", base, state, str(path), dtype, context_window,
                             mask_token_id=int(cfg["mask_token_id"]), shifted=False)
        drafter.source_config = cfg
        return drafter

    def _export_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        inverse = {v: k for k, v in _BLOCK_NAMES.items()}
        out = {}
        for name, tensor in state.items():
            if name == "model.embed_tokens.weight":
                out["model.transformer.wte.weight"] = tensor
            elif name == "model.norm.weight":
                out["model.transformer.ln_f.weight"] = tensor
            elif name == "lm_head.weight":
                if not self.source_config.get("weight_tying", False):
                    out["model.transformer.ff_out.weight"] = tensor
            else:
                m = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
                out[f"model.transformer.blocks.{m.group(1)}.{inverse[m.group(2)]}."
                    f"{m.group(3)}"] = tensor
        return out
