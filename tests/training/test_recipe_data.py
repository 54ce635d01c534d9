"""The data side of a recipe: new packs made from a corpus, a prompt file or self-written
requests (continued with their own settings, decontaminated, packed), committed packs unpacked
instead of generated, resumption, and a bad data field refused by name. The shipped default's
recipe holds every committed pack's lineage, and the lineage agrees with the packs' own meta."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.tiny_models import write_family_verifier
from vllm_specdiff.models import default_verifier_dir
from vllm_specdiff.prompts import read_jsonl
from vllm_specdiff_training.cli import main
from vllm_specdiff_training.corpus import HELDOUT_TOPICS
from vllm_specdiff_training.recipe import packs as P
from vllm_specdiff_training.recipe.data_schema import pack_config
from vllm_specdiff_training.recipe.fields import RecipeError, describe
from vllm_specdiff_training.recipe.run import plan, run_recipe, select
from vllm_specdiff_training.recipe.schema import Recipe, load_recipe, parse_recipe
from vllm_specdiff_training.recipe.workspace import Workspace
from vllm_specdiff_training.self_prompts import _settings_of

ROOT = Path(__file__).parents[2]
DEFAULT_RECIPE = ROOT / "recipes" / "smollm2-135m-conditioned.toml"
HELDOUT_CHAT = f"Explain {sorted(HELDOUT_TOPICS)[0]} in simple terms."

RECIPE = """
name = "datarecipe"
verifier = "tiny"

[drafter]
taps = [1, 2, 3]
num_layers = 1
gamma = 4

[generate]
pack = true
backend = "transformers"

[[data.corpus]]
name = "c1"
num_code = 4
num_chat = 4
seed = 7
exclude_earlier = false
generate = { temperature = 1.0, seed = 3 }

# the same seed: only the exclusion keeps it from repeating c1
[[data.corpus]]
name = "c2"
num_code = 4
num_chat = 4
seed = 7

[[data.prompts]]
name = "p1"
source = "prompts.jsonl"

[[stages]]
name = "stage1"
start = "verifier"
packs = ["c1", "c2", "p1"]
steps = 3
"""


def _prompt_file(path: Path) -> Path:
    records = [{"messages": [{"role": "user", "content": f"w{i} w{i + 1} w{i + 2}"}],
                "source": "chat"} for i in range(5)]
    records.insert(2, {"messages": [{"role": "user", "content": HELDOUT_CHAT}], "source": "chat"})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The recipe above at smoke scale on a tiny 6-layer verifier, twice."""
    root = tmp_path_factory.mktemp("recipe")
    write_family_verifier(root / "tiny", "qwen3", hidden=64, layers=6, heads=2, kv_heads=1,
                          head_dim=32, peak=1.0)
    _prompt_file(root / "prompts.jsonl")
    recipe = root / "data.toml"
    recipe.write_text(RECIPE)
    cache = root / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDIFF_CACHE_DIR", str(cache))
        assert main(["recipe", "run", str(recipe), "--smoke"]) == 0
        work = cache / "recipes" / "datarecipe-smoke"
        first = json.loads((work / "summary.json").read_text())
        assert main(["recipe", "run", str(recipe), "--smoke"]) == 0
        second = json.loads((work / "summary.json").read_text())
        yield SimpleNamespace(root=root, recipe=recipe, cache=cache, work=work, first=first,
                              second=second, outputs={s["stage"]: s["outputs"]
                                                      for s in first["stages"]})


def test_new_packs_are_made_continued_with_their_own_settings_and_packed(run):
    stages = ["generate:c1", "generate:c2", "generate:p1", "features", "stage1", "export"]
    assert [(s["stage"], s["status"]) for s in run.first["stages"]] == \
        [(s, "done") for s in stages]
    assert [s["status"] for s in run.second["stages"]] == ["skipped"] * len(stages)
    c1 = json.loads((run.work / "data/c1/meta.json").read_text())
    c2 = json.loads((run.work / "data/c2/meta.json").read_text())
    assert (c1["temperature"], c1["seed"]) == (1.0, 3)  # the pack's own
    assert (c2["temperature"], c2["seed"]) == (0.0, 0)  # [generate]'s
    assert c1["max_new_tokens"] == c2["max_new_tokens"] == 24  # capped by --smoke
    # a smoke run packs into its own folder, never into the recipe's packs_dir
    assert Path(run.outputs["generate:c1"]["pack"]) == run.work / "packs/c1.npz"
    assert (run.work / "packs/c1.json").is_file()
    assert not (run.root.parent / "data" / "c1.npz").exists()


def test_a_corpus_repeats_no_prompt_of_the_corpora_before_it(run):
    def texts(pack: str) -> list[str]:
        return [r["messages"][0]["content"] for r in read_jsonl(run.work / f"corpus/{pack}.jsonl")]

    first, second = texts("c1"), texts("c2")
    assert len(first) == 8 and second  # the same seed: without the exclusion c2 would be c1
    assert not set(first) & set(second)
    settings = json.loads((run.work / "corpus/c2.settings.json").read_text())
    assert settings["exclude"] == [str(run.work / "corpus/c1.jsonl")]


