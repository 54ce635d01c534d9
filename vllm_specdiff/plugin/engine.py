"""Python-API helpers: the engine arguments that turn SpecDiff on, and its statistics.

    from vllm import LLM
    from vllm_specdiff.plugin.engine import specdiff_engine_args, specdiff_stats
    llm = LLM(model=..., **specdiff_engine_args(num_speculative_tokens=8))
    ...
    print(specdiff_stats(llm))

`specdiff_stats` combines vLLM's own spec-decode counters (the same ones `/metrics` exports)
with the proposer's drafter timing, fetched from the worker by `collective_rpc`.
"""

from __future__ import annotations

from typing import Any

from vllm_specdiff.core import DEFAULT_GAMMA
from vllm_specdiff.plugin.config import (
    SECTION,
    canonical_section,
    check_num_speculative_tokens,
    parse_specdiff_config,
)
from vllm_specdiff.plugin.workers import worker_engine_args

__all__ = ["DEFAULT_GAMMA", "PROPOSER_PATH", "specdiff_engine_args", "specdiff_stats"]

PROPOSER_PATH = "vllm_specdiff.SpecDiffProposer"


def specdiff_engine_args(num_speculative_tokens: int = DEFAULT_GAMMA,
                         **options: Any) -> dict[str, Any]:
    """`speculative_config` and `additional_config` for `LLM(...)` / `EngineArgs`.

    options are the drafter settings of `SpecDiffConfig` (the names in `config.OPTIONS`,
    docs/options.md; the old keyword `K` is a deprecated alias of `num_drafts`); they are
    validated here, so a bad option fails before the engine starts, and the section returned
    names each by its current name. A drafter that reads the verifier's hidden states selects
    the worker that captures them; num_drafts > 1 selects the tree-verifying worker of this
    platform, turns async scheduling off and, on CUDA, keeps attention out of CUDA graphs
    (`compilation_config`): `config.worker_engine_args`.
    """
    check_num_speculative_tokens(num_speculative_tokens)
    section = canonical_section({k: v for k, v in options.items() if v is not None})[0]
    config = parse_specdiff_config({SECTION: section}, gamma=num_speculative_tokens)
    args: dict[str, Any] = {
        "speculative_config": {"model": PROPOSER_PATH,
                               "num_speculative_tokens": num_speculative_tokens},
        "additional_config": {SECTION: section},
    }
    # a conditioned drafter needs the worker that captures the verifier's states; K candidates
    # are verified as a trie by our worker; otherwise vLLM's own worker serves
    args.update(worker_engine_args(config))
    return args


def _proposer_stats(worker: Any) -> dict[str, Any] | None:
    """Runs inside each vLLM worker (collective_rpc): the proposer's own statistics."""
    worker = getattr(worker, "worker", worker)
    runner = getattr(worker, "model_runner", None)
    drafter = getattr(runner, "drafter", None)
    get = getattr(drafter, "get_stats", None)
    return get() if callable(get) else None


def _reset_proposer_stats(worker: Any) -> bool:
    worker = getattr(worker, "worker", worker)
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    reset = getattr(drafter, "reset_stats", None)
    if callable(reset):
        reset()
        return True
    return False


def vllm_spec_decode_counters(llm: Any) -> dict[str, Any]:
    """vLLM's spec-decode counters; empty for an engine built with `disable_log_stats=True`
    (the `LLM` default), whose `get_metrics` refuses to run."""
    from vllm.v1.metrics.reader import Counter, Vector

    counters: dict[str, Any] = {}
    if not getattr(llm.llm_engine, "log_stats", True):
        return counters
    for metric in llm.get_metrics():
        if not metric.name.startswith("vllm:spec_decode"):
            continue
        key = metric.name.removeprefix("vllm:spec_decode_")
        if isinstance(metric, Counter):
            counters[key] = counters.get(key, 0) + metric.value
        elif isinstance(metric, Vector):
            prev = counters.get(key, [0] * len(metric.values))
            counters[key] = [a + b for a, b in zip(prev, metric.values, strict=True)]
    drafts = counters.get("num_drafts", 0)
    if drafts:
        counters["mean_accepted_length"] = counters.get("num_accepted_tokens", 0) / drafts
    return counters


def specdiff_stats(llm: Any) -> dict[str, Any]:
    """Drafter time per step, accepted length (ours and vLLM's counters) of an `LLM`.

    Proposer statistics need the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) or
    VLLM_ALLOW_INSECURE_SERIALIZATION=1; otherwise only vLLM's counters are returned.
    """
    out: dict[str, Any] = {"vllm": vllm_spec_decode_counters(llm)}
    try:
        results = [r for r in llm.collective_rpc(_proposer_stats) if r is not None]
    except Exception as e:  # noqa: BLE001 - stats are best effort, the counters above are not
        out["proposer_error"] = f"{type(e).__name__}: {e}"
        results = []
    if results:
        out["proposer"] = results[0]
        out["drafter_ms_per_step"] = results[0]["drafter_ms_per_step"]
    if "mean_accepted_length" in out["vllm"]:
        out["mean_accepted_length"] = out["vllm"]["mean_accepted_length"]
    elif results:
        out["mean_accepted_length"] = results[0]["mean_accepted_length"]
    return out


def reset_specdiff_stats(llm: Any) -> None:
    """Zero the proposer's counters (vLLM's Prometheus counters only ever grow)."""
    llm.collective_rpc(_reset_proposer_stats)
