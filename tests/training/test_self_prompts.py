"""`self-prompts`: the verifier's own requests, sampled from its chat template with the user turn
opened, kept only when complete, new and not benchmark material."""

import json
import random

import pytest

from tests.tiny_models import write_tiny_verifier
from vllm_specdiff.prompts import render_chat
from vllm_specdiff_training.cli import main
from vllm_specdiff_training.data import SequenceChunk
from vllm_specdiff_training.generate import GenerateConfig
from vllm_specdiff_training.request_styles import (
    CATEGORY_NAMES,
    PERSONAS,
    REWRITE_INSTRUCTION,
    parse_styles,
)
from vllm_specdiff_training.self_prompts import (
    RequestFilter,
    SelfPromptsConfig,
    benchmark_ngrams,
    distinct_trigram_share,
    names_heldout_topic,
    ngrams,
    run_self_prompts,
    user_turn_prefix,
)


@pytest.fixture(scope="module")
def chat_verifier(tmp_path_factory):
    return write_tiny_verifier(tmp_path_factory.mktemp("self") / "verifier", peak=0.5)


def test_the_prefix_is_the_template_up_to_the_users_text(chat_verifier):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_verifier))
    prefix = user_turn_prefix(tok)
    assert tok.decode(prefix).strip() == "<|user|>"
    text = tok.apply_chat_template([{"role": "user", "content": "w5 w6"}], tokenize=False,
                                   add_generation_prompt=True)
    whole = tok(text, add_special_tokens=False)["input_ids"]
    assert whole[:len(prefix)] == prefix and whole[len(prefix)] != prefix[-1]


def test_held_out_topics_are_found_as_phrases_in_any_case():
    assert names_heldout_topic("Tell me something about SHARKS, please.")
    assert names_heldout_topic("How did the Solar System form?")
    assert not names_heldout_topic("What do shark-free beaches look like?")  # 'shark' != 'sharks'
    assert not names_heldout_topic("Help me plan a garden party.")


def test_a_request_sharing_eight_words_with_a_benchmark_prompt_is_dropped():
    benchmark = "Write a python function to return the sum of all even numbers in a list"
    keep = RequestFilter(min_words=4, grams=ngrams(benchmark))
    assert keep.reason("Please return the sum of all even numbers in a list for me", True) \
        == "benchmark_ngram"
    assert keep.reason("Please return the sum of the odd numbers in my list", True) is None


def test_the_real_benchmarks_give_their_ngrams():
    grams = benchmark_ngrams(["humaneval"])
    # HumanEval/0's docstring, as any request quoting it would
    assert ngrams("Check if in given list of numbers, are any two numbers closer to each other "
                  "than given threshold.") & grams


class ScriptedBackend:
    """Returns the scripted samples in order, `cfg.num_samples` per prompt, as a `generate`
    backend would."""

    def __init__(self, samples: list[list[int]]) -> None:
        self.samples = samples
        self.calls: list[tuple[int, int]] = []
        self.cfg = GenerateConfig(verifier="v", prompts="", output="", num_samples=4)

    def generate(self, prompt_ids, seed):
        self.calls.append((len(prompt_ids), seed))
        out = SequenceChunk([], [], [])
        for pi, prefix in enumerate(prompt_ids):
            batch = self.samples[:self.cfg.num_samples]
            self.samples = self.samples[self.cfg.num_samples:]
            out.sequences += [prefix + s for s in batch]
            out.prompt_lens += [len(prefix)] * len(batch)
            out.prompt_index += [pi] * len(batch)
        return out


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_only_complete_new_clean_requests_are_written(chat_verifier, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_verifier))
    eos = [tok.eos_token_id]
    samples = [
        _ids(tok, "w1 w2 w3 w4") + eos,            # kept
        _ids(tok, "w1 w2 w3 w4 w5 w6"),            # no end of turn: dropped
        _ids(tok, "w1 w2") + eos,                  # too short
        _ids(tok, "w1 w2 w3 w4") + eos,            # a repeat
        _ids(tok, "w9 w8 w7 w6 w5") + eos,         # kept
        _ids(tok, "w3 w3 w3 w3") + eos + [7, 8],   # kept, cut at the end of its turn
    ]
    backend = ScriptedBackend(samples)
    out = tmp_path / "self.jsonl"
    cfg = SelfPromptsConfig(verifier=str(chat_verifier), output=str(out), num_prompts=3,
                            samples_per_round=4, benchmark_prompts=[], seed=2, styles="open",
                            near_duplicate=1.0)
    result = run_self_prompts(cfg, backend=backend)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["messages"][0]["content"] for r in records] == \
        ["w1 w2 w3 w4", "w9 w8 w7 w6 w5", "w3 w3 w3 w3"]
    assert all(r["source"] == "self" and r["messages"][0]["role"] == "user" for r in records)
    assert result["dropped"]["unfinished"] == 1 and result["dropped"]["short"] == 1
    assert result["dropped"]["repeat"] == 1
    # each round is one seeded request, seeds far enough apart for its samples' seed + i
    assert [s for _, s in backend.calls] == [2000 * 4, 2001 * 4]


