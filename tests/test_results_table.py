"""docs/results.md and the README's headline table are the ones generated from the committed
JSON (tests/test_results_tree.py checks what the tree may hold)."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("results_table", ROOT / "scripts" /
                                                  "results_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_page_matches_the_committed_results():
    page = (ROOT / "docs" / "results.md").read_text()
    assert page == _script().page(), \
        "docs/results.md is stale: run python scripts/results_table.py --write"


def test_readme_headline_matches_the_committed_results():
    script = _script()
    readme = (ROOT / "README.md").read_text()
    assert readme == script.render_readme(readme), \
        "README headline is stale: run python scripts/results_table.py --write"


def _suite_file(path: Path, identical: bool = True, command: str = "x", date: str =
                "2026-12-02 00:00 UTC", cpu: str = "C", fixed: bool = False) -> None:
    methods = [{"label": "plain", "kind": "plain", "gamma": None, "options": {}},
               {"label": "specdiff2", "kind": "specdiff", "gamma": 8, "options": {}}]
    cell = {"prompts": "humaneval", "num_prompts": 16, "temperature": 0.0, "batch_size": 16,
            "drafter_ms_per_step": 1.0, "drafter_share_of_step": 0.01}
    cells = [{**cell, "method": "plain", "tokens_per_s": 100.0, "speedup": 1.0,
              "accepted_per_step": None, "identical_to_plain": True},
             {**cell, "method": "specdiff2", "tokens_per_s": 123.0, "speedup": 1.23,
              "accepted_per_step": 0.5, "identical_to_plain": identical}]
    if fixed:
        for gamma, speedup in ((4, 1.25), (8, 0.9)):
            label = f"specdiff2:adaptive=false:gamma={gamma}"
            methods.append({"label": label, "kind": "specdiff", "gamma": gamma,
                            "options": {"adaptive": False}})
            cells.append({**cell, "method": label, "tokens_per_s": 100 * speedup,
                          "speedup": speedup, "accepted_per_step": 1.0,
                          "identical_to_plain": True})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(
        {"suite": {"methods": methods}, "cells": cells,
         "provenance": {"date": date, "machine": {"cpu": cpu}, "command": command}}))


def test_main_suite_runs_get_one_compact_row_per_cell_and_show_a_mismatch(tmp_path):
    script = _script()
    path = tmp_path / "benchmarks" / "results" / "2026-12-02" / "suite_main_b16.json"
    _suite_file(path)
    summary = script.suite_summary(path, json.loads(path.read_text()))
    assert summary[0] == "| run | prompts | T | B | plain tok/s | `specdiff2` |"
    assert summary[2] == ("| [suite_main_b16](benchmarks/results/2026-12-02/suite_main_b16.json)"
                          " 2026-12-02 00:00 UTC | humaneval (16) | 0 | 16 | 100.00 "
                          "| 1.23x (0.50) |")
    page = script.page(tmp_path / "benchmarks" / "results")
    assert "`specdiff2` B=16" not in page  # the main runs stay out of the long table
    _suite_file(path, identical=False)
    assert script.suite_summary(path, json.loads(path.read_text()))[-1].endswith(
        "1.23x (0.50) NOT IDENTICAL |")


def test_page_lists_every_run_newest_first(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    _suite_file(results / "a" / "old.json", command="bench --limit 8 --json /tmp/old.json",
                date="2026-12-01 10:00 UTC")
    _suite_file(results / "b" / "new.json", command="bench --limit 8 --json /tmp/new.json",
                date="2026-12-03 10:00 UTC")
    _suite_file(results / "b" / "other_cpu.json", command="bench --limit 8 --json x.json",
                date="2026-12-02 10:00 UTC", cpu="D")
    page = _script().page(results)
    runs = re.findall(r"^\| \[(\w+)\]", page, re.M)
    # the same command twice is two runs the docs quote: both listed
    assert runs == ["new", "other_cpu", "old"]


def test_headline_sets_the_default_beside_the_best_fixed_length(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    _suite_file(results / "d" / "run.json", fixed=True)
    table = _script().headline(results, ("d/run.json",)).splitlines()
    assert table[2:] == ["| humaneval (16) | 16 | 100.0 | **1.23x** | 0.50 | 1.25x (4) "
                         "| yes | [run] |", "", "[run]: benchmarks/results/d/run.json"]


def test_every_results_file_records_its_date_machine_and_command():
    script = _script()
    for path in sorted((ROOT / "benchmarks" / "results").rglob("*.json")):
        prov = script.provenance(json.loads(path.read_text()))
        assert prov.get("date") and prov.get("machine") and prov.get("command"), path


def test_replace_block_refuses_a_file_without_markers():
    with pytest.raises(ValueError, match="block to replace"):
        _script().replace_block("no markers here", "x")
