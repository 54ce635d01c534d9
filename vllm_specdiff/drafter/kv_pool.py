"""A bounded LRU pool of per-sequence KV caches, looked up by longest common token prefix.

vLLM hands the proposer rows that are reordered, preempted and resumed, without request ids. The
block-causal drafter therefore finds its cached context encoding by content: the entry sharing the
longest prefix with the new context is reused (rolled back to the shared prefix, then extended by
the new tokens). Accepted tokens are appended; rejected ones are rolled back implicitly.

The pool lives outside vLLM's memory budget, so it is bounded twice: by entry count and by bytes
(the storage actually allocated, grown with some headroom up to the longest possible context).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

DEFAULT_CACHE_BYTES = 1 << 30  # 1 GiB: ~175k tokens of the default 4-layer drafter in float32


@dataclass
class KVEntry:
    """One sequence's cached context: tokens[:length], per-layer K/V [kv_heads, cap, head_dim]."""

    tokens: np.ndarray  # int64 [capacity]; numpy keeps the per-entry prefix checks cheap
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0
    storage_bytes: int = 0  # bytes of keys + values + tokens, updated when storage is allocated

    @property
    def capacity(self) -> int:
        return self.tokens.shape[0]

    def common_prefix(self, context: np.ndarray) -> int:
        """Number of leading tokens shared with `context` (int64 numpy array)."""
        n = min(self.length, context.shape[0])
        if n == 0:
            return 0
        diff = np.flatnonzero(self.tokens[:n] != context[:n])
        return int(diff[0]) if diff.size else n

    def may_prefix(self, context: np.ndarray) -> bool:
        """Cheap screen: could this entry be a prefix of `context` (first/last token agree)?"""
        n = self.length
        return 0 < n <= context.shape[0] and self.tokens[0] == context[0] \
            and self.tokens[n - 1] == context[n - 1]

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def append(self, tokens: np.ndarray, new_kv: list[tuple[torch.Tensor, torch.Tensor]],
               max_capacity: int | None = None) -> None:
        """Append tokens[n] and per-layer K/V [kv_heads, n, head_dim].

        Storage grows with 25% (at least 64 tokens) headroom, so copies stay amortised O(1) per
        token while little of the byte budget is held empty, and never past `max_capacity` (the
        longest context the drafter accepts) unless needed.
        """
        n = tokens.shape[0]
        need = self.length + n
        if need > self.capacity or not self.keys:
            cap = max(need + 64, need + need // 4)
            cap = max(need, cap if max_capacity is None else min(cap, max_capacity))
            grown = np.zeros(cap, dtype=np.int64)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
            keys, values = [], []
            for layer, (k, v) in enumerate(new_kv):
                gk = k.new_zeros(k.shape[0], cap, k.shape[2])
                gv = v.new_zeros(v.shape[0], cap, v.shape[2])
                if self.keys:
                    gk[:, : self.length] = self.keys[layer][:, : self.length]
                    gv[:, : self.length] = self.values[layer][:, : self.length]
                keys.append(gk)
                values.append(gv)
            self.keys, self.values = keys, values
            self.storage_bytes = _storage_bytes(self)
        self.tokens[self.length: need] = tokens
        for layer, (k, v) in enumerate(new_kv):
            self.keys[layer][:, self.length: need] = k
            self.values[layer][:, self.length: need] = v
        self.length = need

    def copy_prefix(self, length: int) -> KVEntry:
        """A new entry holding the first `length` tokens (used when two rows share one entry)."""
        entry = KVEntry(tokens=self.tokens[:length].copy())
        entry.keys = [k[:, :length].clone() for k in self.keys]
        entry.values = [v[:, :length].clone() for v in self.values]
        entry.length = length
        entry.storage_bytes = _storage_bytes(entry)
        return entry


def _storage_bytes(entry: KVEntry) -> int:
    """Allocated bytes of an entry (capacity, not length: rolled-back room is still held)."""
    return entry.tokens.nbytes + sum(t.numel() * t.element_size()
                                     for t in entry.keys + entry.values)


class KVPool:
    """LRU map of KVEntry objects, bounded by `max_entries` (~one per live request) and by
    `max_bytes` of allocated storage."""

    def __init__(self, max_entries: int = 64, max_bytes: int | None = None) -> None:
        if max_entries < 1:
            raise ValueError(f"cache_size must be >= 1, got {max_entries}")
        max_bytes = DEFAULT_CACHE_BYTES if max_bytes is None else max_bytes
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"cache_bytes must be an integer >= 1 or None, got {max_bytes!r}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, KVEntry] = OrderedDict()
        self._next_key = 0
        self.hits = 0  # context tokens served from the cache
        self.misses = 0  # context tokens that had to be encoded
        self.evictions = 0

    def best_match(self, context: np.ndarray, exclude: set[int] | frozenset[int] = frozenset()
                   ) -> tuple[int | None, int]:
        """(key, shared prefix length) of the entry sharing the longest prefix with `context`.

        Fast path: speculative decoding only appends committed tokens, so a request's entry is
        normally a prefix of its next context; such entries pass a first/last-token screen and
        only they are compared in full. If none is a prefix (preemption, another request's
        branch, a rollback), every entry is compared. Entries in `exclude` (already claimed by
        another row of the batch) are skipped.
        """
        candidates = [k for k, e in self.entries.items()
                      if k not in exclude and e.may_prefix(context)]
        if not candidates:
            candidates = [k for k, e in self.entries.items()
                          if k not in exclude and e.length and e.tokens[0] == context[0]]
        best_key, best_len = None, 0
        for key in candidates:
            n = self.entries[key].common_prefix(context)
            if n > best_len:
                best_key, best_len = key, n
        return best_key, best_len

    def add(self, entry: KVEntry) -> int:
        key = self._next_key
        self._next_key += 1
        self.entries[key] = entry
        return key

    def touch(self, key: int) -> None:
        self.entries.move_to_end(key)

    def nbytes(self) -> int:
        return sum(e.storage_bytes for e in self.entries.values())

    def evict(self, in_use: set[int] | frozenset[int] = frozenset()) -> None:
        """Drop entries until both bounds hold (call after the step's forward pass).

        Order: least recently used entries that no row of this step used, then, only if this
        step's own entries alone break a bound, those newest first, so long-lived requests keep
        hitting and the overflow rows are re-encoded instead of every row thrashing.
        """
        total = self.nbytes()
        idle = [k for k in self.entries if k not in in_use]
        busy = sorted((k for k in in_use if k in self.entries), reverse=True)
        for key in idle + busy:
            if len(self.entries) <= self.max_entries and total <= self.max_bytes:
                break
            total -= self.entries.pop(key).storage_bytes
            self.evictions += 1

    def clear(self) -> None:
        self.entries.clear()

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self.entries),
            "cached_tokens": sum(e.length for e in self.entries.values()),
            "bytes": self.nbytes(),
            "max_bytes": self.max_bytes,
            "hit_tokens": self.hits,
            "miss_tokens": self.misses,
            "evictions": self.evictions,
        }
