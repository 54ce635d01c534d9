"""Published DFlash drafters read as the project's conditioned drafter, without their code.

A DFlash checkpoint (z-lab's `DFlashDraftModel` layout, or vllm-project/speculators'
`speculators_model_type: "dflash"` layout) computes what `ConditionedDrafter` computes: `fc` over
the concatenated verifier taps, `hidden_norm`, Qwen3-style layers whose keys and values cover the
context vectors and the block, a final `norm`, and the verifier's embedding and head. Its block is
`[anchor, mask x (block_size - 1)]`, which is the conditioned drafter's `block_size` exactly, and
its tensors already carry the conditioned drafter's names. So a DFlash directory becomes a
`ConditionedDrafter` and every plugin feature (adaptive drafting, prompt lookup, K > 1, LoRA,
int8, trees, prefix reuse) works unchanged.

What differs is only how the configuration is written, normalised here:
- taps: DFlash's `target_layer_ids` use the conditioned drafter's convention (tap L = output of
  layer L, Hugging Face's `hidden_states[L + 1]`; `export_dflash` writes them unchanged), while
  speculators' `aux_hidden_state_layer_ids` are vLLM's capture indices (before layer i), one more;
  absent taps are spread as DFlash's `build_target_layer_ids` spreads them;
- the mask slot: the embedding of `mask_token_id` (verifier's, or the checkpoint's own), replaced
  by `mask_embedding.pt` when that file is present (as vLLM does);
- `rope_theta`, when absent, is transformers' default for Qwen3 and Llama configs (10000): vLLM
  0.32 loads the config through transformers, which fills it in before vLLM's own 1e6 fallback
  (`set_default_rope_theta`) could apply, and DFlash's reference code reads the same config;
- a reduced head: `lm_head.weight` rows plus `d2t` offsets (target id = draft id + d2t[id]).
Variants whose computation differs (causal or sliding-window layers, attention biases, DSpark or
Domino heads, fused taps, scaled RoPE) are refused by name instead of drafting wrongly.
`auto_map` and any code shipped with the checkpoint are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpoint import read_json_object, read_weights, tensor_shapes, weight_files
from .conditioned import ConditionedConfig, ConditionedDrafter

ARCHITECTURE = "DFlashDraftModel"
SPECULATORS_TYPE = "dflash"
MASK_EMBEDDING_FILE = "mask_embedding.pt"
# what transformers' Qwen3Config / LlamaConfig fill in for a config that names none (measured:
# vLLM 0.32 with transformers 5 serves such a checkpoint at this theta, not at its 1e6 fallback)
DEFAULT_ROPE_THETA = 10000.0
# tensors a published checkpoint may carry that take no part in drafting
IGNORED = ("t2d", "verifier_norm.weight")
D2T = "d2t"
# the verifier's tensors, used from the checkpoint when it ships its own
OWN_EMBEDDING, OWN_HEAD = "embed_tokens.weight", "lm_head.weight"


def is_dflash(cfg: dict) -> bool:
    """Whether a config.json is a DFlash drafter's (either published layout)."""
    return ARCHITECTURE in (cfg.get("architectures") or []) \
        or cfg.get("speculators_model_type") == SPECULATORS_TYPE


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's default taps: one per drafter layer, from layer 1 to layer N-3 (one drafter
    layer: the middle layer)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(int(round(start + i * (end - start) / (num_draft_layers - 1)))
                 for i in range(num_draft_layers))


@dataclass(frozen=True)
class DFlashLayout:
    """A DFlash checkpoint's drafter shape, mask token and draft vocabulary."""

    config: ConditionedConfig
    mask_token_id: int
    draft_vocab_size: int | None


def _sections(cfg: dict, where: str) -> tuple[dict, dict]:
    """(layer sizes, DFlash settings with taps in DFlash's convention) of either layout."""
    if cfg.get("speculators_model_type") == SPECULATORS_TYPE:
        layers = cfg.get("transformer_layer_config")
        if not isinstance(layers, dict):
            raise ValueError(f"{where}: a speculators DFlash config needs a "
                             "transformer_layer_config object")
        aux = cfg.get("aux_hidden_state_layer_ids")
        settings = {k: cfg.get(k) for k in ("block_size", "mask_token_id", "draft_vocab_size",
                                            "target_hidden_size", "sample_from_anchor",
                                            "projector_type", "shift_label")}
        if aux is not None:  # vLLM's capture index (before layer i) = DFlash's tap i - 1
            settings["target_layer_ids"] = [_int(i, "aux_hidden_state_layer_ids", where) - 1
                                            for i in aux]
        return layers, settings
    dflash = cfg.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise ValueError(f"{where}: dflash_config must be a JSON object")
    settings = dict(dflash)
    top = cfg.get("block_size")  # z-lab writes it at the top level; the reference reads it first
    settings["block_size"] = top if top is not None else dflash.get("block_size")
    for key in ("draft_vocab_size", "target_hidden_size", "num_target_layers"):
        settings.setdefault(key, cfg.get(key))
    return cfg, settings


