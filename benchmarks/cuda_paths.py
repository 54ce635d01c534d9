"""Run the device paths of the core and the block-causal drafter once and record what they did.

    python -m vllm_specdiff_benchmarks.cuda_paths [--device cuda] [--trials 2000] [--json OUT]

The unit tests run on CPU; this runs the same code with every tensor on `--device` (a GPU
where there is one: `benchmarks/gpu_check.sh`). Models are tiny and random, built in memory;
the drafter is written to a directory and loaded through `load_drafter`, as serving does.

Checks (the run exits 1 if any fails):
  greedy    the reference decoder (`vllm_specdiff.reference`) with that drafter is
            token-identical to plain greedy decoding, for K = 1, K = 4 (self-selection through
            the fused streak kernel, Triton on CUDA) and the multi-candidate tree rule;
  sampled   at temperature 1, a chi-square test of the first three tokens against the
            verifier's exact joint (p > 1e-3) for point-mass and tree verification; its negative
            control, sampling at temperature 0.5 against the same exact joint, must fail
            (p < 1e-6);
  scoring   `score_drafts` through the dispatch (Triton on CUDA) equals the torch path;
  drafter   the drafter's logits on the device equal those of its CPU copy.
Timing (a figure, not a check): a drafter of the default's shape (4 layers, 576 wide, 8k head,
random weights) in bfloat16 on the device: milliseconds per `draft_logits` call, gamma 8, at
batch 1 and 16, contexts growing by 4 tokens per call as in serving.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vllm_specdiff.core.scoring import score_drafts
from vllm_specdiff.drafter.base import Drafter
from vllm_specdiff.drafter.block_causal import BlockCausalDrafter
from vllm_specdiff.drafter.loading import load_drafter
from vllm_specdiff.provenance import provenance
from vllm_specdiff.reference import (
    DrafterFn,
    ReferenceDecoder,
    chi_square_pvalue,
    exact_first_three,
    first_three_counts,
    plain_generate,
)
from vllm_specdiff_benchmarks import emit_report, invocation
from vllm_specdiff_benchmarks.kernels import kernel_backend, random_tree

MODULE = "vllm_specdiff_benchmarks.cuda_paths"
V = 8  # tiny vocabulary: the exact joint of three tokens has V**3 cells
PROMPT = [1, 5, 2]
SAMPLED_P_MIN = 1e-3
CONTROL_P_MAX = 1e-6
# The default drafter's shape (vllm_specdiff/assets/default_drafter/config.json).
DEFAULT_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=4, num_attention_heads=9, num_key_value_heads=3,
                     max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True)
DEFAULT_HEAD_ROWS = 8192


def tiny_verifier(device: torch.device, seed: int = 2) -> LlamaForCausalLM:
    """Two layers over V tokens with a scaled LM head, so that next-token distributions are
    peaked and depend on the context (near-uniform ones would make the tests weak)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model.to(device)


def save_block_causal(verifier: torch.nn.Module, directory: Path, num_layers: int,
                      head_rows: torch.Tensor | None = None) -> Path:
    """A block-causal drafter directory built from the verifier's first layers."""
    verifier.save_pretrained(directory / "verifier")
    drafter = BlockCausalDrafter.from_causal_lm(directory / "verifier", num_layers,
                                                draft_to_verifier=head_rows)
    drafter.save_pretrained(directory / "drafter")
    return directory / "drafter"


def drafter_fn(drafter: Drafter) -> DrafterFn:
    """The reference decoder's drafter: one context, logits [gamma, V]."""
    return lambda context, gamma: drafter.draft_logits([context], gamma)[0]


def check(name: str, passed: bool, **figures: Any) -> dict[str, Any]:
    """One check's row of the report."""
    return {"check": name, "passed": bool(passed), **figures}


def greedy_checks(verifier: torch.nn.Module, drafter: Drafter) -> list[dict[str, Any]]:
    expected = plain_generate(verifier, PROMPT, 40)
    rows = []
    for num_drafts, rule in ((1, "point-mass"), (4, "point-mass"), (4, "tree")):
        decoder = ReferenceDecoder(verifier, drafter_fn(drafter), gamma=4, num_drafts=num_drafts,
                                   rule=rule, drafter_temperature=1.0)
        gen = torch.Generator(device=next(verifier.parameters()).device).manual_seed(0)
        result = decoder.generate(PROMPT, 40, generator=gen)
        rows.append(check(f"greedy K={num_drafts} {rule}", result.tokens == expected,
                          steps=result.stats.steps, accepted=result.stats.accepted_tokens))
    return rows


def sample_counts(verifier: torch.nn.Module, drafter: Drafter, rule: str,
                  temperature: float, trials: int) -> tuple[torch.Tensor, int]:
    """First three tokens of `trials` speculative generations (K = 3, gamma 2)."""
    decoder = ReferenceDecoder(verifier, drafter_fn(drafter), gamma=2, num_drafts=3, rule=rule,
                               temperature=temperature, drafter_temperature=1.0)
    gen = torch.Generator(device=next(verifier.parameters()).device).manual_seed(11)
    return first_three_counts(decoder, PROMPT, trials, gen)


