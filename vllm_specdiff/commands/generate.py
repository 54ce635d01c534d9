"""`vllm-specdiff generate`: offline batch inference from a jsonl file, with speculation.

Each input line is a JSON object with "prompt" (or "text"): a string, or "messages": a chat;
optional "id" and "max_tokens". Prompts go through the model's chat template unless
`--chat never` (or the tokenizer has none). Each output line repeats "id" (default: the line
number) and adds "output", "output_token_ids", "finish_reason". Drafter statistics are printed at
the end (and written to `--stats`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from vllm_specdiff.commands.common import add_engine_args, add_spec_args

USES_VLLM = True


def _prompt_ids(tokenizer: Any, record: dict[str, Any], chat: str, where: str) -> list[int]:  # noqa: ANN401
    from vllm_specdiff.prompts import encode_prompt, record_to_prompt

    try:
        return encode_prompt(tokenizer, record_to_prompt(record, where), chat)
    except ValueError as e:
        raise ValueError(f"--chat {chat}, {where}: {e}") from None


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from vllm_specdiff.commands.common import build_llm, resolve_model
    from vllm_specdiff.prompts import read_jsonl

    records = read_jsonl(args.input)
    if not records:
        raise ValueError(f"--input {args.input!r} holds no records")
    for name in ("max_tokens",):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    model = resolve_model(args)
    llm = build_llm(args, model, speculative=not args.no_spec)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = llm.get_tokenizer()
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    chunk = max(1, args.chunk_size)
    with output.open("w") as out, tqdm(total=len(records), desc="generate", unit="prompt",
                                       file=sys.stderr) as bar:
        for start in range(0, len(records), chunk):
            batch = records[start: start + chunk]
            prompts, params = [], []
            for offset, record in enumerate(batch):
                where = f"{args.input} record {start + offset}"
                ids = _prompt_ids(tokenizer, record, args.chat, where)
                prompts.append(TokensPrompt(prompt_token_ids=ids))
                params.append(SamplingParams(
                    temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                    max_tokens=int(record.get("max_tokens", args.max_tokens)), seed=args.seed))
            results = llm.generate(prompts, params, use_tqdm=False)
            for offset, (record, result) in enumerate(zip(batch, results, strict=True)):
                completion = result.outputs[0]
                out.write(json.dumps({
                    "id": record.get("id", start + offset),
                    "output": completion.text,
                    "output_token_ids": list(completion.token_ids),
                    "finish_reason": completion.finish_reason,
                }) + "\n")
            out.flush()
            bar.update(len(batch))
    if not args.no_spec:
        from vllm_specdiff.plugin.engine import specdiff_stats

        stats = specdiff_stats(llm)
        summary = {k: stats.get(k) for k in ("mean_accepted_length", "drafter_ms_per_step")}
        print("specdiff: " + json.dumps(summary), file=sys.stderr)
        if args.stats:
            Path(args.stats).write_text(json.dumps(stats, indent=2, default=str))
    print(f"wrote {len(records)} outputs to {output}", file=sys.stderr)
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
                   help="prompts submitted at once (outputs are written after each chunk)")
    p.add_argument("--no-spec", action="store_true", help="plain decoding (no drafter)")
    p.add_argument("--stats", default=None, help="write drafter statistics (JSON) here")
    add_engine_args(p)
    add_spec_args(p)
    p.set_defaults(func=run)
