"""Block-causal drafter: exact incremental KV cache, packed training windows, save/load."""

from __future__ import annotations

import pytest
import torch

from vllm_specdiff.drafter import BlockCausalDrafter, load_drafter

from .checkpoints import write_causal_lm

VOCAB = 96


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def base_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"base_{request.param}")
    write_causal_lm(path, arch=request.param, vocab=VOCAB, tie=request.param == "llama")
    return path


def test_first_draft_is_the_truncated_ar_prediction(base_dir):
    """Shifted head: draft 1 is read from the last context token, computed causally, so it
    equals the AR logits of the first N layers of the source model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    drafter = BlockCausalDrafter.from_causal_lm(base_dir, num_layers=2)
    cfg = AutoConfig.from_pretrained(base_dir).to_dict()
    cfg.update(num_hidden_layers=2, layer_types=None)
    truncated = type(AutoConfig.from_pretrained(base_dir))(**cfg)
    ar = AutoModelForCausalLM.from_pretrained(base_dir, config=truncated).eval()
    ctx = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ar(ctx[None]).logits[0, -1]
    got = drafter.draft_logits([ctx], gamma=3)
    assert got.shape == (1, 3, VOCAB)
    torch.testing.assert_close(got[0, 0], expected, atol=1e-5, rtol=0)
    # the mask embedding row exists but is never proposed
    assert drafter.mask_token_id == VOCAB
    assert drafter.model.embed_tokens.weight.shape[0] == VOCAB + 1


def test_incremental_cache_equals_full_recompute(base_dir):
    """Ragged batch, several steps of appends (accepted tokens) and rollbacks (rejected drafts),
    rows reordered and one row dropped/resumed: the cached drafter matches a cache-less one."""
    cached = BlockCausalDrafter.from_causal_lm(base_dir, num_layers=2, cache_size=8)
    full = BlockCausalDrafter.from_causal_lm(base_dir, num_layers=2, cache_size=0)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (5, 11, 3)]
    gamma = 4
    for step in range(6):
        order = list(range(len(seqs)))
        if step % 2 == 1:
            order = order[::-1]  # vLLM reorders rows
        if step == 3:
            order = order[1:]  # row 0 preempted this step
        batch = [seqs[i] for i in order]
        a = cached.draft_logits(batch, gamma)
        b = full.draft_logits(batch, gamma)
        assert a.shape == (len(batch), gamma, VOCAB)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        for i in order:  # commit: roll back 0-2 drafted tokens and append 1-3 new ones
            drop = int(torch.randint(0, 3, (1,), generator=gen))
            keep = max(1, seqs[i].numel() - drop) if step % 3 == 2 else seqs[i].numel()
            new = torch.randint(0, VOCAB, (int(torch.randint(1, 4, (1,), generator=gen)),),
                                generator=gen)
            seqs[i] = torch.cat([seqs[i][:keep], new])
    stats = cached.cache_stats()
    assert stats["hit_tokens"] > stats["miss_tokens"]  # the cache really served most tokens
    assert stats["entries"] <= 8


def test_shared_prefix_rows_and_lru_bound(base_dir):
    """Two rows sharing a prompt in one batch, and more sequences than pool entries."""
    cached = BlockCausalDrafter.from_causal_lm(base_dir, num_layers=2, cache_size=2)
    full = BlockCausalDrafter.from_causal_lm(base_dir, num_layers=2, cache_size=0)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, VOCAB, (9,), generator=gen)
    cached.draft_logits([prompt], 3)
    rows = [torch.cat([prompt, torch.tensor([5, 6])]), torch.cat([prompt, torch.tensor([7])]),
            torch.randint(0, VOCAB, (6,), generator=gen)]
    for _ in range(2):
        torch.testing.assert_close(cached.draft_logits(rows, 3), full.draft_logits(rows, 3),
                                   atol=1e-5, rtol=0)
    assert cached.cache_stats()["entries"] == 2
    assert cached.cache_stats()["evictions"] >= 1
    cached.clear_cache()
    assert cached.cache_stats()["entries"] == 0


def test_identical_rows_keep_their_own_entries(base_dir):
    """n > 1 samples of one prompt: rows with identical contexts step after step must reuse one
    entry each, not copy a claimed entry every step (which fills the pool with orphans)."""
    cached = BlockCausalDrafter.from_causal_lm(base_dir, num_layers=2, cache_size=16)
    full = BlockCausalDrafter.from_causal_lm(base_dir, num_layers=2, cache_size=0)
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, VOCAB, (7,), generator=gen)] * 3
    for _ in range(6):
        torch.testing.assert_close(cached.draft_logits(rows, 3), full.draft_logits(rows, 3),
                                   atol=1e-5, rtol=0)
        token = torch.randint(0, VOCAB, (1,), generator=gen)
        rows = [torch.cat([r, token]) for r in rows]
    assert cached.cache_stats()["entries"] == 3


def test_draft_logits_in_training_mode_with_checkpointing(base_dir):
    """Training code switches on gradient checkpointing, which drops KV caches in training
    mode; draft_logits must still use its cache (it runs in eval mode) and restore the mode."""
    import functools

    from torch.utils.checkpoint import checkpoint

    drafter = BlockCausalDrafter.from_causal_lm(base_dir, num_layers=2)
    ctx = [torch.arange(9) + 1]
    expected = drafter.draft_logits(ctx, 3)
    drafter.train()
    for layer in drafter.model.layers:
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    got = drafter.draft_logits([torch.cat([ctx[0], torch.tensor([4, 2])])], 3)
    assert drafter.training
    fresh = BlockCausalDrafter.from_causal_lm(base_dir, num_layers=2, cache_size=0)
    torch.testing.assert_close(got, fresh.draft_logits([torch.cat([ctx[0],
                                                                   torch.tensor([4, 2])])], 3),
                               atol=1e-5, rtol=0)
    assert expected.shape == got.shape


def test_window_logits_packs_windows_exactly(base_dir):
    """M windows in one forward equal M separate drafting calls; gradients flow."""
    drafter = BlockCausalDrafter.from_causal_lm(base_dir, num_layers=2, cache_size=0)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 12), generator=gen)
    starts = torch.tensor([[1, 6, 12], [3, 4, 9]])
    out = drafter.window_logits(ids, starts, gamma=3)
    assert out.shape == (2, 3, 3, VOCAB)
    for b in range(2):
        for m in range(3):
            ref = drafter.draft_logits([ids[b, : starts[b, m]]], 3)[0]
            torch.testing.assert_close(drafter.to_verifier_vocab(out[b, m]), ref,
                                       atol=1e-5, rtol=0)
    drafter.to_verifier_vocab(out).logsumexp(-1).sum().backward()  # differentiable mapping
    assert drafter.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_save_pretrained_round_trip_and_bfloat16(base_dir, tmp_path):
    drafter = BlockCausalDrafter.from_causal_lm(base_dir, num_layers=2)
    drafter.save_pretrained(tmp_path / "drafter")
    loaded = load_drafter(tmp_path / "drafter")
    assert isinstance(loaded, BlockCausalDrafter)
    ctx = [torch.arange(10) % VOCAB, torch.arange(4) + 20]
    torch.testing.assert_close(loaded.draft_logits(ctx, 5), drafter.draft_logits(ctx, 5))
    bf16 = load_drafter(tmp_path / "drafter", dtype="bfloat16")
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    low = bf16.draft_logits(ctx, 5)
    assert low.dtype == torch.float32
    low.div_(2.0)  # the result is an ordinary tensor callers may modify in place
    loaded.draft_logits(ctx, 5).mul_(0.5)
    assert (low.argmax(-1) == drafter.draft_logits(ctx, 5).argmax(-1)).float().mean() > 0.6


def test_multi_step_unmasking(base_dir):
    """steps=2: the most confident half keeps its first-pass logits; the rest is re-predicted
    with those positions filled in by their argmax."""
    drafter = BlockCausalDrafter.from_causal_lm(base_dir, num_layers=2)
    ctx = [torch.arange(8) + 3]
    gamma = 4
    one = drafter.draft_logits(ctx, gamma, steps=1)
    two = drafter.draft_logits(ctx, gamma, steps=2)
    conf = one.softmax(-1).amax(-1)[0]
    first = conf.sort(descending=True, stable=True).indices[:2]
    torch.testing.assert_close(two[0, first], one[0, first])
    block = torch.full((1, gamma), drafter.mask_token_id)
    block[0, first] = one[0, first].argmax(-1)
    with torch.inference_mode():
        again = drafter.to_verifier_vocab(drafter._block_logits(ctx, block))
    rest = [j for j in range(gamma) if j not in first.tolist()]
    torch.testing.assert_close(two[0, rest], again[0, rest])
    with pytest.raises(ValueError, match="steps"):
        drafter.draft_logits(ctx, gamma, steps=gamma + 1)


def test_bad_inputs(base_dir):
    drafter = BlockCausalDrafter.from_causal_lm(base_dir, num_layers=2)
    with pytest.raises(ValueError, match="max_positions"):
        drafter.draft_logits([torch.arange(60) % VOCAB], gamma=8)
    with pytest.raises(ValueError, match="gamma"):
        drafter.draft_logits([torch.arange(3)], gamma=0)
    with pytest.raises(ValueError, match="empty"):
        drafter.draft_logits([torch.tensor([], dtype=torch.long)], gamma=2)
    with pytest.raises(ValueError, match="num_layers"):
        BlockCausalDrafter.from_causal_lm(base_dir, num_layers=9)
    windowed = BlockCausalDrafter.from_causal_lm(base_dir, num_layers=2, context_window=16)
    assert windowed.draft_logits([torch.arange(60) % VOCAB], gamma=8).shape == (1, 8, VOCAB)


def _full_forward(drafter: BlockCausalDrafter, context: torch.Tensor, gamma: int) -> torch.Tensor:
    """Reference without any cache or packing: `window_logits`' dense-mask forward of one row."""
    (seen,) = drafter.prepare_contexts([context], gamma)
    with torch.no_grad():
        out = drafter.window_logits(seen[None], torch.tensor([[seen.numel()]]), gamma)
    return drafter.to_verifier_vocab(out[0, 0])


