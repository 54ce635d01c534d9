"""Generate docs/results.md and the README's headline table from benchmarks/results/**/*.json.

A result is a suite run (`vllm-specdiff bench --json`, with "cells"), a plain-vs-SpecDiff
summary (`vllm-specdiff demo --output`) or another measurement JSON (training evaluations,
one-off timings); each records its date, machine and command. `benchmarks/results/` holds only
the runs the docs quote, each under a stable name that a new measurement overwrites
(tests/test_results_tree.py), so the page lists every one, newest first. The main runs of
`benchmarks/suite.sh` (`suite_main_*.json`: every method x set x T) get a compact block: one
row per cell, one column per method.

    python scripts/results_table.py             # print the page
    python scripts/results_table.py --write     # write docs/results.md and README's headline

Every row names its JSON file, so each figure has its source beside it;
tests/test_results_table.py fails when the committed page or headline and the JSON disagree.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from vllm_specdiff.bench.table import batch_text

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
HEADLINE_BEGIN, HEADLINE_END = "<!-- headline:begin -->", "<!-- headline:end -->"
MAIN_SUITE = "suite_main_"  # stems of the main runs, summarised in the compact block
# The README's headline: the latest runs of the default at batch 1 and 16. An entry is a results
# file, optionally with `#METHOD`: the cell that is the default in that run (a run made before
# the default drafter changed names the new default by its options); plain `specdiff2` otherwise.
HEADLINE = ("conditioned/b1_t0.json", "conditioned/b16_t0.json")
HEADER = ("| run | prompts | T | gamma | K (T_d) | plain tok/s | speculative tok/s | speedup "
          "| accepted/step | drafter ms (share of verifier step) | identical | date, machine |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")
# Arguments that name where a run wrote its output, left out of the page's commands.
_OUTPUT_ARGS = re.compile(r"\s--(json|plots|output|out|plot)[ =]\S+")


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def provenance(data: dict[str, Any]) -> dict[str, Any]:
    """Date, machine and command: under "provenance" (bench, demo) or at the top level (training
    evaluations and the scripts' reports)."""
    return data.get("provenance") or data


def _where(data: dict[str, Any]) -> str:
    prov = provenance(data)
    return f"{prov.get('date', '?')}, {(prov.get('machine') or {}).get('cpu', '?')}"


def _link(path: Path, base: Path) -> str:
    """The file's path from the repository root (`base` is that root, or a test's stand-in)."""
    return path.relative_to(base).as_posix()


def row(path: Path, s: dict[str, Any]) -> str:
    """One plain-vs-SpecDiff summary (`vllm-specdiff demo --output`)."""
    share = s.get("drafter_to_verifier")
    drafter = _fmt(s.get("drafter_ms_per_step"), 1) + (f" ({100 * share:.0f}%)" if share else "")
    identical = ("yes" if s["identical_outputs"] else "NO") if s["temperature"] == 0 else "n/a"
    options = s.get("specdiff_options", {})
    k = options.get("num_drafts", options.get("K")) or 1  # K: results before the rename
    candidates = f"{k} ({options.get('drafter_temperature', 0):g})" if k > 1 else "1"
    return (f"| [{path.stem}]({_link(path, _root_of(path))}) | {s['prompts']} "
            f"| {s['temperature']:g} | {s['gamma']} | {candidates} "
            f"| {_fmt(s['plain_tokens_per_s'], 2)} | {_fmt(s['spec_tokens_per_s'], 2)} "
            f"| **{_fmt(s['speed_ratio'], 2)}x** | {_fmt(s.get('mean_accepted_length'), 2)} "
            f"| {drafter} | {identical} | {_where(s)} |")


def _plain_cells(s: dict[str, Any]) -> tuple[dict[str, dict], dict[tuple, dict]]:
    methods = {m["label"]: m for m in s["suite"]["methods"]}
    plain = {_cell_key(c): c for c in s["cells"] if methods[c["method"]]["kind"] == "plain"}
    return methods, plain


def _cell_key(cell: dict[str, Any]) -> tuple:
    return cell["prompts"], cell["temperature"], cell["batch_size"], cell.get("batching")


def suite_rows(path: Path, s: dict[str, Any]) -> list[str]:
    """One row per speculative method and cell of a suite result, against plain decoding of
    the same cell."""
    name = _link(path, _root_of(path))
    methods, plain = _plain_cells(s)
    rows = []
    for c in s["cells"]:
        method = methods[c["method"]]
        if method["kind"] == "plain":
            continue
        options = method["options"]
        num = options.get("num_drafts", options.get("K")) or 1
        candidates = f"{num} ({options.get('drafter_temperature', 0):g})" if num > 1 else "1"
        share = c.get("drafter_share_of_step")
        drafter = _fmt(c.get("drafter_ms_per_step"), 1) + (f" ({100 * share:.0f}% of step)"
                                                             if share else "")
        identical = "n/a" if c["identical_to_plain"] is None else \
            ("yes" if c["identical_to_plain"] else "NO")
        base = plain[_cell_key(c)]
        rows.append(f"| [{path.stem}]({name}) `{c['method']}` B={batch_text(c)} "
                    f"| {c['prompts']} ({c['num_prompts']}) | {c['temperature']:g} "
                    f"| {method['gamma']} | {candidates} | {_fmt(base['tokens_per_s'], 2)} "
                    f"| {_fmt(c['tokens_per_s'], 2)} | **{_fmt(c['speedup'], 2)}x** "
                    f"| {_fmt(c.get('accepted_per_step'), 2)} | {drafter} | {identical} "
                    f"| {_where(s)} |")
    return rows


def _root_of(path: Path) -> Path:
    """The repository root above a results file: the folder holding `benchmarks/results`."""
    for parent in path.parents:
        if parent.name == "results" and parent.parent.name == "benchmarks":
            return parent.parent.parent
    raise ValueError(f"{path} is not under benchmarks/results")


def _summary_cell(cell: dict) -> str:
    """Speedup (accepted draft tokens per step); a greedy mismatch is shown, never hidden."""
    text = f"{_fmt(cell['speedup'], 2)}x"
    if cell.get("accepted_per_step") is not None:
        text += f" ({cell['accepted_per_step']:.2f})"
    return text + (" NOT IDENTICAL" if cell["identical_to_plain"] is False else "")


def suite_summary(path: Path, s: dict[str, Any]) -> list[str]:
    """A main suite run: one row per (prompt set, T, batch), one column per method: speedup
    against plain decoding in the same run, and accepted tokens per step."""
    labels = [m["label"] for m in s["suite"]["methods"]]
    lines = ["| run | prompts | T | B | plain tok/s | " + " | ".join(f"`{m}`" for m in labels[1:])
             + " |", "|" + "---|" * (len(labels) + 4)]
    cells: dict[tuple, dict[str, dict]] = {}
    for c in s["cells"]:
        key = (c["prompts"], c["num_prompts"], c["temperature"], batch_text(c))
        cells.setdefault(key, {})[c["method"]] = c
    name = _link(path, _root_of(path))
    for (prompts, num, temperature, batch), by_method in cells.items():
        plain = by_method[labels[0]]
        lines.append(f"| [{path.stem}]({name}) {provenance(s).get('date', '?')} "
                     f"| {prompts} ({num}) | {temperature:g} | {batch} "
                     f"| {_fmt(plain['tokens_per_s'], 2)} | "
                     + " | ".join(_summary_cell(by_method[m]) if m in by_method else "-"
                                  for m in labels[1:]) + " |")
    return lines


def load(results: Path = RESULTS) -> list[tuple[Path, dict[str, Any]]]:
    """Every committed result, newest first (ties: by path)."""
    runs = [(p, json.loads(p.read_text())) for p in sorted(results.rglob("*.json"))]
    runs.sort(key=lambda run: str(provenance(run[1]).get("date", "")), reverse=True)
    return runs


def _command(data: dict[str, Any]) -> str:
    """The run's command without its output paths."""
    return _OUTPUT_ARGS.sub("", " " + str(provenance(data).get("command", ""))).strip()


def page(results: Path = RESULTS) -> str:
    """docs/results.md: every committed run, newest first."""
    runs = load(results)
    rows = []
    for path, s in runs:
        if "cells" in s and not path.stem.startswith(MAIN_SUITE):
            rows += suite_rows(path, s)
        elif "speed_ratio" in s:
            rows.append(row(path, s))
    main = [p_s for p_s in runs if p_s[0].stem.startswith(MAIN_SUITE)]
    other = [(p, s) for p, s in runs if "cells" not in s and "speed_ratio" not in s]
    text = [
        "# Measured results",
        "",
        "<!-- generated by scripts/results_table.py --write: do not edit by hand -->",
        "",
        "Every committed run under `benchmarks/results/`, newest first: the runs the README,",
        "the docs and the model cards quote, each under a stable name that a new measurement",
        "overwrites (runs no doc quotes any more, and the training stages' run logs, are in git",
        "history). Each JSON records the date, the machine, the versions and the command that",
        "wrote it. Speedups are against plain decoding in the same run; `specdiff2` is the",
        "plugin's default (K = 1, adaptive drafting, prompt lookup where the context repeats),",
        "`adaptive=false` drafts gamma every step; \"identical\" is greedy output against plain",
        "decoding's.",
        "",
        "## Suite and demo runs",
        "",
        HEADER, *rows,
    ]
    if main:  # a section only where a main suite run is committed
        text += [
            "", "## Main suite runs", "",
            "`benchmarks/suite.sh`'s main part, one row per cell and one column per method: "
            "speedup",
            "against plain decoding in the same run, with accepted draft tokens per step in "
            "brackets",
            "(`NOT IDENTICAL` would mark a greedy output that differs from plain).", "",
        ]
    for i, (path, s) in enumerate(main):
        text += ([""] if i else []) + suite_summary(path, s)
    text += ["", "## Other measurements", "",
             "Training evaluations and one-off timings. A command naming a script or a",
             "`vllm_specdiff_benchmarks` module that no longer exists ran an experiment removed",
             "once its question was settled; git history keeps it.", "",
             "| file | date, machine | command (output paths left out) |", "|---|---|---|"]
    for path, s in other:
        command = _command(s).replace("|", "\\|")
        text.append(f"| [{path.relative_to(results).as_posix()}]"
                    f"({_link(path, _root_of(path))}) | {_where(s)} | `{command}` |")
    return "\n".join(text) + "\n"


def headline(results: Path = RESULTS, files: tuple[str, ...] = HEADLINE) -> str:
    """The README's table: per cell of the headline runs, the default against plain decoding
    and the best fixed draft length of the same run."""
    lines = ["| prompts | B | plain tok/s | default | accepted/step | best fixed (gamma) "
             "| identical | run |", "|---|---|---|---|---|---|---|---|"]
    links = []  # reference-style links keep the rows short
    for entry in files:
        name, _, default = entry.partition("#")
        path = results / name
        s = json.loads(path.read_text())
        methods, plain = _plain_cells(s)
        for c in s["cells"]:
            if c["method"] != (default or "specdiff2"):
                continue
            fixed = [f for f in s["cells"] if _cell_key(f) == _cell_key(c)
                     and methods[f["method"]]["options"].get("adaptive") is False]
            best = max(fixed, key=lambda f: f["speedup"]) if fixed else None
            best_text = (f"{_fmt(best['speedup'], 2)}x ({methods[best['method']]['gamma']})"
                         if best else "-")
            identical = "n/a" if c["identical_to_plain"] is None else \
                ("yes" if c["identical_to_plain"] else "NO")
            batch = batch_text(c).replace("(continuous)", "cont.")
            lines.append(f"| {c['prompts']} ({c['num_prompts']}) | {batch} "
                         f"| {_fmt(plain[_cell_key(c)]['tokens_per_s'], 1)} "
                         f"| **{_fmt(c['speedup'], 2)}x** | {_fmt(c.get('accepted_per_step'), 2)} "
                         f"| {best_text} | {identical} | [{path.stem}] |")
        links.append(f"[{path.stem}]: benchmarks/results/{name}")
    return "\n".join([*lines, "", *links])


def replace_block(text: str, block: str, begin: str = HEADLINE_BEGIN,
                  end: str = HEADLINE_END) -> str:
    if begin not in text or end not in text:
        raise ValueError(f"no {begin} ... {end} block to replace")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{block}\n{end}{tail}"


def render_readme(text: str, results: Path = RESULTS) -> str:
    """The README text with its headline block replaced."""
    return replace_block(text, headline(results))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true",
                        help="write docs/results.md and the README's headline block")
    args = parser.parse_args(argv)
    if args.write:
        PAGE.write_text(page())
        README.write_text(render_readme(README.read_text()))
    else:
        print(page())
    return 0


if __name__ == "__main__":
    sys.exit(main())
