"""Verifier-sequence shards: the on-disk format shared by `generate`, `train` and `eval`.

A data directory holds `meta.json` (how the data was made, and the verifier tokenizer's fingerprint)
and `shard-NNNNN.safetensors` files, one per chunk of prompts. Each shard stores every sequence
flat (`tokens`, `seq_offsets`) with its prompt boundary (`prompt_lens`), so any prefix of a
generated continuation can serve as a training context. Optional soft targets (`topk_ids`,
`topk_logprobs`) are stored per generated position. Shards are written atomically, which is what
makes generation resumable: a shard that exists is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .feature_rows import FeatureRows

FORMAT = "specdiff-distill/1"
META_FILE = "meta.json"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the full token -> id map: two tokenizers agree on ids iff their fingerprints do."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    payload = json.dumps(vocab, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(payload).hexdigest()[:16]


def check_fingerprint(meta: dict, fingerprint: str, source: str) -> None:
    """Refuse data made with a tokenizer other than the model's (its ids would be noise)."""
    if meta.get("tokenizer_fingerprint") != fingerprint:
        raise ValueError(
            f"the data in {meta.get('_dir', '?')} was generated with a tokenizer whose "
            f"fingerprint is {meta.get('tokenizer_fingerprint')!r} (verifier "
            f"{meta.get('verifier')!r}), but {source} "
            f"has fingerprint {fingerprint!r}: its token ids mean different tokens. Regenerate the "
            f"data with `specdiff-distill generate` using this model's tokenizer."
        )


@dataclass
class SequenceChunk:
    """Sequences produced for one chunk of prompts, before they are written as a shard."""

    sequences: list[list[int]]  # prompt + continuation token ids
    prompt_lens: list[int]
    prompt_index: list[int]
    topk_ids: list[torch.Tensor] | None = None  # per sequence [generated, k] int
    topk_logprobs: list[torch.Tensor] | None = None  # per sequence [generated, k] float


def shard_path(data_dir: Path, index: int) -> Path:
    return Path(data_dir) / f"shard-{index:05d}.safetensors"


def write_shard(data_dir: Path, index: int, chunk: SequenceChunk) -> Path:
    """Write one chunk atomically (tmp file + rename) so a crash never leaves a half shard."""
    lengths = [len(s) for s in chunk.sequences]
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    tensors = {
        "tokens": torch.tensor([t for s in chunk.sequences for t in s], dtype=torch.int32),
        "seq_offsets": offsets,
        "prompt_lens": torch.tensor(chunk.prompt_lens, dtype=torch.int32),
        "prompt_index": torch.tensor(chunk.prompt_index, dtype=torch.int64),
    }
    if chunk.topk_ids is not None:
        for seq, plen, ids in zip(chunk.sequences, chunk.prompt_lens, chunk.topk_ids, strict=True):
            if ids.shape[0] != len(seq) - plen:
                raise ValueError("soft targets must cover exactly the generated positions")
        tensors["topk_ids"] = torch.cat(chunk.topk_ids).to(torch.int32)
        tensors["topk_logprobs"] = torch.cat(chunk.topk_logprobs).float()
    path = shard_path(data_dir, index)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)
    return path


def write_meta(data_dir: Path, meta: dict) -> None:
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = data_dir / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, data_dir / META_FILE)


DATA_SEPARATOR = ","
PROMPT_INDEX_STRIDE = 10_000_000  # prompt numbers of the k-th of several data directories


def read_meta(data_dir: Path) -> dict:
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--data {data_dir}: no {META_FILE}; create it with "
                                f"`specdiff-distill generate`")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"--data {data_dir}: unknown format {meta.get('format')!r}, "
                         f"expected {FORMAT!r}")
    meta["_dir"] = str(data_dir)
    return meta


