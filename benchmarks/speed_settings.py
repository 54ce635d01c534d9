"""Plain decoding of the default verifier under different CPU runtime settings.

    python -m vllm_specdiff_benchmarks.speed_settings --reps 3 --max-tokens 48

LD_PRELOAD only acts at process start, so each setting runs in its own process; settings are
run in turn (A B C A B C ...) so load from other processes spreads over all of them. Reports
tokens/s per setting (median over repetitions) and the ratio to the first one.

Settings:
  default   engine in this process, no runtime settings (torch's libgomp, one OpenMP thread
            per core, no affinity): what `LLM(...)` with VLLM_ENABLE_V1_MULTIPROCESSING=0 gets.
  cli       what `vllm-specdiff` applies (vllm_specdiff.plugin.cpu_env): Intel OpenMP and, if
            installed, tcmalloc preloaded, vLLM's thread count, KMP_BLOCKTIME/KMP_TPAUSE.
  vllm-mp   vLLM's own multi-process engine, which binds its OpenMP threads itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = ("default", "cli", "vllm-mp")


def settings_env(name: str) -> dict[str, str]:
    from vllm_specdiff.plugin import cpu_env

    base = {k: v for k, v in os.environ.items()
            if k not in ("LD_PRELOAD", "OMP_NUM_THREADS", "KMP_BLOCKTIME", "KMP_TPAUSE",
                         cpu_env.APPLIED_FLAG)}
    if name == "default":
        return {**base, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if name == "cli":
        return {**base, **cpu_env.recommended_env(base), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if name == "vllm-mp":
        return {**base, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    raise ValueError(f"unknown setting {name!r}; choose from {SETTINGS}")


def measure(max_tokens: int, prompts: int) -> dict[str, float]:
    """Runs inside the child process: plain greedy decoding, one prompt at a time."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_specdiff.models import prepare_verifier
    from vllm_specdiff.prompts import load_prompts, render_chat

    llm = LLM(model=str(prepare_verifier()), dtype="float32", max_model_len=1024,
              max_num_seqs=4, kv_cache_memory_bytes=256 * 2**20, enforce_eager=True, seed=0)
    tokenizer = llm.get_tokenizer()
    ids = [render_chat(tokenizer, m) for m in load_prompts("demo", prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=ids[0])], SamplingParams(max_tokens=4),
                 use_tqdm=False)
    tokens, seconds = 0, 0.0
    for p in ids:
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)
        seconds += time.perf_counter() - start
        tokens += len(out[0].outputs[0].token_ids) - 1
    return {"tokens_per_s": tokens / seconds, "ms_per_token": 1000 * seconds / tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(measure(args.max_tokens, args.prompts)), flush=True)
        return 0
    results: dict[str, list[float]] = {name: [] for name in args.settings}
    for rep in range(args.reps):
        for name in args.settings:
            cmd = [sys.executable, "-m", "vllm_specdiff_benchmarks.speed_settings", "--child",
                   "--max-tokens", str(args.max_tokens), "--prompts", str(args.prompts)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=settings_env(name),
                                  timeout=900)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise RuntimeError(f"setting {name!r} failed (exit {proc.returncode})")
            value = json.loads(line.removeprefix("RESULT "))["tokens_per_s"]
            results[name].append(value)
            print(f"rep {rep} {name:8s} {value:7.2f} tokens/s", flush=True)
    first = statistics.median(results[args.settings[0]])
    print(f"{'setting':8s} {'median tok/s':>12s} {'ratio':>6s}  runs")
    for name, values in results.items():
        med = statistics.median(values)
        runs = ", ".join(f"{v:.2f}" for v in values)
        print(f"{name:8s} {med:12.2f} {med / first:6.2f}  {runs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
