"""Merging a PEFT LoRA adapter into the drafter's weights at load time.

Streak-distillation saves a standard PEFT adapter directory (adapter_config.json +
adapter_model.safetensors) made by wrapping the Drafter module with peft. Merging once at load
(W += scale * B @ A) makes drafting cost exactly the base model's. Done here in plain torch, so
inference does not need peft installed; tests check it against peft's own unmerged forward.
Anything that does not fit the base model (unknown module, wrong shape, unsupported variant)
raises a ValueError instead of being skipped.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from .checkpoint import read_json_object, require_dir, tensor_shapes

_PREFIXES = ("base_model.model.", "base_model.")
_LORA_KEY = re.compile(r"^(.*)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B)(\.[^.]+)?"
                       r"(\.weight)?$")


def check_adapter_dir(adapter_dir: str | Path) -> tuple[dict, Path]:
    """adapter_config.json (a JSON object) and the weights file of a PEFT adapter directory,
    checked without loading tensors; errors name the file and what is wrong."""
    path = require_dir(adapter_dir, "LoRA adapter")
    cfg_path = path / "adapter_config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{str(cfg_path)!r} not found (not a PEFT adapter directory)")
    cfg = read_json_object(cfg_path)
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        found = " (adapter_model.bin is not read)" if (path / "adapter_model.bin").exists() else ""
        raise FileNotFoundError(f"{str(weights)!r} not found{found}: save the adapter with "
                                "safe_serialization=True")
    if not tensor_shapes([weights]):
        raise ValueError(f"{str(weights)!r} holds no tensors")
    return cfg, weights


def _module_key(key: str) -> str:
    """A saved adapter tensor name relative to the wrapped drafter (peft's prefix removed)."""
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def check_adapter_fits(adapter_dir: str | Path, weight_shapes: dict[str, tuple[int, ...]],
                       shared: dict[str, str] | None = None) -> None:
    """Raise ValueError if an A/B pair targets a module the drafter's weights (names and shapes
    from the checkpoint's headers) do not have, or would give an update of the wrong shape.

    shared: modules the drafter takes from elsewhere (not in its files, never adapted), each
    with the reason, so such a target is refused with that reason instead of "does not have".
    """
    _, weights = check_adapter_dir(adapter_dir)
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in tensor_shapes([weights]).items():
        m = _LORA_KEY.match(_module_key(key))
        if m and m.group(3) != ".bias":
            pairs.setdefault(m.group(1), {})[m.group(2)] = shape
    for name, parts in sorted(pairs.items()):
        if shared and name in shared:
            raise ValueError(f"LoRA adapter {str(weights)!r} does not match the base model: it "
                             f"targets {name!r}, {shared[name]}")
        weight = next((w for w in (f"{name}.weight", f"model.{name}.weight")
                       if w in weight_shapes), None)
        if weight is None:
            raise ValueError(f"LoRA adapter {str(weights)!r} does not match the base model: "
                             f"it targets {name!r}, which the drafter does not have")
        embedding = "lora_embedding_A" in parts
        a = parts.get("lora_embedding_A" if embedding else "lora_A")
        b = parts.get("lora_embedding_B" if embedding else "lora_B")
        if a is None or b is None or len(a) != 2 or len(b) != 2:
            continue  # merge_lora names the incomplete pair
        update = (a[1], b[0]) if embedding else (b[0], a[1])
        if update != weight_shapes[weight]:
            raise ValueError(f"LoRA adapter {str(weights)!r} does not match the base model: update "
                             f"for {name!r} has shape {update}, weight is "
                             f"{weight_shapes[weight]}")


def _read_adapter(adapter_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg, weights = check_adapter_dir(adapter_dir)
    return cfg, load_file(str(weights))


def _pattern_value(patterns: dict, module_name: str, default: float) -> float:
    """peft's rank/alpha_pattern lookup: a key matches a module name ending in '.key'."""
    for key, value in (patterns or {}).items():
        if module_name == key or re.match(rf"(.*\.)?{key}$", module_name):
            return value
    return default


def _resolve(root: nn.Module, name: str, adapter: str) -> tuple[str, nn.Module]:
    """The module called `name` in the drafter (also accepting names relative to `.model`)."""
    for candidate in (name, f"model.{name}"):
        try:
            return candidate, root.get_submodule(candidate)
        except AttributeError:
            continue
    raise ValueError(f"LoRA adapter {adapter!r} does not match the base model: it targets "
                     f"{name!r}, which the drafter does not have")


def merge_lora(drafter: nn.Module, adapter_dir: str | Path) -> list[str]:
    """Merge the adapter into `drafter` in place; returns the merged module names."""
    adapter_dir = Path(adapter_dir)
    cfg, tensors = _read_adapter(adapter_dir)
    source = str(adapter_dir)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {source!r} is peft_type={cfg.get('peft_type')!r}; only LORA")
    if cfg.get("use_dora"):
        raise ValueError(f"adapter {source!r} uses DoRA, which is not supported")
    if cfg.get("fan_in_fan_out"):
        raise ValueError(f"adapter {source!r} sets fan_in_fan_out, which is not supported")
    if cfg.get("lora_bias"):
        raise ValueError(f"adapter {source!r} sets lora_bias, which is not supported (the "
                         "drafter's projections have no bias to merge it into)")
    lora: dict[str, dict[str, torch.Tensor]] = {}
    full: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        name = _module_key(key)
        m = _LORA_KEY.match(name)
        if m and m.group(3) == ".bias":
            raise ValueError(f"adapter {source!r} holds a LoRA bias ({key}), which is not "
                             "supported")
        if m:
            lora.setdefault(m.group(1), {})[m.group(2)] = tensor
        else:
            full[name.replace(".modules_to_save.default", "").replace(".base_layer", "")] = tensor
    if not lora and not full:
        raise ValueError(f"adapter {source!r} holds no weights")
    own = dict(drafter.named_parameters())
    merged = []
    with torch.no_grad():
        for name, parts in sorted(lora.items()):
            module_name, module = _resolve(drafter, name, source)
            embedding = "lora_embedding_A" in parts or "lora_embedding_B" in parts
            a = parts.get("lora_embedding_A" if embedding else "lora_A")
            b = parts.get("lora_embedding_B" if embedding else "lora_B")
            if a is None or b is None:
                raise ValueError(f"adapter {source!r} has an incomplete A/B pair for {name!r}")
            rank = a.shape[0]
            alpha = _pattern_value(cfg.get("alpha_pattern"), module_name, cfg.get("lora_alpha", 8))
            scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
            delta = (b.float() @ a.float()) * scale
            if isinstance(module, nn.Embedding):
                delta = delta.T
            elif not isinstance(module, nn.Linear):
                raise ValueError(f"adapter {source!r} targets {module_name!r}, a "
                                 f"{type(module).__name__}; only Linear/Embedding are supported")
            if tuple(delta.shape) != tuple(module.weight.shape):
                raise ValueError(f"LoRA adapter {source!r} does not match the base model: update "
                                 f"for {module_name!r} has shape {tuple(delta.shape)}, weight is "
                                 f"{tuple(module.weight.shape)}")
            module.weight.copy_((module.weight.float() + delta).to(module.weight.dtype))
            merged.append(module_name)
        for name, tensor in sorted(full.items()):
            target = name if name in own else f"model.{name}"
            if target not in own or own[target].shape != tensor.shape:
                raise ValueError(f"LoRA adapter {source!r} does not match the base model: saved "
                                 f"module weight {name!r} has no same-shaped drafter parameter")
            own[target].copy_(tensor.to(own[target].dtype))
            merged.append(target)
    return merged
