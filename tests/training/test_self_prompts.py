"""`self-prompts`: the verifier's own requests, sampled from its chat template with the user turn
opened, kept only when complete, new and not benchmark material."""

import json

import pytest

from tests.tiny_models import write_tiny_verifier
from vllm_specdiff_training.cli import main
from vllm_specdiff_training.data import SequenceChunk
from vllm_specdiff_training.self_prompts import (
    RequestFilter,
    SelfPromptsConfig,
    benchmark_ngrams,
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
    """Returns the scripted samples in order, as a `generate` backend would."""

    def __init__(self, samples: list[list[int]]) -> None:
        self.samples = samples
        self.calls: list[tuple[int, int]] = []

    def generate(self, prompt_ids, seed):
        (prefix,) = prompt_ids
        self.calls.append((len(prompt_ids), seed))
        batch, self.samples = self.samples[:4], self.samples[4:]
        return SequenceChunk([prefix + s for s in batch], [len(prefix)] * len(batch),
                             [0] * len(batch))


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
                            samples_per_round=4, benchmark_prompts=[], seed=2)
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
