"""The project's block-causal diffusion drafter: causal context with an exact KV cache, plus a
bidirectional block of gamma masks that attends to the whole context.

Full-bidirectional MDMs (Dream, LLaDA) must re-encode the whole context every decoding step, so
drafting costs O(context). Here the context is encoded causally, so its keys/values never change
when tokens are appended: they are cached per sequence and only the new tokens plus the gamma-mask
block are run each step, O(gamma). The model is initialised from the first N layers of any
Llama/Qwen2 causal LM (as DiffuLLaMA adapts an AR model) and uses the *shifted* convention: the
first draft token is read from the last context token's hidden state (exactly the AR prediction of
the truncated model), draft token j > 0 from mask slot j - 1. A learned mask embedding is appended
as a new input row (id = verifier vocab size), so it can never be proposed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from .base import Drafter
from .checkpoint import load_into, parse_dtype, read_config, read_weights
from .kv_pool import KVEntry, KVLayout, KVPool
from .packed import PackedRows
from .stack import ARCHS, DecoderStack, make_config
from .vocab import copy_tokenizer_files

MODEL_TYPE = "specdiff_block_causal"
SUPPORTED_BASES = tuple(ARCHS)


class BlockCausalDrafter(Drafter):
    """Block-causal MDM drafter with a prefix-matched LRU KV pool (see module docstring)."""

    shifted = True

    def __init__(self, arch: str, config: object, *, verifier_vocab_size: int,
                 mask_token_id: int, draft_vocab_size: int | None = None,
                 cache_size: int = 64, context_window: int | None = None,
                 cache_bytes: int | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.config = config
        self.vocab_size = verifier_vocab_size
        self.mask_token_id = mask_token_id
        self.max_positions = config.max_position_embeddings
        self.context_window = context_window
        self.model = DecoderStack(arch, config)
        self.lm_head = nn.Linear(config.hidden_size, draft_vocab_size or verifier_vocab_size,
                                 bias=False)
        self.register_buffer("draft_to_verifier", None)
        self.pool = KVPool(cache_size, cache_bytes) if cache_size > 0 else None
        self._layout: KVLayout | None = None
        self.source_dir: Path | None = None  # tokenizer files are copied from here on save

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.out_features

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_causal_lm(cls, model_dir: str | Path, num_layers: int, *,
                       draft_to_verifier: torch.Tensor | None = None,
                       dtype: torch.dtype | str = torch.float32, device: str = "cpu",
                       cache_size: int = 64, context_window: int | None = None,
                       cache_bytes: int | None = None) -> BlockCausalDrafter:
        """Build from the embedding, first `num_layers` layers, final norm and LM head of a
        Llama/Qwen2 causal LM directory. `draft_to_verifier` (LongTensor[N]) keeps only those LM
        head rows (reduced vocabulary). The mask embedding starts as the mean token embedding."""
        cfg = read_config(model_dir)
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_BASES:
            raise ValueError(f"from_causal_lm supports model_type {SUPPORTED_BASES}, "
                             f"{str(model_dir)!r} has {arch!r}")
        total = cfg["num_hidden_layers"]
        if not isinstance(num_layers, int) or not 1 <= num_layers <= total:
            raise ValueError(f"num_layers must be in [1, {total}] for {str(model_dir)!r}, "
                             f"got {num_layers!r}")
        vocab = cfg["vocab_size"]
        prefixes = tuple(f"model.layers.{i}." for i in range(num_layers))
        weights = read_weights(model_dir, lambda n: not n.startswith("model.layers.")
                               or n.startswith(prefixes))
        embed = weights["model.embed_tokens.weight"]
        head = weights.get("lm_head.weight", embed)
        if tuple(head.shape) != (vocab, cfg["hidden_size"]):
            raise ValueError(f"LM head of {str(model_dir)!r} has shape {tuple(head.shape)}")
        d2t = _check_d2t(draft_to_verifier, vocab)
        base = dict(cfg, num_hidden_layers=num_layers, vocab_size=vocab + 1,
                    tie_word_embeddings=False)
        state = {k: v for k, v in weights.items()
                 if k.startswith(("model.layers.", "model.norm."))}
        mask_row = embed.float().mean(0, keepdim=True).to(embed.dtype)
        state["model.embed_tokens.weight"] = torch.cat([embed, mask_row])
        state["lm_head.weight"] = head if d2t is None else head[d2t]
        meta = {"verifier_vocab_size": vocab, "mask_token_id": vocab,
                "draft_vocab_size": None if d2t is None else d2t.numel()}
        return cls._build(arch, base, meta, state, d2t, str(model_dir), dtype, device,
                          cache_size, context_window, cache_bytes)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype | str = torch.float32,
                        device: str = "cpu", cache_size: int = 64,
                        context_window: int | None = None,
                        cache_bytes: int | None = None) -> BlockCausalDrafter:
        """Load a directory written by `save_pretrained`."""
        cfg = read_config(path)
        if cfg.get("model_type") != MODEL_TYPE:
            raise ValueError(f"{str(path)!r} is not a {MODEL_TYPE} directory "
                             f"(model_type={cfg.get('model_type')!r})")
        state = read_weights(path)
        d2t = state.pop("draft_to_verifier", None)
        meta = {k: cfg[k] for k in ("verifier_vocab_size", "mask_token_id", "draft_vocab_size")}
        return cls._build(cfg["base_model_type"], cfg["base_config"], meta, state, d2t, str(path),
                          dtype, device, cache_size, context_window, cache_bytes)

    @classmethod
    def _build(cls, arch: str, base: dict, meta: dict, state: dict, d2t: torch.Tensor | None,
               source: str, dtype: torch.dtype | str, device: str, cache_size: int,
               context_window: int | None, cache_bytes: int | None) -> BlockCausalDrafter:
        config = make_config(arch, base)
        with torch.device("meta"):
            drafter = cls(arch, config, verifier_vocab_size=meta["verifier_vocab_size"],
                          mask_token_id=meta["mask_token_id"],
                          draft_vocab_size=meta.get("draft_vocab_size"), cache_size=cache_size,
                          context_window=context_window, cache_bytes=cache_bytes)
        load_into(drafter, state, source)
        drafter.model.reset_rotary()  # meta -> real buffers before moving
        drafter.to(device=device, dtype=parse_dtype(dtype))
        drafter.model.reset_rotary()  # float32 inverse frequencies on the target device
        drafter.source_dir = Path(source)
        if d2t is not None:
            drafter.draft_to_verifier = _check_d2t(d2t, meta["verifier_vocab_size"]).to(device)
        return drafter.eval()

    def save_pretrained(self, path: str | Path) -> None:
        """Write config.json + model.safetensors (the d2t table, if any, is a tensor in it), and
        the source model's tokenizer files, so the directory can be checked against a verifier."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        base = self.config.to_dict()
        base.pop("_attn_implementation_autoset", None)
        config = {
            "model_type": MODEL_TYPE,
            "base_model_type": self.arch,
            "base_config": base,
            "verifier_vocab_size": self.vocab_size,
            "mask_token_id": self.mask_token_id,
            "draft_vocab_size": None if self.draft_to_verifier is None else self.draft_vocab_size,
            "shifted": True,
        }
        (path / "config.json").write_text(json.dumps(config, indent=2, default=str))
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        if self.source_dir is not None and self.source_dir.resolve() != path.resolve():
            copy_tokenizer_files(self.source_dir, path)

    # ---- cache ----------------------------------------------------------------------------------
    def clear_cache(self) -> None:
        if self.pool is not None:
            self.pool.clear()

    def cache_stats(self) -> dict[str, int]:
        return self.pool.stats() if self.pool is not None else {}

    def _claim(self, contexts: list[torch.Tensor]
               ) -> tuple[list[tuple[KVEntry, int]], set[int]]:
        """For each row, the cache entry it extends and how many of its tokens are reused, and
        the pool keys of those entries (which eviction must keep while the step runs).

        At least the last context token is always recomputed (its hidden state gives draft 1).
        An entry matched by several rows is extended in place by the first and copied for the rest.
        """
        if self.pool is None:  # one-step entries
            return [(KVEntry(tokens=np.zeros(0, dtype=np.int64)), 0) for _ in contexts], set()
        plan: list[tuple[KVEntry, int]] = []
        used: set[int] = set()
        for ctx in contexts:
            # Prefer an entry no other row has claimed (rows with identical contexts, e.g. n > 1
            # samples of one prompt, each keep their own); copy a claimed one only if it is
            # strictly better, so duplicates do not leave a trail of orphaned copies.
            key, shared = self.pool.best_match(ctx.numpy(), exclude=used)
            if used:
                claimed, claimed_shared = self.pool.best_match(ctx.numpy())
                if claimed_shared > shared:
                    key, shared = claimed, claimed_shared
            keep = min(shared, ctx.numel() - 1)
            if key is None or keep == 0:
                entry, key = KVEntry(tokens=np.zeros(0, dtype=np.int64)), None
                keep = 0
            elif key in used:
                entry, key = self.pool.entries[key].copy_prefix(keep), None
            else:
                entry = self.pool.entries[key]
                used.add(key)
                self.pool.touch(key)
            plan.append((entry, keep))
            if key is None:
                used.add(self.pool.add(entry))
        for entry, keep in plan:  # roll back only after every row has been matched
            entry.truncate(keep)
        return plan, used

    # ---- context window -------------------------------------------------------------------------
    def window_stride(self) -> int | None:
        """Tokens the window's start moves at a time (None: no window)."""
        return None if self.context_window is None else max(1, self.context_window // 2)

    def prepare_contexts(self, contexts: list[torch.Tensor], gamma: int) -> list[torch.Tensor]:
        """Cut each context to a window whose start moves in steps of `window_stride()` tokens.

        A window sliding one token per step would change every cached token's position and
        left neighbours, so the cache would never hit. Starting the window at a multiple of the
        stride keeps it fixed for `stride` tokens: the drafter sees the last W - stride + 1 .. W
        tokens (positions from 0, so W + gamma positions suffice), the cache extends it as usual,
        and the window is re-encoded (about W / 2 tokens) once every `stride` committed tokens.
        """
        stride = self.window_stride()
        if stride is not None:
            contexts = [_aligned_window(torch.as_tensor(c).reshape(-1), self.context_window,
                                        stride) for c in contexts]
        return super().prepare_contexts(contexts, gamma)

    # ---- forward passes -------------------------------------------------------------------------
    @torch.inference_mode()  # pool tensors are inference tensors; never differentiate through it
    def _block_logits(self, contexts: list[torch.Tensor], block: torch.Tensor) -> torch.Tensor:
        """One packed forward over every row's uncached context tokens and its block (see
        drafter/packed.py); the new context K/V stay in the rows' entries."""
        device = self._device()
        gamma = block.shape[1]
        plan, in_use = self._claim(contexts)
        keep = np.array([k for _, k in plan], dtype=np.int64)
        fresh = np.array([c.numel() for c in contexts], dtype=np.int64) - keep
        layout = self._kv_layout(device)
        longest = self._longest(gamma)
        for (entry, k), n in zip(plan, fresh, strict=True):
            need = k + int(n) + gamma  # the block's K/V are scratch past the context
            entry.reserve(need, layout, need if self.pool is None else longest)
        pieces = []
        for ctx, (_, k), row in zip(contexts, plan, block.cpu(), strict=True):
            pieces += [ctx[k:], row]
        input_ids = torch.cat(pieces).to(device)[None]  # built on CPU, moved once
        rows = PackedRows([e for e, _ in plan], keep, fresh, gamma, device)
        hidden = self.model.forward_packed(input_ids, rows)
        logits = self.lm_head(hidden[0, rows.read])
        for ctx, (entry, k) in zip(contexts, plan, strict=True):
            entry.commit(ctx[k:].numpy())
        if self.pool is not None:
            self.pool.hits += int(keep.sum())
            self.pool.misses += int(fresh.sum())
            self.pool.evict(in_use)
        return logits

    def _kv_layout(self, device: torch.device) -> KVLayout:
        """The K/V storage layout on the drafter's current device and dtype (cached: reading
        transformers config attributes costs more than a small op)."""
        dtype = self.model.embed_tokens.weight.dtype
        layout = self._layout
        if layout is None or layout.dtype != dtype or layout.device != device:
            cfg = self.config
            head_dim = getattr(cfg, "head_dim", None) or \
                cfg.hidden_size // cfg.num_attention_heads
            layout = KVLayout(len(self.model.layers), cfg.num_key_value_heads, head_dim, dtype,
                              device)
            self._layout = layout
        return layout

    def _longest(self, gamma: int) -> int:
        """Most tokens an entry ever holds: the longest context plus the block's scratch."""
        if self.context_window is None:
            return self.max_positions
        return min(self.max_positions, self.context_window + gamma)

    def window_logits(self, input_ids: torch.Tensor, starts: torch.Tensor,
                      gamma: int) -> torch.Tensor:
        """Differentiable logits [B,M,G,V_draft] of M windows per row in ONE forward.

        The sequence is the context (causal) followed by M blocks of gamma masks; block m sits at
        positions s_m..s_m+gamma-1 and attends to context tokens < s_m and to its own block.
        """
        device = self._device()
        input_ids = input_ids.to(device)
        starts = torch.as_tensor(starts, device=device, dtype=torch.long)
        if input_ids.dim() != 2 or starts.dim() != 2 or starts.shape[0] != input_ids.shape[0]:
            raise ValueError("window_logits needs input_ids[B,L] and starts[B,M]")
        batch, length = input_ids.shape
        windows = starts.shape[1]
        if bool(((starts < 1) | (starts > length)).any()):
            raise ValueError(f"window starts must be in [1, {length}]")
        if int(starts.max()) + gamma > self.max_positions:
            raise ValueError(f"window start + gamma exceeds max_positions={self.max_positions}")
        masks = torch.full((batch, windows * gamma), self.mask_token_id, dtype=torch.long,
                           device=device)
        ids = torch.cat([input_ids, masks], dim=1)
        g = torch.arange(gamma, device=device)
        block_pos = (starts[:, :, None] + g).reshape(batch, -1)
        position_ids = torch.cat([torch.arange(length, device=device).expand(batch, -1),
                                  block_pos], dim=1)
        total = length + windows * gamma
        idx = torch.arange(total, device=device)
        is_ctx = idx < length
        block_of = torch.where(is_ctx, -1, (idx - length) // gamma)
        start_of = torch.cat([torch.zeros(batch, length, dtype=torch.long, device=device),
                              starts.repeat_interleave(gamma, dim=1)], dim=1)
        ctx_ctx = (is_ctx[:, None] & is_ctx[None, :] & (idx[None, :] <= idx[:, None]))[None]
        blk_ctx = (~is_ctx)[None, :, None] & is_ctx[None, None, :] \
            & (idx[None, None, :] < start_of[:, :, None])
        blk_blk = ((~is_ctx)[:, None] & (block_of[:, None] == block_of[None, :]))[None]
        allowed = ctx_ctx | blk_ctx | blk_blk
        hidden = self.model(ids, position_ids, allowed)
        first = (starts - 1)[:, :, None]
        rest = length + torch.arange(windows, device=device)[None, :, None] * gamma + g[None, None]
        read = torch.where(g[None, None] == 0, first, rest - 1).reshape(batch, -1)
        picked = hidden.gather(1, read[..., None].expand(-1, -1, hidden.shape[-1]))
        return self.lm_head(picked).reshape(batch, windows, gamma, -1)


def _aligned_window(context: torch.Tensor, window: int, stride: int) -> torch.Tensor:
    """The trailing tokens of `context` from the first multiple of `stride` that leaves at
    most `window` of them (the whole context when it is no longer than `window`)."""
    n = context.numel()
    if n <= window:
        return context
    start = -(-(n - window) // stride) * stride  # ceil((n - window) / stride) * stride
    return context[start:]


def _check_d2t(d2t: torch.Tensor | None, verifier_vocab: int) -> torch.Tensor | None:
    """Validate a draft->verifier table: unique ids inside the verifier vocabulary."""
    if d2t is None:
        return None
    d2t = torch.as_tensor(d2t, dtype=torch.long).reshape(-1)
    if d2t.numel() == 0 or int(d2t.min()) < 0 or int(d2t.max()) >= verifier_vocab:
        raise ValueError(f"draft_to_verifier ids must lie in [0, {verifier_vocab})")
    if d2t.unique().numel() != d2t.numel():
        raise ValueError("draft_to_verifier contains duplicate verifier ids")
    return d2t
