"""A conditioned drafter -> a checkpoint vLLM's own `dflash` method serves, unchanged.

The conditioned drafter (vllm_specdiff/drafter/conditioned.py) computes what vLLM's
`qwen3_dflash` model computes and already uses its tensor names, so the export writes:
- `config.json` in DFlash's format (`architectures: ["DFlashDraftModel"]`, Qwen3 layer sizes,
  `rope_theta` written out because vLLM's default differs from SmolLM2's, and `dflash_config`
  with the block size, the mask token and the taps);
- `model.safetensors` with the trained tensors; with a reduced head also `lm_head.weight` (its
  rows) and `d2t` in vLLM's convention (offsets: target id = draft id + d2t[draft id]); with the
  full head no head at all, so vLLM shares the verifier's;
- `mask_embedding.pt`: the learned mask embedding, which vLLM substitutes for the embedding of
  `mask_token_id` (SmolLM2's vocabulary has no spare row, so a special token the verifier never
  writes in chat stands in for it).
The taps are written unchanged: DFlash's `target_layer_ids` and the conditioned drafter's share a
convention (tap L = output of layer L). `load_drafter` reads the export back
(`vllm_specdiff/drafter/dflash_format.py`) as the same drafter. A drafter with a Markov head
(`markov_rank` > 0) is refused: vLLM's `dflash` model has no such head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from vllm_specdiff.drafter.conditioned import ConditionedDrafter
from vllm_specdiff.drafter.dflash_format import ARCHITECTURE, MASK_EMBEDDING_FILE
from vllm_specdiff.drafter.vocab import copy_tokenizer_files


def mask_stand_in(verifier: str | Path) -> int:
    """A token the verifier does not write, whose embedding vLLM replaces by the mask
    embedding: its highest special token id that is not bos/eos/pad/unk, else unk."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(verifier))
    reserved = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}
    candidates = [i for i in tok.all_special_ids if i not in reserved]
    if candidates:
        return max(candidates)
    if tok.unk_token_id is None:
        raise ValueError(f"{verifier}: no spare special token to stand in for the mask")
    return int(tok.unk_token_id)


def dflash_config(drafter: ConditionedDrafter, mask_token_id: int) -> dict:
    cfg = drafter.cfg
    config = {
        "architectures": [ARCHITECTURE], "model_type": "qwen3",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_target_layers": cfg.verifier_num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "dflash_config": {"block_size": cfg.block_size, "mask_token_id": mask_token_id,
                          "target_layer_ids": list(cfg.target_layer_ids)},
    }
    if drafter.draft_to_verifier is not None:
        config["draft_vocab_size"] = int(drafter.draft_to_verifier.numel())
    return config


def check_dflash_exportable(drafter: ConditionedDrafter) -> None:
    """Refuse, before anything is written, a drafter vLLM's `dflash` would run without part of
    its computation (it would load, and draft otherwise than it was trained to)."""
    if drafter.cfg.markov_rank:
        raise ValueError(f"this drafter has a Markov head (markov_rank "
                         f"{drafter.cfg.markov_rank}), which vLLM's `dflash` method cannot run: "
                         f"serve it with the plugin in its native format (export --format "
                         f"specdiff, or the drafter directory as it is)")


def export_dflash(drafter: ConditionedDrafter, verifier: str | Path, out: str | Path,
                  mask_token_id: int | None = None) -> dict:
    """Write the vLLM `dflash` checkpoint of a conditioned drafter into `out` (the mask's
    stand-in token: `mask_token_id`, else `mask_stand_in`'s choice)."""
    check_dflash_exportable(drafter)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mask_id = mask_stand_in(verifier) if mask_token_id is None else int(mask_token_id)
    tensors = {k: v.float() for k, v in drafter.trained_state().items() if k != "mask_embedding"}
    d2t = drafter.draft_to_verifier
    if d2t is not None:
        tensors["lm_head.weight"] = drafter.lm_head.weight.detach().float()
        tensors["d2t"] = (d2t.long() - torch.arange(d2t.numel())).contiguous()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    torch.save({"mask_token_id": mask_id,
                "embedding": drafter.mask_embedding.detach().float().clone()},
               out / MASK_EMBEDDING_FILE)
    (out / "config.json").write_text(json.dumps(dflash_config(drafter, mask_id), indent=2) + "\n")
    copy_tokenizer_files(verifier, out)
    return {"output": str(out), "format": "dflash", "mask_token_id": mask_id,
            "num_speculative_tokens": drafter.cfg.gamma,
            "draft_vocab_size": None if d2t is None else int(d2t.numel())}
