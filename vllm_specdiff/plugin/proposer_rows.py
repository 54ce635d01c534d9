"""What the proposer knows of a batch row within one step and what it leaves for the next:
the first and last of `propose`'s five steps (`match_rows`, `remember`).

vLLM's rows carry no request ids and are reordered, preempted and finished between steps, so a
row is recognised by its context (`signature`): the length plus its last tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

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


@dataclass
class StepRows:
    """What the verifier step that just ran left: the rows to draft for, the accepted counts
    of the drafts it verified (out of each draft's length, and whether it was a lookup's), the
    verifier tokens it ran (None: it also prefilled) and the rows that arrived and departed."""

    decoded: list[Row] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    from_lookup: list[bool] = field(default_factory=list)
    verified: int | None = 0
    arrived: int = 0
    departed: int = 0


PendingRows = dict[tuple[int, bytes], list[Pending]]  # per context signature, one per row


def match_rows(pending: PendingRows, sampled_token_ids: list[list[int]],
               num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
               room: Callable[[int], int]) -> StepRows:
    """Step 1 of `propose`: each row that sampled tokens, matched to what the last step left
    for it (rows with identical contexts, e.g. greedy n > 1, each keep theirs); `pending` is
    emptied (rows not seen this step finished or were preempted). `room(n)`: the most draft
    tokens after a context of n tokens."""
    step = StepRows()
    for i, sampled in enumerate(sampled_token_ids):
        if not sampled:
            step.verified = None  # partial prefill chunk or discarded request: nothing to extend
            continue
        n = int(num_tokens_no_spec[i])
        context = token_ids_cpu[i, :n]
        same = pending.get(signature(context[: n - len(sampled)]))
        prev = same.pop() if same else None
        if prev is None:
            step.verified = None  # a new or resumed request: this step ran its prefill
            step.arrived += 1
        else:
            step.verified = None if step.verified is None else step.verified + 1 + prev.tokens
            if prev.depth:
                step.accepted.append(min(len(sampled) - 1, prev.depth))
                step.depths.append(prev.depth)
                step.from_lookup.append(prev.lookup)
        step.decoded.append(Row(i, np.asarray(context), max(room(n), 0),
                                0 if prev is None else prev.drafted_upto,
                                n if prev is None else prev.start))
    step.departed = sum(len(left) for left in pending.values())
    pending.clear()
    return step


def remember(pending: PendingRows, decoded: list[Row], lengths: list[int],
             drafts: list[list[int]], drafter_rows: set[int], by_lookup: set[int]) -> None:
    """Step 5 of `propose`: what each row's draft leaves for the next step."""
    for row, length in zip(decoded, lengths, strict=True):
        n = int(row.context.shape[0])
        # a lookup draft may be shorter than its length; a trie has more nodes than depth
        depth = min(length, len(drafts[row.index]))
        pending.setdefault(signature(row.context), []).append(Pending(
            depth, len(drafts[row.index]),
            n if row.index in drafter_rows else row.drafted_upto, row.start,
            lookup=row.index in by_lookup))
