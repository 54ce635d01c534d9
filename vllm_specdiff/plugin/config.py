"""The drafter's own settings, read from vLLM's `additional_config["specdiff"]`.

vLLM rejects unknown keys inside `speculative_config`, so everything that is ours travels in
`--additional-config '{"specdiff": {...}}'`. Every option is checked here, at start-up, with an
error that names it: a typo must fail loudly instead of silently running with a default.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_specdiff.drafter.quantize import QUANTIZE_MODES
from vllm_specdiff.plugin.adaptive import DRAFT_MARGIN

SECTION = "specdiff"
CANDIDATE_SOURCES = ("argmax", "sample", "ngram")
SELECTIONS = ("tau", "tree")
DEFAULT_MAX_TREE_TOKENS = 17
CPU_TREE_WORKER = "vllm_specdiff.plugin.tree_runner.SpecDiffCPUWorker"
GPU_TREE_WORKER = "vllm_specdiff.plugin.tree_runner_gpu.SpecDiffGPUWorker"
# CUDA: the tree rows are recomputed around each attention call, so attention must stay out of
# CUDA graphs (piecewise graphs keep it between the pieces).
TREE_CUDA_COMPILATION_CONFIG = {"cudagraph_mode": "PIECEWISE"}


def tree_worker(platform: Any = None) -> str:  # noqa: ANN401
    """worker_cls for K > 1 on this vLLM platform (default: vLLM's current one): the one place
    that decides, for `specdiff_engine_args`, `vllm-specdiff serve/generate` and the errors."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    if platform.is_cpu():
        return CPU_TREE_WORKER
    if platform.is_cuda():
        return GPU_TREE_WORKER
    raise ValueError(f"{_opt('K')} > 1 (tree verification) supports vLLM's CPU and CUDA "
                     f"platforms, not {getattr(platform, 'device_name', platform)!r}; use K = 1")


def tree_engine_args(platform: Any = None) -> dict[str, Any]:  # noqa: ANN401
    """The engine arguments K > 1 needs on this platform: the tree-verifying worker, async
    scheduling off and, on CUDA, attention outside CUDA graphs."""
    worker = tree_worker(platform)
    args: dict[str, Any] = {"worker_cls": worker, "async_scheduling": False}
    if worker == GPU_TREE_WORKER:
        args["compilation_config"] = dict(TREE_CUDA_COMPILATION_CONFIG)
    return args


@dataclass(frozen=True)
class SpecDiffConfig:
    """Settings of the diffusion drafter inside vLLM (all optional).

    drafter: drafter directory; None uses the default drafter (`vllm-specdiff models`).
    lora: PEFT adapter directory merged into the drafter at load time.
    drafter_temperature: drafter sampling temperature T_d (0: argmax drafts), one name for the
      option, `specdiff_engine_args`' keyword, the CLI's --drafter-temperature and
      ReferenceDecoder's argument. With one draft per step (K = 1) sampling only lowers
      acceptance, so the default is argmax; T_d matters once self-selection over K > 1 drafts
      is used (the paper uses 1.5).
    top_k: keep only the top-k drafter logits per position before sampling (None: all).
    steps: denoising steps per draft (the paper uses 1).
    context_window: trailing context tokens the drafter sees (None: the whole context). The
      block-causal drafter moves the window's start in steps of half the window, so it sees
      the last W/2+1 .. W tokens and its cache keeps hitting between the steps.
    seed: seed of the drafter's sampling generator (drafts, hence runs, are reproducible).
    cache_size: per-sequence KV-cache entries the block-causal drafter keeps (None: twice
      `max_num_seqs`, at least 16). Bounded: least recently used entries are dropped.
    cache_bytes: byte budget of that KV cache (None: 1 GiB). It lives outside vLLM's memory
      budget (on the verifier's device), so it needs its own bound; entries no running request
      uses are dropped first.
    log_interval: seconds between the drafter's log lines (0 disables them).
    K: candidate drafts per request and step (self-selection). K > 1 verifies all of them in
      one tree-masked verifier forward and needs the worker `tree_worker()`.
    candidates: where the K candidates come from: candidate 0 is always the argmax draft
      ("argmax"); the others are sampled from the drafter's marginals at drafter_temperature
      ("sample"); with
      "ngram", a prompt-lookup match (vLLM's ngram matching) replaces candidate 1 when found.
      With K = 1, "ngram" makes a row whose context has a lookup match draft the lookup's
      continuation instead of the drafter's (no drafter call for it; adaptive drafting gives
      those drafts their own length). On by default: it was faster than the drafter alone in
      every batch-1 and batch-4 benchmark cell (README, "Measured figures").
    selection: how a trie is committed: "tau" (the candidate with the highest expected
      accepted length, then vLLM's own point-mass verification of that chain) or "tree" (the
      multi-candidate tree walk over all candidates, `core.verify_tree`; requests it cannot
      serve exactly, `tree_runner.tree_rule_eligible`, commit as with "tau").
    max_tree_tokens: verifier tokens per request and step for K > 1 (root included); trailing
      candidates are dropped until the merged trie fits.
    quantize: "auto" (int8 linears on CPU, none on GPUs), "int8" (CPU only) or "none". The
      drafter only proposes, so this changes speed and acceptance, never the output.
    adaptive: choose the draft length per step (0 .. num_speculative_tokens; K > 1: no draft
      or the full trie) from the verifier's and drafter's measured costs and the running
      acceptance (`plugin/adaptive.py`); False drafts num_speculative_tokens every step.
    draft_margin: with adaptive, at batch > 1 a step drafts only if it promises this fraction
      more committed tokens per second than a step without drafts (`adaptive.DRAFT_MARGIN`).
    refill_ratio: with adaptive, the share of requests that leave a batch early whose slot
      serves another request (`adaptive.Refills`): None measures it while serving; 1 values
      every committed token as a server with a queue does, 0 as a static batch does.
    datastore: a retrieval datastore file (`specdiff-distill datastore`): with K = 1 and
      "ngram", a row whose context has no prompt-lookup match drafts what followed the
      context's suffix in the verifier's own earlier continuations (`core.datastore`), as a
      lookup draft (no drafter call). None: off.
    """

    drafter: str | None = None
    lora: str | None = None
    drafter_temperature: float = 0.0
    top_k: int | None = None
    steps: int = 1
    context_window: int | None = None
    seed: int = 0
    cache_size: int | None = None
    cache_bytes: int | None = None
    log_interval: float = 10.0
    K: int = 1  # noqa: N815 - the paper's name
    candidates: tuple[str, ...] = ("argmax", "sample", "ngram")
    selection: str = "tau"
    max_tree_tokens: int = DEFAULT_MAX_TREE_TOKENS
    quantize: str = "auto"
    adaptive: bool = True
    draft_margin: float = DRAFT_MARGIN
    refill_ratio: float | None = None
    datastore: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


OPTIONS = tuple(SpecDiffConfig.__dataclass_fields__)


def _opt(name: str) -> str:
    return f"additional_config[{SECTION!r}][{name!r}]"


def _int(name: str, value: Any, minimum: int, allow_none: bool = False) -> int | None:  # noqa: ANN401
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{_opt(name)} must be an integer >= {minimum}"
                         f"{' or null' if allow_none else ''}, got {value!r}")
    return value


