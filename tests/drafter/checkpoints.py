"""Tiny drafter checkpoint directories written exactly in the public formats' layouts.

Each writer also returns the HF transformers model holding the same weights, so tests can compute
the expected logits with transformers itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

HIDDEN, LAYERS, HEADS, KV_HEADS, INTER, MAX_POS = 32, 2, 4, 2, 64, 64


def _peaked(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights with larger scale so logits are context dependent, not near-uniform."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model.eval()


def write_causal_lm(path: Path, arch: str = "llama", vocab: int = 96, seed: int = 0,
                    tie: bool = True, layers: int = 3) -> torch.nn.Module:
    """A Llama/Qwen2 causal LM saved by transformers' own save_pretrained."""
    torch.manual_seed(seed)
    kwargs = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTER,
                  num_hidden_layers=layers, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POS,
                  tie_word_embeddings=tie)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kwargs))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**kwargs))
    _peaked(model, seed)
    model.save_pretrained(path)
    return model


def write_dream(path: Path, vocab: int = 98, mask_token_id: int = 97,
                seed: int = 1) -> Qwen2ForCausalLM:
    """Dream/DiffuCoder layout: Qwen2 weight names, config keys of the public Dream config."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTER,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POS,
                         rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = _peaked(Qwen2ForCausalLM(config), seed)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["DreamModel"],
        "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig",
                     "AutoModel": "modeling_dream.DreamModel"},
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1,
        "hidden_act": "silu", "hidden_size": HIDDEN, "initializer_range": 0.02,
        "intermediate_size": INTER, "mask_token_id": mask_token_id,
        "max_position_embeddings": MAX_POS, "max_window_layers": LAYERS,
        "model_type": "Dream", "num_attention_heads": HEADS, "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-6, "rope_scaling": None,
        "rope_theta": 10000.0, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "float32", "transformers_version": "4.46.2", "use_cache": True,
        "use_sliding_window": False, "vocab_size": vocab,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return model


_LLADA_NAMES = {
    "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "attn_out", "mlp.gate_proj": "ff_proj", "mlp.up_proj": "up_proj",
    "mlp.down_proj": "ff_out", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ff_norm",
}


def write_llada(path: Path, vocab: int = 100, mask_token_id: int = 90,
                seed: int = 2) -> LlamaForCausalLM:
    """LLaDA layout: OLMo config keys, weights under model.transformer.*."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTER,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POS,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = _peaked(LlamaForCausalLM(config), seed)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0,
        "architectures": ["LLaDAModelLM"], "attention_dropout": 0.0,
        "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                     "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
                     "AutoModel": "modeling_llada.LLaDAModelLM"},
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama",
        "d_model": HIDDEN, "embedding_dropout": 0.0, "embedding_size": vocab,
        "eos_token_id": 1, "flash_attention": False, "include_bias": False,
        "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta",
        "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False,
        "layer_norm_type": "rms", "layer_norm_with_affine": True,
        "mask_token_id": mask_token_id, "max_sequence_length": MAX_POS,
        "mlp_hidden_size": INTER, "mlp_ratio": 4, "model_type": "llada",
        "multi_query_attention": None, "n_heads": HEADS, "n_kv_heads": KV_HEADS,
        "n_layers": LAYERS, "pad_token_id": 1, "precision": "amp_bf16",
        "residual_dropout": 0.0, "rms_norm_eps": 1e-5, "rope": True,
        "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False,
        "transformers_version": "4.46.3", "use_cache": False, "vocab_size": vocab,
        "weight_tying": False,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    state = {"model.transformer.wte.weight": model.model.embed_tokens.weight,
             "model.transformer.ln_f.weight": model.model.norm.weight,
             "model.transformer.ff_out.weight": model.lm_head.weight}
    for i in range(LAYERS):
        for hf, llada in _LLADA_NAMES.items():
            state[f"model.transformer.blocks.{i}.{llada}.weight"] = \
                model.get_submodule(f"model.layers.{i}.{hf}").weight
    state = {k: v.detach().contiguous() for k, v in state.items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return model


def bidirectional_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own forward of `model` on ids[L] with every token attending every token."""
    length = ids.numel()
    mask = torch.zeros(1, 1, length, length)  # 4D masks are used as given (no causal part)
    with torch.no_grad():
        return model(ids[None], attention_mask=mask).logits[0].float()


def write_word_tokenizer(path: Path, words: list[str]) -> None:
    """A word-level fast tokenizer (id = position in `words`), saved in HF format."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(path)