def test_a_prompt_file_is_decontaminated_of_held_out_topics(run):
    out = run.outputs["generate:p1"]
    assert out["dropped_sequences"] == 1
    assert read_jsonl(out["prompts"])[2]["messages"][0]["content"] == HELDOUT_CHAT
    from safetensors.torch import load_file

    kept = [n for shard in sorted((run.work / "data/p1").glob("shard-*.safetensors"))
            for n in load_file(str(shard))["prompt_index"].tolist()]
    assert sorted(kept) == [0, 1, 3, 4, 5]  # prompt 2 (the held-out topic) went


def _elsewhere(run: SimpleNamespace, text: str) -> str:
    """The recipe text with its relative paths made absolute, to be written in another folder."""
    return text.replace('"prompts.jsonl"', json.dumps(str(run.root / "prompts.jsonl"))) \
        .replace('"tiny"', json.dumps(str(run.root / "tiny")))


def test_changed_prompt_settings_refuse_the_old_prompt_file(run, tmp_path):
    changed = tmp_path / "data.toml"
    changed.write_text(_elsewhere(run, RECIPE.replace("seed = 7\nexclude_earlier",
                                                      "seed = 8\nexclude_earlier")))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDIFF_CACHE_DIR", str(run.cache))
        with pytest.raises(ValueError, match=r"c1\.jsonl was written with other settings"):
            run_recipe(changed, smoke=True, only="generate:c1")


