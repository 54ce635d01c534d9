"""The verifier-conditioned drafter: what each window may see, files, and the verifier taps."""

import pytest
import torch

from vllm_specdiff.drafter.conditioned import (
    ConditionedConfig,
    ConditionedDrafter,
    spread_taps,
)

from .checkpoints import write_causal_lm

H, TAPS, VOCAB = 32, (0, 1), 96


def _cfg(**kw):
    base = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=64, vocab_size=VOCAB, target_layer_ids=TAPS,
                num_hidden_layers=2, block_size=5, max_position_embeddings=64,
                verifier_num_layers=3)
    base.update(kw)
    return ConditionedConfig(**base)


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    path = tmp_path_factory.mktemp("verifier")
    model = write_causal_lm(path, vocab=VOCAB, layers=3)
    return path, model


@pytest.fixture(scope="module")
def drafter(verifier):
    model = ConditionedDrafter.from_verifier(verifier[0], _cfg(), seed=3)
    with torch.no_grad():  # larger weights: every input visibly moves the logits
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name and "lm_head" not in name:
                p.normal_(0, 0.3)
    return model.eval()


def _inputs(seed=0, length=20):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, length), generator=gen)
    feats = torch.randn(1, length, H * len(TAPS), generator=gen)
    return ids, feats


