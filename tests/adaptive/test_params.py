"""The tuning constants (`vllm_specdiff.adaptive.params`) and the package's purity."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import vllm_specdiff.adaptive as adaptive
from vllm_specdiff.adaptive import DRAFT_MARGIN, PARAMS, AdaptiveDrafting, AdaptiveParams

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vllm_specdiff" / "adaptive"


def test_params_are_frozen_and_the_margin_default_is_theirs():
    assert DRAFT_MARGIN == PARAMS.draft_margin == AdaptiveParams().draft_margin
    with pytest.raises(dataclasses.FrozenInstanceError):
        PARAMS.forget = 0.9  # type: ignore[misc]


def test_every_parameter_is_explained_in_the_docs():
    """docs/adaptive.md's parameter table names every field with its default."""
    doc = (ROOT / "docs" / "adaptive.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line.split("|")[2].strip()
            for line in doc.splitlines() if line.startswith("| `")}
    for f in dataclasses.fields(AdaptiveParams):
        assert f.name in rows, f.name
        assert float(rows[f.name]) == getattr(PARAMS, f.name), f.name


def test_params_reach_every_estimate():
    """A controller built with other params uses them throughout (no module constant left)."""
    params = dataclasses.replace(PARAMS, forget=0.9, lookup_forget=0.8, prior_refills=3.0,
                                 draft_margin=0.3, speed_forget=0.5)
    ctrl = AdaptiveDrafting(8, lookup=True, params=params)
    assert ctrl.margin == 0.3 and ctrl.acceptance.forget == 0.9
    assert ctrl.lookup_acceptance is not None and ctrl.lookup_acceptance.forget == 0.8
    assert ctrl.drafter.forget == 0.9 and ctrl.verifier.speed_forget == 0.5
    assert ctrl.refills.departed == 3.0 and ctrl.runs.params is params
    assert ctrl.probes.params is params and ctrl.verifier.params is params


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_the_package_imports_only_the_standard_library_and_itself():
    """Adaptive drafting is policy, not vLLM integration: no vLLM, no plugin, no torch."""
    modules = sorted(PACKAGE.glob("*.py"))
    assert {p.stem for p in modules} >= {"params", "cost", "estimators", "decision", "probes",
                                         "controller"}
    allowed = {"__future__", "math", "collections.abc", "dataclasses", "typing"}
    for path in modules:
        for name in _imports(path):
            assert name in allowed or name.startswith("vllm_specdiff.adaptive"), (path, name)
    assert adaptive.__name__ == "vllm_specdiff.adaptive"
