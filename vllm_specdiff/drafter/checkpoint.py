"""Reading HF-style checkpoint directories (config.json + safetensors), offline, no remote code.

Weights are read tensor by tensor with safetensors, optionally only the names a format needs (the
block-causal drafter takes a few layers of a large model), and modules are built on the meta device
and filled with `assign=True`, so a 7B checkpoint is held in memory once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


def read_config(model_dir: str | Path) -> dict:
    """config.json of `model_dir` as a dict; FileNotFoundError naming the path if absent."""
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"drafter directory {str(path)!r} does not exist")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{str(config_path)!r} not found: a drafter directory needs "
                                "config.json and safetensors weights")
    return json.loads(config_path.read_text())


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint (single file or sharded with an index)."""
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {str(index)!r} are missing: {missing}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    raise FileNotFoundError(
        f"no safetensors weights in {str(path)!r} (expected model.safetensors or "
        "model.safetensors.index.json; .bin checkpoints are not supported, convert them first)")


def read_weights(model_dir: str | Path,
                 keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint (or those whose name passes `keep`), on CPU."""
    out: dict[str, torch.Tensor] = {}
    for file in weight_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if keep is None or keep(name):
                    out[name] = f.get_tensor(name)
    return out


def load_into(module: nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Strictly load `state_dict` into a (meta-initialised) module, with a readable error.

    Saved RoPE inverse frequencies (some remote-code checkpoints persist them) are dropped: they
    are recomputed from the config.
    """
    state_dict = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    expected = set(module.state_dict().keys())
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ValueError(f"weights of {source!r} do not match the model: missing {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{' ...' if len(unexpected) > 5 else ''}")
    own = module.state_dict()
    for name, tensor in state_dict.items():
        if tuple(own[name].shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r} of {source!r} has shape {tuple(tensor.shape)}, "
                             f"the config implies {tuple(own[name].shape)}")
    module.load_state_dict(state_dict, strict=True, assign=True)


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Accept torch dtypes or the strings 'float32'/'bfloat16'/'float16'."""
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {dtype!r}")
    return table[dtype]
