"""Benchmark scripts, installed as `vllm_specdiff_benchmarks` (run with `python -m`).

The installed `vllm-specdiff` CLI never imports this package: what it needs lives in
`vllm_specdiff` (e.g. `vllm_specdiff.harness`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def emit_report(report: dict[str, Any], out: Path | None) -> None:
    """Print a benchmark's JSON report and, with `out`, write it there too (paths under the
    repository, the cache or home written portably: `vllm_specdiff.provenance.portable`)."""
    from vllm_specdiff.provenance import portable

    text = json.dumps(portable(report), indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def invocation(module: str, argv: list[str] | None) -> list[str]:
    """The command line that ran `module` (its full name) with `argv` (None: this process's),
    for a report's provenance."""
    return ["python", "-m", module, *(sys.argv[1:] if argv is None else argv)]
