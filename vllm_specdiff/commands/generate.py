"""`vllm-specdiff generate`: offline batch inference from a jsonl file, with speculation.

Each input line is a JSON object with "prompt" (or "text"): a string, or "messages": a chat;
optional "id" and "max_tokens". Prompts go through the model's chat template unless
`--chat never` (or the tokenizer has none). Each output line repeats "id" (default: the record's
0-based index) and adds "output", "output_token_ids", "finish_reason". Drafter statistics are
printed at the end (and written to `--stats`). Every record is checked and tokenized before the
engine starts (errors name file:line), and the output file appears only once it is complete.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from vllm_specdiff.commands.common import add_engine_args
from vllm_specdiff.commands.flags import add_spec_args

USES_VLLM = True


@dataclass
class Request:
    """One validated input record: what `llm.generate` gets, and the id its output repeats."""

    id: Any  # whatever JSON the record's "id" holds
    prompt_ids: list[int]
    params: Any  # vllm.SamplingParams


def sampling_params(args: argparse.Namespace, max_tokens: Any, where: str) -> Any:
    """vLLM's SamplingParams for one record, its own checks turned into a ValueError naming
    `where` (vLLM raises VLLMValidationError, which is no ValueError, or TypeError)."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be an integer >= 1, got {max_tokens!r}")
    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              max_tokens=max_tokens, seed=args.seed)
    except (VLLMValidationError, ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None


def prepare_requests(args: argparse.Namespace, model: str) -> list[Request]:
    """Every record checked and tokenized before the engine starts (with vLLM's tokenizer for
    `model`): a bad line fails in seconds, naming file:line, and nothing is written."""
    from vllm.tokenizers import get_tokenizer

    from vllm_specdiff.prompts import encode_prompt, read_numbered_jsonl, record_to_prompt

    records = read_numbered_jsonl(args.input)
    if not records:
        raise ValueError(f"--input {args.input!r} holds no records")
    sampling_params(args, args.max_tokens, "--max-tokens")  # the command line's own values
    tokenizer = get_tokenizer(model)
    requests = []
    for index, (lineno, record) in enumerate(records):
        where = f"{args.input}:{lineno}"
        try:
            ids = encode_prompt(tokenizer, record_to_prompt(record, where), args.chat)
        except ValueError as e:
            raise ValueError(f"--chat {args.chat}, {where}: {e}") from None
        if len(ids) >= args.max_model_len:
            raise ValueError(f"{where}: the prompt has {len(ids)} tokens; --max-model-len "
                             f"{args.max_model_len} leaves no room for output")
        params = sampling_params(args, record.get("max_tokens", args.max_tokens), where)
        requests.append(Request(record.get("id", index), ids, params))
    return requests


@contextmanager
def atomic_output(path: Path) -> Iterator[TextIO]:
    """A text file that appears at `path` only complete: written beside it under a temporary
    name and renamed at the end; on any error the temporary file is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w") as f:
            yield f
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_outputs(llm: Any, requests: list[Request], out: TextIO, chunk: int) -> None:
    """Generate chunk by chunk, one JSON line per request, in input order."""
    from tqdm import tqdm
    from vllm.inputs import TokensPrompt

    with tqdm(total=len(requests), desc="generate", unit="prompt", file=sys.stderr) as bar:
        for start in range(0, len(requests), chunk):
            batch = requests[start: start + chunk]
            results = llm.generate([TokensPrompt(prompt_token_ids=r.prompt_ids) for r in batch],
                                   [r.params for r in batch], use_tqdm=False)
            for request, result in zip(batch, results, strict=True):
                completion = result.outputs[0]
                out.write(json.dumps({
                    "id": request.id,
                    "output": completion.text,
                    "output_token_ids": list(completion.token_ids),
                    "finish_reason": completion.finish_reason,
                }) + "\n")
            bar.update(len(batch))


def run(args: argparse.Namespace) -> int:
    from vllm_specdiff.commands.common import build_llm, resolve_model

    model = resolve_model(args)
    requests = prepare_requests(args, model)
    llm = build_llm(args, model, speculative=not args.no_spec)
    output = Path(args.output)
    with atomic_output(output) as out:
        write_outputs(llm, requests, out, max(1, args.chunk_size))
    if not args.no_spec:
        from vllm_specdiff.plugin.engine import specdiff_stats

        stats = specdiff_stats(llm)
        summary = {k: stats.get(k) for k in ("mean_accepted_length", "drafter_ms_per_step")}
        print("specdiff: " + json.dumps(summary), file=sys.stderr)
        if args.stats:
            Path(args.stats).write_text(json.dumps(stats, indent=2, default=str))
    print(f"wrote {len(requests)} outputs to {output}", file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `generate` subcommand."""
    p = subparsers.add_parser(
        "generate", help="offline batch inference: prompts.jsonl -> outputs.jsonl",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="prompts, one JSON object per line")
    p.add_argument("--output", required=True, help="outputs, one JSON object per line")
    p.add_argument("--chat", choices=("auto", "always", "never"), default="auto",
                   help="apply the chat template to plain prompts (auto: if the model has one)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--chunk-size", type=int, default=64,
                   help="prompts submitted at once (the output file appears when all are done)")
    p.add_argument("--no-spec", action="store_true", help="plain decoding (no drafter)")
    p.add_argument("--stats", default=None, help="write drafter statistics (JSON) here")
    add_engine_args(p)
    add_spec_args(p)
    p.set_defaults(func=run)
