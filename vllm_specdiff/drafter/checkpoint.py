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


def require_dir(path: str | Path, what: str) -> Path:
    """`path` if it is a directory; otherwise FileNotFoundError saying what it is instead. The
    one directory check of drafter, adapter and option paths."""
    path = Path(path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise FileNotFoundError(f"{what} path {str(path)!r} is a file, not a directory")
    raise FileNotFoundError(f"{what} directory {str(path)!r} does not exist")


def read_json_object(path: Path) -> dict:
    """A JSON object file; errors name the file and what is wrong with it."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object, not {type(value).__name__}")
    return value


def read_config(model_dir: str | Path) -> dict:
    """config.json of `model_dir` as a dict; errors name the path and the problem."""
    path = require_dir(model_dir, "drafter")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{str(config_path)!r} not found: a drafter directory needs "
                                "config.json and safetensors weights")
    return read_json_object(config_path)


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


def tensor_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in safetensors files, from their headers (no data read);
    a file that is not safetensors raises ValueError naming it."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"{str(file)!r} is not a readable safetensors file: {e}") from None
    return shapes


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