def sampled_checks(verifier: torch.nn.Module, drafter: Drafter, trials: int
                   ) -> list[dict[str, Any]]:
    exact = exact_first_three(verifier, PROMPT)
    rows = []
    for rule in ("point-mass", "tree"):
        counts, accepted = sample_counts(verifier, drafter, rule, 1.0, trials)
        p = chi_square_pvalue(counts, exact)
        rows.append(check(f"sampled T=1 K=3 {rule}", p > SAMPLED_P_MIN and accepted > 0,
                          p_value=p, trials=trials, accepted_per_trial=accepted / trials))
    counts, _ = sample_counts(verifier, drafter, "point-mass", 0.5, trials)
    p = chi_square_pvalue(counts, exact)
    rows.append(check("negative control: sampled at T=0.5, tested against T=1",
                      p < CONTROL_P_MAX, p_value=p, trials=trials))
    return rows


def scoring_check(device: torch.device) -> dict[str, Any]:
    """Greedy and sampled rows of one batch scored through the dispatch and through torch."""
    tree = random_tree(4, 4, 8, 1000, device, seed=3)
    gen = torch.Generator(device=device).manual_seed(3)
    logits = torch.randn(tree.num_nodes, 1000, generator=gen, device=device) * 3
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3], device=device)
    got = score_drafts(logits, tree, temperature)
    with kernel_backend("torch"):
        want = score_drafts(logits, tree, temperature)
    finite = torch.isfinite(want.log_a)
    same_inf = torch.equal(finite, torch.isfinite(got.log_a))
    diff = (got.log_a[finite] - want.log_a[finite]).abs().max().item()
    return check("scoring: dispatch vs torch", same_inf and diff < 1e-4
                 and torch.equal(got.selected, want.selected), max_abs_diff=diff)


def drafter_check(drafter: Drafter, cpu_drafter: Drafter,
                  device: torch.device) -> dict[str, Any]:
    """Two contexts of different lengths (a ragged batch) drafted on the device and on CPU."""
    contexts = [torch.tensor(PROMPT + [3, 4, 0, 7]), torch.tensor([6, 2])]
    got = drafter.draft_logits([c.to(device) for c in contexts], 5).cpu()
    want = cpu_drafter.draft_logits(contexts, 5)
    finite = torch.isfinite(want)
    diff = (got[finite] - want[finite]).abs().max().item()
    return check("drafter logits: device vs CPU",
                 torch.equal(finite, torch.isfinite(got)) and diff < 1e-3, max_abs_diff=diff)


def default_shape_timing(device: torch.device, directory: Path, calls: int
                         ) -> list[dict[str, Any]]:
    """Milliseconds per draft_logits call of a default-shaped drafter (random weights)."""
    torch.manual_seed(0)
    config = LlamaConfig(**DEFAULT_SHAPE)
    head_rows = torch.randperm(config.vocab_size)[:DEFAULT_HEAD_ROWS].sort().values
    path = save_block_causal(LlamaForCausalLM(config), directory, config.num_hidden_layers,
                             head_rows)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    drafter = load_drafter(path, device=device, dtype=dtype,
                           verifier_vocab_size=config.vocab_size)
    rows = []
    for batch in (1, 16):
        gen = torch.Generator().manual_seed(batch)
        contexts = [torch.randint(0, config.vocab_size, (200,), generator=gen)
                    for _ in range(batch)]
        samples = []
        for call in range(calls + 5):
            contexts = [torch.cat([c, torch.randint(0, config.vocab_size, (4,), generator=gen)])
                        for c in contexts]
            on_device = [c.to(device) for c in contexts]
            _synchronize(device)
            start = time.perf_counter()
            drafter.draft_logits(on_device, 8)
            _synchronize(device)
            if call >= 5:  # warm-up: first shapes, allocator, kernel selection
                samples.append(time.perf_counter() - start)
        rows.append({"what": "default-shaped drafter, draft_logits, gamma 8",
                     "batch": batch, "dtype": str(dtype).removeprefix("torch."),
                     "median_ms": 1e3 * statistics.median(samples), "calls": calls})
    return rows


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where every tensor lives (default: cuda when available; cpu "
                             "checks the harness)")
    parser.add_argument("--trials", type=int, default=2000,
                        help="speculative samples per chi-square test")
    parser.add_argument("--timing-calls", type=int, default=30,
                        help="timed draft_logits calls per batch size (0: no timing)")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    if args.trials < 1 or args.timing_calls < 0:
        raise ValueError("--trials must be >= 1 and --timing-calls >= 0")
    verifier = tiny_verifier(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_block_causal(verifier, Path(tmp), num_layers=1)
        drafter = load_drafter(path, device=device, verifier_vocab_size=V)
        cpu_drafter = load_drafter(path, verifier_vocab_size=V)
        checks = [*greedy_checks(verifier, drafter), *sampled_checks(verifier, drafter,
                                                                     args.trials),
                  scoring_check(device), drafter_check(drafter, cpu_drafter, device)]
        timing = default_shape_timing(device, Path(tmp) / "default_shape",
                                      args.timing_calls) if args.timing_calls else []
    report = {"provenance": provenance(invocation(MODULE, argv)),
              "device": str(device), "checks": checks, "timing": timing,
              "passed": all(c["passed"] for c in checks)}
    emit_report(report, args.json)
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
