#!/usr/bin/env bash
# The recipe of the shipped default drafter (SmolLM2-135M-Instruct), stage by stage. Every
# stage is resumable: rerun the script and it continues where it stopped (shards that exist
# are skipped, training resumes from its latest checkpoint). Runs at low priority.
#
#   bash scripts/train_default_drafter.sh            # all stages: corpus, generate, train
#   bash scripts/train_default_drafter.sh STAGE      # corpus|generate|train|streak|continue|export
# `train` is stage 1 (masked cross-entropy, stopped at step 850 for the shipped drafter);
# `streak` is stage 2: the streak run of scripts/compare_losses.sh (from stage 1's step 850) on
# the general corpus's data up to step STAGE2_SWITCH, then continued in the same run to
# SPECDIFF_STREAK_STEPS (default 40000) steps with the completion corpus's data appended
# (HumanEval-like "complete this function" requests, which the general corpus has few of).
# `continue` is stage 2 again from the shipped drafter, for a machine that lost stage 2's
# checkpoints (the cache is not kept between machines): the same settings and data as stage 2
# after STAGE2_SWITCH, a fresh optimizer, to SPECDIFF_STREAK_STEPS steps of its own; its curve
# continues the shipped one. It is not part of `all` (a fresh machine's `all` is the recipe
# from scratch).
# `export` ships the latest checkpoint of the `continue` run if there is one, else of stage 2,
# into the package (vllm_specdiff/assets/default_drafter).
# `generate` and `train` may run side by side: a (re)started training run reads every shard
# that exists by then.
#
# Work lands in $SPECDIFF_CACHE_DIR (default ~/.cache/vllm-specdiff): corpus/, data/, runs/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${SPECDIFF_VENV:-$ROOT/.venv}/bin"
CACHE="${SPECDIFF_CACHE_DIR:-$HOME/.cache/vllm-specdiff}"
NICE="nice -n ${SPECDIFF_NICE:-19}"
RUN="$CACHE/runs/default-drafter"
STEPS="${SPECDIFF_TRAIN_STEPS:-850}"  # stage 1 (stage 2 continues from its step 850)
V="$("$BIN/vllm-specdiff" models | sed -n 's/^verifier: //p')"
# vLLM's CPU speed settings (tcmalloc + Intel OpenMP preloaded, one thread per core)
SPEED_ENV="$("$BIN/python" -c 'import shlex
from vllm_specdiff.plugin.cpu_env import recommended_env
print(" ".join(f"{k}={shlex.quote(v)}" for k, v in recommended_env().items()))')"

STAGE="${1:-all}"
case "$STAGE" in all|corpus|generate|train|streak|continue|export) ;; *)
  echo "usage: $0 [all|corpus|generate|train|streak|continue|export]" >&2; exit 2 ;; esac
STAGE1_END="$RUN/checkpoints/step-0000850"
STREAK_RUN="$CACHE/runs/compare-from-step-0000850-streak"
CONTINUE_RUN="$CACHE/runs/default-drafter-continued"
want() { [ "$STAGE" = all ] || [ "$STAGE" = "$1" ]; }

if [ "$STAGE" = export ]; then
  EXPORT_RUN="$STREAK_RUN"
  [ -d "$CONTINUE_RUN/checkpoints" ] && EXPORT_RUN="$CONTINUE_RUN"
  "$BIN/specdiff-distill" export --run "$EXPORT_RUN" --verifier "$V" \
    --output "$ROOT/vllm_specdiff/assets/default_drafter" --draft-vocab-size 8192
fi

if want corpus && [ ! -f "$CACHE/corpus/prompts.jsonl" ]; then
  $NICE "$BIN/specdiff-distill" corpus \
    --output "$CACHE/corpus/prompts.jsonl" --heldout-output "$CACHE/corpus/chat_heldout.jsonl" \
    --num-code 3000 --num-chat 3000 --num-heldout 60 --seed 0
