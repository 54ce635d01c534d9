"""Per-request context keys/values of a conditioned drafter: what serving keeps between steps.

A conditioned drafter's context is the verifier's features of every committed token but the last
(the anchor). Projecting them into each layer's keys and values is the only per-token work, so
serving keeps each request's projected context and adds only the newly committed positions each
step (chunked prefill arrives in pieces the same way); drafts never enter it.

Appends are amortised O(1): an entry holds one preallocated buffer [layers, 2 (K, V), kv_heads,
capacity, head_dim] whose capacity doubles when full, and its keys/values are views of the filled
part. Concatenating per step would copy the whole context every step, which grows quadratically
over a long generation. Drafting one request reads the views as they are; a batch of several is
padded into one tensor, one copy per request.

Prefix reuse. With vLLM's prefix caching, a request whose prompt starts with cached blocks is
never run through the verifier at those positions, so its first features arrive at a position
> 0. The projected K/V of position p depends only on tokens 0..p (the verifier's features of
token p, which see tokens <= p, and p itself through RoPE), so any request whose recorded tokens
agree on 0..start-1 holds exactly the missing K/V. Entries therefore record the token ids they
cover (known at draft time, not when features arrive), and a request whose entry begins at
start > 0 looks, at its first draft, for such a donor among the running requests and the recently
finished ones: `drop` keeps a finished request's entry in a small LRU "retired" set. A hit copies
the donor's K/V[:start] in front (counted in `prefix_hits`); a miss leaves the shorter context
(counted in `restarts`). A request whose positions jump back (preemption with recomputation, a
prefix-cache hit on re-scheduling) keeps its own K/V up to the new position: same tokens, same K/V.

The store is bounded in bytes (allocated capacity, retired entries included): when it is full,
retired entries go first, then the least recently used requests that are not being drafted. A
request whose entry was dropped (or whose positions jump forward) starts a new entry at the
positions it is given: unless a donor covers its prefix, it drafts from a shorter context, which
lowers acceptance but never changes the output (verification decides).

Deferred projection. A step whose rows the adaptive controller does not draft reads no context,
so its positions need not be projected yet: `extend_many` keeps each request's new features raw
(its `backlog`, one copy per call of the committed rows only) and `block_logits` projects the
backlog of the requests it drafts, all in one call, right before drafting. A request's K/V are
then the same function of the same features and positions as with a projection every step (a
matrix product over other rows may round differently: float32 tolerance, not bits), so drafts
are the same. The backlog is bounded per request (`max_backlog` rows, projected at once when
reached; 0: project every step), counted in the byte bound, and cut to what a donor can ever
lend (positions before its recorded tokens) when the request retires.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .conditioned import ConditionedDrafter
from .markov import greedy_chain_logits

DEFAULT_CACHE_BYTES = 2**30
DEFAULT_MAX_RETIRED = 64
# Raw feature rows a request may hold unprojected. Projecting costs a fixed ~2 ms per call plus
# ~60 us per row (the default drafter, one CPU thread), so the fixed part is amortised from ~128
# rows per call, and only a request that finishes before its next draft saves the rest: 256
# rows cover a typical chat request's prompt and reply. They are 1.8 MB per request with the
# default drafter's 1728 features (its K/V of the same rows: 0.8 MB).
DEFAULT_MAX_BACKLOG = 256


@dataclass
class ContextEntry:
    """One request's projected context and the token ids it has seen.

    kv[layer, 0 (K) or 1 (V), kv_heads, capacity, head_dim] holds positions start..end-1 in its
    first `length` slots; tokens[:num_tokens] are the request's token ids from position 0 (as of
    its last draft). `pending`: begun at start > 0 and not yet looked up for a donor prefix.
    `backlog`: raw features [n, taps*H] of positions end..fed_end-1, not yet projected.
    """

    start: int
    kv: torch.Tensor | None = None
    length: int = 0
    tokens: torch.Tensor | None = None
    num_tokens: int = 0
    pending: bool = False
    backlog: list[torch.Tensor] = field(default_factory=list)
    backlog_rows: int = 0

    @property
    def end(self) -> int:
        """One past the last projected position."""
        return self.start + self.length

    @property
    def fed_end(self) -> int:
        """One past the last position fed, projected or not (the next position `extend`
        expects)."""
        return self.end + self.backlog_rows

    @property
    def keys(self) -> list[torch.Tensor]:
        """Each layer's cached keys [kv_heads, length, head_dim] (views of the buffer)."""
        return [] if self.kv is None else list(self.kv[:, 0, :, :self.length].unbind(0))

    @property
    def values(self) -> list[torch.Tensor]:
        """Each layer's cached values [kv_heads, length, head_dim] (views of the buffer)."""
        return [] if self.kv is None else list(self.kv[:, 1, :, :self.length].unbind(0))

    @property
    def nbytes(self) -> int:
        """Allocated bytes (capacity, not only the filled part), the raw backlog included."""
        return sum(t.numel() * t.element_size() for t in (self.kv, self.tokens, *self.backlog)
                   if t is not None)

    def defer(self, features: torch.Tensor) -> None:
        """Keep features [n, taps*H] of positions fed_end.. to project later."""
        if features.shape[0]:
            self.backlog.append(features)
            self.backlog_rows += features.shape[0]

    def take_backlog(self) -> list[torch.Tensor]:
        """The backlog's pieces, in position order, leaving it empty (they are being
        projected)."""
        pieces, self.backlog, self.backlog_rows = self.backlog, [], 0
        return pieces

    def filled(self) -> torch.Tensor:
        """The filled part of the buffer [layers, 2, kv_heads, length, head_dim]."""
        assert self.kv is not None
        return self.kv[:, :, :, :self.length]

    def append(self, new: torch.Tensor) -> None:
        """Add K/V [layers, 2, kv_heads, n, head_dim] of the next n positions."""
        n = new.shape[3]
        if self.kv is None or self.length + n > self.kv.shape[3]:
            capacity = self.length + n if self.kv is None else max(self.length + n,
                                                                  2 * self.kv.shape[3])
            self._reallocate(capacity, like=new)
        assert self.kv is not None
        self.kv[:, :, :, self.length:self.length + n] = new
        self.length += n

    def prepend(self, prefix: torch.Tensor) -> None:
        """Put K/V [layers, 2, kv_heads, p, head_dim] of positions start-p..start-1 in front."""
        p = prefix.shape[3]
        old, length = self.kv, self.length
        self.kv = None
        self.length = 0
        self._reallocate(p + (0 if old is None else old.shape[3]), like=prefix)
        self.append(prefix)
        if old is not None and length:
            self.append(old[:, :, :, :length])
        self.start -= p

    def truncate(self, end: int) -> None:
        """Forget positions end.., projected or not (kept: start <= end <= self.fed_end)."""
        if end == self.fed_end:  # in step (every step): the backlog is not walked
            return
        if end < self.end:
            self.length = end - self.start
            self.backlog, self.backlog_rows = [], 0
            return
        keep, kept, rows = end - self.end, [], 0
        for piece in self.backlog:
            if rows >= keep:
                break
            kept.append(piece[:keep - rows])
            rows += kept[-1].shape[0]
        self.backlog, self.backlog_rows = kept, keep

    def record_tokens(self, tokens: torch.Tensor) -> None:
        """Remember token ids [n] of positions 0..n-1; only the part not seen before is copied
        (a request's committed tokens never change)."""
        n = tokens.shape[0]
        if n <= self.num_tokens:
            self.num_tokens = n
            return
        if self.tokens is None or n > self.tokens.shape[0]:
            capacity = n if self.tokens is None else max(n, 2 * self.tokens.shape[0])
            grown = torch.empty(capacity, dtype=torch.long)
            if self.tokens is not None:
                grown[:self.num_tokens] = self.tokens[:self.num_tokens]
            self.tokens = grown
        self.tokens[self.num_tokens:n] = tokens[self.num_tokens:n].to("cpu", torch.long)
        self.num_tokens = n

    def covers(self, tokens: torch.Tensor, upto: int) -> bool:
        """Whether this entry holds the K/V of positions 0..upto-1 of a request with `tokens`
        (projected or in its backlog)."""
        return (self.start == 0 and self.fed_end >= upto and self.num_tokens >= upto
                and self.tokens is not None and tokens.shape[0] >= upto
                and torch.equal(self.tokens[:upto], tokens[:upto].to("cpu", torch.long)))

    def _reallocate(self, capacity: int, like: torch.Tensor) -> None:
        shape = (*like.shape[:3], capacity, like.shape[4])
        grown = torch.empty(shape, dtype=like.dtype, device=like.device)
        if self.kv is not None and self.length:
            grown[:, :, :, :self.length] = self.kv[:, :, :, :self.length]
        self.kv = grown


