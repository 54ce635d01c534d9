"""Dream/DiffuCoder and LLaDA checkpoints: loading, head conventions, vocab mapping, errors."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_specdiff.drafter import BlockCausalDrafter, DreamDrafter, LLaDADrafter, load_drafter

from .checkpoints import bidirectional_logits, write_causal_lm, write_dream, write_llada


@pytest.fixture(scope="module")
def dream_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dream")
    return path, write_dream(path, vocab=98, mask_token_id=97)


@pytest.fixture(scope="module")
def llada_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llada")
    return path, write_llada(path, vocab=100, mask_token_id=90)


def _make_layers_identity(drafter):
    """Zero every residual branch: hidden state i = RMSNorm(embedding of input i)."""
    with torch.no_grad():
        for layer in drafter.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def _hand_logits(drafter, token_id: int) -> torch.Tensor:
    e = drafter.model.embed_tokens.weight[token_id].double()
    eps = drafter.model.norm.variance_epsilon
    h = e / torch.sqrt(e.pow(2).mean() + eps) * drafter.model.norm.weight.double()
    return (drafter.lm_head.weight.double() @ h).float()


@pytest.mark.parametrize("fmt", ["dream", "llada", "block"])
def test_shift_convention_hand_computed(fmt, dream_dir, llada_dir, tmp_path):
    """With identity layers each position's logits depend only on its own input token, so the
    convention is visible directly: shifted reads position L+j-1 (draft 1 = last context token),
    unshifted reads L+j (every draft = the mask token)."""
    if fmt == "block":
        write_causal_lm(tmp_path / "ar", arch="llama", vocab=64)
        drafter = BlockCausalDrafter.from_causal_lm(tmp_path / "ar", num_layers=2)
    else:
        drafter = load_drafter(dream_dir[0] if fmt == "dream" else llada_dir[0])
    _make_layers_identity(drafter)
    ctx = torch.tensor([3, 8, 5, 11])
    got = drafter.draft_logits([ctx], gamma=3)[0]
    mask = drafter.mask_token_id
    inputs = [mask, mask, mask] if fmt == "llada" else [int(ctx[-1]), mask, mask]
    for j, token in enumerate(inputs):
        want = _hand_logits(drafter, token)[: drafter.vocab_size]
        if mask < drafter.vocab_size:
            want[mask] = float("-inf")
        torch.testing.assert_close(got[j], want, atol=1e-4, rtol=1e-5)
    assert drafter.shifted is (fmt != "llada")


def test_dream_matches_transformers_qwen2_bidirectional(dream_dir):
    path, reference = dream_dir
    drafter = load_drafter(path)
    assert isinstance(drafter, DreamDrafter) and drafter.mask_token_id == 97
    contexts = [torch.tensor([4, 9, 2, 7, 7, 1]), torch.tensor([30, 31])]  # ragged batch
    gamma = 4
    got = drafter.draft_logits(contexts, gamma)
    for b, ctx in enumerate(contexts):
        full = bidirectional_logits(reference, torch.cat([ctx, torch.full((gamma,), 97)]))
        want = full[ctx.numel() - 1: ctx.numel() - 1 + gamma].clone()  # shifted
        want[:, 97] = float("-inf")
        torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)


def test_llada_matches_transformers_llama_bidirectional(llada_dir):
    path, reference = llada_dir
    drafter = load_drafter(path)
    assert isinstance(drafter, LLaDADrafter) and drafter.mask_token_id == 90
    contexts = [torch.tensor([5, 6, 7]), torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])]
    gamma = 3
    got = drafter.draft_logits(contexts, gamma)
    for b, ctx in enumerate(contexts):
        full = bidirectional_logits(reference, torch.cat([ctx, torch.full((gamma,), 90)]))
        want = full[ctx.numel(): ctx.numel() + gamma].clone()  # unshifted
        want[:, 90] = float("-inf")
        torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)


def test_context_window_and_window_logits(dream_dir):
    path, _ = dream_dir
    windowed = load_drafter(path, context_window=4)
    plain = load_drafter(path)
    ctx = torch.arange(20) + 10
    torch.testing.assert_close(windowed.draft_logits([ctx], 3),
                               plain.draft_logits([ctx[-4:]], 3))
    ids = torch.stack([torch.arange(9) + 2, torch.arange(9) + 40])
    starts = torch.tensor([[2, 9], [5, 6]])
    out = plain.window_logits(ids, starts, 3)
    assert out.shape == (2, 2, 3, 98)
    for b in range(2):
        for m in range(2):
            ref = plain.draft_logits([ids[b, : starts[b, m]]], 3)[0]
            torch.testing.assert_close(plain.to_verifier_vocab(out[b, m]), ref,
                                       atol=1e-5, rtol=1e-5)


def test_appended_mask_vocab_maps_to_verifier(dream_dir):
    """DiffuCoder style: the verifier has 96 ids, the drafter appends extras (96) and the mask
    (97); only verifier ids come out and none of the extras can be proposed."""
    path, _ = dream_dir
    raw = load_drafter(path)
    drafter = load_drafter(path, verifier_vocab_size=96)
    ctx = [torch.tensor([1, 2, 3])]
    got = drafter.draft_logits(ctx, 4)
    assert got.shape == (1, 4, 96)
    torch.testing.assert_close(got, raw.draft_logits(ctx, 4)[..., :96])
    assert torch.isfinite(got).all()
    with pytest.raises(ValueError, match="vocab mismatch"):
        load_drafter(path, verifier_vocab_size=120)


def test_llada_mask_inside_vocab_never_proposed(llada_dir):
    drafter = load_drafter(llada_dir[0])
    got = drafter.draft_logits([torch.tensor([1, 2])], 2)
    assert got.shape[-1] == 100
    assert torch.isneginf(got[..., 90]).all()
    assert torch.isfinite(got[..., :90]).all()


def test_bfloat16_dream(dream_dir):
    path, _ = dream_dir
    low = load_drafter(path, dtype=torch.bfloat16)
    high = load_drafter(path)
    ctx = [torch.tensor([4, 9, 2, 7])]
    a, b = low.draft_logits(ctx, 3), high.draft_logits(ctx, 3)
    assert a.dtype == torch.float32
    finite = torch.isfinite(b)
    assert (a[finite] - b[finite]).abs().max() < 0.5


def test_clear_errors(tmp_path, dream_dir, llada_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_drafter(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_drafter(tmp_path / "empty")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(
        (dream_dir[0] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_drafter(tmp_path / "noweights")
    ar = tmp_path / "ar"
    write_causal_lm(ar, arch="llama", vocab=64)
    with pytest.raises(ValueError, match="unknown drafter model_type 'llama'"):
        load_drafter(ar)
    # config and weights disagree
    bad = tmp_path / "bad"
    write_dream(bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=48)))
    with pytest.raises(ValueError, match="shape"):
        load_drafter(bad)
    (bad / "config.json").write_text(json.dumps({k: v for k, v in cfg.items()
                                                 if k != "mask_token_id"}))
    with pytest.raises(ValueError, match="mask_token_id"):
        load_drafter(bad)
    odd = tmp_path / "odd"
    write_llada(odd)
    cfg = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps(dict(cfg, alibi=True)))
    with pytest.raises(ValueError, match="alibi"):
        load_drafter(odd)
    drafter = load_drafter(llada_dir[0])
    with pytest.raises(ValueError, match="max_positions"):
        drafter.draft_logits([torch.arange(60)], gamma=5)
    with pytest.raises(ValueError, match="outside the drafter's embedding"):
        drafter.draft_logits([torch.tensor([3, 100])], gamma=2)


def test_sharded_checkpoint_and_determinism(tmp_path, dream_dir):
    """Public 7B checkpoints are sharded with an index; loading twice gives identical output."""
    from safetensors.torch import load_file, save_file

    src, _ = dream_dir
    out = tmp_path / "sharded"
    out.mkdir()
    (out / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(out / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in keys})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    ctx = [torch.tensor([4, 9, 2]), torch.tensor([7])]
    a = load_drafter(out).draft_logits(ctx, 3)
    b = load_drafter(src).draft_logits(ctx, 3)
    assert torch.equal(a, b)
    (out / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        load_drafter(out)


@pytest.mark.parametrize("fmt", ["dream", "llada"])
def test_save_pretrained_writes_the_same_format(fmt, dream_dir, llada_dir, tmp_path):
    from safetensors import safe_open

    src = dream_dir[0] if fmt == "dream" else llada_dir[0]
    drafter = load_drafter(src)
    drafter.save_pretrained(tmp_path / "copy")
    assert json.loads((tmp_path / "copy" / "config.json").read_text()) == \
        json.loads((src / "config.json").read_text())
    with safe_open(str(src / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "copy" / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
    ctx = [torch.tensor([3, 1, 4, 1, 5])]
    torch.testing.assert_close(load_drafter(tmp_path / "copy").draft_logits(ctx, 3),
                               drafter.draft_logits(ctx, 3))
