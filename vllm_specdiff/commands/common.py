"""Engine options shared by the offline subcommands (generate, demo, bench).

Defaults suit this project's CPU machines: float32 (greedy outputs then match plain decoding
token for token), eager mode (torch.compile costs minutes of start-up on two cores), an explicit
KV-cache size (vLLM's default reserves 92% of the memory node and fails on a shared machine) and
the engine in this process (start-up in seconds instead of tens of seconds).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

DEFAULT_KV_CACHE_GIB = 0.5


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
    g.add_argument("--num-speculative-tokens", "--gamma", type=int, default=8, dest="gamma",
                   help="draft tokens per step (gamma)")
    g.add_argument("--drafter", default=None,
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


def spec_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"drafter": args.drafter, "lora": args.lora, "temperature": args.drafter_temperature,
            "steps": args.steps, "context_window": args.context_window,
            "seed": args.drafter_seed, "K": args.num_candidates,
            "max_tree_tokens": args.max_tree_tokens}


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
