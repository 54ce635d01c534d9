"""Candidate drafts' prompt lookup (`core/candidates.py`): the continuation of the context's
longest repeated suffix, matched as vLLM's `ngram` method does, row by row and batched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_specdiff.core.candidates import lookup_continuation


def test_lookup_continuation_stops_at_gamma_and_at_the_context_end():
    context = np.array([1, 2, 3, 4, 5, 6, 9, 1, 2, 3])
    assert lookup_continuation(context, 2).tolist() == [4, 5]  # after [1, 2, 3], earliest
    assert lookup_continuation(context, 10).tolist() == [4, 5, 6, 9, 1, 2, 3]
    assert lookup_continuation(np.array([5, 6, 7, 5, 6]), 4).tolist() == [7, 5, 6]
    assert lookup_continuation(np.array([1, 2, 3, 4]), 3) is None


def _lookup_by_definition(context: list[int], gamma: int) -> list[int] | None:
    """The longest suffix of NGRAM_MIN..NGRAM_MAX tokens that occurs earlier (ending before the
    last token), at its earliest start: what followed it, written as plainly as possible."""
    from vllm_specdiff.core.candidates import NGRAM_MAX, NGRAM_MIN

    for n in range(min(NGRAM_MAX, len(context) - 1), NGRAM_MIN - 1, -1):
        for start in range(len(context) - n):
            if context[start:start + n] == context[len(context) - n:]:
                return context[start + n:start + n + gamma]
    return None


def test_lookup_continuation_agrees_with_its_definition_on_random_contexts():
    rng = np.random.default_rng(0)
    matched = 0
    for _ in range(3000):
        context = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(0, 40))).tolist()
        found = lookup_continuation(np.array(context, dtype=np.int32), 4)
        expected = _lookup_by_definition(context, 4)
        assert (None if found is None else found.tolist()) == expected, context
        matched += expected is not None
    assert 1000 < matched < 3000  # both outcomes are exercised


def test_lookup_of_a_batch_agrees_with_each_row_alone():
    """Rows of different lengths searched together (one padded matrix) find what each finds
    alone: padding never matches, nor does a short row's missing suffix."""
    from vllm_specdiff.core.candidates import lookup_continuations

    rng = np.random.default_rng(1)
    matched = 0
    for _ in range(300):
        rows = int(rng.integers(1, 9))
        contexts = [rng.integers(0, int(rng.integers(2, 5)), int(rng.integers(0, 30))).tolist()
                    for _ in range(rows)]
        gammas = [int(rng.integers(1, 6)) for _ in range(rows)]
        found = lookup_continuations([np.array(c, dtype=np.int32) for c in contexts], gammas)
        for context, gamma, row in zip(contexts, gammas, found, strict=True):
            expected = _lookup_by_definition(context, gamma)
            assert (None if row is None else row.tolist()) == expected, (contexts, context)
            matched += expected is not None
    assert matched > 300


def test_ngram_candidate_continues_the_earlier_match():
    import numpy as np

    from vllm_specdiff.core.candidates import ngram_draft

    fill = torch.tensor([9, 9, 9])
    context = np.array([1, 2, 3, 4, 5, 1, 2, 3])
    assert ngram_draft(context, 3, fill).tolist() == [4, 5, 1]
    assert ngram_draft(np.array([7, 8, 1, 2, 3, 4, 1, 2]), 3, fill).tolist() == [3, 4, 1]
    assert ngram_draft(np.array([1, 2, 3, 4]), 3, fill) is None


@pytest.mark.vllm
def test_ngram_candidate_matches_vllms_own_prompt_lookup():
    """Same matches as vLLM's numba function (in a subprocess: importing numba breaks vLLM's
    kernel registration for later engines in this process)."""
    import subprocess
    import sys

    code = """
import numpy as np, torch
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens
from vllm_specdiff.core.candidates import NGRAM_MAX, NGRAM_MIN, ngram_draft
rng = np.random.default_rng(0)
found = 0
for trial in range(300):
    ctx = rng.integers(0, 4, size=int(rng.integers(3, 40)))
    ref = _find_longest_matched_ngram_and_propose_tokens(ctx.astype(np.int32), NGRAM_MIN,
                                                         NGRAM_MAX, len(ctx) + 4, 4)
    ours = ngram_draft(ctx, 4, torch.full((4,), -1))
    if len(ref) == 0:
        assert ours is None, (ctx, ours)
        continue
    found += 1
    assert ours[: len(ref)].tolist() == list(ref), (ctx, ref, ours)
print(found)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.strip().splitlines()[-1]) > 100
