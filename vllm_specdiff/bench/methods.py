"""`--methods`: which decoding methods the suite compares, and their engine arguments.

One spec per method, comma-separated: `NAME[:KEY=VALUE[:KEY=VALUE...]]`, e.g.
`plain,ngram,specdiff2,specdiff2:adaptive=false:gamma=4,specdiff2-k4:drafter_temperature=1.5`.
VALUE is `true`/`false`, `null`, a number, `a+b+c` (a list) or text (`quantize=none` is the
text "none"). `gamma` sets the method's
draft tokens per step (default `--gamma`); `ngram` also takes vLLM's `prompt_lookup_min` /
`prompt_lookup_max`; the SpecDiff methods take every option of `additional_config["specdiff"]`
(docs/vllm.md), checked by the proposer's own validation before any engine starts. The spec as
written is the method's label in the JSON, table and plots.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

PLAIN = "plain"
NGRAM_DEFAULTS = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
# K > 1 presets: the ngram candidate replaces a sampled one when the context repeats; the
# sampled candidates need T_d > 0 to differ from the argmax draft.
TREE_PRESET = {"candidates": ["argmax", "sample", "ngram"], "drafter_temperature": 1.0}
# the drafter alone, without the default's prompt-lookup drafts (K = 1)
DRAFTER_ONLY = {"candidates": ["argmax", "sample"]}
# name -> (kind, preset options)
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    PLAIN: ("plain", {}),
    "ngram": ("ngram", NGRAM_DEFAULTS),
    "draft-model": ("draft_model", {}),
    # vLLM's own DFlash method serving the conditioned drafter's export
    # (`specdiff-distill export --format dflash`): the peer the plugin must beat
    "dflash": ("dflash", {}),
    "specdiff-base": ("specdiff_base", DRAFTER_ONLY),  # the paper's SpecDiff: no lookup
    # the defaults, K = 1: prompt lookup's continuation where the context repeats, the
    # drafter's draft elsewhere
    "specdiff2": ("specdiff", {}),
    "specdiff2-nolookup": ("specdiff", DRAFTER_ONLY),
    "specdiff2-k2": ("specdiff", {"num_drafts": 2, **TREE_PRESET}),
    "specdiff2-k4": ("specdiff", {"num_drafts": 4, **TREE_PRESET}),
}
SYNTAX = "NAME[:KEY=VALUE[:KEY=VALUE...]]"


@dataclass(frozen=True)
class Method:
    """One compared method: its label (the spec as written), kind, gamma and options."""

    label: str
    name: str
    kind: str
    gamma: int | None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def speculative(self) -> bool:
        return self.kind != "plain"

    def describe(self) -> dict[str, Any]:
        """What the JSON states about the method (its settings, not its paths' contents)."""
        return {"name": self.name, "kind": self.kind, "gamma": self.gamma,
                "options": dict(self.options)}


def parse_value(text: str) -> Any:
    """A spec value: bool, None (`null`), int, float, list (`a+b`) or the text itself."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "null":
        return None
    if "+" in text:
        return [parse_value(part) for part in text.split("+")]
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _split_option(item: str, spec: str) -> tuple[str, Any]:
    key, sep, value = item.partition("=")
    if not sep or not key or not value:
        raise ValueError(f"--methods: {item!r} in {spec!r} is not KEY=VALUE (syntax: {SYNTAX})")
    return key, parse_value(value)


def _check_keys(name: str, kind: str, options: dict[str, Any]) -> None:
    from vllm_specdiff.plugin.config import ALIASES, OPTIONS

    allowed = {"plain": set(), "ngram": {"gamma", *NGRAM_DEFAULTS}, "draft_model": {"gamma"},
               "dflash": {"gamma"},
               "specdiff_base": {"gamma", *OPTIONS, *ALIASES} - {"drafter"},
               "specdiff": {"gamma", *OPTIONS, *ALIASES}}[kind]
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"--methods: method {name!r} takes no option(s) {unknown}; "
                         f"valid: {sorted(allowed) or 'none'}")


def _check_values(method: Method) -> None:
    """The options' values, by the same checks the engine would run (before any engine)."""
    from vllm_specdiff.plugin.config import (
        SECTION,
        check_num_speculative_tokens,
        parse_specdiff_config,
    )

    where = f"--methods {method.label!r}"
    if method.gamma is not None:
        try:
            check_num_speculative_tokens(method.gamma, "gamma")
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if method.kind == "ngram":
        low, high = method.options["prompt_lookup_min"], method.options["prompt_lookup_max"]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                   for v in (low, high)) or low > high:
            raise ValueError(f"{where}: prompt_lookup_min/max must be integers with "
                             f"1 <= min <= max, got {low!r}, {high!r}")
    if method.kind in ("specdiff", "specdiff_base"):
        try:
            parse_specdiff_config({SECTION: method.options}, gamma=method.gamma)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"{where}: {e}") from None


