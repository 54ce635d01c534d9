"""Soft targets computed by the verifier itself, cached beside the data like its features.

The soft losses (`kl`, `streak-soft`) distil the verifier's distribution at every drafted
position, not only its greedy token. Data generated with `--top-logprobs K` carry it; the
committed packs keep token ids only (their compact form). Teacher forcing gives it back at the
cost of one verifier forward per sequence: the logits at position t - 1 are the verifier's
distribution of token t, exactly what generation saw, because the data's tokens are the
verifier's own continuation. The top-K of each generated position is stored per data shard in
`DATA_DIR/verifier-topK/` (ids int32, log-probs float16), derived data that is never committed.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .data import SequenceData
from .features import build_missing, load_verifier

SOFT_TARGET_K = 8  # the top-K kept per position (the generated data's usual --top-logprobs)


def topk_dir(data_dir: Path, k: int) -> Path:
    return Path(data_dir) / f"verifier-top{k}"


@torch.no_grad()
def build_shard_topk(model: torch.nn.Module, k: int, shard: Path, out: Path) -> None:
    """The verifier's top-k log-probs of every generated token of a shard, in its order (the
    layout `generate --top-logprobs` stores); written atomically (resumable)."""
    data = load_file(str(shard))
    tokens, offsets = data["tokens"].long(), data["seq_offsets"].long()
    prompt_lens = data["prompt_lens"].long()
    device = next(model.parameters()).device
    ids, lps = [], []
    for i in range(offsets.numel() - 1):
        seq = tokens[offsets[i]:offsets[i + 1]]
        plen = int(prompt_lens[i])
        if plen < 1:
            raise ValueError(f"{shard}: sequence {i} has no prompt token, so its first "
                             f"generated token has no verifier distribution")
        logits = model(input_ids=seq[None].to(device), use_cache=False).logits[0]
        top = logits[plen - 1:-1].float().log_softmax(dim=-1).topk(k, dim=-1)
        ids.append(top.indices.to(torch.int32).cpu())
        lps.append(top.values.to(torch.float16).cpu())
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    save_file({"topk_ids": torch.cat(ids).contiguous(),
               "topk_logprobs": torch.cat(lps).contiguous()}, str(tmp))
    tmp.replace(out)


def ensure_verifier_topk(shards: list[Path], verifier_dir: str | Path, k: int,
                         device: str = "cpu") -> list[Path]:
    """The top-k file of every data shard: stored, or computed (one forward per sequence)."""
    real = [s.resolve() for s in shards]
    paths = [topk_dir(s.parent, k) / s.name for s in real]
    build_missing(list(zip(real, paths, strict=True)),
                  lambda: functools.partial(build_shard_topk,
                                            load_verifier(verifier_dir, device).to(device), k),
                  f"verifier top-{k}")
    return paths


def attach_verifier_topk(seqs: SequenceData, verifier_dir: str | Path, k: int = SOFT_TARGET_K,
                         device: str = "cpu") -> None:
    """Set seqs' soft targets (per generated position, as `load_sequences` lays them out) from
    the verifier's top-k of the shards it read, computing what is missing."""
    files = ensure_verifier_topk([Path(p) for p in seqs.meta["_shards"]], verifier_dir, k,
                                 device)
    parts = [load_file(str(f)) for f in files]
    ids = torch.cat([p["topk_ids"] for p in parts]).long()
    lps = torch.cat([p["topk_logprobs"] for p in parts]).float()
    generated = int(seqs.gen_offsets[-1])
    if ids.shape != (generated, k):
        raise ValueError(f"the verifier's top-{k} in {files[0].parent} hold {ids.shape[0]} "
                         f"positions, the data {generated} generated ones: delete that folder "
                         f"and rerun to rebuild it")
    seqs.topk_ids, seqs.topk_logprobs = ids, lps
