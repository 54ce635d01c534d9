"""Regenerate the README's table of measured speedups from benchmarks/results/*/*.json.

A file is either one plain-vs-SpecDiff summary (`vllm-specdiff demo --output`) or a suite result
(`vllm-specdiff bench --json`, with "cells"): one row per speculative method and cell.

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
HEADER = ("| run | prompts | T | gamma | K (T_d) | plain tok/s | speculative tok/s | speedup "
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


def suite_rows(path: Path, s: dict) -> list[str]:
    """One row per speculative method and cell of a suite result, against plain decoding of
    the same cell."""
    prov = s.get("provenance", {})
    where = f"{prov.get('date', '?')}, {prov.get('machine', {}).get('cpu', '?')}"
    name = path.relative_to(ROOT).as_posix()
    methods = {m["label"]: m for m in s["suite"]["methods"]}
    key = ("prompts", "temperature", "batch_size")
    plain = {tuple(c[field] for field in key): c for c in s["cells"]
             if methods[c["method"]]["kind"] == "plain"}
    rows = []
    for c in s["cells"]:
        method = methods[c["method"]]
        if method["kind"] == "plain":
            continue
        options = method["options"]
        num = options.get("K") or 1
        candidates = f"{num} ({options.get('drafter_temperature', 0):g})" if num > 1 else "1"
        share = c.get("drafter_share_of_step")
        drafter = _fmt(c.get("drafter_ms_per_step"), 1) + (f" ({100 * share:.0f}% of step)"
                                                             if share else "")
        identical = "n/a" if c["identical_to_plain"] is None else \
            ("yes" if c["identical_to_plain"] else "NO")
        base = plain[tuple(c[field] for field in key)]
        rows.append(f"| [{path.stem}]({name}) `{c['method']}` B={c['batch_size']} "
                    f"| {c['prompts']} ({c['num_prompts']}) | {c['temperature']:g} "
                    f"| {method['gamma']} | {candidates} | {_fmt(base['tokens_per_s'], 2)} "
                    f"| {_fmt(c['tokens_per_s'], 2)} | **{_fmt(c['speedup'], 2)}x** "
                    f"| {_fmt(c.get('accepted_per_step'), 2)} | {drafter} | {identical} "
                    f"| {where} |")
    return rows


def rows(path: Path) -> list[str]:
    s = json.loads(path.read_text())
    return suite_rows(path, s) if "cells" in s else [row(path)]


def table(results: Path = RESULTS) -> str:
    files = sorted(results.glob("*/*.json"))
    return "\n".join([HEADER, *(r for p in files for r in rows(p))])


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
