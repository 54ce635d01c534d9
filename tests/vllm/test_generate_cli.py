"""`vllm-specdiff generate`: jsonl in, jsonl out, with and without speculation (greedy)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.vllm.tiny_models import word_prompt

pytestmark = pytest.mark.vllm


def _generate(tmp_path, verifier, drafter, extra: list[str], name: str):
    out = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "vllm_specdiff.cli", "generate",
           "--input", str(tmp_path / "prompts.jsonl"), "--output", str(out),
           "--model", str(verifier), "--max-model-len", "256", "--max-num-seqs", "2",
           "--max-tokens", "10", "--chunk-size", "3", "--gamma", "3", "--drafter", str(drafter),
           *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()], proc.stderr


def test_generate_jsonl_matches_plain_decoding(tmp_path, tiny_verifier, tiny_drafter):
    records = [{"id": f"p{i}", "prompt": word_prompt(i, 3 + 4 * i)} for i in range(5)]
    records.append({"messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 4})
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    spec, err = _generate(tmp_path, tiny_verifier, tiny_drafter, [], "spec")
    plain, _ = _generate(tmp_path, tiny_verifier, tiny_drafter, ["--no-spec"], "plain")
    assert [r["id"] for r in spec] == ["p0", "p1", "p2", "p3", "p4", 5]
    assert [r["output_token_ids"] for r in spec] == [r["output_token_ids"] for r in plain]
    assert len(spec[-1]["output_token_ids"]) <= 4
    assert all(r["output"] for r in spec)
    assert "generate: 100%" in err  # the progress bar
    assert "mean_accepted_length" in err


def test_generate_rejects_bad_input(tmp_path, tiny_verifier, tiny_drafter):
    def run(record: str, drafter) -> subprocess.CompletedProcess:
        (tmp_path / "prompts.jsonl").write_text(record + "\n")
        cmd = [sys.executable, "-m", "vllm_specdiff.cli", "--no-speed-env", "generate",
               "--input", str(tmp_path / "prompts.jsonl"), "--output", str(tmp_path / "o.jsonl"),
               "--model", str(tiny_verifier), "--drafter", str(drafter)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    # the input file is checked first, before any engine starts, with file and line
    proc = run('{"question": "no prompt field"}', tiny_drafter)
    assert proc.returncode == 2
    assert "prompts.jsonl:1: a record needs 'messages'" in proc.stderr
    proc = run('{"prompt": "hi"}', tmp_path / "missing")
    assert proc.returncode == 2
    assert "'drafter'" in proc.stderr