def _int(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {name} must be an integer, got {value!r}")
    return value


def _refuse_variants(layers: dict, settings: dict, where: str) -> None:
    """Name the DFlash variants whose computation the conditioned drafter does not run."""
    rope = {**(layers.get("rope_scaling") or {}), **(layers.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    layer_types = layers.get("layer_types") or []
    refused = {
        "causal attention inside the block (dflash_config.causal)": settings.get("causal"),
        "sliding-window layers": settings.get("use_swa") or "sliding_attention" in layer_types,
        "attention biases (attention_bias)": layers.get("attention_bias"),
        "MLP biases (mlp_bias)": layers.get("mlp_bias"),
        f"activation {layers.get('hidden_act')!r} (only silu)":
            layers.get("hidden_act", "silu") != "silu",
        "interleaved RoPE (is_neox_style: false)": layers.get("is_neox_style", True) is False,
        f"RoPE scaling {rope_type!r}": rope_type != "default",
        "attention sink biases": settings.get("attention_sink_bias"),
        "drafts without the verifier's states (use_aux_hidden_state: false)":
            settings.get("use_aux_hidden_state", True) is False,
        "sampling from the anchor slot (sample_from_anchor, DSpark-style)":
            settings.get("sample_from_anchor"),
        f"projector {settings.get('projector_type')!r}":
            settings.get("projector_type") not in (None, "dflash"),
        "shifted labels (shift_label)": settings.get("shift_label"),
        "fused taps (target_layer_fusion_mode)":
            settings.get("target_layer_fusion_mode", "none") != "none",
        "cross-depth mixer layers": settings.get("cross_depth_mixer_layers"),
    }
    named = [what for what, present in refused.items() if present]
    if named:
        raise ValueError(f"{where}: this DFlash variant is not supported: {', '.join(named)}")


def read_layout(cfg: dict, source: str | Path, verifier_num_layers: int | None = None
                ) -> DFlashLayout:
    """The conditioned drafter a DFlash config describes. `verifier_num_layers` (known at load
    time) checks the taps and places absent ones; without it the config's
    `num_target_layers` does."""
    where = str(Path(source) / "config.json")
    layers, settings = _sections(cfg, where)
    _refuse_variants(layers, settings, where)
    block = settings.get("block_size")
    if block is None:
        raise ValueError(f"{where}: no block_size (DFlash writes it at the top level or in "
                         "dflash_config)")
    mask_id = settings.get("mask_token_id")
    if mask_id is None:
        raise ValueError(f"{where}: no mask_token_id (dflash_config.mask_token_id)")
    hidden = _int(layers.get("hidden_size"), "hidden_size", where)
    target_hidden = settings.get("target_hidden_size")
    if target_hidden is not None and target_hidden != hidden:
        raise ValueError(f"{where}: target_hidden_size {target_hidden} differs from "
                         f"hidden_size {hidden}; the drafter shares the verifier's embedding, "
                         "so both must be the verifier's hidden size")
    heads = _int(layers.get("num_attention_heads"), "num_attention_heads", where)
    num_layers = _int(layers.get("num_hidden_layers"), "num_hidden_layers", where)
    declared = settings.get("num_target_layers")
    if declared is not None and verifier_num_layers is not None \
            and declared != verifier_num_layers:
        raise ValueError(f"{where}: the drafter was built for a {declared}-layer verifier "
                         f"(num_target_layers); this verifier has {verifier_num_layers} layers")
    n = verifier_num_layers if verifier_num_layers is not None else declared
    taps = settings.get("target_layer_ids")
    if taps is None:
        if n is None:
            raise ValueError(f"{where}: no target_layer_ids and no num_target_layers to place "
                             "them; pass the verifier")
        taps = build_target_layer_ids(n, num_layers)
    taps = tuple(_int(t, "target_layer_ids", where) for t in taps)
    if n is None:  # checked against the verifier when it is known
        n = max(taps) + 2
    theta = layers.get("rope_theta") or (layers.get("rope_parameters") or {}).get("rope_theta")
    try:
        config = ConditionedConfig(
            hidden_size=hidden, num_attention_heads=heads,
            num_key_value_heads=int(layers.get("num_key_value_heads") or heads),
            head_dim=int(layers.get("head_dim") or hidden // heads),
            intermediate_size=_int(layers.get("intermediate_size"), "intermediate_size", where),
            vocab_size=_int(layers.get("vocab_size"), "vocab_size", where),
            target_layer_ids=taps, num_hidden_layers=num_layers,
            block_size=_int(block, "block_size", where),
            rms_norm_eps=float(layers.get("rms_norm_eps") or 1e-6),
            rope_theta=float(theta or DEFAULT_ROPE_THETA),
            max_position_embeddings=int(layers.get("max_position_embeddings") or 40960),
            verifier_num_layers=n)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    draft_vocab = settings.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab == config.vocab_size:
        draft_vocab = None
    return DFlashLayout(config, _int(mask_id, "mask_token_id", where), draft_vocab)


def _expected_shapes(layout: DFlashLayout) -> dict[str, tuple[int, ...]]:
    """Every tensor the drafter's computation needs, with its shape (built on the meta device,
    so the one definition of the layers is ConditionedDrafter's)."""
    with torch.device("meta"):
        model = ConditionedDrafter(layout.config)
    return {k: tuple(v.shape) for k, v in model.trained_state().items()
            if k != "mask_embedding"}


def check_tensors(path: str | Path, layout: DFlashLayout) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors against the layout, from file headers: each missing, misshapen
    or unknown tensor is named. Returns the shapes found."""
    found = tensor_shapes(weight_files(path))
    expected = _expected_shapes(layout)
    cfg = layout.config
    rows = layout.draft_vocab_size or cfg.vocab_size
    optional = {D2T: (rows,), OWN_HEAD: (rows, cfg.hidden_size),
                OWN_EMBEDDING: (cfg.vocab_size, cfg.hidden_size)}
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ValueError(f"DFlash checkpoint {str(path)!r} lacks tensor(s) {missing[:6]}"
                         f"{' ...' if len(missing) > 6 else ''} (it must store fc, hidden_norm, "
                         f"norm and all {cfg.num_hidden_layers} layers)")
    unknown = sorted(k for k in found if k not in expected and k not in optional
                     and k not in IGNORED and not k.endswith("rotary_emb.inv_freq"))
    if unknown:
        raise ValueError(f"DFlash checkpoint {str(path)!r} has tensor(s) this drafter does not "
                         f"use: {unknown[:6]} (an unsupported DFlash variant?)")
    for name, shape in {**expected, **optional}.items():
        if name in found and found[name] != shape:
            raise ValueError(f"tensor {name!r} of {str(path)!r} has shape {found[name]}; its "
                             f"config.json implies {shape}")
    if layout.draft_vocab_size is not None and D2T not in found:
        raise ValueError(f"DFlash checkpoint {str(path)!r} declares draft_vocab_size "
                         f"{layout.draft_vocab_size} but stores no d2t table")
    return found


def _verifier_sizes(verifier: str | Path) -> dict:
    cfg = read_json_object(Path(verifier) / "config.json")
    return cfg.get("text_config") or cfg


def read_mask_embedding(path: str | Path, mask_token_id: int, hidden: int
                        ) -> torch.Tensor | None:
    """`mask_embedding.pt` (a tensor, or {"mask_token_id", "embedding"}), read as plain tensors
    (`weights_only`: no code runs), or None when the checkpoint has none."""
    file = Path(path) / MASK_EMBEDDING_FILE
    if not file.is_file():
        return None
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises several types for a bad file
        raise ValueError(f"{str(file)!r} is not a readable tensor file: {e}") from None
    if isinstance(state, dict):
        if state.get("mask_token_id", mask_token_id) != mask_token_id:
            raise ValueError(f"{str(file)!r} is for mask_token_id {state['mask_token_id']}, "
                             f"the config names {mask_token_id}")
        state = state.get("embedding")
    if not isinstance(state, torch.Tensor) or state.numel() != hidden:
        raise ValueError(f"{str(file)!r} must hold a mask embedding of {hidden} values")
    return state.reshape(-1).float()


def load_dflash(path: str | Path, cfg: dict, verifier: str | Path) -> ConditionedDrafter:
    """A DFlash checkpoint as a float32 `ConditionedDrafter` sharing the verifier's embedding and
    head (or the checkpoint's own, when it ships them)."""
    sizes = _verifier_sizes(verifier)
    layout = read_layout(cfg, path, int(sizes["num_hidden_layers"]))
    c = layout.config
    for name, want in (("hidden_size", c.hidden_size), ("vocab_size", c.vocab_size)):
        if sizes.get(name) != want:
            raise ValueError(f"DFlash drafter {str(path)!r} has {name} {want}, the verifier "
                             f"{str(verifier)!r} {sizes.get(name)}: it was built for another "
                             "model")
    check_tensors(path, layout)
    state = {k: v.float() for k, v in read_weights(path).items()}
    d2t = None
    if D2T in state:  # offsets: target id = draft id + d2t[draft id]
        d2t = torch.arange(state[D2T].numel()) + state[D2T].long()
        if int(d2t.min()) < 0 or int(d2t.max()) >= c.vocab_size:
            raise ValueError(f"d2t of {str(path)!r} maps outside the verifier's {c.vocab_size} "
                             "ids")
    model = ConditionedDrafter(c)
    model.load_shared(verifier, d2t)
    trained = {k: v for k, v in state.items() if k in _expected_shapes(layout)}
    with torch.no_grad():
        for name, tensor in trained.items():
            model.get_parameter(name).copy_(tensor)
        for name in (OWN_EMBEDDING, OWN_HEAD):
            if name in state:
                model.get_parameter(name).copy_(state[name])
        mask = read_mask_embedding(path, layout.mask_token_id, c.hidden_size)
        if mask is None:
            if not 0 <= layout.mask_token_id < c.vocab_size:
                raise ValueError(f"mask_token_id {layout.mask_token_id} of {str(path)!r} is not "
                                 f"a row of the {c.vocab_size}-row embedding and no "
                                 f"{MASK_EMBEDDING_FILE} replaces it")
            mask = model.embed_tokens.weight[layout.mask_token_id]
        model.mask_embedding.copy_(mask)
    return model
