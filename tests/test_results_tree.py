"""`benchmarks/results/` is a product, not a diary: at most 40 files, each one quoted by a
hand-written doc, no run logs, no doc quoting a results file that is not there, and no JSON
naming a folder of the machine that wrote it (`vllm_specdiff.provenance.portable`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from vllm_specdiff.provenance import ABSOLUTE_PATH

ROOT = Path(__file__).resolve().parent.parent
MAX_FILES = 40
# A results path as the docs write it; `a_{x,y}.json` is shorthand for a_x.json and a_y.json.
QUOTED = re.compile(r"benchmarks/results/[\w./{},-]*")


def linking_docs(root: Path) -> list[Path]:
    """The hand-written docs whose quotes justify a results file (docs/results.md is generated
    from the tree, so it lists every file and justifies none)."""
    docs = [root / "README.md", root / "data" / "README.md",
            *sorted((root / "docs").glob("*.md")),
            *sorted((root / "vllm_specdiff" / "assets").glob("*/MODEL_CARD.md"))]
    return [d for d in docs if d.is_file() and d.name != "results.md"]


def _expand(pattern: str) -> list[str]:
    match = re.search(r"\{([^}]*)\}", pattern)
    if not match:
        return [pattern]
    return [e for alt in match.group(1).split(",")
            for e in _expand(pattern[:match.start()] + alt + pattern[match.end():])]


def quoted_paths(doc: Path) -> list[str]:
    """Every results path `doc` names, shorthand expanded."""
    return [path for quoted in QUOTED.findall(doc.read_text())
            for path in _expand(quoted.rstrip(".,"))]


def _absolute_paths(value: Any) -> list[str]:
    if isinstance(value, str):
        return ABSOLUTE_PATH.findall(value)
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _absolute_paths(k) + _absolute_paths(v)]
    if isinstance(value, list):
        return [p for v in value for p in _absolute_paths(v)]
    return []


def violations(root: Path, max_files: int = MAX_FILES) -> list[str]:
    """What breaks the rules in the checkout at `root` (empty when none)."""
    results = root / "benchmarks" / "results"
    files = sorted(p for p in results.rglob("*") if p.is_file())
    found = []
    if len(files) > max_files:
        found.append(f"benchmarks/results holds {len(files)} files (at most {max_files})")
    quoted: set[str] = set()
    docs = linking_docs(root)
    for doc in [*docs, root / "CHANGELOG.md", root / "docs" / "results.md"]:
        if not doc.is_file():
            continue
        for path in quoted_paths(doc):
            if not (root / path).exists():
                found.append(f"{doc.relative_to(root)} quotes {path}, which does not exist")
            elif doc in docs:
                quoted.add(path)
    for path in files:
        name = path.relative_to(root).as_posix()
        if path.suffix == ".md":
            found.append(f"{name}: a run log or table; say what it showed in a doc instead")
        elif name not in quoted:
            found.append(f"{name} is quoted by no doc (README, docs/, model cards, data/)")
        if path.suffix == ".json":
            absolute = _absolute_paths(json.loads(path.read_text()))
            if absolute:
                found.append(f"{name} names absolute paths, e.g. {absolute[0]}")
    return found


def test_the_committed_results_tree_keeps_the_rules():
    assert violations(ROOT) == []


def _checkout(tmp_path: Path) -> Path:
    results = tmp_path / "benchmarks" / "results"
    (results / "runs").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    (results / "runs" / "b1.json").write_text(json.dumps({"command": "bench --json out/b1.json"}))
    (tmp_path / "README.md").write_text("[b1](benchmarks/results/runs/b1.json)\n")
    return tmp_path


def test_a_clean_tree_passes_and_each_broken_rule_is_reported(tmp_path):
    root = _checkout(tmp_path)
    results = root / "benchmarks" / "results"
    assert violations(root) == []
    (results / "runs" / "b16.json").write_text("{}")  # quoted by no doc
    (results / "runs" / "NOTE.md").write_text("09:00 UTC started\n")  # a run log
    (root / "docs" / "x.md").write_text(  # a quote of a file that is not there
        "`benchmarks/results/runs/{b1,gone}.json`")
    (results / "runs" / "b1.json").write_text(json.dumps(  # a machine's folder
        {"command": "bench --drafter /home/me/drafter"}))
    found = violations(root, max_files=2)
    assert "benchmarks/results holds 3 files (at most 2)" in found
    assert "benchmarks/results/runs/b16.json is quoted by no doc (README, docs/, model cards, " \
           "data/)" in found
    assert any(v.startswith("benchmarks/results/runs/NOTE.md: a run log") for v in found)
    assert "docs/x.md quotes benchmarks/results/runs/gone.json, which does not exist" in found
    assert "benchmarks/results/runs/b1.json names absolute paths, e.g. /home/me/drafter" in found
    assert len(found) == 5


def test_the_generated_page_justifies_no_file(tmp_path):
    root = _checkout(tmp_path)
    (root / "README.md").write_text("no results quoted here\n")
    (root / "docs" / "results.md").write_text("[b1](benchmarks/results/runs/b1.json)\n")
    assert violations(root) == [
        "benchmarks/results/runs/b1.json is quoted by no doc (README, docs/, model cards, data/)"]
