"""scripts/data_comparison_report.py: the figures it adds to the data comparison's evals."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("data_comparison_report", ROOT / "scripts" /
                                                  "data_comparison_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paired_difference_and_its_standard_error():
    paired = _script().paired
    r = paired([1.0, 2.0, 4.0], [0.0, 1.0, 1.0])  # differences 1, 1, 3
    assert r["difference"] == pytest.approx(5 / 3)
    assert r["stderr"] == pytest.approx(math.sqrt((2 * (2 / 3) ** 2 + (4 / 3) ** 2) / 2 / 3))
    with pytest.raises(ValueError, match="same windows"):
        paired([1.0, 2.0], [1.0])


def test_generate_summaries_of_several_restarts_are_summed(tmp_path):
    log = tmp_path / "g.json"
    log.write_text(json.dumps({"generated_tokens": 100, "seconds": 10.0}, indent=2) + "\n"
                   + "(MainProcess pid=1) INFO non-default args: {'dtype': 'float32'}\n"
                   + "{not json either\n"
                   + json.dumps({"shards": 8, "skipped": 8, "generated_tokens": 0,
                                 "seconds": 0.0}) + "\n"
                   + json.dumps({"generated_tokens": 50, "seconds": 5.0}) + "\n")
    assert _script().generate_summary(log) == {"generated_tokens": 150, "seconds": 15.0,
                                               "tokens_per_s": 10.0}


def test_run_budget_counts_each_step_once_up_to_the_compared_one(tmp_path):
    (tmp_path / "train_config.json").write_text(json.dumps(
        {"data": "d", "loss": "streak", "drafter": "s"}))
    steps = [{"step": s, "loss": -0.1, "tokens": 10, "seconds": 2.0, "cpu_seconds": 1.0}
             for s in (1, 2, 3, 2, 3, 4)]  # resumed after step 1: steps 2-3 logged twice
    steps[4]["heldout_expected_streak"] = 0.5
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    r = _script().run_summary(tmp_path, 3)
    assert r["tokens"] == 30 and r["cpu_hours"] == pytest.approx(3 / 3600)
    assert r["heldout_expected_streak"] == 0.5
    with pytest.raises(ValueError, match="every step up to 5"):
        _script().run_summary(tmp_path, 5)


def test_the_two_data_sets_must_hold_the_same_prompts():
    check = _script().check_same_prompts
    check({"prompts": [0, 1], "heldout_prompts": [1]}, {"prompts": [0, 1], "heldout_prompts": [1]})
    with pytest.raises(ValueError, match="differ in their prompts"):
        check({"prompts": [0, 1], "heldout_prompts": [1]}, {"prompts": [0, 2],
                                                             "heldout_prompts": [1]})


def test_estimate_check_pairs_the_estimate_with_the_verifier_pass():
    check = {"results": {"a": {"windows": 2, "expected_accepted_length": 0.5,
                               "verifier_token_streak": 0.6,
                               "verifier_token_streak_per_window": [0.5, 0.7],
                               "expected_accepted_length_per_window": [0.4, 0.6]}}}
    row = _script().estimate_check(check)["a"]
    assert row["difference"]["difference"] == pytest.approx(0.1)
    assert row["difference"]["stderr"] == pytest.approx(0.0, abs=1e-12)