def _number(name: str, value: Any, minimum: float) -> float:  # noqa: ANN401
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value < minimum:
        raise ValueError(f"{_opt(name)} must be a finite number >= {minimum}, got {value!r}")
    return float(value)


def _ratio(name: str, value: Any) -> float | None:  # noqa: ANN401
    """None, or a number in [0, 1]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not 0.0 <= value <= 1.0:
        raise ValueError(f"{_opt(name)} must be null (measured) or a number in [0, 1], "
                         f"got {value!r}")
    return float(value)


def _bool(name: str, value: Any) -> bool:  # noqa: ANN401
    if not isinstance(value, bool):
        raise ValueError(f"{_opt(name)} must be true or false, got {value!r}")
    return value


def max_spec_len() -> int:
    """The most draft tokens per step vLLM's rejection sampler handles (read from vLLM: a
    larger num_speculative_tokens starts, then fails an assertion on the first request)."""
    from vllm.v1.sample.rejection_sampler import MAX_SPEC_LEN

    return int(MAX_SPEC_LEN)


def check_num_speculative_tokens(value: Any, name: str = "num_speculative_tokens") -> int:  # noqa: ANN401
    """The one check of gamma, for every way it arrives (engine args, serve, the proposer)."""
    limit = max_spec_len()
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ValueError(f"{name} must be an integer in [1, {limit}] (vLLM's rejection sampler "
                         f"verifies at most MAX_SPEC_LEN = {limit} draft tokens per step), "
                         f"got {value!r}")
    return value


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:  # noqa: ANN401
    if value not in choices:
        raise ValueError(f"{_opt(name)} must be one of {list(choices)}, got {value!r}")
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


def _path(name: str, value: Any) -> str | None:  # noqa: ANN401
    if value is None:
        return None
    if not isinstance(value, str | Path) or not str(value):
        raise ValueError(f"{_opt(name)} must be a directory path, got {value!r}")
    return str(Path(value).expanduser())


def _checked(name: str, check: Any, *args: Any) -> None:  # noqa: ANN401
    """Run one of the drafter's own file checks, its error prefixed with the option's name."""
    try:
        check(*args)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"{_opt(name)}: {e}") from None


def _datastore(value: Any, tree: dict[str, Any]) -> str | None:  # noqa: ANN401
    """The datastore file: it must exist, and it drafts only through prompt lookup's path
    (K = 1 with "ngram" in candidates)."""
    path = _path("datastore", value)
    if path is None:
        return None
    if not Path(path).is_file():
        raise FileNotFoundError(f"{_opt('datastore')}: no file {path} (build one with "
                                "`specdiff-distill datastore`)")
    if tree["K"] != 1 or "ngram" not in tree["candidates"]:
        raise ValueError(f"{_opt('datastore')} drafts where prompt lookup finds nothing: it "
                         f"needs K = 1 and 'ngram' in {_opt('candidates')}")
    return path


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


def _choices(name: str, value: Any, allowed: tuple[str, ...]) -> tuple[str, ...]:  # noqa: ANN401
    if isinstance(value, str) or not isinstance(value, list | tuple) or not value \
            or any(v not in allowed for v in value) or len(set(value)) != len(value):
        raise ValueError(f"{_opt(name)} must be a non-empty list of distinct values from "
                         f"{list(allowed)}, got {value!r}")
    return tuple(value)


def _tree_options(get: Any, defaults: SpecDiffConfig, gamma: int | None  # noqa: ANN401
                  ) -> dict[str, Any]:
    """K, candidates, selection and max_tree_tokens, checked together (they bound each other)."""
    k = _int("K", get("K", defaults.K), 1)
    assert k is not None
    candidates = _choices("candidates", get("candidates", list(defaults.candidates)),
                          CANDIDATE_SOURCES)
    if candidates[0] != "argmax":
        raise ValueError(f"{_opt('candidates')} must start with 'argmax' (candidate 0 is the "
                         f"argmax draft), got {list(candidates)!r}")
    if k > 1 and "sample" not in candidates:
        raise ValueError(f"{_opt('K')}={k} needs 'sample' in {_opt('candidates')}: "
                         "only one argmax draft exists")
    selection = _choice("selection", get("selection", defaults.selection), SELECTIONS)
    max_tree = _int("max_tree_tokens", get("max_tree_tokens", defaults.max_tree_tokens), 2)
    assert max_tree is not None
    if k > 1 and max_tree > max_spec_len() + 1:
        raise ValueError(f"{_opt('max_tree_tokens')}={max_tree} exceeds vLLM's limit of "
                         f"{max_spec_len()} draft tokens per step plus the root")
    if k > 1 and gamma is not None and max_tree < gamma + 1:
        raise ValueError(f"{_opt('max_tree_tokens')}={max_tree} cannot hold one draft of "
                         f"num_speculative_tokens={gamma} plus the root; use >= {gamma + 1}")
    return {"K": k, "candidates": candidates, "selection": selection,
            "max_tree_tokens": max_tree}


def parse_specdiff_config(additional_config: Any, gamma: int | None = None) -> SpecDiffConfig:  # noqa: ANN401
    """Validate `additional_config` (a dict, a JSON string or None) and return our settings.

    `gamma` (num_speculative_tokens), when given, bounds `steps`.
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
    unknown = sorted(set(section) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} in additional_config[{SECTION!r}]; "
                         f"valid options: {list(OPTIONS)}")
    defaults = SpecDiffConfig()
    get = section.get
    steps = _int("steps", get("steps", defaults.steps), 1)
    if gamma is not None and steps > gamma:
        raise ValueError(f"{_opt('steps')}={steps} exceeds num_speculative_tokens={gamma}")
    top_k = _int("top_k", get("top_k", defaults.top_k), 1, allow_none=True)
    drafter = _path("drafter", get("drafter", defaults.drafter))
    lora = _path("lora", get("lora", defaults.lora))
    check_paths(drafter, lora)
    tree = _tree_options(get, defaults, gamma)
    return SpecDiffConfig(
        drafter=drafter,
        lora=lora,
        drafter_temperature=_number("drafter_temperature",
                                    get("drafter_temperature", defaults.drafter_temperature),
                                    0.0),
        top_k=top_k,
        steps=steps,
        context_window=_int("context_window", get("context_window", defaults.context_window), 1,
                            allow_none=True),
        seed=_int("seed", get("seed", defaults.seed), 0),
        cache_size=_int("cache_size", get("cache_size", defaults.cache_size), 1,
                        allow_none=True),
        cache_bytes=_int("cache_bytes", get("cache_bytes", defaults.cache_bytes), 1,
                         allow_none=True),
        log_interval=_number("log_interval", get("log_interval", defaults.log_interval), 0.0),
        **tree,
        quantize=_choice("quantize", get("quantize", defaults.quantize), QUANTIZE_MODES),
        adaptive=_bool("adaptive", get("adaptive", defaults.adaptive)),
        draft_margin=_number("draft_margin", get("draft_margin", defaults.draft_margin), 0.0),
        refill_ratio=_ratio("refill_ratio", get("refill_ratio", defaults.refill_ratio)),
        datastore=_datastore(get("datastore", defaults.datastore), tree),
    )
