#!/usr/bin/env bash
# Plain vLLM vs SpecDiff with the default models, on this machine, one engine pair per run
# (ratios from the same process; see vllm_specdiff/harness.py). Writes one JSON per run (with
# date, machine, versions and command) into OUT (default benchmarks/results/DATE), from which
# `python scripts/results_table.py --write README.md` regenerates the README's table.
#
#   bash benchmarks/default_drafter.sh [OUT]      # ~10 minutes on 2 cores
#
# benchmarks/prompts/chat_heldout.jsonl: general chat prompts on topics no training prompt
# mentions (written by `specdiff-distill corpus --heldout-output`, seed 0).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${SPECDIFF_VENV:-$ROOT/.venv}/bin"
OUT="${1:-$ROOT/benchmarks/results/$(date -u +%F)}"
LIMIT="${SPECDIFF_BENCH_LIMIT:-10}"
mkdir -p "$OUT"
bench() { "$BIN/vllm-specdiff" bench --limit "$LIMIT" --max-tokens 96 --gamma 8 "$@"; }
"$BIN/vllm-specdiff" demo --output "$OUT/demo.json"
bench --prompts humaneval --output "$OUT/humaneval-t0.json"
bench --prompts "$ROOT/benchmarks/prompts/chat_heldout.jsonl" --output "$OUT/chat-t0.json"
bench --prompts humaneval --temperature 1 --output "$OUT/humaneval-t1.json"
# self-selection: K = 4 candidates (argmax + 3 sampled at T_d = 1) verified as one trie
bench --prompts humaneval -K 4 --drafter-temperature 1 --output "$OUT/humaneval-t0-k4.json"
