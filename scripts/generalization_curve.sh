#!/usr/bin/env bash
# How the default drafter's training generalises: greedy accepted length (gamma 8) of its
# checkpoints on the verifier's own greedy continuations of prompts no training prompt came
# from, the benchmark sets themselves (16 HumanEval-as-chat prompts, 16 general chat prompts on
# held-out topics, 96 new tokens each, through the chat template). The trainer's held-out
# windows share the training prompts' topics and templates, so they flatter the drafter; these
# are what vLLM's acceptance on the benchmarks follows (stage 2's step 500: 0.44 here on chat,
# and 0.44 accepted per step measured in vLLM at gamma 8).
#
#   bash scripts/generalization_curve.sh [RESULT_DIR] [STEP ...]
#
# RESULT_DIR (default out/) gets generalization_curve_{chat,humaneval}.json; STEPs
# (default: every 100th of stage 2, plus the latest) are checkpoints of stage 2
# (runs/compare-from-step-0000850-streak); stage 1's end (its step 850) is always included.
# SPECDIFF_CURVE_RUN=continued scores `train_default_drafter.sh continue`'s run instead (STEPs
# are its own; step N there is step 3,900 + N in all), against the shipped drafter it started
# from, into generalization_curve_continued_{chat,humaneval}.json.
# SPECDIFF_CURVE_RUN=conditioned scores `train_conditioned_drafter.sh continue`'s run against the
# shipped conditioned drafter, on 40 prompts a set (1,280 windows: its differences are smaller;
# `eval` builds the verifier features their taps read), into generalization_curve_conditioned_*.json;
# SPECDIFF_CURVE_EXTRA="NAME=DIR ..." adds drafters (any mode).
# `eval --no-verifier-pass` scores each draft against the data's own tokens: exact for greedy
# data at T = 0, and ~1 minute per candidate and set on one core; `--replay` adds the accepted
# length per step in serving order (replay_accepted_per_step), the figure serving reports. The
# data are generated once (vLLM, ~3 minutes a set) under $SPECDIFF_CACHE_DIR/data/bench-*-greedy.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${SPECDIFF_VENV:-$ROOT/.venv}/bin"
CACHE="${SPECDIFF_CACHE_DIR:-$HOME/.cache/vllm-specdiff}"
OUT="${1:-$ROOT/out}"
shift || true
V="$("$BIN/vllm-specdiff" models | sed -n 's/^verifier: //p')"
case "${SPECDIFF_CURVE_RUN:-stage2}" in
  stage2)
    RUN="$CACHE/runs/compare-from-step-0000850-streak/checkpoints" NAME=stage2 SUFFIX=
    CANDIDATES=(--candidate "stage1-850=$CACHE/runs/default-drafter/checkpoints/step-0000850") ;;
  continued)
    RUN="$CACHE/runs/default-drafter-continued/checkpoints" NAME=continued SUFFIX=_continued
    CANDIDATES=(--candidate "shipped-3900=$CACHE/drafters/shipped-start") ;;
  conditioned)
    RUN="$CACHE/runs/conditioned-continued/checkpoints" NAME=conditioned SUFFIX=_conditioned
    PROMPTS_PER_SET=40 WINDOWS=(32 1280)
    CANDIDATES=(--candidate "shipped=$ROOT/vllm_specdiff/assets/conditioned_drafter") ;;
  *) echo "SPECDIFF_CURVE_RUN: stage2, continued or conditioned, not ${SPECDIFF_CURVE_RUN}" >&2
     exit 2 ;;
esac
PROMPTS_PER_SET="${PROMPTS_PER_SET:-16}"
[ -n "${WINDOWS+x}" ] || WINDOWS=(16 256)  # windows per sequence, windows
for extra in ${SPECDIFF_CURVE_EXTRA:-}; do CANDIDATES+=(--candidate "$extra"); done
if [ $# -eq 0 ] && [ -d "$RUN" ]; then
  LATEST="$(ls -d "$RUN"/step-* | sort | tail -n 1)"
  set -- $(ls -d "$RUN"/step-*00 | sed 's/.*step-0*//') "$(basename "$LATEST" | sed 's/step-0*//')"
fi
for STEP in $(printf '%s\n' "$@" | sort -n | uniq); do
  CANDIDATES+=(--candidate "$NAME-$STEP=$RUN/step-$(printf %07d "$STEP")")
done
mkdir -p "$OUT"
for SET in chat humaneval; do
  DATA="$CACHE/data/bench-$SET-greedy"
  [ "$PROMPTS_PER_SET" = 16 ] || DATA="$DATA-$PROMPTS_PER_SET"
  if [ ! -f "$DATA/meta.json" ]; then
    PROMPTS="$DATA-prompts.jsonl"
    SOURCE=humaneval
    [ "$SET" = chat ] && SOURCE="$ROOT/benchmarks/prompts/chat_heldout.jsonl"
    "$BIN/python" -c 'import json, sys
from vllm_specdiff.prompts import load_prompts
with open(sys.argv[2], "w") as f:
    for messages in load_prompts(sys.argv[1], int(sys.argv[3])):
        f.write(json.dumps({"messages": messages}) + "\n")' "$SOURCE" "$PROMPTS" "$PROMPTS_PER_SET"
    VLLM_ENABLE_V1_MULTIPROCESSING=0 "$BIN/specdiff-distill" generate --verifier "$V" \
      --prompts "$PROMPTS" --output "$DATA" --num-samples 1 --temperature 0 \
      --max-new-tokens 96 --batch-size 16
  fi
  OMP_NUM_THREADS=1 "$BIN/specdiff-distill" eval --data "$DATA" --verifier "$V" \
    "${CANDIDATES[@]}" --split all --windows-per-seq "${WINDOWS[0]}" \
    --max-windows "${WINDOWS[1]}" --gamma 8 \
    --no-verifier-pass --replay --output "$OUT/generalization_curve${SUFFIX}_$SET.json"
done
