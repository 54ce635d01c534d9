"""Per-request context keys/values of a conditioned drafter: what serving keeps between steps.

A conditioned drafter's context is the verifier's features of every committed token but the last
(the anchor). Projecting them into each layer's keys and values is the only per-token work, so
serving keeps each request's projected context and adds only the newly committed positions each
step (chunked prefill arrives in pieces the same way); drafts never enter it. The store is bounded
in bytes: when it is full, the least recently used requests that are not being drafted are
dropped. A request whose entry was dropped (or whose positions jump, as after preemption with
recomputation) starts a new entry at the positions it is given: it drafts from a shorter
context, which lowers acceptance but never changes the output (verification decides).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .conditioned import ConditionedDrafter

DEFAULT_CACHE_BYTES = 2**30


@dataclass
class ContextEntry:
    """One request's projected context: per layer K and V [kv_heads, T, head_dim]."""

    start: int  # position of the first cached context token
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def end(self) -> int:
        """One past the last cached position (the next position `extend` expects)."""
        return self.start + (self.keys[0].shape[1] if self.keys else 0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class ConditionedContextCache:
    """Bounded LRU store of projected contexts, and batched drafting from it."""

    def __init__(self, drafter: ConditionedDrafter, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.drafter = drafter
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, ContextEntry] = OrderedDict()
        self.restarts = 0  # entries begun again after a drop or a jump in positions

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    @torch.no_grad()
    def extend(self, req_id: str, features: torch.Tensor, first_position: int) -> None:
        """Add the verifier's features [n, taps*H] of positions first_position.. to a request."""
        entry = self.entries.get(req_id)
        if entry is None or entry.end != first_position:
            if entry is not None or first_position > 0:
                self.restarts += 1
            entry = ContextEntry(start=first_position)
            self.entries[req_id] = entry
        self.entries.move_to_end(req_id)
        if features.shape[0] == 0:
            return
        d = self.drafter
        context = d.context(features.to(d.fc.weight.device)[None])
        positions = torch.arange(first_position, first_position + features.shape[0],
                                 device=context.device)[None]
        new = d.context_kv(context, positions)
        if not entry.keys:
            entry.keys = [k[0] for k, _ in new]
            entry.values = [v[0] for _, v in new]
        else:
            entry.keys = [torch.cat([old, k[0]], dim=1) for old, (k, _) in zip(entry.keys, new,
                                                                               strict=True)]
            entry.values = [torch.cat([old, v[0]], dim=1) for old, (_, v) in zip(entry.values,
                                                                                 new, strict=True)]

    def drop(self, req_id: str) -> None:
        """Forget a finished or aborted request."""
        self.entries.pop(req_id, None)

    def evict(self, keep: set[str]) -> int:
        """Drop least recently used entries outside `keep` until the store fits its bound."""
        total, dropped = self.nbytes, 0
        for req_id in list(self.entries):
            if total <= self.max_bytes:
                break
            if req_id not in keep:
                total -= self.entries.pop(req_id).nbytes
                dropped += 1
        return dropped

    @torch.no_grad()
    def block_logits(self, req_ids: list[str], anchors: torch.Tensor,
                     anchor_positions: list[int]) -> torch.Tensor:
        """Logits [B, gamma, V_draft] of one block per request; anchors[B] are the tokens just
        committed, at anchor_positions[B]. A request whose context does not end right before
        its anchor (never fed, dropped, out of step) drafts from an empty one, counted as a
        restart."""
        if not req_ids:
            raise ValueError("block_logits needs at least one request")
        for req_id, position in zip(req_ids, anchor_positions, strict=True):
            entry = self.entries.get(req_id)
            if entry is None or entry.end != position:
                self.restarts += 1
                self.entries[req_id] = ContextEntry(start=position)
        self.evict(set(req_ids))
        entries = [self.entries[r] for r in req_ids]
        d = self.drafter
        device = d.fc.weight.device
        longest = max(e.end - e.start for e in entries)
        padded_k, padded_v = [], []
        for layer in range(len(d.layers)):
            ks, vs = [], []
            for e in entries:
                k = e.keys[layer] if e.keys else _empty(d, device)
                v = e.values[layer] if e.values else _empty(d, device)
                pad = longest - k.shape[1]
                ks.append(torch.nn.functional.pad(k, (0, 0, 0, pad)))
                vs.append(torch.nn.functional.pad(v, (0, 0, 0, pad)))
            padded_k.append(torch.stack(ks))
            padded_v.append(torch.stack(vs))
        lengths = torch.tensor([e.end - e.start for e in entries], device=device)
        ctx_allowed = (torch.arange(longest, device=device)[None] < lengths[:, None])[:, None]
        anchor_pos = torch.tensor([[e.end] for e in entries], device=device)
        hidden = d.block_hidden(anchors.to(device)[:, None], anchor_pos,
                                list(zip(padded_k, padded_v, strict=True)), ctx_allowed)
        return d.lm_head(hidden[:, 0, 1:])


def _empty(drafter: ConditionedDrafter, device: torch.device) -> torch.Tensor:
    cfg = drafter.cfg
    return torch.zeros(cfg.num_key_value_heads, 0, cfg.head_dim, device=device,
                       dtype=drafter.fc.weight.dtype)
