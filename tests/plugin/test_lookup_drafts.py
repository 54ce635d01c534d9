"""K = 1 with `candidates: ["argmax", "ngram"]`: the proposer drafts by prompt lookup where the
context repeats.

A row whose context has a lookup match drafts the tokens that followed the match (at most its
draft length) and costs no drafter call; the other rows get the drafter's argmax draft; where
lookup finds nothing a datastore may draft instead. The engine runs are in tests/engine.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.plugin.test_options import _proposer


def test_repeating_rows_draft_the_lookup_and_skip_the_drafter(tiny_drafter):
    proposer = _proposer(tiny_drafter, 256, gamma=4, adaptive=False)  # lookup is on by default
    proposer.load_model(None)
    calls: list[int] = []
    draft_logits = proposer.drafter.draft_logits
    proposer.drafter.draft_logits = lambda ctx, n, **kw: calls.append(len(ctx)) or draft_logits(
        ctx, n, **kw)
    repeat = [7, 8, 9, 10, 11, 12, 7, 8, 9]  # suffix [7, 8, 9] occurred at the start
    tokens = np.zeros((2, 64), dtype=np.int64)
    tokens[0, :9] = repeat
    tokens[1, :9] = np.arange(20, 29)  # nothing repeats
    drafts = proposer.propose([[9], [28]], np.array([9, 9]), tokens)
    assert drafts[0] == [10, 11, 12, 7]  # the continuation of the match, gamma tokens
    assert len(drafts[1]) == 4  # the drafter's draft
    assert calls == [1]  # one drafter call, for the row without a match
    stats = proposer.get_stats()
    assert stats["lookup_drafts"] == 1 and stats["drafted_rows"] == 2


def test_without_ngram_every_row_asks_the_drafter(tiny_drafter):
    proposer = _proposer(tiny_drafter, 256, gamma=4, adaptive=False,
                         candidates=["argmax", "sample"])
    proposer.load_model(None)
    tokens = np.zeros((1, 64), dtype=np.int64)
    tokens[0, :9] = [7, 8, 9, 10, 11, 12, 7, 8, 9]
    proposer.propose([[9]], np.array([9]), tokens)
    assert proposer.get_stats()["lookup_drafts"] == 0


def _datastore(tmp_path, sequences):
    from vllm_specdiff.core.datastore import Datastore

    path = tmp_path / "datastore.safetensors"
    Datastore.from_sequences(sequences).save(path)
    return path


def test_a_datastore_drafts_where_lookup_finds_nothing(tiny_drafter, tmp_path):
    # the verifier once continued [.., 26, 27, 28] with [40, 41, 42, 43, 44]
    path = _datastore(tmp_path, [([1, 2, 26, 27, 28, 40, 41, 42, 43, 44], 5)])
    proposer = _proposer(tiny_drafter, 256, gamma=4, adaptive=False, datastore=str(path))
    proposer.load_model(None)
    calls: list[int] = []
    draft_logits = proposer.drafter.draft_logits
    proposer.drafter.draft_logits = lambda ctx, n, **kw: calls.append(len(ctx)) or draft_logits(
        ctx, n, **kw)
    tokens = np.zeros((3, 64), dtype=np.int64)
    tokens[0, :9] = [7, 8, 9, 10, 11, 12, 7, 8, 9]  # repeats: prompt lookup comes first
    tokens[1, :9] = np.arange(20, 29)  # no repeat; its suffix [26, 27, 28] is in the datastore
    tokens[2, :9] = np.arange(50, 59)  # neither: the drafter's draft
    drafts = proposer.propose([[9], [28], [58]], np.array([9, 9, 9]), tokens)
    assert drafts[0] == [10, 11, 12, 7]
    assert drafts[1] == [40, 41, 42, 43]
    assert len(drafts[2]) == 4 and calls == [1]
    stats = proposer.get_stats()
    assert stats["lookup_drafts"] == 2 and stats["datastore_drafts"] == 1


@pytest.mark.parametrize("options, error", [
    ({"datastore": "missing.safetensors"}, "no file"),
    ({"candidates": ["argmax", "sample"]}, r"\['num_drafts'\] = 1 and 'ngram'"),
])
def test_bad_datastore_options_are_named(tmp_path, options, error):
    from vllm_specdiff.plugin.config import parse_specdiff_config

    path = _datastore(tmp_path, [([1, 2, 3, 4], 1)])
    section = {"datastore": str(path), **options}
    if section["datastore"] == "missing.safetensors":
        section["datastore"] = str(tmp_path / "missing.safetensors")
    with pytest.raises((ValueError, FileNotFoundError), match=error) as info:
        parse_specdiff_config({"specdiff": section})
    assert "'datastore'" in str(info.value)


def test_a_datastore_of_another_vocabulary_fails_at_start(tiny_drafter, tmp_path):
    from vllm_specdiff.drafter import load_drafter

    vocab = load_drafter(str(tiny_drafter)).vocab_size
    path = _datastore(tmp_path, [([1, 2, vocab + 5, 3], 1)])
    with pytest.raises(ValueError, match="outside the verifier's vocabulary"):
        _proposer(tiny_drafter, 256, gamma=4, datastore=str(path))
