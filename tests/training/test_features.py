"""Verifier taps (the off-by-one that silently ruins acceptance), the feature cache, packed data."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_specdiff_training.data import load_sequences, split_heldout
from vllm_specdiff_training.data_pack import main as data_pack
from vllm_specdiff_training.feature_rows import map_safetensor
from vllm_specdiff_training.features import TapModel, attach_features, features_dir
from vllm_specdiff_training.generate import GenerateConfig, run_generate

from .conftest import make_verifier


def test_tap_l_is_the_output_of_layer_l_hidden_states_l_plus_one(tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_verifier(tmp_path / "v", layers=4)
    ids = torch.randint(3, 60, (1, 17), generator=torch.Generator().manual_seed(0))
    tapped = TapModel(path, (0, 2))(ids)
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(tapped, torch.cat([hs[1], hs[3]], dim=-1))
    # negative control: Hugging Face's hidden_states[L] (one layer early) differs
    assert not torch.allclose(tapped, torch.cat([hs[0], hs[2]], dim=-1))


def _data(tmp_path, verifier, prompts_file):
    out = tmp_path / "data"
    run_generate(GenerateConfig(verifier=str(verifier), prompts=str(prompts_file),
                                output=str(out), num_samples=1, temperature=0.0,
                                max_new_tokens=12, chunk_size=8, batch_size=8,
                                backend="transformers", chat_template=False))
    return out


def test_features_are_cached_per_shard_and_align_with_the_tokens(tmp_path, prompts_file):
    verifier = make_verifier(tmp_path / "v", layers=3)
    out = _data(tmp_path, verifier, prompts_file)
    seqs = load_sequences(out)
    attach_features(seqs, verifier, (1,))
    assert seqs.features.shape == (seqs.tokens.shape[0], 32)
    cached = sorted(features_dir(out, (1,)).glob("shard-*.safetensors"))
    assert len(cached) == len(seqs.meta["_shards"]) == 3
    first = load_file(str(cached[0]))["features"]
    seq0 = seqs.sequence(0)
    direct = TapModel(verifier, (1,))(seq0[None])[0]
    torch.testing.assert_close(first[:seq0.numel()].float(), direct, rtol=2e-3, atol=2e-3)
    # a subset keeps each sequence's own rows
    sub = seqs.subset([2, 0])
    torch.testing.assert_close(sub.features[:seqs.length(2)],
                               seqs.features[seqs.seq_offsets[2]:seqs.seq_offsets[3]])


@pytest.mark.parametrize("shard", [0, 2])
@pytest.mark.parametrize("damage", ["narrow", "short"])
def test_features_that_do_not_match_the_data_are_refused(tmp_path, prompts_file, shard, damage):
    """A feature shard of another width (other taps) or with rows missing is never attached."""
    verifier = make_verifier(tmp_path / "v", layers=3)
    out = _data(tmp_path, verifier, prompts_file)
    attach_features(load_sequences(out), verifier, (1,))
    path = sorted(features_dir(out, (1,)).glob("shard-*.safetensors"))[shard]
    feats = load_file(str(path))["features"]
    save_file({"features": (feats[:, :16] if damage == "narrow" else feats[:-1]).contiguous()},
              str(path))
    with pytest.raises(ValueError, match="do not match the data"):
        attach_features(load_sequences(out), verifier, (1,))


def test_the_split_shares_the_mapped_features_and_keeps_each_sequence_rows(tmp_path,
                                                                          prompts_file):
    """Features are read from the feature shards in place (memory-mapped): the same values as
    loading them, and a train / held-out split hands out views of those rows, never copies."""
    verifier = make_verifier(tmp_path / "v", layers=3)
    out = _data(tmp_path, verifier, prompts_file)
    seqs = load_sequences(out)
    attach_features(seqs, verifier, (1,))
    path = sorted(features_dir(out, (1,)).glob("shard-*.safetensors"))[1]
    assert torch.equal(map_safetensor(path, "features"), load_file(str(path))["features"])
    train, held = split_heldout(seqs, 0.4)
    assert len(train) and len(held)
    row_of = {int(p): i for i, p in enumerate(seqs.prompt_index)}
    for part in (train, held):
        for j in range(len(part)):
            i = row_of[int(part.prompt_index[j])]
            mine = part.features[part.seq_offsets[j]:part.seq_offsets[j + 1]]
            theirs = seqs.features[seqs.seq_offsets[i]:seqs.seq_offsets[i + 1]]
            assert torch.equal(mine, theirs) and mine.data_ptr() == theirs.data_ptr()
    with pytest.raises(IndexError, match="not inside one segment"):
        seqs.features[0:seqs.length(0) + 1]  # rows of two sequences


def test_features_of_fewer_taps_are_sliced_from_stored_ones_without_a_verifier_forward(
        tmp_path, prompts_file, monkeypatch):
    """Features built once for taps (0, 1, 2) serve any subset, each tap's columns in place; taps
    that no stored folder holds still run the verifier (negative control)."""
    import vllm_specdiff_training.features as features

    verifier = make_verifier(tmp_path / "v", layers=4)
    out = _data(tmp_path, verifier, prompts_file)
    wide = load_sequences(out)
    attach_features(wide, verifier, (0, 1, 2))
    forwards = []
    monkeypatch.setattr(features, "TapModel", lambda *a, **k: forwards.append(a) or 1 / 0)
    for taps in ((0, 2), (1,)):
        for path in features_dir(out, taps).glob("shard-*.safetensors"):
            path.unlink()
        sliced = load_sequences(out)
        attach_features(sliced, verifier, taps)
        cols = torch.cat([torch.arange(t * 32, (t + 1) * 32) for t in taps])
        for i in range(len(sliced)):
            torch.testing.assert_close(sliced.features[sliced.seq_offsets[i]:
                                                       sliced.seq_offsets[i + 1]],
                                       wide.features[wide.seq_offsets[i]:
                                                     wide.seq_offsets[i + 1]][:, cols])
    assert not forwards
    with pytest.raises(ZeroDivisionError):  # taps no stored folder holds: a verifier forward
        attach_features(load_sequences(out), verifier, (3,))
    assert forwards


def test_packed_data_unpacks_to_the_same_shards(tmp_path, prompts_file, capsys):
    verifier = make_verifier(tmp_path / "v", layers=2)
    out = _data(tmp_path, verifier, prompts_file)
    assert data_pack(["pack", "--data", str(out), "--output", str(tmp_path / "packed")]) == 0
    assert data_pack(["unpack", "--packed", str(tmp_path / "packed"),
                      "--output", str(tmp_path / "again")]) == 0
    a, b = load_sequences(out), load_sequences(tmp_path / "again" / "data")
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.seq_offsets, b.seq_offsets)
    assert torch.equal(a.prompt_lens, b.prompt_lens)
    assert torch.equal(a.prompt_index, b.prompt_index)
    assert b.meta["tokenizer_fingerprint"] == a.meta["tokenizer_fingerprint"]
    assert data_pack(["unpack", "--packed", str(tmp_path / "nothing"),
                      "--output", str(tmp_path)]) == 2


def test_under_torchrun_a_rank_owns_its_shards_whatever_another_built_first(tmp_path, monkeypatch):
    """Ranks split the shards before looking at what exists: rank 1 starting after rank 0 built
    shard 0 still builds shard 1 (splitting only the missing ones gave it nothing to build, and
    both ranks waited for each other forever)."""
    from vllm_specdiff_training.features import build_missing

    pairs = [(tmp_path / f"shard-{i}", tmp_path / "out" / f"shard-{i}") for i in range(2)]
    pairs[0][1].parent.mkdir()
    pairs[0][1].write_text("rank 0's")
    built = []

    def builder():
        def build(shard, out):
            built.append(shard.name)
            out.write_text("rank 1's")
        return build

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    build_missing(pairs, builder, "test shards")
    assert built == ["shard-1"]
    assert pairs[0][1].read_text() == "rank 0's"