@pytest.mark.parametrize("window", [None, 24])
def test_packed_steps_equal_the_full_forward(base_dir, window):
    """Rows of different lengths drafted together step after step (1-3 tokens appended, some
    drafts rolled back, a row dropped, a long prompt joining, duplicate rows, more rows than
    pool entries so entries are evicted and re-encoded, a context window that re-encodes): every
    row's logits equal a cache-less dense forward of that row alone."""
    gamma = 4
    drafter = BlockCausalDrafter.from_causal_lm(base_dir, num_layers=2, cache_size=3,
                                                context_window=window)
    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (2, 9, 30, 5)]
    for step in range(8):
        batch = list(seqs)
        if step == 2:
            batch = batch[1:]  # a row preempted
        if step == 4:
            batch.append(torch.randint(0, VOCAB, (40,), generator=gen))  # a long prompt joins
        if step == 5:
            batch.append(batch[0].clone())  # two rows with one context (n > 1 samples)
        got = drafter.draft_logits(batch, gamma)
        for row, ctx in enumerate(batch):
            torch.testing.assert_close(got[row], _full_forward(drafter, ctx, gamma),
                                       atol=1e-5, rtol=0)
        for i, seq in enumerate(seqs):
            keep = seq.numel() - (1 if step % 3 == 2 and seq.numel() > 1 else 0)
            new = torch.randint(0, VOCAB, (int(torch.randint(1, 4, (1,), generator=gen)),),
                                generator=gen)
            seqs[i] = torch.cat([seq[:keep], new])[: 50]  # stay inside the 64 positions
    stats = drafter.cache_stats()
    assert stats["hit_tokens"] > 0 and stats["evictions"] > 0 and stats["entries"] <= 3


