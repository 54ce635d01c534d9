"""K = 1 with `candidates: ["argmax", "ngram"]`: prompt lookup where the context repeats.

A row whose context has a lookup match drafts the tokens that followed the match (at most its
draft length) and costs no drafter call; the other rows get the drafter's argmax draft. Only the
drafts change, so greedy output stays identical to plain decoding.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.vllm.test_options import _proposer
from tests.vllm.tiny_models import speculative_args, word, word_prompt
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


@pytest.mark.vllm
def test_lookup_drafts_keep_greedy_output_identical(tiny_verifier, tiny_drafter):
    import gc

    from vllm import LLM, SamplingParams

    from vllm_specdiff.plugin.engine import specdiff_stats

    kwargs = dict(model=str(tiny_verifier), max_model_len=256, max_num_seqs=4, seed=0,
                  kv_cache_memory_bytes=200_000, dtype="float32", enforce_eager=True)
    # repeating prompts give lookup matches; the others leave rows to the drafter
    prompts = [" ".join(word(j % 3) for j in range(12)) if i % 2 else word_prompt(i, 12)
               for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(**kwargs)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    del plain
    gc.collect()
    spec = LLM(**kwargs, **speculative_args(tiny_drafter, gamma=4, adaptive=False,
                                            candidates=["argmax", "ngram"]))
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    stats = specdiff_stats(spec)["proposer"]
    del spec
    gc.collect()
    assert got == expected
    assert 0 < stats["lookup_drafts"] < stats["drafted_rows"]  # both sources drafted


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
    ({"candidates": ["argmax", "sample"]}, "needs K = 1 and 'ngram'"),
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


@pytest.mark.vllm
def test_datastore_drafts_keep_greedy_output_identical(tiny_verifier, tiny_drafter, tmp_path):
    import gc

    from vllm import LLM, SamplingParams

    from vllm_specdiff.plugin.engine import specdiff_stats

    kwargs = dict(model=str(tiny_verifier), max_model_len=256, max_num_seqs=4, seed=0,
                  kv_cache_memory_bytes=200_000, dtype="float32", enforce_eager=True)
    prompts = [word_prompt(i, 12) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(**kwargs)
    outputs = plain.generate(prompts, params, use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in outputs]
    # the datastore: the verifier's own continuations of half the prompts, so the others'
    # drafts come from it wherever their suffixes recur, right or wrong
    path = _datastore(tmp_path, [(list(o.prompt_token_ids) + list(o.outputs[0].token_ids),
                                  len(o.prompt_token_ids)) for o in outputs[:2]])
    del plain
    gc.collect()
    spec = LLM(**kwargs, **speculative_args(tiny_drafter, gamma=4, adaptive=False,
                                            datastore=str(path)))
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    stats = specdiff_stats(spec)["proposer"]
    del spec
    gc.collect()
    assert got == expected
    assert stats["datastore_drafts"] > 0  # retrieval drafted, and verification decided
