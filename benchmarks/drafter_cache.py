"""Cost of the block-causal drafter's context with a `context_window`, before and after the
window's start moved in strides (issue 11, defect 5).

    python -m vllm_specdiff_benchmarks.drafter_cache --out benchmarks/results/drafter_cache.json

A SmolLM2-135M-shaped drafter (4 layers, random weights, float32, one torch thread) drafts
gamma tokens for a batch of long contexts that grow by 1-3 accepted tokens per step. Settings:

  sliding     the window as it was: the last W tokens, re-encoded every step (its cache never
              matched, so this is the old per-step work without the pool's churn).
  strided     the window now: its start moves in steps of W // 2, the KV cache extends it.
  full        no window, KV cache over the whole context (for reference).

Reports context tokens encoded per step (deterministic) and milliseconds per step (wall and
process CPU time; medians, so load from other processes spreads less into them).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vllm_specdiff.provenance import provenance
from vllm_specdiff_benchmarks import emit_report, invocation

SETTINGS = ("sliding", "strided", "full")


def write_base(path: Path, max_positions: int) -> None:
    """A random Llama checkpoint with SmolLM2-135M's shapes (only 4 layers are used)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=4, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=max_positions, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)


def run(setting: str, base: Path, args: argparse.Namespace) -> dict[str, float]:
    from vllm_specdiff.drafter import BlockCausalDrafter

    window = args.window if setting == "strided" else None
    cache = 0 if setting == "sliding" else 16
    drafter = BlockCausalDrafter.from_causal_lm(base, num_layers=4, cache_size=cache,
                                                context_window=window)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 49152, (args.context,), generator=gen) for _ in range(args.batch)]
    wall, cpu, encoded = [], [], 0
    for _ in range(args.steps):
        batch = [s[-args.window:] for s in seqs] if setting == "sliding" else seqs
        t0, c0 = time.perf_counter(), time.process_time()
        drafter.draft_logits(batch, args.gamma)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if setting == "sliding":
            encoded += sum(b.numel() for b in batch)
        seqs = [torch.cat([s, torch.randint(0, 49152, (int(torch.randint(1, 4, (1,),
                                                                           generator=gen)),),
                                            generator=gen)]) for s in seqs]
    stats = drafter.cache_stats()
    if stats:
        encoded = stats["miss_tokens"]
    return {
        "encoded_tokens_per_step": encoded / args.steps,
        "wall_ms_per_step_median": 1000 * statistics.median(wall),
        "cpu_ms_per_step_median": 1000 * statistics.median(cpu),
        "cache_hit_fraction": (stats["hit_tokens"] / (stats["hit_tokens"] + stats["miss_tokens"])
                               if stats else 0.0),
        "cache_bytes": stats.get("bytes", 0),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--context", type=int, default=1500, help="initial context tokens")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--gamma", type=int, default=8)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        write_base(base, max_positions=args.context + 3 * args.steps + args.gamma + 64)
        results = {s: run(s, base, args) for s in SETTINGS}
    command = invocation("vllm_specdiff_benchmarks.drafter_cache", argv)
    report = {
        "provenance": provenance(command),
        "config": {**{k: v for k, v in vars(args).items() if k != "out"}, "torch_threads": 1},
        "results": results,
    }
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
