"""K candidate drafts per request from one drafter forward, merged into a chain-first trie.

Candidate 0 is the argmax draft, so self-selection never scores below K = 1; the others are
sampled independently per position from the drafter's marginals at T_d; with "ngram", candidate 1
comes from prompt lookup (matched as vLLM's `ngram` method does) when the context repeats; with
K = 1, a row with a lookup match drafts its continuation instead of the drafter's. The
point-mass rule never reads draft probabilities, so a candidate's source cannot affect
losslessness.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vllm_specdiff.core import draft_marginals, sample_drafts

# n-gram lengths matched against the context's suffix for the "ngram" candidate.
NGRAM_MIN, NGRAM_MAX = 2, 5


def candidate_drafts(logits: torch.Tensor, num_drafts: int, temperature: float,
                     top_k: int | None, generator: torch.Generator | None) -> torch.Tensor:
    """[B, K, G] drafts from drafter logits [B, G, V]: argmax first, then K - 1 samples."""
    argmax = logits.argmax(dim=-1).unsqueeze(1)
    if num_drafts == 1:
        return argmax
    marginals = draft_marginals(logits, temperature, top_k)
    sampled = sample_drafts(marginals, num_drafts - 1, generator=generator)
    return torch.cat([argmax, sampled], dim=1)


def lookup_continuation(context: np.ndarray, gamma: int) -> np.ndarray | None:
    """Prompt lookup, matched as vLLM's `ngram` method does: the longest suffix of the context
    (NGRAM_MIN..NGRAM_MAX tokens) that occurred earlier, at its earliest occurrence; the (at most
    gamma) tokens that followed it. None when nothing matches. One row of
    `lookup_continuations`."""
    return lookup_continuations([context], [gamma])[0]


def lookup_continuations(contexts: Sequence[np.ndarray], gammas: Sequence[int]
                         ) -> list[np.ndarray | None]:
    """`lookup_continuation` of every row at once (row r: at most gammas[r] tokens).

    It runs for every decode row of every step, so the rows are searched together: the
    contexts are laid out as one padded matrix and each of the NGRAM_MAX suffix tokens is
    compared with every position in one vectorised pass, giving per position the length of
    the match of the context's suffix that ends there (~0.2 ms for 16 rows of 60-400 tokens,
    against ~0.4 ms row by row). numpy, not vLLM's numba function: importing numba leaves an
    llvmlite object in sys.modules that breaks vLLM's kernel registration for every later
    engine in the process.
    """
    out: list[np.ndarray | None] = [None] * len(contexts)
    live = [r for r, context in enumerate(contexts) if len(context) > NGRAM_MIN]
    if not live:
        return out
    lengths = np.array([len(contexts[r]) for r in live])
    width = int(lengths.max())
    # left padding, so the shifted reads below stay inside the matrix; -1 is never a token
    grid = np.full((len(live), NGRAM_MAX + width), -1, dtype=np.int64)
    for k, r in enumerate(live):
        grid[k, NGRAM_MAX:NGRAM_MAX + lengths[k]] = contexts[r]
    # an earlier occurrence ends at position j < length - 1 (before the last token)
    ends = np.arange(width - 1)
    run = ends[None, :] < (lengths - 1)[:, None]
    matched = np.zeros(run.shape, dtype=np.int64)
    rows = np.arange(len(live))
    for i in range(NGRAM_MAX):
        # the suffix's i-th token from the end; -2 (never equal) past the context's start
        back = lengths - 1 - i
        suffix = np.where(back >= 0, grid[rows, NGRAM_MAX + np.maximum(back, 0)], -2)
        run &= grid[:, NGRAM_MAX - i:NGRAM_MAX - i + width - 1] == suffix[:, None]
        matched += run
    longest = matched.max(axis=1)
    for k, r in enumerate(live):
        n = int(longest[k])
        if n >= NGRAM_MIN:
            end = int(np.argmax(matched[k] >= n))  # the earliest occurrence of that length
            out[r] = np.array(contexts[r][end + 1:end + 1 + gammas[r]], dtype=np.int64)
    return out


def ngram_draft(context: np.ndarray, gamma: int, fill: torch.Tensor) -> torch.Tensor | None:
    """The "ngram" candidate: `lookup_continuation` padded to gamma with `fill` [G]; None when
    nothing matches."""
    found = lookup_continuation(context, gamma)
    if found is None:
        return None
    draft = fill.clone()
    draft[: found.shape[0]] = torch.from_numpy(found)
    return draft
