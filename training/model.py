"""Building the trainable drafter: load or initialise it, attach LoRA or choose what to fine-tune,
and write the result in the form the proposer loads (a PEFT adapter, or a full drafter directory).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from torch import nn

from vllm_specdiff.drafter.base import Drafter

if TYPE_CHECKING:
    from .causal import CausalLMDrafter

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
DATA_VOCAB_FILE = "d2t.safetensors"  # train --draft-vocab-size: the table built from the data
# block-causal: token ids only; conditioned: DFlash-style KV injection of the verifier's features
# (new layers on --init-from VERIFIER, or a trained conditioned drafter given by --drafter).
ARCHS = ("block-causal", "conditioned")


def check_arch(arch: str) -> None:
    """Refuse an architecture `train` does not build, for a new run, a resumed one or a saved
    checkpoint alike (`injected`, removed, by name)."""
    if arch == "injected":
        raise ValueError("--arch injected (a block-causal drafter plus verifier-feature "
                         "injection) was removed: it lost the design comparison to --arch "
                         "conditioned, and its runs and checkpoints can no longer be trained, "
                         "resumed or loaded")
    if arch not in ARCHS:
        raise ValueError(f"--arch must be {' or '.join(ARCHS)}, got {arch!r}")


def build_drafter(drafter: str | None, init_from: str | None, num_layers: int,
                  draft_vocab: str | None = None, lora: str | None = None,
                  objective: str = "diffusion") -> Drafter | CausalLMDrafter:
    """An existing drafter directory (`--drafter`, optionally with a LoRA merged in), or a new
    block-causal drafter from the first layers of a causal LM (`--init-from`). With
    `objective="ar"`, the same two sources give a plain causal LM (`training.causal`)."""
    if (drafter is None) == (init_from is None):
        raise ValueError("pass exactly one of --drafter (a drafter directory) or --init-from "
                         "(a causal LM directory to build a block-causal drafter from)")
    if objective == "ar":
        from .causal import load_causal_drafter

        return load_causal_drafter(drafter or init_from, None if drafter else num_layers)
    if drafter is not None:
        from vllm_specdiff.drafter.loading import load_drafter

        if not Path(drafter).is_dir():
            raise FileNotFoundError(f"--drafter {drafter}: not a directory")
        return load_drafter(drafter, lora=lora, cache_size=0)
    from vllm_specdiff.drafter.block_causal import BlockCausalDrafter

    if not Path(init_from).is_dir():
        raise FileNotFoundError(f"--init-from {init_from}: not a directory")
    d2t = None
    if draft_vocab is not None:
        from vllm_specdiff.drafter.vocab import load_d2t

        d2t = load_d2t(Path(draft_vocab))
    out = BlockCausalDrafter.from_causal_lm(init_from, num_layers, draft_to_verifier=d2t,
                                            cache_size=0)
    if lora is not None:
        from vllm_specdiff.drafter.lora import merge_lora

        merge_lora(out, lora)
    return out


class WindowModel(nn.Module):
    """Routes `window_logits` through `forward` so DDP sees (and syncs) every training call."""

    def __init__(self, drafter: Drafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, input_ids: torch.Tensor, starts: torch.Tensor, gamma: int,
                features: torch.Tensor | None = None) -> torch.Tensor:
        if features is None:
            return self.drafter.window_logits(input_ids, starts, gamma)
        return self.drafter.window_logits(input_ids, starts, gamma, features)


def conditioned_taps(verifier: str, num_taps: int) -> tuple[int, ...]:
    """The verifier layers a new conditioned drafter taps (DFlash's spread)."""
    from vllm_specdiff.drafter.checkpoint import read_config
    from vllm_specdiff.drafter.conditioned import spread_taps

    return spread_taps(int(read_config(verifier)["num_hidden_layers"]), num_taps)


def feature_source(cfg: dict) -> str | None:
    """The verifier whose hidden states a `train` config's drafter reads (None: token ids
    only): --init-from for a conditioned drafter."""
    return cfg.get("init_from") if cfg.get("arch") == "conditioned" else None


def config_taps(cfg: dict) -> tuple[int, ...]:
    """The verifier layers a `train` config's drafter reads: those of the conditioned drafter it
    starts from (and --add-taps), else `num_taps` spread over the verifier (none for token-only
    drafters)."""
    from vllm_specdiff.drafter.checkpoint import read_config

    if cfg.get("arch") == "conditioned" and cfg.get("drafter"):
        from vllm_specdiff.drafter.conditioned import merged_taps

        return merged_taps(tuple(read_config(cfg["drafter"])["target_layer_ids"]),
                           cfg.get("add_taps", []))
    source = feature_source(cfg)
    return conditioned_taps(source, cfg["num_taps"]) if source else ()


def build_conditioned(verifier: str, num_layers: int, taps: tuple[int, ...], gamma: int,
                      draft_vocab: str | None, seed: int) -> nn.Module:
    """A new verifier-conditioned drafter: random layers, the verifier's embedding and head."""
    from vllm_specdiff.drafter.checkpoint import read_config
    from vllm_specdiff.drafter.conditioned import ConditionedConfig, ConditionedDrafter
    from vllm_specdiff.drafter.vocab import load_d2t

    if not Path(verifier).is_dir():
        raise FileNotFoundError(f"--init-from {verifier}: not a directory")
    base = ConditionedConfig.for_verifier(read_config(verifier), num_layers=num_layers,
                                          num_taps=len(taps), block_size=gamma + 1)
    cfg = dataclasses.replace(base, target_layer_ids=taps)
    d2t = load_d2t(Path(draft_vocab)) if draft_vocab is not None else None
    return ConditionedDrafter.from_verifier(verifier, cfg, seed, d2t)


def with_markov_head(drafter: nn.Module, cfg: dict) -> nn.Module:
    """The conditioned drafter with the Markov head `--add-markov-rank` asks for (W_out zero:
    the same drafts until training moves it); a drafter that has one already is refused."""
    rank = cfg.get("add_markov_rank", 0)
    if not rank:
        return drafter
    if drafter.markov is not None:
        raise ValueError(f"--add-markov-rank {rank}: --drafter {cfg.get('drafter')} already has "
                         f"a Markov head (rank {drafter.cfg.markov_rank}); train it without "
                         f"--add-markov-rank")
    drafter.add_markov(rank, cfg["seed"])
    return drafter


def build_for_arch(cfg: dict, draft_vocab: str | None) -> nn.Module:
    """The drafter a `train` config starts from: one place for `train` and for rebuilding
    checkpoints."""
    arch = cfg.get("arch", "block-causal")
    check_arch(arch)
    if arch == "conditioned" and cfg.get("drafter"):  # trained weights, e.g. a shipped drafter
        from vllm_specdiff.drafter.conditioned import ConditionedDrafter

        drafter = ConditionedDrafter.from_pretrained(cfg["drafter"], feature_source(cfg))
        if drafter.cfg.gamma != cfg["gamma"]:
            raise ValueError(f"--drafter {cfg['drafter']} drafts {drafter.cfg.gamma} tokens per "
                             f"block: train it with --gamma {drafter.cfg.gamma}")
        if cfg.get("add_layers"):
            drafter.deepen(cfg["add_layers"], cfg["seed"])
        if cfg.get("add_taps"):
            drafter.add_taps(cfg["add_taps"])
        return with_markov_head(drafter, cfg)
    if arch == "conditioned":
        return with_markov_head(build_conditioned(
            feature_source(cfg), cfg["num_layers"], config_taps(cfg), cfg["gamma"], draft_vocab,
            cfg["seed"]), cfg)
    return build_drafter(cfg["drafter"], cfg["init_from"], cfg["num_layers"], draft_vocab,
                         cfg["init_lora"], cfg.get("objective", "diffusion"))


def add_lora(drafter: Drafter, rank: int, alpha: float, dropout: float,
             targets: list[str]) -> object:
    """Inject LoRA layers (peft) and freeze everything else; returns the LoraConfig."""
    from peft import LoraConfig, inject_adapter_in_model

    if rank < 1:
        raise ValueError(f"--lora-rank must be >= 1, got {rank}")
    present = {name.rsplit(".", 1)[-1] for name, m in drafter.named_modules()
               if isinstance(m, nn.Linear)}
    missing = [t for t in targets if t not in present]
    if missing:
        raise ValueError(f"--lora-targets {','.join(missing)}: no such linear module in the "
                         f"drafter (it has {', '.join(sorted(present))})")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                        bias="none")
    inject_adapter_in_model(config, drafter)
    for name, p in drafter.named_parameters():
        p.requires_grad_("lora_" in name)
    return config