@dataclass
class SequenceData:
    """All sequences of a data directory, flat. Soft targets are indexed by generated position."""

    tokens: torch.Tensor  # [T] int64
    seq_offsets: torch.Tensor  # [S+1]
    prompt_lens: torch.Tensor  # [S]
    prompt_index: torch.Tensor  # [S]
    gen_offsets: torch.Tensor  # [S+1] offsets into the generated positions
    topk_ids: torch.Tensor | None  # [Tgen, k] int64
    topk_logprobs: torch.Tensor | None  # [Tgen, k] float32
    meta: dict
    features: FeatureRows | None = None  # [T, F] verifier features (conditioned drafters)

    def __len__(self) -> int:
        return int(self.prompt_lens.shape[0])

    def sequence(self, i: int) -> torch.Tensor:
        return self.tokens[self.seq_offsets[i]:self.seq_offsets[i + 1]]

    def length(self, i: int) -> int:
        return int(self.seq_offsets[i + 1] - self.seq_offsets[i])

    def soft_targets(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k verifier ids/log-probs at every generated position of sequence i."""
        if self.topk_ids is None or self.topk_logprobs is None:
            raise ValueError(f"the data in {self.meta.get('_dir')} has no soft targets; regenerate "
                             f"it with `generate --top-logprobs K` to use soft losses")
        lo, hi = int(self.gen_offsets[i]), int(self.gen_offsets[i + 1])
        return self.topk_ids[lo:hi], self.topk_logprobs[lo:hi]

    @property
    def has_soft_targets(self) -> bool:
        return self.topk_ids is not None

    def subset(self, indices: list[int]) -> SequenceData:
        """A new SequenceData holding only the given sequences (used for train/held-out splits)."""
        seqs = [self.sequence(i) for i in indices]
        lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
        offsets = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        offsets[1:] = lengths.cumsum(0)
        plens = self.prompt_lens[indices] if indices else self.prompt_lens[:0]
        gen_lengths = lengths - plens
        gen_offsets = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        gen_offsets[1:] = gen_lengths.cumsum(0)
        ids = lps = None
        if self.has_soft_targets:
            parts = [self.soft_targets(i) for i in indices]
            k = self.topk_ids.shape[1]
            ids = torch.cat([p[0] for p in parts]) if parts else torch.zeros(0, k, dtype=torch.long)
            lps = torch.cat([p[1] for p in parts]) if parts else torch.zeros(0, k)
        return SequenceData(
            tokens=torch.cat(seqs) if seqs else self.tokens[:0],
            seq_offsets=offsets, prompt_lens=plens,
            prompt_index=self.prompt_index[indices] if indices else self.prompt_index[:0],
            gen_offsets=gen_offsets, topk_ids=ids, topk_logprobs=lps, meta=self.meta,
            features=None if self.features is None else self.features.subset(
                [(int(self.seq_offsets[i]), int(self.seq_offsets[i + 1])) for i in indices]))


def data_dirs(data: str | Path) -> list[Path]:
    """The directories of a `--data` value: one, or several separated by commas."""
    dirs = [Path(part) for part in str(data).split(DATA_SEPARATOR) if part]
    if not dirs:
        raise ValueError("--data names no directory")
    return dirs


def load_sequences(data: str | Path) -> SequenceData:
    """Load every shard of a data directory (in shard order) into one SequenceData; with
    several directories (comma-separated), all of them in turn. The prompts of the k-th
    directory are numbered k * PROMPT_INDEX_STRIDE + their index, so the held-out split (a
    function of the prompt number) keeps each directory's own split and appending a directory
    leaves the earlier ones' split unchanged. All must come from the same tokenizer."""
    dirs = data_dirs(data)
    metas = [read_meta(d) for d in dirs]
    meta = metas[0]
    for d, other in zip(dirs[1:], metas[1:], strict=True):
        for key in ("tokenizer_fingerprint", "vocab_size", "top_logprobs"):
            if other.get(key) != meta.get(key):
                raise ValueError(f"--data {d}: its {key} differs from {dirs[0]}'s; data "
                                 "directories used together need the same tokenizer and "
                                 "soft targets")
    tokens, offsets, plens, pidx, ids, lps = [], [], [], [], [], []
    base = 0
    paths: list[Path] = []
    for k, data_dir in enumerate(dirs):
        found = sorted(data_dir.glob("shard-*.safetensors"))
        if not found:
            raise FileNotFoundError(f"--data {data_dir}: no shards yet; run "
                                    f"`specdiff-distill generate`")
        paths += found
        for path in found:
            shard = load_file(str(path))
            tokens.append(shard["tokens"].long())
            offsets.append(shard["seq_offsets"][:-1] + base)
            base += int(shard["seq_offsets"][-1])
            plens.append(shard["prompt_lens"].long())
            pidx.append(shard["prompt_index"].long() + k * PROMPT_INDEX_STRIDE)
            if "topk_ids" in shard:
                ids.append(shard["topk_ids"].long())
                lps.append(shard["topk_logprobs"].float())
    seq_offsets = torch.cat(offsets + [torch.tensor([base])])
    prompt_lens = torch.cat(plens)
    gen_lengths = seq_offsets[1:] - seq_offsets[:-1] - prompt_lens
    gen_offsets = torch.zeros(len(prompt_lens) + 1, dtype=torch.int64)
    gen_offsets[1:] = gen_lengths.cumsum(0)
    meta["_shards"] = [str(p) for p in paths]
    if ids and len(ids) != len(paths):
        raise ValueError(f"--data {data}: some shards have soft targets and some do not")
    return SequenceData(
        tokens=torch.cat(tokens), seq_offsets=seq_offsets, prompt_lens=prompt_lens,
        prompt_index=torch.cat(pidx), gen_offsets=gen_offsets,
        topk_ids=torch.cat(ids) if ids else None, topk_logprobs=torch.cat(lps) if lps else None,
        meta=meta)


def split_heldout(data: SequenceData, fraction: float) -> tuple[SequenceData, SequenceData]:
    """Split by prompt (never by sample) so held-out windows share no prompt with training ones.

    The split is a pure function of the prompt index alone (not of any run's --seed), so `train`
    and `eval` always agree on it whatever seeds they were given. Verifier features are shared
    as views, never copied (they can run to gigabytes).
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"--heldout-fraction must be in [0, 1), got {fraction}")
    held = [i for i in range(len(data)) if _heldout(int(data.prompt_index[i]), fraction)]
    held_set = set(held)
    return data.subset([i for i in range(len(data)) if i not in held_set]), data.subset(held)


def _heldout(prompt_index: int, fraction: float) -> bool:
    digest = hashlib.sha256(f"heldout:{prompt_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < fraction
