"""Reduced draft vocabulary: an LM head over the N most frequent verifier tokens.

The head's cost and the drafter's logits scale with the vocabulary; most mass sits on a small set
of tokens. A draft->verifier table `d2t` (LongTensor[N] of verifier ids, like EAGLE-3's d2t but
holding absolute ids) selects the head rows kept; `draft_logits` scatters back to verifier ids and
gives every uncovered id -inf, so verification stays lossless (the drafter just cannot propose
those ids). The table is stored beside the weights as `d2t.safetensors`.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

D2T_FILE = "d2t.safetensors"
D2T_KEY = "draft_to_verifier"


def count_tokens(sequences: Iterable[Iterable[int]], vocab_size: int) -> torch.Tensor:
    """Occurrences of every verifier id [vocab_size] over token-id sequences."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        ids = torch.as_tensor(list(seq), dtype=torch.long)
        if ids.numel() == 0:
            continue
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"token id outside [0, {vocab_size}) in the corpus")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def build_d2t(counts: torch.Tensor, size: int, always_include: Iterable[int] = (),
              exclude: Iterable[int] = ()) -> torch.Tensor:
    """Ascending verifier ids of the `size` most frequent tokens (ties: lower id first).

    `always_include` (e.g. EOS and other special tokens) are kept regardless of frequency;
    `exclude` (e.g. a mask id inside the verifier vocab) are never kept.
    """
    vocab = counts.numel()
    if not 1 <= size <= vocab:
        raise ValueError(f"--size must be in [1, {vocab}], got {size}")
    score = counts.double().clone()
    forced = sorted({int(i) for i in always_include if 0 <= int(i) < vocab})
    banned = [int(i) for i in exclude if 0 <= int(i) < vocab]
    if len(forced) > size:
        raise ValueError(f"{len(forced)} always-included tokens exceed --size {size}")
    score[forced] = float("inf")
    score[banned] = float("-inf")
    if size > vocab - len(banned):
        raise ValueError(f"--size {size} exceeds the {vocab - len(banned)} usable ids")
    # stable sort on -score keeps lower ids first among equal counts
    order = torch.sort(-score, stable=True).indices[:size]
    return order.sort().values


def verifier_to_draft(d2t: torch.Tensor, verifier_vocab_size: int) -> torch.Tensor:
    """Inverse table t2d [verifier_vocab_size]: draft index of each verifier id, -1 if uncovered."""
    t2d = torch.full((verifier_vocab_size,), -1, dtype=torch.long, device=d2t.device)
    t2d[d2t] = torch.arange(d2t.numel(), device=d2t.device)
    return t2d


def save_d2t(path: str | Path, d2t: torch.Tensor) -> Path:
    """Write the table; `path` is a drafter directory or a .safetensors file."""
    path = Path(path)
    if path.suffix != ".safetensors":
        path.mkdir(parents=True, exist_ok=True)
        path = path / D2T_FILE
    save_file({D2T_KEY: d2t.to(torch.long).contiguous().cpu()}, str(path))
    return path


def load_d2t(path: str | Path) -> torch.Tensor:
    """Read a table written by `save_d2t` (directory or file)."""
    path = Path(path)
    if path.is_dir():
        path = path / D2T_FILE
    if not path.is_file():
        raise FileNotFoundError(f"draft->verifier table {str(path)!r} not found")
    with safe_open(str(path), framework="pt") as f:
        if D2T_KEY not in f.keys():  # noqa: SIM118 - safe_open is not a dict
            raise ValueError(f"{str(path)!r} has no tensor {D2T_KEY!r}")
        return f.get_tensor(D2T_KEY).to(torch.long)


