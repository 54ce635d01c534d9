"""A reduced draft head's table made from the training data: the verifier ids the data uses
most, so a drafter for a large vocabulary scores a few thousand rows instead of all of them."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from .data import SequenceData
from .model import DATA_VOCAB_FILE

log = logging.getLogger(__name__)


def build_data_vocab(data: SequenceData, size: int, tokenizer_dir: str) -> torch.Tensor:
    """A reduced head's table: the `size` verifier ids most frequent in the data's sequences
    (replies often copy from their prompts, so prompts count too), special tokens always kept."""
    from transformers import AutoTokenizer

    from vllm_specdiff.drafter.vocab import build_d2t, count_tokens

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    sequences = (data.sequence(i).tolist() for i in range(len(data)))
    counts = count_tokens(sequences, int(data.meta.get("vocab_size") or len(tokenizer)))
    d2t = build_d2t(counts, size, always_include=tokenizer.all_special_ids)
    covered = counts[d2t].sum().item() / max(1, counts.sum().item())
    log.info("reduced head: %d ids cover %.2f%% of the data's tokens", size, 100 * covered)
    return d2t


def ensure_data_vocab(out: Path, data: SequenceData, size: int, tokenizer_dir: str) -> Path:
    """`build_data_vocab` once per run directory, so a resumed run keeps the head rows its
    checkpoints were trained with."""
    from vllm_specdiff.drafter.vocab import save_d2t

    path = out / DATA_VOCAB_FILE
    if not path.is_file():  # under torchrun every rank writes the same table: each whole
        out.mkdir(parents=True, exist_ok=True)
        tmp = save_d2t(path.with_name(f"{path.stem}.{os.getpid()}.safetensors"),
                       build_data_vocab(data, size, tokenizer_dir))
        tmp.replace(path)
    return path
