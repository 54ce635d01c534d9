"""Cutting training windows `(s, x_1..x_gamma)` out of verifier sequences.

Any prefix `s` of a verifier sequence that ends inside the generated part is a valid context, and
the next gamma generated tokens are its targets. Several windows are packed per sequence because
the block-causal drafter encodes the shared context once for all of them (`window_logits`).
Batches are a pure function of (seed, step, rank), so a resumed run sees exactly the batches the
uninterrupted run would have seen, without saving any iterator state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_specdiff.drafter.vocab import verifier_to_draft

from .data import SequenceData
from .losses import Targets


@dataclass
class WindowBatch:
    """B sequences with M window starts each; windows with valid=False are padding (no loss)."""

    input_ids: torch.Tensor  # [B, L] long; only input_ids[b, :starts[b, m]] is context
    starts: torch.Tensor  # [B, M] long
    valid: torch.Tensor  # [B, M] bool
    tokens: torch.Tensor  # [B, M, G] verifier ids of x_1..x_G
    topk_ids: torch.Tensor | None = None  # [B, M, G, k] verifier ids
    topk_logprobs: torch.Tensor | None = None  # [B, M, G, k]
    features: torch.Tensor | None = None  # [B, L, F] verifier features of input_ids

    @property
    def num_windows(self) -> int:
        return int(self.valid.sum())

    def targets(self, vocab: VocabMap) -> Targets:
        """The valid windows' targets, flattened to [N, ...] and mapped to drafter ids."""
        v = self.valid
        return Targets(
            tokens=vocab.to_draft(self.tokens[v]),
            topk_ids=None if self.topk_ids is None else vocab.to_draft(self.topk_ids[v]),
            topk_logprobs=None if self.topk_logprobs is None else self.topk_logprobs[v])


