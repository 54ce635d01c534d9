"""Slim drafter checkpoints: store only what the verifier cannot rebuild.

A drafter trained from a verifier keeps some tensors exactly as the verifier has them (the frozen
input embedding, for one). Shipping those twice would waste most of the repository's size budget,
so `slim_checkpoint` writes only the tensors (and the extra rows, e.g. the mask embedding) that
differ, in float16, plus a manifest naming the verifier tensors to copy back and their SHA-256;
`expand_checkpoint` rebuilds the full drafter directory from the verifier and refuses a verifier
whose tensors do not hash as recorded (another conversion or another model).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .checkpoint import read_weights
from .vocab import D2T_FILE, copy_tokenizer_files

WEIGHTS_FILE = "weights.safetensors"
MANIFEST_FILE = "derived.json"
TAIL_SUFFIX = ":tail"  # rows a drafter tensor has beyond the verifier's copy (e.g. the mask)
STORE_DTYPE = torch.float16
# Where a drafter tensor may come from when the verifier has no tensor of the same name: a
# verifier with tied embeddings stores no LM head, its embedding is the head.
ALIASES = {"lm_head.weight": "model.embed_tokens.weight"}


def tensor_sha256(tensor: torch.Tensor) -> str:
    """Hash of the float32 values (what the drafter is rebuilt and run with)."""
    data = tensor.detach().to(torch.float32).contiguous().cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def _store(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(STORE_DTYPE) if tensor.is_floating_point() else tensor


def slim_checkpoint(drafter_dir: str | Path, verifier_dir: str | Path,
                    out_dir: str | Path) -> dict[str, int]:
    """Write `out_dir` (config.json, weights.safetensors, derived.json); returns byte counts."""
    drafter_dir, out_dir = Path(drafter_dir), Path(out_dir)
    drafter = read_weights(drafter_dir)
    wanted = set(drafter) | {ALIASES[n] for n in drafter if n in ALIASES}
    verifier = read_weights(verifier_dir, lambda name: name in wanted)
    stored: dict[str, torch.Tensor] = {}
    derived: dict[str, dict] = {}
    for name, tensor in drafter.items():
        origin = name if name in verifier else ALIASES.get(name, name)
        source = verifier.get(origin)
        rows = source.shape[0] if source is not None else 0
        if source is not None and tensor.shape[1:] == source.shape[1:] \
                and tensor.shape[0] >= rows and torch.equal(tensor[:rows], source.to(tensor.dtype)):
            derived[name] = {"from": origin, "rows": rows, "sha256": tensor_sha256(source)}
            if tensor.shape[0] > rows:
                stored[name + TAIL_SUFFIX] = _store(tensor[rows:])
        else:
            stored[name] = _store(tensor)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in stored.items()}, str(out_dir / WEIGHTS_FILE),
              metadata={"format": "pt"})
    (out_dir / MANIFEST_FILE).write_text(json.dumps(derived, indent=2, sort_keys=True) + "\n")
    shutil.copyfile(drafter_dir / "config.json", out_dir / "config.json")
    return {"stored_bytes": (out_dir / WEIGHTS_FILE).stat().st_size,
            "derived_tensors": len(derived)}


def expand_checkpoint(slim_dir: str | Path, verifier_dir: str | Path,
                      out_dir: str | Path) -> Path:
    """Rebuild a full float32 drafter directory from a slim one and its verifier."""
    slim_dir, out_dir = Path(slim_dir), Path(out_dir)
    stored = load_file(str(slim_dir / WEIGHTS_FILE))
    derived = json.loads((slim_dir / MANIFEST_FILE).read_text())
    sources = read_weights(verifier_dir, lambda name: name in {d["from"] for d in derived.values()})
    full: dict[str, torch.Tensor] = {}
    for name, spec in derived.items():
        source = sources.get(spec["from"])
        if source is None:
            raise ValueError(f"verifier {str(verifier_dir)!r} has no tensor {spec['from']!r} "
                             f"(needed to rebuild the drafter's {name!r})")
        if source.shape[0] != spec["rows"] or tensor_sha256(source) != spec["sha256"]:
            raise ValueError(f"verifier tensor {spec['from']!r} in {str(verifier_dir)!r} differs "
                             f"from the one the drafter in {str(slim_dir)!r} was trained with "
                             "(another model or another conversion)")
        parts = [source.to(torch.float32)]
        tail = stored.pop(name + TAIL_SUFFIX, None)
        if tail is not None:
            parts.append(tail.to(torch.float32))
        full[name] = torch.cat(parts)
    for name, tensor in stored.items():
        full[name] = tensor.to(torch.float32) if tensor.is_floating_point() else tensor
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in full.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    shutil.copyfile(slim_dir / "config.json", out_dir / "config.json")
    if (slim_dir / D2T_FILE).is_file():  # a reduced head, applied by load_drafter
        shutil.copyfile(slim_dir / D2T_FILE, out_dir / D2T_FILE)
    copy_tokenizer_files(verifier_dir, out_dir)
    return out_dir
