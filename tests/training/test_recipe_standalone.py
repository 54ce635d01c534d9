"""A block-causal (standalone) drafter from a recipe, as recipes/smollm2-135m-standalone.toml
makes the older default: at smoke scale on a tiny Llama verifier, stage 2 starts from stage 1's
export rebuilt whole, no verifier features are built, and the export is the slim checkpoint
with its reduced head chosen from the data; the shipped recipe is the model card's lineage."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from tests.tiny_models import write_tiny_verifier
from vllm_specdiff.drafter.loading import load_drafter
from vllm_specdiff.drafter.slim import MANIFEST_FILE, expand_checkpoint
from vllm_specdiff.drafter.vocab import load_d2t
from vllm_specdiff_training.cli import main
from vllm_specdiff_training.recipe.fields import RecipeError
from vllm_specdiff_training.recipe.schema import load_recipe, parse_recipe

ROOT = Path(__file__).parents[2]
RECIPE = """
name = "standalone"
verifier = "tiny"

[drafter]
arch = "block-causal"
num_layers = 2
gamma = 4
draft_vocab_size = 32

[generate]
backend = "transformers"

[[data.prompts]]
name = "p"
source = "prompts.jsonl"

[train]
freeze_params = ["embed_tokens", "layers\\\\.0\\\\.", "lm_head"]

[[stages]]
name = "stage1"
start = "verifier"
packs = ["p"]
loss = "mdm"
steps = 3

[[stages]]
name = "stage2"
start = "stage1"
packs = ["p"]
loss = "streak"
steps = 3

[[eval]]
name = "heldout"
packs = ["p"]

[export]
formats = ["specdiff"]
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("standalone")
    write_tiny_verifier(root / "tiny")
    (root / "prompts.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"w{i} w{i + 3} w{i + 7}"}]}) + "\n"
        for i in range(16)))
    (root / "standalone.toml").write_text(RECIPE)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDIFF_CACHE_DIR", str(root / "cache"))
        assert main(["recipe", "run", str(root / "standalone.toml"), "--smoke"]) == 0
    return root / "cache/recipes/standalone-smoke"


def test_a_standalone_recipe_trains_in_stages_without_features(work):
    summary = json.loads((work / "summary.json").read_text())
    assert [(s["stage"], s["status"]) for s in summary["stages"]] == \
        [(s, "done") for s in ("generate:p", "stage1", "stage2", "eval", "export")]
    first = json.loads((work / "runs/stage1/train_config.json").read_text())
    second = json.loads((work / "runs/stage2/train_config.json").read_text())
    assert first["arch"] == second["arch"] == "block-causal"
    assert first["init_from"] and first["draft_vocab_size"] is None  # full head while training
    # stage 2 starts from stage 1's export, rebuilt into the full directory train loads
    assert second["init_from"] is None and second["drafter"] == str(work / "drafters/stage1-3")
    assert not (work / "drafters/stage1-3" / MANIFEST_FILE).exists()
    curve = json.loads((work / "drafters/stage1-3/learning_curve.json").read_text())
    assert curve["run"].endswith("stage1")
    assert not list(work.glob("data/p/features-*"))
    assert summary["stages"][3]["outputs"]["heldout"]["windows"] > 0


def test_the_export_is_slim_with_the_reduced_head(work, tmp_path):
    export = work / "export/specdiff"
    assert (export / MANIFEST_FILE).is_file()  # rebuilt from the verifier when assembled
    assert load_d2t(export).numel() == 32
    full = expand_checkpoint(export, work.parents[2] / "tiny", tmp_path / "full")
    assert load_drafter(full, verifier_vocab_size=305).draft_vocab_size == 32
    saved = json.loads((export / "learning_curve.json").read_text())
    assert saved["train_config"]["drafter"] == str(work / "drafters/stage1-3")


@pytest.mark.parametrize("change, message", [
    (lambda d: d["drafter"].update(taps=[1]), r"drafter\.taps: a block-causal drafter reads no"),
    (lambda d: d["export"].update(formats=["dflash"]),
     r"export\.formats: dflash exports conditioned drafters only"),
    (lambda d: d["drafter"].update(arch="causal"), r"drafter\.arch: must be one of"),
])
def test_a_wrong_standalone_field_is_refused(tmp_path, change, message):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "prompts.jsonl").write_text('"w1 w2"\n')
    doc = tomllib.loads(RECIPE)
    change(doc)
    with pytest.raises(RecipeError, match=message):
        parse_recipe(doc, tmp_path, "bad")


def test_the_standalone_recipe_is_the_model_cards_lineage():
    r = load_recipe(ROOT / "recipes/smollm2-135m-standalone.toml")
    assert r.drafter.arch == "block-causal" and r.drafter.num_layers == 4
    assert r.drafter.draft_vocab_size == 8192 and r.export.formats == ["specdiff"]
    assert [(s.name, s.loss, s.steps) for s in r.stages] == \
        [("stage1", "mdm", 850), ("stage2a", "streak", 2500), ("stage2", "streak", 550)]
    assert sum(s.steps for s in r.stages) == 3900  # the shipped checkpoint's steps in all
    assert r.stages[-1].packs == ["greedy", "greedy-complete"] and not r.packs_to_make()
    card = (ROOT / "vllm_specdiff/assets/default_drafter/MODEL_CARD.md").read_text()
    assert "recipes/smollm2-135m-standalone.toml" in card
