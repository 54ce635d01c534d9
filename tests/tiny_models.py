"""A tiny random Llama verifier with a real tokenizer, and drafters built from it.

vLLM needs a tokenizer and a Hugging Face directory; both are written here, in seconds, so the
vLLM tests never download anything. The verifier's weights are scaled so next-token
distributions are peaked (near-ties would make greedy comparisons fragile).
"""

from __future__ import annotations

import json
from pathlib import Path

CONDITIONED_GAMMA = 4  # block of the tiny conditioned drafter (tests/engine/conftest.py)

WORDS = 300
SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 2, 2, 1, 32


def word(i: int) -> str:
    return f"w{i}"


def write_tokenizer(path: Path, words: int = WORDS) -> int:
    """A whitespace WordLevel tokenizer over w0..w{words-1} plus specials; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + [word(i) for i in range(words)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return len(vocab)


def write_tiny_verifier(path: Path, seed: int = 0, words: int = WORDS, peak: float = 4.0) -> Path:
    """peak scales the output layer: lower values give flatter next-token distributions."""
    return write_family_verifier(path, "llama", hidden=HIDDEN, layers=LAYERS, heads=HEADS,
                                 kv_heads=KV_HEADS, head_dim=HEAD_DIM, seed=seed, peak=peak,
                                 words=words)


def write_cycle_verifier(path: Path, cycle: list[int], seed: int = 0,
                         layer_scale: float = 0.0) -> Path:
    """A verifier whose greedy next token depends only on the current one: the word ids in
    `cycle` follow each other in a loop (attention and MLP outputs are zeroed, so the logits are
    the current token's embedding against shifted embeddings). Text that reaches the loop
    repeats forever, so prompt lookup predicts it exactly. `layer_scale` > 0 keeps that share
    of the layers' outputs instead: every layer's hidden states then differ."""
    import torch

    write_tiny_verifier(path, seed=seed)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(path)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(layer_scale)
            layer.mlp.down_proj.weight.mul_(layer_scale)
        embed = model.model.embed_tokens.weight
        model.lm_head.weight.zero_()
        ids = [len(SPECIALS) + w for w in cycle]
        for prev, nxt in zip(ids, ids[1:] + ids[:1], strict=True):
            model.lm_head.weight[nxt] = embed[prev]
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def write_tiny_drafter(verifier: Path, path: Path, num_layers: int = LAYERS) -> Path:
    """Block-causal drafter from the verifier's first layers. With all layers its first draft
    token is exactly the verifier's greedy prediction, so acceptance is high by construction."""
    from vllm_specdiff.drafter import BlockCausalDrafter

    BlockCausalDrafter.from_causal_lm(str(verifier), num_layers).save_pretrained(str(path))
    return path


def word_prompt(rng_seed: int, length: int) -> str:
    import random

    rng = random.Random(rng_seed)
    return " ".join(word(rng.randrange(WORDS)) for _ in range(length))


def speculative_args(drafter: Path, gamma: int = 4, **options: object) -> dict:
    section = {"drafter": str(drafter), "log_interval": 0, **options}
    return {"speculative_config": {"model": "vllm_specdiff.SpecDiffProposer",
                                   "num_speculative_tokens": gamma},
            "additional_config": {"specdiff": section}}


def dumps(obj: object) -> str:
    return json.dumps(obj)


PREEMPTING_MAX_NUM_SEQS = 4


def preempting_engine_kwargs(model: Path) -> dict:
    """`LLM(...)` arguments of the tiny verifier with a KV cache small enough that more prompts
    than `PREEMPTING_MAX_NUM_SEQS` force reordering and preemption; stat logging on (vLLM's
    spec-decode counters)."""
    return dict(model=str(model), max_model_len=256, max_num_seqs=PREEMPTING_MAX_NUM_SEQS,
                seed=0, kv_cache_memory_bytes=200_000, dtype="float32", enforce_eager=True,
                disable_log_stats=False)


def write_family_verifier(path: Path, family: str, *, hidden: int, layers: int, heads: int,
                          kv_heads: int, head_dim: int, seed: int = 0,
                          peak: float = 4.0, words: int = WORDS) -> Path:
    """A tiny random verifier of another family or shape ("llama" or "qwen3", with q/k norms),
    with the word tokenizer; Qwen3's head_dim need not be hidden // heads."""
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path, words)
    torch.manual_seed(seed)
    sizes = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                 num_hidden_layers=layers, num_attention_heads=heads,
                 num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=512,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_cls, model_cls = classes[family]
    model = model_cls(config_cls(**sizes)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
        model.lm_head.weight.mul_(peak)
    model.save_pretrained(str(path), safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(str(path))
    return path
