"""The block-causal KV pool's bounds: a byte budget next to the entry count, eviction that keeps
the rows being drafted, and a context window that the cache can follow.

Every cached result is compared with a drafter that has no cache (same window), to 1e-5.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vllm_specdiff.drafter import BlockCausalDrafter, load_drafter
from vllm_specdiff.drafter.kv_pool import DEFAULT_CACHE_BYTES, KVEntry, KVLayout, KVPool
from vllm_specdiff.plugin.config import parse_specdiff_config

from .checkpoints import write_causal_lm

VOCAB = 96
POSITIONS = 1024  # long contexts: the checkpoint's own 64 positions are raised (RoPE is computed)
GAMMA = 4


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("base_long")
    write_causal_lm(path, arch="llama", vocab=VOCAB)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = POSITIONS
    (path / "config.json").write_text(json.dumps(config))
    return path


def _drafter(base_dir, **kwargs) -> BlockCausalDrafter:
    return BlockCausalDrafter.from_causal_lm(base_dir, num_layers=2, **kwargs)


def _bytes_per_token(drafter: BlockCausalDrafter) -> int:
    """K and V of every layer for one token, plus its int64 id."""
    cfg = drafter.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 2 * len(drafter.model.layers) * cfg.num_key_value_heads * head_dim * 4 + 8


def _tokens(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=gen)


def _commit(seq: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One verify step: accept 1-3 tokens (rejected drafts never entered the context)."""
    return torch.cat([seq, _tokens(gen, int(torch.randint(1, 4, (1,), generator=gen)))])


# ---- byte budget ---------------------------------------------------------------------------------
def test_many_long_requests_stay_under_the_byte_budget(base_dir):
    """20 requests of 200-350 tokens, 4 running at a time, 5 steps each: after every step the
    pool holds at most `cache_bytes`, drafts equal the uncached drafter, and the running rows
    still hit. Without the byte budget the same run holds several times the budget."""
    budget = 5 * 350 * _bytes_per_token(_drafter(base_dir, cache_size=0))  # ~4 long entries
    cached = _drafter(base_dir, cache_size=64, cache_bytes=budget)
    unbounded = _drafter(base_dir, cache_size=64, cache_bytes=1 << 40)
    full = _drafter(base_dir, cache_size=0)
    gen = torch.Generator().manual_seed(0)
    for _wave in range(5):
        seqs = [_tokens(gen, int(torch.randint(200, 350, (1,), generator=gen)))
                for _ in range(4)]
        for _step in range(5):
            expected = full.draft_logits(seqs, GAMMA)
            torch.testing.assert_close(cached.draft_logits(seqs, GAMMA), expected,
                                       atol=1e-5, rtol=0)
            unbounded.draft_logits(seqs, GAMMA)
            assert cached.cache_stats()["bytes"] <= budget
            seqs = [_commit(s, gen) for s in seqs]
    stats = cached.cache_stats()
    assert stats["max_bytes"] == budget
    # entries hold >= 264 tokens (200 + headroom), so at most 6 of the 20 fit: finished
    # requests were dropped for the running ones
    assert stats["entries"] <= 6 and stats["evictions"] >= 14
    assert stats["hit_tokens"] > 3 * stats["miss_tokens"]  # running rows kept their entries
    assert unbounded.cache_stats()["bytes"] > 3 * budget  # what the budget prevented


def test_rows_beyond_the_budget_are_re_encoded_without_thrashing(base_dir):
    """Four running rows, a budget for two: the two oldest entries are kept every step (they
    hit), the other two rows are re-encoded; evicting in LRU order would lose all four."""
    cached = _drafter(base_dir, cache_size=64,
                      cache_bytes=2 * 400 * _bytes_per_token(_drafter(base_dir, cache_size=0)))
    full = _drafter(base_dir, cache_size=0)
    gen = torch.Generator().manual_seed(1)
    seqs = [_tokens(gen, 250) for _ in range(4)]
    hits = []
    for _step in range(8):
        before = cached.cache_stats()["hit_tokens"]
        torch.testing.assert_close(cached.draft_logits(seqs, GAMMA), full.draft_logits(seqs, GAMMA),
                                   atol=1e-5, rtol=0)
        hits.append(cached.cache_stats()["hit_tokens"] - before)
        assert cached.cache_stats()["bytes"] <= cached.pool.max_bytes
        seqs = [_commit(s, gen) for s in seqs]
    assert cached.cache_stats()["entries"] == 2
    assert all(h >= 2 * 250 for h in hits[1:])  # two rows served from the cache every step


def _entry(pool: KVPool, n: int) -> int:
    entry = KVEntry(tokens=np.zeros(0, dtype=np.int64))
    entry.reserve(n, KVLayout(1, 1, 2, torch.float32, torch.device("cpu")), max_capacity=n)
    entry.commit(np.arange(n))
    return pool.add(entry)


def test_eviction_order_idle_first_then_newest_of_the_step():
    pool = KVPool(max_entries=8, max_bytes=1 << 30)
    old, mid, new = _entry(pool, 10), _entry(pool, 10), _entry(pool, 10)
    size = pool.entries[old].storage_bytes
    assert pool.nbytes() == 3 * size
    pool.touch(old)  # LRU order is now mid, new, old
    pool.max_bytes = 2 * size
    pool.evict(in_use={old, new})
    assert mid not in pool.entries
    assert list(pool.entries) == [new, old]  # idle `mid` goes first, though `old` is older
    pool.max_bytes = size
    pool.evict(in_use={old, new})
    assert list(pool.entries) == [old]  # the step's own entries: newest first
    pool.max_bytes = 1
    pool.evict(in_use={old})
    assert pool.entries == {} and pool.evictions == 3  # a bound is a bound