def merge_lora_layers(drafter: nn.Module) -> nn.Module:
    """Fold peft's injected LoRA layers into their base weights (W += scale * B @ A) and put the
    plain base layers back, so the drafter saves as a full directory (a conditioned run's
    export writes merged weights: vLLM's `dflash` method takes no adapter)."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(drafter.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            parent = drafter.get_submodule(parent_name) if parent_name else drafter
            setattr(parent, child, module.get_base_layer())
    return drafter


def select_trainable(drafter: Drafter, train: list[str], freeze: list[str]) -> list[str]:
    """Full fine-tuning of chosen parts: parameters matching a `train` regex and no `freeze` one."""
    names = []
    for name, p in drafter.named_parameters():
        on = any(re.search(t, name) for t in train) and not any(re.search(f, name) for f in freeze)
        p.requires_grad_(on)
        if on:
            names.append(name)
    if not names:
        raise ValueError(f"--train {train} / --freeze {freeze} leave no trainable parameter")
    return names


def enable_gradient_checkpointing(drafter: Drafter) -> int:
    """Recompute each decoder layer in backward (transformers' layers support it natively)."""
    from torch.utils.checkpoint import checkpoint

    count = 0
    for module in drafter.modules():
        if hasattr(module, "_gradient_checkpointing_func") or \
                type(module).__name__.endswith("DecoderLayer"):
            module.gradient_checkpointing = True
            module._gradient_checkpointing_func = functools.partial(checkpoint,
                                                                    use_reentrant=False)
            count += 1
    if count == 0:
        raise ValueError("--gradient-checkpointing: this drafter has no checkpointable layers")
    return count


def trainable_state(drafter: Drafter) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in drafter.named_parameters() if p.requires_grad}


