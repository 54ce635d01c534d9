"""`specdiff-distill recipe`: a recipe for a tiny Qwen3 verifier written by `recipe new` runs end
to end at smoke scale (self-written data, features, two training stages, eval, export), a second
run skips every stage, a wrong recipe is refused naming the field, and the shipped default's
recipe is the model card's stage list on the committed packs."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.tiny_models import write_family_verifier
from vllm_specdiff.drafter.conditioned import spread_taps
from vllm_specdiff.drafter.loading import load_drafter
from vllm_specdiff_training.cli import main
from vllm_specdiff_training.export_dflash import mask_stand_in
from vllm_specdiff_training.features import TapModel
from vllm_specdiff_training.recipe.fields import RecipeError
from vllm_specdiff_training.recipe.run import run_recipe
from vllm_specdiff_training.recipe.schema import load_recipe, parse_recipe

ROOT = Path(__file__).parents[2]
DEFAULT_RECIPE = ROOT / "recipes" / "smollm2-135m-conditioned.toml"
GAMMA = 4
STAGES = ["generate:self1", "features", "stage1", "stage2", "eval", "export"]


def _end_turns_often(path: Path) -> None:
    """Random weights almost never write the end token, so self-prompts would keep no request:
    point its head row along the mean final hidden state (about one token in twelve ends)."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(path)).eval()
    ids = torch.randint(5, 300, (8, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mean = model.model(ids).last_hidden_state.reshape(-1, model.config.hidden_size).mean(0)
        model.lm_head.weight[model.config.eos_token_id] = 1.7 * mean / mean.norm()
    model.save_pretrained(str(path))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    path = write_family_verifier(tmp_path_factory.mktemp("qwen3") / "tinyqwen", "qwen3",
                                 hidden=64, layers=6, heads=2, kv_heads=1, head_dim=32, peak=1.0)
    _end_turns_often(path)
    return path


@pytest.fixture(scope="module")
def smoke(qwen3, tmp_path_factory):
    """`recipe new` on the verifier, then `recipe run --smoke` twice."""
    cache = tmp_path_factory.mktemp("cache")
    recipe = tmp_path_factory.mktemp("recipes") / "qwen3.toml"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDIFF_CACHE_DIR", str(cache))
        assert main(["recipe", "new", "--verifier", str(qwen3), "--output", str(recipe),
                     "--gamma", str(GAMMA), "--num-prompts", "12"]) == 0
        text = recipe.read_text()  # the evaluation also scores stage 1: a comparison's arms
        recipe.write_text(text.replace('packs = ["self1"]\n\n[export]',
                                       'packs = ["self1"]\nstages = ["stage1"]\n\n[export]'))
        assert recipe.read_text() != text
        work = cache / "recipes" / "tinyqwen-conditioned-smoke"
        assert main(["recipe", "run", str(recipe), "--smoke"]) == 0
        first = json.loads((work / "summary.json").read_text())
        assert main(["recipe", "run", str(recipe), "--smoke"]) == 0
        second = json.loads((work / "summary.json").read_text())
        yield SimpleNamespace(recipe=recipe, work=work, first=first, second=second, cache=cache)


def test_recipe_new_reads_taps_template_and_mask_from_the_verifier(smoke, qwen3):
    r = load_recipe(smoke.recipe)
    assert r.drafter.taps == list(spread_taps(6, 3)) == [1, 2, 3]
    assert r.drafter.gamma == GAMMA and r.drafter.draft_vocab_size is None  # 305 ids: full head
    assert r.export.mask_token_id == mask_stand_in(qwen3)
    assert r.verifier == str(qwen3) and r.generate.chat_template
    assert not r.data.packs and [p.name for p in r.data.self_prompts] == ["self1"]
    assert [(s.name, s.start, s.packs) for s in r.stages] == \
        [("stage1", "verifier", ["self1"]), ("stage2", "stage1", ["self1"])]


def test_smoke_runs_every_stage_and_a_second_run_skips_them(smoke):
    assert [s["stage"] for s in smoke.first["stages"]] == STAGES
    assert [s["status"] for s in smoke.first["stages"]] == ["done"] * len(STAGES)
    assert [s["status"] for s in smoke.second["stages"]] == ["skipped"] * len(STAGES)
    outputs = {s["stage"]: s["outputs"] for s in smoke.first["stages"]}
    assert json.loads(Path(outputs["generate:self1"]["prompts"]).read_text().splitlines()[0])
    assert outputs["features"]["shards_built"] >= 1
    assert outputs["stage2"]["steps"] == 3  # capped by --smoke
    heldout = outputs["eval"]["heldout"]
    assert heldout["windows"] > 0 and heldout["replay_accepted_per_step"] >= 0
    arm = heldout["compared"]["stage1"]  # scored on the same windows as the exported stage 2
    assert arm["windows"] == heldout["windows"] and arm["replay_accepted_per_step"] >= 0
    report = json.loads(Path(heldout["output"]).read_text())
    assert set(report["results"]) == {"stage1", "stage2"}
    # the second stage started from the first one's export and trained on
    config = json.loads((smoke.work / "runs/stage2/train_config.json").read_text())
    assert config["drafter"] == outputs["stage1"]["drafter"]
    assert config["arch"] == "conditioned" and config["num_taps"] == 3 and config["gamma"] == GAMMA


def test_the_exported_drafter_loads_in_both_formats_and_drafts_alike(smoke, qwen3):
    specdiff = load_drafter(smoke.work / "export/specdiff", verifier=qwen3)
    dflash = load_drafter(smoke.work / "export/dflash", verifier=qwen3)
    assert tuple(specdiff.feature_taps) == tuple(dflash.feature_taps) == (1, 2, 3)
    ids = torch.randint(5, 300, (1, 14), generator=torch.Generator().manual_seed(1))
    features = TapModel(qwen3, (1, 2, 3))(ids)
    drafts = []
    for drafter in (specdiff, dflash):
        with torch.inference_mode():
            logits = drafter.window_logits(ids, torch.tensor([[10]]), GAMMA, features)
        drafts.append(drafter.to_verifier_vocab(logits[0, 0]).argmax(-1))
    assert drafts[0].shape == (GAMMA,)
    assert torch.equal(drafts[0], drafts[1])
    trained = load_drafter(smoke.work / "drafters/stage1-3", verifier=qwen3)
    assert not torch.equal(trained.fc.weight, specdiff.fc.weight)  # stage 2 moved the weights


def _doc(recipe: Path) -> dict:
    return tomllib.loads(recipe.read_text())


@pytest.mark.parametrize("change, message", [
    (lambda d: d["stages"][1].update(lrr=1e-4),
     r"stages\[1\]\.lrr: unknown field; did you mean 'lr'"),
    (lambda d: d["stages"][0].update(steps="many"), r"stages\[0\]\.steps: must be an integer"),
    (lambda d: d["stages"][1].update(packs=["self1", "self9"]),
     r"stages\[1\]\.packs\[1\]: unknown pack 'self9'"),
    (lambda d: d["stages"][0].update(start="stage2"),
     r"stages\[0\]\.start: 'stage2' is neither `verifier`, an earlier stage"),
    (lambda d: d["data"].update(packs=["greedy-nope"]),
     r"data\.packs\[0\]: no committed pack 'greedy-nope'"),
    (lambda d: d["train"].update(schedule="sometimes"), r"train\.schedule: must be one of"),
    (lambda d: d["drafter"].update(taps="1,2,3"), r"drafter\.taps: must be a list"),
    (lambda d: d["eval"][0].update(packs=[]), r"eval\[0\]: give exactly one of packs"),
    (lambda d: d["eval"][0].update(stages=["stage9"]),
     r"eval\[0\]\.stages\[0\]: no stage named 'stage9'"),
])
def test_a_bad_recipe_is_refused_naming_the_field(smoke, change, message):
    doc = _doc(smoke.recipe)
    change(doc)
    with pytest.raises(RecipeError, match=message):
        parse_recipe(doc, smoke.recipe.parent, "bad")


def test_the_cli_names_the_field_and_taps_off_the_spread_are_refused(smoke, tmp_path, capsys):
    text = smoke.recipe.read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("lr = 2e-4", "lr = \"fast\""))
    assert main(["recipe", "run", str(bad), "--smoke"]) == 2
    assert 'stages[1].lr: must be a number, got \'fast\'' in capsys.readouterr().err
    bad.write_text(text.replace("taps = [1, 2, 3]", "taps = [1, 2, 4]"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDIFF_CACHE_DIR", str(tmp_path / "cache"))
        with pytest.raises(RecipeError, match=r"drafter\.taps: .* 6-layer verifier, \[1, 2, 3\]"):
            run_recipe(bad, smoke=True)
    assert not (tmp_path / "cache").exists()  # refused before anything ran


def _copy_verifier(src: Path, dst: Path, **config: object) -> Path:
    shutil.copytree(src, dst)
    path = dst / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return dst


def test_recipe_new_for_a_deep_verifier_with_a_large_vocabulary(qwen3, tmp_path):
    verifier = _copy_verifier(qwen3, tmp_path / "deep", num_hidden_layers=36, vocab_size=151936,
                              layer_types=["full_attention"] * 36)
    out = tmp_path / "deep.toml"
    assert main(["recipe", "new", "--verifier", str(verifier), "--output", str(out)]) == 0
    r = load_recipe(out)
    assert r.drafter.taps == [1, 9, 17, 25, 33]  # DFlash's five taps from layer 1 to L-3
    assert r.drafter.draft_vocab_size == 32768
    assert r.generate.pack is False  # ids past uint16 cannot be packed
    assert main(["recipe", "new", "--verifier", str(verifier), "--output", str(out)]) == 2


def test_recipe_new_refuses_a_verifier_without_a_chat_template(qwen3, tmp_path, capsys):
    verifier = _copy_verifier(qwen3, tmp_path / "plain")
    (verifier / "chat_template.jinja").unlink(missing_ok=True)
    tok_config = verifier / "tokenizer_config.json"
    tok_config.write_text(json.dumps({k: v for k, v in json.loads(tok_config.read_text()).items()
                                      if k != "chat_template"}))
    out = tmp_path / "plain.toml"
    assert main(["recipe", "new", "--verifier", str(verifier), "--output", str(out)]) == 2
    assert "has no chat template" in capsys.readouterr().err
    assert not out.exists()


def test_the_default_recipe_is_the_model_card_stage_list_on_committed_packs():
    r = load_recipe(DEFAULT_RECIPE)  # validates every field and that each pack is committed
    committed = {p.stem for p in (ROOT / "data").glob("*.npz")}
    assert r.verifier == "default" and set(r.committed_packs()) <= committed
    assert not {p.name for _, p in r.packs_to_make()} & r.packs_read()  # test_recipe_data.py
    subsets = {s.name: s.pack for s in r.data.subsets}
    assert set(subsets.values()) <= committed
    for s in r.stages:
        assert {subsets.get(p, p) for p in s.packs} <= committed, s.name
    names = [s.name for s in r.stages]
    line = ["stage1", "stage2", "stage3a", "stage3", "stage4", "stage5-arm", "stage5",
            "stage6-arm", "stage6", "stage7", "stage8", "stage10", "stage11"]  # no stage 9
    arms = ["stage12-ce-decay", "stage12-dpace", "stage12-markov", "stage12-kl"]  # compared
    assert names == line + arms
    assert sum(s.steps for s in r.stages[:12]) == 41_150  # the model card's steps to stage 10
    assert r.stages[0].start == "verifier" and r.drafter.draft_vocab_size == 8192
    assert [s.start for s in r.stages[1:len(line)]] == line[:-1]  # each from the one before
    assert {s.start for s in r.stages[len(line):]} == {"stage11"}  # the arms: one start
    assert len({(s.steps, tuple(s.packs), s.lr) for s in r.stages[len(line):]}) == 1
    assert r.final_stage().add_markov_rank == 0 or "dflash" not in r.export.formats
    assert r.drafter.taps == list(spread_taps(30, 3)) == [1, 14, 27]
    assert r.final_stage().name in line + arms
    assert "10.5" in DEFAULT_RECIPE.read_text().split("\n\n")[0]  # CPU hours in the header


def test_only_picks_a_stage_and_a_stage_without_its_record_resumes(smoke, capsys):
    """Runs last among the smoke tests: it reruns stage2 of the shared work directory."""
    assert main(["recipe", "run", str(smoke.recipe), "--smoke", "--only", "stage7"]) == 2
    assert "this recipe's stages are generate:self1, features, stage1" in capsys.readouterr().err
    checkpoint = smoke.work / "runs/stage2/checkpoints/step-0000003/trainable.safetensors"
    before = checkpoint.stat().st_mtime_ns
    (smoke.work / "stages/stage2.json").unlink()
    assert main(["recipe", "run", str(smoke.recipe), "--smoke", "--only", "stage2"]) == 0
    summary = json.loads((smoke.work / "summary.json").read_text())
    assert [(s["stage"], s["status"]) for s in summary["stages"]] == [("stage2", "done")]
    assert checkpoint.stat().st_mtime_ns == before  # resumed at its last step: nothing retrained
    assert (smoke.work / "stages/stage2.json").is_file()
