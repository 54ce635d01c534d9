"""Drafts retrieved from what the verifier itself wrote before (retrieval-based drafting).

A datastore holds the verifier's own continuations of many prompts (e.g. the greedy data
`specdiff-distill generate` writes for training). A row's draft is looked up by the suffix of
its context: the longest n-gram (orders `ORDERS`) that occurs in the datastore, then the
continuations that followed its occurrences, merged token by token: at each position the token
most of the continuations still agreeing with the draft so far have next (ties: the smallest
id). It costs no model call, and verification decides what is kept, so it cannot affect
losslessness.

Why: the verifier repeats itself across prompts (answer openings, code idioms, the chat
template's turn structure), which neither prompt lookup (the row's own context) nor a small
drafter predicts well. Plain numpy, no vLLM or torch import.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# n-gram orders matched against a context's suffix, longest first.
ORDERS = (4, 3, 2)
# Context tokens kept before each continuation, so its first tokens have keys too (the chat
# template's "assistant" turn opening is what predicts an answer's opening).
LEAD = max(ORDERS)
# Occurrences merged per lookup (the earliest ones): bounds a lookup's cost.
MAX_MATCHES = 64
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)


def _hash_windows(tokens: np.ndarray, n: int) -> np.ndarray:
    """Hash of every window tokens[i:i + n] (uint64 arithmetic, wrapping)."""
    count = tokens.shape[0] - n + 1
    h = np.zeros(max(count, 0), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(n):
            h = h * _MULTIPLIER + tokens[k:k + count].astype(np.uint64) + np.uint64(1)
    return h


@dataclass
class _Index:
    hashes: np.ndarray  # sorted hashes of every n-gram ending before a continuation token
    positions: np.ndarray  # where the token after each n-gram is, in hash order (then position)


class Datastore:
    """Continuations indexed by their preceding n-grams (see the module docstring).

    `tokens` concatenates segments, each `LEAD` context tokens (fewer if its context was
    shorter) followed by a continuation; `starts[i]:starts[i + 1]` is segment i and
    `first[i]` where its continuation begins. Build one with `from_sequences`.
    """

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, first: np.ndarray) -> None:
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        self.starts = np.asarray(starts, dtype=np.int64)
        self.first = np.asarray(first, dtype=np.int64)
        if self.starts.ndim != 1 or self.starts.shape[0] != self.first.shape[0] + 1 \
                or (self.starts.shape[0] and self.starts[-1] != self.tokens.shape[0]):
            raise ValueError("datastore: starts must have one entry per segment plus the end")
        # each token's segment end, so a continuation never runs into the next segment
        ends = np.repeat(self.starts[1:], np.diff(self.starts))
        self.segment_end = ends
        self.indexes = {n: self._index(n) for n in ORDERS}

    @classmethod
    def from_sequences(cls, sequences: Iterable[tuple[Sequence[int], int]]) -> Datastore:
        """From (tokens, prompt length) pairs: each sequence's continuation after its prompt,
        with the prompt's last `LEAD` tokens before it."""
        parts, starts, first, total = [], [0], [], 0
        for tokens, prompt_len in sequences:
            seq = np.asarray(tokens, dtype=np.int64)
            if seq.shape[0] <= prompt_len:
                continue
            lead = max(prompt_len - LEAD, 0)
            parts.append(seq[lead:])
            first.append(total + prompt_len - lead)
            total += seq.shape[0] - lead
            starts.append(total)
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return cls(tokens, np.asarray(starts), np.asarray(first, dtype=np.int64))

    def _index(self, n: int) -> _Index:
        """Every n-gram that ends right before a continuation token, within one segment."""
        hashes = _hash_windows(self.tokens, n)
        nxt = np.arange(n, n + hashes.shape[0], dtype=np.int64)  # the token after window i
        keep = np.zeros(hashes.shape[0], dtype=bool)
        for s, f, e in zip(self.starts[:-1], self.first, self.starts[1:], strict=True):
            lo, hi = max(f, s + n), e  # next-token positions with n tokens of this segment
            if lo < hi:
                keep[lo - n:hi - n] = True
        hashes, nxt = hashes[keep], nxt[keep]
        order = np.lexsort((nxt, hashes))
        return _Index(hashes[order], nxt[order])

    def __len__(self) -> int:
        """Continuation tokens held."""
        return int(self.tokens.shape[0] - (self.first - self.starts[:-1]).sum())

    def matches(self, context: np.ndarray) -> np.ndarray:
        """Positions of the tokens that followed the longest matching suffix (earliest
        `MAX_MATCHES` occurrences); empty when no order matches."""
        context = np.asarray(context, dtype=np.int64)
        for n in ORDERS:
            if context.shape[0] < n:
                continue
            suffix = context[-n:]
            key = _hash_windows(suffix, n)[0]
            index = self.indexes[n]
            lo = int(np.searchsorted(index.hashes, key, side="left"))
            hi = int(np.searchsorted(index.hashes, key, side="right"))
            if lo == hi:
                continue
            found = index.positions[lo:hi]
            # drop hash collisions: the n tokens before each position must equal the suffix
            window = self.tokens[found[:, None] - n + np.arange(n)]
            found = found[(window == suffix).all(axis=1)][:MAX_MATCHES]
            if found.shape[0]:
                return found
        return np.zeros(0, dtype=np.int64)

    def draft(self, context: np.ndarray, gamma: int) -> np.ndarray | None:
        """At most gamma tokens merged from the continuations of the longest matching suffix
        (see the module docstring); None when nothing matches."""
        found = self.matches(context)
        if not found.shape[0] or gamma <= 0:
            return None
        offsets = found[:, None] + np.arange(gamma)
        valid = offsets < self.segment_end[found][:, None]
        conts = np.where(valid, self.tokens[np.minimum(offsets, self.tokens.shape[0] - 1)], -1)
        alive = np.ones(conts.shape[0], dtype=bool)
        out: list[int] = []
        for j in range(gamma):
            column = conts[alive, j]
            column = column[column >= 0]
            if not column.shape[0]:
                break
            values, counts = np.unique(column, return_counts=True)
            token = int(values[np.argmax(counts)])
            out.append(token)
            alive &= conts[:, j] == token
        return np.asarray(out, dtype=np.int64) if out else None

    def save(self, path: Path) -> None:
        """One safetensors file (tokens as uint16 when the ids fit, else int32)."""
        from safetensors.numpy import save_file

        dtype = np.uint16 if self.tokens.size == 0 or int(self.tokens.max()) < 2 ** 16 \
            else np.int32
        save_file({"tokens": self.tokens.astype(dtype), "starts": self.starts,
                   "first": self.first}, str(path))

    @classmethod
    def load(cls, path: Path) -> Datastore:
        from safetensors.numpy import load_file

        data = load_file(str(path))
        return cls(data["tokens"].astype(np.int64), data["starts"], data["first"])
