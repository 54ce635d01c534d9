"""Engine options shared by the offline subcommands (generate, demo, bench).

Defaults suit this project's CPU machines: float32 (greedy outputs then match plain decoding
token for token), eager mode (torch.compile costs minutes of start-up on two cores), an explicit
KV-cache size (vLLM's default reserves 92% of the memory node and fails on a shared machine) and
the engine in this process (start-up in seconds instead of tens of seconds).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

DEFAULT_KV_CACHE_GIB = 0.5
# The shorthand of every command for "the SpecDiff proposer with this drafter" (vLLM 0.32 itself
# spells it --speculative-config plus --additional-config; `serve` writes that out).
SPECULATIVE_MODEL = "--speculative-model"
NUM_SPECULATIVE_TOKENS = "--num-speculative-tokens"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="verifier directory (default: the default verifier, see `models`)")
    g.add_argument("--dtype", default="float32", help="vLLM dtype (default float32)")
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=8,
                   help="requests decoded together (vLLM's batch)")
    g.add_argument("--kv-cache-gib", type=float, default=DEFAULT_KV_CACHE_GIB,
                   help="verifier KV-cache memory in GiB")
    g.add_argument("--compile", action="store_true",
                   help="use torch.compile (slow start-up on small CPUs; default eager)")
    g.add_argument("--engine-seed", type=int, default=0, help="vLLM engine seed")


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("speculative decoding (SpecDiff drafter)")
    g.add_argument(NUM_SPECULATIVE_TOKENS, "--gamma", type=int, default=8, dest="gamma",
                   help="draft tokens per step (gamma)")
    g.add_argument("--drafter", SPECULATIVE_MODEL, default=None, dest="drafter",
                   help="drafter directory (default: the default drafter)")
    g.add_argument("--lora", default=None, help="LoRA adapter merged into the drafter")
    g.add_argument("--drafter-temperature", type=float, default=None,
                   help="drafter sampling temperature T_d (default 0: argmax drafts)")
    g.add_argument("--steps", type=int, default=None, help="denoising steps per draft")
    g.add_argument("--context-window", type=int, default=None,
                   help="trailing context tokens the drafter sees")
    g.add_argument("--drafter-seed", type=int, default=None, help="seed of the drafter's sampler")
    g.add_argument("--num-candidates", "-K", type=int, default=None, dest="num_candidates",
                   help="K candidate drafts per step, verified as one trie (default 1)")
    g.add_argument("--max-tree-tokens", type=int, default=None,
                   help="verifier tokens per request and step for K > 1 (root included)")
    g.add_argument("--candidates", type=lambda text: text.split(","), default=None,
                   help="comma list of candidate sources (default argmax,sample,ngram: with "
                        "K = 1, prompt lookup where the context repeats; argmax,sample: the "
                        "drafter alone)")


def split_option(argv: list[str], *names: str) -> tuple[list[str], list[str]]:
    """argv without `--name VALUE` / `--name=VALUE` (any of the spellings), and those values."""
    rest: list[str] = []
    values: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in names and i + 1 < len(argv):
            values.append(argv[i + 1])
            i += 2
            continue
        if any(arg.startswith(name + "=") for name in names):
            values.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return rest, values


def option_values(argv: list[str], *names: str) -> list[str]:
    """Values of `--name VALUE` / `--name=VALUE` in argv, for any of the option's spellings."""
    return split_option(argv, *names)[1]


def json_option(argv: list[str], *names: str) -> dict | None:
    """The last value of a JSON-object option (e.g. --additional-config), or None if absent."""
    values = option_values(argv, *names)
    if not values:
        return None
    try:
        value = json.loads(values[-1])
    except json.JSONDecodeError as e:
        raise ValueError(f"{names[0]} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{names[0]} must be a JSON object")
    return value


def expand_speculative_model(argv: list[str]) -> list[str]:
    """`vllm serve` arguments with `--speculative-model DRAFTER_DIR [--num-speculative-tokens
    N]` written out as vLLM 0.32 spells them: the proposer in --speculative-config, the drafter
    in --additional-config (merged with a specdiff section already there)."""
    from vllm_specdiff.plugin.config import SECTION
    from vllm_specdiff.plugin.engine import DEFAULT_GAMMA, specdiff_engine_args

    rest, drafters = split_option(argv, SPECULATIVE_MODEL)
    rest, counts = split_option(rest, NUM_SPECULATIVE_TOKENS)
    if not drafters:
        if counts:
            raise ValueError(f"{NUM_SPECULATIVE_TOKENS} goes with {SPECULATIVE_MODEL} "
                             "DRAFTER_DIR (or set num_speculative_tokens in --speculative-config)")
        return argv
    if option_values(rest, "--speculative-config", "-sc", "--spec-model", "--spec-method",
                     "--spec-tokens") \
            or any(a.startswith(("--speculative-config.", "-sc.")) for a in rest):
        raise ValueError(f"{SPECULATIVE_MODEL} is the shorthand for --speculative-config; "
                         "give one of them")
    try:
        gamma = int(counts[-1]) if counts else DEFAULT_GAMMA
    except ValueError:
        raise ValueError(f"{NUM_SPECULATIVE_TOKENS} must be an integer, "
                         f"got {counts[-1]!r}") from None
    additional = json_option(rest, "--additional-config") or {}
    rest, _ = split_option(rest, "--additional-config")
    section = dict(additional.get(SECTION) or {})
    if "drafter" in section:
        raise ValueError(f"{SPECULATIVE_MODEL} and --additional-config's {SECTION!r} section "
                         "both name a drafter; give one")
    engine = specdiff_engine_args(gamma, **section, drafter=drafters[-1])
    additional[SECTION] = engine["additional_config"][SECTION]
    return [*rest, "--speculative-config", json.dumps(engine["speculative_config"]),
            "--additional-config", json.dumps(additional)]


def spec_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"drafter": args.drafter, "lora": args.lora,
            "drafter_temperature": args.drafter_temperature,
            "steps": args.steps, "context_window": args.context_window,
            "seed": args.drafter_seed, "K": args.num_candidates,
            "max_tree_tokens": args.max_tree_tokens, "candidates": args.candidates}


def resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from vllm_specdiff.models import prepare_verifier

    return str(prepare_verifier())


def engine_kwargs(args: argparse.Namespace, model: str) -> dict[str, Any]:
    return {
        "model": model,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30),
        "enforce_eager": not args.compile,
        "seed": args.engine_seed,
        "disable_log_stats": False,
    }


def build_llm(args: argparse.Namespace, model: str, speculative: bool) -> Any:  # noqa: ANN401
    """An in-process `vllm.LLM`, with the SpecDiff proposer when `speculative`."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    from vllm_specdiff.plugin.config import check_drafter_for
    from vllm_specdiff.plugin.engine import specdiff_engine_args

    kwargs = engine_kwargs(args, model)
    if speculative:
        check_drafter_for(args.model, args.drafter)  # before the engine starts
        kwargs.update(specdiff_engine_args(args.gamma, **spec_options(args)))
    return LLM(**kwargs)