def test_the_cli_samples_with_the_verifier_and_stops_after_its_rounds(chat_verifier, tmp_path):
    out = tmp_path / "self.jsonl"
    code = main(["self-prompts", "--verifier", str(chat_verifier), "--output", str(out),
                 "--num-prompts", "16", "--samples-per-round", "8", "--max-rounds", "1",
                 "--max-request-tokens", "12", "--min-words", "1", "--backend", "transformers",
                 "--styles", "open", "--answer-tokens", "8",
                 "--benchmark-prompts", ""])
    assert code == 0
    lines = out.read_text().splitlines()
    assert len(lines) <= 16  # two rounds of eight samples, no more
    for line in lines:
        text = json.loads(line)["messages"][0]["content"]
        assert text and all(w.startswith("w") for w in text.split())


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="--num-prompts"):
        SelfPromptsConfig(verifier="v", output="o", num_prompts=0).validate()
    with pytest.raises(ValueError, match="rounds"):  # seeds would run into the next --seed's
        SelfPromptsConfig(verifier="v", output="o", num_prompts=10_000,
                          samples_per_round=8).validate()
    SelfPromptsConfig(verifier="v", output="o", num_prompts=10_000,
                      samples_per_round=256).validate()


def test_near_repeats_are_dropped_and_exact_only_keeps_them():
    first = "Write a short poem about the sea at night for my sister"
    near = "Write a short poem about the sea at night for my brother"
    for threshold, expected in ((0.6, "near_repeat"), (1.0, None)):
        keep = RequestFilter(min_words=4, grams=set(), near_duplicate=threshold)
        assert keep.keep(first, True)
        assert keep.reason(near, True) == expected
    keep = RequestFilter(min_words=4, grams=set(), near_duplicate=0.6)
    keep.keep(first, True)
    assert keep.reason("Explain how a bicycle gear works to a child", True) is None
    # a follow-up is new when its first turn is, even if its words are common
    assert keep.keep("Can you give me more examples?", True, context="about volcanoes")
    assert keep.keep("Can you give me more examples?", True, context="about saving money")
    assert not keep.keep("Can you give me more examples?", True, context="about volcanoes")


def test_diversity_is_the_share_of_distinct_trigrams():
    assert distinct_trigram_share(["a b c d", "e f g h"]) == 1.0
    assert distinct_trigram_share(["a b c d", "a b c d"]) == 0.5


def test_styles_are_parsed_and_bad_ones_named():
    assert parse_styles("open, category:3,persona:0.5") == \
        {"open": 1.0, "category": 3.0, "persona": 0.5}
    for bad, message in (("chitchat:1", "unknown style 'chitchat'"), ("open:x", "not a number"),
                         ("open:-1", ">= 0"), ("open:0", "no style a positive weight")):
        with pytest.raises(ValueError, match=message):
            parse_styles(bad)
    with pytest.raises(ValueError, match="--near-duplicate"):
        SelfPromptsConfig(verifier="v", output="o", near_duplicate=0).validate()


