"""`vllm-specdiff demo`: the default models end to end, in about two minutes on a small CPU.

Prepares the default verifier and drafter, decodes a few chat prompts greedily with plain and
with speculative decoding in the same process, checks that the outputs are identical, and prints
the mean accepted length, the drafter time per step and the speed ratio. Exit status 1 if the
outputs differ.
"""

from __future__ import annotations

import argparse

from vllm_specdiff.commands.bench import add_bench_args, report, run_comparison

USES_VLLM = True


def run(args: argparse.Namespace) -> int:
    from vllm_specdiff.models import prepare_defaults

    for name, path in prepare_defaults().items():
        print(f"{name}: {path}", flush=True)
    return report(run_comparison(args, "demo", None), args.output)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `demo` subcommand."""
    p = subparsers.add_parser(
        "demo", help="plain vs speculative decoding of the default models (greedy, ~2 min)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default=None, help="write the summary as JSON here")
    add_bench_args(p, max_tokens=48, gamma=4)
    p.set_defaults(func=run)
