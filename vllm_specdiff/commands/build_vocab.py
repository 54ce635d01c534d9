"""`vllm-specdiff build-vocab`: the reduced draft vocabulary (d2t table) from a corpus.

Counts verifier-token frequencies over a text corpus and keeps the N most frequent ids (special
tokens always kept), written as `d2t.safetensors` into a drafter directory, where `load_drafter`
applies it (or to a .safetensors file for `BlockCausalDrafter.from_causal_lm(draft_to_verifier=)`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm


def iter_texts(paths: list[Path], field: str) -> Iterator[str]:
    """Documents of .txt (one per non-empty line) and .jsonl (the `field` of each object) files."""
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"--corpus file {str(path)!r} not found")
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                if path.suffix == ".jsonl":
                    record = json.loads(line)
                    if field not in record:
                        raise ValueError(f"{str(path)}:{number} has no field {field!r} "
                                         "(set --field)")
                    yield str(record[field])
                else:
                    yield line


def run(args: argparse.Namespace) -> int:
    """Build and save the table; prints where it went and how much of the corpus it covers."""
    from transformers import AutoTokenizer

    from vllm_specdiff.drafter.vocab import build_d2t, count_tokens, save_d2t

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    vocab = args.vocab_size or len(tokenizer)
    texts = iter_texts([Path(p) for p in args.corpus], args.field)
    sequences = (tokenizer(t, add_special_tokens=False)["input_ids"]
                 for t in tqdm(texts, desc="tokenizing", unit="doc"))
    counts = count_tokens(sequences, vocab)
    d2t = build_d2t(counts, args.size, always_include=tokenizer.all_special_ids,
                    exclude=args.exclude)
    out = save_d2t(args.out, d2t)
    covered = counts[d2t].sum().item() / max(1, counts.sum().item())
    print(f"wrote {out}: {d2t.numel()} of {vocab} ids, covering {covered:.2%} of corpus tokens")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `build-vocab` subcommand."""
    p = subparsers.add_parser(
        "build-vocab", help="build a reduced draft vocabulary (d2t table) from a corpus",
        description=__doc__)
    p.add_argument("--tokenizer", required=True, help="verifier tokenizer directory (local)")
    p.add_argument("--corpus", required=True, nargs="+",
                   help=".txt (one document per line) or .jsonl files")
    p.add_argument("--field", default="text", help="text field of .jsonl records")
    p.add_argument("--size", type=int, required=True, help="number of draft ids to keep")
    p.add_argument("--out", required=True,
                   help="drafter directory (writes d2t.safetensors) or a .safetensors path")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="verifier vocabulary size (default: len(tokenizer))")
    p.add_argument("--exclude", type=int, nargs="*", default=[],
                   help="ids never to keep (e.g. a mask token inside the verifier vocab)")
    p.set_defaults(func=run)
