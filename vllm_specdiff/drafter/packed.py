"""One packed drafting step of the block-causal drafter: every row's new context tokens and draft
block in ONE sequence, attention row by row straight on the row's KV entry.

The linears (most of the cost) see only real tokens, no padding: a row that arrives with a long
prompt does not widen the other rows. Attention reads each row's cached K/V in place (the step
writes its new K/V into the entry's reserved storage first), so no step copies or pads the cached
context of the batch. Per row and layer the work is one K/V write and one SDPA call.

Row b occupies packed slots [o_b, o_b + n_b + gamma): its n_b new context tokens (causal), then
its gamma block tokens (bidirectional over the block, and attending to the whole context). In the
row's storage, index p holds the token at position p: cached tokens [0, keep_b), the new ones,
then the block as scratch past the entry's length (overwritten by the next step).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .kv_pool import KVEntry


class PackedRows:
    """The per-row layout of one packed step; it is the layers' KV cache (`update`) and their
    attention (`attend`), called by the attention function registered in stack.py."""

    def __init__(self, entries: list[KVEntry], keep: np.ndarray, fresh: np.ndarray, gamma: int,
                 device: torch.device) -> None:
        width = fresh + gamma
        ends = np.cumsum(width)
        starts = ends - width
        total = int(ends[-1])
        # absolute position of every packed slot; a context query at position p sees keys <= p,
        # a block query sees every key of its row (limit past the longest row)
        positions = np.arange(total) - np.repeat(starts - keep, width)
        in_block = np.arange(total) >= np.repeat(starts + fresh, width)
        keys = keep + width
        limit = np.where(in_block, int(keys.max()), positions)
        mask = torch.arange(int(keys.max()), device=device)[None] \
            <= torch.from_numpy(limit).to(device)[:, None]
        self.position_ids = torch.from_numpy(positions).to(device)[None]
        # draft j of row b reads the hidden state of slot j - 1 (j = 0: its last context token)
        read = (starts + fresh - 1)[:, None] + np.arange(gamma)[None]
        self.read = torch.from_numpy(read).to(device)
        # per row: storage, packed slots [start, end), cached tokens, keys it attends, its mask
        self.rows = [(entry.kv, int(start), int(end), int(cached), int(n), mask[start:end, :n])
                     for entry, start, end, cached, n
                     in zip(entries, starts, ends, keep, keys, strict=True)]

    def update(self, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's K/V [1, kv_heads, T, head_dim] into each row's storage."""
        kv = torch.stack((key[0], value[0]))
        for store, start, end, keep, keys, _ in self.rows:
            store[layer_idx, :, :, keep:keys] = kv[:, :, start:end]
        return key, value

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention output [1, T, heads, head_dim] for query [1, heads, T, head_dim]."""
        outs = [F.scaled_dot_product_attention(
            query[:, :, start:end], store[layer_idx, 0, :, :keys][None],
            store[layer_idx, 1, :, :keys][None], attn_mask=mask, scale=scaling, enable_gqa=True)
            for store, start, end, _, keys, mask in self.rows]
        return torch.cat(outs, dim=2).transpose(1, 2)
