# Shared plumbing of the loss comparison (compare_losses.sh) and scripts/train_default_drafter.sh:
# sourced, not run. One place for the training settings every compared run shares (the default
# drafter's, from scripts/train_default_drafter.sh, except the loss, the warm-up and the step
# count), so the compared runs differ only in what they compare.
#
# Needs BIN and CACHE set; NICE defaults to nice 19.
NICE="${NICE:-nice -n ${SPECDIFF_NICE:-19}}"
V="$("$BIN/vllm-specdiff" models | sed -n 's/^verifier: //p')"

compare_start_dir() {  # CHECKPOINT -> prints the checkpoint's full drafter directory (built once)
  local start="$1" dir="$CACHE/drafters/compare-from-$(basename "$1")"
  # (`|| return`: errexit does not reach into the command substitution that calls this)
  if [ ! -f "$dir/model.safetensors" ]; then
    "$BIN/specdiff-distill" export --run "$start" --verifier "$V" --output "$dir.slim" >&2 \
      || return 1
    "$BIN/python" -c 'import sys
from vllm_specdiff.drafter.slim import expand_checkpoint
expand_checkpoint(sys.argv[1], sys.argv[2], sys.argv[3])' "$dir.slim" "$V" "$dir" >&2 || return 1
  fi
  # the start's curve: an export of a run from the start continues it (one curve from scratch)
  cp -n "$dir.slim/learning_curve.json" "$dir/" || return 1
  echo "$dir"
}

compare_train() {  # DATA_DIR START_DIR RUN_NAME LOSS STEPS: one run, one torch thread, logged
  mkdir -p "$CACHE/logs"
  env OMP_NUM_THREADS=1 $NICE "$BIN/specdiff-distill" train --data "$1" \
    --output "$CACHE/runs/$3" --drafter "$2" --finetune full \
    --freeze-params 'embed_tokens,layers\.0\.,lm_head' --loss "$4" --gamma 8 \
    --windows-per-seq 16 --batch-size 4 --steps "$5" --lr 3e-4 --warmup-steps 0 \
    --schedule constant --max-length 640 --heldout-fraction 0.05 --save-every 50 \
    --eval-every 50 --eval-windows 256 >> "$CACHE/logs/$3.log" 2>&1
}

compare_at_step() {  # RUN_NAME STEPS -> that run's checkpoint at STEPS
  echo "$CACHE/runs/$1/checkpoints/step-$(printf %07d "$2")"
}

compare_wait_slot() {  # PARALLEL: block while that many background jobs run
  while [ "$(jobs -rp | wc -l)" -ge "$1" ]; do sleep 5; done
}

compare_eval() {  # DATA_DIR RESULT_JSON WINDOWS --candidate NAME=DIR ...: held-out eval, JSON+PNG
  local data="$1" result="$2" windows="$3"
  shift 3
  mkdir -p "$(dirname "$result")"
  env OMP_NUM_THREADS=1 $NICE "$BIN/specdiff-distill" eval --data "$data" --verifier "$V" "$@" \
    --gamma 8 --max-windows "$windows" --heldout-fraction 0.05 --output "$result"
}
