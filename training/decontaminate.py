"""Drop from a data directory the sequences whose prompt is benchmark material.

Before 2026-12-06 a corpus built with a seed other than 0 held out other chat topics than the
benchmark's `chat_heldout.jsonl` (written with seed 0), so its chat prompts included benchmark
prompts and their topics (`corpus.split_topics`). Training on them makes the held-out chat figures
a test on training data. This rewrites every shard without those sequences, and every verifier
features shard beside it alike, so that nothing has to be regenerated.

    python -m vllm_specdiff_training.decontaminate --data DIR --prompts CORPUS.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .corpus import uses_heldout_topic
from .data import SequenceChunk, read_meta, write_meta, write_shard
from .features import feature_dirs


def heldout_prompt_numbers(prompts: Path) -> set[int]:
    """Line numbers (from 0, as `generate` numbers prompts) of the corpus's held-out-topic chat."""
    from vllm_specdiff.prompts import read_jsonl

    return {i for i, record in enumerate(read_jsonl(prompts))
            if record.get("source") == "chat"
            and uses_heldout_topic(record["messages"][0]["content"])}


def _kept_rows(offsets: torch.Tensor, keep: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(int(offsets[i]), int(offsets[i + 1])) for i in keep])


def drop_prompts(data_dir: Path, drop: set[int]) -> int:
    """Rewrite DATA_DIR's shards (and their feature shards) without the sequences of the prompt
    numbers DROP; returns how many sequences went. Records them in meta.json."""
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    feature_folders = feature_dirs(data_dir)
    dropped: list[int] = []
    for path in sorted(data_dir.glob("shard-*.safetensors")):
        shard = load_file(str(path))
        numbers = shard["prompt_index"].tolist()
        keep = [i for i, n in enumerate(numbers) if n not in drop]
        if len(keep) == len(numbers):
            continue
        if not keep:
            raise ValueError(f"{path}: every sequence would go; delete the shard instead")
        offsets, tokens, plens = shard["seq_offsets"], shard["tokens"], shard["prompt_lens"]
        chunk = SequenceChunk(
            sequences=[tokens[offsets[i]:offsets[i + 1]].tolist() for i in keep],
            prompt_lens=[int(plens[i]) for i in keep], prompt_index=[numbers[i] for i in keep])
        if "topk_ids" in shard:  # soft targets cover the generated positions only
            generated = offsets[1:] - offsets[:-1] - plens.long()
            gen_offsets = torch.zeros(len(numbers) + 1, dtype=torch.int64)
            gen_offsets[1:] = generated.cumsum(0)
            chunk.topk_ids = [shard["topk_ids"][gen_offsets[i]:gen_offsets[i + 1]] for i in keep]
            chunk.topk_logprobs = [shard["topk_logprobs"][gen_offsets[i]:gen_offsets[i + 1]]
                                   for i in keep]
        rows = _kept_rows(offsets, keep)
        for folder in feature_folders:  # features first: a crash in between leaves a mismatch that
            feature_path = folder / path.name  # attach_features detects, never a silent shift
            if feature_path.is_file():
                features = load_file(str(feature_path))["features"]
                if features.shape[0] != tokens.shape[0]:
                    raise ValueError(f"{feature_path}: {features.shape[0]} rows for "
                                     f"{tokens.shape[0]} tokens; delete it and rebuild it")
                tmp = feature_path.with_suffix(f".{os.getpid()}.tmp")
                save_file({"features": features[rows].contiguous()}, str(tmp))
                tmp.replace(feature_path)
        write_shard(data_dir, int(path.stem.split("-")[1]), chunk)
        dropped += [n for n in numbers if n in drop]
    if dropped:
        meta = {k: v for k, v in meta.items() if not k.startswith("_")}
        meta["dropped_prompts"] = sorted(set(meta.get("dropped_prompts", [])) | set(dropped))
        write_meta(data_dir, meta)
    return len(dropped)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_specdiff_training.decontaminate",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="data directory written by `generate`")
    parser.add_argument("--prompts", required=True,
                        help="the corpus (JSONL) the data directory was generated from")
    args = parser.parse_args(argv)
    try:
        drop = heldout_prompt_numbers(Path(args.prompts))
        print(f"{args.data}: dropped {drop_prompts(Path(args.data), drop)} sequences "
              f"({len(drop)} held-out-topic prompts in {args.prompts})")
    except (ValueError, FileNotFoundError) as e:
        print(f"decontaminate: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
