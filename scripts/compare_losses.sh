#!/usr/bin/env bash
# Streak-distillation measured, not assumed (issue 9 item 4): from ONE starting drafter and the
# same budget, continue training with each loss (mdm, position-avg, streak, streak-soft), then
# evaluate the start and every result on the same held-out windows: expected accepted length
# (T_d = 1 drafts against the T = 1 verifier), greedy accepted length and the per-position
# acceptance curves (the paper's Figure 2), as JSON + PNG.
#
#   bash scripts/compare_losses.sh [START_CHECKPOINT] [RESULT_JSON]
#   bash scripts/compare_losses.sh --continue LOSS STEPS [START_CHECKPOINT]
#
# --continue resumes that loss's comparison run up to STEPS optimizer steps in all (the default
# drafter's second stage, scripts/train_default_drafter.sh streak), and evaluates nothing;
# SPECDIFF_COMPARE_DATA (default $SPECDIFF_CACHE_DIR/data/greedy) is its --data then (a resumed
# run may append directories: DIR,MORE).
#
# START_CHECKPOINT: a checkpoint of the default drafter's run (default: its latest).
# RESULT_JSON: default out/loss_comparison.json (PNG beside it); the figure the standalone
# drafter's model card quotes is benchmarks/results/standalone/training/loss_comparison.json.
# SPECDIFF_COMPARE_STEPS (default 200) optimizer steps per loss; SPECDIFF_COMPARE_PARALLEL
# (default 2) runs at a time, one torch thread each; SPECDIFF_COMPARE_WINDOWS (default 512)
# held-out windows evaluated. Runs land in $SPECDIFF_CACHE_DIR/runs/.
# The training settings are the default drafter's (scripts/train_default_drafter.sh) except
# the loss, the warm-up (none: the start is trained) and the step count.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${SPECDIFF_VENV:-$ROOT/.venv}/bin"
CACHE="${SPECDIFF_CACHE_DIR:-$HOME/.cache/vllm-specdiff}"
# shared with train_default_drafter.sh: start directory, train and eval settings
source "$ROOT/scripts/compare_common.sh"
STEPS="${SPECDIFF_COMPARE_STEPS:-200}"
PARALLEL="${SPECDIFF_COMPARE_PARALLEL:-2}"
RUN="$CACHE/runs/default-drafter"
CONTINUE=()
if [ "${1:-}" = --continue ]; then
  [ $# -ge 3 ] || { echo "usage: $0 --continue LOSS STEPS [START_CHECKPOINT]" >&2; exit 2; }
  CONTINUE=("$2" "$3")
  shift 3
fi
START="${1:-$(ls -d "$RUN"/checkpoints/step-* | sort | tail -n 1)}"
RESULT="${2:-$ROOT/out/loss_comparison.json}"
LOSSES=(mdm position-avg streak streak-soft)
TAG="from-$(basename "$START")"
START_DIR="$(compare_start_dir "$START")"

train() {  # LOSS [STEPS]
  compare_train "${SPECDIFF_COMPARE_DATA:-$CACHE/data/greedy}" "$START_DIR" "compare-$TAG-$1" \
    "$1" "${2:-$STEPS}"
}
if [ ${#CONTINUE[@]} -gt 0 ]; then
  train "${CONTINUE[@]}"
  exit 0
fi
at_budget() {  # LOSS -> its checkpoint at the compared budget
  compare_at_step "compare-$TAG-$1" "$STEPS"
}
for loss in "${LOSSES[@]}"; do
  [ -d "$(at_budget "$loss")" ] && continue  # trained already (maybe continued past it since)
  train "$loss" &
  compare_wait_slot "$PARALLEL"
done
wait

CANDIDATES=(--candidate "start=$START_DIR")
for loss in "${LOSSES[@]}"; do CANDIDATES+=(--candidate "$loss=$(at_budget "$loss")"); done
compare_eval "$CACHE/data/greedy" "$RESULT" "${SPECDIFF_COMPARE_WINDOWS:-512}" \
  "${CANDIDATES[@]}"
