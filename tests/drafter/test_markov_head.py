"""The conditioned drafter's optional Markov head (drafter/markov.py): rank 0 is the drafter as it
was, a new head drafts as before, a trained one reads exactly the previous token, serving's
greedy chain is the teacher-forced computation on the drafter's own path, and the files."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from vllm_specdiff.drafter.conditioned import ConditionedConfig, ConditionedDrafter
from vllm_specdiff.drafter.conditioned_state import ConditionedContextCache

from .checkpoints import write_causal_lm
from .test_conditioned import TAPS, VOCAB, H
from .test_conditioned import _cfg as conditioned_cfg

GAMMA, RANK = 4, 4
# a reduced head over 40 verifier ids, none at its own index (d2t[i] != i), so a path fed draft
# indices instead of verifier ids reads other embeddings
D2T = torch.arange(5, 85, 2)


def _cfg(**kw) -> ConditionedConfig:
    """The conditioned drafter tests' shape, with room for longer test sequences."""
    return conditioned_cfg(**{"max_position_embeddings": 128, **kw})


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    path = tmp_path_factory.mktemp("verifier")
    write_causal_lm(path, vocab=VOCAB, layers=3)
    return path


def _loud(model: ConditionedDrafter) -> ConditionedDrafter:
    """Large random weights (shared tensors kept): every input visibly moves the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name and "lm_head" not in name:
                p.normal_(0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def base(verifier):
    return _loud(ConditionedDrafter.from_verifier(verifier, _cfg(), seed=3))


def _headed(drafter: ConditionedDrafter) -> ConditionedDrafter:
    """A copy with a Markov head whose weights (W_out included) are random and large."""
    model = copy.deepcopy(drafter)
    model.add_markov(RANK, seed=5)
    with torch.no_grad():
        for p in model.markov.parameters():
            p.normal_(0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def headed(base):
    return _headed(base)


@pytest.fixture(scope="module")
def reduced(verifier):
    """A Markov-headed drafter with a reduced head (d2t)."""
    return _headed(_loud(ConditionedDrafter.from_verifier(verifier, _cfg(), seed=4,
                                                          draft_to_verifier=D2T)))


def _inputs(seed=0, length=24):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, length), generator=gen)
    feats = torch.randn(1, length, H * len(TAPS), generator=gen)
    return ids, feats


def _served(drafter, rows: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Serving's block logits [B, gamma, V_draft], each row's context fed up to its anchor (its
    last token)."""
    cache = ConditionedContextCache(drafter)
    for req, (ids, feats) in rows.items():
        cache.extend(req, feats[:ids.shape[0] - 1], 0)
    anchors = torch.stack([ids[-1] for ids, _ in rows.values()])
    return cache.block_logits(list(rows), anchors, [ids.shape[0] - 1 for ids, _ in rows.values()])


def _plain_head(drafter, ids, starts, feats) -> torch.Tensor:
    """The drafter before the Markov head existed: lm_head over the block's hidden states."""
    anchor_pos = starts - 1
    length = int(starts.max()) - 1
    ctx = drafter.context(feats[:, :length])
    pos = torch.arange(length).expand(ctx.shape[0], -1)
    hidden = drafter.block_hidden(ids.gather(1, anchor_pos), anchor_pos,
                                  drafter.context_kv(ctx, pos),
                                  pos[:, None, :] < anchor_pos[:, :, None])
    return drafter.lm_head(hidden[:, :, 1:GAMMA + 1])


@torch.no_grad()
def test_rank_zero_is_the_drafter_without_the_field_bit_for_bit(verifier, base, tmp_path):
    explicit = _loud(ConditionedDrafter.from_verifier(verifier, _cfg(markov_rank=0), seed=3))
    fresh = _loud(ConditionedDrafter.from_verifier(verifier, _cfg(), seed=3))
    assert explicit.markov is None and not any("markov" in k for k in explicit.state_dict())
    ids, feats = _inputs()
    starts = torch.tensor([[6, 12, 17]])
    got = explicit.window_logits(ids, starts, GAMMA, feats)
    assert torch.equal(got, fresh.window_logits(ids, starts, GAMMA, feats))
    assert torch.equal(got, _plain_head(explicit, ids, starts, feats))
    # serving: the plain head over the block's hidden states, no chain
    cache = ConditionedContextCache(explicit)
    cache.extend("a", feats[0, :11], 0)
    served = cache.block_logits(["a"], ids[0, 11:12], [11])
    entry = cache.entries["a"]
    ctx = [(k[None], v[None]) for k, v in zip(entry.keys, entry.values, strict=True)]
    hidden = explicit.block_hidden(ids[:, 11:12], torch.tensor([[11]]), ctx,
                                   torch.ones(1, 1, 11, dtype=torch.bool))
    assert torch.equal(served, explicit.lm_head(hidden[:, 0, 1:]))
    # the files are those a drafter without the field always wrote
    explicit.save_pretrained(tmp_path / "d")
    assert "markov_rank" not in json.loads((tmp_path / "d" / "config.json").read_text())
    assert not any("markov" in k for k in load_file(str(tmp_path / "d" / "model.safetensors")))


