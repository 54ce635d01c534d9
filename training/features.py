"""The verifier's tapped hidden states for a conditioned drafter, cached beside the data.

A conditioned drafter is trained on teacher-forced verifier features: for every token of every
data sequence, the outputs of the tapped verifier layers (DFlash's convention: tap L is the output
of decoder layer L, the residual stream vLLM captures before layer L + 1, Hugging Face's
`hidden_states[L + 1]`). Computing them is one verifier forward per sequence, so they are cached
per data shard in `DATA_DIR/features-L<taps>/` (float16) and rebuilt when missing; the cache is
derived data, never committed.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from .data import SequenceData, data_dirs
from .feature_rows import FeatureRows, map_safetensor

log = logging.getLogger(__name__)


FEATURES_PREFIX = "features-L"  # a data directory's feature folders: features-L1-14-27, ...


def features_dir(data_dir: Path, taps: tuple[int, ...]) -> Path:
    return Path(data_dir) / (FEATURES_PREFIX + "-".join(str(t) for t in taps))


def dir_taps(features: Path) -> tuple[int, ...]:
    """The taps a feature folder holds (features_dir's inverse; none for a foreign name)."""
    parts = Path(features).name[len(FEATURES_PREFIX):].split("-")
    return tuple(int(t) for t in parts) if all(t.isdigit() for t in parts) else ()


def feature_dirs(data_dir: Path) -> list[Path]:
    """Every feature folder of a data directory, whatever taps it holds."""
    return sorted(p for p in Path(data_dir).glob(FEATURES_PREFIX + "*") if p.is_dir())


def load_verifier(verifier_dir: str | Path, device: str = "cpu") -> torch.nn.Module:
    """The verifier for a teacher-forced pass: bf16 on GPUs (what it computes is stored in
    float16 either way), float32 on the CPU; in eval mode."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return AutoModelForCausalLM.from_pretrained(str(verifier_dir), dtype=dtype).eval()


class TapModel:
    """The verifier truncated after its deepest tap, with hooks that keep each tap's output."""

    def __init__(self, verifier_dir: str | Path, taps: tuple[int, ...], device: str = "cpu"
                 ) -> None:
        decoder = load_verifier(verifier_dir, device).model
        n = len(decoder.layers)
        if max(taps) >= n:
            raise ValueError(f"tap {max(taps)} is not a layer of the {n}-layer verifier")
        decoder.layers = decoder.layers[:max(taps) + 1]
        self.decoder = decoder.to(device).eval()
        self.taps = taps
        self.device = device
        self._out: dict[int, torch.Tensor] = {}
        for t in set(taps):
            decoder.layers[t].register_forward_hook(self._keeper(t))

    def _keeper(self, index: int):  # noqa: ANN202
        def hook(_module: torch.nn.Module, _inputs: object, output: object) -> None:
            self._out[index] = output[0] if isinstance(output, tuple) else output
        return hook

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Tapped states [B,T,taps*H] (float32) of input_ids[B,T]."""
        self._out.clear()
        self.decoder(input_ids=input_ids.to(self.device), use_cache=False)
        return torch.cat([self._out[t] for t in self.taps], dim=-1).float()


def build_shard_features(tap: TapModel, shard: Path, out: Path) -> None:
    """One verifier forward per sequence of a shard; written atomically (resumable)."""
    data = load_file(str(shard))
    tokens, offsets = data["tokens"].long(), data["seq_offsets"].long()
    parts = []
    for i in range(offsets.numel() - 1):
        seq = tokens[offsets[i]:offsets[i + 1]]
        parts.append(tap(seq[None])[0].to(torch.float16))
    tmp = out.with_suffix(f".{os.getpid()}.tmp")  # two builders never share a temporary
    save_file({"features": torch.cat(parts).contiguous()}, str(tmp))
    tmp.replace(out)


def slice_stored_features(shard: Path, taps: tuple[int, ...], out: Path) -> bool:
    """Write a shard's features for `taps` from a stored feature shard of more taps (its
    columns, no verifier forward): features built once for many taps serve every subset."""
    for folder in feature_dirs(shard.parent):
        have = dir_taps(folder)
        source = folder / shard.name
        if folder == out.parent or not set(taps) <= set(have) or not source.is_file():
            continue
        rows = map_safetensor(source, "features")
        width = rows.shape[1] // len(have)
        columns = torch.cat([torch.arange(have.index(t) * width, (have.index(t) + 1) * width)
                             for t in taps])
        out.parent.mkdir(exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        save_file({"features": rows.index_select(1, columns).contiguous()}, str(tmp))
        tmp.replace(out)
        return True
    return False


def ensure_features(shards: list[Path], verifier_dir: str | Path, taps: tuple[int, ...],
                    device: str = "cpu") -> list[Path]:
    """The feature shard of every data shard: stored, sliced from a stored superset, or
    computed."""
    # beside the shard's real file, so that a folder of links to shards shares their cache
    real = [s.resolve() for s in shards]
    paths = [features_dir(s.parent, taps) / s.name for s in real]
    build_missing(list(zip(real, paths, strict=True)),
                  lambda: functools.partial(build_shard_features,
                                            TapModel(verifier_dir, taps, device)),
                  f"verifier features (taps {list(taps)})",
                  ready=lambda s, p: p.is_file() or slice_stored_features(s, taps, p))
    return paths


def build_missing(pairs: list[tuple[Path, Path]], make_builder: Callable[[], Callable],
                  what: str, ready: Callable[[Path, Path], bool] = lambda _s, p: p.is_file()
                  ) -> None:
    """Write each (shard, output) not `ready` with `make_builder()(shard, output)`, the builder
    made only when something is missing. Under torchrun each process owns every world-th pair
    (split before looking at what exists, so ranks that start apart never both skip a shard)
    and waits for the others'."""
    rank, world = launched_rank()
    mine = [(s, p) for s, p in pairs[rank::world] if not ready(s, p)]
    if mine:
        log.info("computing %s for %d shards", what, len(mine))
        build = make_builder()
        for shard, out in tqdm(mine, desc=what, unit="shard", disable=rank != 0):
            out.parent.mkdir(exist_ok=True)
            build(shard, out)
    if world > 1:
        wait_for_files([p for _, p in pairs])