def parse_method(spec: str, default_gamma: int) -> Method:
    """One `--methods` item; ValueError with the syntax on anything malformed."""
    name, *items = spec.strip().split(":")
    if name not in METHODS:
        raise ValueError(f"--methods: unknown method {name!r}; choose from {list(METHODS)} "
                         f"(syntax: {SYNTAX})")
    kind, preset = METHODS[name]
    given = dict(_split_option(item, spec) for item in items)
    _check_keys(name, kind, given)
    options = {**preset, **given}
    gamma = options.pop("gamma", default_gamma) if kind != "plain" else None
    method = Method(label=spec.strip(), name=name, kind=kind, gamma=gamma, options=options)
    _check_values(method)  # names (and warns about) an old option key as written
    from vllm_specdiff.plugin.config import ALIASES

    return replace(method, options={ALIASES.get(k, k): v for k, v in options.items()})


def parse_methods(text: str, default_gamma: int) -> list[Method]:
    """All of `--methods`, plain decoding first (the reference of speedup and identity)."""
    specs = [s.strip() for s in text.split(",")]
    if not all(specs):
        raise ValueError(f"--methods: empty method in {text!r} (a comma list of {SYNTAX})")
    methods = [parse_method(s, default_gamma) for s in specs]
    labels = [m.label for m in methods]
    duplicates = sorted({x for x in labels if labels.count(x) > 1})
    if duplicates:
        raise ValueError(f"--methods: {duplicates} given more than once")
    plain = [m for m in methods if m.kind == "plain"]
    if len(plain) > 1:
        raise ValueError("--methods: plain decoding takes no options; give it once")
    if sum(m.kind == "ngram" for m in methods) > 1:
        raise ValueError("--methods: one ngram method per run: vLLM's ngram proposer imports "
                         "numba, which breaks kernel registration for every engine built after "
                         "it in the same process; run each ngram setting in its own bench run")
    rest = [m for m in methods if m.kind != "plain"]
    return [plain[0] if plain else parse_method(PLAIN, default_gamma), *rest]


@dataclass(frozen=True)
class Drafters:
    """The drafter directories the methods need (None: not given)."""

    specdiff: str | None = None  # --drafter (None: the default drafter)
    base: str | None = None  # --base-drafter (None: the default verifier's untrained drafter)
    draft_model: str | None = None  # --draft-model (required by draft-model)
    dflash: str | None = None  # --dflash-model (required by dflash)


def engine_args(method: Method, drafters: Drafters) -> dict[str, Any]:
    """The `LLM(...)` keyword arguments that select the method (besides the shared ones)."""
    if method.kind == "plain":
        return {}
    if method.kind == "ngram":
        return {"speculative_config": {"method": "ngram",
                                       "num_speculative_tokens": method.gamma,
                                       **method.options}}
    if method.kind == "draft_model":
        if not drafters.draft_model:
            raise ValueError("method 'draft-model' needs --draft-model PATH (a Hugging Face "
                             "causal-LM directory with the verifier's tokenizer)")
        return {"speculative_config": {"method": "draft_model", "model": drafters.draft_model,
                                       "num_speculative_tokens": method.gamma}}
    if method.kind == "dflash":  # the runner checked that --dflash-model is given
        return {"speculative_config": {"method": "dflash", "model": drafters.dflash,
                                       "num_speculative_tokens": method.gamma}}
    from vllm_specdiff.plugin.engine import specdiff_engine_args

    drafter = drafters.base if method.kind == "specdiff_base" else drafters.specdiff
    options = {"log_interval": 0, **method.options}
    options.setdefault("drafter", drafter)
    return specdiff_engine_args(method.gamma, **options)