def test_markov_rank_is_checked():
    with pytest.raises(ValueError, match="markov_rank must be an int >= 0"):
        _cfg(markov_rank=-1)
    assert ConditionedDrafter(_cfg(markov_rank=3)).markov.w_a.weight.shape == (3, H)


@torch.no_grad()
def test_a_new_head_drafts_exactly_as_before(base):
    fresh = copy.deepcopy(base)
    fresh.add_markov(RANK, seed=1)
    assert fresh.cfg.markov_rank == RANK
    assert fresh.markov.w_out.weight.abs().sum() == 0 and fresh.markov.w_a.weight.abs().sum() > 0
    ids, feats = _inputs(1)
    starts = torch.tensor([[5, 11, 16]])
    assert torch.equal(fresh.window_logits(ids, starts, GAMMA, feats),
                       base.window_logits(ids, starts, GAMMA, feats))
    rows = {"a": (ids[0, :14], feats[0, :14]), "b": (ids[0, :9], feats[0, :9])}
    # one matmul per slot instead of one for the block: the same drafts, float32 rounding apart
    served, plain = _served(fresh, rows), _served(base, rows)
    torch.testing.assert_close(served, plain, rtol=0, atol=1e-6)
    assert torch.equal(served.argmax(-1), plain.argmax(-1))
    with pytest.raises(ValueError, match="has a Markov head already"):
        fresh.add_markov(2)
    with pytest.raises(ValueError, match="rank must be >= 1"):
        copy.deepcopy(base).add_markov(0)


@torch.no_grad()
def test_slot_k_reads_exactly_the_token_before_it(base, headed):
    """Teacher forced: slot k's logits move when the token at slot k-1 (the anchor for k = 1)
    changes, and no other slot's do; a drafter without a head reads none of them."""
    ids, feats = _inputs(2)
    s = 12  # first draft position; anchor at s-1, slot k predicts position s-1+k
    starts = torch.tensor([[s]])
    before = headed.window_logits(ids, starts, GAMMA, feats)[0, 0]
    plain = base.window_logits(ids, starts, GAMMA, feats)[0, 0]
    for k in range(2, GAMMA + 1):  # slot k's previous token sits at position s-1+k-1
        moved = ids.clone()
        moved[0, s + k - 2] = (moved[0, s + k - 2] + 1) % VOCAB
        after = headed.window_logits(moved, starts, GAMMA, feats)[0, 0]
        changed = [j + 1 for j in range(GAMMA) if not torch.equal(after[j], before[j])]
        assert changed == [k]
        # negative control: without a head, the drafted tokens are not read at all
        assert torch.equal(base.window_logits(moved, starts, GAMMA, feats)[0, 0], plain)
    # the token slot GAMMA predicts is no slot's previous token
    last = ids.clone()
    last[0, s + GAMMA - 1] = (last[0, s + GAMMA - 1] + 1) % VOCAB
    assert torch.equal(headed.window_logits(last, starts, GAMMA, feats)[0, 0], before)
    # the anchor is slot 1's previous token (and the block's first input, with or without head)
    anchor = ids.clone()
    anchor[0, s - 1] = (anchor[0, s - 1] + 1) % VOCAB
    assert not torch.allclose(headed.window_logits(anchor, starts, GAMMA, feats)[0, 0, 0],
                              before[0])


def _teacher_forced_on_own_path(drafter, ids, feats, served):
    """window_logits with the slots' tokens filled by the served drafts' greedy path (argmax,
    as verifier ids), and that path."""
    path = served.argmax(-1)
    if drafter.draft_to_verifier is not None:
        path = drafter.draft_to_verifier[path]
    full = torch.cat([ids, path])[None]
    n = ids.shape[0]
    return drafter.window_logits(full, torch.tensor([[n]]), GAMMA, feats[None])[0, 0], path


