#!/usr/bin/env bash
# Greedy vs temperature-1 data, hard vs soft targets, measured (issue 9): from ONE starting
# drafter and the same budget, continue training with the streak loss on greedy data, the streak
# loss on temperature-1 data and streak-soft (the top-8 soft targets) on temperature-1 data,
# all on the same prompts; then evaluate the start and every result on the held-out prompts of
# BOTH data sets against the data's own tokens (`eval --no-verifier-pass`: on this CPU the
# verifier pass would cost ~15x more per window): the greedy accepted length on greedy data (what
# serves temperature 0) and the expected accepted length against the T = 1 verifier on
# temperature-1 data (what serves temperature 1; an unbiased estimate from the verifier's own
# samples), with per-position curves, JSON + PNG (scripts/data_comparison_report.py).
#
#   bash scripts/compare_data.sh [START_CHECKPOINT] [RESULT_JSON]
#
# START_CHECKPOINT: default the default drafter's stage-1 step 850 (the loss comparison's start).
# RESULT_JSON: default benchmarks/results/data_comparison.json (PNG beside it).
# SPECDIFF_DATACMP_SHARDS (default 8) shards of 64 prompts: the greedy data's first ones
# (symlinked into data/greedy-firstN) and the same prompts generated at temperature 1 into
# SPECDIFF_DATACMP_T1_DATA (default $SPECDIFF_CACHE_DIR/data/t1; another shard count needs
# another directory, as `generate` refuses to resume with other settings).
# SPECDIFF_DATACMP_STEPS (default 100) optimizer steps per run, SPECDIFF_DATACMP_PARALLEL
# (default 2) jobs at a time, SPECDIFF_DATACMP_WINDOWS (default 512: with 16 windows per
# held-out sequence, all of 8 shards' 28 held-out prompts) held-out windows per data set;
# SPECDIFF_DATACMP_VERIFIER_WINDOWS (default 0: off) T = 1 windows also scored with the verifier
# pass, which checks the estimate (its JSON has both figures on the same windows).
# Training settings are those of scripts/compare_losses.sh (scripts/compare_common.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${SPECDIFF_VENV:-$ROOT/.venv}/bin"
CACHE="${SPECDIFF_CACHE_DIR:-$HOME/.cache/vllm-specdiff}"
NICE="nice -n ${SPECDIFF_NICE:-10}"
source "$ROOT/scripts/compare_common.sh"
SHARDS="${SPECDIFF_DATACMP_SHARDS:-8}"
STEPS="${SPECDIFF_DATACMP_STEPS:-100}"
PARALLEL="${SPECDIFF_DATACMP_PARALLEL:-2}"
WINDOWS="${SPECDIFF_DATACMP_WINDOWS:-512}"
START="${1:-$CACHE/runs/default-drafter/checkpoints/step-0000850}"
RESULT="${2:-$ROOT/benchmarks/results/data_comparison.json}"
GREEDY="$CACHE/data/greedy-first$SHARDS"
T1="${SPECDIFF_DATACMP_T1_DATA:-$CACHE/data/t1}"
START_DIR="$(compare_start_dir "$START")"

# The greedy data restricted to its first SHARDS shards (the prompts the T = 1 data covers).
mkdir -p "$GREEDY"
ln -sfn "$CACHE/data/greedy/meta.json" "$GREEDY/meta.json"
for ((i = 0; i < SHARDS; i++)); do
  shard="$(printf shard-%05d.safetensors "$i")"
  [ -f "$CACHE/data/greedy/$shard" ] || { echo "$CACHE/data/greedy/$shard is missing" >&2; exit 2; }
  ln -sfn "$CACHE/data/greedy/$shard" "$GREEDY/$shard"
done

RUNS=(greedy-streak t1-streak t1-streak-soft)
run_data() { case "$1" in greedy-*) echo "$GREEDY" ;; *) echo "$T1" ;; esac; }
run_loss() { echo "${1#*-}"; }
trained() { [ -d "$(compare_at_step "datacmp-$1" "$STEPS")" ]; }
start_run() {  # RUN: train it in the background unless it reached the budget already
  trained "$1" || compare_train "$(run_data "$1")" "$START_DIR" "datacmp-$1" "$(run_loss "$1")" \
    "$STEPS" &
  compare_wait_slot "$PARALLEL"
}

start_run greedy-streak  # needs no new data: trains while the T = 1 data is generated
# The same prompts at temperature 1 (vLLM batch inference, one thread: the machine is shared),
# with the top-8 log-probs, as the greedy data was made (scripts/train_default_drafter.sh).
SPEED_ENV="$("$BIN/python" -c 'import shlex
from vllm_specdiff.plugin.cpu_env import recommended_env
print(" ".join(f"{k}={shlex.quote(v)}" for k, v in recommended_env().items()))')"
mkdir -p "$CACHE/logs"
env $SPEED_ENV OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 $NICE "$BIN/specdiff-distill" \
  generate --verifier "$V" --prompts "$CACHE/corpus/prompts.jsonl" --output "$T1" \
  --num-samples 1 --temperature 1 --max-new-tokens 128 --top-logprobs 8 --chunk-size 64 \
  --backend vllm --max-prompts $((SHARDS * 64)) 2>> "$CACHE/logs/datacmp-generate.log" \
  | tee -a "$CACHE/logs/datacmp-generate.json"
start_run t1-streak
start_run t1-streak-soft
wait

CANDIDATES=(--candidate "start=$START_DIR")
for run in "${RUNS[@]}"; do
  CANDIDATES+=(--candidate "$run=$(compare_at_step "datacmp-$run" "$STEPS")")
done
CANDIDATES+=(--no-verifier-pass --windows-per-seq 16)
EVALS="$CACHE/runs/datacmp-eval"
compare_eval "$GREEDY" "$EVALS/greedy-data.json" "$WINDOWS" "${CANDIDATES[@]}" \
  > "$CACHE/logs/datacmp-eval-greedy.log" 2>&1 &
compare_eval "$T1" "$EVALS/t1-data.json" "$WINDOWS" "${CANDIDATES[@]}" \
  > "$CACHE/logs/datacmp-eval-t1.log" 2>&1 &
wait
CHECK=()  # optional: the verifier pass on a few T = 1 windows, to check the estimate against it
if [ "${SPECDIFF_DATACMP_VERIFIER_WINDOWS:-0}" -gt 0 ]; then
  compare_eval "$T1" "$EVALS/t1-data-verifier.json" "$SPECDIFF_DATACMP_VERIFIER_WINDOWS" \
    "${CANDIDATES[@]:0:${#CANDIDATES[@]}-3}" > "$CACHE/logs/datacmp-eval-t1-verifier.log" 2>&1
  CHECK=(--check-eval "$EVALS/t1-data-verifier.json")
fi
RUN_DIRS=()
for run in "${RUNS[@]}"; do RUN_DIRS+=(--run "$run=$CACHE/runs/datacmp-$run"); done
"$BIN/python" "$ROOT/scripts/data_comparison_report.py" --greedy-data "$GREEDY" --t1-data "$T1" \
  --greedy-eval "$EVALS/greedy-data.json" --t1-eval "$EVALS/t1-data.json" --steps "$STEPS" \
  --generate-log "$CACHE/logs/datacmp-generate.json" "${RUN_DIRS[@]}" "${CHECK[@]}" \
  --output "$RESULT"
