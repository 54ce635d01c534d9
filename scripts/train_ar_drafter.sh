#!/usr/bin/env bash
# The autoregressive baseline drafter for vLLM's own `draft_model` method (the bench's
# comparison), made like the default drafter (scripts/train_default_drafter.sh): the verifier's
# first 4 layers, the same frozen parts (embedding = the tied LM head, layer 0) and trained parts
# (layers 1-3 + final norm), the same greedy verifier data, windows, batch, learning rate and,
# by default, as many optimizer steps as the shipped default drafter had. The difference is the
# objective: next-token cross-entropy of a plain causal LM (teacher forcing on the verifier's
# tokens) instead of the diffusion drafter's mask block. Resumable, at low priority.
#
#   bash scripts/train_ar_drafter.sh            # train, then export
#   bash scripts/train_ar_drafter.sh STAGE      # one stage: train|export
# `export` writes a standard transformers LlamaForCausalLM directory (num_hidden_layers=4, the
# verifier's tokenizer files) to $SPECDIFF_CACHE_DIR/drafters/ar-drafter, for
#   --speculative-config '{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}'
#
# SPECDIFF_AR_EXPORT: the checkpoint directory to export (default: the run's latest), e.g. the
# best held-out one when a later step got worse.
# Needs the data of the default recipe: bash scripts/train_default_drafter.sh generate
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${SPECDIFF_VENV:-$ROOT/.venv}/bin"
CACHE="${SPECDIFF_CACHE_DIR:-$HOME/.cache/vllm-specdiff}"
NICE="nice -n ${SPECDIFF_NICE:-19}"
RUN="$CACHE/runs/ar-drafter"
OUT="$CACHE/drafters/ar-drafter"
DATA="$CACHE/data/greedy"
# The shipped default drafter's step: the same training budget in optimizer steps.
SHIPPED_STEP="$("$BIN/python" -c 'import json, sys
curve = json.load(open(sys.argv[1]))["curve"]
print(curve[-1]["step"])' "$ROOT/vllm_specdiff/assets/default_drafter/learning_curve.json")"
STEPS="${SPECDIFF_TRAIN_STEPS:-$SHIPPED_STEP}"
V="$("$BIN/vllm-specdiff" models | sed -n 's/^verifier: //p')"

STAGE="${1:-all}"
case "$STAGE" in all|train|export) ;; *)
  echo "usage: $0 [all|train|export]" >&2; exit 2 ;; esac
want() { [ "$STAGE" = all ] || [ "$STAGE" = "$1" ]; }

if want train; then
  if [ ! -f "$DATA/meta.json" ]; then
    echo "$0: no data in $DATA: run bash scripts/train_default_drafter.sh generate first" >&2
    exit 2
  fi
  # SPECDIFF_TRAIN_THREADS=1 helps on a machine busy with other jobs (no OpenMP barrier stalls).
  env ${SPECDIFF_TRAIN_THREADS:+OMP_NUM_THREADS=$SPECDIFF_TRAIN_THREADS} \
    $NICE "$BIN/specdiff-distill" train --data "$DATA" --output "$RUN" \
    --objective ar --init-from "$V" --num-layers 4 --finetune full \
    --freeze-params 'embed_tokens,layers\.0\.,lm_head' --loss mdm --gamma 8 --windows-per-seq 16 \
    --batch-size 4 --steps "$STEPS" --lr 3e-4 --warmup-steps 50 --schedule constant \
    --max-length 640 --heldout-fraction 0.05 --save-every 50 --eval-every 50 --eval-windows 256
fi

if want export; then
  $NICE "$BIN/specdiff-distill" export --run "${SPECDIFF_AR_EXPORT:-$RUN}" --verifier "$V" --output "$OUT"
fi
exit 0