def apply_reduced_vocab(drafter: nn.Module, d2t: torch.Tensor) -> None:
    """Keep only the LM-head rows of `d2t` and record the table on the drafter."""
    d2t = torch.as_tensor(d2t, dtype=torch.long).reshape(-1).cpu()
    if drafter.draft_to_verifier is not None:
        raise ValueError("the drafter already has a reduced vocabulary")
    limit = min(drafter.vocab_size, drafter.draft_vocab_size)
    if d2t.numel() == 0 or int(d2t.min()) < 0 or int(d2t.max()) >= limit:
        raise ValueError(f"draft_to_verifier ids must lie in [0, {limit})")
    if d2t.unique().numel() != d2t.numel():
        raise ValueError("draft_to_verifier contains duplicate ids")
    if bool((d2t == drafter.mask_token_id).any()):
        raise ValueError(f"draft_to_verifier contains the mask token id {drafter.mask_token_id}")
    old = drafter.lm_head
    head = nn.Linear(old.in_features, d2t.numel(), bias=old.bias is not None,
                     device=old.weight.device, dtype=old.weight.dtype)
    with torch.no_grad():
        head.weight.copy_(old.weight[d2t.to(old.weight.device)])
        if old.bias is not None:
            head.bias.copy_(old.bias[d2t.to(old.weight.device)])
    drafter.lm_head = head
    drafter.draft_to_verifier = d2t.to(old.weight.device)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "tokenizer.model",
                   "chat_template.jinja")


def copy_tokenizer_files(source: str | Path | None, dest: str | Path) -> None:
    """Keep the tokenizer beside saved weights, so later loads and data checks can find it."""
    if source is None:
        return
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(dest) / name)


def read_vocab(tokenizer_dir: str | Path) -> dict[str, int] | None:
    """token -> id of a tokenizer directory, read from its files (never runs tokenizer code).

    Returns None when the directory holds no readable vocabulary.
    """
    import json

    path = Path(tokenizer_dir)
    vocab: dict[str, int] = {}
    tj = path / "tokenizer.json"
    if tj.is_file():
        data = json.loads(tj.read_text(encoding="utf-8"))
        model_vocab = data.get("model", {}).get("vocab", {})
        if isinstance(model_vocab, list):  # Unigram: [[piece, score], ...]
            vocab = {piece: i for i, (piece, _) in enumerate(model_vocab)}
        else:
            vocab = dict(model_vocab)
        for tok in data.get("added_tokens", []):
            vocab[tok["content"]] = tok["id"]
        return vocab
    vj = path / "vocab.json"
    if vj.is_file():
        vocab = json.loads(vj.read_text(encoding="utf-8"))
        added = path / "added_tokens.json"
        if added.is_file():
            vocab.update(json.loads(added.read_text(encoding="utf-8")))
        return vocab
    return None


def check_tokenizer_match(drafter_dir: str | Path, verifier_tokenizer: object,
                          verifier_vocab_size: int | None = None) -> None:
    """Raise ValueError unless every verifier token has the same id in the drafter's tokenizer.

    `verifier_tokenizer` is a tokenizer directory or an object with `get_vocab()`. The drafter
    may have extra ids (mask, appended tokens) beyond the verifier's; it may not renumber any.
    """
    import warnings

    drafter_vocab = read_vocab(drafter_dir)
    if drafter_vocab is None:
        warnings.warn(f"{str(drafter_dir)!r} has no tokenizer files; only the vocabulary size "
                      "was checked against the verifier", stacklevel=2)
        return
    if isinstance(verifier_tokenizer, (str, Path)):
        verifier_vocab = read_vocab(verifier_tokenizer)
        if verifier_vocab is None:
            raise FileNotFoundError(
                f"no tokenizer.json or vocab.json in {str(verifier_tokenizer)!r}")
    else:
        verifier_vocab = verifier_tokenizer.get_vocab()
    by_id = {i: t for t, i in drafter_vocab.items()}
    for token, idx in sorted(verifier_vocab.items(), key=lambda kv: kv[1]):
        if verifier_vocab_size is not None and idx >= verifier_vocab_size:
            continue
        if drafter_vocab.get(token) != idx:
            raise ValueError(
                f"vocab mismatch with the verifier tokenizer: verifier id {idx} is {token!r}, "
                f"the drafter's is {by_id.get(idx)!r} (the drafter must use the verifier's "
                "tokenizer, optionally with extra ids appended)")
