"""The README's table of measured figures is the one generated from the committed JSON."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("results_table", ROOT / "scripts" /
                                                  "results_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_table_matches_the_committed_results():
    script = _script()
    readme = (ROOT / "README.md").read_text()
    assert readme == script.render(readme), \
        "README results blocks are stale: run python scripts/results_table.py --write README.md"


def _main_suite_file(directory: Path, identical: bool) -> None:
    import json

    methods = [{"label": "plain", "kind": "plain"}, {"label": "specdiff2", "kind": "specdiff"}]
    cells = [{"prompts": "humaneval", "num_prompts": 16, "temperature": 0.0, "batch_size": 16,
              "method": "plain", "tokens_per_s": 100.0, "speedup": 1.0,
              "accepted_per_step": None, "identical_to_plain": True},
             {"prompts": "humaneval", "num_prompts": 16, "temperature": 0.0, "batch_size": 16,
              "method": "specdiff2", "tokens_per_s": 123.0, "speedup": 1.23,
              "accepted_per_step": 0.5, "identical_to_plain": identical}]
    (directory / "suite_main_b16.json").write_text(json.dumps(
        {"suite": {"methods": methods}, "cells": cells,
         "provenance": {"date": "2026-12-02 00:00 UTC", "machine": {}, "command": "x"}}))


def test_main_suite_runs_get_one_compact_row_per_cell_and_show_a_mismatch(tmp_path):
    script = _script()
    day = tmp_path / "benchmarks" / "results" / "2026-12-02"
    day.mkdir(parents=True)
    _main_suite_file(day, identical=True)
    results = tmp_path / "benchmarks" / "results"
    summary = script.suite_summary(results).splitlines()
    assert summary[0] == "| run | prompts | T | B | plain tok/s | `specdiff2` |"
    assert summary[2] == ("| [suite_main_b16](benchmarks/results/2026-12-02/suite_main_b16.json)"
                          " 2026-12-02 00:00 UTC | humaneval (16) | 0 | 16 | 100.00 "
                          "| 1.23x (0.50) |")
    assert script.table(results).count("\n") == 1  # header only: the main runs stay out of it
    _main_suite_file(day, identical=False)
    assert script.suite_summary(results).endswith("1.23x (0.50) NOT IDENTICAL |")


def test_every_results_file_has_provenance():
    for path in sorted((ROOT / "benchmarks" / "results").glob("*/*.json")):
        import json

        prov = json.loads(path.read_text()).get("provenance", {})
        assert prov.get("date") and prov.get("machine") and prov.get("command"), path


def test_replace_block_refuses_a_file_without_markers():
    import pytest

    with pytest.raises(ValueError, match="block to replace"):
        _script().replace_block("no markers here", "x")