def test_packed_step_skips_padding_and_reuses_storage(base_dir):
    """A long prompt joining short rows does not widen them: the linears see exactly the new
    tokens plus the blocks (a padded batch runs rows x widest row). A row whose entry has room
    keeps its storage from step to step (no per-step copy of its cached context)."""
    drafter = BlockCausalDrafter.from_causal_lm(base_dir, num_layers=2, cache_size=8)
    seen: list[int] = []
    drafter.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda _m, args, _out: seen.append(args[0].shape[-2] * args[0].shape[0]))
    short = [torch.arange(10) + 1, torch.arange(12) + 2]
    drafter.draft_logits(short, 4)
    short = [torch.cat([s, torch.tensor([7])]) for s in short]
    storage = [e.kv.data_ptr() for e in drafter.pool.entries.values()]
    prompt = torch.arange(40) % VOCAB
    seen.clear()
    drafter.draft_logits([*short, prompt], 4)
    assert seen == [1 + 4 + 1 + 4 + 40 + 4]  # not 3 x (40 + 4)
    assert [e.kv.data_ptr() for e in list(drafter.pool.entries.values())[:2]] == storage
    two = drafter.draft_logits([*short, prompt], 4, steps=2)
    fresh = BlockCausalDrafter.from_causal_lm(base_dir, num_layers=2, cache_size=0)
    for row, ctx in enumerate([*short, prompt]):  # the block's own tokens (steps > 1) too
        torch.testing.assert_close(two[row], fresh.draft_logits([ctx], 4, steps=2)[0],
                                   atol=1e-5, rtol=0)
