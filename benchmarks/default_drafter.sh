#!/usr/bin/env bash
# Plain vLLM vs SpecDiff-2 with the default models, on this machine, batch 1, in one process
# (ratios from the same run; see vllm_specdiff/bench/suite.py). Writes the demo's JSON and one
# suite JSON (with date, machine, versions and command) into OUT (default
# benchmarks/results/DATE), from which `python scripts/results_table.py --write README.md`
# regenerates the README's table. The whole suite of issue 12 is benchmarks/suite.sh.
#
#   bash benchmarks/default_drafter.sh [OUT]      # ~15 minutes on 2 cores
#
# benchmarks/prompts/chat_heldout.jsonl: general chat prompts on topics no training prompt
# mentions (written by `specdiff-distill corpus --heldout-output`, seed 0).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${SPECDIFF_VENV:-$ROOT/.venv}/bin"
OUT="${1:-$ROOT/benchmarks/results/$(date -u +%F)}"
LIMIT="${SPECDIFF_BENCH_LIMIT:-10}"
mkdir -p "$OUT"
"$BIN/vllm-specdiff" demo --output "$OUT/demo.json"
# specdiff2-k4: self-selection over K = 4 candidates (argmax, ngram, sampled at T_d = 1)
"$BIN/vllm-specdiff" bench --prompts humaneval "$ROOT/benchmarks/prompts/chat_heldout.jsonl" \
  --limit "$LIMIT" --max-tokens 96 --gamma 8 --temperature 0 1 --batch-size 1 --repeats 1 \
  --methods plain,specdiff2,specdiff2-k4 --json "$OUT/default_drafter.json"
