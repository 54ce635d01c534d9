"""`load_drafter`: one entry point for every drafter directory format.

The format is chosen from config.json's `model_type`, or for a published DFlash drafter its
`architectures` / `speculators_model_type` (never by running code shipped with the checkpoint:
`auto_map` is ignored); a LoRA adapter is merged into the weights, a reduced-vocabulary table
found beside the weights is applied, and the output is checked against the verifier's vocabulary
size.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .base import Drafter
from .block_causal import MODEL_TYPE as BLOCK_CAUSAL_TYPE
from .block_causal import BlockCausalDrafter
from .checkpoint import parse_dtype, read_config, tensor_shapes, weight_files
from .conditioned import MODEL_TYPE as CONDITIONED_TYPE
from .conditioned import SHARED as CONDITIONED_SHARED
from .conditioned import ConditionedDrafter
from .dflash_format import check_tensors, is_dflash, load_dflash, read_layout
from .dream import DREAM_TYPES, DreamDrafter
from .hub import resolve_drafter
from .llada import LLADA_TYPES, LLaDADrafter
from .lora import check_adapter_dir, check_adapter_fits, merge_lora
from .quantize import quantize_drafter, resolve_quantize
from .vocab import D2T_FILE, apply_reduced_vocab, check_tokenizer_match, load_d2t, read_vocab

KNOWN_TYPES = (BLOCK_CAUSAL_TYPE, CONDITIONED_TYPE, *DREAM_TYPES, *LLADA_TYPES)
# A conditioned drafter's embedding and head are the verifier's (frozen, not in its directory):
# an adapter of them would change the drafter's copy only, so it is refused by name.
_CONDITIONED_SHARED_MODULES = {
    name.removesuffix(".weight"): f"which a {CONDITIONED_TYPE} drafter shares with the verifier "
    "(frozen, not stored in the drafter directory): adapt its layers and fc only"
    for name in CONDITIONED_SHARED}


def check_drafter_dir(path: str | Path) -> dict:
    """What can be checked without loading weights, so that a broken directory fails in
    seconds (the option check before vLLM starts) instead of deep inside engine start-up:
    config.json (valid JSON, a known model_type) and readable safetensors weights. Returns the
    config."""
    cfg = read_config(path)
    if is_dflash(cfg):  # its config and every tensor's name and shape
        check_tensors(path, read_layout(cfg, path))
        return cfg
    model_type = cfg.get("model_type")
    if model_type not in KNOWN_TYPES:
        raise ValueError(f"unknown drafter model_type {model_type!r} in "
                         f"{str(Path(path) / 'config.json')!r}; supported: {list(KNOWN_TYPES)}, "
                         "or a DFlash drafter (architectures [\"DFlashDraftModel\"] or "
                         "speculators_model_type \"dflash\")")
    tensor_shapes(weight_files(path))
    return cfg


def reads_verifier_states(cfg: dict) -> bool:
    """Whether a drafter config describes a drafter conditioned on the verifier's hidden states
    (`specdiff_conditioned` or DFlash): such a drafter needs the worker that captures them."""
    return cfg.get("model_type") == CONDITIONED_TYPE or is_dflash(cfg)


def block_draft_tokens(path: str | Path) -> int | None:
    """Draft tokens one forward of a conditioned drafter proposes (its block minus the anchor),
    from its config; None for formats without a fixed block."""
    cfg = read_config(path)
    if is_dflash(cfg):
        return read_layout(cfg, path).config.gamma
    if cfg.get("model_type") == CONDITIONED_TYPE:
        return int(cfg.get("block_size", 9)) - 1
    return None


def check_block_fits(path: str | Path, num_speculative_tokens: int) -> None:
    """The one check that `num_speculative_tokens` fits the drafter's block, at start-up (a
    larger value would ask one forward for drafts its block has no slots for)."""
    block = block_draft_tokens(path)
    if block is not None and num_speculative_tokens > block:
        raise ValueError(f"num_speculative_tokens = {num_speculative_tokens} exceeds the block "
                         f"of the drafter {str(path)!r}: it drafts at most {block} tokens per "
                         f"forward (block_size {block + 1}); use num_speculative_tokens <= "
                         f"{block}")


def check_lora_for(path: str | Path, lora: str | Path) -> None:
    """An adapter's files, and for the formats whose tensor names are module names
    (block-causal, conditioned) its targets and shapes against the drafter's, all from file
    headers, so a wrong adapter fails at the option check instead of in a worker."""
    check_adapter_dir(lora)
    cfg = read_config(path)
    model_type = cfg.get("model_type")
    if reads_verifier_states(cfg):  # its head (even a reduced one) is never in its files
        check_adapter_fits(lora, tensor_shapes(weight_files(path)), _CONDITIONED_SHARED_MODULES)
    elif model_type == BLOCK_CAUSAL_TYPE and not (Path(path) / D2T_FILE).is_file():
        check_adapter_fits(lora, tensor_shapes(weight_files(path)))


def load_drafter(path: str | Path, *, lora: str | Path | None = None,
                 dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
                 context_window: int | None = None, verifier_vocab_size: int | None = None,
                 cache_size: int = 64, verifier_tokenizer: object = None,
                 cache_bytes: int | None = None, quantize: str = "none",
                 verifier: str | Path | None = None) -> Drafter:
    """Load a drafter directory (config.json + safetensors; or a hub id, `drafter/hub.py`), without
    remote code.

    lora: a PEFT adapter directory merged into the weights at load time.
    context_window: trailing context tokens the drafter sees (bounds the cost of formats that
      re-encode the context each step).
    verifier_vocab_size: number of verifier token ids the output must cover; ids beyond it (mask,
      appended extras) are dropped. A drafter that covers fewer ids is a vocabulary mismatch.
    cache_size: KV-pool entries of the block-causal drafter (0 disables its cache).
    cache_bytes: byte budget of that KV pool (None: 1 GiB).
    quantize: "none", "int8" (dynamic int8 linears, CPU float32 only) or "auto" (int8 on CPU,
      none elsewhere); see drafter/quantize.py.
    verifier_tokenizer: the verifier's tokenizer (directory or object with get_vocab()); when
      given, every verifier token must have the same id in the drafter directory's tokenizer.
    verifier: the verifier's directory, for a drafter that shares its embedding and head
      (`specdiff_conditioned` and DFlash: those tensors are not stored in the drafter
      directory, unless a DFlash checkpoint ships its own).
    """
    path = resolve_drafter(str(path))
    cfg = check_drafter_dir(path)
    if lora is not None:
        check_lora_for(path, lora)
    model_type = cfg.get("model_type")
    dtype = parse_dtype(dtype)
    device = str(device)
    quantize = resolve_quantize(quantize, device)
    if context_window is not None and (not isinstance(context_window, int) or context_window < 1):
        raise ValueError(f"context_window must be a positive int or None, got {context_window!r}")
    # With an adapter, merge in float32 first, then cast (a bf16 merge would round twice).
    load_dtype = torch.float32 if lora is not None else dtype
    if reads_verifier_states(cfg):
        drafter = _load_conditioned(path, cfg, verifier, lora, dtype, device,
                                    verifier_vocab_size, verifier_tokenizer)
        return quantize_drafter(drafter, quantize)
    if model_type == BLOCK_CAUSAL_TYPE:
        drafter: Drafter = BlockCausalDrafter.from_pretrained(
            path, dtype=load_dtype, cache_size=cache_size, context_window=context_window,
            cache_bytes=cache_bytes)
    elif model_type in DREAM_TYPES:
        drafter = DreamDrafter.from_pretrained(path, dtype=load_dtype,
                                               context_window=context_window)
    elif model_type in LLADA_TYPES:
        drafter = LLaDADrafter.from_pretrained(path, dtype=load_dtype,
                                               context_window=context_window)
    else:  # check_drafter_dir admits only KNOWN_TYPES
        raise AssertionError(model_type)
    d2t_path = Path(path) / D2T_FILE
    if d2t_path.is_file() and drafter.draft_to_verifier is None:
        apply_reduced_vocab(drafter, load_d2t(d2t_path))
    if lora is not None:  # after the d2t table: an adapter is trained on the drafter as loaded
        merge_lora(drafter, lora)
    if verifier_vocab_size is not None:
        set_verifier_vocab(drafter, verifier_vocab_size)
    if verifier_tokenizer is not None:
        check_tokenizer_match(path, verifier_tokenizer, verifier_vocab_size)
    drafter.to(device=device, dtype=dtype)
    drafter.model.reset_rotary()
    return quantize_drafter(drafter.eval(), quantize)


def _load_conditioned(path: str | Path, cfg: dict, verifier: str | Path | None,
                      lora: str | Path | None, dtype: torch.dtype, device: str,
                      verifier_vocab_size: int | None, verifier_tokenizer: object) -> Drafter:
    """A verifier-conditioned drafter (native or DFlash): its trained tensors plus the
    verifier's embedding and head, with a LoRA adapter of its layers and `fc` merged in
    (float32, before the cast, as the other formats). Its tokenizer is the verifier's own;
    tokenizer files beside it (a training run's output, an export) are checked."""
    kind = "DFlash" if is_dflash(cfg) else CONDITIONED_TYPE
    if verifier is None:
        raise ValueError(f"{str(path)!r} is a {kind} drafter, which shares the verifier's "
                         "embedding and head: pass verifier=VERIFIER_DIR")
    drafter = load_dflash(path, cfg, verifier) if is_dflash(cfg) \
        else ConditionedDrafter.from_pretrained(path, verifier)  # float32
    if lora is not None:  # check_lora_for has refused targets in the shared embedding and head
        merge_lora(drafter, lora)
    if verifier_vocab_size is not None and drafter.vocab_size < verifier_vocab_size:
        raise ValueError(f"vocab mismatch: the drafter covers {drafter.vocab_size} ids but the "
                         f"verifier has {verifier_vocab_size}")
    if verifier_tokenizer is not None and read_vocab(path) is not None:
        check_tokenizer_match(path, verifier_tokenizer, verifier_vocab_size)
    return drafter.to(device=device, dtype=dtype).eval()


def set_verifier_vocab(drafter: Drafter, verifier_vocab_size: int) -> None:
    """Make `draft_logits` cover exactly `verifier_vocab_size` ids, or raise on a mismatch."""
    if not isinstance(verifier_vocab_size, int) or verifier_vocab_size < 1:
        raise ValueError(f"verifier_vocab_size must be a positive int, got {verifier_vocab_size!r}")
    d2t = drafter.draft_to_verifier
    if d2t is not None:
        if int(d2t.max()) >= verifier_vocab_size:
            raise ValueError(f"vocab mismatch: the drafter's draft->verifier table maps to id "
                             f"{int(d2t.max())}, outside verifier_vocab_size={verifier_vocab_size}")
    elif drafter.draft_vocab_size < verifier_vocab_size:
        raise ValueError(
            f"vocab mismatch: the drafter's LM head covers {drafter.draft_vocab_size} ids but the "
            f"verifier has {verifier_vocab_size}; pass the tokenizer's length if the verifier's "
            "embedding is only padded, or use a drafter built for this verifier's tokenizer")
    drafter.vocab_size = verifier_vocab_size