class ConditionedContextCache:
    """Bounded LRU store of projected contexts, prefix reuse, and batched drafting from it."""

    def __init__(self, drafter: ConditionedDrafter, max_bytes: int = DEFAULT_CACHE_BYTES,
                 max_retired: int = DEFAULT_MAX_RETIRED,
                 max_backlog: int = DEFAULT_MAX_BACKLOG) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if max_retired < 0:
            raise ValueError(f"max_retired must be >= 0, got {max_retired}")
        if max_backlog < 0:
            raise ValueError(f"max_backlog must be >= 0, got {max_backlog}")
        self.drafter = drafter
        self.max_bytes = max_bytes
        self.max_retired = max_retired
        self.max_backlog = max_backlog
        self.projections = 0  # projection calls (fc, hidden_norm, each layer's K/V)
        self.projected_rows = 0  # positions those calls projected
        self.entries: OrderedDict[str, ContextEntry] = OrderedDict()
        self.retired: OrderedDict[str, ContextEntry] = OrderedDict()  # finished, kept as donors
        self.restarts = 0  # entries drafting without their prefix (dropped, jumped, no donor)
        self.prefix_hits = 0  # entries begun at start > 0 whose prefix a donor supplied

    @property
    def nbytes(self) -> int:
        """Allocated bytes of all entries, retired ones included."""
        return (sum(e.nbytes for e in self.entries.values())
                + sum(e.nbytes for e in self.retired.values()))

    def extend(self, req_id: str, features: torch.Tensor, first_position: int) -> None:
        """Add the verifier's features [n, taps*H] of positions first_position.. to a request."""
        self.extend_many([(req_id, features, first_position)])

    @torch.no_grad()
    def extend_many(self, updates: list[tuple[str, torch.Tensor, int]]) -> None:
        """`extend` for a whole batch: (request id, features [n, taps*H], first position) each.
        The features wait in each request's backlog until it is drafted (`block_logits`) or
        holds `max_backlog` rows; the requests due are projected together (`_project`)."""
        placed = []
        for req_id, features, first_position in updates:
            entry = self._place(req_id, first_position)
            self.entries.move_to_end(req_id)
            placed.append((entry, features.shape[0]))
        rows = [f for _, f, _ in updates if f.shape[0]]
        if not rows:
            return
        # one copy of the committed rows: the caller's step tensor (rejected rows too) is not
        # kept alive by the backlog
        fed = torch.cat(rows).to(self.drafter.device)
        offset = 0
        for entry, n in placed:
            entry.defer(fed[offset:offset + n])
            offset += n
        self._project([e for e, _ in placed if e.backlog_rows >= max(self.max_backlog, 1)])

    def catch_up(self, req_ids: list[str]) -> None:
        """Project the deferred positions of these requests in one call: a step that drafts
        them in several `block_logits` calls (draft lengths differ) still projects once."""
        self._project([self.entries[r] for r in req_ids if r in self.entries])

    def _place(self, req_id: str, position: int) -> ContextEntry:
        """The request's entry, cut back to `position` when it reaches there (in step, or back
        over its own positions), else a new entry beginning there (new, dropped, or jumped
        forward: a start > 0 is resolved, donor or restart, at its draft)."""
        self.retired.pop(req_id, None)
        entry = self.entries.get(req_id)
        if entry is not None and entry.start <= position <= entry.fed_end:
            entry.truncate(position)
        else:
            entry = ContextEntry(start=position, pending=position > 0)
            self.entries[req_id] = entry
        return entry

    def _project(self, entries: list[ContextEntry]) -> None:
        """Project the backlog of these entries in one call (`fc`, `hidden_norm`, then each
        layer's K/V with every row's own RoPE position) and append it to their K/V: at batch
        16 one call per request costs more than the draft."""
        due = list({id(e): e for e in entries if e.backlog_rows}.values())
        if not due:
            return
        d = self.drafter
        counts = [e.backlog_rows for e in due]
        positions = torch.cat([torch.arange(e.end, e.fed_end) for e in due]).to(d.device)
        features = torch.cat([piece for e in due for piece in e.take_backlog()])
        new = d.context_kv(d.context(features[None]), positions[None])
        kv = torch.stack([torch.stack([k[0], v[0]]) for k, v in new])  # [L, 2, kv, T, D]
        offset = 0
        for entry, n in zip(due, counts, strict=True):
            entry.append(kv[:, :, :, offset:offset + n])
            offset += n
        self.projections += 1
        self.projected_rows += offset

    def drop(self, req_id: str) -> None:
        """Forget a finished or aborted request; a complete entry with recorded tokens is kept
        as a retired donor (least recently used first out, bounded in count and bytes)."""
        entry = self.entries.pop(req_id, None)
        if (entry is None or self.max_retired == 0 or entry.start != 0 or not entry.fed_end
                or not entry.num_tokens):
            return
        # a donor lends only positions before its recorded tokens: at most one backlog row stays
        entry.truncate(min(entry.fed_end, entry.num_tokens))
        self.retired[req_id] = entry
        while len(self.retired) > self.max_retired:
            self.retired.popitem(last=False)
        total = self.nbytes
        while self.retired and total > self.max_bytes:  # retiring never breaks the bound
            total -= self.retired.popitem(last=False)[1].nbytes

    def evict(self, keep: set[str]) -> int:
        """Drop retired entries, then least recently used entries outside `keep`, until the
        store fits its bound."""
        total, dropped = self.nbytes, 0
        while self.retired and total > self.max_bytes:
            total -= self.retired.popitem(last=False)[1].nbytes
            dropped += 1
        for req_id in list(self.entries):
            if total <= self.max_bytes:
                break
            if req_id not in keep:
                total -= self.entries.pop(req_id).nbytes
                dropped += 1
        return dropped

    def _find_donor(self, entry: ContextEntry, tokens: torch.Tensor) -> ContextEntry | None:
        """A running or retired entry holding K/V 0..entry.start-1 of these tokens."""
        upto = entry.start
        for candidate in reversed(self.entries.values()):
            if candidate is not entry and candidate.covers(tokens, upto):
                return candidate
        for req_id, candidate in reversed(self.retired.items()):
            if candidate.covers(tokens, upto):
                self.retired.move_to_end(req_id)
                return candidate
        return None

    def _resolve(self, entry: ContextEntry, tokens: torch.Tensor | None) -> None:
        """Supply a pending entry's missing prefix from a donor, or count it as a restart."""
        entry.pending = False
        donor = None if tokens is None else self._find_donor(entry, tokens)
        if donor is None:
            self.restarts += 1
            return
        if donor.end < entry.start:  # the prefix is partly in the donor's backlog
            self._project([donor])
        entry.prepend(donor.filled()[:, :, :, :entry.start])
        self.prefix_hits += 1

    @torch.no_grad()
    def block_logits(self, req_ids: list[str], anchors: torch.Tensor, anchor_positions: list[int],
                     tokens: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [B, gamma, V_draft] of one block per request; anchors[B] are the tokens just
        committed, at anchor_positions[B]; tokens[B] (optional) each request's token ids from
        position 0 through its anchor, recorded for prefix reuse. A request whose context does
        not end right before its anchor (never fed, dropped, out of step) starts a new entry
        there: a donor may supply its prefix (a prefix hit), else it drafts from an empty one
        (a restart)."""
        if not req_ids:
            raise ValueError("block_logits needs at least one request")
        if tokens is not None and len(tokens) != len(req_ids):
            raise ValueError(f"{len(tokens)} token rows for {len(req_ids)} requests")
        for b, (req_id, position) in enumerate(zip(req_ids, anchor_positions, strict=True)):
            entry = self._place(req_id, position)
            row = None if tokens is None else tokens[b]
            if row is not None:
                entry.record_tokens(row)
            if entry.pending:
                self._resolve(entry, row)
        entries = [self.entries[r] for r in req_ids]
        self._project(entries)  # catch up: every drafted request's deferred positions at once
        self.evict(set(req_ids))
        d = self.drafter
        device = d.device
        lengths = [e.length for e in entries]
        longest = max(lengths)
        if len(entries) == 1:
            e = entries[0]
            if e.length:
                ctx = [(k[None], v[None]) for k, v in zip(e.keys, e.values, strict=True)]
            else:
                empty = _empty(d, device)[None]
                ctx = [(empty, empty) for _ in d.layers]
        else:
            like = next((e.kv for e in entries if e.kv is not None), None)
            cfg = d.cfg
            batch = torch.zeros(len(d.layers), 2, len(entries), cfg.num_key_value_heads, longest,
                                cfg.head_dim, device=device,
                                dtype=d.dtype if like is None else like.dtype)
            for i, e in enumerate(entries):
                if e.length:
                    batch[:, :, i, :, :e.length] = e.filled()
            ctx = [(batch[layer, 0], batch[layer, 1]) for layer in range(len(d.layers))]
        ctx_allowed = (torch.arange(longest, device=device)[None]
                       < torch.tensor(lengths, device=device)[:, None])[:, None]
        anchor_pos = torch.tensor([[e.end] for e in entries], device=device)
        hidden = d.block_hidden(anchors.to(device)[:, None], anchor_pos, ctx, ctx_allowed)
        # with a Markov head, each slot conditioned on the drafter's own greedy path
        return greedy_chain_logits(d, hidden[:, 0, 1:], anchors)


def _empty(drafter: ConditionedDrafter, device: torch.device) -> torch.Tensor:
    cfg = drafter.cfg
    return torch.zeros(cfg.num_key_value_heads, 0, cfg.head_dim, device=device,
                       dtype=drafter.dtype)