def launched_rank() -> tuple[int, int]:
    """(rank, world size) of a process that torchrun started; (0, 1) otherwise."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def wait_for_files(paths: list[Path], timeout_s: float = 24 * 3600.0) -> None:
    """Until the other ranks have written their shards (files appear atomically): no process
    group is needed, so `build_features` runs under torchrun as it does alone."""
    deadline = time.monotonic() + timeout_s
    while not all(p.is_file() for p in paths):
        if time.monotonic() > deadline:
            missing = [str(p) for p in paths if not p.is_file()]
            raise TimeoutError(f"feature shards never appeared (another rank failed?): "
                               f"{missing[:3]}")
        time.sleep(1.0)


def build_features(data: str | Path, verifier_dir: str | Path, taps: tuple[int, ...],
                   device: str = "cpu") -> int:
    """Compute the missing feature shards of every data shard that exists now (a resumable
    stage of its own, so training does not wait for it); returns the shards built."""
    shards = [s for d in data_dirs(data) for s in sorted(d.glob("shard-*.safetensors"))]
    before = sum((features_dir(s.resolve().parent, taps) / s.resolve().name).is_file()
                 for s in shards)
    ensure_features(shards, verifier_dir, taps, device)
    return len(shards) - before


def attach_features(seqs: SequenceData, verifier_dir: str | Path, taps: tuple[int, ...],
                    device: str = "cpu") -> None:
    """Set seqs.features: rows [T, taps*H] (as stored: float16) aligned with seqs.tokens, mapped
    from the feature shards of the shards `load_sequences` read, in its order."""
    shards = [Path(p) for p in seqs.meta["_shards"]]
    files = ensure_features(shards, verifier_dir, taps, device)
    lengths = (seqs.seq_offsets[1:] - seqs.seq_offsets[:-1]).tolist()
    parts = [map_safetensor(path, "features") for path in files]
    width, dtype = parts[0].shape[1], parts[0].dtype  # every shard must be as wide as the first
    segments: list[torch.Tensor] = []
    for part in parts:
        row = 0
        while part.shape[1] == width and len(segments) < len(lengths) \
                and row + lengths[len(segments)] <= part.shape[0]:
            segments.append(part[row:row + lengths[len(segments)]])
            row += segments[-1].shape[0]
        if part.shape[1] != width or row != part.shape[0]:
            segments = []
            break
    if len(segments) != len(lengths):
        raise ValueError(f"the verifier features in {files[0].parent} do not match the data "
                         f"({seqs.tokens.shape[0]} tokens of {width} features): delete them and "
                         f"rerun to rebuild them")
    seqs.features = FeatureRows(segments, width, dtype)
