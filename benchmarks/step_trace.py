"""Where a suite run's time goes, engine step by engine step: `vllm-specdiff bench` with every
scheduler step timed and sorted by kind, per method.

    python -m vllm_specdiff_benchmarks.step_trace --out OUT.json -- BENCH OPTIONS...

e.g. `-- --prompts benchmarks/prompts/chat_heldout.jsonl --limit 48 --repeats 2 --max-tokens 64
--temperature 0 --batch-size 16 --batching continuous --methods plain,specdiff2`. A step's time
is the time from its `Scheduler.schedule` call to the next one of the same engine (the forward,
sampling, the proposer and the output processing between). Kinds: "prefill" (a step that
schedules a new request or more tokens than its rows and drafts: a prompt, or a chunk of it),
"drafts" (decode steps verifying draft tokens), "decode" (decode steps without drafts). Gaps
of over 2 s (between the bench's passes) are not steps; `--interleave step` is refused (each
step would include the other engines'). The suite's own result goes to
OUT's stem + `_bench.json`, so speedups and step totals come from the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from vllm_specdiff.provenance import provenance
from vllm_specdiff_benchmarks import invocation

MODULE = "vllm_specdiff_benchmarks.step_trace"
MAX_STEP_S = 2.0
KINDS = ("prefill", "drafts", "decode")


def step_kind(step: dict[str, int]) -> str:
    """A scheduled step's kind (see the module docstring)."""
    if step["new"] or step["tokens"] > step["reqs"] + step["spec"]:
        return "prefill"
    return "drafts" if step["spec"] else "decode"


def summarize(steps: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per kind: steps, total seconds, mean ms, mean scheduled tokens, rows and draft tokens,
    from one engine's schedule calls in order (each timed to the next)."""
    timed = [(a, b["t"] - a["t"]) for a, b in zip(steps, steps[1:], strict=False)
             if a["tokens"] > 0 and b["t"] - a["t"] < MAX_STEP_S]
    out = {}
    for kind in KINDS:
        rows = [(a, d) for a, d in timed if step_kind(a) == kind]
        if not rows:
            continue
        n = len(rows)
        out[kind] = {"steps": n, "seconds": round(sum(d for _, d in rows), 3),
                     "mean_ms": round(1000 * sum(d for _, d in rows) / n, 1),
                     "mean_tokens": round(sum(a["tokens"] for a, _ in rows) / n, 1),
                     "mean_rows": round(sum(a["reqs"] for a, _ in rows) / n, 1),
                     "mean_draft_tokens": round(sum(a["spec"] for a, _ in rows) / n, 1)}
    return out


def trace(bench_argv: list[str]) -> tuple[int, dict[str, list[dict[str, Any]]]]:
    """Run the bench with its schedulers timed; the exit status and each method's steps."""
    from vllm.v1.core.sched import scheduler as sched

    import vllm_specdiff.bench.runner as runner
    from vllm_specdiff.cli import main

    steps: dict[int, list[dict[str, Any]]] = {}
    labels: dict[int, str] = {}
    schedule, build = sched.Scheduler.schedule, runner.build_engines

    def timed_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        out = schedule(self, *args, **kwargs)
        steps.setdefault(id(self), []).append({
            "t": time.perf_counter(), "tokens": out.total_num_scheduled_tokens,
            "reqs": len(out.num_scheduled_tokens), "new": len(out.scheduled_new_reqs),
            "spec": sum(len(v) for v in out.scheduled_spec_decode_tokens.values())})
        return out

    def labelled_build(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        engines, startup = build(*args, **kwargs)
        for label, engine in engines.items():
            labels[id(engine.llm.llm_engine.engine_core.engine_core.scheduler)] = label
        steps.clear()  # start-up and warm-up steps are not the bench's
        return engines, startup

    sched.Scheduler.schedule, runner.build_engines = timed_schedule, labelled_build
    try:
        rc = main(["--no-speed-env", "bench", *bench_argv])
    finally:
        sched.Scheduler.schedule, runner.build_engines = schedule, build
    return rc, {labels[k]: v for k, v in steps.items() if k in labels}


def interleave_option(bench_argv: list[str]) -> str | None:
    """The bench's `--interleave` value (either spelling), None when not given."""
    for i, arg in enumerate(bench_argv):
        if arg.startswith("--interleave="):
            return arg.split("=", 1)[1]
        if arg == "--interleave" and i + 1 < len(bench_argv):
            return bench_argv[i + 1]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON summary")
    parser.add_argument("--no-speed-env", action="store_true",
                        help="keep the environment (no tcmalloc / iomp re-exec)")
    parser.add_argument("bench", nargs=argparse.REMAINDER,
                        help="-- then the options of `vllm-specdiff bench`")
    args = parser.parse_args(argv)
    bench_argv = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if "--json" in bench_argv:
        parser.error("the bench's --json is OUT's stem + _bench.json; do not pass it")
    if interleave_option(bench_argv) == "step":
        parser.error("a step is timed to its engine's next schedule call, which with "
                     "--interleave step comes after the other engines' steps: use the default "
                     "--interleave pass")
    if not args.no_speed_env:
        from vllm_specdiff.plugin import cpu_env

        cpu_env.reexec_with_speed_env(argv, module=MODULE)
    bench_json = args.out.with_name(args.out.stem + "_bench.json")
    rc, steps = trace([*bench_argv, "--json", str(bench_json)])
    report = {"provenance": provenance(invocation(MODULE, argv)),
              "bench_result": bench_json.name,
              "methods": {label: summarize(s) for label, s in steps.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for label, kinds in report["methods"].items():
        total = sum(k["seconds"] for k in kinds.values())
        parts = ", ".join(f"{kind} {k['steps']} x {k['mean_ms']} ms" for kind, k in kinds.items())
        print(f"{label}: {total:.2f} s in steps: {parts}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