def test_taps_spread_from_layer_one_to_n_minus_three_as_dflash():
    assert spread_taps(30, 3) == (1, 14, 27)
    assert spread_taps(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B's published taps
    assert spread_taps(30, 1) == (27,)
    with pytest.raises(ValueError, match="num_taps"):
        spread_taps(30, 0)


def test_config_rejects_taps_outside_the_verifier_and_tiny_blocks():
    with pytest.raises(ValueError, match="layers 0..N-2"):
        _cfg(target_layer_ids=(0, 2))  # the last layer's output has no capture point
    with pytest.raises(ValueError, match="block_size"):
        _cfg(block_size=1)


@torch.no_grad()
def test_a_window_sees_only_features_before_its_anchor_and_its_anchor_token(drafter):
    ids, feats = _inputs()
    s = 12  # first draft position; anchor token at 11, context features 0..10
    base = drafter.window_logits(ids, torch.tensor([[s]]), 4, feats)
    later = feats.clone()
    later[:, s - 1:] = torch.randn_like(later[:, s - 1:])  # the anchor's own state and after
    future_ids = ids.clone()
    future_ids[:, s:] = (future_ids[:, s:] + 1) % VOCAB
    assert torch.equal(base, drafter.window_logits(future_ids, torch.tensor([[s]]), 4, later))
    # negative controls: the last visible feature and the anchor token do move the logits
    moved = feats.clone()
    moved[:, s - 2] += 1.0
    assert not torch.allclose(base, drafter.window_logits(ids, torch.tensor([[s]]), 4, moved))
    anchor = ids.clone()
    anchor[:, s - 1] = (anchor[:, s - 1] + 1) % VOCAB
    assert not torch.allclose(base, drafter.window_logits(anchor, torch.tensor([[s]]), 4, feats))


@torch.no_grad()
def test_windows_packed_in_one_forward_equal_one_window_at_a_time(drafter):
    ids, feats = _inputs(1)
    starts = torch.tensor([[3, 9, 15]])
    packed = drafter.window_logits(ids, starts, 4, feats)
    for m, s in enumerate(starts[0].tolist()):
        alone = drafter.window_logits(ids[:, :s], torch.tensor([[s]]), 4, feats[:, :s])
        torch.testing.assert_close(packed[:, m], alone[:, 0], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_saved_directory_holds_no_verifier_tensor_and_reloads_identically(tmp_path, verifier,
                                                                           drafter):
    from safetensors.torch import load_file

    drafter.save_pretrained(tmp_path / "d")
    stored = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert "embed_tokens.weight" not in stored and "lm_head.weight" not in stored
    assert "fc.weight" in stored and "layers.1.self_attn.k_norm.weight" in stored
    again = ConditionedDrafter.from_pretrained(tmp_path / "d", verifier[0]).eval()
    ids, feats = _inputs(2)
    starts = torch.tensor([[5, 10]])
    torch.testing.assert_close(again.window_logits(ids, starts, 4, feats),
                               drafter.window_logits(ids, starts, 4, feats))


@torch.no_grad()
def test_reduced_head_keeps_the_verifier_rows_it_names(tmp_path, verifier):
    d2t = torch.tensor([5, 1, 40, 7])
    model = ConditionedDrafter.from_verifier(verifier[0], _cfg(), draft_to_verifier=d2t)
    torch.testing.assert_close(model.lm_head.weight, verifier[1].lm_head.weight[d2t])
    model.save_pretrained(tmp_path / "r")
    again = ConditionedDrafter.from_pretrained(tmp_path / "r", verifier[0])
    assert torch.equal(again.draft_to_verifier, d2t)
    assert again.lm_head.weight.shape == (4, H)


def test_shared_tensors_stay_frozen(drafter):
    assert not drafter.embed_tokens.weight.requires_grad
    assert not drafter.lm_head.weight.requires_grad
    assert drafter.fc.weight.requires_grad and drafter.mask_embedding.requires_grad


@torch.no_grad()
def test_incremental_context_drafts_as_the_teacher_forced_window(drafter):
    from vllm_specdiff.drafter.conditioned_state import ConditionedContextCache

    cache = ConditionedContextCache(drafter)
    seqs = [_inputs(seed) for seed in (4, 5)]
    lengths = [14, 9]  # committed tokens 0..n-1; the anchor is token n-1
    for r, ((_, feats), n) in enumerate(zip(seqs, lengths, strict=True)):
        pieces = [0, 5, 7, n - 1]  # a chunked prefill, then single steps
        for lo, hi in zip(pieces, pieces[1:], strict=False):
            cache.extend(f"r{r}", feats[0, lo:hi], lo)
    anchors = torch.tensor([ids[0, n - 1] for (ids, _), n in zip(seqs, lengths, strict=True)])
    got = cache.block_logits(["r0", "r1"], anchors, [n - 1 for n in lengths])
    for r, ((ids, feats), n) in enumerate(zip(seqs, lengths, strict=True)):
        want = drafter.window_logits(ids[:, :n], torch.tensor([[n]]), 4, feats[:, :n])[0, 0]
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5)
    assert cache.restarts == 0


@torch.no_grad()
def test_context_cache_is_bounded_and_restarts_a_request_it_dropped(drafter):
    from vllm_specdiff.drafter.conditioned_state import ConditionedContextCache

    ids, feats = _inputs(6)
    cache = ConditionedContextCache(drafter)
    cache.extend("a", feats[0, :10], 0)
    one = cache.nbytes
    cache.max_bytes = one + one // 2  # room for one request and a half
    cache.extend("b", feats[0, :10], 0)
    cache.block_logits(["b"], ids[0, 10:11], [10])  # drafting "b" evicts the idle "a"
    assert list(cache.entries) == ["b"] and cache.nbytes <= cache.max_bytes
    cache.extend("a", feats[0, 10:12], 10)  # "a" comes back mid-sequence: a new, short entry
    # counted when it drafts (a donor could still supply its prefix; here none: no tokens)
    assert cache.restarts == 0 and cache.entries["a"].start == 10
    logits = cache.block_logits(["a"], ids[0, 12:13], [12])
    assert torch.isfinite(logits).all() and cache.restarts == 1
    # a request drafted out of step with its context (or never fed) drafts from an empty one
    cache.block_logits(["a"], ids[0, 15:16], [15])
    assert cache.restarts == 2 and cache.entries["a"].start == 15
    assert cache.entries["a"].end == 15
    cache.drop("a")
    assert "a" not in cache.entries
