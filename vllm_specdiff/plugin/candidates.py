"""K candidate drafts per request from one drafter forward, merged into a chain-first trie.

Candidate 0 is the argmax draft, so self-selection never scores below K = 1; the others are
sampled independently per position from the drafter's marginals at T_d, and with "ngram" the last
one comes from prompt lookup (vLLM's own `ngram` matching) when the context repeats. The
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


def ngram_draft(context: np.ndarray, gamma: int, fill: torch.Tensor) -> torch.Tensor | None:
    """Prompt lookup: the tokens that followed the longest earlier match of the context's
    suffix (vLLM's `ngram` matching), padded with `fill` [G]; None when nothing matches."""
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens,
    )

    tokens = np.ascontiguousarray(context, dtype=np.int32)
    found = _find_longest_matched_ngram_and_propose_tokens(
        tokens, NGRAM_MIN, NGRAM_MAX, tokens.shape[0] + gamma, gamma)
    if len(found) == 0:
        return None
    draft = fill.clone()
    draft[: len(found)] = torch.from_numpy(np.asarray(found, dtype=np.int64))
    return draft
