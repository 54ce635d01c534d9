"""The drafter's own settings, read from vLLM's `additional_config["specdiff"]`, declared once.

vLLM rejects unknown keys inside `speculative_config`, so everything that is ours travels in
`--additional-config '{"specdiff": {...}}'`. Each option is one field of `SpecDiffConfig` whose
`option(...)` metadata holds its description, bounds or choices and CLI spelling. From that one
declaration come the start-up validation here (a typo or a bad value fails loudly with an error
that names the option, instead of silently running with a default), docs/options.md
(`config_docs`) and the flags of `vllm-specdiff generate/bench/serve` (`commands/flags.py`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_specdiff.adaptive import DRAFT_MARGIN
from vllm_specdiff.core import DEFAULT_GAMMA
from vllm_specdiff.drafter.quantize import QUANTIZE_MODES

__all__ = ["DEFAULT_GAMMA", "OPTIONS", "SECTION", "SpecDiffConfig", "parse_specdiff_config"]

SECTION = "specdiff"
CANDIDATE_SOURCES = ("argmax", "sample", "ngram")
SELECTIONS = ("tau", "tree")
DEFAULT_MAX_TREE_TOKENS = 17


@dataclass(frozen=True)
class Spec:
    """What the declaration says about one option beyond its type and default."""

    help: str  # one line: docs/options.md and the CLI's --help
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    path: str = ""  # "directory" or "file": the value is a path
    hub: bool = False  # a hub id (ORG/NAME) is fetched to a local snapshot (drafter/hub.py)
    null: str = ""  # what null (None) means, for options that may be null
    details: str = ""  # more for the docs table only
    flag: str = ""  # CLI flag where the name would clash with a request setting (--seed)
    aliases: tuple[str, ...] = ()  # further CLI spellings
    deprecated: tuple[str, ...] = ()  # old option keys and CLI flags, accepted with a warning


def option(default: Any, help: str, **spec: Any) -> Any:
    """A `SpecDiffConfig` field: its default and its `Spec`."""
    return field(default=default, metadata={"spec": Spec(help, **spec)})


@dataclass(frozen=True)
class SpecDiffConfig:
    """Settings of the diffusion drafter inside vLLM (all optional); each field's `option(...)`
    describes it, and docs/options.md is generated from them."""

    drafter: str | None = option(
        None, "drafter directory (any format `load_drafter` reads) or hub id", path="directory",
        hub=True, null="the default drafter (with the default verifier only)",
        details="Required for any other verifier, checked at start-up. A hub id (`ORG/NAME`, "
                "no such local path) is fetched as vLLM fetches models: from the local Hugging "
                "Face cache with `HF_HUB_OFFLINE=1`, else downloaded (configs, weights, the "
                "mask embedding, tokenizer files; never code)",
        aliases=("--speculative-model",))
    lora: str | None = option(
        None, "PEFT adapter directory merged into the drafter at load time", path="directory",
        null="none")
    drafter_temperature: float = option(
        0.0, "drafter sampling temperature T_d (0: argmax drafts)", minimum=0.0,
        details="With one draft per step sampling only lowers acceptance; T_d matters for "
                "self-selection over `num_drafts` > 1 (the paper uses 1.5). One name "
                "everywhere: this option, `specdiff_engine_args(drafter_temperature=)`, "
                "`--drafter-temperature` of the CLIs (training's too) and "
                "`ReferenceDecoder(drafter_temperature=)`; the request's own temperature is "
                "vLLM's `temperature`")
    top_k: int | None = option(
        None, "keep the top-k drafter logits per position before sampling", minimum=1,
        null="all", flag="--drafter-top-k")
    steps: int = option(1, "denoising steps per draft (<= num_speculative_tokens)", minimum=1)
    context_window: int | None = option(
        None, "trailing context tokens the drafter sees", minimum=1, null="the whole context",
        details="The block-causal drafter caches its context, so it rarely needs one. A drafter "
                "with fewer positions than `max_model_len` fails at start-up unless this is at "
                "most its positions minus `num_speculative_tokens`. Rows within "
                "`num_speculative_tokens` of the drafter's last position (or of "
                "`max_model_len`) get shorter drafts, the last one none. The block-causal "
                "drafter moves the window's start in steps of `context_window // 2` tokens, so "
                "it sees the last W/2+1 .. W tokens and re-encodes about W/2 tokens once every "
                "W/2 committed tokens; its cache keeps hitting in between")
    seed: int = option(0, "seed of the drafter's sampler (drafts, hence runs, are reproducible)",
                       minimum=0, flag="--drafter-seed")
    cache_size: int | None = option(
        None, "per-sequence KV-cache entries the block-causal drafter keeps (LRU, bounded)",
        minimum=1, null="max(16, 2 * max_num_seqs)")
    cache_bytes: int | None = option(
        None, "byte budget of that cache", minimum=1, null="1073741824 (1 GiB)",
        details="It is allocated on the verifier's device outside vLLM's memory budget "
                "(`gpu_memory_utilization` leaves the rest of the GPU for it). Entries no "
                "running request uses are dropped first; if the running requests alone need "
                "more, the newest of them are dropped and re-encoded next step (correct, only "
                "slower). `cache_stats()` in the proposer's stats reports `bytes` and "
                "`max_bytes`")
    log_interval: float = option(10.0, "seconds between the drafter's log lines (0: off)",
                                 minimum=0.0)
    num_drafts: int = option(
        1, "candidate drafts per request and step (K)", minimum=1,
        details="> 1: self-selection over a trie verified in one forward by the tree-verifying "
                "worker (docs/vllm.md, \"Self-selection\"). Formerly `K` (`-K`, "
                "`--num-candidates`), still accepted with a deprecation warning",
        deprecated=("K", "--num-candidates", "-K"))
    candidates: tuple[str, ...] = option(
        CANDIDATE_SOURCES, "where the drafts come from (a list; the CLI takes a comma list)",
        choices=CANDIDATE_SOURCES,
        details="Candidate 0 is the argmax draft (`\"argmax\"` comes first); the others are "
                "sampled from the marginals at `drafter_temperature` (`\"sample\"`); "
                "`\"ngram\"`: a prompt-lookup match (vLLM `ngram`'s matching, 2-5 tokens) "
                "replaces candidate 1; with `num_drafts` = 1, `\"ngram\"` drafts a row's lookup "
                "continuation whenever its context has a match (no drafter call for that row; "
                "adaptive drafting gives it its own length), and the drafter's draft otherwise "
                "(`specdiff_stats` counts `lookup_drafts`). On by default: it was faster than "
                "the drafter alone at batch 1 and 4 in every benchmark cell; "
                "`[\"argmax\", \"sample\"]` turns it off")
    selection: str = option(
        "tau", "how a trie is committed", choices=SELECTIONS,
        details="`\"tau\"`: the candidate with the highest tau (expected accepted length) "
                "through vLLM's rejection sampler; `\"tree\"`: the multi-candidate tree walk "
                "over the whole trie (ALGORITHM.md section 3); requests asking for sample "
                "logprobs (or `logprob_token_ids`), `min_p`, `logit_bias`, `allowed_token_ids`, "
                "`min_tokens` or a thinking budget, and every request of an engine with custom "
                "logits processors, commit as `\"tau\"` (docs/vllm.md, \"Self-selection\")")
    best_first: bool = option(
        False, "draft a best-first tree of up to num_speculative_tokens nodes from one drafter "
               "forward instead of a chain",
        details="DDTree's construction (`core/best_first.py`): the most probable prefixes "
                "under the product of the drafter's per-position marginals (temperature 1), "
                "as deep as the drafter's block. A confident drafter's tree is its argmax "
                "chain; an unsure one spends the verified tokens on the likeliest siblings. "
                "Needs the tree-verifying worker (added by `specdiff_engine_args` and the "
                "CLIs) and `num_drafts` = 1; the tree commits by the tree walk (lossless at any "
                "temperature), requests the walk cannot serve exactly by the best path's tau, "
                "and rows with a prompt-lookup match still draft their lookup chain. With "
                "`adaptive`, the node budget is chosen per step as a chain's length is "
                "(docs/vllm.md, \"Best-first trees\")")
    max_tree_tokens: int = option(
        DEFAULT_MAX_TREE_TOKENS,
        "verifier tokens per request and step for num_drafts > 1, root included", minimum=2,
        details=">= num_speculative_tokens + 1 and <= vLLM's MAX_SPEC_LEN + 1 (129); trailing "
                "candidates are dropped until the merged trie fits")
    quantize: str = option(
        "auto", "drafter weights: int8 on CPU and none on GPUs (auto), int8 or none",
        choices=QUANTIZE_MODES,
        details="`int8`: `torch.ao` dynamic int8 `nn.Linear`s (fbgemm/x86 kernels; embeddings "
                "and norms stay float32), refused on a GPU at start-up; GPUs run bf16. "
                "Verification decides what is committed, so greedy output is identical whatever "
                "the mode")
    adaptive: bool = option(
        True, "choose the draft length per step from the costs and acceptance measured while "
              "serving",
        details="0 (no draft, the drafter not called) up to `num_speculative_tokens`; with "
                "`num_drafts` > 1 no draft or the full trie (docs/vllm.md, \"Adaptive "
                "drafting\"); `false` drafts `num_speculative_tokens` every step")
    draft_margin: float = option(
        DRAFT_MARGIN, "with adaptive at batch > 1: the fraction by which a step with drafts must "
                      "beat one without in predicted committed tokens per second", minimum=0.0,
        details="`0` drafts on any predicted gain; ignored at batch 1 and with "
                "`adaptive: false`")
    refill_ratio: float | None = option(
        None, "with adaptive at batch > 1: the share of requests leaving a batch early whose "
              "slot serves another request", minimum=0.0, maximum=1.0, null="measured",
        details="It sets what a token beyond a row's first is worth (docs/vllm.md, \"Adaptive "
                "drafting\"). Unset, it is measured while serving; `1` prices every token as a "
                "server with a queue does, `0` as a static batch does")
    datastore: str | None = option(
        None, "a retrieval datastore file (`specdiff-distill datastore`)", path="file",
        null="off",
        details="With `num_drafts` = 1 and `\"ngram\"` in `candidates` (else refused at "
                "start-up), a row whose context has no prompt-lookup match drafts what followed "
                "the context's longest suffix (4, 3 or 2 tokens) in the verifier's own earlier "
                "continuations (`core/datastore.py`), merged token by token by majority, as a "
                "lookup draft (no drafter call); `specdiff_stats` counts `datastore_drafts`. A "
                "datastore holding ids outside the verifier's vocabulary fails at start-up")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def verifies_trees(self) -> bool:
        """Whether requests are verified as tries (the tree-verifying worker's job)."""
        return self.num_drafts > 1 or self.best_first

    @property
    def walks_trees(self) -> bool:
        """Whether a trie commits by the tree walk: with selection "tree", and always for a
        best-first tree (tau would commit one of its paths; the walk tries them all)."""
        return self.selection == "tree" or self.best_first


@dataclass(frozen=True)
class Option:
    """One declared option: name, Python type (without None), default and `Spec`."""

    name: str
    type: type
    nullable: bool
    default: Any
    spec: Spec


def _declared() -> dict[str, Option]:
    hints = typing.get_type_hints(SpecDiffConfig)
    out = {}
    for f in dataclasses.fields(SpecDiffConfig):
        hint = hints[f.name]
        union = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        base = next(a for a in union if a is not type(None))
        out[f.name] = Option(f.name, typing.get_origin(base) or base, type(None) in union,
                             f.default, f.metadata["spec"])
    return out


DECLARED: dict[str, Option] = _declared()
OPTIONS = tuple(DECLARED)
# old option keys -> their names now (accepted with a FutureWarning)
ALIASES = {old: o.name for o in DECLARED.values() for old in o.spec.deprecated
           if not old.startswith("-")}


def _opt(name: str) -> str:
    return f"additional_config[{SECTION!r}][{name!r}]"


def check_value(opt: Option, value: Any, key: str | None = None) -> Any:
    """One option's value checked against its declaration; `key` is the name it was given as
    (an old alias), so the error names what the user wrote."""
    where, spec = _opt(key or opt.name), opt.spec
    if value is None and opt.nullable:
        return None
    or_null = f"null ({spec.null}) or " if opt.nullable else ""
    if opt.type is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return value
    if opt.type is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < spec.minimum:
            raise ValueError(f"{where} must be an integer >= {spec.minimum}"
                             f"{' or null' if opt.nullable else ''}, got {value!r}")
        return value
    if opt.type is float:
        number = not isinstance(value, bool) and isinstance(value, int | float) \
            and math.isfinite(value)
        if spec.maximum is not None:
            if not number or not spec.minimum <= value <= spec.maximum:
                raise ValueError(f"{where} must be {or_null}a number in "
                                 f"[{spec.minimum:g}, {spec.maximum:g}], got {value!r}")
        elif not number or value < spec.minimum:
            raise ValueError(f"{where} must be a finite number >= {spec.minimum:g}, "
                             f"got {value!r}")
        return float(value)
    if opt.type is tuple:
        if isinstance(value, str) or not isinstance(value, list | tuple) or not value \
                or any(v not in spec.choices for v in value) or len(set(value)) != len(value):
            raise ValueError(f"{where} must be a non-empty list of distinct values from "
                             f"{list(spec.choices)}, got {value!r}")
        return tuple(value)
    if spec.choices:
        if value not in spec.choices:
            raise ValueError(f"{where} must be one of {list(spec.choices)}, got {value!r}")
        return value
    if not spec.path:
        if not isinstance(value, str):
            raise ValueError(f"{where} must be a string, got {value!r}")
        return value
    if not isinstance(value, str | Path) or not str(value):
        raise ValueError(f"{where} must be a {spec.path} path, got {value!r}")
    if spec.hub:
        from vllm_specdiff.drafter.hub import resolve_drafter

        try:
            value = resolve_drafter(str(value))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{where}: {e}") from None
    return str(Path(value).expanduser())


def canonical_section(section: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The section with old keys renamed (each warned about once), and name -> key as given."""
    unknown = sorted(set(section) - set(OPTIONS) - set(ALIASES))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} in additional_config[{SECTION!r}]; "
                         f"valid options: {list(OPTIONS)}")
    out, given = {}, {}
    for key, value in section.items():
        name = ALIASES.get(key, key)
        if name in out:
            raise ValueError(f"{_opt(key)} and {_opt(given[name])} name the same option; give "
                             f"{name!r} only")
        if key != name:
            warnings.warn(f"{_opt(key)} is deprecated; use {name!r}", FutureWarning,
                          stacklevel=3)
        out[name], given[name] = value, key
    return out, given


def max_spec_len() -> int:
    """The most draft tokens per step vLLM's rejection sampler handles (read from vLLM: a
    larger num_speculative_tokens starts, then fails an assertion on the first request)."""
    from vllm.v1.sample.rejection_sampler import MAX_SPEC_LEN

    return int(MAX_SPEC_LEN)


def check_num_speculative_tokens(value: Any, name: str = "num_speculative_tokens") -> int:
    """The one check of gamma, for every way it arrives (engine args, serve, the proposer)."""
    limit = max_spec_len()
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ValueError(f"{name} must be an integer in [1, {limit}] (vLLM's rejection sampler "
                         f"verifies at most MAX_SPEC_LEN = {limit} draft tokens per step), "
                         f"got {value!r}")
    return value


def is_default_verifier(model: str) -> bool:
    """True for the default verifier: its converted directory, or any copy or hub id of it
    (a path or id whose last component is its name)."""
    from vllm_specdiff import models

    path = Path(model).expanduser()
    if path.name == models.VERIFIER_NAME:
        return True
    return path.exists() and path.resolve() == models.default_verifier_dir().resolve()


def check_drafter_for(model: str | None, drafter: str | None) -> None:
    """Without a `drafter` option only the default verifier (model None) may be served: the
    default drafter is built from its layers and fits no other model's vocabulary. A drafter
    named by $SPECDIFF_DRAFTER is the user's explicit choice and is allowed for any model."""
    from vllm_specdiff import models

    if drafter is not None or model is None or os.environ.get(models.DRAFTER_ENV) \
            or is_default_verifier(model):
        return
    raise ValueError(
        f"{_opt('drafter')} is required when serving {model!r}: the default drafter is built "
        f"from the default verifier ({models.VERIFIER_NAME}) and fits no other model; pass a "
        "drafter directory made for this model's tokenizer (or $SPECDIFF_DRAFTER)")


def _checked(name: str, check: Any, *args: Any) -> None:
    """Run one of the drafter's own file checks, its error prefixed with the option's name."""
    try:
        check(*args)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"{_opt(name)}: {e}") from None


