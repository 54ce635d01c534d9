"""K candidate drafts per request from one drafter forward, merged into a chain-first trie.

Candidate 0 is the argmax draft, so self-selection never scores below K = 1; the others are
sampled independently per position from the drafter's marginals at T_d; with "ngram", candidate 1
comes from prompt lookup (matched as vLLM's `ngram` method does) when the context repeats; with
K = 1, a row with a lookup match drafts its continuation instead of the drafter's. The
point-mass rule never reads draft probabilities, so a candidate's source cannot affect
losslessness.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_specdiff.core import draft_marginals, sample_drafts

# n-gram lengths matched against the context's suffix for the "ngram" candidate.
NGRAM_MIN, NGRAM_MAX = 2, 5


def candidate_drafts(logits: torch.Tensor, num_candidates: int, temperature: float,
                     top_k: int | None, generator: torch.Generator | None) -> torch.Tensor:
    """[B, K, G] drafts from drafter logits [B, G, V]: argmax first, then K - 1 samples."""
    argmax = logits.argmax(dim=-1).unsqueeze(1)
    if num_candidates == 1:
        return argmax
    marginals = draft_marginals(logits, temperature, top_k)
    sampled = sample_drafts(marginals, num_candidates - 1, generator=generator)
    return torch.cat([argmax, sampled], dim=1)


def lookup_continuation(context: np.ndarray, gamma: int) -> np.ndarray | None:
    """Prompt lookup, matched as vLLM's `ngram` method does: the longest suffix of the context
    (NGRAM_MIN..NGRAM_MAX tokens) that occurred earlier, at its earliest occurrence; the (at most
    gamma) tokens that followed it. None when nothing matches.

    Every earlier occurrence of the last token is found in one pass and only those are checked
    against the longer suffix, so a row costs about one comparison per context token (it runs
    for every row of every step, and a sliding-window search per n-gram length cost ~0.1 ms a
    row: 2 ms of a batch-16 step). numpy, not vLLM's numba function: importing numba leaves an
    llvmlite object in sys.modules that breaks vLLM's kernel registration for every later
    engine in the process.
    """
    tokens = np.asarray(context, dtype=np.int64)
    length = tokens.shape[0]
    if length <= NGRAM_MIN:
        return None
    # where an earlier n-gram would end: an occurrence of the last token before the last token
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    for n in range(min(NGRAM_MAX, length - 1), NGRAM_MIN - 1, -1):
        starts = ends[ends >= n - 1] - (n - 1)
        for k in range(n - 1):  # the last token already matches
            if not starts.size:
                break
            starts = starts[tokens[starts + k] == tokens[length - n + k]]
        if starts.size:
            start = int(starts[0]) + n
            return tokens[start:start + gamma].copy()
    return None


def ngram_draft(context: np.ndarray, gamma: int, fill: torch.Tensor) -> torch.Tensor | None:
    """The "ngram" candidate: `lookup_continuation` padded to gamma with `fill` [G]; None when
    nothing matches."""
    found = lookup_continuation(context, gamma)
    if found is None:
        return None
    draft = fill.clone()
    draft[: found.shape[0]] = torch.from_numpy(found)
    return draft
