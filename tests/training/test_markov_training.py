"""`train --add-markov-rank R`: a Markov head (vllm_specdiff/drafter/markov.py) added to a trained
conditioned drafter or to a new one, trained, shipped, and refused where it cannot go."""

import json

import pytest
import torch

from vllm_specdiff_training.cli import main
from vllm_specdiff_training.model import drafter_from_checkpoint
from vllm_specdiff_training.trainer import TrainConfig, Trainer, latest_checkpoint

from .test_conditioned_training import _cfg as conditioned_cfg

GAMMA, RANK = 4, 4


@pytest.fixture(scope="module")
def verifier(verifier3):
    return verifier3


@pytest.fixture(scope="module")
def data(greedy_data):
    return greedy_data


def _cfg(data, out, verifier, **kw) -> TrainConfig:
    """The conditioned-training tests' settings, shorter: 4 steps, a checkpoint every 2."""
    return conditioned_cfg(data, out, verifier, **{"steps": 4, "save_every": 2, "eval_every": 0,
                                                   **kw})


def test_a_head_added_to_a_trained_drafter_starts_at_its_drafts_then_trains(tmp_path, data,
                                                                           verifier):
    from vllm_specdiff.drafter.conditioned import ConditionedDrafter

    base = Trainer(_cfg(data, tmp_path / "base", verifier, steps=3)).run()["model"]
    run = Trainer(_cfg(data, tmp_path / "headed", verifier, drafter=base,
                       add_markov_rank=RANK))
    assert run.drafter.cfg.markov_rank == RANK
    batch = run._micro_batch(0)
    args = (batch.input_ids, batch.starts, GAMMA, batch.features)
    plain = ConditionedDrafter.from_pretrained(base, verifier).eval()
    with torch.no_grad():
        assert torch.equal(run.drafter.eval().window_logits(*args), plain.window_logits(*args))
    summary = run.run()
    assert run.drafter.markov.w_out.weight.abs().sum() > 0  # the head learned something

    shipped = ConditionedDrafter.from_pretrained(summary["model"], verifier).eval()
    rebuilt = drafter_from_checkpoint(latest_checkpoint(tmp_path / "headed"))
    assert shipped.cfg.markov_rank == rebuilt.cfg.markov_rank == RANK
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.window_logits(*args), shipped.window_logits(*args))
    # eval reads the windows' targets' prefixes too (teacher forced), replay included
    from vllm_specdiff_training.evaluate import EvalConfig, run_eval

    report = run_eval(EvalConfig(
        data=str(data), verifier=str(verifier), gamma=GAMMA, max_windows=12,
        candidates=[f"headed={summary['model']}"], output=str(tmp_path / "eval.json"),
        heldout_fraction=0.25, replay=True))["results"]["headed"]
    assert report["replay_steps"] > 0 and report["expected_accepted_length"] >= 0
    # a drafter that has a head already is not given a second one
    with pytest.raises(ValueError, match="already has a Markov head"):
        Trainer(_cfg(data, tmp_path / "twice", verifier, drafter=summary["model"],
                     add_markov_rank=2))


def test_add_markov_rank_is_refused_where_the_head_would_not_train(tmp_path, data, verifier):
    with pytest.raises(ValueError, match="--add-markov-rank must be >= 0"):
        _cfg(data, tmp_path, verifier, add_markov_rank=-1).validate()
    with pytest.raises(ValueError, match="--add-markov-rank adds a Markov head"):
        _cfg(data, tmp_path, verifier, drafter=str(tmp_path), finetune="lora",
             add_markov_rank=RANK).validate()
    with pytest.raises(ValueError, match="--add-markov-rank adds a Markov head"):
        TrainConfig(data=str(data), output=str(tmp_path), init_from=str(verifier),
                    add_markov_rank=RANK).validate()  # block-causal


def test_cli_trains_a_new_drafter_with_a_head_and_export_dflash_refuses_it(tmp_path, data,
                                                                           verifier, capsys):
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--output", str(out), "--init-from",
                 str(verifier), "--arch", "conditioned", "--num-layers", "1", "--num-taps", "2",
                 "--gamma", str(GAMMA), "--add-markov-rank", str(RANK), "--finetune", "full",
                 "--loss", "ce-decay", "--steps", "3", "--batch-size", "3",
                 "--windows-per-seq", "3", "--lr", "3e-3", "--warmup-steps", "1",
                 "--save-every", "3", "--eval-windows", "8", "--heldout-fraction", "0.25"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    from safetensors.torch import load_file

    assert json.loads(open(f"{model}/config.json").read())["markov_rank"] == RANK
    assert load_file(f"{model}/model.safetensors")["markov.w_out.weight"].abs().sum() > 0

    assert main(["export", "--run", str(out), "--verifier", str(verifier), "--output",
                 str(tmp_path / "dflash"), "--format", "dflash"]) == 2
    err = capsys.readouterr().err
    assert "Markov head" in err and "vLLM's `dflash` method cannot run" in err
    assert not (tmp_path / "dflash").exists()
    assert main(["export", "--run", str(out), "--verifier", str(verifier), "--output",
                 str(tmp_path / "native")]) == 0
    assert json.loads((tmp_path / "native" / "config.json").read_text())["markov_rank"] == RANK


RECIPE = """
name = "markov"
verifier = "tiny"

[drafter]
taps = [1, 2, 3]
num_layers = 1
gamma = 4

[generate]
backend = "transformers"

[[data.prompts]]
name = "p1"
source = "prompts.jsonl"

[[stages]]
name = "plain"
start = "verifier"
packs = ["p1"]
steps = 3

[[stages]]
name = "headed"
start = "plain"
packs = ["p1"]
steps = 3
add_markov_rank = 4

[[stages]]
name = "more"
start = "headed"
packs = ["p1"]
steps = 3
"""


def test_a_recipe_refuses_the_dflash_export_of_a_markov_lineage(tmp_path):
    """Up front, not after the training: the exported stage descends from one that adds a head."""
    import tomllib

    from vllm_specdiff_training.recipe.fields import RecipeError
    from vllm_specdiff_training.recipe.schema import parse_recipe

    (tmp_path / "tiny").mkdir()
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "w1 w2"}\n')
    with pytest.raises(RecipeError, match="export.formats: stage 'headed' adds a Markov head"):
        parse_recipe(tomllib.loads(RECIPE), tmp_path, "bad")  # default formats: both
    native = parse_recipe(tomllib.loads(RECIPE + '\n[export]\nformats = ["specdiff"]\n'),
                          tmp_path, "native")
    assert native.stages[1].add_markov_rank == RANK and native.stages[2].add_markov_rank == 0
    # an exported arm without a head in its lineage still exports both ways
    plain = parse_recipe(tomllib.loads(RECIPE + '\n[export]\nstage = "plain"\n'), tmp_path, "p")
    assert "dflash" in plain.export.formats