class VocabMap:
    """Verifier id -> drafter head id (-1 where a reduced head does not cover the id)."""

    def __init__(self, verifier_vocab_size: int, draft_to_verifier: torch.Tensor | None = None
                 ) -> None:
        self.verifier_vocab_size = verifier_vocab_size
        self.draft_to_verifier = draft_to_verifier
        if draft_to_verifier is None:
            self.t2d = torch.arange(verifier_vocab_size)
        else:
            d2t = draft_to_verifier.long().cpu()
            if int(d2t.max()) >= verifier_vocab_size or int(d2t.min()) < 0:
                raise ValueError("draft_to_verifier holds ids outside the verifier vocabulary")
            self.t2d = verifier_to_draft(d2t, verifier_vocab_size)

    def to_draft(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.long()
        if ids.numel() and (int(ids.max()) >= self.verifier_vocab_size or int(ids.min()) < 0):
            raise ValueError(
                f"the data holds token id {int(ids.max())}, outside the drafter's verifier "
                f"vocabulary of {self.verifier_vocab_size}: was it made with another tokenizer?")
        return self.t2d.to(ids.device)[ids]

    def coverage(self, ids: torch.Tensor) -> float:
        """Fraction of the given verifier tokens the drafter head can propose."""
        return float((self.to_draft(ids) >= 0).float().mean()) if ids.numel() else 1.0


def valid_starts(data: SequenceData, i: int, gamma: int, min_context: int = 1,
                 max_length: int | None = None) -> range:
    """Window starts s of sequence i: s >= prompt length, and s + gamma tokens exist (and fit)."""
    end = data.length(i) - gamma
    if max_length is not None:
        end = min(end, max_length - gamma)
    return range(max(int(data.prompt_lens[i]), min_context, 1), end + 1)


def eligible_sequences(data: SequenceData, gamma: int, min_context: int = 1,
                       max_length: int | None = None) -> list[int]:
    return [i for i in range(len(data))
            if len(valid_starts(data, i, gamma, min_context, max_length)) > 0]


def make_batch(data: SequenceData, seq_ids: list[int], starts: list[list[int]], gamma: int,
               soft: bool = False, lookahead: int = 0) -> WindowBatch:
    """Assemble a padded batch from explicit (sequence, starts) choices. input_ids holds the
    tokens before the last start plus `lookahead` more (a causal LM reads its targets' prefixes:
    gamma - 1; the diffusion drafters see only the context: 0)."""
    if not 0 <= lookahead < gamma:
        raise ValueError(f"lookahead must be in [0, gamma), got {lookahead}")
    m = max(len(s) for s in starts)
    b = len(seq_ids)
    length = max(max(s) for s in starts) + lookahead
    input_ids = torch.zeros(b, length, dtype=torch.long)
    start_t = torch.zeros(b, m, dtype=torch.long)
    valid = torch.zeros(b, m, dtype=torch.bool)
    tokens = torch.zeros(b, m, gamma, dtype=torch.long)
    k = data.topk_ids.shape[1] if soft and data.topk_ids is not None else 0
    topk_ids = torch.zeros(b, m, gamma, k, dtype=torch.long) if soft else None
    topk_lps = torch.full((b, m, gamma, k), float("-inf")) if soft else None
    feats = None
    if data.features is not None:
        feats = torch.zeros(b, length, data.features.shape[1], dtype=data.features.dtype)
    for row, (i, ss) in enumerate(zip(seq_ids, starts, strict=True)):
        seq = data.sequence(i)
        n = min(length, seq.numel())
        input_ids[row, :n] = seq[:n]
        if feats is not None:
            lo = int(data.seq_offsets[i])
            feats[row, :n] = data.features[lo:lo + n]
        plen = int(data.prompt_lens[i])
        if soft:
            ids, lps = data.soft_targets(i)
        for col in range(m):
            s = ss[col] if col < len(ss) else ss[0]  # padding repeats a real window, masked out
            start_t[row, col] = s
            valid[row, col] = col < len(ss)
            tokens[row, col] = seq[s:s + gamma]
            if soft:
                topk_ids[row, col] = ids[s - plen:s - plen + gamma]
                topk_lps[row, col] = lps[s - plen:s - plen + gamma]
    return WindowBatch(input_ids, start_t, valid, tokens, topk_ids, topk_lps, feats)


def sample_batch(data: SequenceData, eligible: list[int], batch_size: int, windows_per_seq: int,
                 gamma: int, generator: torch.Generator, soft: bool = False,
                 min_context: int = 1, max_length: int | None = None,
                 lookahead: int = 0) -> WindowBatch:
    """Random sequences (without replacement) and random distinct starts within each."""
    if not eligible:
        raise ValueError(f"no sequence has a full window of gamma={gamma} generated tokens; "
                         f"generate longer continuations or lower --gamma")
    pick = torch.randperm(len(eligible), generator=generator)[:batch_size].tolist()
    seq_ids = [eligible[p] for p in pick]
    starts = []
    for i in seq_ids:
        rng = valid_starts(data, i, gamma, min_context, max_length)
        chosen = torch.randperm(len(rng), generator=generator)[:windows_per_seq]
        starts.append(sorted(rng[c] for c in chosen.tolist()))
    return make_batch(data, seq_ids, starts, gamma, soft, lookahead)


def batch_generator(seed: int, step: int, rank: int = 0) -> torch.Generator:
    """The generator that draws batch `step` on `rank`: deterministic, so resume is exact."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1009 + rank)


def eval_windows(data: SequenceData, gamma: int, windows_per_seq: int, max_windows: int,
                 min_context: int = 1, max_length: int | None = None, seed: int = 0
                 ) -> list[tuple[int, list[int]]]:
    """A fixed set of held-out (sequence, starts), evenly spaced inside each sequence."""
    out, total = [], 0
    gen = torch.Generator().manual_seed(seed)
    for i in eligible_sequences(data, gamma, min_context, max_length):
        rng = valid_starts(data, i, gamma, min_context, max_length)
        count = min(windows_per_seq, len(rng), max_windows - total)
        if count <= 0:
            break
        offset = int(torch.randint(0, max(1, len(rng) // count), (1,), generator=gen))
        step = len(rng) / count
        out.append((i, sorted({rng[min(len(rng) - 1, offset + int(c * step))]
                               for c in range(count)})))
        total += len(out[-1][1])
    if not out:
        raise ValueError(f"no held-out window of gamma={gamma}: use more prompts, a larger "
                         f"--heldout-fraction, longer continuations or a smaller --gamma")
    return out
