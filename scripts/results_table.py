"""Regenerate the README's tables of measured speedups from benchmarks/results/*/*.json.

A file is either one plain-vs-SpecDiff summary (`vllm-specdiff demo --output`) or a suite result
(`vllm-specdiff bench --json`, with "cells"): one row per speculative method and cell. The main
runs of `benchmarks/suite.sh` (`suite_main_*.json`: every method x set x T) would add hundreds of
such rows, so they get a second, compact block instead: one row per cell, one column per method.

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

from vllm_specdiff.bench.table import batch_text

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
SUITE_BEGIN, SUITE_END = "<!-- suite:begin -->", "<!-- suite:end -->"
MAIN_SUITE = "suite_main_"  # stems of the main runs, summarised in the compact block
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
        rows.append(f"| [{path.stem}]({name}) `{c['method']}` B={batch_text(c)} "
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
    files = [p for p in sorted(results.glob("*/*.json")) if not p.stem.startswith(MAIN_SUITE)]
    return "\n".join([HEADER, *(r for p in files for r in rows(p))])


def _summary_cell(cell: dict) -> str:
    """Speedup (accepted draft tokens per step); a greedy mismatch is shown, never hidden."""
    text = f"{_fmt(cell['speedup'], 2)}x"
    if cell.get("accepted_per_step") is not None:
        text += f" ({cell['accepted_per_step']:.2f})"
    return text + (" NOT IDENTICAL" if cell["identical_to_plain"] is False else "")


def suite_summary(results: Path = RESULTS) -> str:
    """One row per (run, prompt set, T, batch) of the main suite runs, one column per method:
    speedup against plain decoding in the same run, and accepted tokens per step."""
    lines: list[str] = []
    for path in sorted(results.glob(f"*/{MAIN_SUITE}*.json")):
        s = json.loads(path.read_text())
        labels = [m["label"] for m in s["suite"]["methods"]]
        lines += ([""] if lines else []) + [  # one table per run: its methods are its columns
            "| run | prompts | T | B | plain tok/s | " + " | ".join(f"`{m}`" for m in labels[1:])
            + " |", "|" + "---|" * (len(labels) + 4)]
        name = path.relative_to(results.parent.parent).as_posix()
        prov = s.get("provenance", {})
        cells: dict[tuple, dict[str, dict]] = {}
        for c in s["cells"]:
            key = (c["prompts"], c["num_prompts"], c["temperature"], batch_text(c))
            cells.setdefault(key, {})[c["method"]] = c
        for (prompts, num, temperature, batch), by_method in cells.items():
            plain = by_method[labels[0]]
            lines.append(f"| [{path.stem}]({name}) {prov.get('date', '?')} | {prompts} ({num}) "
                         f"| {temperature:g} | {batch} | {_fmt(plain['tokens_per_s'], 2)} | "
                         + " | ".join(_summary_cell(by_method[m]) if m in by_method else "-"
                                      for m in labels[1:]) + " |")
    return "\n".join(lines) if lines else "(no main suite run committed yet)"


def replace_block(text: str, block: str, begin: str = BEGIN, end: str = END) -> str:
    if begin not in text or end not in text:
        raise ValueError(f"no {begin} ... {end} block to replace")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{block}\n{end}{tail}"


def render(text: str, results: Path = RESULTS) -> str:
    """The README text with both generated blocks replaced."""
    text = replace_block(text, table(results))
    return replace_block(text, suite_summary(results), SUITE_BEGIN, SUITE_END)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", default=None, help="Markdown file whose block to replace")
    args = parser.parse_args(argv)
    if args.write:
        path = Path(args.write)
        path.write_text(render(path.read_text()))
    else:
        print(table())
        print()
        print(suite_summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
