"""What speculation costs on the steps that draft nothing: the proposer's own time and vLLM's
sampling path, per engine step, at batch 16 (held-out chat, 16 requests in flight, T = 0).

    python -m vllm_specdiff_benchmarks.step_overhead --out DIR/step_overhead.json

Settings, one in-process engine each, in turn: `plain` (no speculation); `specdiff2` (the
default proposer: adaptive, prompt lookup); `specdiff2-vllm-sample`, the same with vLLM's own
`GPUModelRunner._sample` put back (`draftless_fix.restore_vllm_sample`), which sends every step
through the rejection sampler. Each decodes the prompts once to warm up, then once under
cProfile. Per setting: engine steps, decode tokens per second, and per step the cumulative
milliseconds of `SpecDiffProposer.propose`, `RejectionSampler.forward`, `Sampler.forward` (all
calls, the rejection sampler's bonus sampling included) and `GPUModelRunner.sample_tokens`
(sampling plus the proposer). cProfile slows Python code more than the model's kernels, so the
figures compare settings; they are not the overhead's share of an unprofiled step.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any

from vllm_specdiff.prompts import read_jsonl
from vllm_specdiff.provenance import provenance
from vllm_specdiff_benchmarks import chat_parser, emit_report, invocation

PROMPTS = Path(__file__).resolve().parent / "prompts" / "chat_heldout.jsonl"
SETTINGS = ("plain", "specdiff2", "specdiff2-vllm-sample")
# (file suffix, function name) -> report key
FUNCTIONS = {
    ("vllm_specdiff/plugin/proposer.py", "propose"): "propose_ms",
    ("vllm/v1/sample/rejection_sampler.py", "forward"): "rejection_sampler_ms",
    ("vllm/v1/sample/sampler.py", "forward"): "sampler_ms",
    ("vllm/v1/worker/gpu_model_runner.py", "sample_tokens"): "sample_tokens_ms",
    ("vllm/v1/engine/core.py", "step"): "engine_step_ms",
}


def engine(setting: str, max_num_seqs: int = 16) -> Any:  # noqa: ANN401
    """The default verifier in-process, plain or with the default proposer (gamma 8)."""
    from vllm import LLM

    from vllm_specdiff.models import prepare_defaults
    from vllm_specdiff.plugin.engine import specdiff_engine_args

    paths = prepare_defaults()
    kwargs: dict[str, Any] = dict(model=str(paths["verifier"]), dtype="float32",
                                  max_model_len=2048, kv_cache_memory_bytes=2**30,
                                  enforce_eager=True, max_num_seqs=max_num_seqs)
    if setting != "plain":
        kwargs.update(specdiff_engine_args(num_speculative_tokens=8,
                                           drafter=str(paths["drafter"]), log_interval=0))
    return LLM(**kwargs)


def chat_prompts(count: int) -> list[Any]:
    """The first `count` held-out chat prompts' messages."""
    return [record["messages"] for record in read_jsonl(PROMPTS)][:count]


def totals(stats: pstats.Stats, suffix: str, function: str) -> tuple[int, float]:
    """Calls and cumulative seconds of the profiled functions `function` in files ending in
    `suffix`."""
    calls, seconds = 0, 0.0
    for (path, _, name), (_, n, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        if name == function and path.endswith(suffix):
            calls, seconds = calls + n, seconds + cumulative
    return calls, seconds


def per_step(stats: pstats.Stats, steps: int) -> dict[str, float]:
    """Cumulative milliseconds per engine step of each function in FUNCTIONS (0: not called)."""
    return {key: round(1000.0 * totals(stats, *where)[1] / steps, 3)
            for where, key in FUNCTIONS.items()}


def run(setting: str, prompts: int, max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams

    from vllm_specdiff.plugin.draftless_fix import restore_vllm_sample

    llm = engine(setting)
    if setting == "specdiff2-vllm-sample":  # after start-up, which installs the plugin's fixes
        restore_vllm_sample()
    chats = chat_prompts(prompts)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.chat(chats, params, use_tqdm=False)  # warm-up
    profile = cProfile.Profile()
    began = time.perf_counter()
    profile.enable()
    outputs = llm.chat(chats, params, use_tqdm=False)
    profile.disable()
    seconds = time.perf_counter() - began
    stats = pstats.Stats(profile)
    steps = totals(stats, "vllm/v1/engine/core.py", "step")[0]
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    return {"setting": setting, "steps": steps, "new_tokens": tokens,
            "tokens_per_s_profiled": round(tokens / seconds, 2), **per_step(stats, steps)}


def main(argv: list[str] | None = None) -> int:
    parser = chat_parser(__doc__, prompts=48, max_tokens=64)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    command = invocation("vllm_specdiff_benchmarks.step_overhead", argv)
    results = [run(setting, args.prompts, args.max_tokens) for setting in SETTINGS]
    emit_report({"provenance": provenance(command), "batch_size": 16,
                 "prompts": args.prompts, "max_tokens": args.max_tokens,
                 "results": results}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
