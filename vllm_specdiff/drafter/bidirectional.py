"""Full-bidirectional MDM drafters (Dream/DiffuCoder, LLaDA): context + gamma masks, all tokens
attend to all tokens, context re-encoded every step.

Because every context token also attends to the masks, nothing can be cached across steps; the
`context_window` option bounds the cost by keeping only the trailing tokens. The two head
conventions differ only in which hidden state is read for block position j:
shifted (Dream) reads position L+j-1, unshifted (LLaDA) reads L+j.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from .base import Drafter
from .checkpoint import load_into, parse_dtype
from .stack import DecoderStack, make_config
from .vocab import copy_tokenizer_files


class BidirectionalDrafter(Drafter):
    """Shared implementation; subclasses convert their checkpoint's config and weight names."""

    def __init__(self, arch: str, config: object, *, mask_token_id: int, shifted: bool,
                 context_window: int | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.config = config
        self.mask_token_id = mask_token_id
        self.shifted = shifted
        self.vocab_size = config.vocab_size
        self.max_positions = config.max_position_embeddings
        self.context_window = context_window
        self.model = DecoderStack(arch, config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("draft_to_verifier", None)
        self.source_config: dict | None = None  # config.json as loaded, written back on save
        self.source_dir: Path | None = None

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.out_features

    @classmethod
    def _build(cls, arch: str, base: dict, state: dict[str, torch.Tensor], source: str,
               dtype: torch.dtype | str, context_window: int | None, *, mask_token_id: int,
               shifted: bool) -> BidirectionalDrafter:
        config = make_config(arch, base)
        if not 0 <= mask_token_id < config.vocab_size:
            raise ValueError(f"mask_token_id {mask_token_id} of {source!r} is outside the "
                             f"embedding (vocab_size={config.vocab_size})")
        with torch.device("meta"):
            drafter = cls(arch, config, mask_token_id=mask_token_id, shifted=shifted,
                          context_window=context_window)
        load_into(drafter, state, source)
        drafter.model.reset_rotary()
        drafter.to(dtype=parse_dtype(dtype))
        drafter.model.reset_rotary()
        drafter.source_dir = Path(source)
        return drafter.eval()

    def _export_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Weight names of the checkpoint format (identity for Dream, renamed for LLaDA)."""
        return state

    def save_pretrained(self, path: str | Path) -> None:
        """Write the drafter back in its own checkpoint format (e.g. after full fine-tuning)."""
        if self.draft_to_verifier is not None or self.source_config is None:
            raise ValueError("only a drafter loaded with from_pretrained and without a reduced "
                             "vocabulary can be saved; keep the d2t table beside the original")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.source_config, indent=2))
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(self._export_state(state), str(path / "model.safetensors"),
                  metadata={"format": "pt"})
        if self.source_dir is not None and self.source_dir.resolve() != path.resolve():
            copy_tokenizer_files(self.source_dir, path)

    def _run(self, rows: list[torch.Tensor], gamma: int,
             blocks: torch.Tensor) -> torch.Tensor:
        """Logits [R,G,V_draft] for R sequences `rows[r] + blocks[r]`, one bidirectional pass."""
        device = self._device()
        count = len(rows)
        lengths = torch.tensor([r.numel() for r in rows], device=device)
        width = int(lengths.max()) + gamma
        ids = torch.full((count, width), self.mask_token_id, dtype=torch.long)
        for r, ctx in enumerate(rows):
            ids[r, : ctx.numel()] = ctx.cpu()  # built on CPU, moved once
        ids = ids.to(device)
        slots = lengths[:, None] + torch.arange(gamma, device=device)[None]
        ids.scatter_(1, slots, blocks.to(device))
        pos = torch.arange(width, device=device)
        live = pos[None] < (lengths + gamma)[:, None]
        allowed = live[:, None, :]  # [R,1,W]: a key-padding mask, broadcast over queries
        position_ids = torch.where(live, pos[None], 0)
        hidden = self.model(ids, position_ids, allowed)
        read = slots - int(self.shifted)
        picked = hidden.gather(1, read[..., None].expand(-1, -1, hidden.shape[-1]))
        return self.lm_head(picked)

    def _block_logits(self, contexts: list[torch.Tensor], block: torch.Tensor) -> torch.Tensor:
        return self._run(contexts, block.shape[1], block)

    def window_logits(self, input_ids: torch.Tensor, starts: torch.Tensor,
                      gamma: int) -> torch.Tensor:
        """Differentiable logits [B,M,G,V_draft]; each window is its own bidirectional sequence
        (context tokens see the masks, so windows cannot share one pass here)."""
        starts = torch.as_tensor(starts, dtype=torch.long)
        if input_ids.dim() != 2 or starts.dim() != 2 or starts.shape[0] != input_ids.shape[0]:
            raise ValueError("window_logits needs input_ids[B,L] and starts[B,M]")
        batch, length = input_ids.shape
        if bool(((starts < 1) | (starts > length)).any()):
            raise ValueError(f"window starts must be in [1, {length}]")
        rows = []
        for b in range(batch):
            for s in starts[b].tolist():
                ctx = input_ids[b, :s]
                if self.context_window is not None:
                    ctx = ctx[-self.context_window:]
                if ctx.numel() + gamma > self.max_positions:
                    raise ValueError(f"window start + gamma exceeds max_positions="
                                     f"{self.max_positions}")
                rows.append(ctx)
        blocks = torch.full((len(rows), gamma), self.mask_token_id, dtype=torch.long,
                            device=self._device())
        logits = self._run(rows, gamma, blocks)
        return logits.reshape(batch, starts.shape[1], gamma, -1)