@torch.no_grad()
def test_serving_drafts_the_teacher_forced_logits_of_its_own_greedy_path(reduced):
    """Consistency of training and serving, with a reduced head in play: the served slots are
    window_logits with the input filled by the drafter's own greedy path (mapped through d2t),
    row by row in a batch of different lengths."""
    ids, feats = _inputs(3, length=30)
    rows = {"a": (ids[0, :21], feats[0, :21]), "b": (ids[0, :9], feats[0, :9]),
            "c": (ids[0, :1], feats[0, :1])}  # "c": a one-token prompt, an empty context
    served = _served(reduced, rows)
    assert served.shape == (3, GAMMA, D2T.numel())
    for b, (i, f) in enumerate(rows.values()):
        forced, path = _teacher_forced_on_own_path(reduced, i, f, served[b])
        torch.testing.assert_close(served[b], forced, rtol=1e-5, atol=1e-5)
        assert set(path.tolist()) <= set(D2T.tolist())
        # negative control: the path fed as draft indices (not verifier ids) drafts otherwise
        wrong = torch.cat([i, served[b].argmax(-1)])[None]
        assert not torch.allclose(served[b], reduced.window_logits(
            wrong, torch.tensor([[i.shape[0]]]), GAMMA, f[None])[0, 0], atol=1e-3)


@torch.no_grad()
def test_files_round_trip_and_load_for_serving(tmp_path, verifier, reduced):
    from vllm_specdiff.drafter.loading import load_drafter

    reduced.save_pretrained(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["markov_rank"] == RANK
    stored = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert {k for k in stored if k.startswith("markov.")} == {
        "markov.w_a.weight", "markov.w_b.weight", "markov.w_out.weight"}
    again = ConditionedDrafter.from_pretrained(tmp_path / "m", verifier).eval()
    assert again.cfg == reduced.cfg
    ids, feats = _inputs(4)
    starts = torch.tensor([[4, 10, 15]])
    assert torch.equal(again.window_logits(ids, starts, GAMMA, feats),
                       reduced.window_logits(ids, starts, GAMMA, feats))
    rows = {"a": (ids[0, :13], feats[0, :13])}
    assert torch.equal(_served(again, rows), _served(reduced, rows))
    # the serving loader (int8 on CPU included) keeps the head
    for quantize in ("none", "int8"):
        loaded = load_drafter(tmp_path / "m", verifier=verifier, quantize=quantize)
        assert loaded.cfg.markov_rank == RANK
        got = _served(loaded, rows)
        assert got.shape == (1, GAMMA, D2T.numel())
        if quantize == "none":
            torch.testing.assert_close(got, _served(reduced, rows))
    # weights without the head's tensors do not load as a headed drafter
    del stored["markov.w_out.weight"]
    from safetensors.torch import save_file

    save_file(stored, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match="markov.w_out.weight"):
        ConditionedDrafter.from_pretrained(tmp_path / "m", verifier)


def test_a_directory_written_before_the_field_loads_without_a_head(tmp_path, verifier, base):
    base.save_pretrained(tmp_path / "old")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    assert "markov_rank" not in config
    assert ConditionedDrafter.from_pretrained(tmp_path / "old", verifier).markov is None


def test_dflash_export_refuses_a_markov_head(tmp_path, verifier, base, headed):
    from vllm_specdiff_training.export import ExportConfig, run_export
    from vllm_specdiff_training.export_dflash import export_dflash

    with pytest.raises(ValueError, match="Markov head .*vLLM's `dflash` method cannot run"):
        export_dflash(headed, verifier, tmp_path / "out", mask_token_id=3)
    assert not (tmp_path / "out").exists()  # refused before anything is written
    headed.save_pretrained(tmp_path / "headed")
    with pytest.raises(ValueError, match="serve it with the plugin in its native format"):
        run_export(ExportConfig(verifier=str(verifier), output=str(tmp_path / "out2"),
                                drafter=str(tmp_path / "headed"), format="dflash"))
    # negative control: the same drafter without the head exports
    export_dflash(base, verifier, tmp_path / "plain", mask_token_id=3)
    assert (tmp_path / "plain" / "model.safetensors").is_file()
