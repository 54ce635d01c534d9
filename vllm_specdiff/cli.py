"""`vllm-specdiff`: prepare the default models, generate offline, serve, benchmark.

Subcommands live in vllm_specdiff/commands/<name>.py, each exposing `register(subparsers)`.
Those that start vLLM first re-execute the process once with vLLM's recommended CPU settings
(tcmalloc / Intel OpenMP preloaded, OpenMP threads); `--no-speed-env` skips that.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS = ("models", "generate", "serve", "demo", "bench", "build_vocab")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-specdiff",
        description="SpecDiff-2 speculative decoding with a diffusion drafter, on vLLM.")
    parser.add_argument("--no-speed-env", action="store_true",
                        help="do not apply vLLM's recommended CPU settings (LD_PRELOAD, threads)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"vllm_specdiff.commands.{name}")
        module.register(subparsers)
    return parser


def _uses_vllm(args: argparse.Namespace) -> bool:
    module = sys.modules.get(getattr(args.func, "__module__", ""), None)
    return bool(getattr(module, "USES_VLLM", False))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if _uses_vllm(args):
        from vllm_specdiff.plugin import cpu_env

        if not args.no_speed_env:
            cpu_env.reexec_with_speed_env(argv)  # returns only if nothing needs a restart
        print(cpu_env.describe(os.environ), file=sys.stderr, flush=True)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"vllm-specdiff {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