fi
if want corpus && [ ! -f "$CACHE/corpus/complete.jsonl" ]; then
  $NICE "$BIN/specdiff-distill" corpus --output "$CACHE/corpus/complete.jsonl" \
    --num-code 1024 --num-chat 0 --code-tasks complete --seed 1
fi

# Greedy verifier continuations with the top-8 log-probs (soft targets), vLLM batch inference:
# the completion corpus first (small), then the general one.
generate() {  # CORPUS DATA_DIR
  env $SPEED_ENV VLLM_ENABLE_V1_MULTIPROCESSING=0 $NICE "$BIN/specdiff-distill" generate \
    --verifier "$V" --prompts "$CACHE/corpus/$1.jsonl" --output "$CACHE/data/$2" \
    --num-samples 1 --temperature 0 --max-new-tokens 128 --top-logprobs 8 --chunk-size 64 \
    --backend vllm ${SPECDIFF_GENERATE_ARGS:-}
}
if want generate; then
  generate complete greedy-complete
  generate prompts greedy
fi

# 4 layers from the verifier; the embedding, layer 0 and the LM head (the verifier's tied
# embedding, as EAGLE reuses the verifier's head) stay frozen and are rebuilt from the verifier
# when shipped; layers 1-3 and the final norm are trained. The reduced head (rows of the frozen
# one) is chosen at export from the data, so it needs no retraining.
# SPECDIFF_TRAIN_THREADS=1 helps on a machine busy with other jobs (no OpenMP barrier stalls).
want train && env ${SPECDIFF_TRAIN_THREADS:+OMP_NUM_THREADS=$SPECDIFF_TRAIN_THREADS} \
  $NICE "$BIN/specdiff-distill" train --data "$CACHE/data/greedy" --output "$RUN" \
  --init-from "$V" --num-layers 4 --finetune full \
  --freeze-params 'embed_tokens,layers\.0\.,lm_head' --loss mdm --gamma 8 --windows-per-seq 16 \
  --batch-size 4 --steps "$STEPS" --lr 3e-4 --warmup-steps 50 --schedule constant \
  --max-length 640 --heldout-fraction 0.05 --save-every 50 --eval-every 50 --eval-windows 256
# Stage 2: the streak loss from stage 1's step 850 (the loss comparison's winner); from step
# STAGE2_SWITCH on, the same run (resumed) also trains on the completion data.
STAGE2_SWITCH=2500
if want streak; then
  last="$(ls -d "$STREAK_RUN"/checkpoints/step-* 2>/dev/null | sort | tail -n 1)"
  if [ -z "$last" ] || [ "$((10#${last##*step-}))" -lt "$STAGE2_SWITCH" ]; then
    bash "$ROOT/scripts/compare_losses.sh" --continue streak "$STAGE2_SWITCH" "$STAGE1_END"
  fi
  SPECDIFF_COMPARE_DATA="$CACHE/data/greedy,$CACHE/data/greedy-complete" \
    bash "$ROOT/scripts/compare_losses.sh" --continue streak "${SPECDIFF_STREAK_STEPS:-40000}" \
    "$STAGE1_END"
fi
if [ "$STAGE" = continue ]; then
  # the shipped drafter as `vllm-specdiff models` assembles it, with the full (frozen) head:
  # without its d2t table, as stage 2 trained; export picks the reduced head again
  START="$CACHE/drafters/shipped-start"
  if [ ! -f "$START/model.safetensors" ]; then
    D="$("$BIN/vllm-specdiff" models | sed -n 's/^standalone drafter: //p')"
    mkdir -p "$START"
    cp "$D"/* "$START"/
    rm -f "$START/d2t.safetensors"
    cp "$ROOT/vllm_specdiff/assets/default_drafter/learning_curve.json" "$START"/
  fi
  source "$ROOT/scripts/compare_common.sh"
  compare_train "$CACHE/data/greedy,$CACHE/data/greedy-complete" "$START" \
    "$(basename "$CONTINUE_RUN")" streak "${SPECDIFF_STREAK_STEPS:-40000}"
fi
exit 0