def test_a_committed_pack_is_unpacked_not_generated(run, tmp_path):
    recipe = tmp_path / "committed.toml"
    packs_dir = json.dumps(str(run.work / "packs"))  # what the first run packed
    recipe.write_text(_elsewhere(run, RECIPE.replace('name = "datarecipe"', 'name = "committed"')
                                 .replace('name = "c1"\n', 'name = "c1"\ncommitted = true\n')
                                 .replace("[generate]",
                                          f"[data]\npacks_dir = {packs_dir}\n\n[generate]")))
    r = load_recipe(recipe)
    assert r.committed_packs() == ["c1"] and [p.name for _, p in r.packs_to_make()] == ["c2", "p1"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDIFF_CACHE_DIR", str(tmp_path / "cache"))
        assert main(["recipe", "run", str(recipe), "--smoke", "--only", "data"]) == 0
    data = tmp_path / "cache/recipes/committed-smoke/data/c1"
    assert json.loads((data / "meta.json").read_text())["unpacked_from"] == "c1.npz"
    assert not (tmp_path / "cache/recipes/committed-smoke/corpus").exists()  # nothing generated


def _doc(folder: Path) -> dict:
    """The recipe's document, its verifier and prompt file stand-ins in `folder` (validation
    checks they exist; nothing here loads them)."""
    (folder / "tiny").mkdir()
    _prompt_file(folder / "prompts.jsonl")
    return tomllib.loads(RECIPE)


@pytest.mark.parametrize("change, message", [
    (lambda d: d["data"]["corpus"][0].update(seeed=1),
     r"data\.corpus\[0\]\.seeed: unknown field; did you mean 'seed'"),
    (lambda d: d["data"]["corpus"][0]["generate"].update(tempreature=1.0),
     r"data\.corpus\[0\]\.generate\.tempreature: unknown field; did you mean 'temperature'"),
    (lambda d: d["data"]["corpus"][0]["generate"].update(temperature=-1.0),
     r"data\.corpus\[0\]\.generate: --temperature must be >= 0"),
    (lambda d: d["data"]["corpus"][0]["generate"].update(top_logprobs="8"),
     r"data\.corpus\[0\]\.generate\.top_logprobs: must be an integer"),
    (lambda d: d["data"]["corpus"][0]["generate"].update(top_logprobs=8),
     r"stages\[0\]\.packs: packs with different soft targets .* \(top_logprobs: c1 8, c2 0"),
    (lambda d: d["data"]["corpus"][1].update(code_tasks=["complete", "sing"]),
     r"data\.corpus\[1\]: --code-tasks must name"),
    (lambda d: d["data"]["corpus"][1].update(name="c1"),
     r"data\.corpus\[1\]\.name: pack 'c1' is already named by data\.corpus\[0\]\.name"),
    (lambda d: d["data"]["corpus"][0].update(committed=True),
     r"data\.corpus\[0\]\.committed: no committed pack 'c1'"),
    (lambda d: d["data"]["prompts"][0].update(source="missing.jsonl"),
     r"data\.prompts\[0\]\.source: neither a built-in prompt source"),
    (lambda d: d["data"].update(self_prompts=[{"name": "s1", "state": "gone.json"}]),
     r"data\.self_prompts\[0\]\.state: no state file"),
    (lambda d: d["data"].update(self_prompts=[{"name": "s1", "near_duplicate": 2.0}]),
     r"data\.self_prompts\[0\]: --near-duplicate must be in"),
])
def test_a_bad_data_field_is_refused_by_name(tmp_path, change, message):
    doc = _doc(tmp_path)
    change(doc)
    with pytest.raises(RecipeError, match=message):
        parse_recipe(doc, tmp_path, "bad")


def test_a_committed_state_is_copied_in_once_and_resumed(tmp_path, monkeypatch):
    """self-prompts goes on from a stopped run's state: copied into the work directory when it
    has none (never over the work directory's own), then the requests written once."""
    (tmp_path / "stopped.json").write_text('{"next_round": 4}')
    doc = _doc(tmp_path)
    doc["data"]["self_prompts"] = [{"name": "s1", "num_prompts": 3, "state": "stopped.json",
                                    "benchmark_prompts": ["../elsewhere/held.jsonl"]}]
    r = parse_recipe(doc, tmp_path, "selfie")
    ws = Workspace(r, tmp_path / "work", str(tmp_path / "tiny"))
    calls = []

    def fake(cfg):
        state = Path(cfg.output + ".state.json")
        calls.append((cfg, json.loads(state.read_text()) if state.is_file() else None))
        Path(cfg.output).write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
        state.unlink(missing_ok=True)  # as a finished run does

    monkeypatch.setattr("vllm_specdiff_training.self_prompts.run_self_prompts", fake)
    pack = r.data.self_prompts[0]
    path = P.self_written_prompts(ws, pack)
    assert path == tmp_path / "work/corpus/s1.jsonl" and path.is_file()
    (cfg, state), = calls
    assert state == {"next_round": 4}  # the committed state, in place before sampling began
    assert cfg.num_prompts == 3 and cfg.verifier == str(tmp_path / "tiny")
    assert cfg.benchmark_prompts == [str(tmp_path.parent / "elsewhere/held.jsonl")]
    P.self_written_prompts(ws, pack)
    assert len(calls) == 1  # written once
    path.unlink()
    Path(f"{path}.state.json").write_text('{"next_round": 9}')  # the work dir's own progress
    P.self_written_prompts(ws, pack)
    assert calls[-1][1] == {"next_round": 9}


def test_every_data_field_has_its_help():
    rows = [(path, help_) for path, _, help_ in describe(Recipe)
            if path.startswith(("data.", "generate."))]
    assert {"data.corpus[].committed", "data.corpus[].generate.temperature",
            "data.self_prompts[].state", "data.prompts[].source"} <= {p for p, _ in rows}
    assert [p for p, help_ in rows if not help_.strip()] == []


# ---- the shipped default's lineage ---------------------------------------------------------------
def test_the_default_recipe_generates_nothing_a_fresh_clone_has():
    r = load_recipe(DEFAULT_RECIPE)
    committed = {p.stem for p in (ROOT / "data").glob("*.npz")}
    assert set(r.committed_packs()) <= committed and not r.data.packs  # every pack's lineage
    assert not r.packs_to_make()  # greedy-self3, the last made, is committed too
    ws = Workspace(r, Path("/nonexistent/work"), "verifier")
    steps = plan(ws)
    names = [s.name for s in select(steps, None, None)]
    assert names[:2] == ["data", "features"] and not any(n.startswith("generate:") for n in names)
    data = next(s for s in steps if s.name == "data")
    assert sorted(data.settings["packs"]) == sorted(committed)


def test_the_default_lineage_agrees_with_each_committed_pack():
    r = load_recipe(DEFAULT_RECIPE)
    for table, pack in r.new_packs():
        if not pack.committed:
            continue
        meta = json.loads((ROOT / "data" / f"{pack.name}.json").read_text())
        settings = r.generate_settings(pack)
        for key in ("temperature", "top_logprobs", "seed", "max_new_tokens", "chunk_size",
                    "num_samples", "max_prompt_tokens"):
            assert meta[key] == settings[key], (pack.name, key)
        prompts = pack.num_code + pack.num_chat if table == "corpus" else pack.num_prompts
        assert meta["num_prompts"] == prompts, pack.name


def test_the_default_self3_table_resumes_the_committed_state():
    """The committed state of seed 3 only resumes under exactly its settings: the recipe's table
    must give them (run_self_prompts refuses a state made with others)."""
    r = load_recipe(DEFAULT_RECIPE)
    pack = next(p for p in r.data.self_prompts if p.name == "greedy-self3")
    cfg = pack_config(r, "self_prompts", pack, verifier=str(default_verifier_dir()), output="x",
                      backend=r.generate.backend, dtype=r.generate.dtype,
                      device=r.generate.device)
    state = json.loads(Path(r.resolve(pack.state)).read_text())
    assert _settings_of(cfg) == state["settings"]