def load_trainable_state(drafter: Drafter, state: dict[str, torch.Tensor]) -> None:
    params = dict(drafter.named_parameters())
    unknown = [k for k in state if k not in params]
    if unknown:
        raise ValueError(f"checkpoint holds parameters this drafter lacks: {unknown[:3]}")
    with torch.no_grad():
        for k, v in state.items():
            params[k].copy_(v)


def save_adapter(drafter: Drafter, lora_config: object, path: Path, base: str | None) -> Path:
    """Write a standard PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
    from peft import get_peft_model_state_dict

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = get_peft_model_state_dict(drafter)
    save_file({PEFT_PREFIX + k: v.detach().contiguous().cpu() for k, v in state.items()},
              str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    lora_config.base_model_name_or_path = base
    lora_config.save_pretrained(str(path))
    return path


def save_full(drafter: Drafter, path: Path) -> Path:
    """Merged weights for full fine-tuning: a drafter directory `load_drafter` reads."""
    if not hasattr(drafter, "save_pretrained"):
        raise ValueError(f"{type(drafter).__name__} cannot be saved as a full drafter directory; "
                         f"use --finetune lora")
    drafter.save_pretrained(path)
    return Path(path)


def drafter_from_checkpoint(path: Path) -> Drafter | CausalLMDrafter:
    """Rebuild the drafter of a `train` checkpoint (base + its trained weights), in eval mode."""
    from safetensors.torch import load_file

    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    cfg = state["config"]
    draft_vocab = cfg["draft_vocab"]
    if cfg.get("draft_vocab_size") and draft_vocab is None:  # built by the run: out/d2t.safetensors
        draft_vocab = str(path.parent.parent / DATA_VOCAB_FILE)
    drafter = build_for_arch(cfg, draft_vocab)
    if cfg["finetune"] == "lora":
        add_lora(drafter, cfg["lora_rank"], cfg["lora_alpha"], 0.0, cfg["lora_targets"])
    load_trainable_state(drafter, load_file(str(path / "trainable.safetensors")))
    return drafter.eval()


def write_json(path: Path, obj: dict) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
