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
    assert readme == script.replace_block(readme, script.table()), \
        "README results block is stale: run python scripts/results_table.py --write README.md"


def test_every_results_file_has_provenance():
    for path in sorted((ROOT / "benchmarks" / "results").glob("*/*.json")):
        import json

        prov = json.loads(path.read_text()).get("provenance", {})
        assert prov.get("date") and prov.get("machine") and prov.get("command"), path


def test_replace_block_refuses_a_file_without_markers():
    import pytest

    with pytest.raises(ValueError, match="block to replace"):
        _script().replace_block("no markers here", "x")
