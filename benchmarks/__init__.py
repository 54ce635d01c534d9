"""Benchmark scripts, installed as `vllm_specdiff_benchmarks` (run with `python -m`).

The installed `vllm-specdiff` CLI never imports this package: what it needs lives in
`vllm_specdiff` (e.g. `vllm_specdiff.harness`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def emit_report(report: dict[str, Any], out: Path | None) -> None:
    """Print a benchmark's JSON report and, with `out`, write it there too."""
    text = json.dumps(report, indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def chat_parser(doc: str, prompts: int, max_tokens: int) -> argparse.ArgumentParser:
    """The options of the scripts that decode held-out chat prompts in one engine: --prompts,
    --max-tokens and --out (a script adds its own)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=prompts,
                        help=f"chat prompts (default {prompts})")
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    return parser


def invocation(module: str, argv: list[str] | None) -> list[str]:
    """The command line that ran `module` (its full name) with `argv` (None: this process's),
    for a report's provenance."""
    return ["python", "-m", module, *(sys.argv[1:] if argv is None else argv)]
