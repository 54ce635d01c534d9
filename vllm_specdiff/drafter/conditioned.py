"""A diffusion drafter conditioned on the verifier's hidden states (DFlash-style KV injection).

A drafter that sees only token ids must re-derive, with a few layers, what the verifier has
already computed. This one reads it: the verifier's hidden states after a few tapped layers
(`target_layer_ids`, DFlash's convention: tap L is the output of decoder layer L, Hugging Face's
`hidden_states[L + 1]`) are concatenated, projected by `fc` and normalised by `hidden_norm` into
one context vector per position. Every drafter layer projects those vectors into keys and values
(its own `k_proj`/`v_proj`, k-norm and RoPE at the context positions) placed in front of the
block's own; queries come only from the block.

The block is `[anchor, mask, ..., mask]` (`block_size` slots at positions p .. p+B-1): the anchor
is the token the verifier just committed at position p, whose hidden state does not exist yet, so
the block sees the context features strictly before p; slot k predicts the token at p + k.
Attention is bidirectional inside the block, so one forward drafts the whole window and K drafts
can be sampled from its marginals. The verifier's token embedding and LM head are shared and
frozen; a learned mask embedding stands in for the mask token (SmolLM2 has no spare row).

Layers are Qwen3-style (pre-norm, q/k RMSNorm, SwiGLU) with the tensor names of vLLM's native
`dflash` checkpoints, so `specdiff-distill export --format dflash` only renames the directory's
files; the computation here is the one vLLM's `qwen3_dflash` model runs. An optional Markov head
(`markov_rank`, drafter/markov.py: each slot reads its previous token) has no `dflash` match.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from .base import Drafter
from .checkpoint import read_config, read_weights
from .markov import MarkovHead, previous_tokens, teacher_forced_logits
from .vocab import D2T_FILE, load_d2t, save_d2t

MODEL_TYPE = "specdiff_conditioned"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# Tensors taken from the verifier at load time (never stored in the drafter directory), and
# their names in the verifier's checkpoint (a tied head has no lm_head.weight).
SHARED = ("embed_tokens.weight", "lm_head.weight")
VERIFIER_SHARED = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class ConditionedConfig:
    """The drafter's shape; sizes default to the verifier's so its embedding and head fit."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the verifier's vocabulary (embedding rows, head rows)
    target_layer_ids: tuple[int, ...]  # verifier layers whose outputs are tapped
    num_hidden_layers: int = 2
    block_size: int = 9  # anchor + gamma masks
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    verifier_num_layers: int = 30
    model_type: str = field(default=MODEL_TYPE)
    markov_rank: int = 0  # rank of the Markov head (drafter/markov.py); 0: none

    def __post_init__(self) -> None:
        if self.model_type != MODEL_TYPE:
            raise ValueError(f"model_type must be {MODEL_TYPE!r}, got {self.model_type!r}")
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + masks), got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one verifier layer")
        bad = [t for t in self.target_layer_ids if not 0 <= t < self.verifier_num_layers - 1]
        if bad:
            raise ValueError(f"target_layer_ids {bad} must be layers 0..N-2 of the "
                             f"{self.verifier_num_layers}-layer verifier (vLLM captures tap L "
                             f"before layer L + 1)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not isinstance(self.markov_rank, int) or self.markov_rank < 0:
            raise ValueError(f"markov_rank must be an int >= 0 (0: none), got {self.markov_rank!r}")

    @property
    def gamma(self) -> int:
        """Draft tokens one forward proposes."""
        return self.block_size - 1

    @property
    def feature_size(self) -> int:
        return self.hidden_size * len(self.target_layer_ids)

    @classmethod
    def for_verifier(cls, verifier_config: dict, *, num_layers: int = 2, num_taps: int = 3,
                     block_size: int = 9) -> ConditionedConfig:
        """The verifier's sizes, `num_taps` taps spread from layer 1 to layer N-3 (DFlash)."""
        n = int(verifier_config["num_hidden_layers"])
        hidden = int(verifier_config["hidden_size"])
        heads = int(verifier_config["num_attention_heads"])
        rope = verifier_config.get("rope_parameters") or {}
        theta = rope.get("rope_theta", verifier_config.get("rope_theta", 10000.0))
        return cls(hidden_size=hidden, num_attention_heads=heads,
                   num_key_value_heads=int(verifier_config.get("num_key_value_heads", heads)),
                   head_dim=int(verifier_config.get("head_dim") or hidden // heads),
                   intermediate_size=int(verifier_config["intermediate_size"]),
                   vocab_size=int(verifier_config["vocab_size"]),
                   target_layer_ids=spread_taps(n, num_taps), num_hidden_layers=num_layers,
                   block_size=block_size, rms_norm_eps=float(verifier_config["rms_norm_eps"]),
                   rope_theta=float(theta),
                   max_position_embeddings=int(verifier_config["max_position_embeddings"]),
                   verifier_num_layers=n)

    @classmethod
    def from_dict(cls, d: dict) -> ConditionedConfig:
        known = {f for f in cls.__dataclass_fields__}
        values = {k: v for k, v in d.items() if k in known}
        values["target_layer_ids"] = tuple(values["target_layer_ids"])
        return cls(**values)


def spread_taps(num_layers: int, num_taps: int) -> tuple[int, ...]:
    """Taps evenly spread from layer 1 to layer N-3, as DFlash places them (never past N-2:
    vLLM captures tap L before layer L + 1, which must exist)."""
    if num_taps < 1:
        raise ValueError(f"num_taps must be >= 1, got {num_taps}")
    last = max(num_layers - 3, 0)
    first = min(1, last)
    if num_taps == 1:
        return (last,)
    return tuple(round(first + i * (last - first) / (num_taps - 1)) for i in range(num_taps))


def merged_taps(taps: tuple[int, ...], extra: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """The taps of a drafter that reads `extra` layers too, in layer order (the order its
    features are concatenated, the order vLLM captures them in)."""
    if not extra:
        return tuple(taps)
    if list(taps) != sorted(set(taps)):
        raise ValueError(f"taps can be added to a drafter whose taps are distinct and in layer "
                         f"order, not {list(taps)}")
    return tuple(sorted(set(taps) | {int(t) for t in extra}))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding of x[..., T, D] at positions[..., T] (float32 angles)."""
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    angles = positions.to(torch.float32)[..., None] * inv
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class ConditionedAttention(nn.Module):
    """Block queries over [context K/V from the features, the block's own K/V]."""

    def __init__(self, cfg: ConditionedConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.q_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], n, self.cfg.head_dim).transpose(-3, -2)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K [B,kv,T,D] (k-norm, RoPE) and V [B,kv,T,D] of inputs x[B,T,H]."""
        n = self.cfg.num_key_value_heads
        k = self.k_norm(self._heads(self.k_proj(x), n))
        k = rope(k, positions[:, None, :], self.cfg.rope_theta)
        return k, self._heads(self.v_proj(x), n)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """x[B,Q,H] at positions[B,Q]; allowed[B,Q,C+Q]: query may see that context/block key."""
        q = self.q_norm(self._heads(self.q_proj(x), self.cfg.num_attention_heads))
        q = rope(q, positions[:, None, :], self.cfg.rope_theta)
        k, v = self.keys_values(x, positions)
        k = torch.cat([ctx_k, k], dim=2)
        v = torch.cat([ctx_v, v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None],
                                             enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1))


class ConditionedLayer(nn.Module):
    """Pre-norm decoder layer: attention with injected context K/V, then SwiGLU."""

    def __init__(self, cfg: ConditionedConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.self_attn = ConditionedAttention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.mlp = nn.ModuleDict({
            "gate_proj": nn.Linear(h, cfg.intermediate_size, bias=False),
            "up_proj": nn.Linear(h, cfg.intermediate_size, bias=False),
            "down_proj": nn.Linear(cfg.intermediate_size, h, bias=False)})

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx_k, ctx_v, allowed)
        h = self.post_attention_layernorm(x)
        m = self.mlp
        return x + m["down_proj"](F.silu(m["gate_proj"](h)) * m["up_proj"](h))


class ConditionedDrafter(Drafter):
    """fc + hidden_norm (context), N conditioned layers over the block, norm, shared head."""

    shifted = False  # slot k of the block predicts the token k after the anchor
    mask_token_id = -1  # a learned mask embedding, no input id
    float_linears = ("fc",)  # reads raw verifier states (massive activations): never int8

    def __init__(self, cfg: ConditionedConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.mask_embedding = nn.Parameter(torch.zeros(h))
        self.fc = nn.Linear(cfg.feature_size, h, bias=False)
        self.hidden_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(ConditionedLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
        self.markov = MarkovHead(h, cfg.markov_rank) if cfg.markov_rank else None
        self.register_buffer("draft_to_verifier", None)
        for p in (self.embed_tokens.weight, self.lm_head.weight):
            p.requires_grad_(False)

    # ---- pieces shared by training and serving --------------------------------------------------
    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Fused, normalised context vectors [B,T,H] from tapped features [B,T,taps*H]."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K/V of the context vectors: what serving caches per committed token."""
        return [layer.self_attn.keys_values(context, positions) for layer in self.layers]

    def block_hidden(self, anchors: torch.Tensor, anchor_pos: torch.Tensor,
                     ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], ctx_allowed: torch.Tensor
                     ) -> torch.Tensor:
        """Final-normed hidden states [B,M,Bk,H] of M blocks per row.

        anchors[B,M], anchor_pos[B,M]: each block's anchor token and its position;
        ctx_allowed[B,M,C]: which of the C cached context keys each block may see.
        """
        b, m = anchors.shape
        bk = self.cfg.block_size
        emb = self.embed_tokens(anchors)[:, :, None, :]
        masks = self.mask_embedding.to(emb.dtype).expand(b, m, bk - 1, -1)
        x = torch.cat([emb, masks], dim=2).reshape(b, m * bk, -1)
        slot = torch.arange(bk, device=anchors.device)
        positions = (anchor_pos[:, :, None] + slot).reshape(b, m * bk)
        block_id = torch.arange(m, device=anchors.device).repeat_interleave(bk)
        own = (block_id[:, None] == block_id[None, :]).expand(b, -1, -1)
        sees_ctx = ctx_allowed.repeat_interleave(bk, dim=1)
        allowed = torch.cat([sees_ctx, own], dim=2)
        for layer, (k, v) in zip(self.layers, ctx_kv, strict=True):
            x = layer(x, positions, k, v, allowed)
        return self.norm(x).reshape(b, m, bk, -1)

    # ---- training -------------------------------------------------------------------------------
    def window_logits(self, input_ids: torch.Tensor, starts: torch.Tensor,
                      gamma: int | None = None, features: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """Differentiable logits [B,M,G,V] of windows starting at starts[B,M] (first draft
        position s; the anchor is the token at s-1, the context features those before s-1).

        features[B,L,taps*H] are the verifier's tapped states of input_ids[B,L] (teacher forced).
        """
        if features is None:
            raise ValueError("a conditioned drafter needs the verifier's features")
        gamma = self.cfg.gamma if gamma is None else gamma
        if gamma > self.cfg.gamma:
            raise ValueError(f"gamma {gamma} exceeds this drafter's block ({self.cfg.gamma})")
        device = self.device
        starts = starts.to(device)
        input_ids = input_ids.to(device)
        if bool((starts < 1).any()):
            raise ValueError("window starts must be >= 1 (the anchor is the token before)")
        length = int(starts.max()) - 1  # context positions any block can see
        ctx = self.context(features[:, :length].to(device))
        pos = torch.arange(length, device=device).expand(ctx.shape[0], -1)
        anchor_pos = starts - 1
        anchors = input_ids.gather(1, anchor_pos)
        ctx_allowed = pos[:, None, :] < anchor_pos[:, :, None]
        hidden = self.block_hidden(anchors, anchor_pos, self.context_kv(ctx, pos), ctx_allowed)
        previous = None if self.markov is None else previous_tokens(input_ids, anchor_pos, gamma)
        return teacher_forced_logits(self, hidden[:, :, 1:gamma + 1], previous)

    def input_lookahead(self, gamma: int) -> int:
        """Tokens past the last window start window_logits reads (a Markov head: targets')."""
        return gamma - 1 if self.markov is not None else 0

    # ---- construction and files -----------------------------------------------------------------
    @classmethod
    def from_verifier(cls, verifier_dir: str | Path, cfg: ConditionedConfig, seed: int = 0,
                      draft_to_verifier: torch.Tensor | None = None) -> ConditionedDrafter:
        """Random layers (scaled like the verifier's init), the verifier's embedding and head."""
        torch.manual_seed(seed)
        model = cls(cfg)
        for name, p in model.named_parameters():  # a Markov head keeps its own init
            if p.dim() == 2 and name not in SHARED and not name.startswith("markov."):
                nn.init.normal_(p, std=0.02 / (1 if "o_proj" not in name and "down_proj"
                                               not in name else math.sqrt(2 * len(model.layers))))
        model.load_shared(verifier_dir, draft_to_verifier)
        with torch.no_grad():
            model.mask_embedding.copy_(model.embed_tokens.weight.mean(0))
        return model

    def deepen(self, extra: int, seed: int = 0) -> None:
        """Append `extra` new layers whose output projections are zero: the drafter drafts
        exactly as before, so a deeper drafter is trained on from this one's acceptance
        instead of from scratch (the layer count can be raised without losing CPU hours)."""
        if extra < 1:
            raise ValueError(f"extra layers must be >= 1, got {extra}")
        torch.manual_seed(seed)
        self.cfg = replace(self.cfg, num_hidden_layers=self.cfg.num_hidden_layers + extra)
        for _ in range(extra):
            layer = ConditionedLayer(self.cfg).to(device=self.device, dtype=self.dtype)
            for name, p in layer.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    nn.init.zeros_(p)
                elif p.dim() == 2:
                    nn.init.normal_(p, std=0.02)
            self.layers.append(layer)

    def add_taps(self, extra: list[int] | tuple[int, ...]) -> None:
        """Read more verifier layers: the feature projection gets zero columns for the new taps,
        so the drafter drafts exactly as before and training decides what the new layers add
        (taps can be compared without losing the CPU hours behind this drafter)."""
        old = tuple(self.cfg.target_layer_ids)
        taps = merged_taps(old, extra)
        if taps == old:
            raise ValueError(f"taps {list(extra)} are read already (this drafter taps {list(old)})")
        cfg = replace(self.cfg, target_layer_ids=taps)  # checks the taps are verifier layers
        h = self.cfg.hidden_size
        fc = nn.Linear(cfg.feature_size, h, bias=False).to(device=self.device, dtype=self.dtype)
        with torch.no_grad():
            fc.weight.zero_()
            for i, t in enumerate(old):
                j = taps.index(t)
                fc.weight[:, j * h:(j + 1) * h] = self.fc.weight[:, i * h:(i + 1) * h]
        self.fc, self.cfg = fc, cfg

    def add_markov(self, rank: int, seed: int = 0) -> None:
        """Add a Markov head of this rank, its W_out zero: the drafter drafts exactly as before
        and training decides what the previous token adds (drafter/markov.py)."""
        if self.markov is not None:
            raise ValueError(f"the drafter has a Markov head already (rank {self.cfg.markov_rank})")
        torch.manual_seed(seed)
        head = MarkovHead(self.cfg.hidden_size, rank)  # refuses a rank < 1
        self.cfg = replace(self.cfg, markov_rank=rank)
        self.markov = head.to(device=self.device, dtype=self.dtype)

    # attributes the trainer reads from every drafter
    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.out_features

    @property
    def device(self) -> torch.device:
        """Where the drafter runs (read off the embedding, which int8 quantisation keeps)."""
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the embedding's: int8 linears take and give float32)."""
        return self.embed_tokens.weight.dtype

    @property
    def feature_taps(self) -> tuple[int, ...]:
        return tuple(self.cfg.target_layer_ids)

    @property
    def max_positions(self) -> int:
        return self.cfg.max_position_embeddings

    def load_shared(self, verifier_dir: str | Path,
                    draft_to_verifier: torch.Tensor | None = None) -> None:
        """Copy the verifier's embedding and LM head (tied in SmolLM2) into the frozen slots;
        with a reduced-vocabulary table, keep only those head rows."""
        state = read_weights(verifier_dir, keep=lambda name: name in VERIFIER_SHARED)
        head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
        if draft_to_verifier is not None:
            d2t = draft_to_verifier.long()
            head = head[d2t]
            self.lm_head = nn.Linear(self.cfg.hidden_size, d2t.numel(), bias=False)
            self.lm_head.weight.requires_grad_(False)
            self.draft_to_verifier = d2t
        with torch.no_grad():
            self.embed_tokens.weight.copy_(state["model.embed_tokens.weight"])
            self.lm_head.weight.copy_(head)

    def trained_state(self) -> dict[str, torch.Tensor]:
        """Everything but the shared tensors: what a drafter directory stores."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()
                if k not in SHARED and k != "draft_to_verifier"}

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.float32) -> None:
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.to(dtype) for k, v in self.trained_state().items()},
                  str(out / WEIGHTS_FILE))
        if self.draft_to_verifier is not None:
            save_d2t(out, self.draft_to_verifier)
        config = asdict(self.cfg)
        if not config["markov_rank"]:  # a drafter without a head: the files it always had
            del config["markov_rank"]
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, path: str | Path, verifier_dir: str | Path
                        ) -> ConditionedDrafter:
        cfg = ConditionedConfig.from_dict(read_config(path))
        model = cls(cfg)
        d2t = load_d2t(path) if (Path(path) / D2T_FILE).is_file() else None
        state = read_weights(path)
        missing, unexpected = model.load_state_dict(
            {k: v.float() for k, v in state.items()}, strict=False)
        missing = [k for k in missing if k not in SHARED]
        if missing or unexpected:
            raise ValueError(f"{path}: not a {MODEL_TYPE} drafter of this shape (missing "
                             f"{missing[:4]}, unexpected {unexpected[:4]})")
        model.load_shared(verifier_dir, d2t)
        return model
