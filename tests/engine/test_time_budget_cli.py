"""`python benchmarks/time_budget.py --quick` on the tiny models: three engines in one process,
timed greedy runs through vLLM's step loop, a finish per budget, the JSON report and the plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import write_tiny_drafter

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "time_budget.py"


def test_quick_run_writes_report_and_plot(tmp_path, tiny_verifier, tiny_drafter):
    base = write_tiny_drafter(tiny_verifier, tmp_path / "base", num_layers=1)
    out, png = tmp_path / "tb.json", tmp_path / "tb.png"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--no-speed-env", "--no-progress",
           "--model", str(tiny_verifier), "--drafter", str(tiny_drafter),
           "--base-drafter", str(base), "--gamma", "3", "--max-model-len", "512",
           "--max-num-seqs", "2", "--json", str(out), "--plot", str(png)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert png.stat().st_size > 0
    methods = ["plain", "specdiff-base", "specdiff2"]
    assert report["config"]["methods"] == methods
    assert report["config"]["drafters"] == {"specdiff-base": str(base),
                                            "specdiff2": str(tiny_drafter)}
    assert report["provenance"]["command"].startswith(
        "python -m vllm_specdiff_benchmarks.time_budget --quick")
    assert list(report["accuracy"]) == methods
    assert all(list(row) == ["0.25", "1"] for row in report["accuracy"].values())
    assert len(report["questions"]) == 2
    assert report["greedy_mismatches"] == []
    for question in report["questions"]:
        runs = question["methods"]
        plain = runs["plain"]["tokens"]
        assert plain
        for method in methods:
            run = runs[method]
            assert len(run["token_times"]) == len(run["tokens"])
            assert run["token_times"] == sorted(run["token_times"])
            # Lossless: speculative greedy answers agree with plain decoding where both ran.
            common = min(len(plain), len(run["tokens"]))
            assert run["tokens"][:common] == plain[:common], method
            for key, cell in run["budgets"].items():
                assert cell["tokens"] == sum(t <= float(key) for t in run["token_times"])
                # The tiny vocabulary has no numbers ("w280" is a word), so no answer.
                assert cell["answer"] is None and cell["correct"] is False
    assert "| plain |" in proc.stdout
