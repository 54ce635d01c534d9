"""Generated training data in a compact, committable form (token ids only, uint16, compressed).

Generating the verifier's continuations takes CPU hours; a new machine keeps only the repository.
`pack` turns data directories written by `specdiff-distill generate` into one `.npz` each (every
sequence's prompt + continuation ids, prompt lengths, prompt numbers and the shard layout) plus
the meta it was made with; `unpack` writes the same shards back, so training resumes on a fresh
machine without regenerating. Soft targets (top-k log-probs) are not packed: they are large and
only the soft losses need them.

    python -m vllm_specdiff_training.data_pack pack --data DIR[,DIR...] --output data/
    python -m vllm_specdiff_training.data_pack unpack --packed data/ --output CACHE/data
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from .data import SequenceChunk, data_dirs, read_meta, write_meta, write_shard

PACK_SUFFIX = ".npz"
MAX_ID = np.iinfo(np.uint16).max


def pack(data_dir: Path, output: Path) -> Path:
    """One data directory -> OUTPUT/NAME.npz + OUTPUT/NAME.json (its meta)."""
    shards = sorted(Path(data_dir).glob("shard-*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{data_dir}: no shards to pack")
    tokens, lengths, plens, pidx, per_shard = [], [], [], [], []
    for path in shards:
        shard = load_file(str(path))
        offsets = shard["seq_offsets"]
        tokens.append(shard["tokens"].numpy())
        lengths.append((offsets[1:] - offsets[:-1]).numpy())
        plens.append(shard["prompt_lens"].numpy())
        pidx.append(shard["prompt_index"].numpy())
        per_shard.append(int(path.stem.split("-")[1]))
    ids = np.concatenate(tokens)
    if ids.min() < 0 or ids.max() > MAX_ID:
        raise ValueError(f"{data_dir}: token ids outside uint16; this vocabulary cannot be packed")
    counts = np.array([len(p) for p in plens], dtype=np.int64)
    output.mkdir(parents=True, exist_ok=True)
    name = Path(data_dir).name
    out = output / f"{name}{PACK_SUFFIX}"
    np.savez_compressed(out, tokens=ids.astype(np.uint16),
                        lengths=np.concatenate(lengths).astype(np.int32),
                        prompt_lens=np.concatenate(plens).astype(np.int32),
                        prompt_index=np.concatenate(pidx).astype(np.int64),
                        shard_index=np.array(per_shard, dtype=np.int64), shard_counts=counts)
    from vllm_specdiff.provenance import portable

    # committed beside the pack: the verifier's and prompts' paths as $SPECDIFF_CACHE_DIR/...
    meta = portable({k: v for k, v in read_meta(data_dir).items() if not k.startswith("_")})
    (output / f"{name}.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return out


def unpack(packed: Path, output: Path) -> Path:
    """NAME.npz (+ NAME.json) -> OUTPUT/NAME/ shards; shards that exist are left alone."""
    name = packed.name.removesuffix(PACK_SUFFIX)
    meta = json.loads((packed.parent / f"{name}.json").read_text())
    meta.update(top_logprobs=0, unpacked_from=packed.name)
    arrays = np.load(packed)
    data_dir = output / name
    write_meta(data_dir, meta)
    tokens = torch.from_numpy(arrays["tokens"].astype(np.int64))
    lengths = arrays["lengths"].tolist()
    plens, pidx = arrays["prompt_lens"].tolist(), arrays["prompt_index"].tolist()
    seq, pos = 0, 0
    for index, count in zip(arrays["shard_index"].tolist(), arrays["shard_counts"].tolist(),
                            strict=True):
        chunk = SequenceChunk(sequences=[], prompt_lens=plens[seq:seq + count],
                              prompt_index=pidx[seq:seq + count])
        for n in lengths[seq:seq + count]:
            chunk.sequences.append(tokens[pos:pos + n].tolist())
            pos += n
        seq += count
        if not (data_dir / f"shard-{index:05d}.safetensors").is_file():
            write_shard(data_dir, index, chunk)
    return data_dir


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_specdiff_training.data_pack",
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="data directories -> compact .npz files")
    p.add_argument("--data", required=True, help="data directory, or several comma-separated")
    p.add_argument("--output", required=True, help="folder for NAME.npz and NAME.json")
    u = sub.add_parser("unpack", help="compact .npz files -> data directories")
    u.add_argument("--packed", required=True, help="folder of NAME.npz files (or one file)")
    u.add_argument("--output", required=True, help="folder that receives NAME/ data directories")
    args = parser.parse_args(argv)
    try:
        if args.command == "pack":
            for d in data_dirs(args.data):
                print(pack(d, Path(args.output)))
        else:
            packed = Path(args.packed)
            files = [packed] if packed.is_file() else sorted(packed.glob(f"*{PACK_SUFFIX}"))
            if not files:
                raise FileNotFoundError(f"--packed {packed}: no {PACK_SUFFIX} files")
            for f in files:
                print(unpack(f, Path(args.output)))
    except (ValueError, FileNotFoundError) as e:
        print(f"data_pack: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
