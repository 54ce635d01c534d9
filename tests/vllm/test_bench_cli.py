"""`vllm-specdiff bench` runs from the installed package alone (its harness is
`vllm_specdiff.harness`, not the benchmarks folder) and reports a lossless greedy comparison."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm.tiny_models import word_prompt

pytestmark = pytest.mark.vllm


def test_bench_outside_the_checkout_writes_a_lossless_summary(tmp_path, tiny_verifier,
                                                              tiny_drafter):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": word_prompt(i, 6)}) + "\n" for i in range(2)))
    out = tmp_path / "bench.json"
    cmd = [str(Path(sys.executable).with_name("vllm-specdiff")), "--no-speed-env", "bench",
           "--prompts", str(prompts), "--limit", "2", "--model", str(tiny_verifier),
           "--drafter", str(tiny_drafter), "--gamma", "3", "--max-tokens", "8",
           "--max-model-len", "256", "--max-num-seqs", "2", "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["prompts"] == 2
    assert summary["identical_outputs"] is True
    assert summary["plain_tokens_per_s"] > 0 and summary["spec_tokens_per_s"] > 0
    assert "greedy outputs identical: yes" in proc.stdout
    # Two engines started: neither found a `triton_kernels` package that is not Triton's
    # (vLLM logs to stdout by default).
    assert "Failed to import Triton kernels" not in proc.stdout + proc.stderr
