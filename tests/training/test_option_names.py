"""The trainer's names match the plugin's: drafter_temperature, num_drafts (old spellings warn)."""

from __future__ import annotations

import json

import pytest

from vllm_specdiff_training.cli import build_parser


def test_drafter_temperature_flag_and_its_old_spelling():
    args = build_parser().parse_args(["train", "--data", "d", "--output", "o",
                                      "--drafter-temperature", "2"])
    assert args.drafter_temperature == 2.0
    with pytest.warns(FutureWarning, match="--draft-temperature is deprecated; use "
                                           "--drafter-temperature"):
        args = build_parser().parse_args(["eval", "--data", "d", "--verifier", "v",
                                          "--candidate", "c", "--draft-temperature", "0.5",
                                          "--num-drafts", "3"])
    assert (args.drafter_temperature, args.num_drafts) == (0.5, 3)


def test_run_saved_with_the_old_name_resumes(tmp_path):
    """A checkpoint written before the rename (draft_temperature) matches the same settings."""
    from dataclasses import asdict

    from vllm_specdiff_training.trainer import TrainConfig, _check_same_run

    cfg = TrainConfig(data=str(tmp_path / "data"), output=str(tmp_path / "out"))
    saved = asdict(cfg)
    saved["draft_temperature"] = saved.pop("drafter_temperature")
    (tmp_path / "state.json").write_text(json.dumps({"config": saved}))
    _check_same_run(tmp_path, cfg)  # must not raise
    saved["draft_temperature"] = 2.0
    (tmp_path / "state.json").write_text(json.dumps({"config": saved}))
    with pytest.raises(ValueError, match="--drafter-temperature"):
        _check_same_run(tmp_path, cfg)
