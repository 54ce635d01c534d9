"""What the proposer knows of a batch row within one step and what it leaves for the next.

vLLM's rows carry no request ids and are reordered, preempted and finished between steps, so a
row is recognised by its context (`signature`): the length plus its last tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Tokens of context that identify a row between two steps (with its length) when counting how
# many drafts were accepted; a collision of two different rows only swaps their entries.
SIGNATURE_TOKENS = 8


@dataclass(frozen=True)
class Row:
    """A row that just sampled tokens: batch index, committed context (a view of vLLM's token
    array, read only during the step), the most draft tokens that fit (position limits), the
    context length the drafter last encoded for it, and the context length when the request
    was first seen (its output tokens since: its progress)."""

    index: int
    context: np.ndarray
    room: int
    drafted_upto: int
    start: int


@dataclass(frozen=True)
class Pending:
    """What one step left for the next: the row's draft length (accepted counts are out of
    it), the draft tokens the verifier got (a trie's nodes for K > 1), `drafted_upto` and
    `start`."""

    depth: int
    tokens: int
    drafted_upto: int
    start: int
    lookup: bool = False  # the draft was a prompt-lookup continuation


def signature(context: np.ndarray) -> tuple[int, bytes]:
    """The key a row's pending entry is kept under: its length and its last tokens."""
    tail = np.asarray(context[-SIGNATURE_TOKENS:], dtype=np.int64)
    return int(context.shape[0]), tail.tobytes()
