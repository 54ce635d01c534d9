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
from dataclasses import dataclass

import numpy as np
import torch

DEFAULT_CACHE_BYTES = 1 << 30  # 1 GiB: ~175k tokens of the default 4-layer drafter in float32


@dataclass(frozen=True)
class KVLayout:
    """Shape of a drafter's cached K/V: one tensor [layers, 2 (K, V), kv_heads, cap, head_dim]."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def empty(self, capacity: int) -> torch.Tensor:
        return torch.zeros(self.layers, 2, self.kv_heads, capacity, self.head_dim,
                           dtype=self.dtype, device=self.device)


@dataclass
class KVEntry:
    """One sequence's cached context: tokens[:length] and kv[:, :, :, :length] (see KVLayout).

    The forward pass writes its K/V straight into `kv` past `length` (the step's new context
    tokens, then the draft block as scratch), so attention reads each row's cache in place;
    `commit` then makes the new context tokens part of the entry.
    """

    tokens: np.ndarray  # int64 [capacity]; numpy keeps the per-entry prefix checks cheap
    kv: torch.Tensor | None = None
    length: int = 0
    storage_bytes: int = 0  # bytes of kv + tokens, updated when storage is allocated

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

    def reserve(self, need: int, layout: KVLayout, max_capacity: int | None = None) -> None:
        """Make room for `need` tokens, keeping the first `length`.

        Storage grows with 25% (at least 64 tokens) headroom, so copies stay amortised O(1) per
        token while little of the byte budget is held empty, and never past `max_capacity` (the
        longest context plus draft block the drafter accepts) unless needed.
        """
        if self.kv is not None and need <= self.capacity and self.kv.dtype == layout.dtype \
                and self.kv.device == layout.device:
            return  # (a drafter moved or cast since caching re-allocates, converting the cache)
        cap = max(need + 64, need + need // 4)
        cap = max(need, cap if max_capacity is None else min(cap, max_capacity))
        grown = np.zeros(cap, dtype=np.int64)
        grown[: self.length] = self.tokens[: self.length]
        kv = layout.empty(cap)
        if self.kv is not None and self.length:
            kv[:, :, :, : self.length] = self.kv[:, :, :, : self.length]
        self.tokens, self.kv = grown, kv
        self.storage_bytes = _storage_bytes(self)

    def commit(self, tokens: np.ndarray) -> None:
        """Append tokens[n] whose K/V the forward pass has written at kv[..., length:length+n]."""
        need = self.length + tokens.shape[0]
        if self.kv is None or need > self.capacity:
            raise ValueError(f"commit of {tokens.shape[0]} tokens past the reserved capacity")
        self.tokens[self.length: need] = tokens
        self.length = need

    def copy_prefix(self, length: int) -> KVEntry:
        """A new entry holding the first `length` tokens (used when two rows share one entry)."""
        entry = KVEntry(tokens=self.tokens[:length].copy())
        entry.kv = self.kv[:, :, :, :length].clone()
        entry.length = length
        entry.storage_bytes = _storage_bytes(entry)
        return entry


def _storage_bytes(entry: KVEntry) -> int:
    """Allocated bytes of an entry (capacity, not length: rolled-back room is still held)."""
    kv = 0 if entry.kv is None else entry.kv.numel() * entry.kv.element_size()
    return entry.tokens.nbytes + kv


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
        """Drop every entry and zero the counters (a fresh pool, its storage kept)."""
        self.entries.clear()
        self.hits = self.misses = self.evictions = 0

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
