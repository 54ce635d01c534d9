"""The suite's Markdown table: one row per cell and method, figures as in the JSON."""

from __future__ import annotations

from typing import Any

HEADER = ("| prompts | T | B | method | tok/s | tok/s per request | speedup "
          "| accepted/step | drafter ms (share of step) | identical |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def identical_text(cell: dict[str, Any]) -> str:
    if cell["identical_to_plain"] is None:
        return "n/a"
    return "yes" if cell["identical_to_plain"] else f"NO {cell['mismatched_prompts']}"


def drafter_text(cell: dict[str, Any]) -> str:
    share = cell.get("drafter_share_of_step")
    return _fmt(cell.get("drafter_ms_per_step"), 1) + (f" ({100 * share:.0f}%)" if share else "")


def batch_text(cell: dict[str, Any]) -> str:
    """B, marked when the cell kept B requests in flight instead of decoding B-prompt batches
    (results from before the option have no "batching": static)."""
    continuous = cell.get("batching", "static") == "continuous"
    return f"{cell['batch_size']}" + (" (continuous)" if continuous else "")


def row(cell: dict[str, Any]) -> str:
    return (f"| {cell['prompts']} ({cell['num_prompts']}) | {cell['temperature']:g} "
            f"| {batch_text(cell)} | `{cell['method']}` | {_fmt(cell['tokens_per_s'], 2)} "
            f"| {_fmt(cell['per_request_tokens_per_s'], 2)} "
            f"| **{_fmt(cell['speedup'], 2)}x** | {_fmt(cell['accepted_per_step'], 2)} "
            f"| {drafter_text(cell)} | {identical_text(cell)} |")


def markdown(result: dict[str, Any]) -> str:
    """The table plus one line on where and how it was measured."""
    prov = result.get("provenance", {})
    suite = result["suite"]
    note = (f"{prov.get('date', '?')}, {prov.get('machine', {}).get('cpu', '?')}; "
            f"max_tokens {suite['max_tokens']}, median of {suite['repeats']} repeat(s); "
            f"speedup against plain decoding in the same run"
            + ("; methods interleaved step by step" if suite.get("interleave") == "step"
               else ""))
    return "\n".join([HEADER, *(row(c) for c in result["cells"]), "", note, ""])