def check_paths(drafter: str | None, lora: str | None) -> None:
    """The drafter and adapter files, checked in seconds before the engine starts (the same
    checks `load_drafter` runs): a broken config.json, an unknown model_type, missing weights
    or an adapter that does not fit otherwise fail deep inside a worker's start-up."""
    from vllm_specdiff.drafter.loading import check_drafter_dir, check_lora_for
    from vllm_specdiff.drafter.lora import check_adapter_dir

    if drafter is not None:
        _checked("drafter", check_drafter_dir, drafter)
    if lora is not None and drafter is None:  # the default drafter may not be built yet
        _checked("lora", check_adapter_dir, lora)
    elif lora is not None:
        _checked("lora", check_lora_for, drafter, lora)


def _check_together(c: SpecDiffConfig, gamma: int | None, given: dict[str, str]) -> None:
    """The checks that relate options to each other (or to gamma and the files they name)."""
    k = _opt(given.get("num_drafts", "num_drafts"))
    if gamma is not None and c.steps > gamma:
        raise ValueError(f"{_opt('steps')}={c.steps} exceeds num_speculative_tokens={gamma}")
    check_paths(c.drafter, c.lora)
    if c.best_first and c.num_drafts > 1:
        raise ValueError(f"{_opt('best_first')} grows one tree from the drafter's marginals; it "
                         f"replaces {k}={c.num_drafts} sampled drafts: give one of them")
    if gamma is not None and c.drafter is not None and not c.best_first:
        # (a best-first tree's nodes are num_speculative_tokens; its depth stops at the block)
        from vllm_specdiff.drafter.loading import check_block_fits

        _checked("drafter", check_block_fits, c.drafter, gamma)
    if c.candidates[0] != "argmax":
        raise ValueError(f"{_opt('candidates')} must start with 'argmax' (candidate 0 is the "
                         f"argmax draft), got {list(c.candidates)!r}")
    if c.num_drafts > 1 and "sample" not in c.candidates:
        raise ValueError(f"{k}={c.num_drafts} needs 'sample' in {_opt('candidates')}: only one "
                         "argmax draft exists")
    if c.num_drafts > 1 and c.max_tree_tokens > max_spec_len() + 1:
        raise ValueError(f"{_opt('max_tree_tokens')}={c.max_tree_tokens} exceeds vLLM's limit "
                         f"of {max_spec_len()} draft tokens per step plus the root")
    if c.num_drafts > 1 and gamma is not None and c.max_tree_tokens < gamma + 1:
        raise ValueError(f"{_opt('max_tree_tokens')}={c.max_tree_tokens} cannot hold one draft "
                         f"of num_speculative_tokens={gamma} plus the root; use >= {gamma + 1}")
    if c.datastore is not None:
        if not Path(c.datastore).is_file():
            raise FileNotFoundError(f"{_opt('datastore')}: no file {c.datastore} (build one "
                                    "with `specdiff-distill datastore`)")
        if c.num_drafts != 1 or "ngram" not in c.candidates:
            raise ValueError(f"{_opt('datastore')} drafts where prompt lookup finds nothing: "
                             f"it needs {k} = 1 and 'ngram' in {_opt('candidates')}")


def parse_specdiff_config(additional_config: Any, gamma: int | None = None) -> SpecDiffConfig:
    """Validate `additional_config` (a dict, a JSON string or None) and return our settings.

    `gamma` (num_speculative_tokens), when given, bounds `steps` and `max_tree_tokens`.
    """
    if additional_config is None:
        additional_config = {}
    if isinstance(additional_config, str):
        try:
            additional_config = json.loads(additional_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--additional-config is not valid JSON: {e}") from e
    if not isinstance(additional_config, dict):
        raise ValueError(f"additional_config must be a JSON object, got {additional_config!r}")
    section = additional_config.get(SECTION, {})
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise ValueError(f"additional_config[{SECTION!r}] must be a JSON object, got {section!r}")
    section, given = canonical_section(section)
    values = {name: check_value(DECLARED[name], value, given[name])
              for name, value in section.items()}
    config = SpecDiffConfig(**values)
    _check_together(config, gamma, given)
    return config
