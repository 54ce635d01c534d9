"""Retrieval drafts (`vllm_specdiff.core.datastore`): the index finds exactly the occurrences a
brute-force scan finds, the draft is the token-by-token majority of their continuations, no
continuation runs into the next sequence, prompts are never drafted from, and a saved datastore
loads back the same."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from vllm_specdiff.core import datastore as ds
from vllm_specdiff.core.datastore import Datastore


def brute_force_matches(sequences: list[tuple[list[int], int]], context: list[int]
                        ) -> list[list[int]]:
    """The continuations (rest of the sequence) after every occurrence of the longest suffix
    of context that ends right before a continuation token, scanning everything."""
    for n in ds.ORDERS:
        if len(context) < n:
            continue
        suffix = context[-n:]
        found = []
        for tokens, prompt_len in sequences:
            for i in range(max(prompt_len, n), len(tokens)):
                if i - n >= prompt_len - ds.LEAD and tokens[i - n:i] == suffix:
                    found.append(tokens[i:])
        if found:
            return found[: ds.MAX_MATCHES]
    return []


def majority_draft(continuations: list[list[int]], gamma: int) -> list[int]:
    out: list[int] = []
    for j in range(gamma):
        votes = Counter(c[j] for c in continuations if len(c) > j and c[:j] == out)
        if not votes:
            break
        best = max(votes.values())
        out.append(min(t for t, v in votes.items() if v == best))
    return out


def random_sequences(rng: np.random.Generator, count: int, vocab: int
                     ) -> list[tuple[list[int], int]]:
    out = []
    for _ in range(count):
        prompt_len = int(rng.integers(0, 8))
        length = prompt_len + int(rng.integers(0, 30))
        out.append((rng.integers(0, vocab, length).tolist(), prompt_len))
    return out


def test_matches_and_drafts_equal_a_brute_force_scan():
    rng = np.random.default_rng(0)
    sequences = random_sequences(rng, 60, vocab=5)  # a small vocabulary: many repeats
    store = Datastore.from_sequences(sequences)
    checked = drafted = 0
    for _ in range(300):
        context = rng.integers(0, 5, int(rng.integers(1, 9))).tolist()
        expected = majority_draft(brute_force_matches(sequences, context), 6)
        got = store.draft(np.asarray(context), 6)
        assert (got.tolist() if got is not None else []) == expected, context
        checked += 1
        drafted += bool(expected)
    assert drafted > 100  # the check saw real drafts, not only misses


def test_a_continuation_stops_at_its_sequence_end_and_prompts_are_not_drafted():
    # "7 8" occurs at the very end of the first continuation and inside a prompt: neither may
    # draft; its occurrence in the second continuation drafts what followed it there
    sequences = [([1, 2, 3, 7, 8], 2), ([7, 8, 9, 9, 5, 7, 8, 4, 6], 5)]
    store = Datastore.from_sequences(sequences)
    assert store.draft(np.asarray([0, 7, 8]), 4).tolist() == [4, 6]
    # a key may hold the prompt's last tokens, but a draft holds continuation tokens only
    assert store.draft(np.asarray([9, 5]), 3).tolist() == [7, 8, 4]
    assert store.draft(np.asarray([9, 9]), 3) is None  # what followed is the prompt's 5
    assert store.draft(np.asarray([6]), 3) is None  # order 1 is not matched
    assert len(store) == 3 + 4  # continuation tokens: [3, 7, 8] and [7, 8, 4, 6]


def test_a_hash_collision_is_not_a_match(monkeypatch: pytest.MonkeyPatch):
    # every window hashes alike: only the token check can tell the n-grams apart
    monkeypatch.setattr(ds, "_hash_windows",
                        lambda tokens, n: np.zeros(max(tokens.shape[0] - n + 1, 0), np.uint64))
    store = Datastore.from_sequences([([1, 2, 3, 4, 5, 6], 0)])
    assert store.draft(np.asarray([3, 4]), 2).tolist() == [5, 6]
    assert store.draft(np.asarray([4, 3]), 2) is None


def test_save_and_load_give_the_same_drafts(tmp_path):
    rng = np.random.default_rng(1)
    store = Datastore.from_sequences(random_sequences(rng, 30, vocab=7))
    store.save(tmp_path / "datastore.safetensors")
    loaded = Datastore.load(tmp_path / "datastore.safetensors")
    for _ in range(100):
        context = rng.integers(0, 7, 5)
        a, b = store.draft(context, 8), loaded.draft(context, 8)
        assert (a is None and b is None) or a.tolist() == b.tolist()


def test_inconsistent_offsets_are_refused():
    with pytest.raises(ValueError, match="starts"):
        Datastore(np.arange(5), np.asarray([0, 3]), np.asarray([0, 1]))