def test_entry_storage_stops_at_the_longest_context(base_dir):
    """Headroom never allocates past the drafter's positions (or its window)."""
    drafter = _drafter(base_dir, cache_size=4)
    seq = _tokens(torch.Generator().manual_seed(2), POSITIONS - GAMMA)
    drafter.draft_logits([seq[:900]], GAMMA)
    drafter.draft_logits([seq], GAMMA)
    (entry,) = drafter.pool.entries.values()
    assert entry.capacity == POSITIONS
    assert drafter.cache_stats()["bytes"] == POSITIONS * _bytes_per_token(drafter)


def test_cache_bytes_option_and_load_path(base_dir, tmp_path):
    assert parse_specdiff_config({"specdiff": {"cache_bytes": 4096}}).cache_bytes == 4096
    assert parse_specdiff_config(None).cache_bytes is None
    for bad in (0, -1, "1GiB", True, 1.5):
        with pytest.raises(ValueError, match="cache_bytes"):
            parse_specdiff_config({"specdiff": {"cache_bytes": bad}})
    with pytest.raises(ValueError, match="cache_bytes"):
        KVPool(4, max_bytes=0)
    _drafter(base_dir).save_pretrained(tmp_path)
    assert load_drafter(tmp_path).pool.max_bytes == DEFAULT_CACHE_BYTES
    drafter = load_drafter(tmp_path, cache_bytes=12345)
    assert drafter.pool.max_bytes == drafter.cache_stats()["max_bytes"] == 12345


# ---- context window ------------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "start"), [(20, 0), (32, 0), (33, 16), (48, 16), (49, 32),
                                          (50, 32), (64, 32), (65, 48)])
def test_window_starts_at_multiples_of_half_the_window(base_dir, n, start):
    """W = 32: the drafter sees context[start:], 17..32 tokens at positions from 0, exactly
    what a window-less drafter computes on that slice."""
    windowed = _drafter(base_dir, cache_size=0, context_window=32)
    plain = _drafter(base_dir, cache_size=0)
    assert windowed.window_stride() == 16
    ctx = _tokens(torch.Generator().manual_seed(n), n)
    (seen,) = windowed.prepare_contexts([ctx], GAMMA)
    assert torch.equal(seen, ctx[start:])
    torch.testing.assert_close(windowed.draft_logits([ctx], GAMMA),
                               plain.draft_logits([ctx[start:]], GAMMA), atol=1e-5, rtol=0)


def test_window_keeps_the_cache_hitting(base_dir):
    """Three rows grow past a 64-token window for 30 steps (with rollbacks of rejected drafts
    and one preempted step): cached logits equal the uncached windowed drafter, and most context
    tokens come from the cache. A window sliding one token per step never hit (0 hit tokens),
    re-encoding the whole window every step."""
    window = 64
    cached = _drafter(base_dir, cache_size=8, context_window=window)
    full = _drafter(base_dir, cache_size=0, context_window=window)
    gen = torch.Generator().manual_seed(3)
    seqs = [_tokens(gen, n) for n in (10, 70, 130)]
    committed = 0
    for step in range(30):
        batch = seqs if step != 17 else seqs[1:]
        torch.testing.assert_close(cached.draft_logits(batch, GAMMA),
                                   full.draft_logits(batch, GAMMA), atol=1e-5, rtol=0)
        grown = [_commit(s, gen) for s in seqs]
        committed += sum(g.numel() - s.numel() for g, s in zip(grown, seqs, strict=True))
        seqs = grown
    stats = cached.cache_stats()
    assert stats["hit_tokens"] > 4 * stats["miss_tokens"]
    # encoded: the 3 first windows, ~1 token per committed token (the stride's re-encodes),
    # plus the recomputed last token of each row and step
    assert stats["miss_tokens"] <= 3 * window + 2 * committed + 3 * 30
    # storage: the window plus the draft block's scratch
    assert max(e.capacity for e in cached.pool.entries.values()) <= window + GAMMA


def test_cache_follows_a_cast_drafter(base_dir):
    """Entries cached in float32 are converted when the drafter is cast to bfloat16 (attention
    needs one dtype): drafting goes on and agrees with a drafter cast before any caching."""
    cached = _drafter(base_dir, cache_size=4)
    seq = _tokens(torch.Generator().manual_seed(4), 30)
    cached.draft_logits([seq], GAMMA)
    fresh = _drafter(base_dir, cache_size=0)
    for drafter in (cached, fresh):
        drafter.to(torch.bfloat16)
        drafter.model.reset_rotary()
    longer = torch.cat([seq, torch.tensor([3, 5])])
    got = cached.draft_logits([longer], GAMMA)
    assert cached.cache_stats()["hit_tokens"] == 30
    (entry,) = cached.pool.entries.values()
    assert entry.kv.dtype == torch.bfloat16
    torch.testing.assert_close(got, fresh.draft_logits([longer], GAMMA), atol=0.2, rtol=0.05)
