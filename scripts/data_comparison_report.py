"""The data comparison's result (scripts/compare_data.sh): two `eval` JSONs -> one JSON + PNG.

The same candidates were evaluated (`eval --no-verifier-pass`, against the data's own tokens) on
the held-out prompts of the greedy data (what serves temperature 0: greedy drafts against the
greedy verifier) and of the temperature-1 data (what serves temperature 1: sampled drafts against
the T = 1 verifier, estimated without bias from the verifier's own samples). This adds what the
figures need to be read: the data (prompts, tokens), each run's budget (steps, tokens, CPU
time), the commands, and, since every candidate is scored on the same windows, each difference to
the greedy-data run paired window by window with its standard error.

    python scripts/data_comparison_report.py --greedy-data DIR --t1-data DIR \\
        --greedy-eval JSON --t1-eval JSON --run NAME=RUN_DIR ... --steps N --output JSON
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from vllm_specdiff.provenance import provenance
from vllm_specdiff_training.data import load_sequences, split_heldout

HELDOUT_FRACTION = 0.05  # the split every compared run trained with (scripts/compare_common.sh)
BASELINE = "greedy-streak"  # the recipe's data: the other candidates are compared with it
# (metric key, data set) pairs of the table, scored against the data's own tokens (`eval
# --no-verifier-pass`): greedy drafts vs the T = 0 verifier (what serves temperature 0), sampled
# drafts (T_d = 1) vs the T = 1 verifier (what serves temperature 1: the paper's tau), sampled
# drafts vs the T = 0 verifier, greedy drafts vs the T = 1 verifier
METRICS = (("data_greedy_accepted_length", "greedy"), ("verifier_token_streak", "t1"),
           ("verifier_token_streak", "greedy"), ("data_greedy_accepted_length", "t1"))


def data_summary(data_dir: Path) -> dict[str, Any]:
    """How the data was made, how much there is, and which prompts the split holds out."""
    data = load_sequences(data_dir)
    train, held = split_heldout(data, HELDOUT_FRACTION)
    keys = ("temperature", "num_samples", "top_logprobs", "max_new_tokens", "chunk_size", "seed",
            "prompts", "verifier")
    total = int(data.seq_offsets[-1])
    return {
        "dir": str(data_dir), **{k: data.meta.get(k) for k in keys},
        "shards": len(list(Path(data_dir).glob("shard-*.safetensors"))),
        "prompts": sorted({int(i) for i in data.prompt_index}), "sequences": len(data),
        "tokens": total, "generated_tokens": total - int(data.prompt_lens.sum()),
        "train_prompts": len({int(i) for i in train.prompt_index}),
        "heldout_prompts": sorted({int(i) for i in held.prompt_index}),
    }


def check_same_prompts(greedy: dict[str, Any], t1: dict[str, Any]) -> None:
    """Both data sets must cover the same prompts and hold out the same ones."""
    for key in ("prompts", "heldout_prompts"):
        if greedy[key] != t1[key]:
            raise ValueError(f"the greedy and temperature-1 data differ in their {key}: "
                             f"generate the T = 1 data for the greedy data's first prompts")


def run_summary(run_dir: Path, steps: int) -> dict[str, Any]:
    """A run's data, loss and budget up to `steps` (it may have been continued past it)."""
    config = json.loads((run_dir / "train_config.json").read_text())
    by_step = {}  # a resumed run logs the steps after its checkpoint again: keep the last
    for line in (run_dir / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record and record["step"] <= steps:
            by_step[record["step"]] = record
    if sorted(by_step) != list(range(1, steps + 1)):
        raise ValueError(f"{run_dir}: its log does not hold every step up to {steps}")
    records = by_step.values()

    def total(key: str) -> float:
        return sum(r[key] for r in records)

    return {"dir": str(run_dir), "data": config["data"], "loss": config["loss"], "steps": steps,
            "drafter": config["drafter"], "tokens": int(total("tokens")),
            "cpu_hours": total("cpu_seconds") / 3600, "step_wall_hours": total("seconds") / 3600,
            "heldout_expected_streak": by_step[steps].get("heldout_expected_streak"),
            "train_config": config}


def generate_summary(path: Path) -> dict[str, Any]:
    """Sum the JSON summaries `generate` printed (one per (re)start) in its stdout, which also
    holds vLLM's log lines: each summary is the JSON object that starts a line with `{`."""
    decoder, text = json.JSONDecoder(), path.read_text()
    total = {"generated_tokens": 0, "seconds": 0.0}
    starts = [0] if text.startswith("{") else []
    starts += [i + 1 for i, c in enumerate(text) if c == "\n" and text[i + 1:i + 2] == "{"]
    for start in starts:
        try:
            summary, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        if "generated_tokens" in summary:
            total["generated_tokens"] += summary["generated_tokens"]
            total["seconds"] += summary.get("seconds", 0.0)
    seconds = total["seconds"]
    total["tokens_per_s"] = total["generated_tokens"] / seconds if seconds else None
    return total


def paired(values: list[float], base: list[float]) -> dict[str, float]:
    """Mean difference of two candidates on the same windows and its standard error."""
    if len(values) != len(base) or len(values) < 2:
        raise ValueError("paired differences need the same windows, at least two")
    diffs = [v - b for v, b in zip(values, base, strict=True)]
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return {"difference": mean, "stderr": math.sqrt(var / len(diffs))}


def table(evals: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per candidate: each metric on each data set, and its paired difference to BASELINE."""
    rows: dict[str, dict[str, Any]] = {}
    for name in evals["greedy"]["results"]:
        row: dict[str, Any] = {}
        for metric, data in METRICS:
            results = evals[data]["results"]
            key = f"{metric}_on_{data}_data"
            row[key] = results[name][metric]
            if name != BASELINE and BASELINE in results:
                per = f"{metric}_per_window"
                row[key + "_vs_" + BASELINE] = paired(results[name][per], results[BASELINE][per])
        rows[name] = row
    return rows


def estimate_check(check: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The T = 1 estimate from the verifier's samples against the verifier pass's figures, on the
    same windows: expected accepted length of sampled drafts and the token streak, and their
    paired difference (zero in expectation: both are sums over x of P(x) Q(x))."""
    rows = {}
    for name, r in check["results"].items():
        rows[name] = {"windows": r["windows"],
                      "expected_accepted_length": r["expected_accepted_length"],
                      "verifier_token_streak": r["verifier_token_streak"],
                      "difference": paired(r["verifier_token_streak_per_window"],
                                           r["expected_accepted_length_per_window"])}
    return rows


def plot(evals: dict[str, dict[str, Any]], path: Path) -> Path:
    """Per-position acceptance: greedy on greedy data (T = 0), sampled on T = 1 data (T = 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    panels = ((axes[0], "greedy", "data_greedy", "data_greedy_accepted_length",
               "T = 0: greedy drafts, greedy data (held out)"),
              (axes[1], "t1", "data_streak", "verifier_token_streak",
               "T = 1: sampled drafts vs the T = 1 verifier, T = 1 data (held out)"))
    for ax, data, kind, figure, title in panels:
        for name, r in evals[data]["results"].items():
            curve = [math.nan if v is None else v for v in r[f"per_position_acceptance_{kind}"]]
            ax.plot(range(1, len(curve) + 1), curve, marker="o",
                    label=f"{name} ({r[figure]:.3f})")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("draft position j")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("P(j accepted | 1..j-1 accepted)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag in ("--greedy-data", "--t1-data", "--greedy-eval", "--t1-eval", "--output"):
        parser.add_argument(flag, type=Path, required=True)
    parser.add_argument("--generate-log", type=Path, help="the T = 1 `generate` JSON summaries")
    parser.add_argument("--run", action="append", default=[], help="NAME=RUN_DIR, repeated")
    parser.add_argument("--steps", type=int, required=True, help="the compared budget")
    parser.add_argument("--check-eval", type=Path,
                        help="an eval of the T = 1 data with the verifier pass (a few windows)")
    args = parser.parse_args()
    data = {"greedy": data_summary(args.greedy_data), "t1": data_summary(args.t1_data)}
    check_same_prompts(data["greedy"], data["t1"])
    evals = {"greedy": json.loads(args.greedy_eval.read_text()),
             "t1": json.loads(args.t1_eval.read_text())}
    runs = {name: run_summary(Path(d), args.steps)
            for name, _, d in (r.partition("=") for r in args.run)}
    if args.generate_log and args.generate_log.is_file():
        data["t1"]["generate"] = generate_summary(args.generate_log)
    out = {
        **provenance(), "steps": args.steps, "baseline": BASELINE, "data": data, "runs": runs,
        "table": table(evals),
        "commands": {"script": "bash scripts/compare_data.sh",
                     "eval_greedy_data": evals["greedy"]["command"],
                     "eval_t1_data": evals["t1"]["command"]},
        "evals": evals,
    }
    if args.check_eval:
        check = json.loads(args.check_eval.read_text())
        out["estimate_check"] = estimate_check(check)
        out["commands"]["eval_t1_data_verifier_pass"] = check["command"]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    out["plot"] = str(plot(evals, args.output.with_suffix(".png")))
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out["table"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
