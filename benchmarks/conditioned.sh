#!/usr/bin/env bash
# The verifier-conditioned drafter against plain decoding, the shipped default and vLLM's own
# `dflash` method serving the same drafter's export (issue 39's targets), on the default verifier
# (SmolLM2-135M-Instruct). Every run steps its methods side by side (--interleave step) in one
# process, so speedups are ratios within the run. Writes into OUT (default
# out/conditioned-DATE) one JSON + Markdown table per run (copy a re-measured run over its name
# in benchmarks/results/conditioned/, which the docs quote):
#   b1_t0.json   batch 1, T = 0, HumanEval-as-chat and held-out chat: plain, the default
#                (standalone drafter, adaptive, prompt lookup), the conditioned drafter alone
#                (adaptive, no lookup), the conditioned drafter with the defaults, vLLM dflash
#   b1_t1.json   the same at T = 1 (outputs compared in distribution by the tests, not here)
#   b16_t0.json  batch 16 (static batches), T = 0: plain, the default, the conditioned drafter
#                with the defaults, vLLM dflash
#   b16_cont.json  the same with continuous batching (32 prompts, 16 in flight)
#   b1_k4.json   batch 1, T = 0: the conditioned drafter with the defaults at K = 1 and at
#                K = 4 (self-selection over four drafts of one forward, trie verification)
#
#   bash benchmarks/conditioned.sh [OUT]      # ~30 min on 2 idle cores
#
# SPECDIFF_CONDITIONED (default: the shipped vllm_specdiff/assets/conditioned_drafter) picks the
# drafter; its `dflash` export is written to $SPECDIFF_CACHE_DIR/drafters/conditioned-dflash.
# SPECDIFF_BENCH_PARTS (default "b1_t0 b1_t1 b16_t0"; also b16_cont, b1_k4) picks the runs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${SPECDIFF_VENV:-$ROOT/.venv}/bin"
CACHE="${SPECDIFF_CACHE_DIR:-$HOME/.cache/vllm-specdiff}"
OUT="${1:-$ROOT/out/conditioned-$(date -u +%F)}"
A="${SPECDIFF_CONDITIONED:-vllm_specdiff/assets/conditioned_drafter}"
DFLASH="$CACHE/drafters/conditioned-dflash"
V="$("$BIN/vllm-specdiff" models | sed -n 's/^verifier: //p')"
cd "$ROOT"
mkdir -p "$OUT"
"$BIN/specdiff-distill" export --drafter "$A" --verifier "$V" --format dflash --output "$DFLASH"

bench() {  # NAME ARGS...
  local name="$1"
  shift
  "$BIN/vllm-specdiff" bench --gamma 8 --interleave step --dflash-model "$DFLASH" --no-progress \
    --json "$OUT/$name.json" "$@"
}
SETS=(--prompts humaneval benchmarks/prompts/chat_heldout.jsonl)
ALONE="specdiff2-nolookup:drafter=$A"
WITH="specdiff2:drafter=$A"
for part in ${SPECDIFF_BENCH_PARTS:-b1_t0 b1_t1 b16_t0}; do
  case "$part" in
    b1_t0) bench b1_t0 "${SETS[@]}" --limit 6 --max-tokens 64 --batch-size 1 --temperature 0 \
             --repeats 2 --methods "plain,specdiff2,$ALONE,$WITH,dflash" ;;
    b1_t1) bench b1_t1 "${SETS[@]}" --limit 6 --max-tokens 64 --batch-size 1 --temperature 1 \
             --repeats 2 --methods "plain,specdiff2,$ALONE,$WITH,dflash" ;;
    b16_t0) bench b16_t0 --prompts humaneval --limit 16 --max-tokens 64 --batch-size 16 \
              --batching static --temperature 0 --repeats 2 \
              --methods "plain,specdiff2,$WITH,dflash" ;;
    b16_cont) bench b16_cont --prompts humaneval --limit 32 --max-tokens 64 --batch-size 16 \
                --batching continuous --temperature 0 --repeats 2 \
                --methods "plain,specdiff2,$WITH,dflash" ;;
    b1_k4) bench b1_k4 "${SETS[@]}" --limit 6 --max-tokens 64 --batch-size 1 --temperature 0 \
             --repeats 2 --methods "plain,$WITH,specdiff2-k4:drafter=$A" ;;
    *) echo "unknown part $part (b1_t0, b1_t1, b16_t0, b16_cont, b1_k4)" >&2; exit 2 ;;
  esac
done
