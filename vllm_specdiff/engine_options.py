"""The verifier engine's options, shared by the offline subcommands and the benchmark suite.

Defaults suit this project's CPU machines: float32 (greedy outputs then match plain decoding
token for token), eager mode (torch.compile costs minutes of start-up on two cores), an explicit
KV-cache size (vLLM's default reserves 92% of the memory node and fails on a shared machine) and
the engine in this process (start-up in seconds instead of tens of seconds).
"""

from __future__ import annotations

import argparse
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
