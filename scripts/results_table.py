"""Regenerate the README's table of measured speedups from benchmarks/results/*/*.json.

    python scripts/results_table.py                 # print the table
    python scripts/results_table.py --write README.md   # replace the block between the markers

Every row names its JSON file, so each figure in the README has its source beside it;
tests/test_results_table.py fails when the README's block and the JSON files disagree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
HEADER = ("| run | prompts | T | gamma | K (T_d) | plain tok/s | SpecDiff tok/s | speedup "
          "| accepted/step | drafter ms (share of verifier step) | identical | date, machine |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def row(path: Path) -> str:
    s = json.loads(path.read_text())
    prov = s.get("provenance", {})
    share = s.get("drafter_to_verifier")
    drafter = _fmt(s.get("drafter_ms_per_step"), 1) + (f" ({100 * share:.0f}%)" if share else "")
    identical = ("yes" if s["identical_outputs"] else "NO") if s["temperature"] == 0 else "n/a"
    where = f"{prov.get('date', '?')}, {prov.get('machine', {}).get('cpu', '?')}"
    name = path.relative_to(ROOT).as_posix()
    options = s.get("specdiff_options", {})
    k = options.get("K") or 1
    candidates = f"{k} ({options.get('drafter_temperature', 0):g})" if k > 1 else "1"
    return (f"| [{path.stem}]({name}) | {s['prompts']} | {s['temperature']:g} | {s['gamma']} "
            f"| {candidates} "
            f"| {_fmt(s['plain_tokens_per_s'], 2)} | {_fmt(s['spec_tokens_per_s'], 2)} "
            f"| **{_fmt(s['speed_ratio'], 2)}x** | {_fmt(s.get('mean_accepted_length'), 2)} "
            f"| {drafter} | {identical} | {where} |")


def table(results: Path = RESULTS) -> str:
    files = sorted(results.glob("*/*.json"))
    return "\n".join([HEADER, *(row(p) for p in files)])


def replace_block(text: str, block: str) -> str:
    if BEGIN not in text or END not in text:
        raise ValueError(f"no {BEGIN} ... {END} block to replace")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", default=None, help="Markdown file whose block to replace")
    args = parser.parse_args(argv)
    block = table()
    if args.write:
        path = Path(args.write)
        path.write_text(replace_block(path.read_text(), block))
    else:
        print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
