#!/usr/bin/env bash
# The cells the targets of issues 9 and 12 are judged on, with the default models on this
# machine, every method of a run in one process (ratios from the same run; see
# vllm_specdiff/bench/suite.py). Writes into OUT (default out/standalone-DATE) the demo's
# JSON and one suite JSON + Markdown table per run (with date, machine, versions and command);
# a run the docs quote is copied over its name in benchmarks/results/standalone/, from which
# `python scripts/results_table.py --write` regenerates docs/results.md.
# The whole suite of issue 12 (all sets, T, batch sizes, K and gamma sweeps) is
# benchmarks/suite.sh.
#
#   bash benchmarks/default_drafter.sh [OUT]      # ~30 minutes on 2 quiet cores
#
# Runs:
# `specdiff2` is the plugin's default (K = 1, adaptive, prompt lookup where the context
# repeats); `specdiff2-nolookup` is the drafter alone (its accepted length at fixed gamma 8 is
# issue 9's acceptance target).
#   b1_t0   batch 1, T = 0: plain, vLLM ngram, vLLM draft_model (the AR baseline, where it was
#           exported), the untrained base drafter, specdiff2 adaptive and at fixed gamma 8, 4
#           and 2 (adaptive against the best fixed gamma), specdiff2-nolookup adaptive and at
#           fixed gamma 8
#   b1_t1   batch 1, T = 1: plain, ngram, specdiff2 adaptive and fixed, specdiff2-nolookup
#   b4_t0   batch 4, T = 0: plain, ngram, specdiff2 adaptive and at fixed gamma 4,
#           specdiff2-nolookup
#   b16_t0  batch 16, T = 0: plain, ngram, specdiff2 adaptive and at fixed gamma 8, 4,
#           specdiff2-nolookup
# benchmarks/prompts/chat_heldout.jsonl: general chat prompts on topics no training prompt
# mentions (written by `specdiff-distill corpus --heldout-output`, seed 0).
# SPECDIFF_AR_DRAFTER: the draft_model baseline (default: $SPECDIFF_CACHE_DIR/drafters/ar-drafter,
# made by the commands in docs/training.md); SPECDIFF_BENCH_LIMIT (8): prompts per set at batch 1 (batch 16 uses 16).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${SPECDIFF_VENV:-$ROOT/.venv}/bin"
OUT="${1:-$ROOT/out/standalone-$(date -u +%F)}"
LIMIT="${SPECDIFF_BENCH_LIMIT:-8}"
SETS=(humaneval "$ROOT/benchmarks/prompts/chat_heldout.jsonl")
AR="${SPECDIFF_AR_DRAFTER:-${SPECDIFF_CACHE_DIR:-$HOME/.cache/vllm-specdiff}/drafters/ar-drafter}"
FIXED="specdiff2:adaptive=false,specdiff2:adaptive=false:gamma=4"
B1="plain,ngram,specdiff-base,specdiff2,$FIXED,specdiff2:adaptive=false:gamma=2"
B1="$B1,specdiff2-nolookup,specdiff2-nolookup:adaptive=false"
EXTRA=()
if [ -f "$AR/config.json" ]; then
  B1="$B1,draft-model"
  EXTRA=(--draft-model "$AR")
else
  echo "default_drafter.sh: no AR drafter at $AR: the draft-model row is left out" >&2
fi
bench() { "$BIN/vllm-specdiff" bench --prompts "${SETS[@]}" --max-tokens 96 --gamma 8 "$@"; }
mkdir -p "$OUT"
"$BIN/vllm-specdiff" demo --output "$OUT/demo.json"
bench --limit "$LIMIT" --repeats 1 --temperature 0 --batch-size 1 --methods "$B1" "${EXTRA[@]}" \
  --json "$OUT/b1_t0.json" --plots "$OUT/plots_b1_t0"
bench --limit "$LIMIT" --repeats 1 --temperature 1 --batch-size 1 \
  --methods plain,ngram,specdiff2,specdiff2:adaptive=false,specdiff2-nolookup \
  --json "$OUT/b1_t1.json"
bench --limit "$LIMIT" --repeats 1 --temperature 0 --batch-size 4 \
  --methods "plain,ngram,specdiff2,specdiff2:adaptive=false:gamma=4,specdiff2-nolookup" \
  --json "$OUT/b4_t0.json"
bench --limit 16 --repeats 2 --temperature 0 --batch-size 16 \
  --methods "plain,ngram,specdiff2,$FIXED,specdiff2-nolookup" --json "$OUT/b16_t0.json"