class WordBackend(ScriptedBackend):
    """Every sample a new run of words, ended; records what each prompt showed the verifier."""

    def __init__(self, tok) -> None:
        super().__init__([])
        self.tok, self.count, self.seen_prompts = tok, 0, []

    def generate(self, prompt_ids, seed):
        self.seen_prompts += [self.tok.decode(p) for p in prompt_ids]
        need = len(prompt_ids) * self.cfg.num_samples
        for _ in range(need):
            self.count += 1
            digits = [self.count // 97 ** k % 97 for k in range(3)]  # new in every sample
            words = " ".join(f"w{d}" for d in digits + [d * 5 % 97 for d in digits])
            self.samples.append(_ids(self.tok, words) + [self.tok.eos_token_id])
        return super().generate(prompt_ids, seed)


def test_every_style_writes_requests_of_its_shape(chat_verifier, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_verifier))
    backend = WordBackend(tok)
    out = tmp_path / "self.jsonl"
    cfg = SelfPromptsConfig(verifier=str(chat_verifier), output=str(out), num_prompts=120,
                            samples_per_round=40, samples_per_prefix=4, benchmark_prompts=[],
                            styles="open:1,category:2,persona:1,followup:1,rewrite:1",
                            min_words=2)
    result = run_self_prompts(cfg, backend=backend)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 120 and result["prompts"] == 120
    by_style = {s: [r for r in records if r["style"] == s] for s in result["styles"]}
    assert set(by_style) == {"open", "category", "persona", "followup", "rewrite"}
    assert sum(result["styles"].values()) == 120
    for r in by_style["persona"]:  # the persona stays as the served system prompt
        assert [m["role"] for m in r["messages"]] == ["system", "user"]
        assert r["messages"][0]["content"] in PERSONAS
    for r in by_style["followup"]:  # a first turn, the verifier's answer, a second turn
        roles = [m["role"] for m in r["messages"] if m["role"] != "system"]
        assert roles == ["user", "assistant", "user"]
    for r in by_style["category"]:  # the steering system prompt is not served
        assert [m["role"] for m in r["messages"]] == ["user"]
        assert r["category"] in CATEGORY_NAMES
    # what the verifier saw while writing: system prompts, and kept requests to rewrite
    # (the tiny vocabulary reads the system role as <unk>; a plain prefix starts with the user's)
    steered = [p for p in backend.seen_prompts
               if p.split()[0] != "<|user|>" and "<|assistant|>" not in p]
    assert len(steered) >= 2
    asked = {tok.decode(render_chat(tok, [{"role": "user", "content": REWRITE_INSTRUCTION
                                           + r["messages"][-1]["content"]}]))
             for r in records if r["style"] in ("open", "category", "persona")}
    assert asked & set(backend.seen_prompts)
    assert set(result["categories"]) >= {"open", "persona"}
    assert 0 < result["distinct_trigram_share"] <= 1


class SeededBackend(ScriptedBackend):
    """Samples that depend only on (prompt, seed, sample index), as vLLM's seeded samples do;
    raises once `stop_after` calls were made (a run stopped half-way)."""

    def __init__(self, tok, stop_after: int | None = None) -> None:
        super().__init__([])
        self.tok, self.stop_after = tok, stop_after

    def generate(self, prompt_ids, seed):
        if self.stop_after is not None and len(self.calls) >= self.stop_after:
            raise KeyboardInterrupt("stopped")
        for prefix in prompt_ids:
            for i in range(self.cfg.num_samples):
                rng = random.Random(hash((tuple(prefix), seed, i)))
                words = " ".join(f"w{rng.randrange(97)}" for _ in range(6))
                self.samples.append(_ids(self.tok, words) + [self.tok.eos_token_id])
        return super().generate(prompt_ids, seed)


def test_a_stopped_run_goes_on_to_write_what_one_run_writes(chat_verifier, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_verifier))
    settings = dict(verifier=str(chat_verifier), num_prompts=60, samples_per_round=20,
                    samples_per_prefix=4, benchmark_prompts=[], min_words=2,
                    styles="open:1,category:2,followup:1,rewrite:1")
    whole = tmp_path / "whole.jsonl"
    run_self_prompts(SelfPromptsConfig(output=str(whole), **settings),
                     backend=SeededBackend(tok))
    parts = tmp_path / "new" / "parts.jsonl"  # a folder that does not exist yet
    cfg = SelfPromptsConfig(output=str(parts), **settings)
    with pytest.raises(KeyboardInterrupt):
        run_self_prompts(cfg, backend=SeededBackend(tok, stop_after=5))
    state = json.loads((tmp_path / "new" / "parts.jsonl.state.json").read_text())
    assert state["next_round"] >= 1 and not parts.exists()
    with pytest.raises(ValueError, match="min_words"):  # other settings: refused by name
        run_self_prompts(SelfPromptsConfig(output=str(parts), **{**settings, "min_words": 3}),
                         backend=SeededBackend(tok))
    result = run_self_prompts(cfg, backend=SeededBackend(tok))
    assert parts.read_text() == whole.read_text() and result["prompts"] == 60
    assert not (tmp_path / "new" / "parts.jsonl.state.json").exists()


def test_requests_naming_a_web_host_are_dropped():
    keep = RequestFilter(min_words=2, grams=set())
    for text in ("Summarize the article at https://example/x for me",
                 "What does www.something say about tea?", "Is Laws.com a good source?"):
        assert keep.reason(text, True) == "web_host"
    assert keep.reason("Explain the .com bubble of the nineties to me", True) is None
